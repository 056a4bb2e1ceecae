//! A quantized latent cache through the runner protocol (issue #38 item 4): with `--kv-cache-dtype FMT`
//! the decode request carries `kv_cache` in the format's bytes and `meta.cache.format`; a runner that
//! lists FMT in `supports.cache_formats` is judged against fp64 over the rows it can decode from those
//! bytes, and the end-to-end checks are widened by the format's effect (as on the CPU mirror). A runner
//! that does not list FMT is refused before any layer runs.
//!
//! Needs MLA_DIFF_PYTHON with numpy and safetensors (skips without it, fails under CI).

use crate::common::{assert_clean_error, fixture, python, run, runner, stderr};
use crate::runners::checks;
use serde_json::Value as J;

/// `runners::run_json` of a shipped fixture with `--kv-cache-dtype FMT` plus `extra`.
fn run_json(file: &str, cmd: &str, fmt: &str, extra: &[&str]) -> (Option<i32>, J, String) {
    let args = [&["--kv-cache-dtype", fmt], extra].concat();
    crate::runners::run_json(&fixture(file), cmd, &args)
}

/// The shipped fixtures `fp8_ds_mla` fits (kv_lora_rank 512, qk_rope 64; minicpm3's 256 + 32 does not).
const FITS: [&str; 4] = [
    "deepseek-v2-lite-bf16.gguf",
    "deepseek-v3-legacy-kv-b-q8_0.gguf",
    "deepseek-v3-yarn-q4_k.gguf",
    "glm-5-q4_0.gguf",
];

#[test]
fn numpy_runner_reads_the_fp8_ds_mla_bytes_on_every_fixture_that_fits() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = runner(&py, "numpy_mla.py");
    for f in FITS {
        let (code, rep, err) = run_json(f, &cmd, "fp8_ds_mla", &[]);
        assert_eq!(code, Some(0), "{f}: {err}");
        let all = checks(&rep);
        for c in [
            "attn_latent@runner",
            "lse[decode]@runner",
            "split_out@runner",
        ] {
            let x = all.iter().find(|x| x["check"] == c);
            assert!(x.is_some_and(|x| x["pass"] == true), "{f}: {c}: {x:?}");
        }
        // The end-to-end decode checks carry the format's effect (the mirror's, as without a runner).
        let lat = all.iter().find(|x| x["check"] == "attn_latent").unwrap();
        assert!(!lat["cache_effect"].is_null(), "{f}: {lat}");
        assert_eq!(rep["runner_checks"]["pass"], true, "{f}");
    }
}

#[test]
fn a_reader_that_applies_the_scale_twice_is_caught_at_the_runner() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let bug = runner(&py, "bugs/cache/fp8_scale_twice.py");
    for f in ["deepseek-v3-yarn-q4_k.gguf", "glm-5-q4_0.gguf"] {
        let (code, rep, err) = run_json(f, &bug, "fp8_ds_mla", &[]);
        assert_eq!(code, Some(1), "{f}: not caught: {err}");
        let first = rep["modes"][0]["layers"][0]["first_failure"]
            .as_str()
            .unwrap();
        assert!(
            ["split_out", "split_lse", "attn_latent", "lse[decode]"].contains(&first),
            "{f}: first failure {first}"
        );
        let all = checks(&rep);
        let at = all.iter().find(|x| x["check"] == "attn_latent@runner");
        assert!(at.is_some_and(|x| x["pass"] == false), "{f}: {at:?}");
        // Upstream of the runner all clean, the cache rows included.
        for c in ["q_absorbed", "cache_rows", "kv_latent"] {
            if let Some(x) = all.iter().find(|x| x["check"] == c) {
                assert_eq!(x["pass"], true, "{f}: {c}");
            }
        }
    }
    // Without a quantized cache the same runner is numpy_mla and passes: the bug is the reader's.
    let f = fixture("glm-5-q4_0.gguf");
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--runner",
        &bug,
        "-q",
        "--prompt-len",
        "40",
        "--decode-steps",
        "2",
        "--num-splits",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn a_runner_that_does_not_list_the_format_is_refused_before_any_layer() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("glm-5-q4_0.gguf");
    let go = |cmd: &str, fmt: &str| {
        run(&[
            "run",
            f.to_str().unwrap(),
            "--backend",
            "cpu",
            "--runner",
            cmd,
            "--kv-cache-dtype",
            fmt,
            "-q",
        ])
    };
    assert_clean_error(
        &go(&runner(&py, "numpy_mla.py"), "fp8_v41"),
        "runner numpy does not read a fp8_v41 cache (its describe's supports.cache_formats: [\"fp8_ds_mla\", \"fp8_ds_mla_nope\"])",
    );
    // A runner whose describe has no cache_formats takes the dtype's cache only.
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("plain.py");
    let runners = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners");
    std::fs::write(
        &s,
        format!(
            "import sys\nsys.path.insert(0, {:?})\nimport numpy_mla, protocol\nclass R(numpy_mla.NumpyMLA):\n    def describe(self):\n        d = super().describe()\n        del d['supports']['cache_formats']\n        return d\nprotocol.main(R)\n",
            runners.to_str().unwrap()
        ),
    )
    .unwrap();
    let plain = format!("{py} {}", s.display());
    assert_clean_error(
        &go(&plain, "fp8_ds_mla"),
        "runner numpy does not read a fp8_ds_mla cache (its describe's supports.cache_formats: [])",
    );
    // And without --kv-cache-dtype it runs as before.
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--runner",
        &plain,
        "-q",
        "--prompt-len",
        "40",
        "--decode-steps",
        "2",
        "--num-splits",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}
