//! FlashMLA's sparse runner (`runners/flashmla_sparse.py`, ops `sparse_prefill` and `sparse_decode` over
//! FlashMLA's fp8 cache; docs/dsa.md) on a DSA file past top_k, through the real protocol, with its numpy
//! stand-in for the kernels (`MLA_DIFF_FLASHMLA_STANDIN=numpy`: no GPU here): a clean run passes with
//! the runner's checks, planted kernel bugs (the −1 padding read as the last cache row; the fp8 scale
//! applied twice, or the next tile's) are caught at the runner's stages, and what the runner cannot
//! take (no flash_mla, fp16, a dense layer) is a clean exit-2 error.
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

/// The FlashMLA sparse runner (stand-in) on the DSA fixture, no bug planted: its report, exit code
/// and stderr. Run once for the tests that read it (the prefill and the decode checks).
fn clean_run(py: &str) -> &'static (J, Option<i32>, String) {
    static RUN: std::sync::OnceLock<(J, Option<i32>, String)> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let f = selftest_dsa_fixture();
        let o = go(
            f.to_str().unwrap(),
            &runner(py, "flashmla_sparse.py"),
            true,
            &[],
        );
        let rep = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
        (rep, o.status.code(), stderr(&o))
    })
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
    let (rep, code, err) = clean_run(&py);
    assert_eq!(*code, Some(0), "{err}");
    let cs = checks(rep);
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
    let errs = schema_errors(&report_validator(), rep);
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
        "has only sparse ops",
    );
}

/// A runner with dense and sparse ops (runners/numpy_mla.py) keeps every check on a layer that runs
/// dense: the DSA fixture within top_k (12 prompt tokens + 3 decode steps ≤ 16) runs its dense ops, and
/// their split partials are compared (`split_out`, `split_lse`, end to end and `@runner`) and its decode
/// stages have their stage-local view. What its sparse decode takes away (no partials; decode stages end
/// to end) is taken only where a layer runs sparse (`Backend::sparse_layers`; past top_k:
/// runner_cache_sparse.rs). Before, declaring `sparse_decode` dropped them on every layer.
#[test]
fn dense_layers_keep_their_split_checks_under_a_runner_with_sparse_ops() {
    let Some(py) = python("the numpy runner", "numpy") else {
        return;
    };
    let f = selftest_dsa_fixture();
    let o = bin()
        .args(["run", f.to_str().unwrap(), "--backend", "cpu", "--mode"])
        .args(["shadow", "--prompt-len", "12", "--chunk", "8"])
        .args(["--decode-steps", "3", "--layers", "0", "--runner"])
        .args([&runner(&py, "numpy_mla.py"), "--json", "-", "-q"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let rep: J = serde_json::from_slice(&o.stdout).unwrap();
    let ops = rep["environment"]["runner"].to_string();
    assert!(ops.contains("sparse_decode"), "{ops}");
    let l0 = &rep["modes"][0]["layers"][0];
    assert!(l0.get("not_provided").is_none(), "{}", l0["not_provided"]);
    let all = checks(&rep);
    for name in [
        "split_out",
        "split_lse",
        "split_out@runner",
        "split_lse@runner",
    ] {
        let c = all.iter().find(|c| c["check"] == name);
        assert!(c.is_some_and(|c| c["pass"] == true), "{name}: {c:?}");
    }
    for name in ["attn_latent", "lse[decode]", "attn_heads[decode]"] {
        let c = all.iter().find(|c| c["check"] == name).unwrap();
        assert_eq!(c["local"]["pass"], true, "{name}: no local view: {c}");
    }
}

/// `runners/selfcheck.py` drives the runner alone (no mla-diff) through sparse_prefill and sparse_decode
/// requests at DeepSeek's 128 and GLM-5's 64 heads (top_k not a multiple of 128, pages shuffled, NaN
/// slots) against float64 — for sparse_decode over FlashMLA's fp8 cache as its format stores the rows,
/// quantized by selfcheck itself: the stand-in passes, the planted padding bug fails at sparse_prefill
/// and the two fp8 read bugs at sparse_decode only, fp16 is ruled out by its describe.
#[test]
fn selfcheck_drives_the_sparse_runner() {
    let Some(py) = python("the sparse runner's selfcheck", "numpy") else {
        return;
    };
    let sc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners/selfcheck.py");
    let go = |rel: &str| {
        crate::common::python_command(&py)
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
    assert!(out.contains("12 checks passed, 0 failed"), "{out}");
    assert!(out.contains("dtypes fp16 not in ['bf16']"), "{out}");
    for (bug, op) in [
        ("minus_one_wraps", "sparse_prefill"),
        ("fp8_scale_twice", "sparse_decode"),
        ("fp8_wrong_tile", "sparse_decode"),
    ] {
        let o = go(&format!("bugs/sparse/{bug}.py"));
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(1), "{bug}: {out}");
        assert!(
            out.contains(&format!("failing: {op}.attn_latent {op}.lse\n")),
            "{bug}: {out}"
        );
    }
}

/// `runners/selfcheck.py --kv-cache-dtype FMT` sends the ops that read the latent cache its rows in the
/// format's bytes with `meta.cache` (its own encoder, not the runner SDK's reader) and judges them over
/// the values the bytes hold: numpy_mla's sparse ops pass with `fp8_ds_mla`, FlashMLA's sparse stand-in's
/// decode too (its describe lists no `fp8`: unsupported there, not sent); the two planted misreaders of
/// `fp8_ds_mla` fail (tile 0's scale on every latent column: rel-L2 ~6 at sparse_decode, both sparse ops;
/// the bf16 rope read as e4m3: −inf LSEs), which they pass without the format (runner_cache_sparse.rs).
/// GLM-5's case in bf16 only, and the ops named (`--ops`): ~4 s of CPU in all, most of it the sparse
/// prefill's two requests.
#[test]
fn selfcheck_drives_the_sparse_ops_over_a_quantized_cache() {
    let Some(py) = python("the sparse runner's selfcheck", "numpy") else {
        return;
    };
    let sc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners/selfcheck.py");
    let go = |rel: &str, fmt: &str, ops: &str| {
        let o = crate::common::python_command(&py)
            .arg(&sc)
            .args(["--runner", &runner(&py, rel)])
            .args(["--dtypes", "bf16", "--cases", "glm5", "--ops", ops])
            .args(["--kv-cache-dtype", fmt])
            .env(STANDIN, "numpy")
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).to_string(),
        )
    };
    let both = "sparse_prefill,sparse_decode";
    for (rel, ops, n) in [
        ("numpy_mla.py", both, 6),
        ("flashmla_sparse.py", "sparse_decode", 2),
    ] {
        let (code, out) = go(rel, "fp8_ds_mla", ops);
        assert_eq!(code, Some(0), "{rel}: {out}");
        let passed = format!("PASS: {n} checks passed, 0 failed, 0 cases unsupported");
        assert!(
            out.contains(&passed) && out.contains("fp8_ds_mla"),
            "{rel}: {out}"
        );
    }
    let (_, out) = go("flashmla_sparse.py", "fp8", "sparse_decode");
    assert!(
        out.contains("cache_formats ['fp8_ds_mla'] does not list fp8"),
        "{out}"
    );
    for (bug, ops) in [
        ("ds_mla_one_scale", both),
        ("ds_mla_rope_fp8", "sparse_decode"),
    ] {
        let (code, out) = go(&format!("bugs/sparse/{bug}.py"), "fp8_ds_mla", ops);
        assert_eq!(code, Some(1), "{bug}: {out}");
        for op in ops.split(',') {
            let failing = format!("{op}.attn_latent {op}.lse");
            assert!(out.contains(&failing), "{bug}: {out}");
        }
    }
}

fn check<'a>(cs: &[&'a J], name: &str) -> Vec<&'a J> {
    cs.iter().copied().filter(|c| c["check"] == name).collect()
}

/// The decode steps go through `sparse_decode` over FlashMLA's fp8 cache: the `@runner` checks judge
/// the kernel against fp64 over that cache at bf16's bound, and the end-to-end decode checks carry the
/// cache's exact effect — larger than the kernel's own error, so the `@runner` yardstick is the fp8
/// cache's (against the bf16 rows it would see the fp8 rounding as the kernel's error).
#[test]
fn sparse_decode_runner_reads_the_fp8_cache_and_says_so() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let (rep, code, err) = clean_run(&py);
    assert_eq!(*code, Some(0), "{err}");
    let cs = checks(rep);
    for name in ["attn_latent", "lse[decode]"] {
        let at = check(&cs, &format!("{name}@runner"));
        let e2e = check(&cs, name);
        assert!(!at.is_empty() && at.len() == e2e.len(), "{name}: {at:?}");
        for (a, e) in at.iter().zip(&e2e) {
            assert_eq!(a["pass"], true, "{a}");
            assert_eq!(e["pass"], true, "{e}");
            let own = a["metrics"]["rel_l2"].as_f64().unwrap_or(f64::NAN);
            let fx = e["cache_effect"]["rel_l2"].as_f64().unwrap_or(f64::NAN);
            assert_eq!(e["cache_effect"]["cache"], "fp8_v32", "{e}");
            assert!(own > 0.0 && own < 1e-2, "{name}@runner: rel_l2 {own}");
            assert!(
                fx > own,
                "{name}: the fp8 effect {fx} vs the kernel's own {own}"
            );
            // The widened tolerance is the table's plus the effect, not more.
            let tol = e["tolerance"]["rel_l2"].as_f64().unwrap();
            assert!(
                tol - fx > 0.0 && tol - fx < 0.1,
                "{name}: tolerance {tol}, effect {fx}"
            );
        }
    }
    for name in ["attn_heads[decode]", "attn_out[decode]"] {
        for e in check(&cs, name) {
            assert!(
                e["cache_effect"]["rel_l2"].as_f64().unwrap_or(0.0) > 0.0,
                "{e}"
            );
        }
    }
    // FlashMLA returns no split partials; prefill checks carry no cache effect.
    assert!(check(&cs, "split_out").is_empty());
    assert!(check(&cs, "lse[prefill]")
        .iter()
        .all(|c| c["cache_effect"].is_null()));
    let text = rep.to_string();
    assert!(
        text.contains("sparse_prefill and sparse_decode"),
        "{text:.3000}"
    );
    assert!(text.contains("reads a fp8_v32 cache"), "{text:.3000}");
    let errs = schema_errors(&report_validator(), rep);
    assert!(errs.is_empty(), "{errs:?}");
}

/// fp8 scale bugs in the decode kernel (its stand-in's read of the cache): caught at the runner, the
/// prefill and everything upstream clean.
#[test]
fn fp8_cache_scale_bugs_are_caught_at_the_runner() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let f = selftest_dsa_fixture();
    for bug in ["fp8_scale_twice.py", "fp8_wrong_tile.py"] {
        let o = go(
            f.to_str().unwrap(),
            &runner(&py, &format!("bugs/sparse/{bug}")),
            true,
            &[],
        );
        assert_eq!(o.status.code(), Some(1), "{bug}: {}", stderr(&o));
        let rep: J = serde_json::from_slice(&o.stdout).unwrap();
        let cs = checks(&rep);
        let failing: Vec<&str> = cs
            .iter()
            .filter(|c| c["pass"] == false)
            .filter_map(|c| c["check"].as_str())
            .collect();
        assert!(
            failing.contains(&"attn_latent@runner"),
            "{bug}: {failing:?}"
        );
        for clean in [
            "cache_rows",
            "q_absorbed",
            "lse[prefill]@runner",
            "attn_heads[prefill]@runner",
        ] {
            assert!(
                !failing.contains(&clean),
                "{bug}: {clean} failed: {failing:?}"
            );
        }
        let worst = check(&cs, "attn_latent@runner")
            .iter()
            .map(|c| c["metrics"]["rel_l2"].as_f64().unwrap_or(f64::INFINITY))
            .fold(0f64, f64::max);
        eprintln!("{bug}: attn_latent@runner worst rel-L2 {worst:.3e}; failing {failing:?}");
    }
}

/// runners/flashmla_fp8.py (what the runner writes) rounds, encodes and decodes e4m3 as the known
/// values say, and agrees with mla-diff's own model of the cache (`fp8_cache`, unit-tested on the same
/// values) on those values.
#[test]
fn the_runners_fp8_cache_writer_matches_the_known_values() {
    let Some(py) = python("the fp8 cache writer", "numpy") else {
        return;
    };
    let code = r#"
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import flashmla_fp8 as f
cases = [(448, 448, 0x7E), (1.0, 1.0, 0x38), (-1.75, -1.75, 0xBE), (2**-9, 2**-9, 0x01), (0.875 * 2**-6, 0.875 * 2**-6, 0x07),
         (1.0625, 1.0, 0x38), (1.1875, 1.25, 0x3A), (17.0, 16.0, 0x58), (19.0, 20.0, 0x5A), (2**-10, 0.0, 0x00),
         (3 * 2**-11, 2**-9, 0x01), (300.0, 288.0, 0x79), (-0.3, -0.3125, 0xAA)]
bad = [(x, want, b) for x, want, b in cases if f.e4m3_round(x) != want or int(f.e4m3_bits(f.e4m3_round(x))) != b or f.e4m3_value(b) != want]
allb = np.arange(256); v = f.e4m3_value(allb); ok = ~np.isnan(v)
assert (f.e4m3_bits(v[ok]) == allb[ok]).all(), "byte round trip"
assert np.isnan(v).sum() == 2, "e4m3fn: two NaN bytes, no inf"
assert f.tile_scales(np.array([[3.5] + [0.0] * 511], np.float32))[0, 0] == 2.0**-7
assert f.tile_scales(np.zeros((1, 512), np.float32))[0, 0] == 2.0**-13
x = np.random.default_rng(0).standard_normal((8, 576)).astype(np.float32); x[3] = np.nan
p = f.pack(x); assert p.shape == (8, 656)
d = f.unpack(p); assert np.isnan(d[3]).all() and np.isfinite(np.delete(d, 3, 0)).all()
assert (f.unpack(f.pack(d[:3])) == d[:3]).all(), "a dequantized row is a fixed point"
print("bad", bad)
"#;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners");
    let o = crate::common::python_command(&py)
        .args(["-c", code, dir.to_str().unwrap()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    assert!(out.contains("bad []"), "{out}");
}
