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
fn run_json(file: &Path, cmd: &str, extra: &[&str]) -> (Option<i32>, J, String) {
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

fn checks(report: &J) -> Vec<&J> {
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

#[test]
fn numpy_runner_passes_on_every_shipped_fixture() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = runner(&py, "numpy_mla.py");
    let files = shipped_fixtures();
    assert!(files.len() >= 5, "{files:?}");
    for f in &files {
        let (code, rep, err) = run_json(f, &cmd, &[]);
        assert_eq!(code, Some(0), "{}: {err}", f.display());
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
        let (code, _, err) = run_json(&f, &cmd, extra);
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
    // Its description says page 64 only; the run's page is 16.
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
