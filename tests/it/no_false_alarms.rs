//! No false alarms: clean runs of the CPU mirror pass over seeds × schedules × every shipped fixture,
//! and on inputs whose attention is peaky (max scores of 30–50, as real checkpoints reach) — the
//! tolerances must hold where the softmax is badly conditioned, not only on the calibration runs.

use crate::common::{fixtures_dir, rewrite, run, stderr};
use mla_diff::backend::RunTables;
use mla_diff::gguf::GgufFile;
use mla_diff::model::{LayerWeights, MlaConfig, RopeFactors};
use mla_diff::schedule::Schedule;
use mla_diff::trace::Stage;
use std::path::{Path, PathBuf};

fn shipped() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    v.sort();
    v
}

/// Schedules that differ in what they stress: the default; MTP queries on small pages; long splits
/// in few chunks; many splits (some empty early) on one-row pages without shuffling.
const SCHEDULES: [&[&str]; 4] = [
    &[],
    &["--q-len", "3", "--decode-steps", "6", "--page-size", "8"],
    &[
        "--prompt-len",
        "150",
        "--chunk",
        "64",
        "--decode-steps",
        "4",
        "--num-splits",
        "2",
    ],
    &[
        "--prompt-len",
        "20",
        "--chunk",
        "7",
        "--decode-steps",
        "8",
        "--num-splits",
        "16",
        "--page-size",
        "1",
        "--no-shuffle",
    ],
];

fn run_clean(file: &Path, seed: u64, sched: &[&str]) {
    run_clean_in(file, seed, sched, "shadow");
}

/// `run_clean` in `--mode MODE`.
fn run_clean_in(file: &Path, seed: u64, sched: &[&str], mode: &str) {
    let seed = seed.to_string();
    let mut a = vec![
        "run",
        file.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        mode,
        "-q",
        "--seed",
        &seed,
    ];
    a.extend_from_slice(sched);
    let o = run(&a);
    assert_eq!(
        o.status.code(),
        Some(0),
        "false alarm: {} seed {seed} {sched:?}: {}{}",
        file.display(),
        String::from_utf8_lossy(&o.stdout),
        stderr(&o)
    );
}

/// 5 fixtures × 4 schedules × 5 seeds, less GLM-5's default schedule on seeds 3 and 4: 98 clean runs
/// (all layers of each file). Seed 1 on the default schedule runs in both modes: it is also
/// run_report's `mirror_passes_on_every_shipped_fixture` in bf16 on the default schedule (a default
/// run of GLM-5 costs ~20 CPU s; a second one bought nothing). GLM-5's default run judges 64 heads of
/// 132-token decode queries (`attn_heads[decode]` ~600k elements:
/// peaky_attention_on_the_default_schedule) at ~24 CPU s a seed, the other default runs 1–6: seeds 3
/// and 4 of it (~51 CPU s) are cut; seed 5 stays, the closest of the five to its end-to-end tolerance
/// (0.796 of it, against 0.697–0.780), and the other fixtures keep all five (docs/ci-time.md, ninth
/// session).
#[test]
fn clean_runs_pass_over_seeds_schedules_and_fixtures() {
    let files = shipped();
    assert_eq!(files.len(), 5, "{files:?}");
    for f in &files {
        let glm5 = f.file_name().is_some_and(|n| n == "glm-5-q4_0.gguf");
        for sched in SCHEDULES {
            let seeds: &[u64] = match glm5 && sched.is_empty() {
                true => &[1, 2, 5],
                false => &[1, 2, 3, 4, 5],
            };
            for &seed in seeds {
                let both = sched.is_empty() && seed == 1;
                run_clean_in(f, seed, sched, if both { "both" } else { "shadow" });
            }
        }
    }
}

/// The largest log-sum-exp of layer 0's fp64 reference on the default schedule: max score ≤ lse ≤
/// max score + ln(keys).
fn max_lse(file: &Path) -> f64 {
    let f = GgufFile::open(file).unwrap();
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    let sched = Schedule::default();
    let w = LayerWeights::load(&f, &cfg, 0).unwrap();
    let factors = RopeFactors::load(&f, &cfg).unwrap();
    let tables = RunTables::new(&cfg, factors.as_ref(), &sched).unwrap();
    let x = mla_diff::input::random_hidden(cfg.hidden, sched.total_tokens(), 0);
    let tr = mla_diff::reference::run_layer(&cfg, &w, &tables.rope, &x, &sched).unwrap();
    let lse = tr.get(Stage::Lse).unwrap();
    lse.data.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
}

/// The fixture with every attn_norm weight scaled by `k`: q and k_pe grow by k (the latent is
/// normalised again), so rope scores grow by k² and nope scores by k.
fn scaled(src: &Path, dst: &Path, k: f32) -> PathBuf {
    rewrite(
        src,
        dst,
        |_| {},
        |ts| {
            for t in ts
                .iter_mut()
                .filter(|t| t.name.ends_with(".attn_norm.weight"))
            {
                assert_eq!(t.type_id, 0, "{}: norm weights are F32", t.name);
                for c in t.bytes.chunks_exact_mut(4) {
                    let v = f32::from_le_bytes(c.try_into().unwrap()) * k;
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
        },
    )
}

/// A serving schedule of single-token decode steps (the default before #14's kernel-aware one).
const SERVING: &[&str] = &[
    "--prompt-len",
    "48",
    "--chunk",
    "32",
    "--decode-steps",
    "16",
    "--q-len",
    "1",
    "--page-size",
    "16",
    "--num-splits",
    "4",
];

/// f32 storage on the serving schedule, 5 fixtures × seeds 1–4. Before the combine's weight and Σw
/// roundings were in `attn_latent`'s noise model (a shared scaling of the row), one f32 run in ten
/// failed a row criterion there (glm-5 seed 1 at 1.06×, deepseek-v2-lite seed 2, deepseek-v3 legacy
/// seed 4); bf16's own rounding hid the missing term.
#[test]
fn f32_runs_pass_on_the_serving_schedule() {
    for f in shipped() {
        for seed in 1..=4 {
            let mut sched = SERVING.to_vec();
            sched.extend(["--dtype", "f32"]);
            run_clean(&f, seed, &sched);
        }
    }
}

#[test]
fn peaky_attention_with_max_scores_of_30_to_50_passes() {
    let dir = tempfile::tempdir().unwrap();
    for f in shipped() {
        let base = max_lse(&f);
        // Grow k by 1.5× until the largest lse reaches 30, then bisect down into 30–50.
        let path = dir.path().join("peaky.gguf");
        let at = |k: f32| max_lse(&scaled(&f, &path, k));
        let (mut lo, mut k, mut reached) = (1.0f32, 1.0f32, base);
        for _ in 0..30 {
            if reached >= 30.0 {
                break;
            }
            lo = k;
            k *= 1.5;
            reached = at(k);
        }
        let mut hi = k;
        for _ in 0..30 {
            if reached <= 50.0 {
                break;
            }
            k = (lo + hi) / 2.0;
            reached = at(k);
            if reached < 30.0 {
                lo = k;
            } else if reached > 50.0 {
                hi = k;
            }
        }
        assert!(
            (30.0..=50.0).contains(&reached),
            "{}: could not reach a max lse of 30–50 (base {base:.1}, last {reached:.1} at ×{k})",
            f.display()
        );
        let file = scaled(&f, &path, k);
        for seed in 0..3 {
            run_clean(&file, seed, SERVING);
        }
        eprintln!(
            "{}: attn_norm ×{k:.2}, max lse {base:.1} → {reached:.1}: clean",
            f.file_name().unwrap().to_string_lossy()
        );
    }
}

/// Once a false alarm (2026-12-01): on the kernel-aware default schedule (264 decode queries) the GLM-5
/// fixture with attn_norm ×3.38 (max LSE 40) failed `attn_heads[decode]`'s end-to-end elementwise
/// criterion in 3 of ~600k elements (ref 1.16, opt 2.28 at token 326, head 37): near-tied top scores of
/// ~40, each off by ~40·2⁻⁸ in bf16, swap which key dominates — a legitimate bf16 result that a fixed
/// end-to-end bound cannot allow for. The stage-local view, which decides, recomputes the attention from
/// the path's own rounded scores and passes it; the end-to-end finding stays in `end_to_end_reasons`.
#[test]
fn peaky_attention_on_the_default_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures_dir().join("glm-5-q4_0.gguf");
    let file = scaled(&f, &dir.path().join("peaky.gguf"), 3.38);
    run_clean(&file, 1, &[]);
}
