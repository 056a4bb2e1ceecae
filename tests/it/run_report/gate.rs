//! The baseline gate and the tolerance options: a run against a committed baseline, identity checks, one grammar for --tol.

use super::*;

#[test]
fn baseline_gate() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.json").display().to_string();
    let fx = tiny4().display().to_string();
    let (code, _, err) = run_cli(&["run", &fx, "--backend", "cpu", "--write-baseline", &base]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = run_cli(&["run", &fx, "--backend", "cpu", "--baseline", &base]);
    assert_eq!(code, 0, "unchanged run passes the gate:\n{out}");
    assert!(out.contains("baseline OK"), "{out}");

    // Make one metric of the baseline 10x better: the same run is now a 10x regression there.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    let m = &mut v["modes"][0]["layers"][2]["checks"][1]["metrics"]["rel_l2"];
    *m = serde_json::json!(m.as_f64().unwrap() / 10.0);
    std::fs::write(&base, serde_json::to_string(&v).unwrap()).unwrap();
    let (code, out, _) = run_cli(&["run", &fx, "--backend", "cpu", "--baseline", &base]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("BASELINE REGRESSION") && out.contains("layer 2 q_nope"),
        "{out}"
    );
}

/// A baseline of another problem is refused (exit 2, one line naming each difference) unless asked for;
/// the same file elsewhere (another checkout) is the same problem.
#[test]
fn baseline_identity_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let fx = tiny4().display().to_string();
    let base = p("base.json");
    let common = ["run", &fx, "--backend", "cpu", "--layers", "0..2"];
    let (code, _, err) = run_cli(&[&common[..], &["--write-baseline", &base]].concat());
    assert_eq!(code, 0, "{err}");

    for (mut extra, needle) in [
        (vec!["--seed", "7"], "seed 7 vs baseline 0"),
        (vec!["--dtype", "fp16"], "dtype fp16 vs baseline bf16"),
        (vec!["--num-splits", "3"], "num_splits 3 vs baseline"),
        (vec!["--tol", "q_pe=rtol:0.5"], "tolerances of q_pe"),
        (vec!["--layers", "3"], "none in common"),
    ] {
        if extra[0] != "--layers" {
            extra.extend_from_slice(&["--layers", "0..2"]);
        }
        let mut args = ["run", fx.as_str(), "--backend", "cpu", "--baseline", &base].to_vec();
        args.extend_from_slice(&extra);
        let (code, out, err) = run_cli(&args);
        assert_eq!(code, 2, "{extra:?}: {out}\n{err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(out.is_empty(), "refused before the run: {out}");
    }
    let other = tiny_fixture_other_seed(dir.path());
    let (code, _, err) = run_cli(&[
        "run",
        &other,
        "--backend",
        "cpu",
        "--layers",
        "0..2",
        "--baseline",
        &base,
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("file "), "{err}");

    // Asked for: compared, and the report says across what.
    let json = p("r.json");
    let (code, _, err) = run_cli(
        &[
            &common[..],
            &[
                "--baseline",
                &base,
                "--seed",
                "7",
                "--allow-baseline-mismatch",
                "--json",
                &json,
            ],
        ]
        .concat(),
    );
    assert!(code == 0 || code == 1, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let across = v["baseline"]["across"].as_array().unwrap();
    assert!(across[0].as_str().unwrap().contains("seed"), "{across:?}");

    // The same file copied elsewhere (another checkout) matches.
    let moved = dir.path().join("elsewhere");
    std::fs::create_dir(&moved).unwrap();
    let copy = moved.join("tiny4.gguf");
    std::fs::copy(tiny4(), &copy).unwrap();
    let copy = copy.display().to_string();
    let (code, out, err) = run_cli(&[
        "run",
        &copy,
        "--backend",
        "cpu",
        "--layers",
        "0..2",
        "--baseline",
        &base,
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
}

/// A 4-layer tiny fixture with other weights, under the same base name.
fn tiny_fixture_other_seed(dir: &Path) -> String {
    let d = dir.join("other");
    std::fs::create_dir_all(&d).unwrap();
    common::make_fixture(
        &d,
        "tiny4.gguf",
        &[
            "--preset", "tiny", "--layers", "4", "--seed", "4", "--quant", "f32",
        ],
    )
    .display()
    .to_string()
}

/// `--tol` and `--tol-file` share one grammar: keys without a phase apply to both phases (they used to
/// be ignored in the file), short names work, partial entries keep the other fields, and bad entries
/// are one-line errors listing what is valid.
#[test]
fn tolerance_options_share_one_grammar() {
    let dir = tempfile::tempdir().unwrap();
    let fx = tiny4().display().to_string();
    let tol = dir.path().join("tol.json");
    let common = [
        "run",
        &fx,
        "--backend",
        "cpu",
        "--layers",
        "0",
        "--mode",
        "shadow",
    ];
    let run_file = |body: &str| {
        std::fs::write(&tol, body).unwrap();
        let t = tol.display().to_string();
        run_cli(&[&common[..], &["--tol-file", &t]].concat())
    };
    // A zero rel-L2 on attn_out (no phase, one field): both phases are held to it and fail.
    let (code, out, err) = run_file(r#"{"dtypes": {"bf16": {"attn_out": {"rel_l2": 0}}}}"#);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("attn_out[prefill]"), "{out}");
    // The same through --tol with the table's short name of one phase.
    let (code, out, err) = run_cli(&[&common[..], &["--tol", "out.d=rel_l2:0"]].concat());
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("attn_out[decode]"), "{out}");
    assert!(
        !out.contains("first at layer 0, stage attn_out[prefill]"),
        "{out}"
    );

    for (body, needle) in [
        (
            r#"{"dtypes": {"bf16": {"attn_out": {"rel_l2": -1}}}}"#,
            "finite and >= 0",
        ),
        (
            r#"{"dtypes": {"bf16": {"bogus": {"rel_l2": 1}}}}"#,
            "attn_out (out)",
        ),
        (
            r#"{"dtypes": {"bf16": {"attn_out": {"atol": 1}}}}"#,
            "rel_l2, atol_rms, rtol",
        ),
        (r#"{"dtypes": {"int8": {}}}"#, "bf16, fp16, f32"),
    ] {
        let (code, _, err) = run_file(body);
        assert_eq!(code, 2, "{body}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{body}: {err}");
        assert!(err.contains(needle), "{body}: {err}");
    }
    for spec in ["attn_out=rel_l2:-1", "nope=rtol:1", "q_pe[decode]=rtol:1"] {
        let (code, _, err) = run_cli(&[&common[..], &["--tol", spec]].concat());
        assert_eq!(code, 2, "{spec}: {err}");
        assert!(err.contains("valid"), "{spec}: {err}");
    }
}
