//! The benchmark command's code path runs (tiny shapes; timings are not checked).

use mla_diff::model::synthetic::Family;

#[test]
fn reference_bench_runs() {
    let mut d = Family::Minicpm3.test_dims();
    d.hidden = 64;
    let r = mla_diff::bench::reference(Family::Minicpm3, d, 12, 4, 1).unwrap();
    assert_eq!((r.tokens, r.decode_tokens), (12, 4));
    assert!(r.flops > 0.0 && r.reference_s > 0.0 && r.gemm_s > 0.0 && r.ratio.is_finite());
    assert!(r.text().contains("ratio"));
}

/// `bench load` reads every attention tensor of the file and loads each layer as `run` does: on the
/// shipped GLM-5 fixture its byte and f32 counts are the tensors' own (not timings).
#[test]
fn load_floor_counts_the_files_attention_tensors() {
    use mla_diff::gguf::GgufFile;
    use mla_diff::model::weights::tensor_names;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/glm-5-q4_0.gguf");
    let r = mla_diff::bench::load::measure(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let tensors: Vec<_> = tensor_names(0)
        .iter()
        .filter_map(|n| f.tensor(n).cloned())
        .collect();
    let stored: u64 = tensors.iter().map(|t| t.n_bytes().unwrap()).sum();
    // Every element once as f32, but attn_k_b / attn_v_b (llama.cpp's split of kv_b) are loaded as
    // W_UK / W_UV of the same element counts.
    let elements: u64 = tensors.iter().map(|t| t.ne.iter().product::<u64>()).sum();
    assert_eq!(
        (r.layers, r.tensor_bytes, r.f32_bytes),
        (1, stored, 4 * elements)
    );
    assert!(r.read_s > 0.0 && r.load_s > 0.0 && r.read_gb_s.is_finite());
    assert!(r.text().contains("load + dequantize"));
    let bad = mla_diff::bench::load::measure(std::path::Path::new("README.md"));
    assert!(bad.unwrap_err().to_string().contains("not a GGUF file"));
}
