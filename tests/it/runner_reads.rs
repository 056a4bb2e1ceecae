//! Decode kernels that read a quantized cache less precisely than its bytes, by design, and declare it
//! (docs/runners.md "The kernel's own reads", issue #38): `conventions.cache_dequant: "dtype"` (the
//! dequantized rows rounded to the run's dtype, vLLM's Triton decode over the `fp8` cache) and
//! `conventions.p_fp8: "fp8"` (P rounded to e4m3 before P·V, FlashMLA's dense fp8 decode). Declared,
//! a correct kernel passes; the same reading undeclared is caught at the runner; a planted bug of
//! another kind is still caught with the declaration.
//!
//! The numpy runner plays both kernels (`MLA_DIFF_NUMPY_CACHE_IN_DTYPE=1`, `MLA_DIFF_NUMPY_P_FP8=1`).
//! Needs MLA_DIFF_PYTHON with numpy (skips without it, fails under CI).

use crate::common::{fixture, python, runner};
use crate::runner_cache::SHORT;
use crate::runners::checks;
use serde_json::Value as J;

/// GLM-5 over the per-tensor `fp8` cache on runner_cache's short schedule (two decode steps over two
/// splits): the CPU repro of vLLM's fp8 false alarm (split_lse@runner ~10³ times its predicted rel-L2;
/// the decode is where it shows: a 40-token prompt runs it in ~2.5 s, 160 tokens in ~45 s).
fn run_fp8(cmd: &str, dtype: &str) -> (Option<i32>, J, String) {
    let args = [&["--kv-cache-dtype", "fp8", "--dtype", dtype][..], SHORT].concat();
    crate::runners::run_json(&fixture("glm-5-q4_0.gguf"), cmd, &args)
}

fn check<'a>(rep: &'a J, name: &str) -> Option<&'a J> {
    checks(rep).into_iter().find(|x| x["check"] == name)
}

fn passes(rep: &J, name: &str) -> bool {
    check(rep, name).is_some_and(|x| x["pass"] == true)
}

fn fails(rep: &J, name: &str) -> bool {
    check(rep, name).is_some_and(|x| x["pass"] == false)
}

#[test]
fn a_cache_rounded_to_the_dtype_is_judged_as_declared() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let declared = format!(
        "env MLA_DIFF_NUMPY_CACHE_IN_DTYPE=1 {}",
        runner(&py, "numpy_mla.py")
    );
    let (code, rep, err) = run_fp8(&declared, "bf16");
    assert_eq!(code, Some(0), "{err}");
    let conv = &rep["environment"]["runner"]["conventions"];
    assert_eq!(conv["cache_dequant"], "dtype", "{conv}");
    for c in [
        "split_lse@runner",
        "split_out@runner",
        "attn_latent@runner",
        "lse[decode]@runner",
        "split_lse",
        "attn_latent",
    ] {
        assert!(passes(&rep, c), "{c}: {:?}", check(&rep, c));
    }
    assert_eq!(rep["runner_checks"]["pass"], true);
    assert!(rep["run"]["notices"]
        .to_string()
        .contains("conventions.cache_dequant"));
    // The same reading undeclared: judged over the rows as decoded, the kernel's own rounding is
    // ~10³ times the split LSEs' predicted error.
    let bug = runner(&py, "bugs/cache/cache_in_dtype_undeclared.py");
    let (code, rep, err) = run_fp8(&bug, "bf16");
    assert_eq!(code, Some(1), "not caught: {err}");
    assert!(
        fails(&rep, "split_lse@runner"),
        "{:?}",
        check(&rep, "split_lse@runner")
    );
    // Declared, a precision bug in the P·V is still caught (fp16 accumulation, in an fp16 run).
    let pv = format!(
        "env MLA_DIFF_NUMPY_CACHE_IN_DTYPE=1 {}",
        runner(&py, "bugs/pv_fp16_accum.py")
    );
    let (code, rep, err) = run_fp8(&pv, "fp16");
    assert_eq!(code, Some(1), "pv_fp16_accum not caught: {err}");
    assert!(
        fails(&rep, "split_out@runner"),
        "{:?}",
        check(&rep, "split_out@runner")
    );
}

#[test]
fn p_rounded_to_e4m3_is_judged_as_declared() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let with = |rel: &str| format!("env MLA_DIFF_NUMPY_P_FP8=1 {}", runner(&py, rel));
    let (code, rep, err) = run_fp8(&with("numpy_mla.py"), "bf16");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(rep["environment"]["runner"]["conventions"]["p_fp8"], "fp8");
    for c in [
        "split_out@runner",
        "attn_latent@runner",
        "split_out",
        "attn_latent",
        "lse[decode]@runner",
    ] {
        assert!(passes(&rep, c), "{c}: {:?}", check(&rep, c));
    }
    // The batch checks allow P's rounding, bounded per element, besides the storage bound.
    assert_eq!(
        rep["runner_checks"]["pass"], true,
        "{}",
        rep["runner_checks"]
    );
    assert!(rep["runner_checks"]
        .to_string()
        .contains("with P's e4m3 rounding"));
    // Undeclared, P's rounding is judged as the attention type's: caught at the runner.
    let (code, rep, err) = run_fp8(&runner(&py, "bugs/cache/p_fp8_undeclared.py"), "bf16");
    assert_eq!(code, Some(1), "not caught: {err}");
    assert!(
        fails(&rep, "split_out@runner"),
        "{:?}",
        check(&rep, "split_out@runner")
    );
    // Declared, a kernel bug in the split partials is still caught there (a floor partition).
    let (code, rep, err) = run_fp8(&with("bugs/split_floor.py"), "bf16");
    assert_eq!(code, Some(1), "split_floor not caught: {err}");
    assert!(
        fails(&rep, "split_out@runner"),
        "{:?}",
        check(&rep, "split_out@runner")
    );
}
