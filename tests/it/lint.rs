//! `mla-diff lint`: every shipped file lints clean; a file with one corrupted key (or tensor) gives the
//! error naming that key and the value expected; the kernel plan names the kernel the dims take; and a
//! runner's conventions are probed through the real protocol: the numpy runner is clean, each planted
//! bug in runners/bugs/ gives its own error and no other.
//!
//! The runner tests need the interpreter named by MLA_DIFF_PYTHON with numpy (.ci/run installs it);
//! without it they skip, except under CI where they fail.

use crate::common::{
    assert_clean_error, fixture, fixtures_dir, python, rewrite, run, runner, stderr, Tensor,
};
use mla_diff::gguf::Value;
use serde_json::Value as J;
use std::path::{Path, PathBuf};

/// `lint FILE --json - ARGS`: exit code, the JSON object, stderr (where the text goes).
fn lint(file: &Path, extra: &[&str]) -> (Option<i32>, J, String) {
    let mut args = vec!["lint", file.to_str().unwrap(), "--json", "-"];
    args.extend_from_slice(extra);
    let o = run(&args);
    let j: J = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
    (o.status.code(), j, stderr(&o))
}

fn findings<'a>(j: &'a J, severity: &str) -> Vec<&'a J> {
    j["findings"]
        .as_array()
        .unwrap_or_else(|| panic!("no findings in {j}"))
        .iter()
        .filter(|f| f["severity"] == severity)
        .collect()
}

fn checks(j: &J, severity: &str) -> Vec<String> {
    findings(j, severity)
        .iter()
        .map(|f| f["check"].as_str().unwrap().to_string())
        .collect()
}

/// The one finding of `severity` on `check`.
fn finding<'a>(j: &'a J, severity: &str, check: &str) -> &'a J {
    let f: Vec<&J> = findings(j, severity)
        .into_iter()
        .filter(|f| f["check"] == check)
        .collect();
    assert_eq!(f.len(), 1, "{severity} {check} in {j:#}");
    f[0]
}

/// The JSON agrees with itself, the schema and the exit code.
fn consistent(code: Option<i32>, j: &J) {
    let schema: J = serde_json::from_str(include_str!("../../schema/lint.schema.json")).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let errs: Vec<String> = v.iter_errors(j).map(|e| e.to_string()).collect();
    assert!(errs.is_empty(), "{errs:?}");
    let n = findings(j, "error").len();
    assert_eq!(j["errors"], n);
    assert_eq!(j["warnings"], findings(j, "warning").len());
    // A runner that cannot take the model is unsupported (2, as `run` exits), distinct from a wrong
    // kernel or file (1).
    let unsupported = findings(j, "error")
        .iter()
        .any(|f| f["check"].as_str().unwrap().starts_with("runner.supports."));
    let want = match (unsupported, n > 0) {
        (true, _) => 2,
        (false, true) => 1,
        _ => 0,
    };
    assert_eq!(code, Some(want), "{j:#}");
}

fn gguf_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_shipped_file_lints_clean() {
    let mut files = gguf_files(&fixtures_dir());
    files.extend(gguf_files(&fixtures_dir().join("golden")));
    assert!(files.len() >= 14, "{files:?}");
    for f in &files {
        // DeepSeek-V4 has no CUDA path yet (lint --backend cuda exits 2 on it: v4_reader.rs).
        let v4 = f.ends_with("deepseek-v4.gguf");
        let (code, j, err) = lint(f, if v4 { &[] } else { &["--backend", "cuda"] });
        consistent(code, &j);
        assert_eq!(code, Some(0), "{}: {err}", f.display());
        assert!(
            checks(&j, "note").contains(&"softmax_scale".to_string()),
            "{j:#}"
        );
    }
    // The shipped fixtures are catalogue models at reduced hidden/heads, and lint says which.
    for (file, model) in [
        ("deepseek-v3-yarn-q4_k.gguf", "DeepSeek-V3"),
        ("deepseek-v3-legacy-kv-b-q8_0.gguf", "DeepSeek-V3"),
        ("deepseek-v2-lite-bf16.gguf", "DeepSeek-V2-Lite"),
        ("glm-5-q4_0.gguf", "GLM-5"),
        ("minicpm3-f32.gguf", "MiniCPM3-4B"),
    ] {
        let (_, j, _) = lint(&fixture(file), &[]);
        let c = finding(&j, "note", "catalogue");
        assert!(
            c["found"].as_str().unwrap().starts_with(model),
            "{file}: {c}"
        );
        assert!(findings(&j, "warning").is_empty(), "{file}: {j:#}");
    }
    // The golden converted without mscale_all_dim is flagged as the engines' disagreement it is.
    let (_, j, _) = lint(
        &fixtures_dir().join("golden/deepseek-v3-yarn-no-mscale.gguf"),
        &[],
    );
    let w = finding(&j, "warning", "deepseek2.rope.scaling.yarn_log_multiplier");
    assert!(
        w["why"].as_str().unwrap().contains("yarn_mscale_missing"),
        "{w}"
    );
}

#[test]
fn the_softmax_scale_is_printed_with_the_576_trap() {
    let (_, j, _) = lint(&fixture("deepseek-v3-yarn-q4_k.gguf"), &[]);
    let s = finding(&j, "note", "softmax_scale");
    let found = s["found"].as_str().unwrap();
    // mscale = 0.1·1·ln(40) + 1; scale = mscale² / sqrt(192).
    let mscale = 0.1f64 * 40f64.ln() + 1.0;
    let want = mscale * mscale / 192f64.sqrt();
    assert!(
        found.starts_with(&format!("{:.6}", want)),
        "{found} vs {want}"
    );
    assert!(found.contains("sqrt(128 + 64)"), "{found}");
    let why = s["why"].as_str().unwrap();
    assert!(why.contains("576^-0.5 = 0.041667"), "{why}");
    assert!(
        why.contains(&format!("{:.6}", 1.0 / 192f64.sqrt())),
        "{why}"
    );
}

/// The deepseek-v3 fixture with its metadata edited (keys `deepseek2.*`).
fn edited(dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> PathBuf {
    rewrite(
        &fixture("deepseek-v3-yarn-q4_k.gguf"),
        &dir.join(name),
        edit,
        |_| {},
    )
}

fn set(m: &mut Vec<(String, Value)>, key: &str, v: Value) {
    match m.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => m.push((key.to_string(), v)),
    }
}

fn remove(m: &mut Vec<(String, Value)>, key: &str) {
    let n = m.len();
    m.retain(|(k, _)| k != key);
    assert_eq!(m.len() + 1, n, "{key} was not in the file");
}

/// A corrupted key: exit 1, an error on that key expecting `expected`, whose reason mentions `why`.
fn expect_error(p: &Path, key: &str, expected: &str, why: &str) -> J {
    let (code, j, err) = lint(p, &[]);
    consistent(code, &j);
    assert_eq!(code, Some(1), "{key}: {err}");
    let f = finding(&j, "error", key);
    assert!(
        f["expected"].as_str().unwrap().contains(expected),
        "{key}: expected {:?}, not {expected:?}",
        f["expected"]
    );
    assert!(f["why"].as_str().unwrap().contains(why), "{key}: {f}");
    j
}

#[test]
fn corrupted_keys_are_errors_naming_the_value_expected() {
    let d = tempfile::tempdir().unwrap();
    let k = |s: &str| format!("deepseek2.{s}");
    // Rope dims that disagree with the tensors (attn_kv_a_mqa is 512 + 64 wide), or cannot pair.
    for (name, r) in [("rope32.gguf", 32u32), ("rope63.gguf", 63)] {
        let p = edited(d.path(), name, |m| {
            set(m, &k("rope.dimension_count"), Value::U32(r))
        });
        let j = expect_error(&p, &k("rope.dimension_count"), "64", "attn_kv_a_mqa");
        assert_eq!(findings(&j, "error").len(), 1, "{j:#}");
    }
    // kv_lora_rank against the latent tensors; key_length (the 576 row) is right and stays quiet.
    let p = edited(d.path(), "kv.gguf", |m| {
        set(m, &k("attention.kv_lora_rank"), Value::U32(256))
    });
    let j = expect_error(&p, &k("attention.kv_lora_rank"), "512", "attn_kv_a_norm");
    assert_eq!(checks(&j, "error"), [k("attention.kv_lora_rank")], "{j:#}");
    // YaRN without its original context: llama.cpp and mla-diff fall back differently.
    let p = edited(d.path(), "orig.gguf", |m| {
        remove(m, &k("rope.scaling.original_context_length"))
    });
    expect_error(
        &p,
        &k("rope.scaling.original_context_length"),
        "original",
        "context_length (163840)",
    );
    // eps 0 (NaN on a zero row), eps absent (llama.cpp refuses it).
    let p = edited(d.path(), "eps0.gguf", |m| {
        set(m, &k("attention.layer_norm_rms_epsilon"), Value::F32(0.0))
    });
    let j = expect_error(
        &p,
        &k("attention.layer_norm_rms_epsilon"),
        "[1.000000e-7",
        "NaN",
    );
    assert_eq!(findings(&j, "error").len(), 1, "{j:#}");
    let p = edited(d.path(), "noeps.gguf", |m| {
        remove(m, &k("attention.layer_norm_rms_epsilon"))
    });
    expect_error(
        &p,
        &k("attention.layer_norm_rms_epsilon"),
        "1e-6",
        "refuses",
    );
    // yarn_log_multiplier stored as the HF mscale_all_dim, without the converter's ×0.1.
    let p = edited(d.path(), "logmul.gguf", |m| {
        set(m, &k("rope.scaling.yarn_log_multiplier"), Value::F32(1.0))
    });
    expect_error(
        &p,
        &k("rope.scaling.yarn_log_multiplier"),
        "0.1",
        "PR #17945",
    );
    // A factor without the scaling type: llama.cpp reads it as linear scaling.
    let p = edited(d.path(), "notype.gguf", |m| {
        remove(m, &k("rope.scaling.type"))
    });
    expect_error(&p, &k("rope.scaling.factor"), "yarn", "linear");
    // The same through the old key llama.cpp still reads.
    let p = edited(d.path(), "linear.gguf", |m| {
        remove(m, &k("rope.scaling.type"));
        remove(m, &k("rope.scaling.factor"));
        set(m, &k("rope.scale_linear"), Value::F32(4.0));
    });
    expect_error(&p, &k("rope.scale_linear"), "yarn", "linear");
    // One of the *_mla pair.
    let p = edited(d.path(), "mla1.gguf", |m| {
        remove(m, &k("attention.value_length_mla"))
    });
    expect_error(&p, &k("attention.key_length_mla"), "both", "head dims");
    // The MQA view's key length (the cache row).
    let p = edited(d.path(), "klen.gguf", |m| {
        set(m, &k("attention.key_length"), Value::U32(512))
    });
    expect_error(&p, &k("attention.key_length"), "576", "cache row");
    // q-LoRA tensors without the rank key.
    let p = edited(d.path(), "noq.gguf", |m| {
        remove(m, &k("attention.q_lora_rank"))
    });
    expect_error(&p, &k("attention.q_lora_rank"), "256", "attn_q");
    // A rope base that cannot rotate.
    let p = edited(d.path(), "base.gguf", |m| {
        set(m, &k("rope.freq_base"), Value::F32(0.0))
    });
    expect_error(&p, &k("rope.freq_base"), "above 1", "rope angle");
    // Not an integer where one is read.
    let p = edited(d.path(), "type.gguf", |m| {
        set(m, &k("attention.head_count"), Value::String("8".into()))
    });
    expect_error(&p, &k("attention.head_count"), "unsigned integer", "type");
}

/// The loader collects every diagnostic of the keys (not only its first), each naming its key; its error
/// is the first one's, and lint reports the same diagnostics as errors on those keys.
#[test]
fn the_loader_collects_every_key_diagnostic_and_lint_reports_them() {
    let d = tempfile::tempdir().unwrap();
    let k = |s: &str| format!("deepseek2.{s}");
    let p = edited(d.path(), "three.gguf", |m| {
        set(m, &k("attention.head_count"), Value::String("8".into()));
        remove(m, &k("attention.kv_lora_rank"));
        remove(m, &k("attention.value_length_mla"));
    });
    let f = mla_diff::gguf::GgufFile::open(&p).unwrap();
    let dg = mla_diff::model::MlaConfig::from_gguf_diagnosed(&f).unwrap();
    assert!(dg.cfg.is_none());
    let got: Vec<(&str, &str)> = dg
        .diagnostics
        .0
        .iter()
        .map(|d| (d.key.as_str(), d.rule))
        .collect();
    let want = [
        (k("attention.head_count"), "type"),
        (k("attention.kv_lora_rank"), "missing"),
        (k("attention.key_length_mla"), "mla_pair"),
    ];
    let want: Vec<(&str, &str)> = want.iter().map(|(a, b)| (a.as_str(), *b)).collect();
    assert_eq!(got, want);
    let e = mla_diff::model::MlaConfig::from_gguf(&f)
        .unwrap_err()
        .to_string();
    assert!(
        e.ends_with(": metadata key deepseek2.attention.head_count should be an unsigned integer, found \"8\""),
        "{e}"
    );
    let (code, j, _) = lint(&p, &[]);
    consistent(code, &j);
    for (key, _) in &want {
        finding(&j, "error", key);
    }
}

/// The loader's dims rules (`zero`, `limit`, `rope_dims`) are evaluated on whatever keys it can read,
/// not only once every dim is readable: a file missing one key still gets them, one per key, and lint
/// reports them from the loader (it evaluates none of them itself). `from_gguf`'s error stays the first.
#[test]
fn the_loaders_dims_rules_hold_on_the_keys_it_can_read() {
    let d = tempfile::tempdir().unwrap();
    let k = |s: &str| format!("deepseek2.{s}");
    let big = 1u32 << 21;
    let p = edited(d.path(), "partial.gguf", |m| {
        remove(m, &k("attention.kv_lora_rank"));
        set(m, &k("embedding_length"), Value::U32(0));
        set(m, &k("attention.head_count"), Value::U32(big));
        // A head of rope only (the tensors agree with the rope key: lint blames it for nothing else).
        set(m, &k("attention.key_length_mla"), Value::U32(64));
    });
    let q = edited(d.path(), "no_layers.gguf", |m| {
        set(m, &k("block_count"), Value::U32(0));
        remove(m, &k("attention.key_length_mla"));
        set(m, &k("attention.value_length_mla"), Value::U32(0));
    });
    let cases = [
        (
            &p,
            vec![
                (k("attention.kv_lora_rank"), "missing", "refuse an MLA file"),
                (k("embedding_length"), "zero", "zero-sized attention"),
                (k("rope.dimension_count"), "rope_dims", "rope rotates pairs"),
                (k("attention.head_count"), "limit", "implausible"),
            ],
            "required metadata key deepseek2.attention.kv_lora_rank is missing",
            (Some(64), Some(128), true),
        ),
        (
            &q,
            vec![
                (k("attention.value_length_mla"), "mla_pair", "per-head dims"),
                (k("block_count"), "zero", "a model without layers"),
                (
                    k("attention.value_length_mla"),
                    "zero",
                    "zero-sized value heads",
                ),
            ],
            "value_length_mla is present (llama.cpp needs both or neither)",
            (None, Some(0), false),
        ),
    ];
    for (p, want, first, (qk, v, whole)) in cases {
        let f = mla_diff::gguf::GgufFile::open(p).unwrap();
        let dg = mla_diff::model::MlaConfig::from_gguf_diagnosed(&f).unwrap();
        let got: Vec<(String, &str)> = dg
            .diagnostics
            .0
            .iter()
            .map(|d| (d.key.clone(), d.rule))
            .collect();
        let keys: Vec<(String, &str)> = want.iter().map(|(a, b, _)| (a.clone(), *b)).collect();
        assert_eq!(got, keys, "{}", p.display());
        // The head dims the rules saw (and lint's checks take): the *_mla keys as far as present.
        let h = dg.heads;
        assert_eq!((h.qk, h.v, h.mla, h.whole), (qk, v, true, whole));
        let e = mla_diff::model::MlaConfig::from_gguf(&f)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with(first), "{e}");
        let (code, j, _) = lint(p, &[]);
        consistent(code, &j);
        for (key, _, why) in &want {
            let on_key = findings(&j, "error")
                .into_iter()
                .filter(|f| f["check"] == key.as_str() && f["why"].as_str().unwrap().contains(why))
                .count();
            assert_eq!(on_key, 1, "{key} ({why}) in {j:#}");
        }
    }
}

#[test]
fn tensor_shapes_are_checked_against_the_metadata() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture("deepseek-v3-yarn-q4_k.gguf");
    // attn_k_b of layer 0 stored untransposed (the same bytes, ne {Lkv, P, H}).
    let p = rewrite(
        &src,
        &d.path().join("kb.gguf"),
        |_| {},
        |ts: &mut Vec<Tensor>| {
            let t = ts
                .iter_mut()
                .find(|t| t.name == "blk.0.attn_k_b.weight")
                .unwrap();
            t.ne = vec![512, 128, 8];
        },
    );
    let j = expect_error(&p, "blk.0.attn_k_b.weight", "{128, 512, 8}", "untransposed");
    // The metadata's keys are not blamed for one layer's odd tensor.
    assert_eq!(checks(&j, "error"), ["blk.0.attn_k_b.weight"], "{j:#}");
    // A layer without its kv_a projection.
    let p = rewrite(
        &src,
        &d.path().join("miss.gguf"),
        |_| {},
        |ts: &mut Vec<Tensor>| ts.retain(|t| t.name != "blk.1.attn_kv_a_mqa.weight"),
    );
    let j = expect_error(&p, "blk.1.attn_kv_a_mqa.weight", "{512, 576}", "refuses");
    assert_eq!(
        finding(&j, "error", "blk.1.attn_kv_a_mqa.weight")["found"],
        "absent"
    );
}

#[test]
fn a_file_one_key_off_a_known_model_is_a_warning_naming_it() {
    let d = tempfile::tempdir().unwrap();
    for (name, key, v, expected) in [
        (
            "eps.gguf",
            "attention.layer_norm_rms_epsilon",
            Value::F32(1e-5),
            "1.000000e-6, as DeepSeek-V3",
        ),
        (
            "base.gguf",
            "rope.freq_base",
            Value::F32(50000.0),
            "10000, as DeepSeek-V3",
        ),
    ] {
        let p = edited(d.path(), name, |m| set(m, &format!("deepseek2.{key}"), v));
        let (code, j, err) = lint(&p, &[]);
        consistent(code, &j);
        assert_eq!(code, Some(0), "{err}");
        let w = finding(&j, "warning", &format!("deepseek2.{key}"));
        assert_eq!(w["expected"], expected, "{w}");
    }
}

#[test]
fn the_kernel_plan_follows_the_dims() {
    let kernel = |file: &Path, extra: &[&str]| -> (String, String) {
        let mut a = vec!["--backend", "cuda"];
        a.extend_from_slice(extra);
        let (code, j, err) = lint(file, &a);
        assert_eq!(code, Some(0), "{err}");
        let get = |c: &str| {
            let f = findings(&j, "note")
                .into_iter()
                .chain(findings(&j, "warning"))
                .find(|f| f["check"] == c)
                .unwrap_or_else(|| panic!("no {c} in {j:#}"));
            f["found"].as_str().unwrap().to_string() + " | " + f["why"].as_str().unwrap()
        };
        (get("kernel.decode"), get("kernel.prefill"))
    };
    let glm = fixture("glm-5-q4_0.gguf");
    // 64 heads: 64 rows per request, latent 512 — Hopper's wgmma decode.
    let (dec, pre) = kernel(&glm, &[]);
    assert!(dec.starts_with("attn_wgmma"), "{dec}");
    assert!(dec.contains("231424 bytes"), "{dec}");
    assert!(dec.contains("pages of 16 rows"), "{dec}");
    // Prefill on Hopper's wgmma too: 128 rows x 64 keys, Q + two K/V stages of 256-wide rows.
    assert!(pre.starts_with("attn_wgmma"), "{pre}");
    assert!(
        pre.contains("128 rows × 64 keys per CTA, 197632 bytes"),
        "{pre}"
    );
    let (dec, pre) = kernel(&glm, &["--arch", "sm_90", "--page-size", "64"]);
    assert!(
        dec.starts_with("attn_mma") && dec.contains("sm_90a only"),
        "{dec}"
    );
    assert!(
        pre.starts_with("attn_mma") && pre.contains("sm_90a only"),
        "{pre}"
    );
    assert!(dec.contains("pages of 64 rows"), "{dec}");
    let (dec, pre) = kernel(&glm, &["--dtype", "f32"]);
    assert!(
        dec.starts_with("attn_scalar") && pre.starts_with("attn_scalar"),
        "{dec}"
    );
    // 8 heads, one query: the small-row tiles; eight queries (MTP): 64 rows, wgmma.
    let v3 = fixture("deepseek-v3-yarn-q4_k.gguf");
    let (dec, _) = kernel(&v3, &[]);
    assert!(
        dec.starts_with("attn_mma") && dec.contains("16 rows"),
        "{dec}"
    );
    let (dec, _) = kernel(&v3, &["--q-len", "8"]);
    assert!(dec.starts_with("attn_wgmma"), "{dec}");
    // A latent of 64 (the goldens' tiny dims) is no wgmma shape.
    let (dec, _) = kernel(
        &fixtures_dir().join("golden/glm-5.gguf"),
        &["--q-len", "16"],
    );
    assert!(
        dec.starts_with("attn_mma") && dec.contains("kv_lora_rank 64"),
        "{dec}"
    );
    // The CPU mirror takes anything.
    let (code, j, _) = lint(&v3, &["--backend", "cpu"]);
    assert_eq!(code, Some(0));
    assert_eq!(finding(&j, "note", "kernel")["found"], "the CPU mirror");
}

#[test]
fn output_modes_and_bad_input() {
    let d = tempfile::tempdir().unwrap();
    let v3 = fixture("deepseek-v3-yarn-q4_k.gguf");
    let v3s = v3.to_str().unwrap();
    // Text on stdout, JSON to a file; -q keeps errors and warnings only.
    let out = d.path().join("lint.json");
    let o = run(&["lint", v3s, "--json", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("note     softmax_scale: 0.135234"), "{text}");
    assert!(
        text.trim_end()
            .ends_with("lint: 0 errors, 0 warnings (clean)"),
        "{text}"
    );
    let j: J = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    consistent(Some(0), &j);
    assert_eq!(j["lint_version"], 1);
    let o = run(&["lint", v3s, "-q"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 2);
    // An error line: severity, check, found, expected, why.
    let p = edited(d.path(), "eps0.gguf", |m| {
        set(
            m,
            "deepseek2.attention.layer_norm_rms_epsilon",
            Value::F32(0.0),
        )
    });
    let o = run(&["lint", p.to_str().unwrap(), "-q"]);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(
            "error    deepseek2.attention.layer_norm_rms_epsilon: found 0; expected in ["
        ),
        "{text}"
    );
    // Unreadable or non-MLA input, bad options: exit 2, one line.
    assert_clean_error(&run(&["lint", "/nonexistent.gguf"]), "/nonexistent.gguf");
    let junk = d.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all").unwrap();
    assert_clean_error(&run(&["lint", junk.to_str().unwrap()]), "junk.gguf");
    let llama = edited(d.path(), "llama.gguf", |m| {
        set(m, "general.architecture", Value::String("llama".into()))
    });
    assert_clean_error(
        &run(&["lint", llama.to_str().unwrap()]),
        "does not use Multi-head Latent Attention",
    );
    assert_clean_error(
        &run(&["lint", v3s, "--backend", "cuda", "--arch", "sm_1"]),
        "--arch sm_1",
    );
    assert_clean_error(&run(&["lint", v3s, "--page-size", "0"]), "--page-size");
    assert_clean_error(
        &run(&["lint", v3s, "--json", "/nonexistent/dir/x.json"]),
        "does not exist",
    );
    assert_clean_error(
        &run(&["lint", v3s, "--runner", "/nonexistent/runner"]),
        "cannot start it",
    );
}

// ---- runners ----

/// What every probe of a clean runner notes.
const PROBES: [&str; 10] = [
    "runner.decode.softmax_scale",
    "runner.decode.lse_base",
    "runner.decode.cache_row",
    "runner.decode.paging",
    "runner.decode.mtp_causal",
    "runner.decode.split_partition",
    "runner.decode.empty_split",
    "runner.prefill.softmax_scale",
    "runner.prefill.lse_base",
    "runner.prefill.causal",
];

#[test]
fn the_numpy_runner_probes_clean_on_every_shipped_fixture() {
    let Some(py) = python("lint runner probes", "numpy and safetensors") else {
        return;
    };
    let cmd = runner(&py, "numpy_mla.py");
    for f in gguf_files(&fixtures_dir()) {
        for extra in [
            &[][..],
            &["--page-size", "1"],
            &["--dtype", "f32", "--page-size", "64"],
        ] {
            let mut a = vec!["--runner", cmd.as_str()];
            a.extend_from_slice(extra);
            let (code, j, err) = lint(&f, &a);
            consistent(code, &j);
            assert_eq!(code, Some(0), "{} {extra:?}: {err}", f.display());
            let notes = checks(&j, "note");
            for p in PROBES {
                assert!(
                    notes.contains(&p.to_string()),
                    "{}: no {p} in {notes:?}",
                    f.display()
                );
            }
        }
    }
}

#[test]
fn each_planted_runner_bug_gives_its_own_error() {
    let Some(py) = python("lint runner probes", "numpy and safetensors") else {
        return;
    };
    // The bugs are numpy_mla's, whose sparse ops share its hooks: a wrong scale or LSE base is wrong in
    // them too, and lint probes every op declared (on a dense file as well).
    for (bug, errors, needle) in [
        (
            "scale_default.py",
            &[
                "runner.decode.softmax_scale",
                "runner.sparse_prefill.softmax_scale",
                "runner.sparse_decode.softmax_scale",
                "runner.prefill.softmax_scale",
            ][..],
            "576^-0.5 trap",
        ),
        (
            "lse_base2.py",
            &[
                "runner.decode.lse_base",
                "runner.sparse_prefill.lse_base",
                "runner.sparse_decode.lse_base",
                "runner.prefill.lse_base",
            ],
            "lse_log2_merge",
        ),
        (
            "kpe_latent_swapped.py",
            &["runner.decode.cache_row"],
            "[k_pe | latent]",
        ),
        ("page_size.py", &["runner.decode.paging"], "NaN-poisoned"),
        ("prefill_noncausal.py", &["runner.prefill.causal"], "0.1875"),
        // An early NaN is one finding, not three on the scale, the base and the value.
        (
            "seqlen_past_end.py",
            &["runner.decode.non_finite"],
            "reads rows outside the sequence",
        ),
        ("mtp_noncausal.py", &["runner.decode.mtp_causal"], "0.1875"),
        (
            "split_floor.py",
            &["runner.decode.split_partition"],
            "[1, 1, 1, 2]",
        ),
        (
            "empty_split_lse_zero.py",
            &["runner.decode.empty_split"],
            "split_lse is 0",
        ),
    ] {
        for file in ["deepseek-v3-yarn-q4_k.gguf", "glm-5-q4_0.gguf"] {
            let (code, j, err) = lint(
                &fixture(file),
                &["--runner", &runner(&py, &format!("bugs/{bug}"))],
            );
            consistent(code, &j);
            assert_eq!(code, Some(1), "{bug} on {file}: {err}");
            assert_eq!(checks(&j, "error"), errors, "{bug} on {file}: {j:#}");
            let f = finding(&j, "error", errors[0]);
            let text = format!("{}{}", f["found"], f["why"]);
            assert!(text.contains(needle), "{bug}: {f}");
        }
    }
    // The 576^-0.5 trap is named with the numbers: FlashMLA's default against the model's scale.
    let (_, j, _) = lint(
        &fixture("deepseek-v3-yarn-q4_k.gguf"),
        &["--runner", &runner(&py, "bugs/scale_default.py")],
    );
    let f = finding(&j, "error", "runner.decode.softmax_scale");
    assert!(f["found"].as_str().unwrap().starts_with("0.041667"), "{f}");
    assert!(
        f["expected"].as_str().unwrap().starts_with("0.135234"),
        "{f}"
    );
}

/// A runner whose `supports` leave the model out: an error per key, probes at what it takes or none.
#[test]
fn a_runners_supports_are_checked_against_the_model() {
    let Some(py) = python("lint runner probes", "numpy and safetensors") else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("flashmla_like.py");
    std::fs::write(
        &s,
        format!(
            "import sys\nsys.path.insert(0, {:?})\nimport numpy_mla, protocol\n\
class R(numpy_mla.NumpyMLA):\n    def describe(self):\n        d = super().describe()\n        d['supports'].update(page_sizes=[64], kv_lora_rank=[512], qk_rope=[64], dtypes=['bf16', 'fp16'])\n        return d\n\
if __name__ == '__main__':\n    protocol.main(R)\n",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("runners").display().to_string()
        ),
    )
    .unwrap();
    let cmd = format!("{py} {}", s.display());
    // DeepSeek dims, no --page-size: the probes take page 64 (the runner's), as a run does.
    let (code, j, err) = lint(&fixture("deepseek-v3-yarn-q4_k.gguf"), &["--runner", &cmd]);
    consistent(code, &j);
    assert_eq!(code, Some(0), "{err}");
    assert!(finding(&j, "note", "runner.supports.page_size")["found"] == "page size 64");
    assert!(finding(&j, "note", "runner.decode.paging")["found"]
        .as_str()
        .unwrap()
        .contains("of 64 rows"));
    // --page-size 16 asked for: refused by page size (unsupported: exit 2, as run), probed at 64.
    let (code, j, err) = lint(
        &fixture("deepseek-v3-yarn-q4_k.gguf"),
        &["--runner", &cmd, "--page-size", "16"],
    );
    consistent(code, &j);
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(checks(&j, "error"), ["runner.supports.page_size"], "{j:#}");
    let (code, j, _) = lint(
        &fixture("deepseek-v3-yarn-q4_k.gguf"),
        &["--runner", &cmd, "--page-size", "64", "--dtype", "f32"],
    );
    assert_eq!(code, Some(2));
    assert_eq!(checks(&j, "error"), ["runner.supports.dtype"], "{j:#}");
    // MiniCPM3's latent of 256: no request at its dims can be answered.
    let (code, j, _) = lint(
        &fixture("minicpm3-f32.gguf"),
        &["--runner", &cmd, "--page-size", "64"],
    );
    assert_eq!(code, Some(2));
    assert_eq!(
        checks(&j, "error"),
        ["runner.supports.kv_lora_rank", "runner.supports.qk_rope"],
        "{j:#}"
    );
    assert_eq!(finding(&j, "note", "runner.probes")["found"], "not run");
}

/// The DSA ops are probed too (scale, LSE base, the one key's latent): FlashMLA's sparse runner with
/// its numpy stand-in is clean on both, including its sparse_decode over the fp8 cache (the probe's
/// entries are exact in it); its planted bugs give their own op's errors (the −1 padding read as the
/// last, NaN, slot: one non-finite finding; the fp8 scale applied twice).
#[test]
fn the_sparse_runners_ops_are_probed() {
    let Some(py) = python("lint runner probes", "numpy and safetensors") else {
        return;
    };
    let f = fixture("glm-5-q4_0.gguf");
    let clean = format!(
        "env MLA_DIFF_FLASHMLA_STANDIN=numpy {}",
        runner(&py, "flashmla_sparse.py")
    );
    let (code, j, err) = lint(&f, &["--runner", &clean]);
    consistent(code, &j);
    assert_eq!(code, Some(0), "{err}");
    let notes = checks(&j, "note");
    for op in ["sparse_prefill", "sparse_decode"] {
        for p in ["softmax_scale", "lse_base"] {
            let want = format!("runner.{op}.{p}");
            assert!(notes.contains(&want), "no {want} in {notes:?}");
        }
    }
    for (bug, errors) in [
        (
            // Its NaN is one finding naming rows read outside the selection, not three.
            "minus_one_wraps.py",
            &["runner.sparse_prefill.non_finite"][..],
        ),
        (
            "fp8_scale_twice.py",
            &[
                "runner.sparse_decode.softmax_scale",
                "runner.sparse_decode.value",
            ],
        ),
    ] {
        let (code, j, err) = lint(
            &f,
            &["--runner", &runner(&py, &format!("bugs/sparse/{bug}"))],
        );
        consistent(code, &j);
        assert_eq!(code, Some(1), "{bug}: {err}");
        assert_eq!(checks(&j, "error"), errors, "{bug}: {j:#}");
    }
}
