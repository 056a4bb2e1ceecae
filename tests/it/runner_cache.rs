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

/// A short schedule with cached decode over two splits: where a cache reader's bug shows.
pub(crate) const SHORT: &[&str] = &[
    "--prompt-len",
    "40",
    "--decode-steps",
    "2",
    "--num-splits",
    "2",
];

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
        // GLM-5's 64 heads on the short schedule (cached decode over two splits, where a reader's bug
        // shows): the numpy reader over its covering schedule cost a minute of CI for the same reads.
        let sched = if f.starts_with("glm-5") { SHORT } else { &[] };
        let (code, rep, err) = run_json(f, &cmd, "fp8_ds_mla", sched);
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
    // DeepSeek-V3 on the default schedule; GLM-5's 64 heads on a short one (the numpy reader over the
    // covering schedule cost a minute of CI per run for the same finding).
    for (f, sched) in [
        ("deepseek-v3-yarn-q4_k.gguf", &[][..]),
        ("glm-5-q4_0.gguf", SHORT),
    ] {
        let (code, rep, err) = run_json(f, &bug, "fp8_ds_mla", sched);
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
    let head = [
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--runner",
        &bug,
        "-q",
    ];
    let o = run(&[&head[..], SHORT].concat());
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
    // numpy_mla with its describe's cache_formats edited: `edit` a Python statement on `d`.
    let dir = tempfile::tempdir().unwrap();
    let variant = |name: &str, edit: &str| {
        let s = crate::common::numpy_variant(dir.path(), name, edit);
        format!("{py} {}", s.display())
    };
    let ds_only = variant("ds.py", "d['supports']['cache_formats'] = ['fp8_ds_mla']");
    assert_clean_error(
        &go(&ds_only, "fp8"),
        "runner numpy does not read a fp8 cache (its describe's supports.cache_formats: [\"fp8_ds_mla\"])",
    );
    // A runner whose describe has no cache_formats takes the dtype's cache only.
    let plain = variant("plain.py", "del d['supports']['cache_formats']");
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

/// The runner SDK's `dequantize_cache` (python/mla_diff/runner.py) reads every format mla-diff writes
/// as `Codec::decode` does, bit for bit: rows at every scale (normals, e4m3 subnormals after the scale,
/// values below the 1e-4 scale floor, zeros, outliers, midpoints) encoded by the codec, unwritten
/// slots left 0xff (NaN), and `fp8`'s layer scale passed as the request's `meta.cache.scale` is (a
/// JSON number). One Python process for all six cases.
#[test]
fn the_sdk_dequantizes_every_format_as_the_codec_bit_for_bit() {
    use mla_diff::kv_format::{tensor_scale, Codec, KvFormat};
    let Some(py) = python("the SDK's dequantize_cache", "numpy") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (n, unwritten) = (60, [7usize, 31]);
    let mut cases = Vec::new();
    let mut want = Vec::new();
    for (i, (f, lkv, r)) in [
        (KvFormat::Fp8, 512, 64),
        (KvFormat::Fp8, 256, 32),
        (KvFormat::Fp8DsMla, 512, 64),
        (KvFormat::Fp8DsMlaNope, 512, 0),
        (KvFormat::Fp8V41, 448, 64),
        (KvFormat::Fp4V41, 448, 64),
    ]
    .into_iter()
    .enumerate()
    {
        let w = lkv + r;
        let rows = crate::common::cache_rows(n, w, 0x2545_f491_4f6c_dd1d ^ i as u64);
        let c = Codec::new(f, lkv, r).with_tensor_scale(tensor_scale(&rows));
        let nb = c.bytes();
        let mut bytes = vec![0xffu8; n * nb];
        let mut dec = vec![0f32; n * w];
        for t in 0..n {
            let b = &mut bytes[t * nb..(t + 1) * nb];
            if !unwritten.contains(&t) {
                c.encode(&rows[t * w..(t + 1) * w], b);
            }
            c.decode(b, &mut dec[t * w..(t + 1) * w]);
        }
        let file = dir.path().join(format!("c{i}.bin"));
        std::fs::write(&file, &bytes).unwrap();
        let scale = (f == KvFormat::Fp8).then_some(c.tensor_scale);
        cases.push(serde_json::json!({
            "file": file, "format": f.name(), "lkv": lkv, "r": r, "bytes": nb, "scale": scale,
        }));
        want.push(dec);
    }
    let manifest = dir.path().join("cases.json");
    std::fs::write(&manifest, serde_json::to_string(&cases).unwrap()).unwrap();
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let script = format!(
        "import sys, json, numpy as np\nsys.path.insert(0, {sdk:?})\nfrom mla_diff.runner import dequantize_cache\nfor c in json.load(open({m:?})):\n    b = np.fromfile(c['file'], np.uint8).reshape(-1, c['bytes'])\n    d = dequantize_cache(b, c['format'], c['lkv'], c['r'], c['scale'])\n    assert d.dtype == np.float32, d.dtype\n    d.tofile(c['file'] + '.out')\n",
        sdk = sdk.to_str().unwrap(),
        m = manifest.to_str().unwrap()
    );
    let o = crate::common::python_command(&py)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (c, want) in cases.iter().zip(&want) {
        let out = std::fs::read(format!("{}.out", c["file"].as_str().unwrap())).unwrap();
        let got: Vec<f32> = out
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(got.len(), want.len(), "{}", c["format"]);
        let mut nan = 0;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{} (lkv {}): element {i}: SDK {g}, codec {w}",
                c["format"],
                c["lkv"]
            );
            nan += w.is_nan() as usize;
        }
        assert!(
            nan >= unwritten.len(),
            "{}: unwritten rows read NaN",
            c["format"]
        );
    }
}

/// numpy_mla reads every format mla-diff writes (`supports.cache_formats`: all five) and passes with
/// each on a file it fits, its `@runner` checks against fp64 over the codec's rows: `fp8` on minicpm3
/// (256 + 32, the one shipped fixture only `fp8` fits; the others run with `fp8_ds_mla` above and
/// `fp8` by hand), `fp8_ds_mla_nope` on a NoPE glm5-next file, `fp8_v41` and `fp4_v41` on a file of
/// DeepSeek-V4's 448 + 64 row (no shipped fixture fits those three).
#[test]
fn numpy_runner_reads_every_format_on_a_file_it_fits() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = runner(&py, "numpy_mla.py");
    let dir = tempfile::tempdir().unwrap();
    let g5n = crate::common::make_fixture(
        dir.path(),
        "g5n.gguf",
        &[
            "--preset",
            "glm5-next",
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "4",
        ],
    );
    let mut s = mla_diff::fixture::Spec::from_options(&mla_diff::fixture::Options {
        preset: mla_diff::fixture::Preset::DeepseekV3,
        layers: Some(1),
        quant: mla_diff::gguf::GgmlType::from_name("BF16").unwrap(),
        seed: 4,
        legacy_kv_b: false,
        hidden: Some(256),
        heads: Some(4),
        q_lora_rank: None,
        vocab: Some(64),
    })
    .unwrap();
    s.kv_lora_rank = 448;
    let v4 = dir.path().join("v4-dims.gguf");
    mla_diff::fixture::write(&s, &v4).unwrap();
    let cases = [
        (fixture("minicpm3-f32.gguf"), "fp8", &[][..]),
        (g5n, "fp8_ds_mla_nope", &["--layers", "3"][..]),
        (v4.clone(), "fp8_v41", &[][..]),
        (v4, "fp4_v41", &[][..]),
    ];
    for (path, fmt, extra) in cases {
        let args = [&["--kv-cache-dtype", fmt][..], extra].concat();
        let (code, rep, err) = crate::runners::run_json(&path, &cmd, &args);
        let what = format!("{} {fmt}", path.file_name().unwrap().to_string_lossy());
        assert_eq!(code, Some(0), "{what}: {err}");
        let all = checks(&rep);
        for c in [
            "attn_latent@runner",
            "lse[decode]@runner",
            "split_out@runner",
        ] {
            let x = all.iter().find(|x| x["check"] == c);
            assert!(x.is_some_and(|x| x["pass"] == true), "{what}: {c}: {x:?}");
        }
        assert_eq!(rep["runner_checks"]["pass"], true, "{what}");
    }
}

/// `lint --runner R --kv-cache-dtype FMT` probes the runner's scale convention with one exact key
/// (src/lint/runner/cache.rs): numpy_mla reads every convention as the format stores it (notes); each
/// planted reader is named, an error (exit 1): the scale as a divisor, twice, and the ds_mla rope read
/// with a scale. A runner not listing the format is an error too, as a run refuses it.
#[test]
fn lint_names_a_runners_cache_scale_convention() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let f = fixture("glm-5-q4_0.gguf");
    let lint = |rel: &str, fmt: &str| {
        let cmd = runner(&py, rel);
        let o = run(&[
            "lint",
            f.to_str().unwrap(),
            "--runner",
            &cmd,
            "--kv-cache-dtype",
            fmt,
            "--json",
            "-",
        ]);
        let j: J = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
        (o.status.code(), j, stderr(&o))
    };
    let finding = |j: &J, check: &str| -> J {
        j["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["check"] == check)
            .cloned()
            .unwrap_or(J::Null)
    };
    for (rel, fmt, rope) in [
        ("numpy_mla.py", "fp8_ds_mla", "as stored"),
        ("numpy_mla.py", "fp8", "with its group's scale"),
    ] {
        let (code, j, err) = lint(rel, fmt);
        assert_eq!(code, Some(0), "{rel} {fmt}: {err}");
        let s = finding(&j, "runner.decode.cache_scale");
        assert_eq!(s["severity"], "note", "{rel} {fmt}: {s}");
        assert!(s["found"].as_str().unwrap().contains("multiplier"), "{s}");
        let r = finding(&j, "runner.decode.cache_rope");
        assert_eq!(r["severity"], "note", "{rel} {fmt}: {r}");
        assert!(r["found"].as_str().unwrap().contains(rope), "{r}");
    }
    for (rel, check, named) in [
        (
            "bugs/cache/fp8_scale_divisor.py",
            "runner.decode.cache_scale",
            "as a divisor",
        ),
        (
            "bugs/cache/fp8_scale_twice.py",
            "runner.decode.cache_scale",
            "applied twice",
        ),
        (
            "bugs/cache/fp8_rope_scaled.py",
            "runner.decode.cache_rope",
            "read with a scale",
        ),
    ] {
        let (code, j, err) = lint(rel, "fp8_ds_mla");
        assert_eq!(code, Some(1), "{rel}: {err}");
        let x = finding(&j, check);
        assert_eq!(x["severity"], "error", "{rel}: {x}");
        assert!(x["found"].as_str().unwrap().contains(named), "{rel}: {x}");
    }
}

/// The two planted readers lint names are caught by a run too, at the runner's stage, with everything
/// upstream of it clean.
#[test]
fn a_divisor_and_a_scaled_rope_reader_are_caught_at_the_runner() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    for rel in [
        "bugs/cache/fp8_scale_divisor.py",
        "bugs/cache/fp8_rope_scaled.py",
    ] {
        let (code, rep, err) = run_json("glm-5-q4_0.gguf", &runner(&py, rel), "fp8_ds_mla", SHORT);
        assert_eq!(code, Some(1), "{rel}: not caught: {err}");
        let all = checks(&rep);
        let at = all.iter().find(|x| x["check"] == "attn_latent@runner");
        assert!(at.is_some_and(|x| x["pass"] == false), "{rel}: {at:?}");
        for c in ["q_absorbed", "cache_rows", "kv_latent"] {
            if let Some(x) = all.iter().find(|x| x["check"] == c) {
                assert_eq!(x["pass"], true, "{rel}: {c}");
            }
        }
    }
}

/// The per-tensor `fp8` cache in an fp16 run, prefill over two chunks: the second chunk's context
/// keys come from the cache rows, whose k_pe (e4m3 · amax/448, generally not an fp16 value) the
/// runner reads rounded to fp16. numpy_mla (correct) passes at lse[prefill] and its `@runner` check:
/// the yardstick reads the rounded keys as sent, the stage-local view carries the rounding's exact
/// error on the score (it failed both, a correct runner blamed). Planted bugs still fail, with the
/// same flags: fp16 P·V accumulation (a precision bug) and an undeclared e4m3 q read.
#[test]
fn numpy_runner_passes_the_fp8_cache_in_fp16_with_a_prefill_context() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let args = [
        "--dtype",
        "fp16",
        "--prompt-len",
        "160",
        "--decode-steps",
        "2",
        "--num-splits",
        "2",
    ];
    let (code, rep, err) = run_json(
        "glm-5-q4_0.gguf",
        &runner(&py, "numpy_mla.py"),
        "fp8",
        &args,
    );
    assert_eq!(code, Some(0), "{err}");
    let all = checks(&rep);
    for c in [
        "lse[prefill]",
        "lse[prefill]@runner",
        "attn_heads[prefill]@runner",
    ] {
        let x = all
            .iter()
            .find(|x| x["check"] == c && x["local"].is_object());
        assert!(x.is_some_and(|x| x["pass"] == true), "{c}: {x:?}");
    }
    for rel in ["bugs/pv_fp16_accum.py", "bugs/cache/fp8_q_undeclared.py"] {
        let (code, rep, err) = run_json("glm-5-q4_0.gguf", &runner(&py, rel), "fp8", &args);
        assert_eq!(code, Some(1), "{rel}: not caught: {err}");
        let all = checks(&rep);
        let at = all.iter().find(|x| x["check"] == "split_out@runner");
        assert!(at.is_some_and(|x| x["pass"] == false), "{rel}: {at:?}");
    }
}
