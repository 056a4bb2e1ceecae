//! Report formats: JSON, Markdown, JUnit and HTML validate, parse, agree on the verdict and are deterministic; output options.

use super::*;

#[test]
fn reports_validate_and_parse() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let fx = tiny4().display().to_string();
    let (code, stdout, stderr) = run_cli(&[
        "run",
        &fx,
        "--backend",
        "cpu",
        "--json",
        &p("r.json"),
        "--junit",
        &p("r.xml"),
        "--markdown",
        &p("r.md"),
        "--plot",
        &p("r.svg"),
        "--dump-dir",
        &p("dump"),
        "--dump-layers",
        "2",
    ]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("PASS"), "{stdout}");
    assert!(!stdout.contains('\x1b'), "no colour when not a terminal");

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p("r.json")).unwrap()).unwrap();
    let validator = common::report_validator();
    let errors = common::schema_errors(&validator, &report);
    assert!(errors.is_empty(), "schema errors: {errors:#?}");
    // The schema is not vacuous: a report without its verdict is rejected.
    let mut broken = report.clone();
    broken.as_object_mut().unwrap().remove("verdict");
    assert!(!validator.is_valid(&broken));

    let junit = std::fs::read_to_string(p("r.xml")).unwrap();
    let doc = roxmltree::Document::parse(&junit).unwrap();
    assert_eq!(
        doc.descendants()
            .filter(|n| n.has_tag_name("testcase"))
            .count(),
        8 + 2 * 4 * 4,
        "4 layers x 2 modes, and the 4 checks of each layer's serving batch and of its batch aimed at attn_small"
    );
    let svg = std::fs::read_to_string(p("r.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    assert!(doc.descendants().filter(|n| n.has_tag_name("rect")).count() >= 4 * 10);
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect();
    // The title names the file by its base name; no absolute path anywhere.
    assert!(
        texts
            .iter()
            .any(|t| t.starts_with("tiny4.gguf: shadow mode")),
        "{texts:?}"
    );
    let fixture_dir = tiny4().parent().unwrap().display().to_string();
    assert!(texts.iter().all(|t| !t.contains(&fixture_dir)), "{texts:?}");
    // Full stage labels, axis titles, and a colour bar with the tolerance marked.
    for label in [
        "attn_heads[prefill]",
        "attn_out[decode]",
        "layer",
        "1 = tolerance",
        "NaN / Inf",
    ] {
        assert!(texts.iter().any(|t| t == label), "{label}: {texts:?}");
    }
    assert!(texts.iter().any(|t| t.starts_with("stage")), "{texts:?}");
    assert!(std::fs::read_to_string(p("r.md"))
        .unwrap()
        .contains("| layer |"));
    // The dump is numpy's format: magic, version, then a header naming float64.
    let npy = std::fs::read(dir.path().join("dump/layer2/attn_out.opt.npy")).unwrap();
    assert_eq!(&npy[..6], b"\x93NUMPY");
    assert!(String::from_utf8_lossy(&npy[..128]).contains("'descr': '<f8'"));
    assert!(dir.path().join("dump/layer2/attn_out.ref.npy").exists());
}

#[test]
fn json_is_byte_identical_across_runs() {
    let fx = tiny4().display().to_string();
    let (c1, a, _) = run_cli(&[
        "run",
        &fx,
        "--backend",
        "cpu",
        "--layers",
        "0..2",
        "--json",
        "-",
    ]);
    let (c2, b, _) = run_cli(&[
        "run",
        &fx,
        "--backend",
        "cpu",
        "--layers",
        "0..2",
        "--json",
        "-",
    ]);
    assert_eq!((c1, c2), (0, 0));
    assert!(a.len() > 1000);
    assert_eq!(a, b);
}

/// Failure count of a JUnit document.
fn junit_failures(xml: &str) -> usize {
    let doc = roxmltree::Document::parse(xml).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("failure"))
        .count()
}

/// Exit code, JSON `verdict.pass`, JUnit and Markdown say the same for a pass, a divergence and a
/// baseline regression (which used to exit 1 with `verdict.pass` true and a green JUnit).
#[test]
fn verdicts_agree_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let fx = tiny4().display().to_string();
    let base = p("base.json");
    let common = ["run", &fx, "--backend", "cpu", "--layers", "0..2"];
    let (code, _, err) = run_cli(&[&common[..], &["--write-baseline", &base]].concat());
    assert_eq!(code, 0, "{err}");
    // A baseline 10x better at one metric: the same run is a regression there.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    let m = &mut v["modes"][0]["layers"][1]["checks"][1]["metrics"]["rel_l2"];
    *m = serde_json::json!(m.as_f64().unwrap() / 10.0);
    let better = p("better.json");
    std::fs::write(&better, serde_json::to_string(&v).unwrap()).unwrap();

    for (case, extra, want) in [
        ("pass", vec!["--baseline", base.as_str()], 0),
        ("divergence", vec!["--inject", "rope_neox@layer=1"], 1),
        (
            "baseline regression",
            vec!["--baseline", better.as_str()],
            1,
        ),
    ] {
        let outs = ["--json", &p("r.json"), "--junit", &p("r.xml")];
        let md = ["--markdown", &p("r.md")];
        let args = [&common[..], &extra[..], &outs[..], &md[..]].concat();
        let (code, out, err) = run_cli(&args);
        assert_eq!(code, want, "{case}: {out}\n{err}");
        let pass = want == 0;
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p("r.json")).unwrap()).unwrap();
        assert_eq!(json["verdict"]["pass"], pass, "{case}: {}", json["verdict"]);
        let errors = common::schema_errors(&common::report_validator(), &json);
        assert!(errors.is_empty(), "{case}: {errors:#?}");
        let junit = std::fs::read_to_string(p("r.xml")).unwrap();
        assert_eq!(junit_failures(&junit) == 0, pass, "{case}: {junit}");
        let md = std::fs::read_to_string(p("r.md")).unwrap();
        let head = md.lines().next().unwrap();
        assert!(
            head.contains(if pass { "✅" } else { "❌" }),
            "{case}: {md}"
        );
        if case == "baseline regression" {
            let msg = json["verdict"]["message"].as_str().unwrap();
            assert!(msg.contains("BASELINE REGRESSION"), "{msg}");
            assert!(junit.contains("baseline gate"), "{junit}");
            assert!(md.contains("BASELINE REGRESSION"), "{md}");
        }
    }
}

/// Output paths are checked before the run; `-` is stdout for every format (one at most); colour and
/// `-q` behave; failing cells are marked without colour; dump directories are printed.
#[test]
fn output_options() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let fx = tiny4().display().to_string();
    let common = ["run", &fx, "--backend", "cpu", "--layers", "0..2"];
    for bad in [
        vec!["--junit", "/nonexistent-dir/x.xml"],
        vec!["--json", "/"],
        vec!["--markdown", "-", "--json", "-"],
        vec!["--json", "a.json", "--junit", "a.json"],
        vec!["--dump-dir", "/proc/version/x"],
    ] {
        let started = std::time::Instant::now();
        let (code, out, err) = run_cli(&[&common[..], &bad[..]].concat());
        assert_eq!(code, 2, "{bad:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{bad:?}: {err}");
        assert!(out.is_empty(), "{bad:?}: nothing ran: {out}");
        assert!(started.elapsed().as_secs() < 5, "{bad:?} failed late");
    }
    // `-` for Markdown and SVG: stdout, no file named `-`; the table goes to stderr.
    for (flag, marker) in [
        ("--markdown", "### "),
        ("--plot", "<svg"),
        ("--junit", "<testsuites"),
    ] {
        let out = Command::new(BIN)
            .args([&common[..], &[flag, "-"]].concat())
            .current_dir(dir.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{flag}: {stderr}");
        assert!(
            stdout.starts_with(marker) || stdout.contains(marker),
            "{flag}: {stdout}"
        );
        assert!(
            stderr.contains("[shadow mode]"),
            "{flag}: table on stderr: {stderr}"
        );
        assert!(
            !dir.path().join("-").exists(),
            "{flag} wrote a file named -"
        );
    }
    // Colour on demand; failing cells carry `!` without colour.
    let fail = ["--inject", "rope_neox@layer=1", "--mode", "shadow"];
    let (code, out, _) = run_cli(&[&common[..], &fail[..], &["--color", "never"]].concat());
    assert_eq!(code, 1);
    assert!(!out.contains('\x1b'), "{out}");
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("1 FAIL"))
        .unwrap();
    assert!(row.contains('!'), "{row}");
    let ok_row = out
        .lines()
        .find(|l| l.trim_start().starts_with("0 PASS"))
        .unwrap();
    assert!(!ok_row.contains('!'), "{ok_row}");
    let (_, out, _) = run_cli(&[&common[..], &fail[..], &["--color", "always"]].concat());
    assert!(out.contains("\x1b[31;1m"), "{out}");
    // -q: the verdict line only.
    let (code, out, err) = run_cli(&[&common[..], &fail[..], &["-q"]].concat());
    assert_eq!(code, 1);
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.contains("DIVERGENCE"), "{out}");
    assert!(err.is_empty(), "{err}");
    // Where dumps went.
    let dump = p("dump");
    let (_, _, err) = run_cli(&[&common[..], &fail[..], &["--dump-dir", &dump]].concat());
    assert!(
        err.contains(&format!(
            "dumped {}",
            dir.path().join("dump/layer1").display()
        )),
        "{err}"
    );
}
