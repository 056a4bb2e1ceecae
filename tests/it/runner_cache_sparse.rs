//! A quantized latent cache through the runner's sparse ops (issue #38; DSA past top_k, docs/dsa.md):
//! with `--kv-cache-dtype FMT` `sparse_prefill` gets `kv` and `sparse_decode` gets `kv_cache` as the
//! format's u8 bytes with `meta.cache`, as the decode op does; the `@runner` checks are fp64 over the
//! rows decoded from those bytes, and the end-to-end checks are widened by the format's effect (the
//! sparse prefill's computed by the runner backend, since every key it reads comes from the cache).
//! Planted readers of the wrong convention are caught at the runner's stages, a runner not listing the
//! format is refused, and `lint` probes the sparse ops' scale convention.
//!
//! On the selftest's DSA fixture (GLM-5's 512 + 64 row, top_k 16) past top_k, with runners/numpy_mla.py
//! (its sparse ops: the layer runs sparse) and FlashMLA's sparse runner on its numpy stand-in. Needs MLA_DIFF_PYTHON with numpy (skipped
//! without it, except under CI).

use crate::common::{
    assert_clean_error, bin, python, report_validator, runner, schema_errors, selftest_dsa_fixture,
    stderr,
};
use crate::runners::checks;
use serde_json::Value as J;

/// `run` of the DSA fixture's layer 0 past top_k (40 prompt tokens in chunks of 16, 3 decode steps,
/// page 8: runners_sparse's schedule) under `cmd` with `--kv-cache-dtype fmt`, the FlashMLA stand-in
/// on. One layer: ~1.4 s a run here, against 2.7 s for the three.
fn go(cmd: &str, fmt: &str) -> (Option<i32>, J, String) {
    let f = selftest_dsa_fixture();
    let o = bin()
        .args([
            "run",
            f.to_str().unwrap(),
            "--backend",
            "cpu",
            "--mode",
            "shadow",
        ])
        .args(["--prompt-len", "40", "--chunk", "16", "--decode-steps", "3"])
        .args(["--page-size", "8", "--layers", "0", "--runner", cmd])
        .args(["--kv-cache-dtype", fmt])
        .args(["--json", "-", "-q"])
        .env("MLA_DIFF_FLASHMLA_STANDIN", "numpy")
        .output()
        .unwrap();
    let j = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
    (o.status.code(), j, stderr(&o))
}

fn find<'a>(all: &[&'a J], name: &str) -> Vec<&'a J> {
    all.iter().copied().filter(|c| c["check"] == name).collect()
}

/// The runner's stages of both sparse ops: `@runner` twins of the end-to-end checks.
const AT_RUNNER: [&str; 4] = [
    "lse[prefill]@runner",
    "attn_heads[prefill]@runner",
    "attn_latent@runner",
    "lse[decode]@runner",
];

/// numpy_mla's sparse ops read their cache in `fp8_ds_mla` and `fp8` bytes and pass; each
/// end-to-end check of the runner's stages carries the format's effect, larger than the runner's own
/// error, and the sparse prefill's is the effect on every key it read: above the inner path's (which
/// reads its own chunk from the fresh rows: lse[prefill] 2.1e-3 vs 4.5e-3, attn_heads[prefill]
/// 1.24e-2 vs 2.22e-2 on layer 0 with fp8_ds_mla). The layer runs sparse, so what the sparse decode
/// takes away is gone there (its dense layers keep it: runners_sparse.rs): no split partials, and the
/// decode stages judged end to end, without a stage-local view.
#[test]
fn numpy_sparse_ops_read_the_quantized_cache_past_top_k() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let cmd = runner(&py, "numpy_mla.py");
    for fmt in ["fp8_ds_mla", "fp8"] {
        let (code, rep, err) = go(&cmd, fmt);
        assert_eq!(code, Some(0), "{fmt}: {err}");
        let all = checks(&rep);
        for name in AT_RUNNER {
            let at = find(&all, name);
            let e2e = find(&all, name.trim_end_matches("@runner"));
            assert!(!at.is_empty() && at.len() == e2e.len(), "{fmt} {name}");
            for (a, e) in at.iter().zip(&e2e) {
                assert_eq!(a["pass"], true, "{fmt}: {a}");
                assert_eq!(e["pass"], true, "{fmt}: {e}");
                assert_eq!(e["cache_effect"]["cache"], fmt, "{fmt}: {e}");
                let own = a["metrics"]["rel_l2"].as_f64().unwrap();
                let fx = e["cache_effect"]["rel_l2"].as_f64().unwrap();
                assert!(fx > own, "{fmt} {name}: effect {fx}, runner's own {own}");
            }
        }
        let not_provided = &rep["modes"][0]["layers"][0]["not_provided"];
        assert_eq!(not_provided, &serde_json::json!(["split_out", "split_lse"]));
        for name in ["attn_latent", "lse[decode]", "attn_heads[decode]"] {
            assert!(
                find(&all, name).iter().all(|c| c["local"].is_null()),
                "{fmt} {name}"
            );
        }
        // Layer 0's prefill effect is the sparse op's own, not the inner path's context-only one.
        let l0 = rep["modes"][0]["layers"][0]["checks"].as_array().unwrap();
        let heads = l0.iter().find(|c| c["check"] == "attn_heads[prefill]");
        let heads = heads.unwrap();
        let fx = heads["cache_effect"]["rel_l2"].as_f64().unwrap();
        assert!(fx > 0.018, "{fmt}: attn_heads[prefill] effect {fx}");
        assert!(
            !rep.to_string().contains("fp8_v32"),
            "{fmt}: no runner-written cache"
        );
        let errs = schema_errors(&report_validator(), &rep);
        assert!(errs.is_empty(), "{fmt}: {errs:?}");
    }
}

/// FlashMLA's sparse runner (stand-in) takes mla-diff's `fp8_ds_mla` bytes (its own 656-byte cache):
/// its decode hands them to the kernel as sent instead of writing the cache from rows, its prefill
/// upconverts them to bf16; it passes, and its notices no longer say it writes an fp8_v32 cache. It
/// lists only that format: `fp8` is refused before any layer (exit 2, one line).
#[test]
fn flashmla_sparse_takes_the_fp8_ds_mla_bytes() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let cmd = runner(&py, "flashmla_sparse.py");
    let (code, rep, err) = go(&cmd, "fp8_ds_mla");
    assert_eq!(code, Some(0), "{err}");
    let all = checks(&rep);
    for name in AT_RUNNER {
        let at = find(&all, name);
        assert!(!at.is_empty(), "{name}");
        assert!(at.iter().all(|c| c["pass"] == true), "{name}: {at:?}");
    }
    let lat = find(&all, "attn_latent");
    assert!(lat
        .iter()
        .all(|c| c["cache_effect"]["cache"] == "fp8_ds_mla"));
    assert!(!rep.to_string().contains("fp8_v32 cache"), "notice");
    let f = selftest_dsa_fixture();
    let o = bin()
        .args([
            "run",
            f.to_str().unwrap(),
            "--backend",
            "cpu",
            "--runner",
            &cmd,
        ])
        .args(["--kv-cache-dtype", "fp8", "-q"])
        .env("MLA_DIFF_FLASHMLA_STANDIN", "numpy")
        .output()
        .unwrap();
    assert_clean_error(
        &o,
        "runner flashmla_sparse does not read a fp8 cache (its describe's supports.cache_formats: [\"fp8_ds_mla\"])",
    );
}

/// Two planted sparse readers of `fp8_ds_mla` (runners/bugs/sparse/): one that ignores the per-128
/// scale groups (tile 0's scale for every latent column) and one that reads the bf16 rope as e4m3
/// codes. Each fails the run (exit 1) at the runner's first stage, lse[prefill], with the runner named
/// the culprit; every `@runner` stage of both ops fails and nothing upstream does.
#[test]
fn sparse_readers_of_the_wrong_convention_are_caught_at_the_runner() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    for bug in ["ds_mla_one_scale", "ds_mla_rope_fp8"] {
        let (code, rep, err) = go(&runner(&py, &format!("bugs/sparse/{bug}.py")), "fp8_ds_mla");
        assert_eq!(code, Some(1), "{bug}: not caught: {err}");
        let v = &rep["verdict"];
        assert_eq!(v["first_check"], "lse[prefill]", "{bug}: {v}");
        let msg = v["message"].as_str().unwrap();
        assert!(msg.contains("culprit: the runner's kernel"), "{bug}: {msg}");
        let all = checks(&rep);
        for name in AT_RUNNER {
            assert!(
                find(&all, name).iter().all(|c| c["pass"] == false),
                "{bug}: {name} passed"
            );
        }
        for up in ["kv_latent", "k_pe", "cache_rows", "q_absorbed"] {
            assert!(
                find(&all, up).iter().all(|c| c["pass"] == true),
                "{bug}: {up} failed"
            );
        }
    }
}

/// `lint --runner R --kv-cache-dtype fp8_ds_mla` probes each sparse op's scale convention with one
/// exact key in the format's bytes: numpy_mla reads both as the format stores them (notes); the
/// rope-as-fp8 reader is an error on both ops' rope; the one-scale reader is not seen (the probe's
/// tiles share one scale) and is left to a run.
#[test]
fn lint_probes_the_sparse_ops_cache_convention() {
    let Some(py) = python("the sparse runner", "numpy") else {
        return;
    };
    let f = selftest_dsa_fixture();
    let lint = |rel: &str| {
        let o = bin()
            .args(["lint", f.to_str().unwrap(), "--runner", &runner(&py, rel)])
            .args(["--kv-cache-dtype", "fp8_ds_mla", "--json", "-"])
            .output()
            .unwrap();
        let j: J = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
        (o.status.code(), j, stderr(&o))
    };
    let finding = |j: &J, check: &str| -> J {
        let all = j["findings"].as_array().unwrap();
        all.iter()
            .find(|x| x["check"] == check)
            .cloned()
            .unwrap_or(J::Null)
    };
    let (code, j, err) = lint("numpy_mla.py");
    assert_eq!(code, Some(0), "{err}");
    let (bcode, bj, berr) = lint("bugs/sparse/ds_mla_rope_fp8.py");
    assert_eq!(bcode, Some(1), "{berr}");
    for op in ["sparse_prefill", "sparse_decode"] {
        let s = finding(&j, &format!("runner.{op}.cache_scale"));
        assert_eq!(s["severity"], "note", "{op}: {s}");
        assert!(s["found"].as_str().unwrap().contains("multiplier"), "{s}");
        let r = finding(&j, &format!("runner.{op}.cache_rope"));
        assert_eq!(r["severity"], "note", "{op}: {r}");
        assert!(r["found"].as_str().unwrap().contains("as stored"), "{r}");
        let b = finding(&bj, &format!("runner.{op}.cache_rope"));
        assert_eq!(b["severity"], "error", "{op}: {b}");
        let s = finding(&bj, &format!("runner.{op}.cache_scale"));
        assert_eq!(s["severity"], "note", "{op}: {s}");
    }
}

/// What mla-diff sends FlashMLA's sparse decode with `--kv-cache-dtype fp8_ds_mla` is the cache
/// FlashMLA's own quantizer writes (its tests/quant.py convention, as runners/flashmla_fp8.py `pack`
/// writes it for the runner's `fp8_v32` path): `Codec::encode` and `pack` agree byte for byte on rows
/// at every scale (bf16 values, zeros, outliers, values under the 1e-4 scale floor).
#[test]
fn the_fp8_ds_mla_bytes_are_flashmlas_own() {
    use mla_diff::kv_format::{Codec, KvFormat};
    let Some(py) = python("flashmla_fp8.pack", "numpy") else {
        return;
    };
    let (n, w) = (48usize, 576usize);
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let rows: Vec<f32> = (0..n * w)
        .map(|k| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            let v = match (k / w) % 4 {
                0 => u * 2f64.powi((k % 9) as i32 - 4),
                1 if k % 29 == 0 => u * 700.0,
                1 => u,
                2 => u * 1e-6,
                _ => 0.0,
            };
            half::bf16::from_f64(v).to_f32()
        })
        .collect();
    let c = Codec::new(KvFormat::Fp8DsMla, 512, 64);
    let mut want = vec![0u8; n * 656];
    for (r, b) in rows.chunks(w).zip(want.chunks_mut(656)) {
        c.encode(r, b);
    }
    let dir = tempfile::tempdir().unwrap();
    let (inp, out) = (dir.path().join("rows.f32"), dir.path().join("packed.u8"));
    let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&inp, bytes).unwrap();
    let runners = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners");
    let script = format!(
        "import sys, numpy as np\nsys.path.insert(0, {r:?})\nimport flashmla_fp8\nx = np.fromfile({i:?}, '<f4').reshape(-1, 576)\nflashmla_fp8.pack(x).tofile({o:?})\n",
        r = runners.to_str().unwrap(),
        i = inp.to_str().unwrap(),
        o = out.to_str().unwrap()
    );
    let o = crate::common::python_command(&py)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len(), want.len());
    for (t, (g, w)) in got.chunks(656).zip(want.chunks(656)).enumerate() {
        assert_eq!(g, w, "row {t}");
    }
}
