//! A decode kernel that reads q in e4m3 with the `fp8` cache (FlashMLA's dense fp8 decode; issue #38
//! item 6): the runner declares it (`conventions.q_fp8: "fp8"`), mla-diff sends q on the e4m3 grid of
//! one power-of-two scale (`meta.q_scale`) and judges `@runner` over that q at the run's bound; the
//! quantization's effect joins the cache's in the end-to-end tolerances. A runner that quantizes q
//! without declaring it is judged over the q it did not read, and caught at the runner.
//!
//! The numpy runner plays the kernel (`MLA_DIFF_NUMPY_Q_FP8=1`: it rounds q to e4m3 on the grid of
//! `meta.q_scale`, the SDK's `quantize_q_fp8`). Needs MLA_DIFF_PYTHON with numpy (skips without it,
//! fails under CI).

use crate::common::{fixture, python, run, runner, stderr};
use crate::runners::checks;
use serde_json::Value as J;

fn run_fp8(file: &str, cmd: &str, extra: &[&str]) -> (Option<i32>, J, String) {
    let args = [&["--kv-cache-dtype", "fp8"], extra].concat();
    crate::runners::run_json(&fixture(file), cmd, &args)
}

fn declared(py: &str) -> String {
    format!("env MLA_DIFF_NUMPY_Q_FP8=1 {}", runner(py, "numpy_mla.py"))
}

#[test]
fn a_runner_that_reads_q_in_fp8_is_judged_over_the_q_it_reads() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = declared(&py);
    // fp16 too: the values sent are the quantized ones only if e4m3 times the scale is exact there (a
    // value rounded on its way would be rounded again by the runner, off the yardstick's q).
    for (f, dt) in [
        ("deepseek-v3-yarn-q4_k.gguf", "fp16"),
        ("glm-5-q4_0.gguf", "bf16"),
    ] {
        let (code, rep, err) = run_fp8(f, &cmd, &["--dtype", dt]);
        assert_eq!(code, Some(0), "{f} {dt}: {err}");
        assert_eq!(
            rep["environment"]["runner"]["conventions"]["q_fp8"], "fp8",
            "{f}"
        );
        let all = checks(&rep);
        for c in [
            "attn_latent@runner",
            "lse[decode]@runner",
            "split_out@runner",
            "split_lse@runner",
            "attn_latent",
            "split_out",
        ] {
            let x = all.iter().find(|x| x["check"] == c);
            assert!(x.is_some_and(|x| x["pass"] == true), "{f} {dt}: {c}: {x:?}");
        }
        // The end-to-end decode checks carry the cache's and q's effect together.
        let lat = all.iter().find(|x| x["check"] == "attn_latent").unwrap();
        assert!(!lat["cache_effect"].is_null(), "{f}: {lat}");
        let notices = rep["run"]["notices"].to_string();
        assert!(notices.contains("conventions.q_fp8"), "{f}: {notices}");
    }
}

#[test]
fn a_runner_that_reads_q_in_fp8_without_declaring_it_is_caught_at_the_runner() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let bug = runner(&py, "bugs/cache/fp8_q_undeclared.py");
    let (code, rep, err) = run_fp8("deepseek-v3-yarn-q4_k.gguf", &bug, &[]);
    assert_eq!(code, Some(1), "not caught: {err}");
    let all = checks(&rep);
    let lat = all
        .iter()
        .find(|x| x["check"] == "attn_latent@runner" && x["pass"] == false);
    assert!(lat.is_some(), "attn_latent@runner passed: {err}");
    assert!(
        rep["run"]["notices"]
            .to_string()
            .find("conventions.q_fp8")
            .is_none(),
        "an undeclared runner is sent q as computed"
    );
}

/// q is quantized only with the cache format the runner names: over `fp8_ds_mla` the declared runner
/// reads q as sent, and so does mla-diff's yardstick (quantizing it there would fail the run).
#[test]
fn q_stays_as_computed_with_another_cache_format() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let args = [
        "--kv-cache-dtype",
        "fp8_ds_mla",
        "--decode-steps",
        "2",
        "--prompt-len",
        "60",
    ];
    let f = fixture("glm-5-q4_0.gguf");
    let (code, rep, err) = crate::runners::run_json(&f, &declared(&py), &args);
    assert_eq!(code, Some(0), "{err}");
    assert!(rep["run"]["notices"].to_string().find("q_fp8").is_none());
}

/// `lint --kv-cache-dtype fp8` still reads a q_fp8 runner's cache convention: its probe's q (0 and
/// 0.125) is on every power-of-two grid, so the runner's own scale leaves it as sent.
#[test]
fn lint_reads_a_q_fp8_runners_cache_convention() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let cmd = declared(&py);
    let o = run(&[
        "lint",
        f.to_str().unwrap(),
        "--runner",
        &cmd,
        "--kv-cache-dtype",
        "fp8",
        "--json",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j: J = serde_json::from_slice(&o.stdout).unwrap();
    let s = j["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["check"] == "runner.decode.cache_scale")
        .cloned()
        .unwrap_or(J::Null);
    assert_eq!(s["severity"], "note", "{s}");
    assert!(s["found"].as_str().unwrap().contains("multiplier"), "{s}");
}
