//! Capsules (`mla-diff export`, `mla-diff replay`, issue #13 item 5): a shipped fixture's layer exported
//! and replayed gives the same checks as `run` on that layer, bit for bit; head cuts replay; a changed
//! weight, a broken manifest, a head cut off the quant blocks and a layer out of range are clean errors.

use crate::common;

use common::{assert_clean_error, fixture, run, stderr};
use mla_diff::gguf::GgufFile;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A short schedule with every phase (two prefill chunks, decode with splits) to keep the tests fast.
const SCHED: [&str; 8] = [
    "--prompt-len",
    "20",
    "--chunk",
    "12",
    "--decode-steps",
    "6",
    "--num-splits",
    "3",
];

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `mla-diff export FIXTURE ARGS… --schedule -o DIR`; must succeed.
fn export(fx: &str, dir: &Path, args: &[&str]) -> PathBuf {
    let o = export_out(fx, dir, args);
    assert!(
        o.status.success(),
        "export {fx} {args:?} failed: {}",
        stderr(&o)
    );
    dir.to_path_buf()
}

fn export_out(fx: &str, dir: &Path, args: &[&str]) -> std::process::Output {
    let f = fixture(fx);
    let mut all = vec!["export", s(&f)];
    all.extend_from_slice(args);
    all.extend_from_slice(&SCHED);
    all.extend_from_slice(&["-o", s(dir)]);
    run(&all)
}

/// `mla-diff replay DIR --backend cpu --json -`: exit code and the JSON report.
fn replay(dir: &Path) -> (i32, Value) {
    let o = run(&["replay", s(dir), "--backend", "cpu", "--json", "-"]);
    let code = o.status.code().unwrap();
    assert!(code != 2, "replay {} failed: {}", dir.display(), stderr(&o));
    (
        code,
        serde_json::from_slice(&o.stdout).expect("JSON report"),
    )
}

/// `mla-diff run FIXTURE --layers L --mode shadow` on the same schedule: the JSON report.
fn run_json(fx: &str, layers: &str, extra: &[&str]) -> Value {
    let f = fixture(fx);
    let mut all = vec![
        "run",
        s(&f),
        "--layers",
        layers,
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--json",
        "-",
    ];
    all.extend_from_slice(&SCHED);
    all.extend_from_slice(extra);
    let o = run(&all);
    assert_eq!(o.status.code(), Some(0), "run: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The last layer's result in the shadow mode of a report.
fn last_layer(r: &Value) -> &Value {
    let m = &r["modes"][0];
    assert_eq!(m["mode"], "shadow");
    m["layers"].as_array().unwrap().last().unwrap()
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("capsule.json")).unwrap()).unwrap()
}

/// A stage tensor of a capsule's reference, or of a run's `.npy` dump.
fn npy(p: &Path) -> ndarray::ArrayD<f64> {
    ndarray_npy::read_npy(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn a_replayed_capsule_gives_the_runs_checks_bit_for_bit() {
    let fx = "deepseek-v3-yarn-q4_k.gguf";
    let d = tempfile::tempdir().unwrap();
    // Layer 1 alone (its input is the seeded one), and layer 1 as a run over 0..=1 feeds it (the
    // reference's residual stream through layer 0).
    for (layers, before) in [("1", vec![]), ("0..=1", vec![0])] {
        let dir = export(
            fx,
            &d.path().join(format!("cap{}", before.len())),
            &["--layers", layers],
        );
        let m = manifest(&dir);
        assert_eq!(m["capsule_version"], 1);
        assert_eq!(m["layer"], 1);
        assert_eq!(m["heads"], Value::Null);
        assert_eq!(m["input"]["layers_before"], serde_json::json!(before));
        assert_eq!(m["conventions"]["lse_base"], "e");
        assert_eq!(m["source"]["file"], fx);
        let (code, rep) = replay(&dir);
        assert_eq!(code, 0, "{rep}");
        let errors = common::schema_errors(&common::report_validator(), &rep);
        assert!(errors.is_empty(), "schema errors: {errors:#?}");
        let notices = rep["run"]["notices"].to_string();
        assert!(
            notices.contains("layer 1 of deepseek-v3-yarn-q4_k.gguf"),
            "{notices}"
        );

        let dump = d.path().join(format!("dump{}", before.len()));
        let ran = run_json(fx, layers, &["--dump-dir", s(&dump), "--dump-layers", "1"]);
        let (a, b) = (last_layer(&rep), last_layer(&ran));
        assert_eq!(a["layer"], 0, "the capsule's layer is blk.0");
        assert_eq!(b["layer"], 1);
        // The same metrics, bit for bit (JSON keeps every f64 exactly); positions name the layer.
        for k in ["pass", "first_failure", "checks"] {
            let (x, y) = (without_layer(&a[k]), without_layer(&b[k]));
            assert!(
                x == y,
                "{k} differs between replay and run --layers {layers}"
            );
        }
        // The capsule's reference is the run's, bit for bit.
        for st in m["files"]["reference"].as_array().unwrap() {
            let name = st["stage"].as_str().unwrap();
            let ours = npy(&dir.join(st["path"].as_str().unwrap()));
            let theirs = npy(&dump.join(format!("layer1/{name}.ref.npy")));
            assert_eq!(ours.shape(), theirs.shape(), "{name}");
            let same = ours
                .iter()
                .zip(theirs.iter())
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "reference stage {name} differs from the run's");
        }
    }
    // Exporting again into a capsule directory replaces it.
    export(fx, &d.path().join("cap0"), &["--layers", "0"]);
    assert_eq!(manifest(&d.path().join("cap0"))["layer"], 0);
}

/// `v` without the `layer` of its positions (0 in a replay, L in the run).
fn without_layer(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| *k != "layer")
                .map(|(k, x)| (k.clone(), without_layer(x)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_layer).collect()),
        x => x.clone(),
    }
}

/// Heads A..B of a capsule's stage `[token, head, dim]` against the full layer's: the cut keeps each
/// head's numbers (every per-head stage is computed from that head's rows alone).
fn assert_heads_kept(cap: &Path, dump: &Path, stage: &str, heads: [usize; 2]) {
    let ours = npy(&cap.join(format!("reference/{stage}.npy")));
    let full = npy(&dump.join(format!("layer0/{stage}.ref.npy")));
    let full = full.slice_axis(ndarray::Axis(1), (heads[0]..heads[1]).into());
    assert_eq!(ours.shape(), full.shape(), "{stage}");
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in ours.iter().zip(full.iter()) {
        num += (x - y) * (x - y);
        den += y * y;
    }
    let rel = (num / den).sqrt();
    assert!(
        rel <= 1e-12,
        "{stage}: heads {heads:?} differ from the full layer's by {rel:e}"
    );
}

#[test]
fn head_cuts_replay_on_every_kv_b_layout() {
    let d = tempfile::tempdir().unwrap();
    // Split attn_k_b/attn_v_b with a Q4_K attn_output (pairs of heads); legacy attn_kv_b; MiniCPM3,
    // whose head dims default to hidden / head_count; GLM-5's 64 heads of 256.
    for (fx, heads, kept) in [
        ("deepseek-v3-yarn-q4_k.gguf", "2..6", [2, 6]),
        ("deepseek-v3-legacy-kv-b-q8_0.gguf", "1..3", [1, 3]),
        ("minicpm3-f32.gguf", "1..2", [1, 2]),
        ("glm-5-q4_0.gguf", "8..16", [8, 16]),
    ] {
        let dir = export(fx, &d.path().join(fx), &["--layers", "0", "--heads", heads]);
        let m = manifest(&dir);
        assert_eq!(m["heads"], serde_json::json!(kept), "{fx}");
        assert!(m["heads_note"]
            .as_str()
            .unwrap()
            .contains("attn_out sums the kept heads only"));
        assert_eq!(m["config"]["n_head"], kept[1] - kept[0], "{fx}");
        assert_eq!(m["config"]["n_layer"], 1, "{fx}");
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
        assert!(readme.contains("Heads cut"), "{readme}");
        let (code, rep) = replay(&dir);
        assert_eq!(code, 0, "{fx}: {rep}");
        assert!(rep["run"]["notices"]
            .to_string()
            .contains("attn_out sums the kept heads only"));

        let dump = d.path().join(format!("{fx}.dump"));
        run_json(fx, "0", &["--dump-dir", s(&dump), "--dump-layers", "0"]);
        for stage in [
            "q_nope",
            "q_pe",
            "lse",
            "attn_heads",
            "q_absorbed",
            "attn_latent",
        ] {
            assert_heads_kept(&dir, &dump, stage, kept);
        }
    }
}

#[test]
fn a_changed_weight_byte_is_caught_before_the_run() {
    let d = tempfile::tempdir().unwrap();
    let dir = export("deepseek-v3-yarn-q4_k.gguf", d.path(), &["--layers", "0"]);
    let gguf = dir.join("layer.gguf");
    let at = {
        let f = GgufFile::open(&gguf).unwrap();
        let t = f.tensor("blk.0.attn_output.weight").unwrap();
        (f.data_offset + t.offset + t.n_bytes().unwrap() / 2) as usize
    };
    let mut b = std::fs::read(&gguf).unwrap();
    b[at] ^= 0x5a;
    std::fs::write(&gguf, b).unwrap();
    let o = run(&["replay", s(&dir), "--backend", "cpu"]);
    assert_clean_error(
        &o,
        "capsule's reference does not match its weights: stage attn_out",
    );
}

#[test]
fn a_missing_or_malformed_manifest_is_a_clean_error() {
    let d = tempfile::tempdir().unwrap();
    let good = export(
        "minicpm3-f32.gguf",
        &d.path().join("good"),
        &["--layers", "0"],
    );
    let text = std::fs::read_to_string(good.join("capsule.json")).unwrap();
    let replay_err = |dir: &Path, needle: &str| {
        assert_clean_error(&run(&["replay", s(dir), "--backend", "cpu"]), needle)
    };
    // Each case on a copy of the capsule, edited.
    let copy = |name: &str| {
        let c = d.path().join(name);
        std::fs::create_dir_all(c.join("reference")).unwrap();
        for e in walk(&good) {
            let rel = e.strip_prefix(&good).unwrap();
            std::fs::copy(&e, c.join(rel)).unwrap();
        }
        c
    };
    replay_err(&d.path().join("nowhere"), "cannot open capsule");
    let c = copy("no-manifest");
    std::fs::remove_file(c.join("capsule.json")).unwrap();
    replay_err(&c, "is not a capsule: cannot read its capsule.json");
    let c = copy("not-json");
    std::fs::write(c.join("capsule.json"), &text[..text.len() / 2]).unwrap();
    replay_err(&c, "capsule.json: not JSON");
    let c = copy("newer");
    std::fs::write(
        c.join("capsule.json"),
        text.replace("\"capsule_version\": 1", "\"capsule_version\": 2"),
    )
    .unwrap();
    replay_err(&c, "capsule_version 2; this mla-diff reads version 1");
    let c = copy("no-schedule");
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("schedule");
    std::fs::write(c.join("capsule.json"), v.to_string()).unwrap();
    replay_err(&c, "malformed capsule manifest: missing field `schedule`");
    let c = copy("escape");
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["files"]["input"] = "../good/input.npy".into();
    std::fs::write(c.join("capsule.json"), v.to_string()).unwrap();
    replay_err(&c, "is not a plain relative path inside the capsule");
    let c = copy("no-input");
    std::fs::remove_file(c.join("input.npy")).unwrap();
    replay_err(&c, "is incomplete: the input");
    let c = copy("no-stage");
    std::fs::remove_file(c.join("reference/lse.npy")).unwrap();
    replay_err(&c, "is incomplete: the reference of lse");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn bad_exports_are_clean_errors() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("c");
    let fx = "deepseek-v3-yarn-q4_k.gguf";
    // Q4_K blocks of 256 values, heads of 128 columns: a cut must fall on an even head.
    assert_clean_error(
        &export_out(fx, &dir, &["--layers", "0", "--heads", "1..4"]),
        "nearest valid ranges 0..4 (covering), 2..4 (inside)",
    );
    assert_clean_error(
        &export_out(fx, &dir, &["--layers", "0", "--heads", "0..9"]),
        "not a non-empty range of the model's 8 heads",
    );
    assert_clean_error(
        &export_out(fx, &dir, &["--layers", "2"]),
        "layer 2 does not exist: the model has 2 layers",
    );
    assert!(!dir.exists(), "a failed export writes nothing");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    assert_clean_error(
        &export_out(fx, &dir, &["--layers", "0"]),
        "the directory is not empty and holds no capsule",
    );
}
