//! The writer and the loader agree: what `fixture` generates in torch layout is what `MlaConfig` and
//! `LayerWeights` read back — bit for bit for F32, and equal to quantize→dequantize of the same values
//! for the other types. In particular the per-head kv_b split [k_nope | v] and the k_b transpose must
//! come back as `W_UK[h] = kv_b_proj[h·(P+Dv) .. +P]` and `W_UV[h] = kv_b_proj[h·(P+Dv)+P ..]`, for both
//! the split and the legacy unsplit layouts.

use approx::abs_diff_eq;
use mla_diff::fixture::{Options, Preset, Spec};
use mla_diff::gguf::{GgmlType, GgufFile};
use mla_diff::model::{Arch, KvBLayout, LayerWeights, MlaConfig, QProj, RopePairing};
use ndarray::Array3;

fn spec(preset: Preset, quant: &str, f: impl FnOnce(&mut Options)) -> Spec {
    let mut o = Options {
        preset,
        layers: Some(2),
        quant: GgmlType::from_name(quant).unwrap(),
        seed: 7,
        legacy_kv_b: false,
        hidden: None,
        heads: None,
        q_lora_rank: None,
        vocab: Some(64),
    };
    f(&mut o);
    Spec::from_options(&o).unwrap()
}

/// Small files that keep the real head dims.
fn small(o: &mut Options) {
    o.hidden = Some(256);
    o.heads = Some(2);
    if o.preset != Preset::DeepseekV2Lite {
        o.q_lora_rank = Some(256);
    }
}

fn write(s: &Spec) -> (tempfile::TempDir, GgufFile) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("f.gguf");
    mla_diff::fixture::write(s, &p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    (d, f)
}

/// What a reader must see for `name`: the generated values after the file's encoding.
fn stored(s: &Spec, f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f.tensor(name).unwrap();
    let ty = match t.ty {
        mla_diff::gguf::TensorType::Known(t) => t,
        other => panic!("{other}"),
    };
    let v = s.torch_values(name).unwrap();
    if ty.name == "F32" {
        return v;
    }
    let bytes = mla_diff::gguf::write::quantize(&v, t.ne[0] as usize, ty).unwrap();
    decode(&bytes, ty, v.len())
}

/// Independent decoding of a whole tensor (one candle call, not the loader's chunked path).
fn decode(bytes: &[u8], ty: GgmlType, n: usize) -> Vec<f32> {
    match ty.name {
        "F16" => bytes
            .chunks(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        "BF16" => bytes
            .chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => {
            use candle_core::quantized::{QStorage, QTensor};
            let dev = candle_core::Device::Cpu;
            let st = QStorage::from_data(
                std::borrow::Cow::Borrowed(bytes),
                &dev,
                ty.candle().unwrap(),
            )
            .unwrap();
            QTensor::new(st, (n,))
                .unwrap()
                .dequantize(&dev)
                .unwrap()
                .to_vec1()
                .unwrap()
        }
    }
}

fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    let bad = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(bad.is_none(), "{what}: first difference at {bad:?}");
}

/// Relative RMS error of `got` against `want`.
fn rel_rms(got: &[f32], want: &[f32]) -> f64 {
    let (mut e, mut n) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        e += (*g as f64 - *w as f64).powi(2);
        n += (*w as f64).powi(2);
    }
    (e / n).sqrt()
}

/// `W_UK [H, P, Lkv]` and `W_UV [H, Dv, Lkv]` cut straight out of the HF kv_b_proj `[H·(P+Dv), Lkv]`.
fn uk_uv_from_kv_b(s: &Spec, kv_b: &[f32]) -> (Array3<f32>, Array3<f32>) {
    let (h, p, dv, l) = (s.n_head, s.qk_nope, s.v_head_dim, s.kv_lora_rank);
    let kv = Array3::from_shape_vec((h, p + dv, l), kv_b.to_vec()).unwrap();
    (
        kv.slice(ndarray::s![.., ..p, ..]).to_owned(),
        kv.slice(ndarray::s![.., p.., ..]).to_owned(),
    )
}

fn flat<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>) -> Vec<f32> {
    a.as_standard_layout().iter().copied().collect()
}

/// Every weight of every layer equals what the file should hold; kv_b against the HF kv_b_proj.
fn check_layers(s: &Spec, f: &GgufFile, cfg: &MlaConfig) {
    for layer in 0..s.layers {
        let w = LayerWeights::load(f, cfg, layer).unwrap();
        let n = |t: &str| format!("blk.{layer}.{t}.weight");
        same_bits(
            w.attn_norm.as_slice().unwrap(),
            &stored(s, f, &n("attn_norm")),
            "attn_norm",
        );
        match &w.q {
            QProj::Lora { a, a_norm, b } => {
                same_bits(&flat(a), &stored(s, f, &n("attn_q_a")), "q_a");
                same_bits(
                    &flat(a_norm),
                    &stored(s, f, &n("attn_q_a_norm")),
                    "q_a_norm",
                );
                same_bits(&flat(b), &stored(s, f, &n("attn_q_b")), "q_b");
            }
            QProj::Plain { q } => same_bits(&flat(q), &stored(s, f, &n("attn_q")), "q"),
        }
        same_bits(&flat(&w.kv_a), &stored(s, f, &n("attn_kv_a_mqa")), "kv_a");
        same_bits(
            &flat(&w.kv_a_norm),
            &stored(s, f, &n("attn_kv_a_norm")),
            "kv_a_norm",
        );
        same_bits(&flat(&w.o), &stored(s, f, &n("attn_output")), "o");

        // The decompression, compared with the HF weight it came from.
        let (uk, uv) = uk_uv_from_kv_b(s, &s.kv_b_proj(layer));
        match w.kv_b_layout {
            KvBLayout::Split => {
                // attn_k_b holds torch [H, Lkv, P]: transpose what the file holds back to [H, P, Lkv].
                let kb = stored(s, f, &n("attn_k_b"));
                let kb = Array3::from_shape_vec((s.n_head, s.kv_lora_rank, s.qk_nope), kb).unwrap();
                let kb = flat(&kb.permuted_axes([0, 2, 1]));
                same_bits(&flat(&w.w_uk), &kb, "w_uk");
                same_bits(&flat(&w.w_uv), &stored(s, f, &n("attn_v_b")), "w_uv");
            }
            KvBLayout::Unsplit => {
                let kv = stored(s, f, &n("attn_kv_b"));
                let (suk, suv) = uk_uv_from_kv_b(s, &kv);
                same_bits(&flat(&w.w_uk), &flat(&suk), "w_uk");
                same_bits(&flat(&w.w_uv), &flat(&suv), "w_uv");
            }
        }
        // Bounded by the type's quantization error: a transposed or mis-split tensor would be ~1.4.
        let tol = match s.quant.name {
            "F32" => 0.0,
            "F16" => 1e-3,
            "BF16" => 5e-3,
            "Q8_0" => 1e-2,
            "Q6_K" => 3e-2,
            "Q5_K" | "Q5_0" => 6e-2,
            _ => 0.12,
        };
        for (what, got, want) in [("w_uk", &w.w_uk, &uk), ("w_uv", &w.w_uv, &uv)] {
            let e = rel_rms(&flat(got), &flat(want));
            assert!(
                e <= tol,
                "layer {layer} {what}: relative RMS error {e} > {tol}"
            );
        }
    }
}

#[test]
fn deepseek_v3_f32_split_is_bit_exact() {
    let s = spec(Preset::DeepseekV3, "F32", small);
    let (_d, f) = write(&s);
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    assert_eq!(cfg.arch, Arch::Deepseek2);
    assert_eq!(
        (cfg.n_layer, cfg.hidden, cfg.n_head, cfg.n_head_kv),
        (2, 256, 2, 1)
    );
    assert_eq!(cfg.q_lora_rank, Some(256));
    assert_eq!(
        (cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_rope, cfg.v_head_dim),
        (512, 128, 64, 128)
    );
    assert!(cfg.mla_keys);
    let y = cfg.rope.yarn.as_ref().unwrap();
    assert_eq!(
        (y.factor, y.original_context, y.mscale_all_dim),
        (40.0, 4096, 1.0)
    );
    assert_eq!(format!("{:.6}", cfg.softmax_scale), "0.135234");
    assert_eq!(cfg.vocab_size, Some(64));
    check_layers(&s, &f, &cfg);
}

#[test]
fn legacy_kv_b_loads_the_same_weights_as_split() {
    let split = spec(Preset::DeepseekV3, "F32", small);
    let legacy = spec(Preset::DeepseekV3, "F32", |o| {
        small(o);
        o.legacy_kv_b = true;
    });
    let (_a, fs) = write(&split);
    let (_b, fl) = write(&legacy);
    let (cs, cl) = (
        MlaConfig::from_gguf(&fs).unwrap(),
        MlaConfig::from_gguf(&fl).unwrap(),
    );
    assert!(!cl.mla_keys);
    assert_eq!(cl.n_head_kv, 2);
    assert_eq!((cl.qk_nope, cl.qk_rope, cl.v_head_dim), (128, 64, 128));
    assert_eq!(cs.softmax_scale, cl.softmax_scale);
    check_layers(&legacy, &fl, &cl);
    for layer in 0..2 {
        let (ws, wl) = (
            LayerWeights::load(&fs, &cs, layer).unwrap(),
            LayerWeights::load(&fl, &cl, layer).unwrap(),
        );
        assert_eq!(
            (ws.kv_b_layout, wl.kv_b_layout),
            (KvBLayout::Split, KvBLayout::Unsplit)
        );
        same_bits(&flat(&ws.w_uk), &flat(&wl.w_uk), "w_uk split vs legacy");
        same_bits(&flat(&ws.w_uv), &flat(&wl.w_uv), "w_uv split vs legacy");
        same_bits(&flat(&ws.o), &flat(&wl.o), "o split vs legacy");
    }
}

#[test]
fn no_q_lora_v2_lite() {
    let s = spec(Preset::DeepseekV2Lite, "F32", small);
    let (_d, f) = write(&s);
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    assert_eq!(cfg.q_lora_rank, None);
    assert!(f.get("deepseek2.attention.q_lora_rank").is_none());
    assert_eq!(format!("{:.6}", cfg.softmax_scale), "0.114721");
    check_layers(&s, &f, &cfg);
    assert!(matches!(
        LayerWeights::load(&f, &cfg, 0).unwrap().q,
        QProj::Plain { .. }
    ));
}

#[test]
fn minicpm3_unsplit_neox_longrope() {
    let s = spec(Preset::Minicpm3, "F32", |o| {
        o.hidden = Some(256);
        o.heads = Some(4);
        o.q_lora_rank = Some(128);
    });
    let (_d, f) = write(&s);
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    assert_eq!(cfg.arch, Arch::Minicpm3);
    assert_eq!(cfg.rope.pairing, RopePairing::Neox);
    assert_eq!(cfg.n_head_kv, 4);
    assert_eq!(
        (cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_rope, cfg.v_head_dim),
        (256, 64, 32, 64)
    );
    assert_eq!(
        cfg.rope.freq_factors_long.as_deref(),
        Some("rope_factors_long.weight")
    );
    assert_eq!(
        cfg.rope.freq_factors_short.as_deref(),
        Some("rope_factors_short.weight")
    );
    for name in ["rope_factors_long.weight", "rope_factors_short.weight"] {
        let got = mla_diff::model::weights::load_freq_factors(&f, name, 16).unwrap();
        same_bits(&got, &s.torch_values(name).unwrap(), name);
        assert!(got.iter().all(|&x| x >= 1.0));
    }
    check_layers(&s, &f, &cfg);
}

#[test]
fn minicpm3_full_size_has_no_value_length_key_like_the_converter() {
    let s = spec(Preset::Minicpm3, "Q8_0", |o| o.layers = Some(1));
    let (_d, f) = write(&s);
    assert!(f.get("minicpm3.attention.value_length").is_none());
    assert!(f.get("minicpm3.rope.freq_base").is_none());
    // llama.cpp's default head size hidden/heads = 2560/40 = 64 = v_head_dim.
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    assert_eq!((cfg.hidden, cfg.n_head, cfg.v_head_dim), (2560, 40, 64));
    assert_eq!(cfg.rope.base, 10000.0);
    check_layers(&s, &f, &cfg);
}

#[test]
fn quantized_types_round_trip() {
    for quant in [
        "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q5_1",
    ] {
        let s = spec(Preset::DeepseekV3, quant, |o| {
            small(o);
            o.layers = Some(1);
        });
        let (_d, f) = write(&s);
        let cfg = MlaConfig::from_gguf(&f).unwrap();
        check_layers(&s, &f, &cfg);
    }
}

#[test]
fn glm5_dims_and_keys() {
    let s = spec(Preset::Glm5, "Q8_0", |o| {
        o.layers = Some(1);
        o.hidden = Some(128);
        o.q_lora_rank = Some(64);
        o.heads = Some(8);
    });
    let (_d, f) = write(&s);
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    assert_eq!(cfg.arch, Arch::GlmDsa);
    assert_eq!((cfg.qk_nope, cfg.qk_rope, cfg.v_head_dim), (192, 64, 256));
    assert!(cfg.rope.yarn.is_none());
    assert_eq!(cfg.softmax_scale, 0.0625);
    assert_eq!(
        f.get("glm-dsa.attention.indexer.head_count")
            .and_then(|v| v.as_u64()),
        Some(32)
    );
    check_layers(&s, &f, &cfg);
}

#[test]
fn weights_have_realistic_structure() {
    let s = spec(Preset::DeepseekV3, "F32", small);
    let norm = s.torch_values("blk.0.attn_norm.weight").unwrap();
    let ones = norm.iter().filter(|&&x| x == 1.0).count();
    assert_eq!(ones, 0, "norm weights are not all ones");
    let big = norm.iter().filter(|&&x| x > 6.0).count();
    assert!(
        (1..=8).contains(&big),
        "a few large attn_norm channels, got {big}"
    );
    // Linear weights ~ N(0, 1/fan_in): q_a has fan_in = hidden = 256.
    let qa = s.torch_values("blk.0.attn_q_a.weight").unwrap();
    let var = qa.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / qa.len() as f64;
    assert!(
        abs_diff_eq!(var * 256.0, 1.0, epsilon = 0.05),
        "q_a variance × fan_in = {}",
        var * 256.0
    );
    // kv_a: a few output channels (rows) far larger than the rest.
    let kv_a = s.torch_values("blk.0.attn_kv_a_mqa.weight").unwrap();
    let rms: Vec<f64> = kv_a
        .chunks(256)
        .map(|r| (r.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / 256.0).sqrt())
        .collect();
    let large = rms.iter().filter(|&&r| r > 4.0 / 16.0).count();
    assert!((2..=8).contains(&large), "large kv_a rows: {large}");
    assert!(
        rms[512..].iter().any(|&r| r > 4.0 / 16.0),
        "one large k_pe channel"
    );
}

#[test]
fn seeds_are_deterministic_and_distinct() {
    let a = spec(Preset::Tiny, "Q4_K", |_| {});
    let b = spec(Preset::Tiny, "Q4_K", |o| o.seed = 8);
    let (_d1, f1) = write(&a);
    let (_d2, f2) = write(&a);
    let (_d3, f3) = write(&b);
    let bytes = |f: &GgufFile| std::fs::read(&f.path).unwrap();
    assert_eq!(bytes(&f1), bytes(&f2));
    assert_ne!(bytes(&f1), bytes(&f3));
}
