//! Runner runs reach the cases where MLA kernels break (issue #32, items 5–10): the default runner
//! schedule is the covering one (a rescale bug past one key tile passes the classic schedule and fails
//! it), within what `supports` allows (and says what that misses); the serving batch, padded entries,
//! batch invariance and input mutation are checked (`runner_checks`); a declared tile geometry drives
//! coverage, and an own split partition is checked by merge consistency.
//!
//! Needs MLA_DIFF_PYTHON with numpy and safetensors, as tests/it/runners.rs.

use crate::common::{bin, fixture, python, report_validator, runner, schema_errors, stderr};
use serde_json::Value as J;

/// `run FILE --backend cpu --mode shadow --runner CMD --json - -q EXTRA…` with `env`: exit code, report.
fn go(file: &str, cmd: &str, extra: &[&str], env: &[(&str, &str)]) -> (Option<i32>, J, String) {
    let f = fixture(file);
    let mut c = bin();
    c.args([
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--runner",
        cmd,
        "--json",
        "-",
        "-q",
    ])
    .args(extra);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().expect("run mla-diff");
    let j = serde_json::from_slice(&o.stdout).unwrap_or(J::Null);
    (o.status.code(), j, stderr(&o))
}

const CLASSIC: [&str; 8] = [
    "--prompt-len",
    "48",
    "--chunk",
    "32",
    "--decode-steps",
    "16",
    "--num-splits",
    "4",
];

fn runner_checks(rep: &J) -> Vec<&J> {
    rep["runner_checks"]["checks"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default()
}

fn with_status<'a>(rep: &'a J, check: &str, status: &str) -> Vec<&'a J> {
    runner_checks(rep)
        .into_iter()
        .filter(|c| c["check"] == check && c["status"] == status)
        .collect()
}

/// Item 5: vLLM's Triton decode bug (an online-softmax rescale in base 2) planted in the numpy runner:
/// invisible while no split holds a second 64-key tile (the classic schedule), caught by the default.
#[test]
fn a_rescale_bug_past_one_tile_fails_the_default_runner_schedule_only() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = runner(&py, "bugs/serving/tile_rescale_base2.py");
    for file in [
        "deepseek-v3-yarn-q4_k.gguf",
        "deepseek-v3-legacy-kv-b-q8_0.gguf",
    ] {
        let (code, _, err) = go(file, &cmd, &CLASSIC, &[]);
        assert_eq!(code, Some(0), "{file}: the classic schedule: {err}");
        let (code, rep, err) = go(file, &cmd, &[], &[]);
        assert_eq!(code, Some(1), "{file}: the default schedule: {err}");
        let first = rep["verdict"]["first_check"].as_str().unwrap_or("");
        assert!(
            [
                "split_out",
                "split_out@runner",
                "attn_latent",
                "attn_latent@runner"
            ]
            .contains(&first),
            "{file}: first failure {first}"
        );
        // The default runner schedule: MTP steps, 2 splits, chunked prefill with context.
        let s = &rep["run"]["schedule"];
        assert!(s["q_len"].as_u64().unwrap() > 1, "{s}");
        assert!(s["prompt_len"].as_u64().unwrap() > s["chunk"].as_u64().unwrap());
        assert_eq!(s["num_splits"], 2);
        // Its serving batch (splits of many tiles) fails it too.
        assert!(
            !with_status(&rep, "serving_batch", "fail").is_empty(),
            "{}",
            rep["runner_checks"]
        );
    }
}

/// Item 5 within `supports`: a runner of one query per step and page 64 gets a schedule it takes, the
/// serving batch still reaches an empty split, and the coverage section says no MTP step ran.
#[test]
fn a_limited_runner_gets_a_schedule_it_supports_and_coverage_says_what_it_misses() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let s = crate::common::numpy_variant(
        dir.path(),
        "limited.py",
        "d['supports']['max_q_len'] = 1; d['supports']['page_sizes'] = [64]",
    );
    let cmd = format!("{py} {}", s.display());
    let (code, rep, err) = go("deepseek-v3-yarn-q4_k.gguf", &cmd, &[], &[]);
    assert_eq!(code, Some(0), "{err}");
    let sc = &rep["run"]["schedule"];
    assert_eq!(
        (sc["q_len"].as_u64(), sc["page_size"].as_u64()),
        (Some(1), Some(64)),
        "{sc}"
    );
    let cov = &rep["coverage"];
    assert!(
        cov["warnings"].to_string().contains("max_q_len"),
        "{}",
        cov["warnings"]
    );
    let empty = cov["classes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["phase"] == "decode" && c["class"] == "empty_split")
        .unwrap();
    assert!(empty["count"].as_u64().unwrap() > 0, "{empty}");
}

/// Item 7: padded entries (zero length, NaN query) must leave the real rows bit-identical; a max shared
/// over the batch leaks the NaN into every row. Every report format says so.
#[test]
fn padded_entries_must_not_change_real_rows() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let file = "deepseek-v3-legacy-kv-b-q8_0.gguf";
    let (code, rep, err) = go(file, &runner(&py, "numpy_mla.py"), &[], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        with_status(&rep, "padding", "pass").len(),
        1,
        "{}",
        rep["runner_checks"]
    );
    assert_eq!(rep["runner_checks"]["pass"], true);

    let leak = runner(&py, "bugs/serving/padding_leak.py");
    let (code, rep, err) = go(file, &leak, &[], &[]);
    assert_eq!(code, Some(1), "{err}");
    let fails = with_status(&rep, "padding", "fail");
    assert_eq!(fails.len(), 1, "{}", rep["runner_checks"]);
    let errs = schema_errors(&report_validator(), &rep);
    assert!(errs.is_empty(), "{errs:?}");
    assert_eq!(fails[0]["what"], "attn_latent");
    assert_eq!(rep["verdict"]["pass"], false);
    assert!(rep["verdict"]["message"]
        .as_str()
        .unwrap()
        .contains("RUNNER CHECK FAILED"));
    // The stage checks of the schedule's own batch pass: only the padding shows it.
    assert_eq!(rep["modes"][0]["verdict"]["pass"], true);
    // JUnit and Markdown agree.
    let dir = tempfile::tempdir().unwrap();
    let (junit, md) = (dir.path().join("j.xml"), dir.path().join("r.md"));
    let (code, _, _) = go(
        file,
        &leak,
        &[
            "--junit",
            junit.to_str().unwrap(),
            "--markdown",
            md.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, Some(1));
    let j = std::fs::read_to_string(&junit).unwrap();
    assert!(
        j.contains("runner checks") && j.contains("layer 0 padding attn_latent: fail"),
        "{j}"
    );
    let m = std::fs::read_to_string(&md).unwrap();
    assert!(m.contains("| 0 | padding | attn_latent | fail |"), "{m}");
}

/// Item 8: a request alone vs inside the batch is reported; a verdict only when declared.
#[test]
fn batch_invariance_is_a_verdict_only_where_the_runner_declares_it() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let file = "deepseek-v3-legacy-kv-b-q8_0.gguf";
    let leak = runner(&py, "bugs/serving/padding_leak.py");
    let (_, rep, err) = go(file, &leak, &[], &[]);
    let reported = with_status(&rep, "batch_invariance", "report");
    assert_eq!(reported.len(), 2, "{err} {}", rep["runner_checks"]);
    assert!(with_status(&rep, "batch_invariance", "fail").is_empty());
    let (code, rep, _) = go(
        file,
        &leak,
        &[],
        &[("MLA_DIFF_TEST_DECLARE_INVARIANT", "1")],
    );
    assert_eq!(code, Some(1));
    assert!(
        !with_status(&rep, "batch_invariance", "fail").is_empty(),
        "{}",
        rep["runner_checks"]
    );
    // numpy_mla declares it and holds it.
    let (code, rep, err) = go(file, &runner(&py, "numpy_mla.py"), &[], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(with_status(&rep, "batch_invariance", "pass").len(), 2);
}

/// Item 9: a kernel that writes into its inputs fails the run, naming the tensor.
#[test]
fn a_runner_writing_into_its_inputs_fails_naming_the_tensor() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    for dtype in ["bf16", "f32"] {
        let (code, rep, err) = go(
            "deepseek-v3-legacy-kv-b-q8_0.gguf",
            &runner(&py, "bugs/serving/writes_q.py"),
            &["--dtype", dtype],
            &[],
        );
        assert_eq!(code, Some(1), "{dtype}: {err}");
        let bad: Vec<&str> = with_status(&rep, "input_mutation", "fail")
            .iter()
            .map(|c| c["what"].as_str().unwrap())
            .collect();
        assert!(
            bad.contains(&"q_nope") && bad.contains(&"q_pe"),
            "{dtype}: {bad:?}"
        );
        assert!(!bad.contains(&"kv_cache"), "{bad:?}");
        // Every output is right: the stage checks pass.
        assert_eq!(rep["modes"][0]["verdict"]["pass"], true, "{dtype}");
    }
}

/// Item 10: a declared geometry is counted by coverage; an own split partition is checked by merge
/// consistency, and a partial LSE in the wrong base fails it.
#[test]
fn a_declared_geometry_drives_coverage_and_own_splits_are_checked_by_merge() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let file = "deepseek-v3-legacy-kv-b-q8_0.gguf";
    let cmd = runner(&py, "numpy_own_splits.py");
    let (code, rep, err) = go(file, &cmd, &[], &[]);
    assert_eq!(code, Some(0), "{err}");
    let dec = rep["coverage"]["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["phase"] == "decode")
        .unwrap();
    assert_eq!(dec["geometry"]["keys_per_tile"], 64, "{dec}");
    for c in rep["coverage"]["classes"].as_array().unwrap() {
        if c["phase"] == "decode" {
            assert!(c["count"].as_u64().is_some_and(|n| n > 0), "{c}");
        }
    }
    // The schedule's steps and the serving batch, and (issue #35) the batches aimed at variants.
    let merges = with_status(&rep, "merge_consistency", "pass");
    let aimed = |c: &&J| c["detail"].as_str().unwrap_or("").contains("aimed at");
    assert_eq!(merges.iter().filter(|c| !aimed(c)).count(), 4, "{merges:?}");
    assert!(merges.iter().any(aimed), "{merges:?}");
    let names: Vec<String> = rep["modes"][0]["layers"][0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["check"].as_str().unwrap().to_string())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with("split_")), "{names:?}");
    let (code, rep, _) = go(file, &cmd, &[], &[("MLA_DIFF_TEST_BUG", "lse_base2")]);
    assert_eq!(code, Some(1));
    let f = with_status(&rep, "merge_consistency", "fail");
    assert!(!f.is_empty(), "{}", rep["runner_checks"]);
    let errs = schema_errors(&report_validator(), &rep);
    assert!(errs.is_empty(), "{errs:?}");
}

/// The short runner schedule of tests/it/runners.rs (`SHORT`).
const SHORT: [&str; 6] = [
    "--prompt-len",
    "40",
    "--decode-steps",
    "2",
    "--num-splits",
    "2",
];

/// Issue #35 item 2: a runner run gets the batches aimed at the production variants its own launches
/// miss. A kernel reading pages of more than 32 rows through a 32-key box at the page's first row
/// passes every stage check and the serving batch at the run's page 16, and fails only the batch
/// aimed at `attn_small`'s multi-tile pages (page 64), which the coverage section lists as reached by
/// an aimed batch.
#[test]
fn a_multi_tile_page_bug_fails_only_the_batch_aimed_at_it() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let cmd = runner(&py, "bugs/serving/page_tile32.py");
    let (code, rep, err) = go("deepseek-v3-yarn-q4_k.gguf", &cmd, &SHORT, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(rep["modes"][0]["verdict"]["pass"], true, "{err}");
    assert!(with_status(&rep, "serving_batch", "fail").is_empty());
    let fails = with_status(&rep, "variant_batch", "fail");
    assert!(!fails.is_empty(), "{}", rep["runner_checks"]);
    let id = "decode/attn_small/tma-ring-multi-tile-page";
    assert!(
        fails[0]["detail"].as_str().unwrap().contains(id),
        "{}",
        fails[0]
    );
    let v = rep["coverage"]["variants"]["list"].as_array().unwrap();
    let aimed = v.iter().find(|x| x["id"] == id).expect(id);
    assert_eq!(
        (aimed["reached"].as_bool(), aimed["aimed"].as_bool()),
        (Some(true), Some(true))
    );
    let errs = schema_errors(&report_validator(), &rep);
    assert!(errs.is_empty(), "{errs:?}");
}

/// An aim outside the runner's `supports` is not run: the coverage section says which and why, and
/// lists its variant as not reached.
#[test]
fn an_aim_outside_the_runners_supports_is_skipped_and_said() {
    let Some(py) = python("runners", "numpy and safetensors") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runners");
    let s = dir.path().join("page16.py");
    std::fs::write(
        &s,
        format!(
            "import sys\nsys.path.insert(0, {:?})\nimport numpy_mla, protocol\nclass L(numpy_mla.NumpyMLA):\n    def describe(self):\n        d = super().describe()\n        d['supports']['page_sizes'] = [16]\n        return d\nprotocol.main(L)\n",
            here.display().to_string()
        ),
    )
    .unwrap();
    let cmd = format!("{py} {}", s.display());
    let (code, rep, err) = go("deepseek-v3-yarn-q4_k.gguf", &cmd, &SHORT, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(with_status(&rep, "variant_batch", "pass").is_empty());
    let w = rep["coverage"]["warnings"].to_string();
    assert!(
        w.contains("the batch aimed at decode/attn_small/tma-ring-multi-tile-page was not run: page 64 not in supports.page_sizes"),
        "{w}"
    );
    let v = rep["coverage"]["variants"]["list"].as_array().unwrap();
    assert!(v.iter().any(|x| x["reached"] == false), "{v:?}");
}
