//! The converter's file against HF's weights, and `mla-diff fixture` against the converter.

use super::*;
use mla_diff::fixture::{self, Preset, Spec, YarnSpec};
use mla_diff::gguf::{GgmlType, TensorType};
use mla_diff::model::weights::tensor_names;
use std::collections::BTreeSet;

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
        "glm-5" | "glm-5-dsa" => Preset::Glm5,
        "deepseek-v3.2-dsa" => Preset::DeepseekV32,
        "minicpm3" | "minicpm3-long" => Preset::Minicpm3,
        other => panic!("no preset for {other}"),
    };
    let mut s = preset.spec();
    config_dims(&mut s, c, g.name);
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
/// values), the same tensor names, types and ne shapes (the DSA indexer's too, on the DSA goldens:
/// GLM-5's and DeepSeek-V3.2's, whose `deepseek32` file is the converter's `DeepseekV32Model` output),
/// and the same kv_b convention (checked by decompression against each file's own source kv_b_proj);
/// the two files give identical `MlaConfig`s.
#[test]
fn fixture_writes_what_the_converter_writes() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FAMILIES
        .into_iter()
        .chain(["glm-5-dsa", "deepseek-v3.2-dsa"])
    {
        let g = load(name);
        let spec = spec_for(&g);
        let path = tmp.path().join(format!("{name}.gguf"));
        fixture::write(&spec, &path).unwrap();
        let ours = GgufFile::open(&path).unwrap();
        same_as_converter(name, &spec, &ours, &g.file, &g.manifest);
    }
}

/// The same for glm5-next (#37), whose golden is a hybrid (layer 0 linear attention, layers 1..3 MLA,
/// layer 2 a "shared" indexer layer) with k-pool 4: the spec takes its `layer_types`, `indexer_types`
/// and `index_kpool` from the golden's config, and both files give the same hybrid layout and k-pool
/// indexer besides the same `MlaConfig`.
#[test]
fn glm5_next_fixture_writes_what_the_converter_writes() {
    let conv = GgufFile::open(dir().join("glm5-next.gguf")).unwrap();
    let manifest: J =
        serde_json::from_str(&std::fs::read_to_string(dir().join("glm5-next.json")).unwrap())
            .unwrap();
    let spec = glm5_next_spec(&manifest["flat_config"]);
    assert_eq!(
        (
            spec.layer_types.clone(),
            spec.indexer_types.clone(),
            spec.kpool
        ),
        (
            Some(vec![false, true, true, true]),
            Some(vec![true, true, false, true]),
            Some(4)
        ),
        "the golden is the hybrid this test is about"
    );
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("glm5-next.gguf");
    fixture::write(&spec, &path).unwrap();
    let ours = GgufFile::open(&path).unwrap();
    same_as_converter("glm5-next", &spec, &ours, &conv, &manifest);
    let layout = |f: &GgufFile| mla_diff::model::HybridLayout::from_gguf(f).unwrap();
    assert_eq!(layout(&ours), layout(&conv));
    let kpool = |f: &GgufFile| {
        let cfg = MlaConfig::from_gguf(f).unwrap();
        let k = mla_diff::model::KpoolIndexer::from_gguf(f, &cfg)
            .unwrap()
            .unwrap();
        serde_json::to_value(&k).unwrap()
    };
    assert_eq!(kpool(&ours), kpool(&conv));
}

/// The attention dims every MLA HF config names alike, into `s` (`who`: the golden, for a missing key).
fn config_dims(s: &mut Spec, c: &J, who: &str) {
    let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{who}: {k}")) as usize;
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
}

/// The fixture spec with glm5-next's golden config (`flat_config`: the HF config as converted).
fn glm5_next_spec(c: &J) -> Spec {
    let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("glm5-next: {k}")) as usize;
    let list = |k: &str, yes: &str| -> Vec<bool> {
        c[k].as_array()
            .unwrap_or_else(|| panic!("glm5-next: {k}"))
            .iter()
            .map(|v| v == yes)
            .collect()
    };
    let mut s = Preset::Glm5Next.spec();
    config_dims(&mut s, c, "glm5-next");
    s.indexer = Some((
        u("index_n_heads") as u32,
        u("index_head_dim") as u32,
        u("index_topk") as u32,
    ));
    s.kpool = Some(u("index_kpool") as u32);
    s.layer_types = Some(list("layer_types", "indexed_attention"));
    s.indexer_types = Some(list("indexer_types", "full"));
    s.quant = GgmlType::from_name("F32").unwrap();
    s
}

/// `ours` (written from `spec`) against the converter's file `conv` of the golden `name`: metadata,
/// tensors, the config read back and the kv_b convention.
fn same_as_converter(name: &str, spec: &Spec, ours: &GgufFile, conv: &GgufFile, manifest: &J) {
    let arch = conv.architecture().unwrap().to_string();
    assert_eq!(ours.architecture(), Some(arch.as_str()), "{name}");
    // GLM-4.7-Flash's MTP block: the fixture, like the GLM-5 preset, writes the trunk only.
    let nextn = conv
        .get(&format!("{arch}.nextn_predict_layers"))
        .and_then(|v| v.as_u64())
        .unwrap_or(0) as usize;
    same_keys(name, &arch, nextn, ours, conv, manifest);
    same_tensors(name, spec, nextn, ours, conv, manifest);

    // The same config, read back.
    let (co, cc) = (
        MlaConfig::from_gguf(ours).unwrap(),
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

    // The kv_b convention, by decompression against each file's own source weight (of the first MLA
    // layer: the goldens' kv_b_proj.npy is that layer's).
    let l = (0..spec.layers).find(|&l| spec.is_mla(l)).unwrap();
    let wo = LayerWeights::load(ours, &co, l).unwrap();
    let wc = LayerWeights::load(conv, &cc, l).unwrap();
    assert_eq!(wo.kv_b_layout, wc.kv_b_layout, "{name}: kv_b layout");
    let kv_b_ours = Array2::from_shape_vec(
        (co.n_head * (co.qk_nope + co.v_head_dim), co.kv_lora_rank),
        spec.kv_b_proj(l),
    )
    .unwrap();
    check_decompression(&format!("{name} (fixture)"), &co, &wo, &kv_b_ours);
    let kv_b_hf: Array2<f32> =
        ndarray_npy::read_npy(dir().join(format!("{name}.kv_b_proj.npy"))).unwrap();
    check_decompression(&format!("{name} (converter)"), &cc, &wc, &kv_b_hf);
}

/// Metadata: attention keys must agree exactly (type included); the rest is listed.
fn same_keys(name: &str, arch: &str, nextn: usize, ours: &GgufFile, conv: &GgufFile, manifest: &J) {
    let keys =
        |f: &GgufFile| -> BTreeSet<String> { f.metadata.iter().map(|(k, _)| k.clone()).collect() };
    let (ko, kc) = (keys(ours), keys(conv));
    // The converter writes these only because transformers' config carries them; they do not change
    // attention while the context is within index_topk (see docs/conventions.md).
    let converter_only_ok = [format!("{arch}.attention.indexer.types")];
    let mut mismatches = Vec::new();
    for k in ko.union(&kc).filter(|k| attention_key(arch, k)) {
        match (ours.get(k), conv.get(k)) {
            (Some(a), Some(b)) if a == b => {}
            // block_count counts the MTP block; the trunk must agree.
            (Some(a), Some(b))
                if *k == format!("{arch}.block_count")
                    && a.as_u64().map(|v| v as usize + nextn) == b.as_u64().map(|v| v as usize) => {
            }
            (None, Some(_)) if converter_only_ok.contains(k) => {}
            (a, b) => mismatches.push(format!("{k}: ours {a:?}, converter {b:?}")),
        }
    }
    let only = |a: &BTreeSet<String>, b: &BTreeSet<String>| -> Vec<String> {
        a.difference(b)
            .filter(|k| !attention_key(arch, k))
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
    if let Some(dropped) = manifest["dropped_from_converter_output"]["keys"].as_object() {
        assert!(
            dropped.keys().all(|k| k.starts_with("tokenizer.ggml.")),
            "{name}"
        );
    }
    assert!(mismatches.is_empty(), "{name}:\n{}", mismatches.join("\n"));
}

/// Tensors: every attention tensor of the MLA layers (the DSA indexer's and the k-pool's, the rope
/// factors) with the same type and ne; token_embd; nothing else of attention only in the converter's.
fn same_tensors(
    name: &str,
    spec: &Spec,
    nextn: usize,
    ours: &GgufFile,
    conv: &GgufFile,
    manifest: &J,
) {
    let mla: Vec<usize> = (0..spec.layers).filter(|&l| spec.is_mla(l)).collect();
    let mut names: Vec<String> = mla.iter().flat_map(|&l| tensor_names(l)).collect();
    names.extend(
        mla.iter()
            .flat_map(|&l| mla_diff::model::indexer::tensor_names(l)),
    );
    names.extend(
        mla.iter()
            .flat_map(|&l| mla_diff::model::kpool::tensor_names(l)),
    );
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
            let d = &manifest["dropped_from_converter_output"]["tensors"]["token_embd.weight"];
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
    // FFN, the output norm, glm5-next's hyper-connections and its linear-attention (KDA) layers are
    // outside MLA attention (the fixture writes the DSA indexer's tensors).
    let mtp_block = format!("blk.{}.", spec.layers);
    let linear: Vec<String> = (0..spec.layers)
        .filter(|&l| !spec.is_mla(l))
        .map(|l| format!("blk.{l}."))
        .collect();
    let outside = |n: &str| {
        (nextn > 0 && n.starts_with(&mtp_block))
            || linear.iter().any(|p| n.starts_with(p))
            || n == "output_norm.weight"
            || n.contains(".ffn_")
            || n.contains(".exp_probs_b")
            || n.contains(".hc_")
    };
    assert!(
        extra.iter().all(|n| outside(n)),
        "{name}: converter tensors the fixture lacks: {extra:?}"
    );
}
