//! glm5-next's k-pool indexer (#37): its tensors read, linted and written by `fixture --preset glm5-next`.

use crate::common::*;
use mla_diff::gguf::GgufFile;
use mla_diff::model::{KpoolIndexer, KpoolLayer, MlaConfig};
use std::path::{Path, PathBuf};

/// 8 layers of the default layout (MLA on 3 and 7), small dims.
pub fn kpool_fixture(dir: &Path, quant: &str) -> PathBuf {
    make_fixture(
        dir,
        &format!("g5n-{quant}.gguf"),
        &[
            "--preset",
            "glm5-next",
            "--layers",
            "8",
            "--hidden",
            "128",
            "--heads",
            "2",
            "--q-lora-rank",
            "64",
            "--quant",
            quant,
        ],
    )
}

#[test]
fn fixture_writes_the_kpool_tensors_as_the_converter_does() {
    let dir = tempfile::tempdir().unwrap();
    let p = kpool_fixture(dir.path(), "q8_0");
    let f = GgufFile::open(&p).unwrap();
    for l in [3, 7] {
        let g = f
            .tensor(&format!("blk.{l}.indexer_compressor_gate.weight"))
            .unwrap();
        let a = f
            .tensor(&format!("blk.{l}.indexer_compressor_ape.weight"))
            .unwrap();
        // ne {E, Di} and {Di, kpool}; F32 in a Q8_0 file (the converter's tensor_force_quant).
        assert_eq!(
            (g.ne.clone(), a.ne.clone()),
            (vec![128, 128], vec![128, 16])
        );
        assert_eq!(format!("{:?}", g.ty), format!("{:?}", a.ty));
        assert!(format!("{:?}", g.ty).contains("F32"), "{:?}", g.ty);
    }
    for l in [0, 1, 2, 4] {
        assert!(f
            .tensor(&format!("blk.{l}.indexer_compressor_gate.weight"))
            .is_none());
    }
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    let k = KpoolIndexer::from_gguf(&f, &cfg).unwrap().unwrap();
    assert_eq!(
        (k.ic.heads, k.ic.head_dim, k.ic.top_k, k.ic.rope_dim),
        (32, 128, 2048, 0)
    );
    assert_eq!((k.kp.kpool, k.kp.select_tail), (16, true));
    let w = KpoolLayer::load(&f, &cfg, &k, 7).unwrap().unwrap();
    assert_eq!(w.pool.gate.dim(), (128, 128));
    assert_eq!(w.pool.ape.dim(), (16, 128));
    assert!(w.pool.ape.iter().all(|v| v.is_finite()) && w.pool.ape.iter().any(|&v| v != 0.0));
}

/// The fixture with layer 3's APE dropped and layer 7's gate transposed.
fn broken(dir: &Path) -> PathBuf {
    rewrite(
        &kpool_fixture(dir, "f32"),
        &dir.join("broken.gguf"),
        |_| {},
        |ts| {
            ts.retain(|t| t.name != "blk.3.indexer_compressor_ape.weight");
            let g = ts
                .iter_mut()
                .find(|t| t.name == "blk.7.indexer_compressor_gate.weight")
                .unwrap();
            g.ne = vec![64, 256];
        },
    )
}

#[test]
fn a_missing_or_misshapen_kpool_tensor_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = broken(dir.path());
    let o = run(&["lint", p.to_str().unwrap(), "--json", "-"]);
    assert!(!o.status.success());
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let errors: Vec<&serde_json::Value> = j["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["severity"] == "error" && f["check"].as_str().unwrap().contains("indexer_compressor")
        })
        .collect();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    let s = serde_json::to_string(&errors).unwrap();
    assert!(
        s.contains("blk.N.indexer_compressor_ape.weight") && s.contains("absent on layers 3"),
        "{s}"
    );
    assert!(
        s.contains("ne {64, 256} on layers 7") && s.contains("{128, 128}"),
        "{s}"
    );
    // The loader: one line naming the tensor each.
    let f = GgufFile::open(&p).unwrap();
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    let k = KpoolIndexer::from_gguf(&f, &cfg).unwrap().unwrap();
    let e3 = KpoolLayer::load(&f, &cfg, &k, 3).unwrap_err().to_string();
    assert!(
        e3.contains("not the k-pool's blk.3.indexer_compressor_ape.weight"),
        "{e3}"
    );
    let e7 = KpoolLayer::load(&f, &cfg, &k, 7).unwrap_err().to_string();
    assert!(
        e7.contains("blk.7.indexer_compressor_gate.weight has shape (ne) {64, 256}"),
        "{e7}"
    );
}

/// `fixture --preset glm5-next --layers N --hidden 128 --heads 2 --q-lora-rank 64 --quant f32` as the
/// library's `Spec`, for a test to change (top_k, shared layers) before `fixture::write`.
pub fn small_spec(layers: usize) -> mla_diff::fixture::Spec {
    mla_diff::fixture::Spec::from_options(&mla_diff::fixture::Options {
        preset: mla_diff::fixture::Preset::Glm5Next,
        layers: Some(layers),
        quant: mla_diff::gguf::GgmlType::from_name("F32").unwrap(),
        seed: 0,
        legacy_kv_b: false,
        hidden: Some(128),
        heads: Some(2),
        q_lora_rank: Some(64),
        vocab: None,
    })
    .unwrap()
}

/// A 4-layer fixture (MLA on layer 3) with top_k 32 (two pools of 16), so that the default schedule's
/// queries go past it; optionally without the k-pool tensors (removed from the written file: the
/// writer has no such option, the file is a broken one).
fn past_top_k(dir: &Path, keep_kpool: bool) -> PathBuf {
    let mut s = small_spec(4);
    s.indexer = s.indexer.map(|(h, d, _)| (h, d, 32));
    let path = dir.join("g5n4-top32.gguf");
    mla_diff::fixture::write(&s, &path).unwrap();
    if keep_kpool {
        return path;
    }
    rewrite(
        &path,
        &dir.join("g5n4-top32-bare.gguf"),
        |_| {},
        |ts| ts.retain(|t| !t.name.contains("indexer_compressor_")),
    )
}

#[test]
fn run_attends_over_the_kpool_selection_past_top_k() {
    let dir = tempfile::tempdir().unwrap();
    let p = past_top_k(dir.path(), true);
    for dt in ["bf16", "f32"] {
        let (o, j) = cpu_run_json(&p, &["--dtype", dt]);
        assert!(o.status.success(), "{dt}: {}", stderr(&o));
        let d = &j["dsa"];
        assert_eq!(d["top_k"], 32, "{d}");
        assert!(d["message"].as_str().unwrap().contains("k-pool"), "{d}");
        assert_eq!(d["layers"][0]["layer"], 3, "{d}");
        assert!(
            d["layers"][0]["sparse_queries"].as_u64().unwrap() > 0,
            "{d}"
        );
        assert!(
            !j["run"]["notices"]
                .to_string()
                .contains("dense attention beyond"),
            "{}",
            j["run"]["notices"]
        );
    }
    // Without the k-pool tensors there is no k-pool model: dense past top_k is refused, as for GLM-5.
    let bare = past_top_k(dir.path(), false);
    let o = run(&["run", bare.to_str().unwrap(), "--backend", "cpu"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("dense attention beyond the DSA top-k"),
        "{}",
        stderr(&o)
    );
}

/// The converter's golden file (top_k 16, kpool 4, layer 2 shared) on the default schedule: sparse on
/// every MLA layer, the shared one reusing layer 1's selection, and clean.
#[test]
fn run_on_the_golden_is_sparse_and_clean() {
    let p = fixture("golden").join("glm5-next.gguf");
    let (o, j) = cpu_run_json(&p, &["--dtype", "bf16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let layers = j["dsa"]["layers"].as_array().unwrap();
    let got: Vec<(u64, serde_json::Value)> = layers
        .iter()
        .map(|l| (l["layer"].as_u64().unwrap(), l["shared_from"].clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, serde_json::Value::Null),
            (2, serde_json::json!(1)),
            (3, serde_json::Value::Null)
        ]
    );
    assert!(layers
        .iter()
        .all(|l| l["sparse_queries"].as_u64().unwrap() > 0));
}
