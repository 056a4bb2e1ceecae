//! The `deepseek-v4` golden (fixtures/golden/deepseek_v4.py): DeepSeek-V4 attention recorded by
//! transformers over two forward passes on one cache, converted by llama.cpp's own converter.

use ndarray::{Array2, Array3};
use ndarray_npy::read_npy;
use serde_json::Value as J;
use sha2::{Digest, Sha256};

use super::dir;

pub(super) fn manifest() -> J {
    serde_json::from_str(&std::fs::read_to_string(dir().join("deepseek-v4.json")).unwrap()).unwrap()
}

/// The files are the ones the manifest recorded (sha256), with the shapes its passes say: a golden
/// regenerated in part, or truncated in a checkout, fails here rather than as a numeric mismatch.
#[test]
fn v4_golden_files_are_the_manifests() {
    let m = manifest();
    for (name, sum) in m["files"].as_object().unwrap() {
        let bytes = std::fs::read(dir().join(name)).unwrap();
        let got = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(got, sum.as_str().unwrap(), "{name}");
    }
    let passes: Vec<usize> = m["passes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let t: usize = passes.iter().sum();
    assert_eq!(passes.len(), 2, "a prompt and a continuation");
    assert_eq!(m["tokens"].as_u64().unwrap() as usize, t);
    let hidden = m["original_config"]["hidden_size"].as_u64().unwrap() as usize;
    let layers = m["original_config"]["num_hidden_layers"].as_u64().unwrap() as usize;
    for f in ["attn_in", "attn_out"] {
        let a: Array3<f64> = read_npy(dir().join(format!("deepseek-v4.{f}.npy"))).unwrap();
        assert_eq!(a.dim(), (layers, t, hidden), "{f}");
        assert!(a.iter().all(|v| v.is_finite()), "{f}");
    }
    let topk: Array2<i32> = read_npy(dir().join("deepseek-v4.topk.npy")).unwrap();
    let k = m["original_config"]["index_topk"].as_u64().unwrap() as usize;
    assert_eq!(topk.dim(), (t, k));
    // Causality as transformers' indexer states it: entry w is valid for position p iff w < (p+1)/4.
    for (p, row) in topk.outer_iter().enumerate() {
        for &w in row {
            assert!(
                w == -1 || (w as usize) < (p + 1) / 4,
                "position {p} picked {w}"
            );
        }
    }
}
