//! Captures (docs/captures.md): `run --write-capture` writes the CPU mirror's stages in the capture
//! format — values we control, with `--inject` wrong in a known layer and stage — and `run --capture`
//! must pass the clean ones, name each planted bug at its layer and stage, compare a TP rank as its
//! slice and N ranks merged, say which stages it lacked, refuse a capture of another file and every
//! malformed capture with one line and exit 2. The Python package (`python/`) is driven end to end:
//! its unit tests, its model identity against ours, and a batch with left padding and two requests
//! written through `mla_diff.capture`.

use super::common::{self, assert_clean_error, fixture, run, stderr};
use serde_json::Value as J;
use std::path::{Path, PathBuf};

/// The shipped DeepSeek-V3-shaped fixture: 2 layers, YaRN, real 128/64/128 head dims.
fn model() -> PathBuf {
    fixture("deepseek-v3-yarn-q4_k.gguf")
}

/// A short schedule with two prefill chunks and decode steps (every stage, chunked prefill).
const SCHED: [&str; 6] = ["--prompt-len", "20", "--chunk", "8", "--decode-steps", "4"];

/// `run FILE --backend cpu --write-capture DIR` plus `extra`, in shadow mode; its exit code.
fn write_capture(file: &Path, dir: &Path, extra: &[&str]) -> i32 {
    write_capture_with(file, dir, &SCHED, extra)
}

/// The same on schedule `sched`.
fn write_capture_with(file: &Path, dir: &Path, sched: &[&str], extra: &[&str]) -> i32 {
    let mut a = vec![
        "run",
        file.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "-q",
        "--write-capture",
        dir.to_str().unwrap(),
    ];
    a.extend_from_slice(sched);
    a.extend_from_slice(extra);
    let o = run(&a);
    assert!(
        dir.join("manifest.json").is_file() || dir.join("rank0/manifest.json").is_file(),
        "no capture written: {}",
        stderr(&o)
    );
    o.status.code().unwrap()
}

/// `run FILE --capture DIR… --json -` plus `extra`: exit code and the (schema-valid) report.
fn check(file: &Path, dirs: &[&Path], extra: &[&str]) -> (i32, J) {
    let mut a = vec!["run", file.to_str().unwrap(), "-q", "--json", "-"];
    for d in dirs {
        a.extend_from_slice(&["--capture", d.to_str().unwrap()]);
    }
    a.extend_from_slice(extra);
    let o = run(&a);
    let code = o.status.code().unwrap();
    assert!(code <= 1, "{}", stderr(&o));
    let j: J = serde_json::from_slice(&o.stdout).expect("a JSON report");
    let errors = common::schema_errors(&common::report_validator(), &j);
    assert!(errors.is_empty(), "{errors:#?}");
    assert_eq!(
        code == 0,
        j["verdict"]["pass"] == true,
        "exit code vs verdict"
    );
    (code, j)
}

fn not_provided(rep: &J, mode: usize, layer: usize) -> Vec<String> {
    rep["modes"][mode]["layers"][layer]["not_provided"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

fn checked(rep: &J) -> Vec<String> {
    rep["modes"][0]["layers"][0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["check"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_clean_capture_passes_in_both_modes_and_says_what_it_had() {
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("cap");
    assert_eq!(write_capture(&model(), &cap, &[]), 0);
    let (code, rep) = check(&model(), &[&cap], &[]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
    assert_manifest_valid(&cap);
    assert_eq!(rep["run"]["backend"], "capture");
    assert_eq!(rep["run"]["input"]["kind"], "capture");
    assert_eq!(rep["run"]["input"]["not_captured"], serde_json::json!([]));
    assert_eq!(rep["run"]["input"]["stages"][0], "x");
    assert_eq!(rep["run"]["modes"], serde_json::json!(["shadow", "free"]));
    // The capture's schedule: prompt 20 in chunks of 8, 4 decode steps.
    assert_eq!(rep["run"]["schedule"]["prompt_len"], 20);
    assert_eq!(rep["run"]["schedule"]["chunk"], 8);
    assert_eq!(rep["run"]["schedule"]["decode_steps"], 4);
    let notices = rep["run"]["notices"].to_string();
    assert!(
        notices.contains("stages captured: x, attn_in, q_nope, q_pe"),
        "{notices}"
    );
    // Every captured stage compared end to end and by the stage-local view.
    let names = checked(&rep);
    for c in [
        "q_pe",
        "cache_rows",
        "lse[prefill]",
        "attn_latent",
        "attn_out[decode]",
    ] {
        assert!(names.contains(&c.to_string()), "{c} not checked: {names:?}");
    }
    let first = &rep["modes"][0]["layers"][0]["checks"][1];
    assert!(first.get("local").is_some_and(|l| !l.is_null()), "{first}");
    // Split partials are not in the format: not provided, never a pass.
    assert_eq!(not_provided(&rep, 0, 0), ["split_out", "split_lse"]);
    // Free mode: the layer's drift in the residual stream it adds to.
    let drift = rep["modes"][1]["layers"][0]["drift"].as_f64().unwrap();
    assert!(drift > 0.0 && drift < 1e-2, "drift {drift}");
}

/// Each planted bug is named at the layer it was planted in and the catalogue's first stage.
#[test]
fn planted_bugs_are_named_at_their_layer_and_stage() {
    let dir = tempfile::tempdir().unwrap();
    for (fault, layer, stage) in [
        ("rope_neox@layer=1", 1, "q_pe"),
        ("yarn_mscale_missing@layer=0", 0, "lse[prefill]"),
        ("k_b_untransposed@layer=1", 1, "q_absorbed"),
        ("kv_b_swap@layer=1", 1, "lse[prefill]"),
    ] {
        let cap = dir.path().join(fault.replace(['@', '='], "_"));
        assert_eq!(write_capture(&model(), &cap, &["--inject", fault]), 1);
        let (code, rep) = check(&model(), &[&cap], &["--mode", "shadow"]);
        assert_eq!(code, 1, "{fault} passed");
        let v = &rep["verdict"];
        assert_eq!(v["first_layer"], layer, "{fault}: {}", v["message"]);
        assert_eq!(v["first_check"], stage, "{fault}: {}", v["message"]);
    }
}

/// Rewrite every step file of `cap` without the tensors `drop`, and the manifest with it.
fn drop_stages(cap: &Path, drop: &[&str]) {
    drop_stages_in(cap, None, drop)
}

/// [`drop_stages`] in one layer's files only (`Some(layer)`).
fn drop_stages_in(cap: &Path, layer: Option<usize>, drop: &[&str]) {
    let mpath = cap.join("manifest.json");
    let mut m: J = serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    for f in m["layers"].as_array_mut().unwrap() {
        if layer.is_some_and(|l| f["layer"] != l) {
            continue;
        }
        let p = cap.join(f["file"].as_str().unwrap());
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<(String, safetensors::tensor::TensorView)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| !drop.contains(&n.as_str()))
            .collect();
        safetensors::tensor::serialize_to_file(kept, None, &p).unwrap();
        let stages = f["stages"].as_array_mut().unwrap();
        stages.retain(|s| !drop.contains(&s.as_str().unwrap()));
    }
    std::fs::write(&mpath, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

#[test]
fn a_stage_not_captured_is_not_provided_never_a_pass() {
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("cap");
    assert_eq!(write_capture(&model(), &cap, &[]), 0);
    drop_stages(&cap, &["q_pe", "attn_latent"]);
    let (code, rep) = check(&model(), &[&cap], &["--mode", "shadow"]);
    assert_eq!(code, 0);
    let np = not_provided(&rep, 0, 1);
    for s in ["q_pe", "attn_latent"] {
        assert!(np.contains(&s.to_string()), "{s} not reported: {np:?}");
        assert!(!checked(&rep).contains(&s.to_string()));
    }
    assert_eq!(
        rep["run"]["input"]["not_captured"],
        serde_json::json!(["q_pe", "attn_latent"])
    );
    let notices = rep["run"]["notices"].to_string();
    assert!(notices.contains("not captured: q_pe, "), "{notices}");
    assert!(notices.contains("attn_latent"), "{notices}");
    // A bug in a stage that was not captured still shows downstream (q_pe feeds the scores).
    let bad = dir.path().join("bad");
    write_capture(&model(), &bad, &["--inject", "rope_neox@layer=1"]);
    drop_stages(&bad, &["q_pe"]);
    let (code, rep) = check(&model(), &[&bad], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    // rope_neox also rotates k_pe wrongly: the first captured stage it touches.
    assert_eq!(rep["verdict"]["first_layer"], 1);
    assert_eq!(rep["verdict"]["first_check"], "k_pe");
}

/// Apply `f` to the f32 values of tensor `name` in every step file of `cap` (`f(values, last dim)`).
fn map_f32(cap: &Path, name: &str, f: impl Fn(&mut [f32], usize)) {
    let m: J =
        serde_json::from_str(&std::fs::read_to_string(cap.join("manifest.json")).unwrap()).unwrap();
    for e in m["layers"].as_array().unwrap() {
        let file = e["file"].as_str().unwrap();
        let bytes = std::fs::read(cap.join(file)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let Ok(t) = st.tensor(name) else { continue };
        let mut v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        f(&mut v, *t.shape().last().unwrap());
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let shape = t.shape().to_vec();
        edit_tensor(
            cap,
            file,
            name,
            name,
            Some((safetensors::Dtype::F32, shape, raw)),
        );
    }
}

/// The rope dims of a capture (k_pe's last axis, from its first step file).
fn rope_dim(cap: &Path) -> usize {
    let m: J =
        serde_json::from_str(&std::fs::read_to_string(cap.join("manifest.json")).unwrap()).unwrap();
    let file = m["layers"][0]["file"].as_str().unwrap();
    let bytes = std::fs::read(cap.join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    *st.tensor("k_pe").unwrap().shape().last().unwrap()
}

/// An engine's own conventions, declared in the manifest, are converted: rope dims de-interleaved
/// `[even…, odd…]` (transformers' DeepSeek-V3) and a base-2 LSE (FlashInfer); undeclared, they fail.
#[test]
fn declared_rope_order_and_lse_base_are_converted() {
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("cap");
    assert_eq!(write_capture(&model(), &cap, &[]), 0);
    let halves = |v: &mut [f32], r: usize| {
        for row in v.chunks_exact_mut(r) {
            let even: Vec<f32> = row.iter().step_by(2).copied().collect();
            let odd: Vec<f32> = row.iter().skip(1).step_by(2).copied().collect();
            row[..r / 2].copy_from_slice(&even);
            row[r / 2..].copy_from_slice(&odd);
        }
    };
    map_f32(&cap, "q_pe", halves);
    map_f32(&cap, "k_pe", halves);
    // The cache rows' k_pe is the same roped key: in the same order.
    let rope = rope_dim(&cap);
    map_f32(&cap, "cache_rows", |v, w| {
        for row in v.chunks_exact_mut(w) {
            halves(&mut row[w - rope..], rope);
        }
    });
    map_f32(&cap, "lse", |v, _| {
        v.iter_mut()
            .for_each(|x| *x = (*x as f64 / std::f64::consts::LN_2) as f32)
    });
    let (code, rep) = check(&model(), &[&cap], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    assert_eq!(rep["verdict"]["first_check"], "q_pe");
    edit_manifest(&cap, |m| m["conventions"]["rope_order"] = J::from("halves"));
    let (code, rep) = check(&model(), &[&cap], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    assert_eq!(rep["verdict"]["first_check"], "lse[prefill]");
    edit_manifest(&cap, |m| m["conventions"]["lse_base"] = J::from("2"));
    let (code, rep) = check(&model(), &[&cap], &["--mode", "shadow"]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
}

#[test]
fn tp_ranks_are_compared_as_slices_and_merged() {
    let dir = tempfile::tempdir().unwrap();
    // The tiny preset has 4 heads: 2 per rank.
    let m = common::make_fixture(dir.path(), "tiny.gguf", &["--preset", "tiny"]);
    let cap = dir.path().join("tp");
    assert_eq!(write_capture(&m, &cap, &["--tp", "2"]), 0);
    let (r0, r1) = (cap.join("rank0"), cap.join("rank1"));
    let (code, rep) = check(&m, &[&r0, &r1], &["--mode", "shadow"]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
    assert_eq!(rep["tp"]["ranks_run"], serde_json::json!([0, 1]));
    assert_eq!(rep["tp"]["ranks"][1]["heads"], serde_json::json!([2, 4]));
    // Merged: the whole layer, heads gathered and attn_out summed.
    assert!(checked(&rep).contains(&"attn_out[decode]".to_string()));
    // One rank alone: its slice in the tp section, the replicated stages in the run.
    let (code, rep) = check(&m, &[&r1], &["--mode", "shadow"]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
    assert_eq!(rep["tp"]["ranks_run"], serde_json::json!([1]));
    assert_eq!(
        checked(&rep),
        ["attn_in", "kv_latent", "k_pe", "cache_rows"]
    );
    assert!(not_provided(&rep, 0, 0).contains(&"q_pe".to_string()));
    let rank_checks = rep["tp"]["ranks"][0]["layers"][0]["checks"].to_string();
    assert!(rank_checks.contains("attn_out[decode]"), "{rank_checks}");

    // A bug in rank 1's capture: named in rank 1, the merged run fails, rank 0 alone passes.
    let bad = dir.path().join("bad");
    write_capture(
        &m,
        &bad,
        &[
            "--tp",
            "2",
            "--inject",
            "rope_neox@layer=1",
            "--inject-rank",
            "1",
        ],
    );
    let (b0, b1) = (bad.join("rank0"), bad.join("rank1"));
    let (code, rep) = check(&m, &[&b0, &b1], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    assert_eq!(rep["verdict"]["first_layer"], 1);
    assert_eq!(rep["verdict"]["first_check"], "q_pe");
    assert_eq!(rep["tp"]["ranks"][0]["verdict"]["pass"], true);
    assert_eq!(rep["tp"]["ranks"][1]["verdict"]["pass"], false);
    assert!(rep["verdict"]["message"]
        .as_str()
        .unwrap()
        .contains("rank 1 (heads 2..4)"));
    let (code, _) = check(&m, &[&b0], &["--mode", "shadow"]);
    assert_eq!(code, 0);
    let (code, rep) = check(&m, &[&b1], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    assert_eq!(rep["tp"]["ranks"][0]["verdict"]["first_check"], "q_pe");
}

/// Edit `cap`'s manifest with `f`.
fn edit_manifest(cap: &Path, f: impl FnOnce(&mut J)) {
    let p = cap.join("manifest.json");
    let mut m: J = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut m);
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// Replace tensor `name` of `cap`'s `file` with `with` (dtype, shape, bytes), or rename it.
fn edit_tensor(
    cap: &Path,
    file: &str,
    name: &str,
    new_name: &str,
    with: Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let p = cap.join(file);
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    for t in owned.iter_mut().filter(|t| t.0 == name) {
        t.0 = new_name.to_string();
        if let Some((d, s, b)) = &with {
            (t.1, t.2, t.3) = (*d, s.clone(), b.clone());
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &p).unwrap();
}

#[test]
fn bad_captures_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean");
    assert_eq!(write_capture(&model(), &clean, &[]), 0);
    let fresh = |name: &str| -> PathBuf {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for e in walk(&clean) {
            let to = d.join(e.strip_prefix(&clean).unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&e, &to).unwrap();
        }
        d
    };
    let f = model();
    let err = |cap: &Path, needle: &str| {
        let o = run(&[
            "run",
            f.to_str().unwrap(),
            "--capture",
            cap.to_str().unwrap(),
            "-q",
        ]);
        assert_clean_error(&o, needle);
    };
    // Another file: the shipped V2-Lite fixture (same architecture, other size and header).
    let o = run(&[
        "run",
        fixture("deepseek-v2-lite-bf16.gguf").to_str().unwrap(),
        "--capture",
        clean.to_str().unwrap(),
    ]);
    assert_clean_error(
        &o,
        "was made from another file (deepseek-v3-yarn-q4_k.gguf): model size",
    );
    let c = fresh("digest");
    edit_manifest(&c, |m| {
        m["model"]["header_sha256"] = J::from("0".repeat(64))
    });
    err(&c, "model header sha256 0000");
    let c = fresh("arch");
    edit_manifest(&c, |m| m["model"]["architecture"] = J::from("glm-dsa"));
    err(&c, "model architecture \"glm-dsa\", FILE is \"deepseek2\"");

    err(&dir.path().join("absent"), "cannot open capture");
    let c = fresh("nomanifest");
    std::fs::remove_file(c.join("manifest.json")).unwrap();
    err(&c, "cannot read manifest.json");
    let c = fresh("notjson");
    std::fs::write(c.join("manifest.json"), "{").unwrap();
    err(&c, "manifest.json is not JSON");
    let c = fresh("v3");
    edit_manifest(&c, |m| m["version"] = J::from(3));
    err(&c, "format version 3; this mla-diff reads versions 1 to 2");
    let c = fresh("v1dtypes");
    edit_manifest(&c, |m| {
        m["version"] = J::from(1);
        m["stage_dtypes"] = serde_json::json!({"cache_rows": "fp16"})
    });
    err(&c, "stage_dtypes needs format version 2");
    let c = fresh("dtypestage");
    edit_manifest(&c, |m| {
        m["stage_dtypes"] = serde_json::json!({"topk": "fp16"})
    });
    err(
        &c,
        "stage_dtypes names \"topk\", which is not a stage with values",
    );
    let c = fresh("field");
    edit_manifest(&c, |m| m["extra"] = J::from(1));
    err(&c, "unknown field `extra`");
    let c = fresh("traversal");
    edit_manifest(&c, |m| {
        m["layers"][0]["file"] = J::from("../clean/layer0/step0.safetensors")
    });
    err(&c, "must be a relative path inside the folder");
    let c = fresh("unknownstage");
    edit_manifest(&c, |m| m["layers"][0]["stages"][1] = J::from("q_rope"));
    err(&c, "unknown stage \"q_rope\"");
    let c = fresh("badrow");
    edit_manifest(&c, |m| m["steps"][0]["rows"][0] = serde_json::json!([7, 0]));
    err(&c, "step 0: a row names request 7");
    let c = fresh("missingfile");
    std::fs::remove_file(c.join("layer1/step2.safetensors")).unwrap();
    err(&c, "layer1/step2.safetensors: cannot read it");
    let c = fresh("garbage");
    std::fs::write(c.join("layer0/step0.safetensors"), b"not safetensors").unwrap();
    err(&c, "layer0/step0.safetensors: not a safetensors file");
    let c = fresh("renamed");
    edit_tensor(&c, "layer0/step1.safetensors", "q_pe", "q_rope", None);
    err(&c, "unknown tensor \"q_rope\"");
    let c = fresh("unlisted");
    edit_manifest(&c, |m| {
        m["layers"][0]["stages"]
            .as_array_mut()
            .unwrap()
            .retain(|s| s != "lse")
    });
    err(&c, "but the manifest lists");
    let c = fresh("shape");
    edit_tensor(
        &c,
        "layer0/step0.safetensors",
        "k_pe",
        "k_pe",
        Some((safetensors::Dtype::F32, vec![8, 63], vec![0; 8 * 63 * 4])),
    );
    err(&c, "k_pe has shape [8, 63], expected [8, 64]");
    let c = fresh("dtype");
    edit_tensor(
        &c,
        "layer0/step0.safetensors",
        "k_pe",
        "k_pe",
        Some((safetensors::Dtype::I32, vec![8, 64], vec![0; 8 * 64 * 4])),
    );
    err(&c, "k_pe: dtype I32; values are BF16, F16, F32 or F64");
    let c = fresh("nox");
    drop_stages(&c, &["x"]);
    err(&c, "layer 0 has no x");
    let c = fresh("gap");
    edit_manifest(&c, |m| {
        let l = m["layers"].as_array_mut().unwrap();
        l.retain(|f| !(f["layer"] == 0 && f["step"] == 1));
    });
    err(
        &c,
        "has no row for request 0 position 8 (every token of the request needs one)",
    );
    let c = fresh("uneven");
    drop_stages_in(&c, Some(1), &["k_pe"]);
    err(
        &c,
        "layer 1 has the stages [attn_in, q_nope, q_pe, kv_latent, cache_rows",
    );
    let c = fresh("twice");
    edit_manifest(&c, |m| m["steps"][1]["rows"][0] = serde_json::json!([0, 0]));
    err(&c, "position 0 is captured twice");
    // --inject has nothing to plant in a capture.
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--capture",
        clean.to_str().unwrap(),
        "--inject",
        "rope_neox",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Our header digest and gguf-py's (`mla_diff.gguf_identity`) agree on every shipped fixture.
#[test]
fn python_identity_matches_ours() {
    let Some(py) = common::python(
        "the capture identity cross-check",
        "gguf, numpy, safetensors, ml_dtypes",
    ) else {
        return;
    };
    for e in std::fs::read_dir(common::fixtures_dir()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "gguf") {
            continue;
        }
        let o = python_cmd(&py)
            .args(["-c", "import json, sys, mla_diff; print(json.dumps(mla_diff.gguf_identity(sys.argv[1])))"])
            .arg(&p)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let theirs: J = serde_json::from_slice(&o.stdout).unwrap();
        let file = mla_diff::gguf::GgufFile::open(&p).unwrap();
        let ours = serde_json::to_value(mla_diff::capture::Manifest::identity_of(&file)).unwrap();
        assert_eq!(theirs, ours, "{}", p.display());
    }
}

/// `python` with the repository's `python/` first on its path (the package as checked out).
fn python_cmd(py: &str) -> std::process::Command {
    let mut c = crate::common::python_command(py);
    c.env(
        "PYTHONPATH",
        Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
    );
    c
}

/// The capture package's own tests (`python/tests/test_capture*.py`, unittest: no pytest needed).
#[test]
fn python_package_unit_tests() {
    let Some(py) = common::python(
        "the mla_diff package tests",
        "gguf, numpy, safetensors, ml_dtypes",
    ) else {
        return;
    };
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests");
    let o = python_cmd(&py)
        .args(["-m", "unittest", "discover", "-s"])
        .arg(&tests)
        // test_capture*.py only: python/tests also holds the pytest plugin's tests (pytest, the wheel).
        .args(["-p", "test_capture*.py", "-v"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        stderr(&o)
    );
}

/// Two requests in one batch, left-padded, written through `mla_diff.capture` from two captures of
/// ours (inputs of two seeds; the second with a planted bug): each request is aligned by its
/// positions, the clean one passes and the other is named at its layer and stage.
#[test]
fn a_batch_with_padding_is_aligned_by_positions() {
    let Some(py) = common::python(
        "the batched capture test",
        "gguf, numpy, safetensors, ml_dtypes",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (a, b, batch) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("batch"),
    );
    assert_eq!(write_capture(&model(), &a, &["--seed", "1"]), 0);
    assert_eq!(
        write_capture(
            &model(),
            &b,
            &["--seed", "2", "--inject", "rope_neox@layer=1"]
        ),
        1
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/batch_capture.py");
    let o = python_cmd(&py)
        .arg(&script)
        .args([&model(), &a, &b, &batch])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_manifest_valid(&batch);
    let (code, rep) = check(&model(), &[&batch], &["--capture-request", "0"]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
    assert_eq!(rep["run"]["input"]["request"], 0);
    let (code, rep) = check(
        &model(),
        &[&batch],
        &["--capture-request", "1", "--mode", "shadow"],
    );
    assert_eq!(code, 1);
    assert_eq!(rep["verdict"]["first_layer"], 1);
    assert_eq!(rep["verdict"]["first_check"], "q_pe");
    // Two requests and no choice: a usage error naming them.
    let o = run(&[
        "run",
        model().to_str().unwrap(),
        "--capture",
        batch.to_str().unwrap(),
    ]);
    assert_clean_error(
        &o,
        "2 requests in one capture: choose one with --capture-request (ids 0, 1)",
    );
}

/// `cap`'s manifest against schema/capture.schema.json.
fn assert_manifest_valid(cap: &Path) {
    let schema: J = serde_json::from_str(include_str!("../../schema/capture.schema.json")).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let m: J =
        serde_json::from_str(&std::fs::read_to_string(cap.join("manifest.json")).unwrap()).unwrap();
    let errors = common::schema_errors(&v, &m);
    assert!(errors.is_empty(), "{}: {errors:#?}", cap.display());
}

/// DSA past top_k: a capture's `topk` is the engine's selection, checked against the reference's
/// (tie-aware, the `dsa` section) with its attention against fp64 over it; a clean capture passes, one
/// key swapped in one decode row fails naming the layer, step and position; a sparse capture without
/// `topk` and a `topk` key in the query's future are refused (exit 2).
#[test]
fn dsa_topk_is_checked_against_the_reference_selection() {
    let f = common::selftest_dsa_fixture();
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean");
    // 27 tokens past top_k 16: six steps (three prefill chunks of 8, three decodes).
    let sched = ["--prompt-len", "24", "--chunk", "8", "--decode-steps", "3"];
    assert_eq!(write_capture_with(&f, &clean, &sched, &[]), 0);
    assert_manifest_valid(&clean);
    let (code, rep) = check(&f, &[&clean], &[]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
    let dsa = &rep["dsa"];
    assert_eq!(dsa["pass"], true);
    assert_eq!(dsa["layers"].as_array().unwrap().len(), 3);
    assert!(
        dsa["layers"][1]["selection"]["sparse_queries"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(
        dsa["indexer"].as_str().unwrap().contains("captured topk"),
        "{}",
        dsa["indexer"]
    );
    assert!(!rep.to_string().contains("not compared"));

    let copy = |name: &str| -> PathBuf {
        let d = dir.path().join(name);
        for e in walk(&clean) {
            let to = d.join(e.strip_prefix(&clean).unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&e, &to).unwrap();
        }
        d
    };
    let topk = |cap: &Path, file: &str| -> (Vec<usize>, Vec<i32>) {
        let b = std::fs::read(cap.join(file)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&b).unwrap();
        let t = st.tensor("topk").unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::I32);
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (t.shape().to_vec(), v)
    };
    let put = |cap: &Path, file: &str, shape: Vec<usize>, v: &[i32]| {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        edit_tensor(
            cap,
            file,
            "topk",
            "topk",
            Some((safetensors::Dtype::I32, shape, bytes)),
        );
    };
    // Layer 1, step 4 (the first decode, position 25): its first selected key swapped for an unselected
    // visible one.
    let bad = copy("bad");
    let file = "layer1/step4.safetensors";
    let (shape, mut v) = topk(&bad, file);
    assert_eq!(shape[0], 1);
    let other = (0..=25).find(|k| !v.contains(k)).unwrap();
    v[0] = other;
    put(&bad, file, shape.clone(), &v);
    let (code, rep) = check(&f, &[&bad], &[]);
    assert_eq!(code, 1);
    let dsa = &rep["dsa"];
    assert_eq!(dsa["pass"], false);
    assert_eq!(dsa["first_layer"], 1);
    let msg = dsa["message"].as_str().unwrap();
    assert!(
        msg.starts_with("DSA layer 1 at request 0 step 4 position 25 (query 25)"),
        "{msg}"
    );
    assert!(msg.contains(&format!("key {other}")), "{msg}");
    assert_eq!(dsa["layers"][0]["pass"], true);
    assert!(rep["verdict"]["message"].as_str().unwrap().contains(msg));

    // Refused: a key in the query's future; a sparse capture without topk.
    let future = copy("future");
    let (shape, mut v) = topk(&future, file);
    v[0] = 26;
    put(&future, file, shape, &v);
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--capture",
        future.to_str().unwrap(),
    ]);
    assert_clean_error(
        &o,
        "layer 1: topk of request 0 position 25 selects position 26",
    );
    let none = copy("none");
    drop_stages(&none, &["topk"]);
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--capture",
        none.to_str().unwrap(),
    ]);
    assert_clean_error(&o, "has no topk");
    let tp = copy("tp");
    edit_manifest(&tp, |m| {
        m["tp"] = serde_json::json!({"rank": 0, "world_size": 2, "heads": [0, 1]});
    });
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--capture",
        tp.to_str().unwrap(),
    ]);
    assert_clean_error(&o, "a tensor-parallel capture past the DSA indexer's top_k");
}

/// `cap`'s cache rows as an f16 cache holds them: every step file's `cache_rows` rounded to f16 and
/// stored F16, with `bump` f16 ulps added to every element of token `row`'s cache row in `layer`.
fn cache_to_f16(cap: &Path, bump: Option<(usize, usize, i16)>) {
    let m: J =
        serde_json::from_str(&std::fs::read_to_string(cap.join("manifest.json")).unwrap()).unwrap();
    for e in m["layers"].as_array().unwrap() {
        let file = e["file"].as_str().unwrap();
        let bytes = std::fs::read(cap.join(file)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("cache_rows").unwrap();
        let width = *t.shape().last().unwrap();
        let step_rows = &m["steps"][e["step"].as_u64().unwrap() as usize]["rows"];
        let raw: Vec<u8> = t
            .data()
            .chunks_exact(4)
            .enumerate()
            .map(|(i, b)| {
                let h = half::f16::from_f32(f32::from_le_bytes(b.try_into().unwrap()));
                // The batch row's position is its token (one request from position 0).
                let pos = step_rows[i / width][1].as_u64().unwrap() as usize;
                match bump {
                    Some((l, r, k)) if e["layer"] == l && pos == r => {
                        half::f16::from_bits((h.to_bits() as i16 + k) as u16)
                    }
                    _ => h,
                }
            })
            .flat_map(|h| h.to_le_bytes())
            .collect();
        let shape = t.shape().to_vec();
        edit_tensor(
            cap,
            file,
            "cache_rows",
            "cache_rows",
            Some((safetensors::Dtype::F16, shape, raw)),
        );
    }
}

/// Per-stage storage dtypes (format version 2, `stage_dtypes`): an engine with f32 projections and an
/// f16 cache (llama.cpp's defaults) passes when its manifest says `cache_rows: fp16` — the cache an
/// exact copy of kv_latent | k_pe after rounding to f16, the attention that reads it bounded at f16,
/// the projections still at f32 — and fails at `cache_rows` without the declaration (the f32 copy
/// check) or with one token's cache row off by 5 f16 ulps (10× the rounding's largest error).
#[test]
fn an_f16_cache_next_to_f32_projections_is_bounded_by_its_own_dtype() {
    let f = model();
    let dir = tempfile::tempdir().unwrap();
    let f32cap = dir.path().join("f32");
    assert_eq!(write_capture(&f, &f32cap, &["--dtype", "f32"]), 0);
    let copy = |name: &str| -> PathBuf {
        let d = dir.path().join(name);
        std::fs::create_dir_all(d.join("layer0")).unwrap();
        std::fs::create_dir_all(d.join("layer1")).unwrap();
        for p in walk(&f32cap) {
            let rel = p.strip_prefix(&f32cap).unwrap();
            std::fs::copy(&p, d.join(rel)).unwrap();
        }
        d
    };
    let declare = |c: &Path| {
        edit_manifest(c, |m| {
            m["stage_dtypes"] = serde_json::json!({"cache_rows": "fp16"})
        })
    };
    let f16 = copy("f16");
    cache_to_f16(&f16, None);
    declare(&f16);
    assert_manifest_valid(&f16);
    let (code, rep) = check(&f, &[&f16], &["--mode", "shadow"]);
    assert_eq!(code, 0, "{}", rep["verdict"]["message"]);
    let notices = rep["run"]["notices"].to_string();
    assert!(
        notices.contains("stored in f32, except cache_rows fp16"),
        "{notices}"
    );
    let checks = rep["modes"][0]["layers"][1]["checks"].as_array().unwrap();
    let of = |name: &str| checks.iter().find(|c| c["check"] == name).unwrap();
    // The projections at f32's tolerance, the cache and everything after it at fp16's.
    let tol = |name: &str| of(name)["tolerance"]["rel_l2"].as_f64().unwrap();
    assert!(
        tol("kv_latent") < 1e-5 && tol("q_pe") < 1e-5,
        "{}",
        tol("kv_latent")
    );
    assert!(tol("cache_rows") > 1e-3 && tol("attn_latent") > 1e-3);
    assert_eq!(of("cache_rows")["local"]["store"], "fp16");
    assert_eq!(of("cache_rows")["local"]["rel_l2"], 0.0);
    assert_eq!(of("q_pe")["local"]["store"], "f32");
    for name in [
        "lse[prefill]",
        "attn_heads[prefill]",
        "attn_latent",
        "attn_out[decode]",
    ] {
        assert_eq!(of(name)["pass"], true, "{name}: {}", of(name));
    }

    // Undeclared: an f32 capture whose cache rows are not an f32 copy.
    let undeclared = copy("undeclared");
    cache_to_f16(&undeclared, None);
    let (code, rep) = check(&f, &[&undeclared], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    assert_eq!(rep["verdict"]["first_layer"], 0);
    assert_eq!(rep["verdict"]["first_check"], "cache_rows");

    // Declared, one cache row of layer 1 off by 5 ulps: named there.
    let bad = copy("bad");
    cache_to_f16(&bad, Some((1, 13, 5)));
    declare(&bad);
    let (code, rep) = check(&f, &[&bad], &["--mode", "shadow"]);
    assert_eq!(code, 1);
    assert_eq!(rep["verdict"]["first_layer"], 1);
    assert_eq!(rep["verdict"]["first_check"], "cache_rows");
    let reasons = rep["verdict"]["reasons"].to_string();
    assert!(reasons.contains("exact copy"), "{reasons}");
}
