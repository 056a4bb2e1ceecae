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
