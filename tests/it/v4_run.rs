//! `mla-diff run` on a DeepSeek-V4 file: the exit code, the JSON, JUnit and Markdown reports tell one
//! verdict, clean and with a planted V4 fault; what the V4 run does not take exits 2 in one line.

use crate::common::{
    assert_clean_error, fixtures_dir, report_validator, run, schema_errors, stderr,
};
use std::path::PathBuf;

fn golden() -> PathBuf {
    fixtures_dir().join("golden/deepseek-v4.gguf")
}

/// (exit code, JSON verdict.pass, JUnit failures, Markdown's verdict mark) of one run.
fn verdicts(extra: &[&str]) -> (Option<i32>, bool, usize, bool, serde_json::Value) {
    let d = tempfile::tempdir().unwrap();
    let (j, x, m) = (
        d.path().join("r.json"),
        d.path().join("r.xml"),
        d.path().join("r.md"),
    );
    let g = golden();
    let mut args = vec!["run", g.to_str().unwrap(), "--backend", "cpu", "-q"];
    args.extend_from_slice(extra);
    args.extend([
        "--json",
        j.to_str().unwrap(),
        "--junit",
        x.to_str().unwrap(),
    ]);
    args.extend(["--markdown", m.to_str().unwrap()]);
    let o = run(&args);
    assert!(o.status.code() != Some(2), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    let xml = std::fs::read_to_string(&x).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let failures = doc
        .descendants()
        .filter(|n| n.has_tag_name("failure"))
        .count();
    let md = std::fs::read_to_string(&m).unwrap();
    let md_pass = md.starts_with("### ✅");
    (
        o.status.code(),
        json["verdict"]["pass"].as_bool().unwrap(),
        failures,
        md_pass,
        json,
    )
}

/// Clean: exit 0 and every format passes; the JSON is of the report schema, holds every V4 stage of the layer kinds (the
/// window layer none of the compressed ones) and the coverage's V4 classes.
#[test]
fn a_clean_v4_run_passes_in_every_format() {
    let (code, pass, failures, md, j) = verdicts(&[]);
    assert_eq!((code, pass, failures, md), (Some(0), true, 0, true));
    let errs = schema_errors(&report_validator(), &j);
    assert!(errs.is_empty(), "{errs:#?}");
    assert_eq!(j["file"]["architecture"], "deepseek4");
    let checks = |l: usize| -> Vec<String> {
        j["modes"][0]["layers"][l]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["check"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(checks(0).len(), 8);
    assert_eq!(checks(1).len(), 11);
    assert!(checks(2).contains(&"compressed".to_string()) && checks(2).len() == 9);
    let classes = j["coverage"]["classes"].as_array().unwrap();
    assert!(classes
        .iter()
        .any(|c| c["class"] == "hca_carried" && c["phase"] == "decode"));
}

/// A planted V4 fault: exit 1, and JSON, JUnit and Markdown fail too, at the fault's stage.
#[test]
fn a_planted_v4_fault_fails_in_every_format() {
    let (code, pass, failures, md, j) = verdicts(&["--inject", "sink_dropped@layer=1"]);
    assert_eq!((code, pass, md), (Some(1), false, false));
    assert!(failures > 0);
    assert_eq!(j["verdict"]["first_layer"], 1);
    assert_eq!(j["verdict"]["first_check"], "attn_heads");
    assert_eq!(j["run"]["injected"][0]["name"], "sink_dropped");
}

/// What the V4 run does not take: one line, exit 2 (runners are not built for V4, `--kernels` is CUDA's);
/// an MLA fault on a V4 file, a V4 fault on an MLA file or in the self-test.
#[test]
fn what_a_v4_run_does_not_take_exits_2() {
    let g = golden();
    let g = g.to_str().unwrap();
    let mla = fixtures_dir().join("deepseek-v2-lite-bf16.gguf");
    for (args, says) in [
        (
            vec!["run", g, "--backend", "cpu", "--kernels", "kernels"],
            "--backend cpu runs the V4 mirror",
        ),
        // `auto` with a kernel directory means the CUDA kernels, as for MLA: no GPU here is its error.
        (
            vec!["run", g, "--kernels", "kernels"],
            "the CUDA backend needs an NVIDIA driver",
        ),
        (
            vec!["run", g, "--runner", "true"],
            "no runner op takes DeepSeek-V4",
        ),
        (vec!["run", g, "--inject", "rope_neox"], "an MLA fault"),
        (vec!["run", g, "--mode", "free"], "shadow mode only"),
        (
            vec![
                "run",
                mla.to_str().unwrap(),
                "--backend",
                "cpu",
                "--inject",
                "window_off_by_one",
            ],
            "a DeepSeek-V4 fault",
        ),
    ] {
        assert_clean_error(&run(&args), says);
    }
    // The self-test lists V4's faults (`--list`); it runs them too (tests/it/selftest.rs).
    let o = run(&["selftest", "--list"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("sink_dropped  (MLA_FAULT_SINK_DROPPED)"));
}
