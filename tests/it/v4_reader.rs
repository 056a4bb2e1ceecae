//! DeepSeek-V4 (`deepseek4`) files: `inspect` and `lint` read them (every key llama.cpp's converter
//! writes, each attention tensor's shape), a corrupted key or tensor is a lint error naming it, and
//! every command not built for V4 exits 2 with one line saying so, never a panic or a pass.

use crate::common::{assert_clean_error, fixtures_dir, rewrite, run, stderr, Tensor};
use mla_diff::gguf::{Array, Value};
use serde_json::Value as J;
use std::path::{Path, PathBuf};

fn golden() -> PathBuf {
    fixtures_dir().join("golden/deepseek-v4.gguf")
}

fn lint_json(p: &Path, extra: &[&str]) -> (Option<i32>, J) {
    let mut a = vec!["lint", p.to_str().unwrap(), "--json", "-"];
    a.extend_from_slice(extra);
    let o = run(&a);
    let j = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
    (o.status.code(), j)
}

fn of<'a>(j: &'a J, severity: &str) -> Vec<&'a J> {
    j["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == severity)
        .collect()
}

#[test]
fn inspect_shows_every_v4_key() {
    let g = golden();
    let o = run(&["inspect", g.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = String::from_utf8(o.stdout).unwrap();
    for want in [
        "deepseek4 (DeepSeek-V4",
        "kinds 0:window 1:csa 2:hca",
        "head_dim 80 = nope 64 + rope 16",
        "q_lora        48",
        "2 groups x o_lora 40",
        "window        16 tokens",
        "rope main     θ=10000",
        "θ=160000, YaRN factor 16, original context 64, β 32/1",
        "3 heads x 32, top_k 8",
        "0.111803 = 1/sqrt(80)",
        "4 streams, sinkhorn 20",
        "hash layers 0",
    ] {
        assert!(t.contains(want), "{want:?} not in\n{t}");
    }
    let o = run(&["inspect", g.to_str().unwrap(), "--json"]);
    let j: J = serde_json::from_slice(&o.stdout).unwrap();
    let c = &j["deepseek_v4"];
    assert_eq!(c["kinds"], serde_json::json!(["window", "csa", "hca"]));
    assert_eq!(c["compress_rope_base"], 160000.0);
    assert_eq!(c["yarn"]["original_context"], 64);
    assert_eq!(c["indexer"]["top_k"], 8);
    assert_eq!(c["experts"]["gating_func"], 4);
    // Layer 1 (CSA) lists its compressor and indexer tensors, layer 0 (window) none.
    let names = |l: usize| -> Vec<String> {
        j["layers"][l]["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(0).len(), 12);
    assert_eq!(names(1).len(), 22);
    assert_eq!(names(2).len(), 16);
    assert!(names(1).contains(&"blk.1.indexer.proj.weight".to_string()));
}

#[test]
fn the_golden_lints_clean_with_notes() {
    let (code, j) = lint_json(&golden(), &[]);
    assert_eq!(code, Some(0), "{j:#}");
    assert!(
        of(&j, "error").is_empty() && of(&j, "warning").is_empty(),
        "{j:#}"
    );
    let notes: Vec<&str> = of(&j, "note")
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    assert_eq!(notes, ["layers", "softmax_scale", "head_dims", "catalogue"]);
}

fn set(m: &mut Vec<(String, Value)>, key: &str, v: Option<Value>) {
    let n = m.len();
    m.retain(|(k, _)| k != key);
    assert_eq!(m.len() + 1, n, "{key} was not in the file");
    if let Some(v) = v {
        m.push((key.to_string(), v));
    }
}

/// One corrupted key (or tensor) per file: exit 1, one error, on that key, expecting `expected`.
#[test]
fn each_bad_key_or_tensor_is_one_error_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let ratios = |v: Vec<u32>| Some(Value::Array(Array::U32(v)));
    let k = |s: &str| format!("deepseek4.{s}");
    let cases: Vec<(&str, Option<Value>, &str, &str)> = vec![
        (
            "attention.compress_ratios",
            None,
            "attention.compress_ratios",
            "an array",
        ),
        (
            "attention.compress_ratios",
            ratios(vec![0, 4]),
            "attention.compress_ratios",
            ">= 3",
        ),
        (
            "attention.compress_ratios",
            ratios(vec![0, 4, 64]),
            "attention.compress_ratios",
            "0, 4 or 128",
        ),
        (
            "attention.head_count_kv",
            Some(Value::U32(4)),
            "attention.head_count_kv",
            "1",
        ),
        (
            "attention.value_length",
            Some(Value::U32(64)),
            "attention.value_length",
            "key_length 80",
        ),
        (
            "rope.dimension_count",
            Some(Value::U32(15)),
            "rope.dimension_count",
            "even",
        ),
        (
            "attention.output_group_count",
            Some(Value::U32(3)),
            "attention.output_group_count",
            "divisor of head_count 4",
        ),
        (
            "attention.indexer.key_length",
            Some(Value::U32(8)),
            "attention.indexer.key_length",
            ">= rope.dimension_count 16",
        ),
        (
            "attention.compress_rope_freq_base",
            None,
            "attention.compress_rope_freq_base",
            "a number",
        ),
        (
            "attention.q_lora_rank",
            Some(Value::String("48".into())),
            "attention.q_lora_rank",
            "an unsigned integer",
        ),
        (
            "hyper_connection.count",
            None,
            "hyper_connection.count",
            "an unsigned integer",
        ),
        (
            "attention.layer_norm_rms_epsilon",
            Some(Value::F32(0.0)),
            "attention.layer_norm_rms_epsilon",
            "(0, 1e-2)",
        ),
    ];
    for (i, (key, v, check, expected)) in cases.into_iter().enumerate() {
        let p = rewrite(
            &golden(),
            &d.path().join(format!("k{i}.gguf")),
            |m| set(m, &k(key), v),
            |_| {},
        );
        let (code, j) = lint_json(&p, &[]);
        let errs = of(&j, "error");
        assert_eq!(code, Some(1), "{key}: {j:#}");
        assert_eq!(errs.len(), 1, "{key}: {j:#}");
        assert_eq!(errs[0]["check"], k(check), "{j:#}");
        assert!(
            errs[0]["expected"].as_str().unwrap().contains(expected),
            "{key}: {:#}",
            errs[0]
        );
        // The loader refuses the same file with one line (what every other command meets).
        assert_clean_error(&run(&["inspect", p.to_str().unwrap()]), &k(check));
    }
    let tensor_cases: Vec<(&str, &str, &str)> = vec![
        ("blk.1.indexer.proj.weight", "absent", "{96, 3}"),
        ("blk.2.attn_kv.weight", "{80, 96}", "{96, 80}"),
        ("blk.2.attn_compressor_ape.weight", "{80, 4}", "{80, 128}"),
    ];
    for (i, (name, found, expected)) in tensor_cases.into_iter().enumerate() {
        let edit = |ts: &mut Vec<Tensor>| {
            if found == "absent" {
                ts.retain(|t| t.name != name);
            } else {
                let t = ts.iter_mut().find(|t| t.name == name).unwrap();
                t.ne = found[1..found.len() - 1]
                    .split(", ")
                    .map(|x| x.parse().unwrap())
                    .collect();
                t.bytes.truncate(t.ne.iter().product::<u64>() as usize * 4);
            }
        };
        let p = rewrite(
            &golden(),
            &d.path().join(format!("t{i}.gguf")),
            |_| {},
            edit,
        );
        let (code, j) = lint_json(&p, &[]);
        let errs = of(&j, "error");
        assert_eq!((code, errs.len()), (Some(1), 1), "{name}: {j:#}");
        assert_eq!(errs[0]["check"], name);
        assert_eq!(errs[0]["found"], found);
        assert_eq!(errs[0]["expected"], expected);
    }
}

/// Every command that is not built for V4 says so in one line, exit 2 (`run` is: `v4_run`).
#[test]
fn commands_not_built_for_v4_exit_2_in_one_line() {
    let g = golden();
    let g = g.to_str().unwrap();
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x");
    let out = out.to_str().unwrap();
    for args in [
        vec!["inspect", g, "--load-layer", "0"],
        vec!["export", g, "--layers", "0", "-o", out],
        vec!["sweep", g],
        vec!["flashinfer", d.path().to_str().unwrap(), "--model", g],
    ] {
        assert_clean_error(&run(&args), "not built for V4 yet");
    }
    for extra in [["--backend", "cuda"], ["--runner", "true"]] {
        let o = run(&["lint", g, extra[0], extra[1]]);
        assert_clean_error(&o, "no optimized path is built for DeepSeek-V4");
    }
}

/// `fixture --preset deepseek-v4` writes DeepSeek-V4-Flash's attention dims (here at hidden 256, 8
/// heads): the file lints clean, `inspect` reads its real head dims, and the reference runs each layer
/// kind from it to finite outputs.
#[test]
fn the_v4_fixture_lints_clean_and_runs_through_the_reference() {
    use mla_diff::gguf::GgufFile;
    use mla_diff::model::v4::{LayerKind, V4Config, V4Weights};
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("v4.gguf");
    let ps = p.to_str().unwrap();
    let args = ["fixture", "--preset", "deepseek-v4", "--layers", "3"];
    let o = run(&[&args[..], &["--hidden", "256", "--heads", "8", "-o", ps]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (code, j) = lint_json(&p, &[]);
    assert_eq!(code, Some(0), "{j:#}");
    assert!(
        of(&j, "error").is_empty() && of(&j, "warning").is_empty(),
        "{j:#}"
    );
    let f = GgufFile::open(&p).unwrap();
    let c = V4Config::from_gguf(&f).unwrap();
    assert_eq!((c.head_dim, c.rope_dim, c.q_lora_rank), (512, 64, 1024));
    assert_eq!(
        (c.o_groups, c.o_lora_rank, c.sliding_window),
        (8, 1024, 128)
    );
    assert_eq!(c.kinds, [LayerKind::Window, LayerKind::Csa, LayerKind::Hca]);
    let x = ndarray::Array2::from_shape_fn((9, 256), |(t, e)| {
        ((t * 31 + e * 7) % 13) as f64 / 6.0 - 1.0
    });
    for l in 0..3 {
        let w = V4Weights::load(&f, &c, l).unwrap();
        let out = mla_diff::reference::v4::run_layer(&c, &w, l, x.view());
        assert!(out.attn_out.iter().all(|v| v.is_finite()), "layer {l}");
        assert_eq!(out.attn_out.dim(), (9, 256));
    }
    // MLA-only options are refused in one line.
    assert_clean_error(
        &run(&[&args[..], &["--legacy-kv-b", "-o", ps]].concat()),
        "MLA options",
    );
}
