//! FlashMLA's sparse prefill runner (`runners/flashmla_sparse.py`, op `sparse_prefill`; docs/dsa.md) on a
//! DSA file past top_k, through the real protocol, with its numpy stand-in for `flash_mla_sparse_fwd`
//! (`MLA_DIFF_FLASHMLA_STANDIN=numpy`: no GPU here): a clean run passes with the runner's checks, a
//! planted kernel bug (the −1 padding read as the last cache row) is caught at the runner's stages, and
//! what the runner cannot take (no flash_mla, fp16, a dense layer) is a clean exit-2 error.
//!
//! Needs MLA_DIFF_PYTHON with numpy (skipped without it, except under CI).

use crate::common::{
    assert_clean_error, bin, fixture, python, report_validator, runner, schema_errors,
    selftest_dsa_fixture, stderr,
};
use serde_json::Value as J;
use std::process::Output;

const STANDIN: &str = "MLA_DIFF_FLASHMLA_STANDIN";

/// `run FILE --backend cpu --mode shadow --runner CMD --json -` on 40 prompt tokens in chunks of 16
/// (24 queries past top_k 16) and 3 decode steps, with the stand-in on unless `standin` is false.
fn go(file: &str, cmd: &str, standin: bool, extra: &[&str]) -> Output {
    let mut c = bin();
    c.args([
        "run",
        file,
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--prompt-len",
        "40",
        "--chunk",
        "16",
        "--decode-steps",
        "3",
        "--page-size",
        "8",
        "--runner",
        cmd,
        "--json",
        "-",
        "-q",
    ])
    .args(extra);
    match standin {
        true => c.env(STANDIN, "numpy"),
        false => c.env_remove(STANDIN),
    };
    c.output().expect("run mla-diff")
}

fn checks(rep: &J) -> Vec<&J> {
    rep["modes"][0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["checks"].as_array().unwrap())
        .collect()
}

#[test]
fn sparse_prefill_runner_passes_past_top_k_with_its_own_checks() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let f = selftest_dsa_fixture();
    let o = go(
        f.to_str().unwrap(),
        &runner(&py, "flashmla_sparse.py"),
        true,
        &[],
    );
    let rep: J = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let cs = checks(&rep);
    for name in ["lse[prefill]@runner", "attn_heads[prefill]@runner"] {
        let at: Vec<&&J> = cs.iter().filter(|c| c["check"] == name).collect();
        assert!(!at.is_empty(), "no {name} check");
        for c in at {
            assert_eq!(c["pass"], true, "{c}");
            // Not a vacuous check: the stand-in's bf16 output differs from fp64 by its rounding.
            let e = c["metrics"]["rel_l2"].as_f64().unwrap_or(f64::NAN);
            assert!(e > 0.0 && e < 1e-2, "{name}: rel_l2 {e}");
        }
    }
    let text = rep.to_string();
    assert!(
        text.contains("sparse_prefill"),
        "notice/describe: {text:.2000}"
    );
    assert!(text.contains("STAND-IN"), "the report names the stand-in");
    // The DSA section is there, and passes (the runner does not change the indexer's selection).
    let dsa = &rep["dsa"];
    assert!(!dsa.is_null(), "no dsa section");
    assert_eq!(dsa["pass"], true, "{dsa}");
    let errs = schema_errors(&report_validator(), &rep);
    assert!(errs.is_empty(), "{errs:?}");
}

#[test]
fn a_sparse_kernel_that_reads_the_padding_is_caught_at_the_runner() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let f = selftest_dsa_fixture();
    let o = go(
        f.to_str().unwrap(),
        &runner(&py, "bugs/sparse/minus_one_wraps.py"),
        true,
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let rep: J = serde_json::from_slice(&o.stdout).unwrap();
    let failing: Vec<&str> = checks(&rep)
        .iter()
        .filter(|c| c["pass"] == false)
        .filter_map(|c| c["check"].as_str())
        .collect();
    assert!(
        failing.contains(&"lse[prefill]@runner") && failing.contains(&"attn_heads[prefill]@runner"),
        "{failing:?}"
    );
    // Upstream of the runner nothing moved.
    for clean in ["q_nope", "q_pe", "kv_latent", "k_pe", "cache_rows"] {
        assert!(!failing.contains(&clean), "{clean} failed: {failing:?}");
    }
}

#[test]
fn what_the_sparse_runner_cannot_take_is_a_clean_error() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let f = selftest_dsa_fixture();
    let f = f.to_str().unwrap();
    let cmd = runner(&py, "flashmla_sparse.py");
    // Without the stand-in it needs torch, an SM90 GPU and flash_mla: none of them here (exit 3).
    assert_clean_error(&go(f, &cmd, false, &[]), "is unsupported here");
    // flash_mla_sparse_fwd is bf16 only.
    assert_clean_error(
        &go(f, &cmd, true, &["--dtype", "fp16"]),
        "does not support dtype fp16",
    );
    // A dense layer (a model without an indexer) has nothing for it.
    let dense = fixture("deepseek-v3-yarn-q4_k.gguf");
    assert_clean_error(
        &go(dense.to_str().unwrap(), &cmd, true, &[]),
        "has only sparse_prefill",
    );
}

/// `runners/selfcheck.py` drives the runner alone (no mla-diff) through sparse_prefill requests at
/// DeepSeek's 128 and GLM-5's 64 heads (top_k not a multiple of 128, pages shuffled, NaN slots) against
/// float64: the stand-in passes, the planted padding bug fails, fp16 is ruled out by its describe.
#[test]
fn selfcheck_drives_the_sparse_runner() {
    let Some(py) = python("the sparse runner's selfcheck", "numpy") else {
        return;
    };
    let sc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners/selfcheck.py");
    let go = |rel: &str| {
        std::process::Command::new(&py)
            .arg(&sc)
            .args(["--runner", &runner(&py, rel)])
            .args(["--dtypes", "bf16,fp16", "--cases", "deepseek,glm5"])
            .env(STANDIN, "numpy")
            .output()
            .unwrap()
    };
    let o = go("flashmla_sparse.py");
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    assert!(out.contains("6 checks passed, 0 failed"), "{out}");
    assert!(out.contains("dtypes fp16 not in ['bf16']"), "{out}");
    let o = go("bugs/sparse/minus_one_wraps.py");
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("failing: sparse_prefill.attn_latent sparse_prefill.lse"),
        "{out}"
    );
}
