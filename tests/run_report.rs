//! `mla-diff run`: verdicts, localisation, report formats and the baseline gate.

mod common;

use mla_diff::backend::cpu::CpuMirror;
use mla_diff::backend::{Backend, BackendInfo, Dtype, Kind, LayerCtx};
use mla_diff::compare::ToleranceTable;
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::run::{InputSpec, Modes, RunOptions};
use mla_diff::schedule::Schedule;
use mla_diff::trace::{LayerTrace, Stage, StageSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_mla-diff");

/// A 4-layer tiny model, made once per test binary.
fn tiny4() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("mla-diff-run-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        common::make_fixture(
            &dir,
            "tiny4.gguf",
            &["--preset", "tiny", "--layers", "4", "--seed", "3"],
        )
    })
    .clone()
}

fn opts(dtype: Dtype) -> RunOptions {
    RunOptions {
        layers: None,
        input: InputSpec::Random { seed: 1 },
        sched: Schedule::default(),
        dtype,
        modes: Modes {
            shadow: true,
            free: true,
        },
        tolerances: ToleranceTable::defaults(),
        tolerance_source: "defaults".into(),
        dump: None,
        faults: Default::default(),
        progress: false,
    }
}

/// The mirror with one element of one stage of one layer changed.
struct Corrupt {
    inner: CpuMirror,
    layer: usize,
    stage: Stage,
    index: usize,
    value: Option<f64>,
}

impl Backend for Corrupt {
    fn describe(&self) -> String {
        "corrupted mirror".into()
    }
    fn provides(&self) -> StageSet {
        StageSet::ALL
    }
    fn run_layer(
        &mut self,
        ctx: &LayerCtx,
        x: &ndarray::Array2<f64>,
    ) -> mla_diff::Result<LayerTrace> {
        let mut t = self.inner.run_layer(ctx, x)?;
        if ctx.layer == self.layer {
            let st = t.get_mut(self.stage).unwrap();
            let rms = (st.data.iter().map(|v| v * v).sum::<f64>() / st.data.len() as f64).sqrt();
            st.data[self.index] = self.value.unwrap_or(st.data[self.index] + 10.0 * rms);
        }
        Ok(t)
    }
}

fn try_run(
    backend: &mut dyn Backend,
    path: &Path,
    o: &RunOptions,
) -> mla_diff::Result<mla_diff::report::Report> {
    let f = GgufFile::open(path).unwrap();
    let info = BackendInfo::of(Kind::Cpu, backend);
    mla_diff::run::run(&f, backend, &info, o)
}

fn run_with(backend: &mut dyn Backend, path: &Path, o: &RunOptions) -> mla_diff::report::Report {
    try_run(backend, path, o).unwrap()
}

/// The mirror leaving stages out of its trace, declaring `provides` as told.
struct Omit {
    inner: CpuMirror,
    omit: Vec<Stage>,
    provides: StageSet,
}

impl Backend for Omit {
    fn describe(&self) -> String {
        "mirror without some stages".into()
    }
    fn provides(&self) -> StageSet {
        self.provides
    }
    fn run_layer(
        &mut self,
        ctx: &LayerCtx,
        x: &ndarray::Array2<f64>,
    ) -> mla_diff::Result<LayerTrace> {
        let mut t = self.inner.run_layer(ctx, x)?;
        t.stages.retain(|s| !self.omit.contains(&s.stage));
        Ok(t)
    }
}

#[test]
fn a_stage_not_provided_is_shown_in_every_format() {
    let omit = vec![Stage::QAbsorbed, Stage::SplitOut];
    let mut b = Omit {
        inner: CpuMirror::new(Dtype::Bf16),
        provides: omit.iter().fold(StageSet::ALL, |s, &st| s.without(st)),
        omit,
    };
    let mut o = opts(Dtype::Bf16);
    o.layers = Some(vec![0, 1]);
    let rep = run_with(&mut b, &tiny4(), &o);
    // Not a divergence: the run passes (exit code 0) ...
    assert!(rep.pass(), "{}", rep.verdict.message);
    let want = ["q_absorbed".to_string(), "split_out".to_string()];
    for m in &rep.modes {
        for l in &m.layers {
            assert_eq!(l.not_provided, want);
            assert!(l.checks.iter().all(|c| !want.contains(&c.check)));
            assert!(l.checks.iter().any(|c| c.check == "split_lse"));
        }
    }
    // ... but every format says what was not compared.
    let style = mla_diff::report::table::Style { color: false };
    let table = mla_diff::report::table::render(&rep, &style);
    assert!(
        table.contains("not provided by the backend (not compared): q_absorbed, split_out"),
        "{table}"
    );
    let md = mla_diff::report::markdown::render(&rep);
    assert!(
        md.contains("Not provided by the backend (not compared): `q_absorbed`, `split_out`"),
        "{md}"
    );
    let junit = mla_diff::report::junit::render(&rep);
    let doc = roxmltree::Document::parse(&junit).unwrap();
    let skipped: Vec<(String, String)> = doc
        .descendants()
        .filter(|n| n.has_tag_name("skipped"))
        .map(|n| {
            (
                n.parent().unwrap().attribute("name").unwrap().to_string(),
                n.attribute("message").unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(skipped.len(), 4, "2 checks x 2 modes: {junit}");
    assert_eq!(skipped[0].0, "q_absorbed (not provided)");
    assert!(
        skipped[0].1.contains("not provided by the backend") && skipped[0].1.contains("0, 1"),
        "{skipped:?}"
    );
    let json = rep.to_json();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["modes"][0]["layers"][1]["not_provided"],
        serde_json::json!(want)
    );
    let validator = common::report_validator();
    let errors = common::schema_errors(&validator, &v);
    assert!(errors.is_empty(), "schema errors: {errors:#?}");
    // The field round-trips through a baseline file, and a full backend's layers leave it out.
    let back: mla_diff::report::Report = serde_json::from_str(&json).unwrap();
    assert_eq!(back.modes[0].layers[0].not_provided, want);
    let full = run_with(&mut CpuMirror::new(Dtype::Bf16), &tiny4(), &o);
    assert!(!full.to_json().contains("not_provided"));
}

#[test]
fn a_stage_claimed_but_missing_is_an_error() {
    let mut b = Omit {
        inner: CpuMirror::new(Dtype::Bf16),
        omit: vec![Stage::SplitLse],
        provides: StageSet::ALL,
    };
    let mut o = opts(Dtype::Bf16);
    o.layers = Some(vec![0]);
    let e = try_run(&mut b, &tiny4(), &o).unwrap_err();
    assert!(matches!(e, mla_diff::Error::Usage(_)), "{e}");
    assert!(
        e.to_string().contains("split_lse") && e.to_string().contains("claims to provide"),
        "{e}"
    );
}

#[test]
fn clean_mirror_passes_both_modes() {
    let o = opts(Dtype::Bf16);
    let rep = run_with(&mut CpuMirror::new(Dtype::Bf16), &tiny4(), &o);
    assert!(rep.pass(), "{}", rep.verdict.message);
    assert_eq!(rep.modes.len(), 2);
    assert!(rep.modes.iter().all(|m| m.layers.len() == 4));
}

#[test]
fn corrupted_element_is_located_exactly() {
    let o = opts(Dtype::Bf16);
    let s = &o.sched;
    let f = GgufFile::open(tiny4()).unwrap();
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    // attn_latent is [decode_token, head, dim]: pick decode token 5, head 1, dim 17.
    let (dt, h, d) = (5, 1, 17);
    let index = (dt * cfg.n_head + h) * cfg.kv_lora_rank + d;
    let mut b = Corrupt {
        inner: CpuMirror::new(Dtype::Bf16),
        layer: 3,
        stage: Stage::AttnLatent,
        index,
        value: None,
    };
    let rep = run_with(&mut b, &tiny4(), &o);
    assert!(!rep.pass());
    let shadow = &rep.modes[0];
    assert_eq!(shadow.mode, "shadow");
    assert_eq!(
        shadow.verdict.first_layer,
        Some(3),
        "{}",
        shadow.verdict.message
    );
    assert_eq!(shadow.verdict.first_check.as_deref(), Some("attn_latent"));
    for l in &shadow.layers[..3] {
        assert!(l.pass, "layer {} should pass", l.layer);
    }
    let c = shadow.layers[3]
        .checks
        .iter()
        .find(|c| c.check == "attn_latent")
        .unwrap();
    let at = c.metrics.max_abs_at.as_ref().unwrap();
    let get = |k: &str| at.coords.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    assert_eq!(get("layer"), Some(3));
    assert_eq!(get("token"), Some(s.prompt_len + dt));
    assert_eq!(get("decode_step"), Some(dt));
    assert_eq!(get("head"), Some(h));
    assert_eq!(get("dim"), Some(d));
    assert_eq!(c.metrics.outside, 1, "exactly one element is off");
}

#[test]
fn nan_in_optimized_output_fails_with_positions() {
    let o = opts(Dtype::Bf16);
    let f = GgufFile::open(tiny4()).unwrap();
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    let index = 7 * cfg.hidden + 3; // token 7, hidden 3
    let mut b = Corrupt {
        inner: CpuMirror::new(Dtype::Bf16),
        layer: 1,
        stage: Stage::AttnOut,
        index,
        value: Some(f64::NAN),
    };
    let rep = run_with(&mut b, &tiny4(), &o);
    let shadow = &rep.modes[0];
    assert_eq!(shadow.verdict.first_layer, Some(1));
    assert_eq!(
        shadow.verdict.first_check.as_deref(),
        Some("attn_out[prefill]")
    );
    let c = shadow.layers[1]
        .checks
        .iter()
        .find(|c| c.check == "attn_out[prefill]")
        .unwrap();
    assert_eq!(c.metrics.nonfinite.opt_nan, 1);
    let p = &c.metrics.first_nonfinite_at[0];
    assert!(
        p.coords.contains(&("token".to_string(), 7))
            && p.coords.contains(&("hidden".to_string(), 3)),
        "{p}"
    );
    // In free-running mode the NaN flows into every later layer's input.
    let free = &rep.modes[1];
    assert!(!free.layers[2].pass && !free.layers[3].pass);
}

fn run_cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

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
        8,
        "4 layers x 2 modes"
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

#[test]
fn bad_usage_exits_2() {
    let fx = tiny4().display().to_string();
    for args in [
        vec!["run", fx.as_str(), "--layers", "9"],
        vec!["run", fx.as_str(), "--page-size", "0"],
        vec!["run", fx.as_str(), "--tol", "bogus=rel_l2:1"],
        vec!["run", fx.as_str(), "--tokens", "1,2,3"],
        vec!["run", fx.as_str(), "--hidden", "/nonexistent.npy"],
        vec!["run", "/nonexistent.gguf"],
    ] {
        let (code, _, err) = run_cli(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The clean mirror passes on every shipped fixture, in both storage types, under the default schedule
/// and under one that puts every boundary (chunk, page, split) somewhere else.
#[test]
fn mirror_passes_on_every_shipped_fixture() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "gguf") {
            continue;
        }
        let fx = p.display().to_string();
        for extra in [
            &[][..],
            &[
                "--prompt-len",
                "21",
                "--chunk",
                "8",
                "--decode-steps",
                "9",
                "--q-len",
                "2",
                "--page-size",
                "5",
                "--num-splits",
                "3",
            ][..],
        ] {
            for dtype in ["bf16", "fp16"] {
                let mut args = vec!["run", fx.as_str(), "--backend", "cpu", "--dtype", dtype];
                args.extend_from_slice(extra);
                let (code, out, err) = run_cli(&args);
                assert_eq!(code, 0, "{args:?}\n{out}\n{err}");
            }
        }
        n += 1;
    }
    assert!(n >= 5, "expected the shipped fixtures in {}", dir.display());
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
