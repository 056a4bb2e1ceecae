//! FlashMLA's dense fp8 decode as the numpy runner plays it on the CPU (issue #38's last items): q and
//! the cache in e4m3 (`conventions.q_fp8`), P rounded to e4m3 before P·V (`p_fp8`), the QKᵀ summed
//! in a truncating e8m13 accumulator (`MLA_DIFF_NUMPY_QK_ACC=32:13`, declared `qk_acc: "e8m13"`), and
//! no split partials returned (`MLA_DIFF_NUMPY_NO_SPLITS=1`: the stage-local view merges splits of
//! its own). Declared, the kernel passes; the accumulator undeclared is caught at `lse[decode]@runner`,
//! and so is one narrower than declared (9 fraction bits declared as 13). Without the accumulator, the
//! view's own merge is over the q the kernel read (it used to be over q as computed, and blamed
//! "upstream of the runner").
//!
//! Needs MLA_DIFF_PYTHON with numpy (skips without it, fails under CI).

use crate::common::{fixture, python, runner};
use crate::runner_cache::SHORT;
use crate::runners::checks;
use serde_json::Value as J;

const FLASHMLA_FP8: &str =
    "MLA_DIFF_NUMPY_Q_FP8=1 MLA_DIFF_NUMPY_P_FP8=1 MLA_DIFF_NUMPY_NO_SPLITS=1";

fn run_fp8(file: &str, env: &str, py: &str, rel: &str) -> (Option<i32>, J, String) {
    let cmd = format!("env {env} {}", runner(py, rel));
    let args = [&["--kv-cache-dtype", "fp8", "--dtype", "bf16"][..], SHORT].concat();
    crate::runners::run_json(&fixture(file), &cmd, &args)
}

/// Every decode check of every layer named `name`, with its local verdict: (pass, local pass).
fn verdicts(rep: &J, name: &str) -> Vec<(bool, bool)> {
    let v: Vec<(bool, bool)> = checks(rep)
        .into_iter()
        .filter(|x| x["check"] == name)
        .map(|x| (x["pass"] == true, x["local"]["pass"] == true))
        .collect();
    assert!(!v.is_empty(), "no {name} check");
    v
}

/// Every decode check of the kernel's outputs passes, end to end and locally.
fn decode_passes(rep: &J, what: &str) {
    for c in [
        "lse[decode]@runner",
        "lse[decode]",
        "attn_latent@runner",
        "attn_latent",
    ] {
        let v = verdicts(rep, c);
        assert!(v.iter().all(|&(p, l)| p && l), "{what} {c}: {v:?}");
    }
}

#[test]
fn an_e8m13_qk_accumulator_is_judged_as_declared() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let env = format!("{FLASHMLA_FP8} MLA_DIFF_NUMPY_QK_ACC=32:13");
    for f in ["glm-5-q4_0.gguf", "deepseek-v3-yarn-q4_k.gguf"] {
        let (code, rep, err) = run_fp8(f, &env, &py, "numpy_mla.py");
        assert_eq!(code, Some(0), "{f}: {err}");
        assert_eq!(
            rep["environment"]["runner"]["conventions"]["qk_acc"],
            "e8m13"
        );
        assert!(rep["run"]["notices"]
            .to_string()
            .contains("conventions.qk_acc"));
        decode_passes(&rep, f);
        // Undeclared, the same kernel is judged as an f32 sum: ~10⁴× the predicted LSE noise.
        let (code, rep, err) = run_fp8(f, &env, &py, "bugs/cache/qk_acc_undeclared.py");
        assert_eq!(code, Some(1), "{f}: not caught: {err}");
        assert!(rep["environment"]["runner"]["conventions"]["qk_acc"].is_null());
        assert!(
            verdicts(&rep, "lse[decode]@runner")
                .iter()
                .any(|&(p, _)| !p),
            "{f}: undeclared passes lse[decode]@runner"
        );
        // Declared, an accumulator of 9 fraction bits said to be 13 is caught there too.
        let (code, rep, err) = run_fp8(f, &env, &py, "bugs/cache/qk_acc_narrow.py");
        assert_eq!(code, Some(1), "{f}: e8m9 as e8m13 not caught: {err}");
        assert_eq!(
            rep["environment"]["runner"]["conventions"]["qk_acc"],
            "e8m13"
        );
        assert!(
            verdicts(&rep, "lse[decode]@runner")
                .iter()
                .any(|&(p, l)| !p && !l),
            "{f}: e8m9 passes lse[decode]@runner"
        );
    }
}

/// With q in e4m3 and no partials returned, the view merges splits of its own over the q the kernel
/// read (`LayerTrace::q_scale`): the clean kernel passes every decode check, locally too (it failed
/// `attn_latent` and `lse[decode]` locally, blamed "upstream of the runner"); the cache's scale
/// applied twice (FlashMLA's planted `descale_k` = s², numpy's copy) is still caught at the runner.
#[test]
fn the_views_own_merge_is_over_the_q_the_kernel_read() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let (code, rep, err) = run_fp8("glm-5-q4_0.gguf", FLASHMLA_FP8, &py, "numpy_mla.py");
    assert_eq!(code, Some(0), "{err}");
    let outs = &rep["environment"]["runner"]["ops"]["decode"]["outputs"];
    assert_eq!(outs.as_array().map(Vec::len), Some(2), "{outs}");
    decode_passes(&rep, "glm-5");
    let (code, rep, err) = run_fp8(
        "glm-5-q4_0.gguf",
        FLASHMLA_FP8,
        &py,
        "bugs/cache/fp8_scale_twice.py",
    );
    assert_eq!(code, Some(1), "scale twice not caught: {err}");
    assert!(
        verdicts(&rep, "attn_latent@runner")
            .iter()
            .any(|&(p, _)| !p),
        "scale twice passes attn_latent@runner"
    );
}

/// A `qk_acc` mla-diff can't model, or one named by a runner that does not read q in fp8, is refused
/// before any layer: exit 2, one line naming it.
#[test]
fn a_bad_or_misplaced_qk_acc_is_refused_in_one_line() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let f = fixture("glm-5-q4_0.gguf");
    for (name, acc, env, needle) in [
        (
            "wide.py",
            "e8m40",
            "MLA_DIFF_NUMPY_Q_FP8=1",
            "conventions.qk_acc \"e8m40\" is not an accumulator mla-diff knows",
        ),
        (
            "no_q_fp8.py",
            "e8m13",
            "X=1",
            "but the runner does not read q in fp8 (no conventions.q_fp8)",
        ),
    ] {
        let edit = format!("d['conventions']['qk_acc'] = {acc:?}");
        let p = crate::common::numpy_variant(dir.path(), name, &edit);
        let o = crate::common::run(&[
            "run",
            f.to_str().unwrap(),
            "--backend",
            "cpu",
            "--kv-cache-dtype",
            "fp8",
            "--runner",
            &format!("env {env} {py} {}", p.display()),
            "-q",
        ]);
        crate::common::assert_clean_error(&o, needle);
    }
}
