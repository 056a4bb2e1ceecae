//! Goldens from implementations no one here wrote (fixtures/golden/, made by make_goldens.py): tiny,
//! randomly initialised Hugging Face transformers models, converted to GGUF by llama.cpp's own
//! `convert_hf_to_gguf.py`, with every layer's attention input and output recorded by transformers in
//! float64. The fp64 reference runs on the converter's file with transformers' inputs and must give
//! transformers' outputs: if it shared a misreading of a convention with the kernels (rope pairing, k_b
//! transpose, YaRN scaling, eps), the diff harness would report zero while both are wrong.
//!
//! The last test checks that `mla-diff fixture` writes what the converter writes for the same config.

use mla_diff::compare::metrics::rel_l2;
use mla_diff::fixture::{self, Preset, Spec, YarnSpec};
use mla_diff::gguf::{GgmlType, GgufFile, TensorType};
use mla_diff::input::{load_npy, LayerInputs};
use mla_diff::model::weights::tensor_names;
use mla_diff::model::{LayerWeights, MlaConfig, RopeFactors, RopePairing};
use mla_diff::rope::{theta, RopeTables};
use mla_diff::schedule::Schedule;
use mla_diff::trace::Stage;
use ndarray::{s, Array2, Array3, Axis};
use serde_json::Value as J;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Goal of issue #7 with f32 weights. transformers rounds RMSNorm, rope and softmax through float32 even
/// in a float64 model, which puts the floor of the agreement near 1e-7 (measured: 0.9–1.5e-7).
const TOL: f64 = 1e-6;

/// A convention error must move the output by far more than the tolerance.
const DETECT: f64 = 100.0 * TOL;

const FAMILIES: [&str; 9] = [
    "deepseek-v3",
    "deepseek-v3-yarn-no-mscale",
    "deepseek-v2-lite",
    "kimi-k2",
    "glm-4.7-flash",
    "glm-5",
    "minicpm3",
    "minicpm3-long",
    "deepseek-v3-legacy-kv-b",
];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden")
}

struct Golden {
    name: &'static str,
    file: GgufFile,
    cfg: MlaConfig,
    factors: Option<RopeFactors>,
    manifest: J,
    x: Array3<f64>,
    /// transformers as it is.
    out: Array3<f64>,
    /// transformers with its q_a/kv_a RMSNorm eps set to rms_norm_eps (only where they differ).
    out_eps_unified: Option<Array3<f64>>,
}

fn per_layer(path: &Path, cfg: &MlaConfig, t: usize) -> Array3<f64> {
    match load_npy(path, cfg.hidden, t).unwrap_or_else(|e| panic!("{}: {e}", path.display())) {
        LayerInputs::PerLayer(a) => {
            assert_eq!(a.dim().0, cfg.n_layer, "{}", path.display());
            a
        }
        LayerInputs::Shared(_) => panic!("{}: expected [layers, T, hidden]", path.display()),
    }
}

fn load(name: &'static str) -> Golden {
    let d = dir();
    let file = GgufFile::open(d.join(format!("{name}.gguf"))).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let factors = RopeFactors::load(&file, &cfg).unwrap();
    let manifest: J =
        serde_json::from_str(&std::fs::read_to_string(d.join(format!("{name}.json"))).unwrap())
            .unwrap();
    let t = manifest["tokens"].as_u64().unwrap() as usize;
    let x = per_layer(&d.join(format!("{name}.attn_in.npy")), &cfg, t);
    let out = per_layer(&d.join(format!("{name}.attn_out.npy")), &cfg, t);
    let unified = d.join(format!("{name}.attn_out.eps_unified.npy"));
    let out_eps_unified = unified.exists().then(|| per_layer(&unified, &cfg, t));
    Golden {
        name,
        file,
        cfg,
        factors,
        manifest,
        x,
        out,
        out_eps_unified,
    }
}

impl Golden {
    fn tokens(&self) -> usize {
        self.x.dim().1
    }
    fn hf(&self, key: &str) -> &J {
        &self.manifest["hf"][key]
    }
    /// The reference's attention output of every layer, with `cfg` (possibly altered), weights as loaded
    /// (possibly altered by `edit`) and positions 0..T-1, prefill only.
    fn run_with(
        &self,
        cfg: &MlaConfig,
        factors: Option<&RopeFactors>,
        edit: &dyn Fn(&mut LayerWeights),
    ) -> Vec<Array2<f64>> {
        let t = self.tokens();
        let sched = Schedule {
            prompt_len: t,
            chunk: t,
            decode_steps: 0,
            ..Schedule::default()
        };
        let rope = RopeTables::for_run(cfg, factors, 0, t).unwrap();
        (0..cfg.n_layer)
            .map(|l| {
                let mut w = LayerWeights::load(&self.file, cfg, l).unwrap();
                edit(&mut w);
                let x = self.x.index_axis(Axis(0), l).to_owned();
                let tr = mla_diff::reference::run_layer(cfg, &w, &rope, &x, &sched).unwrap();
                let o = tr.get(Stage::AttnOut).unwrap();
                Array2::from_shape_vec((o.shape[0], o.shape[1]), o.data.clone()).unwrap()
            })
            .collect()
    }
    fn run(&self, cfg: &MlaConfig) -> Vec<Array2<f64>> {
        self.run_with(cfg, self.factors.as_ref(), &|_| {})
    }
    /// What transformers gives under llama.cpp's eps convention (one eps for every RMSNorm).
    fn theirs_unified(&self) -> &Array3<f64> {
        self.out_eps_unified.as_ref().unwrap_or(&self.out)
    }
}

/// rel-L2 per layer of `ours` against `theirs`; a non-finite value anywhere is an infinite error.
fn errors(ours: &[Array2<f64>], theirs: &Array3<f64>) -> Vec<f64> {
    ours.iter()
        .enumerate()
        .map(|(l, o)| {
            let r: Vec<f64> = theirs.index_axis(Axis(0), l).iter().copied().collect();
            let o: Vec<f64> = o.iter().copied().collect();
            if r.iter().chain(&o).any(|v| !v.is_finite()) {
                f64::INFINITY
            } else {
                rel_l2(&r, &o)
            }
        })
        .collect()
}

fn fmt(e: &[f64]) -> String {
    e.iter()
        .map(|v| format!("{v:.2e}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn within(e: &[f64], tol: f64) -> bool {
    e.iter().all(|v| *v <= tol)
}

/// The reference on the converter's file reproduces transformers' attention output, every layer, with
/// llama.cpp's eps convention, against transformers with its inner-norm eps set the same way.
#[test]
fn reference_matches_transformers() {
    let mut failures = Vec::new();
    for name in FAMILIES {
        let g = load(name);
        let e = errors(&g.run(&g.cfg), g.theirs_unified());
        println!("{name:27} rel-L2 per layer [{}]", fmt(&e));
        if !within(&e, TOL) {
            failures.push(format!("{name}: [{}] > {TOL:e}", fmt(&e)));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// transformers builds q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says; with
/// `lora_norm_eps` set to that, the reference reproduces transformers as it is. Without it (llama.cpp's
/// reading) the gap is visible, so the goldens do pin the eps.
#[test]
fn reference_matches_transformers_inner_norm_eps() {
    let mut failures = Vec::new();
    let mut seen = 0;
    for name in FAMILIES {
        let g = load(name);
        if g.out_eps_unified.is_none() {
            continue;
        }
        seen += 1;
        let hf_eps = g.hf("q_a_kv_a_norm_eps").as_array().unwrap();
        assert_eq!(hf_eps.len(), 1, "{name}: one eps for both inner norms");
        let mut cfg = g.cfg.clone();
        cfg.lora_norm_eps = hf_eps[0].as_f64().unwrap();
        let same = errors(&g.run(&cfg), &g.out);
        let gap = errors(&g.run(&g.cfg), &g.out);
        println!(
            "{name:27} inner eps {:e}: [{}]; llama.cpp's eps {:e} vs transformers as it is: [{}]",
            cfg.lora_norm_eps,
            fmt(&same),
            g.cfg.lora_norm_eps,
            fmt(&gap)
        );
        if !within(&same, TOL) {
            failures.push(format!("{name}: with HF's inner eps [{}]", fmt(&same)));
        }
        if within(&gap, 5.0 * TOL) {
            failures.push(format!(
                "{name}: the eps convention does not show ([{}])",
                fmt(&gap)
            ));
        }
    }
    assert_eq!(
        seen, 4,
        "glm-4.7-flash, glm-5, minicpm3, minicpm3-long have rms_norm_eps 1e-5"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The config read from the converter's file gives transformers' softmax scale, cos/sin magnitude and
/// rope frequencies (YaRN ramp, LongRoPE factors) for every family.
#[test]
fn scales_and_rope_frequencies_match_transformers() {
    for name in FAMILIES {
        let g = load(name);
        let hf_scale = g.hf("softmax_scale").as_f64().unwrap();
        let hf_attn = g.hf("rope_attention_scaling").as_f64().unwrap();
        // The file keeps 0.1·mscale_all_dim as f32, so the scale agrees to f32 rounding, not exactly.
        let ds = (g.cfg.softmax_scale - hf_scale).abs() / hf_scale;
        let da = (g.cfg.rope.attn_factor - hf_attn).abs() / hf_attn;
        let t = g.tokens();
        let ff = g.factors.as_ref().and_then(|f| f.choose(t));
        let inv: Vec<f64> = g
            .hf("rope_inv_freq_f32")
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(inv.len(), g.cfg.qk_rope / 2, "{name}");
        // HF computes inv_freq in float32 (base^(2i/d) with a float32 exponent): ~1e-7 relative, times ln(base).
        let dinv = inv
            .iter()
            .enumerate()
            .map(|(i, &f)| (theta(&g.cfg.rope, ff, 1.0, i) - f).abs() / f)
            .fold(0.0, f64::max);
        println!(
            "{name:27} softmax scale {:.9} (HF {hf_scale:.9}, rel {ds:.1e}); cos/sin × {:.6} (HF {hf_attn:.6}); inv_freq max rel {dinv:.1e}",
            g.cfg.softmax_scale, g.cfg.rope.attn_factor
        );
        assert!(ds < 1e-7, "{name}: softmax scale");
        assert!(da < 1e-12, "{name}: cos/sin magnitude");
        assert!(dinv < 2e-6, "{name}: rope frequencies");
        assert_eq!(
            g.cfg.rope.pairing,
            if g.cfg.arch == mla_diff::model::Arch::Minicpm3 {
                RopePairing::Neox
            } else {
                RopePairing::Norm
            }
        );
    }
}

/// GLM-4.7-Flash's file, like the real one, ends with the NextN/MTP block the converter appends
/// (`block_count` = trunk + 1, `nextn_predict_layers` = 1, `blk.{trunk}.nextn.*` beside a full attention).
/// transformers' forward runs the trunk only, and so must the reference: the MTP block is not layer `trunk`.
#[test]
fn mtp_block_is_not_a_trunk_layer() {
    let g = load("glm-4.7-flash");
    let key = |k: &str| g.file.get(&format!("deepseek2.{k}")).unwrap().as_u64();
    assert_eq!(key("block_count"), Some(3));
    assert_eq!(key("nextn_predict_layers"), Some(1));
    assert!(g.file.tensor("blk.2.nextn.eh_proj.weight").is_some());
    assert!(g.file.tensor("blk.2.attn_kv_a_mqa.weight").is_some());
    assert_eq!(g.cfg.n_layer, 2);
    assert_eq!(g.x.dim().0, g.cfg.n_layer);
}

/// A misreading to try: its name, the config and rope factors it reads, and its edit of the weights.
type Mutation = (
    &'static str,
    MlaConfig,
    Option<RopeFactors>,
    Box<dyn Fn(&mut LayerWeights)>,
);

/// Each convention error a reader could make moves the output far beyond the tolerance, so a pass above
/// means the conventions are right, not that the goldens are blind to them.
#[test]
fn goldens_detect_convention_errors() {
    let mut failures = Vec::new();
    for name in FAMILIES {
        let g = load(name);
        let theirs = g.theirs_unified();
        let none: &dyn Fn(&mut LayerWeights) = &|_| {};
        let mut cases: Vec<Mutation> = Vec::new();
        let mut cfg = g.cfg.clone();
        cfg.rope.pairing = match cfg.rope.pairing {
            RopePairing::Norm => RopePairing::Neox,
            RopePairing::Neox => RopePairing::Norm,
        };
        cases.push(("other rope pairing", cfg, g.factors.clone(), Box::new(none)));
        // FlashMLA's default: 1/sqrt(latent row) instead of 1/sqrt(qk head dim).
        let mut cfg = g.cfg.clone();
        cfg.softmax_scale = g.cfg.mscale * g.cfg.mscale / (g.cfg.cache_row() as f64).sqrt();
        cases.push((
            "scale 1/sqrt(Lkv+R)",
            cfg,
            g.factors.clone(),
            Box::new(none),
        ));
        if g.cfg.rope.yarn.is_some() {
            let mut cfg = g.cfg.clone();
            cfg.rope.yarn = None;
            cases.push(("rope without YaRN", cfg, g.factors.clone(), Box::new(none)));
            if g.cfg.mscale != 1.0 {
                let mut cfg = g.cfg.clone();
                cfg.softmax_scale = 1.0 / (g.cfg.qk_head_dim() as f64).sqrt();
                cases.push((
                    "softmax without mscale²",
                    cfg,
                    g.factors.clone(),
                    Box::new(none),
                ));
            }
            let betas = g.cfg.rope.yarn.as_ref().map(|y| (y.beta_fast, y.beta_slow));
            if betas != Some((32.0, 1.0)) {
                // A reader that ignores the file's YaRN betas (Kimi-K2: 1/1) and takes DeepSeek's 32/1.
                let mut cfg = g.cfg.clone();
                let y = cfg.rope.yarn.as_mut().unwrap();
                (y.beta_fast, y.beta_slow) = (32.0, 1.0);
                cases.push((
                    "YaRN betas 32/1 (defaults)",
                    cfg,
                    g.factors.clone(),
                    Box::new(none),
                ));
            }
            if g.cfg.rope.attn_factor != 1.0 {
                // This reader's state before the fix: cos/sin at 1 and llama.cpp's get_mscale(f, 1)² in the
                // softmax.
                let mut cfg = g.cfg.clone();
                let m =
                    mla_diff::model::Yarn::get_mscale(cfg.rope.yarn.as_ref().unwrap().factor, 1.0);
                cfg.rope.attn_factor = 1.0;
                cfg.softmax_scale = m * m / (g.cfg.qk_head_dim() as f64).sqrt();
                cases.push((
                    "cos/sin 1, softmax mscale²",
                    cfg,
                    g.factors.clone(),
                    Box::new(none),
                ));
                let mut cfg = g.cfg.clone();
                cfg.softmax_scale = m * m / (g.cfg.qk_head_dim() as f64).sqrt();
                cases.push(("llama.cpp kq_scale", cfg, g.factors.clone(), Box::new(none)));
            }
        }
        if g.cfg.rope.base != 10000.0 {
            let mut cfg = g.cfg.clone();
            cfg.rope.base = 10000.0;
            cases.push(("rope base 10000", cfg, g.factors.clone(), Box::new(none)));
        }
        if let Some(f) = &g.factors {
            let swapped = RopeFactors {
                short: f.long.clone(),
                long: f.short.clone(),
                ..f.clone()
            };
            cases.push((
                "long/short factors swapped",
                g.cfg.clone(),
                Some(swapped),
                Box::new(none),
            ));
            cases.push(("no rope factors", g.cfg.clone(), None, Box::new(none)));
        }
        let (h, p, lkv, dv) = (
            g.cfg.n_head,
            g.cfg.qk_nope,
            g.cfg.kv_lora_rank,
            g.cfg.v_head_dim,
        );
        match LayerWeights::load(&g.file, &g.cfg, 0).unwrap().kv_b_layout {
            mla_diff::model::KvBLayout::Split => {
                // A loader that forgets the converter's transpose of attn_k_b (same bytes, read as [H, P, Lkv]).
                cases.push((
                    "attn_k_b not transposed",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(move |w: &mut LayerWeights| {
                        let raw = w
                            .w_uk
                            .clone()
                            .permuted_axes([0, 2, 1])
                            .as_standard_layout()
                            .to_owned();
                        w.w_uk = raw.into_shape_with_order((h, p, lkv)).unwrap();
                    }),
                ));
            }
            mla_diff::model::KvBLayout::Unsplit if p == dv => {
                // kv_b heads read as [v | k_nope].
                cases.push((
                    "kv_b split [v | k_nope]",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(|w: &mut LayerWeights| std::mem::swap(&mut w.w_uk, &mut w.w_uv)),
                ));
            }
            mla_diff::model::KvBLayout::Unsplit => {
                // The same bytes (attn_kv_b rows, torch [H·(P+Dv), Lkv]) cut the wrong way: each head
                // as [v | k_nope], or the whole matrix as [k_nope of every head | v of every head].
                cases.push((
                    "kv_b heads [v | k_nope]",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(move |w: &mut LayerWeights| {
                        let kv_b = unsplit_rows(w);
                        let heads = kv_b.into_shape_with_order((h, p + dv, lkv)).unwrap();
                        w.w_uv = heads.slice(s![.., ..dv, ..]).to_owned();
                        w.w_uk = heads.slice(s![.., dv.., ..]).to_owned();
                    }),
                ));
                cases.push((
                    "kv_b [all k_nope | all v]",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(move |w: &mut LayerWeights| {
                        let kv_b = unsplit_rows(w);
                        w.w_uk = kv_b
                            .slice(s![..h * p, ..])
                            .to_owned()
                            .into_shape_with_order((h, p, lkv))
                            .unwrap();
                        w.w_uv = kv_b
                            .slice(s![h * p.., ..])
                            .to_owned()
                            .into_shape_with_order((h, dv, lkv))
                            .unwrap();
                    }),
                ));
            }
        }
        // kv_a output rows read as [k_pe | latent].
        cases.push((
            "kv_a rows [k_pe | latent]",
            g.cfg.clone(),
            g.factors.clone(),
            Box::new(move |w: &mut LayerWeights| {
                let rolled = ndarray::concatenate(
                    Axis(0),
                    &[w.kv_a.slice(s![lkv.., ..]), w.kv_a.slice(s![..lkv, ..])],
                )
                .unwrap();
                w.kv_a = rolled;
            }),
        ));
        for (what, cfg, factors, edit) in &cases {
            let e = errors(&g.run_with(cfg, factors.as_ref(), edit.as_ref()), theirs);
            let min = e.iter().copied().fold(f64::INFINITY, f64::min);
            println!("{name:27} {what:28} rel-L2 [{}]", fmt(&e));
            if min.is_nan() || min <= DETECT {
                failures.push(format!("{name}: {what} gives only [{}]", fmt(&e)));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The rows of an unsplit `attn_kv_b` (torch `[H·(P+Dv), Lkv]`, each head `[k_nope | v]`), rebuilt from
/// the loaded `W_UK`/`W_UV`: the bytes a misreading would cut differently.
fn unsplit_rows(w: &LayerWeights) -> Array2<f32> {
    let (h, p, lkv) = w.w_uk.dim();
    let dv = w.w_uv.dim().1;
    let heads = ndarray::concatenate(Axis(1), &[w.w_uk.view(), w.w_uv.view()]).unwrap();
    heads
        .as_standard_layout()
        .to_owned()
        .into_shape_with_order((h * (p + dv), lkv))
        .unwrap()
}

/// The converter's attn_k_b / attn_v_b, read by our loader, are HF's kv_b_proj split per head into
/// [k_nope | v] (k_b transposed back), value for value: the decompression of a latent equals
/// kv_b_proj · latent viewed per head.
#[test]
fn converter_kv_b_is_hf_kv_b_proj() {
    for name in FAMILIES {
        let g = load(name);
        let kv_b: Array2<f32> =
            ndarray_npy::read_npy(dir().join(format!("{name}.kv_b_proj.npy"))).unwrap();
        let w = LayerWeights::load(&g.file, &g.cfg, 0).unwrap();
        check_decompression(name, &g.cfg, &w, &kv_b);
    }
}

/// `W_UK[h]`/`W_UV[h]` against the HF weight `kv_b [H·(P+Dv), Lkv]`: bit-exact rows, and the decompression
/// of a latent computed both ways.
fn check_decompression(what: &str, cfg: &MlaConfig, w: &LayerWeights, kv_b: &Array2<f32>) {
    let (h, p, dv, lkv) = (cfg.n_head, cfg.qk_nope, cfg.v_head_dim, cfg.kv_lora_rank);
    assert_eq!(kv_b.dim(), (h * (p + dv), lkv), "{what}: kv_b_proj shape");
    for hh in 0..h {
        let head = kv_b.slice(s![hh * (p + dv)..(hh + 1) * (p + dv), ..]);
        assert_eq!(
            w.w_uk.slice(s![hh, .., ..]),
            head.slice(s![..p, ..]),
            "{what}: head {hh} k_nope rows"
        );
        assert_eq!(
            w.w_uv.slice(s![hh, .., ..]),
            head.slice(s![p.., ..]),
            "{what}: head {hh} v rows"
        );
    }
    let latent = mla_diff::input::random_hidden(lkv, 3, 5);
    let hf = latent.dot(&kv_b.mapv(f64::from).t()); // [3, H·(P+Dv)]
    let (k, v) = mla_diff::reference::mha::decompress(cfg, w, latent.view());
    for t in 0..3 {
        for hh in 0..h {
            let row = hf.slice(s![t, hh * (p + dv)..(hh + 1) * (p + dv)]);
            assert_eq!(k.slice(s![t, hh, ..]), row.slice(s![..p]), "{what}: k_nope");
            assert_eq!(v.slice(s![t, hh, ..]), row.slice(s![p..]), "{what}: v");
        }
    }
}

/// The fixture spec with the golden's HF config.
fn spec_for(g: &Golden) -> Spec {
    let c = &g.manifest["hf_config"];
    let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{}: {k}", g.name)) as usize;
    let rp = &c["rope_parameters"];
    let preset = match g.name {
        "deepseek-v3" | "deepseek-v3-yarn-no-mscale" | "deepseek-v3-legacy-kv-b" => {
            Preset::DeepseekV3
        }
        "kimi-k2" => Preset::KimiK2,
        "glm-4.7-flash" => Preset::Glm47Flash,
        "deepseek-v2-lite" => Preset::DeepseekV2Lite,
        "glm-5" => Preset::Glm5,
        "minicpm3" | "minicpm3-long" => Preset::Minicpm3,
        other => panic!("no preset for {other}"),
    };
    let mut s = preset.spec();
    s.layers = u("num_hidden_layers");
    s.hidden = u("hidden_size");
    s.n_head = u("num_attention_heads");
    s.q_lora_rank = c["q_lora_rank"].as_u64().map(|v| v as usize);
    s.kv_lora_rank = u("kv_lora_rank");
    s.qk_nope = u("qk_nope_head_dim");
    s.qk_rope = u("qk_rope_head_dim");
    s.v_head_dim = u("v_head_dim");
    s.rms_eps = c["rms_norm_eps"].as_f64().unwrap() as f32;
    s.context_length = u("max_position_embeddings") as u32;
    s.vocab = u("vocab_size");
    // MiniCPM3's converter writes no rope.freq_base (the preset's None); the others write rope_theta.
    if s.rope_base.is_some() {
        s.rope_base = Some(rp["rope_theta"].as_f64().unwrap() as f32);
    }
    s.yarn = (rp["rope_type"] == "yarn").then(|| YarnSpec {
        factor: rp["factor"].as_f64().unwrap() as f32,
        original_context: rp["original_max_position_embeddings"].as_u64().unwrap() as u32,
        mscale_all_dim: rp["mscale_all_dim"].as_f64(),
        beta_fast: rp["beta_fast"].as_f64().map(|v| v as f32),
        beta_slow: rp["beta_slow"].as_f64().map(|v| v as f32),
    });
    if s.indexer.is_some() {
        s.indexer = Some((
            u("index_n_heads") as u32,
            u("index_head_dim") as u32,
            u("index_topk") as u32,
        ));
    }
    s.quant = GgmlType::from_name("F32").unwrap();
    // The legacy golden is the converter's file rewritten into the pre-PR #12801 layout (make_goldens.py).
    s.legacy_kv_b |= g.name == "deepseek-v3-legacy-kv-b";
    s
}

/// Keys that decide attention: what `MlaConfig::from_gguf` and llama.cpp's attention read.
fn attention_key(arch: &str, k: &str) -> bool {
    k == "general.architecture"
        || [
            "attention.",
            "rope.",
            "block_count",
            "embedding_length",
            "context_length",
            "vocab_size",
        ]
        .iter()
        .any(|p| k.starts_with(&format!("{arch}.{p}")))
}

fn ty_name(t: &TensorType) -> String {
    t.to_string()
}

/// Same config as the converter's file ⇒ `mla-diff fixture` writes the same attention keys (types and
/// values), the same tensor names, types and ne shapes, and the same kv_b convention (checked by
/// decompression against each file's own source kv_b_proj); the two files give identical `MlaConfig`s.
#[test]
fn fixture_writes_what_the_converter_writes() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FAMILIES {
        let g = load(name);
        let spec = spec_for(&g);
        let path = tmp.path().join(format!("{name}.gguf"));
        fixture::write(&spec, &path).unwrap();
        let ours = GgufFile::open(&path).unwrap();
        let conv = &g.file;
        let arch = conv.architecture().unwrap().to_string();
        assert_eq!(ours.architecture(), Some(arch.as_str()), "{name}");

        // Metadata. Attention keys must agree exactly (type included); the rest is listed.
        let keys = |f: &GgufFile| -> BTreeSet<String> {
            f.metadata.iter().map(|(k, _)| k.clone()).collect()
        };
        let (ko, kc) = (keys(&ours), keys(conv));
        // The converter writes these only because transformers' config carries them; they do not change
        // attention while the context is within index_topk (see README, "Conventions").
        let converter_only_ok = [format!("{arch}.attention.indexer.types")];
        // GLM-4.7-Flash's MTP block: the fixture, like the GLM-5 preset, writes the trunk only.
        let nextn = conv
            .get(&format!("{arch}.nextn_predict_layers"))
            .and_then(|v| v.as_u64())
            .unwrap_or(0) as usize;
        let mut mismatches = Vec::new();
        for k in ko.union(&kc).filter(|k| attention_key(&arch, k)) {
            match (ours.get(k), conv.get(k)) {
                (Some(a), Some(b)) if a == b => {}
                // block_count counts the MTP block; the trunk must agree.
                (Some(a), Some(b))
                    if *k == format!("{arch}.block_count")
                        && a.as_u64().map(|v| v as usize + nextn)
                            == b.as_u64().map(|v| v as usize) => {}
                (None, Some(_)) if converter_only_ok.contains(k) => {}
                (a, b) => mismatches.push(format!("{k}: ours {a:?}, converter {b:?}")),
            }
        }
        let only = |a: &BTreeSet<String>, b: &BTreeSet<String>| -> Vec<String> {
            a.difference(b)
                .filter(|k| !attention_key(&arch, k))
                .cloned()
                .collect()
        };
        println!(
            "{name:27} non-attention keys only in the converter's file: {:?}; only in ours: {:?}",
            only(&kc, &ko),
            only(&ko, &kc)
        );
        // Keys the vocabulary strip removed from the converter's file (tokenizer.ggml.*) are listed in the
        // manifest; none of them is an attention key.
        if let Some(dropped) = g.manifest["dropped_from_converter_output"]["keys"].as_object() {
            assert!(
                dropped.keys().all(|k| k.starts_with("tokenizer.ggml.")),
                "{name}"
            );
        }
        assert!(mismatches.is_empty(), "{name}:\n{}", mismatches.join("\n"));

        // Tensors: every attention tensor (and the rope factors) with the same type and ne.
        let mut names: Vec<String> = (0..spec.layers).flat_map(tensor_names).collect();
        names.extend(["rope_factors_long.weight", "rope_factors_short.weight"].map(String::from));
        for n in &names {
            match (ours.tensor(n), conv.tensor(n)) {
                (None, None) => {}
                (Some(a), Some(b)) => {
                    assert_eq!(a.ne, b.ne, "{name}: {n} ne");
                    assert_eq!(ty_name(&a.ty), ty_name(&b.ty), "{name}: {n} type");
                }
                (a, b) => panic!(
                    "{name}: {n} present in ours {}, in the converter's {}",
                    a.is_some(),
                    b.is_some()
                ),
            }
        }
        // token_embd: in the file, or recorded by the strip step.
        let te = ours.tensor("token_embd.weight").unwrap();
        match conv.tensor("token_embd.weight") {
            Some(b) => {
                assert_eq!(te.ne, b.ne, "{name}: token_embd ne");
                assert_eq!(ty_name(&te.ty), ty_name(&b.ty), "{name}: token_embd type");
            }
            None => {
                let d =
                    &g.manifest["dropped_from_converter_output"]["tensors"]["token_embd.weight"];
                let ne: Vec<u64> = d["ne"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap())
                    .collect();
                assert_eq!(te.ne, ne, "{name}: token_embd ne (dropped)");
                assert_eq!(
                    ty_name(&te.ty),
                    d["type"].as_str().unwrap(),
                    "{name}: token_embd type (dropped)"
                );
            }
        }
        let extra: Vec<&str> = conv
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| !names.iter().any(|m| m == n) && ours.tensor(n).is_none())
            .collect();
        println!("{name:27} tensors only in the converter's file: {extra:?}");
        // FFN and the output norm are outside attention; the DSA indexer (GLM-5) is not used by the dense
        // MLA graph, and selects every key while the context is within index_topk.
        let mtp_block = format!("blk.{}.", spec.layers);
        let outside = |n: &str| {
            (nextn > 0 && n.starts_with(&mtp_block))
                || n == "output_norm.weight"
                || n.contains(".ffn_")
                || n.contains(".exp_probs_b")
                || n.contains(".indexer.")
        };
        assert!(
            extra.iter().all(|n| outside(n)),
            "{name}: converter tensors the fixture lacks: {extra:?}"
        );

        // The same config, read back.
        let (co, cc) = (
            MlaConfig::from_gguf(&ours).unwrap(),
            MlaConfig::from_gguf(conv).unwrap(),
        );
        let mut jo = serde_json::to_value(&co).unwrap();
        let mut jc = serde_json::to_value(&cc).unwrap();
        // The vocabulary strip removed the converter's token_embd.
        jo["vocab_size"] = J::Null;
        jc["vocab_size"] = J::Null;
        assert_eq!(
            jo, jc,
            "{name}: MlaConfig from ours vs the converter's file"
        );

        // The kv_b convention, by decompression against each file's own source weight.
        let wo = LayerWeights::load(&ours, &co, 0).unwrap();
        let wc = LayerWeights::load(conv, &cc, 0).unwrap();
        assert_eq!(wo.kv_b_layout, wc.kv_b_layout, "{name}: kv_b layout");
        let kv_b_ours = Array2::from_shape_vec(
            (co.n_head * (co.qk_nope + co.v_head_dim), co.kv_lora_rank),
            spec.kv_b_proj(0),
        )
        .unwrap();
        check_decompression(&format!("{name} (fixture)"), &co, &wo, &kv_b_ours);
        let kv_b_hf: Array2<f32> =
            ndarray_npy::read_npy(dir().join(format!("{name}.kv_b_proj.npy"))).unwrap();
        check_decompression(&format!("{name} (converter)"), &cc, &wc, &kv_b_hf);
    }
}
