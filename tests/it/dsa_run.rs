//! `mla-diff run` on a DSA file past top_k (issue #17): the glm-5-dsa golden (top_k 8) on the default
//! schedule runs the sparse model — the modes attend over the reference's selection, the `dsa` section
//! checks each side's own — and every report format says so; planted indexer bugs fail the selection
//! check in their layer with the stage checks clean, a kernel bug does the reverse.

use crate::common::{self, fixture, run, stderr};
use std::process::Output;

fn golden() -> String {
    fixture("golden/glm-5-dsa.gguf").display().to_string()
}

fn run_json(extra: &[&str]) -> (Output, serde_json::Value) {
    common::cpu_run_json(&fixture("golden/glm-5-dsa.gguf"), extra)
}

#[test]
fn sparse_run_passes_and_every_format_says_so() {
    let d = tempfile::tempdir().unwrap();
    let (j, m, x) = (
        d.path().join("r.json"),
        d.path().join("r.md"),
        d.path().join("r.xml"),
    );
    let g = golden();
    let o = run(&[
        "run",
        &g,
        "--backend",
        "cpu",
        "--json",
        j.to_str().unwrap(),
        "--markdown",
        m.to_str().unwrap(),
        "--junit",
        x.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("[DSA selections"), "{table}");
    assert!(table.contains("layer 1 PASS: selection PASS"), "{table}");
    assert!(table.contains("dsa: sparse,"), "{table}");
    assert!(!table.contains("NOTICE"), "{table}");

    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    let errs = common::schema_errors(&common::report_validator(), &r);
    assert!(errs.is_empty(), "{errs:?}");
    assert!(r["run"].get("notices").is_none());
    let dsa = &r["dsa"];
    assert_eq!(dsa["pass"], true);
    assert_eq!(dsa["top_k"], 8);
    assert_eq!(dsa["layers"].as_array().unwrap().len(), 2);
    // The stage-local view decides every attention stage of the sparse layers too (over the selection).
    for l in r["modes"][0]["layers"].as_array().unwrap() {
        for c in l["checks"].as_array().unwrap() {
            assert_eq!(c["local"]["pass"], true, "{c}");
        }
    }
    let cov = &r["coverage"]["dsa"];
    assert!(cov["sparse_queries"].as_u64().unwrap() > 0, "{cov}");
    assert!(cov["indexer"].as_str().unwrap().contains("bf16"), "{cov}");
    for l in dsa["layers"].as_array().unwrap() {
        let s = &l["selection"];
        assert_eq!(s["pass"], true, "{l}");
        assert!(s["sparse_queries"].as_u64().unwrap() > 0, "{l}");
        // The own-selection path is a kernel check: within the attn_out tolerance, so well below 1.
        assert!(l["own_path_error"].as_f64().unwrap() < 0.05, "{l}");
        assert!(l["own_path_first_failing"].is_null(), "{l}");
    }
    let md = std::fs::read_to_string(&m).unwrap();
    assert!(md.contains("#### DSA selections"), "{md}");
    assert!(md.contains("- dsa: sparse,"), "{md}");
    let xml = std::fs::read_to_string(&x).unwrap();
    assert!(xml.contains("dsa top_k 8"), "{xml}");
    assert!(xml.contains(r#"name="layer 0 selection""#), "{xml}");
    assert!(xml.contains(r#"name="mla-diff.coverage.dsa""#), "{xml}");
    assert!(!xml.contains("<failure"), "{xml}");
}

/// The sparse run really is sparse: the same file and schedule through dense attention (the reference
/// with every key) is far from what the run's reference computed; a run within top_k has no `dsa`
/// section and says the indexer did not run.
#[test]
fn within_top_k_stays_dense() {
    let (o, r) = run_json(&[
        "--prompt-len",
        "6",
        "--decode-steps",
        "2",
        "--mode",
        "shadow",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(r.get("dsa").is_none(), "{r}");
    let cov = &r["coverage"]["dsa"];
    assert_eq!(cov["sparse_queries"], 0, "{cov}");
    assert!(cov["indexer"].is_null(), "{cov}");
}

#[test]
fn dense_files_have_no_dsa_fields() {
    let f = fixture("deepseek-v3-yarn-q4_k.gguf");
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--prompt-len",
        "8",
        "--decode-steps",
        "2",
        "--json",
        "-",
    ]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(r.get("dsa").is_none());
    assert!(r["coverage"].get("dsa").is_none());
}

/// Each indexer fault is caught by the selection check in the layer it was planted in, with every stage
/// check (over the reference's selection) clean; exit code, JSON and verdict agree.
#[test]
fn indexer_faults_are_attributed_to_the_selection() {
    for fault in [
        "indexer_rope_swap",
        "indexer_non_causal",
        "indexer_no_relu",
        "indexer_topk_off_by_one",
    ] {
        let inj = format!("{fault}@layer=1");
        // The classic schedule (48 prompt tokens, 16 decode steps): 56 queries past top_k 8.
        let (o, r) = run_json(&["--inject", &inj, "--mode", "shadow", "--prompt-len", "48"]);
        assert_eq!(o.status.code(), Some(1), "{fault}: {}", stderr(&o));
        assert_eq!(r["verdict"]["pass"], false, "{fault}");
        assert_eq!(r["modes"][0]["verdict"]["pass"], true, "{fault}: {r}");
        let dsa = &r["dsa"];
        assert_eq!(dsa["first_layer"], 1, "{fault}: {dsa}");
        assert_eq!(dsa["layers"][0]["pass"], true, "{fault}");
        assert_eq!(dsa["layers"][1]["selection"]["pass"], false, "{fault}");
        // The optimized path over its own (wrong) selection is still the model over that selection.
        assert!(
            dsa["layers"][1]["own_path_first_failing"].is_null(),
            "{fault}"
        );
        let msg = r["verdict"]["message"].as_str().unwrap();
        assert!(msg.contains("DSA layer 1"), "{fault}: {msg}");
    }
}

/// A kernel bug fails the stage checks (over the reference's selection), not the selection check.
#[test]
fn kernel_fault_is_not_a_selection_difference() {
    let (o, r) = run_json(&["--inject", "scale_576@layer=0", "--mode", "shadow"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = &r["modes"][0]["verdict"];
    assert_eq!(v["first_layer"], 0, "{v}");
    for l in r["dsa"]["layers"].as_array().unwrap() {
        assert_eq!(l["selection"]["pass"], true, "{l}");
    }
}

/// Sparse attention reading its keys at their positions (the block table skipped) fails the first
/// attention check of its layer, over the reference's selection, and the selection check stays clean;
/// the same run within top_k (dense: no index rows) does not plant it.
#[test]
fn sparse_index_page_base_is_caught_at_the_first_attention_stage() {
    let (o, r) = run_json(&[
        "--inject",
        "sparse_index_page_base@layer=1",
        "--mode",
        "shadow",
        "--prompt-len",
        "48",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = &r["modes"][0]["verdict"];
    assert_eq!(v["first_layer"], 1, "{v}");
    assert_eq!(v["first_check"], "lse[prefill]", "{v}");
    // Decided by the stage-local view (over the selection the path was given).
    assert!(
        v["reasons"][0].as_str().unwrap().starts_with("local: "),
        "{v}"
    );
    for l in r["dsa"]["layers"].as_array().unwrap() {
        assert_eq!(l["selection"]["pass"], true, "{l}");
    }
    // Within top_k 8 the run is dense: no stage reads through index rows, but the batch aimed at the
    // sparse kernel does (issue #35), and fails at layer 1 only.
    let (o, r) = run_json(&[
        "--inject",
        "sparse_index_page_base@layer=1",
        "--prompt-len",
        "6",
        "--decode-steps",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(r.get("dsa").is_none(), "{r}");
    assert!(
        r["modes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["verdict"]["pass"] == true),
        "{r}"
    );
    let failed: Vec<&serde_json::Value> = r["runner_checks"]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .collect();
    assert!(!failed.is_empty());
    assert!(failed.iter().all(|c| c["check"] == "variant_batch"
        && c["layer"] == 1
        && c["detail"]
            .as_str()
            .unwrap()
            .contains("sparse_attn/past-top-k")));
}
