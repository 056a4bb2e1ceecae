//! The DeepSeek-V3.2 preset (issue #17): `mla-diff fixture --preset deepseek-v3.2` writes a `deepseek32`
//! file with V3.2's indexer (64 heads of 128, top_k 2048, NeoX rope) in the converter's layout; `inspect`
//! shows the indexer, `lint` reads it, and `run` passes on the CPU mirror within top_k (dense) and past
//! it (sparse; top_k lowered to 16 in the file, as the selftest's DSA fixture does, so that sparsity
//! bites at a few dozen tokens). The indexer's rope style of this architecture (NeoX) is pinned by the
//! catalogue's `indexer_rope_swap` fault, which is caught in the layer it is planted in.

use crate::common::{self, inspect_json, make_fixture, rewrite, run, stderr};
use mla_diff::gguf::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// V3.2's head dims (128/64/128, kv_lora 512) and full indexer at a test size: hidden 512, 8 heads,
/// q-LoRA 256 (as the shipped deepseek-v3 fixture), Q4_K, 2 layers. Written once per test process.
fn v32() -> &'static Path {
    static P: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &P.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let p = make_fixture(
            d.path(),
            "v32.gguf",
            &[
                "--preset",
                "deepseek-v3.2",
                "--layers",
                "2",
                "--hidden",
                "512",
                "--heads",
                "8",
                "--q-lora-rank",
                "256",
                "--quant",
                "q4_k",
            ],
        );
        (d, p)
    })
    .1
}

const TOP_K: u32 = 16;

/// The same file with the indexer's top_k lowered to 16 (the key rewritten, every tensor unchanged).
fn v32_small_top_k() -> &'static Path {
    static P: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &P.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("v32-topk16.gguf");
        rewrite(
            v32(),
            &dst,
            |m| {
                let (_, v) = m
                    .iter_mut()
                    .find(|(k, _)| k == "deepseek32.attention.indexer.top_k")
                    .expect("the preset writes top_k");
                *v = Value::U32(TOP_K);
            },
            |_| {},
        );
        (d, dst)
    })
    .1
}

#[test]
fn inspect_shows_the_v32_indexer() {
    let j = inspect_json(v32());
    let c = &j["config"];
    assert_eq!(c["arch"], "deepseek32");
    assert_eq!(
        (
            &c["qk_nope"],
            &c["qk_rope"],
            &c["v_head_dim"],
            &c["kv_lora_rank"]
        ),
        (
            &serde_json::json!(128),
            &serde_json::json!(64),
            &serde_json::json!(128),
            &serde_json::json!(512)
        )
    );
    // The MLA rope is interleaved, with DeepSeek's YaRN; the indexer's is NeoX.
    assert_eq!(c["rope"]["pairing"], "norm");
    assert_eq!(c["rope"]["yarn"]["factor"], 40.0);
    let i = &j["indexer"];
    assert_eq!(i["heads"], 64, "{i}");
    assert_eq!(i["head_dim"], 128, "{i}");
    assert_eq!(i["top_k"], 2048, "{i}");
    assert_eq!(i["rope_dim"], 64, "{i}");
    assert_eq!(i["rope"], "neox", "{i}");
    let names: Vec<&str> = j["layers"][1]["indexer_tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "blk.1.indexer.attn_q_b.weight",
            "blk.1.indexer.attn_k.weight",
            "blk.1.indexer.k_norm.weight",
            "blk.1.indexer.k_norm.bias",
            "blk.1.indexer.proj.weight"
        ]
    );
    let o = run(&["inspect", v32().to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(
            "dsa indexer   64 heads x 128 (rope on the first 64, Neox pairing), top_k 2048"
        ),
        "{text}"
    );
    // A dense file has no indexer.
    let d = inspect_json(&crate::common::fixture("deepseek-v3-yarn-q4_k.gguf"));
    assert!(d["indexer"].is_null());
    assert!(d["layers"][0]["indexer_tensors"]
        .as_array()
        .unwrap()
        .is_empty());
}

#[test]
fn lint_reads_the_v32_file() {
    let o = run(&["lint", v32().to_str().unwrap(), "--json", "-"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no JSON ({e}): {}", stderr(&o)));
    assert_eq!(o.status.code(), Some(0), "{j}");
    let text = j.to_string();
    assert!(
        text.contains("deepseek32.attention.indexer.top_k"),
        "{text}"
    );
    // DeepSeek-V3.2's own dims: the catalogue entry is recognised, with no warning.
    assert!(text.contains("DeepSeek-V3.2"), "{text}");
}

/// Within top_k the sparse model is dense attention: the default schedule passes with no `dsa` section.
#[test]
fn v32_within_top_k_passes_dense() {
    let (o, r) = common::cpu_run_json(v32(), &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(r["verdict"]["pass"], true);
    assert!(r.get("dsa").is_none(), "{}", r["dsa"]);
    assert_eq!(r["coverage"]["dsa"]["sparse_queries"], 0);
}

/// Past top_k (16): the sparse model, both modes and the selection check pass on the CPU mirror.
#[test]
fn v32_past_top_k_passes_sparse() {
    let (o, r) = common::cpu_run_json(v32_small_top_k(), &["--prompt-len", "48"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(r["verdict"]["pass"], true);
    let dsa = &r["dsa"];
    assert_eq!(dsa["pass"], true, "{dsa}");
    assert_eq!(dsa["top_k"], TOP_K, "{dsa}");
    assert_eq!(dsa["layers"].as_array().unwrap().len(), 2);
    for l in dsa["layers"].as_array().unwrap() {
        assert_eq!(l["selection"]["pass"], true, "{l}");
        assert!(
            l["selection"]["sparse_queries"].as_u64().unwrap() > 0,
            "{l}"
        );
    }
    assert!(r["coverage"]["dsa"]["sparse_queries"].as_u64().unwrap() > 0);
}

/// The indexer's rope style on this architecture: the optimized indexer roped interleaved (GLM's style,
/// the catalogue's `indexer_rope_swap` on a NeoX file) disagrees with the reference's NeoX selection and
/// is caught by the selection check in its layer, every stage check clean.
#[test]
fn v32_interleaved_indexer_rope_is_caught() {
    let (o, r) = common::cpu_run_json(
        v32_small_top_k(),
        &[
            "--prompt-len",
            "48",
            "--mode",
            "shadow",
            "--inject",
            "indexer_rope_swap@layer=1",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(r["verdict"]["pass"], false);
    assert_eq!(r["modes"][0]["verdict"]["pass"], true, "{r}");
    let dsa = &r["dsa"];
    assert_eq!(dsa["first_layer"], 1, "{dsa}");
    assert_eq!(dsa["layers"][0]["pass"], true, "{dsa}");
    assert_eq!(dsa["layers"][1]["selection"]["pass"], false, "{dsa}");
}
