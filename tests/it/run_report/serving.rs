//! Our own decode's serving batch (#32 item 6, `backend::cpu::serving`): requests of mixed lengths in
//! one batch, checked against fp64 from its own inputs and reported in `runner_checks`.

use super::{opts, run_with, tiny4};
use mla_diff::backend::cpu::serving::Plant;
use mla_diff::backend::cpu::CpuMirror;
use mla_diff::precision::Dtype;

#[test]
fn the_mirrors_serving_batch_passes_and_an_empty_split_weighed_one_fails_only_there() {
    let o = opts(Dtype::Bf16);
    let clean = run_with(&mut CpuMirror::new(Dtype::Bf16), &tiny4(), &o);
    assert!(clean.pass(), "{}", clean.verdict.message);
    let rc = clean
        .runner_checks
        .as_ref()
        .expect("the mirror's batch checks");
    // 4 layers × (attn_latent, lse, split_out, split_lse), all against fp64 of the batch's inputs, for
    // the serving batch and for the batch aimed at the variant the schedule does not reach (4 heads:
    // attn_small at page 64, issue #35).
    assert_eq!(rc.checks.len(), 2 * 4 * 4, "{:#?}", rc.checks);
    assert!(rc.pass && rc.message.starts_with("batch checks: 32 passed"));
    let (serving, aimed): (Vec<_>, Vec<_>) =
        rc.checks.iter().partition(|c| c.check == "serving_batch");
    assert_eq!((serving.len(), aimed.len()), (16, 16));
    assert!(serving
        .iter()
        .all(|c| c.detail.contains("5 requests of 2113, 1, ")
            && c.value.is_some_and(|v| v <= c.bound.unwrap())));
    assert!(aimed.iter().all(|c| c.check == "variant_batch"
        && c.detail.contains("aimed at decode/attn_small/tma-ring-multi-tile-page: heads 4 of 4, page 64, 1 split(s)")
        && c.detail.contains("4 requests of 256, 1, 33, 65 keys")
        && c.value.is_some_and(|v| v <= c.bound.unwrap())));

    // A bug planted in the batch's combine: an empty split (lse −inf) weighed as the largest. Every
    // stage check of the default run (one entry per decode step) passes, bit for bit as clean; the
    // serving batch's one-key request (3 of its 4 splits empty) fails.
    let mut planted = CpuMirror::new(Dtype::Bf16).with_plant(Plant::EmptySplitWeightOne);
    let bad = run_with(&mut planted, &tiny4(), &o);
    assert_eq!(
        serde_json::to_value(&bad.modes).unwrap(),
        serde_json::to_value(&clean.modes).unwrap()
    );
    assert!(bad.modes.iter().all(|m| m.verdict.pass));
    let rc = bad.runner_checks.as_ref().unwrap();
    assert!(!rc.pass && !bad.pass() && !bad.verdict.pass);
    assert!(
        rc.message.starts_with(
            "BATCH CHECK FAILED: 8 of 32 (first: layer 0 serving_batch attn_latent: fail"
        ),
        "{}",
        rc.message
    );
    // Only the serving batch's merged outputs: the partials are the kernel's, right, and the aimed
    // batch's one split has no empty split to weigh.
    for c in &rc.checks {
        let merged = c.check == "serving_batch" && (c.what == "attn_latent" || c.what == "lse");
        assert_eq!(c.status.name() == "fail", merged, "{}", c.line());
    }
    assert!(bad.verdict.message.contains("BATCH CHECK FAILED"));
}
