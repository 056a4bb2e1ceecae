//! External runners (docs/runners.md) end to end through the real protocol: the numpy runner passes on
//! every shipped fixture, each planted bug in a copy of it is caught at the runner's stage (end to end
//! and against fp64 from its own inputs), an upstream error is told apart from a runner error, and a
//! runner that cannot take the case, or breaks, is a clean exit-2 error.
//!
//! Needs the interpreter named by MLA_DIFF_PYTHON with numpy and safetensors (.ci/run installs them);
//! without it the tests skip, except under CI where they fail.

use crate::common::{assert_clean_error, fixture, fixtures_dir, python, run, runner, stderr};
use serde_json::Value as J;
use std::path::{Path, PathBuf};

/// `run FILE --backend cpu --runner CMD --mode shadow --json -` plus `extra`; exit code and report.
pub(crate) fn run_json(file: &Path, cmd: &str, extra: &[&str]) -> (Option<i32>, J, String) {
    let mut args = vec![
        "run",
        file.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--runner",
        cmd,
        "--json",
        "-",
        "-q",
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    let j = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
    (o.status.code(), j, stderr(&o))
}

pub(crate) fn checks(report: &J) -> Vec<&J> {
    report["modes"][0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["checks"].as_array().unwrap())
        .collect()
}

fn shipped_fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    v.sort();
    v
}

/// The stages a runner produces, end to end and at the runner.
const RUNNER_CHECKS: [&str; 6] = [
    "lse[prefill]",
    "attn_heads[prefill]",
    "split_out",
    "split_lse",
    "attn_latent",
    "lse[decode]",
];

/// A short schedule that still has a chunked prefill and a split decode: for runs whose point is not
/// the default schedule (a default run of a 64-head fixture through a Python runner costs ~20 CPU s
/// here, this one ~1).
pub const SHORT: &[&str] = &[
    "--prompt-len",
    "40",
    "--decode-steps",
    "2",
    "--num-splits",
    "2",
];

/// The outputs a runner returns, each in `DT[(a·i + k) % 3]` for output `i`: `MLA_DIFF_NUMPY_DTYPES`.
fn output_dtypes(a: usize, k: usize) -> String {
    const OUTS: [&str; 6] = [
        "decode.attn_latent",
        "decode.lse",
        "decode.split_out",
        "decode.split_lse",
        "prefill.attn_heads",
        "prefill.lse",
    ];
    const DT: [&str; 3] = ["bf16", "fp16", "f32"];
    let combo: Vec<String> = OUTS
        .iter()
        .enumerate()
        .map(|(i, o)| format!("{o}={}", DT[(a * i + k) % 3]))
        .collect();
    combo.join(",")
}

/// GLM-5's default run (~36 CPU s through the runner) returns mixed output dtypes (`output_dtypes(1,
/// 0)`): it is also `every_output_dtype_combination_passes`' one combination on the default schedule.
#[test]
fn numpy_runner_passes_on_every_shipped_fixture() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let plain = runner(&py, "numpy_mla.py");
    let mixed = format!("env MLA_DIFF_NUMPY_DTYPES={} {plain}", output_dtypes(1, 0));
    let files = shipped_fixtures();
    assert!(files.len() >= 5, "{files:?}");
    for f in &files {
        let glm5 = f.file_name().is_some_and(|n| n == "glm-5-q4_0.gguf");
        let cmd = if glm5 { &mixed } else { &plain };
        let (code, rep, err) = run_json(f, cmd, &[]);
        assert_eq!(code, Some(0), "{}: {err}", f.display());
        if glm5 {
            let notes = rep["run"]["notices"].to_string();
            assert!(notes.contains("attn_latent bf16"), "{notes}");
            assert!(notes.contains("split_lse bf16"), "{notes}");
        }
        let at: Vec<&str> = checks(&rep)
            .iter()
            .filter_map(|c| c["check"].as_str())
            .filter(|n| n.ends_with("@runner"))
            .collect();
        for c in RUNNER_CHECKS {
            assert!(
                at.contains(&format!("{c}@runner").as_str()),
                "{}: no {c}@runner in {at:?}",
                f.display()
            );
        }
        let env = rep["environment"]["backend"].as_str().unwrap();
        assert!(env.starts_with("runner numpy"), "{env}");
        // Coverage: the runner's kernels are external, their tile classes unknown and said to be;
        // a runner gets the covering default schedule too (#32: q_len > 1, an empty split, splits of
        // two tiles), with its serving batch, padding and input checks passing.
        let cov = &rep["coverage"];
        assert!(cov["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["family"] == "external" && k.get("geometry").is_none()));
        assert!(cov["classes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["class"] == "two_full_tiles" && c["count"].is_null()));
        assert!(cov["warnings"]
            .to_string()
            .contains("unknown tile geometry"));
        assert_eq!(rep["run"]["schedule"]["prompt_len"], 131, "{}", f.display());
        assert_eq!(
            rep["runner_checks"]["pass"], true,
            "{}",
            rep["runner_checks"]
        );
    }
    // Other dtypes and MTP queries (q_len 2: causal within the step) on one file.
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    for extra in [
        &["--dtype", "fp16"][..],
        &["--dtype", "f32"],
        &["--q-len", "2", "--decode-steps", "5"],
    ] {
        let (code, _, err) = run_json(&f, &plain, extra);
        assert_eq!(code, Some(0), "{extra:?}: {err}");
    }
}

#[test]
fn planted_runner_bugs_are_caught_at_the_runners_stage() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    for bug in [
        "scale_default.py",
        "lse_base2.py",
        "kpe_latent_swapped.py",
        "page_size.py",
        "prefill_noncausal.py",
    ] {
        for file in ["deepseek-v3-yarn-q4_k.gguf", "glm-5-q4_0.gguf"] {
            // The classic schedule: these bugs need no long split (CI time; the default schedule's
            // reach is tests/it/runners_reach.rs's).
            let classic = [
                "--prompt-len",
                "48",
                "--chunk",
                "32",
                "--decode-steps",
                "16",
                "--num-splits",
                "4",
            ];
            let (code, rep, err) = run_json(
                &fixture(file),
                &runner(&py, &format!("bugs/{bug}")),
                &classic,
            );
            assert_eq!(code, Some(1), "{bug} on {file} was not caught: {err}");
            let layer = &rep["modes"][0]["layers"][0];
            let first = layer["first_failure"].as_str().unwrap();
            assert!(
                RUNNER_CHECKS.contains(&first),
                "{bug} on {file}: first failure {first}, not a runner stage"
            );
            let all = checks(&rep);
            // Everything upstream of the runner is the inner path's and stays clean.
            for c in &all {
                let name = c["check"].as_str().unwrap();
                let runner_side = name.ends_with("@runner")
                    || RUNNER_CHECKS.contains(&name)
                    || name.starts_with("attn_heads")
                    || name.starts_with("attn_out");
                if !runner_side {
                    assert!(
                        c["pass"].as_bool().unwrap(),
                        "{bug}: {name} failed upstream"
                    );
                }
            }
            // And the runner's own error shows against fp64 from its inputs.
            assert!(
                all.iter()
                    .any(|c| c["check"].as_str().unwrap().ends_with("@runner")
                        && !c["pass"].as_bool().unwrap()),
                "{bug} on {file}: no @runner check failed"
            );
        }
    }
}

/// A bug upstream of a clean runner fails end to end but not at the runner: the attribution.
#[test]
fn an_upstream_error_passes_at_the_runner() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let (code, rep, err) = run_json(&f, &runner(&py, "numpy_mla.py"), &["--inject", "rope_neox"]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(rep["modes"][0]["layers"][0]["first_failure"], "q_pe");
    for c in checks(&rep) {
        let name = c["check"].as_str().unwrap();
        if name.ends_with("@runner") {
            assert!(c["pass"].as_bool().unwrap(), "{name} failed: {c}");
        }
    }
}

/// A throwaway runner script.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

const DESCRIBE: &str = r#"
import json, sys
D = {"protocol": 1, "name": "test", "version": "0", "ops": {"decode": {"outputs": ["attn_latent", "lse"]}},
     "supports": {"page_sizes": [64]}, "conventions": {}}
if sys.argv[1] == "--describe":
    print(json.dumps(D)); sys.exit(0)
"#;

#[test]
fn a_case_the_runner_cannot_take_is_unsupported_not_a_verdict() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let f = f.to_str().unwrap();
    let go = |s: &Path, extra: &[&str]| {
        let cmd = format!("{py} {}", s.display());
        let mut a = vec!["run", f, "--backend", "cpu", "--runner", &cmd, "-q"];
        a.extend_from_slice(extra);
        run(&a)
    };
    // Its description says page 64 only; the run's page is 16, asked for.
    let s = script(
        dir.path(),
        "page64.py",
        &format!("{DESCRIBE}\nsys.exit(1)\n"),
    );
    assert_clean_error(
        &go(&s, &["--page-size", "16"]),
        "does not support page_size 16 (it takes [64])",
    );
    // It says so itself when asked: exit code 3 from --describe, or an unsupported reply.
    let s = script(
        dir.path(),
        "exit3.py",
        "import sys\nprint('no SM90 GPU here', file=sys.stderr)\nsys.exit(3)\n",
    );
    assert_clean_error(&go(&s, &[]), "no SM90 GPU here");
    let s = script(
        dir.path(),
        "reply.py",
        &format!(
            "{DESCRIBE}\nfor line in sys.stdin:\n    r = json.loads(line)\n    print(json.dumps({{'id': r['id'], 'status': 'unsupported', 'reason': 'batch too large'}}), flush=True)\n"
        ),
    );
    let o = go(&s, &["--page-size", "64"]);
    assert_clean_error(&o, "batch too large");
    assert!(stderr(&o).contains("unsupported") || stderr(&o).contains("cannot take"));
}

#[test]
fn a_broken_runner_is_a_clean_error() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let f = f.to_str().unwrap();
    let go = |cmd: &str| {
        run(&[
            "run",
            f,
            "--backend",
            "cpu",
            "--runner",
            cmd,
            "--page-size",
            "64",
            "-q",
        ])
    };
    assert_clean_error(&go("/nonexistent/runner --x"), "cannot start it");
    assert_clean_error(&go(""), "--runner is empty");
    let s = script(dir.path(), "junk.py", "print('hello')\n");
    assert_clean_error(
        &go(&format!("{py} {}", s.display())),
        "did not print a valid description",
    );
    let s = script(
        dir.path(),
        "chatty.py",
        &format!("{DESCRIBE}\nfor line in sys.stdin:\n    print('loading torch...', flush=True)\n"),
    );
    assert_clean_error(
        &go(&format!("{py} {}", s.display())),
        "stdout carries only replies",
    );
    let s = script(
        dir.path(),
        "crash.py",
        &format!("{DESCRIBE}\nsys.stdin.readline()\nraise RuntimeError('CUDA error: illegal memory access')\n"),
    );
    assert_clean_error(
        &go(&format!("{py} {}", s.display())),
        "illegal memory access",
    );
    // Outputs of the wrong shape.
    let s = script(
        dir.path(),
        "shape.py",
        &format!(
            "{DESCRIBE}\nimport numpy as np\nfrom safetensors.numpy import save_file\nfor line in sys.stdin:\n    r = json.loads(line)\n    save_file({{'attn_latent': np.zeros((1, 2), np.float32), 'lse': np.zeros((1,), np.float32)}}, r['output'])\n    print(json.dumps({{'id': r['id'], 'status': 'ok'}}), flush=True)\n"
        ),
    );
    assert_clean_error(&go(&format!("{py} {}", s.display())), "has shape [1, 2]");
}

/// A capsule replays through a runner: the repro a user attaches, rerun on someone else's kernel.
#[test]
fn a_capsule_replays_through_a_runner() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("cap");
    let f = fixture("glm-5-q4_0.gguf");
    let o = run(&[
        "export",
        f.to_str().unwrap(),
        "--layers",
        "0",
        "-o",
        cap.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let replay = |cmd: &str| {
        run(&[
            "replay",
            cap.to_str().unwrap(),
            "--backend",
            "cpu",
            "--runner",
            cmd,
            "--json",
            "-",
            "-q",
        ])
    };
    let o = replay(&runner(&py, "numpy_mla.py"));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = replay(&runner(&py, "bugs/kpe_latent_swapped.py"));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let rep: J = serde_json::from_slice(&o.stdout).unwrap();
    let first = rep["modes"][0]["layers"][0]["first_failure"]
        .as_str()
        .unwrap();
    assert!(RUNNER_CHECKS.contains(&first), "{first}");
}

/// A correct runner may return each output in any dtype the protocol allows (bf16, fp16, f32): with
/// exact values it passes, whatever the combination. The downstream recomputation and the stage-local
/// view agree about rounding a wider `attn_latent` to the run's dtype, and partials returned in a
/// 16-bit type are bounded by that type. Every output in every dtype, over rotations that pair them
/// up, in bf16 and fp16 runs.
#[test]
fn every_output_dtype_combination_passes() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let plain = runner(&py, "numpy_mla.py");
    let f = fixture("glm-5-q4_0.gguf");
    let mut cases = Vec::new();
    for run_dt in ["bf16", "fp16"] {
        // a = 0 all alike, a = 1, 2 mixed.
        for a in 0..3 {
            for k in 0..3 {
                if run_dt == "fp16" && a != 1 {
                    continue;
                }
                cases.push((run_dt, output_dtypes(a, k)));
            }
        }
    }
    for (run_dt, combo) in &cases {
        let cmd = format!("env MLA_DIFF_NUMPY_DTYPES={combo} {plain}");
        // The dtypes are bounded per element, whatever the schedule: a short one that still has a
        // chunked prefill and split decode (a default run costs ~20 CPU s here, the short one ~1).
        // One mixed combination (bf16, `output_dtypes(1, 0)`) also runs on the default schedule, its
        // batches and runner checks: numpy_runner_passes_on_every_shipped_fixture's GLM-5 run.
        let mut args = vec!["--dtype", run_dt];
        args.extend(SHORT);
        let (code, rep, err) = run_json(&f, &cmd, &args);
        assert_eq!(code, Some(0), "{run_dt} run, {combo}: {err}");
        // The report records the dtypes as returned.
        let notes = rep["run"]["notices"].to_string();
        let lat = combo.split(',').next().unwrap().split('=').nth(1).unwrap();
        assert!(notes.contains(&format!("attn_latent {lat}")), "{notes}");
    }
}

/// The report's `environment.runner` (docs/runners.md): what the runner declared, the dtype each
/// output came back in and the command, valid against schema/report.schema.json.
#[test]
fn the_report_records_the_runner_in_its_environment() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = format!(
        "env MLA_DIFF_NUMPY_DTYPES=decode.lse=bf16 {}",
        runner(&py, "numpy_mla.py")
    );
    let (code, rep, err) = run_json(&fixture("glm-5-q4_0.gguf"), &cmd, SHORT);
    assert_eq!(code, Some(0), "{err}");
    let errors = crate::common::schema_errors(&crate::common::report_validator(), &rep);
    assert!(errors.is_empty(), "{errors:?}");
    let r = &rep["environment"]["runner"];
    assert_eq!(r["name"], "numpy", "{r:#}");
    assert!(
        r["version"].as_str().unwrap().contains("numpy_mla.py"),
        "{r:#}"
    );
    assert_eq!(r["command"], cmd.as_str());
    assert_eq!(
        r["ops"]["decode"]["outputs"],
        serde_json::json!(["attn_latent", "lse", "split_out", "split_lse"])
    );
    assert_eq!(
        r["supports"]["dtypes"],
        serde_json::json!(["bf16", "fp16", "f32"])
    );
    assert!(r["supports"]["page_sizes"].is_null(), "{r:#}");
    assert_eq!(r["conventions"]["lse_base"], "e");
    assert_eq!(r["batch_invariant"], true);
    assert_eq!(r["returned_dtypes"]["lse[decode]"], "bf16", "{r:#}");
    assert_eq!(r["returned_dtypes"]["attn_latent"], "bf16", "{r:#}");
    assert_eq!(r["returned_dtypes"]["lse[prefill]"], "f32", "{r:#}");
    // Without a runner there is none.
    let f = fixture("glm-5-q4_0.gguf");
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--prompt-len",
        "40",
        "--json",
        "-",
        "-q",
    ]);
    let j: J = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        j["environment"].get("runner").is_none(),
        "{}",
        j["environment"]
    );
}

/// One error model decides the stage-local check and its `@runner` twin: P·V accumulated in fp16 (in
/// k-steps of 8 keys) in an fp16 run fails `split_out` locally and `split_out@runner` alike (the flat
/// storage bound let it pass, and the reading rule then blamed upstream), and the verdict line names
/// the runner's kernel as the culprit.
#[test]
fn a_kernel_error_fails_at_the_runner_by_the_local_model() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let cmd = runner(&py, "bugs/pv_fp16_accum.py");
    // The classic schedule (16 single-token decode steps in 4 splits) shows it; the default one too,
    // at many times the cost (the bug's fp16 arithmetic is emulated in numpy, per key chunk).
    let classic = [
        "--dtype",
        "fp16",
        "--prompt-len",
        "48",
        "--chunk",
        "32",
        "--decode-steps",
        "16",
        "--num-splits",
        "4",
    ];
    let (code, rep, err) = run_json(&f, &cmd, &classic);
    assert_eq!(code, Some(1), "{err}");
    let layer = &rep["modes"][0]["layers"][0];
    assert_eq!(layer["first_failure"], "split_out", "{err}");
    let at = checks(&rep)
        .into_iter()
        .find(|c| c["check"] == "split_out@runner")
        .unwrap();
    assert_eq!(at["pass"], false, "{at}");
    assert!(at["local"].is_object(), "judged by the local model: {at}");
    assert!(
        err.contains("culprit: the runner's kernel (split_out@runner fails too"),
        "{err}"
    );
}

/// Empty splits are judged by their LSE: a kernel that leaves their `split_out` unwritten (NaN, as a
/// `torch.empty` buffer) with `split_lse` −inf and merges them out passes (the report says so); one
/// whose merge multiplies the garbage by its zero weight (0·NaN) fails at `attn_latent`.
#[test]
fn empty_splits_are_judged_by_their_lse() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let plain = runner(&py, "numpy_mla.py");
    let cmd = |mode: &str| format!("env MLA_DIFF_NUMPY_EMPTY_SPLITS={mode} {plain}");
    // 49.. keys in 16 splits of ⌈L/16⌉: the last splits are empty.
    let (code, rep, err) = run_json(&f, &cmd("nan"), &["--num-splits", "16"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        rep["run"]["notices"]
            .to_string()
            .contains("empty splits' split_out"),
        "{}",
        rep["run"]["notices"]
    );
    let (code, rep, err) = run_json(&f, &cmd("nan-naive-merge"), &["--num-splits", "16"]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(rep["modes"][0]["layers"][0]["first_failure"], "attn_latent");
}

/// A runner that hangs does not hang `run` or `lint`: past `--runner-timeout` it is killed, and the
/// run stops with one exit-2 line naming the runner, the op and the layer (or `--describe`).
#[test]
fn a_hung_runner_times_out() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let f = f.to_str().unwrap();
    let hang = script(
        dir.path(),
        "hang.py",
        &format!("{DESCRIBE}\nimport time\nsys.stdin.readline()\ntime.sleep(600)\n"),
    );
    let cmd = format!("{py} {}", hang.display());
    let t0 = std::time::Instant::now();
    let o = run(&[
        "run",
        f,
        "--backend",
        "cpu",
        "--runner",
        &cmd,
        "--page-size",
        "64",
        "--runner-timeout",
        "2",
        "-q",
    ]);
    assert_clean_error(&o, "runner test did not answer layer 0 decode within 2 s");
    let o = run(&[
        "lint",
        f,
        "--runner",
        &cmd,
        "--page-size",
        "64",
        "--runner-timeout",
        "2",
    ]);
    assert_clean_error(&o, "runner test did not answer layer 0 decode within 2 s");
    let slow = script(dir.path(), "slow.py", "import time\ntime.sleep(600)\n");
    let o = run(&[
        "run",
        f,
        "--backend",
        "cpu",
        "--runner",
        &format!("{py} {}", slow.display()),
        "--runner-timeout",
        "2",
        "-q",
    ]);
    assert_clean_error(&o, "did not answer --describe within 2 s");
    assert!(t0.elapsed().as_secs() < 60, "{:?}", t0.elapsed());
}

/// `supports` keys mla-diff does not know are an error naming the near key (they read as "any"
/// before); a runner whose `page_sizes` excludes the default page gets one it takes, and the report
/// says so (an explicit --page-size it does not take is still refused).
#[test]
fn supports_are_read_strictly_and_the_page_fits_the_runner() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let typo = script(
        dir.path(),
        "typo.py",
        &DESCRIBE.replace("\"page_sizes\"", "\"page_size\""),
    );
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--runner",
        &format!("{py} {}", typo.display()),
        "-q",
    ]);
    assert_clean_error(
        &o,
        "supports has an unknown key 'page_size' (did you mean 'page_sizes'?)",
    );
    let p64 = crate::common::numpy_variant(
        dir.path(),
        "numpy64.py",
        "d['supports']['page_sizes'] = [64]",
    );
    let (code, rep, err) = run_json(&f, &format!("{py} {}", p64.display()), &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(rep["run"]["schedule"]["page_size"], 64);
    assert!(
        rep["run"]["notices"].to_string().contains("page size 64"),
        "{}",
        rep["run"]["notices"]
    );
}

/// `--inject` of a fault that first shows in a stage the runner replaces would change nothing: refused,
/// one exit-2 line (a fault upstream of the runner still runs: `an_upstream_error_passes_at_the_runner`).
#[test]
fn inject_into_a_replaced_stage_is_refused() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--runner",
        &runner(&py, "numpy_mla.py"),
        "--inject",
        "split_drop_last",
        "-q",
    ]);
    assert_clean_error(&o, "--inject split_drop_last plants its bug where it first shows, attn_latent, which runner numpy replaces");
}
