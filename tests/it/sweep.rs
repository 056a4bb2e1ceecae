//! `mla-diff sweep` (lengths around the kernel's boundaries, the smallest failing length and its
//! bisection; split invariance) and `run --repeat` (bit-for-bit determinism). Small: one layer of a
//! shipped fixture, a few short lengths.

use crate::common;
use mla_diff::backend::cpu::CpuMirror;
use mla_diff::backend::{Backend, BackendInfo, KeyTile, KeyTiles, Kind, LayerCtx};
use mla_diff::compare::ToleranceTable;
use mla_diff::gguf::GgufFile;
use mla_diff::precision::Dtype;
use mla_diff::run::{InputSpec, Modes, RunOptions};
use mla_diff::schedule::Schedule;
use mla_diff::sweep::{self, lengths, LengthPlan, SweepOptions};
use mla_diff::trace::{LayerTrace, Stage, StageSet};
use serde_json::Value;
use std::path::PathBuf;

fn fixture() -> PathBuf {
    common::fixture("deepseek-v3-yarn-q4_k.gguf")
}

fn sweep_validator() -> jsonschema::Validator {
    let schema: Value =
        serde_json::from_str(include_str!("../../schema/sweep.schema.json")).unwrap();
    jsonschema::validator_for(&schema).unwrap()
}

/// `mla-diff sweep FILE --backend cpu ARGS --json --junit --markdown`: exit code, JSON (validated), the
/// JUnit test cases (name, failed) and the Markdown.
fn sweep_cli(args: &[&str]) -> (i32, Value, Vec<(String, bool)>, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let fx = fixture().display().to_string();
    let mut all = vec!["sweep", fx.as_str(), "--backend", "cpu", "-q"];
    all.extend_from_slice(args);
    let (j, x, m) = (p("s.json"), p("s.xml"), p("s.md"));
    all.extend_from_slice(&["--json", &j, "--junit", &x, "--markdown", &m]);
    let o = common::run(&all);
    let code = o.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 1,
        "{args:?}: exit {code}: {}",
        common::stderr(&o)
    );
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    let errors = common::schema_errors(&sweep_validator(), &json);
    assert!(errors.is_empty(), "schema errors: {errors:#?}");
    let xml = std::fs::read_to_string(&x).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let cases = doc
        .descendants()
        .filter(|n| n.has_tag_name("testcase"))
        .map(|n| {
            (
                n.attribute("name").unwrap().to_string(),
                n.children().any(|c| c.has_tag_name("failure")),
            )
        })
        .collect();
    (code, json, cases, std::fs::read_to_string(&m).unwrap())
}

fn points(json: &Value) -> Vec<(u64, bool)> {
    json["lengths"]["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["length"].as_u64().unwrap(), p["pass"].as_bool().unwrap()))
        .collect()
}

/// Exit code, JSON verdict, JUnit and Markdown tell the same verdict; one JUnit case per point.
fn agree(code: i32, json: &Value, cases: &[(String, bool)], md: &str) {
    let pass = json["verdict"]["pass"].as_bool().unwrap();
    assert_eq!(code == 0, pass, "{}", json["verdict"]);
    assert_eq!(cases.iter().all(|(_, failed)| !failed), pass, "{cases:?}");
    assert!(
        md.starts_with(if pass { "### ✅" } else { "### ❌" }),
        "{md}"
    );
    if json.get("lengths").is_some() {
        let pts = points(json);
        assert_eq!(cases.len(), pts.len());
        for ((name, failed), (l, ok)) in cases.iter().zip(&pts) {
            assert_eq!(name, &format!("length {l}"));
            assert_eq!(*failed, !ok, "{name}");
        }
    }
}

#[test]
fn a_clean_fixture_passes_every_length_in_every_format() {
    // Lengths 14..=20 with 2 decode steps: the page boundary (16) and its neighbours among them.
    let (code, json, cases, md) = sweep_cli(&["--lengths", "14..=20", "--decode-steps", "2"]);
    agree(code, &json, &cases, &md);
    assert_eq!(code, 0, "{}", json["verdict"]);
    let ls = &json["lengths"];
    assert_eq!(ls["smallest_failing"], Value::Null);
    assert!(ls.get("bisection").is_none());
    let lens: Vec<u64> = points(&json).iter().map(|p| p.0).collect();
    for l in [15, 16, 17] {
        assert!(lens.contains(&l), "page boundary {l} in {lens:?}");
    }
    // The CPU mirror's tiles, as the backend reported them.
    assert_eq!(ls["key_tiles"]["decode"][0]["keys"], 64);
    // Each point is a real run: its prompt is its length less the decode tokens, its worst check below 1.
    for p in ls["points"].as_array().unwrap() {
        assert_eq!(
            p["prompt_len"].as_u64().unwrap() + 2,
            p["length"].as_u64().unwrap()
        );
        let r = p["worst"]["ratio"].as_f64().unwrap();
        assert!(r > 0.0 && r < 1.0, "{p}");
    }
    // The schema is not vacuous.
    let mut broken = json.clone();
    broken["lengths"]["points"][0]
        .as_object_mut()
        .unwrap()
        .remove("origins");
    assert!(!sweep_validator().is_valid(&broken));
}

#[test]
fn bisection_finds_the_exact_smallest_failing_length() {
    // page_off_by_one shows once the sequence crosses a page: it fails from page + 1 tokens on. Lengths
    // 4, 16, 28, 40 without boundaries leave a gap that the bisection closes.
    for page in [13usize, 16] {
        let page_arg = page.to_string();
        let (code, json, cases, md) = sweep_cli(&[
            "--lengths",
            "4..=40:12",
            "--no-boundaries",
            "--decode-steps",
            "2",
            "--page-size",
            &page_arg,
            "--inject",
            "page_off_by_one",
        ]);
        agree(code, &json, &cases, &md);
        assert_eq!(code, 1);
        let ls = &json["lengths"];
        let expected = page as u64 + 1;
        assert_eq!(ls["smallest_failing"], expected, "page {page}");
        let b = &ls["bisection"];
        let (pass, fail) = (b["pass"].as_u64().unwrap(), b["fail"].as_u64().unwrap());
        assert!(pass < expected && expected <= fail, "{b}");
        assert_eq!(b["smallest_failing"], expected);
        // Every point agrees with the fault's trigger; the first failure is the cache.
        for (l, ok) in points(&json) {
            assert_eq!(ok, l <= page as u64, "length {l}, page {page}");
        }
        let first = ls["points"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["length"] == expected)
            .unwrap();
        assert_eq!(first["first_check"], "cache_rows");
        assert_eq!(first["origins"][0], "bisect");
        assert!(
            json["verdict"]["message"]
                .as_str()
                .unwrap()
                .contains(&format!("smallest failing length {expected}")),
            "{}",
            json["verdict"]
        );
        assert!(
            md.contains(&format!("smallest failing length: {expected}")),
            "{md}"
        );
    }
}

#[test]
fn boundaries_find_the_smallest_failing_length_without_bisection() {
    // With the boundaries the page crossing itself is run: 16 passes, 17 fails, nothing to bisect.
    let (code, json, cases, md) = sweep_cli(&[
        "--lengths",
        "4..=40",
        "--decode-steps",
        "2",
        "--inject",
        "page_off_by_one",
    ]);
    agree(code, &json, &cases, &md);
    let ls = &json["lengths"];
    assert_eq!(ls["smallest_failing"], 17);
    assert!(ls.get("bisection").is_none(), "{ls}");
    assert!(points(&json).contains(&(16, true)));
}

/// The mirror reporting other key tiles than its own: the boundaries follow what the backend says.
struct Tiled {
    inner: CpuMirror,
    tiles: KeyTiles,
}

impl Backend for Tiled {
    fn describe(&self) -> String {
        "mirror with declared tiles".into()
    }
    fn provides(&self) -> StageSet {
        StageSet::ALL
    }
    fn run_layer(
        &mut self,
        ctx: &LayerCtx,
        x: &ndarray::Array2<f64>,
    ) -> mla_diff::Result<LayerTrace> {
        self.inner.run_layer(ctx, x)
    }
    fn judging(&self) -> mla_diff::judging::Judging {
        mla_diff::judging::Judging {
            key_tiles: self.tiles.clone(),
            ..Default::default()
        }
    }
}

fn sweep_opts(sched: Schedule) -> SweepOptions {
    SweepOptions {
        layers: vec![0],
        seed: 0,
        sched,
        dtype: Dtype::Bf16,
        tolerances: ToleranceTable::defaults(),
        tolerance_source: "defaults".into(),
        faults: Default::default(),
        progress: false,
        allow_dense_beyond_topk: false,
    }
}

#[test]
fn boundaries_follow_the_kernel_in_use() {
    let sched = Schedule {
        decode_steps: 1,
        num_splits: 3,
        page_size: 64,
        chunk: 64,
        ..Schedule::default()
    };
    let mut b = Tiled {
        inner: CpuMirror::new(Dtype::Bf16),
        tiles: KeyTiles {
            prefill: vec![KeyTile::new("test prefill tile", 10)],
            decode: vec![KeyTile::new("test decode tile", 7)],
        },
    };
    let info = BackendInfo::of(Kind::Cpu, &b);
    let f = GgufFile::open(fixture()).unwrap();
    let (ls, r) = lengths::parse_lengths("1..=25").unwrap();
    let plan = LengthPlan {
        user: Some(("1..=25".into(), ls, r)),
        boundaries: true,
        extra_tiles: vec![],
    };
    let rep = sweep::sweep_lengths(&f, &mut b, &info, &sweep_opts(sched.clone()), &plan).unwrap();
    let l = rep.lengths.unwrap();
    let at = |n: usize| -> Vec<String> {
        l.points
            .iter()
            .find(|p| p.length == n)
            .map(|p| p.origins.clone())
            .unwrap_or_default()
    };
    // Decode: 7 keys per split × 3 splits = 21 tokens, and one either side.
    for (n, o) in [(20, "-1"), (21, ""), (22, "+1")] {
        assert!(
            at(n).contains(&format!("decode test decode tile L=3x7{o}")),
            "{n}: {:?}",
            at(n)
        );
    }
    // Prefill: a prompt of 10 (length 11).
    assert!(
        at(11).contains(&"prefill test prefill tile P=10".to_string()),
        "{:?}",
        at(11)
    );
    // The page (64) and chunk (64) are past the range: no such origin.
    assert!(l
        .points
        .iter()
        .all(|p| p.origins.iter().all(|o| !o.starts_with("page"))));
    assert!(l.points.iter().all(|p| p.outcome.pass));
    // Each split holds exactly 7 keys at 21 tokens: the boundary is where the partition says.
    assert!(sched.split_ranges(21).iter().all(|r| r.len() == 7));
}

#[test]
fn split_counts_agree_on_a_clean_fixture_and_not_with_a_dropped_split() {
    let (code, json, cases, md) = sweep_cli(&["--splits", "1,2,4,8", "--decode-steps", "3"]);
    agree(code, &json, &cases, &md);
    assert_eq!(code, 0, "{}", json["verdict"]);
    let sp = &json["splits"];
    let cmp = sp["comparisons"].as_array().unwrap();
    // 3 counts × the 4 invariant checks × 1 layer, each within tolerance.
    assert_eq!(cmp.len(), 3 * 4);
    assert!(cmp
        .iter()
        .all(|c| c["pass"] == true && c["ratio"].as_f64().unwrap() < 1.0));
    // The counts really change the decode outputs (so the comparison can fail).
    assert!(
        cmp.iter().any(|c| c["rel_l2"].as_f64().unwrap() > 0.0),
        "{cmp:?}"
    );
    // 4 runs against fp64 and 3 comparisons as JUnit cases.
    assert_eq!(cases.len(), 4 + 3);

    // A dropped split changes the result with the count: every run fails against fp64 and the counts
    // disagree with each other.
    let (code, json, cases, md) = sweep_cli(&[
        "--splits",
        "2,4",
        "--decode-steps",
        "3",
        "--inject",
        "split_drop_last",
    ]);
    agree(code, &json, &cases, &md);
    assert_eq!(code, 1);
    let sp = &json["splits"];
    assert!(sp["runs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["first_check"] == "attn_latent"));
    let latent = sp["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "attn_latent")
        .unwrap();
    assert_eq!(latent["pass"], false, "{latent}");
    assert!(cases
        .iter()
        .any(|(n, failed)| n == "splits 4 vs 2" && *failed));
}

/// The mirror with one element of one stage changed on every second call: nondeterministic.
struct Flaky {
    inner: CpuMirror,
    calls: usize,
    stage: Stage,
    index: usize,
    value: Change,
}

type Change = fn(f64) -> f64;

impl Backend for Flaky {
    fn describe(&self) -> String {
        "flaky mirror".into()
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
        self.calls += 1;
        if self.calls.is_multiple_of(2) {
            let s = t.get_mut(self.stage).unwrap();
            s.data[self.index] = (self.value)(s.data[self.index]);
        }
        Ok(t)
    }
}

fn run_opts(repeat: usize) -> RunOptions {
    RunOptions {
        layers: Some(vec![0]),
        input: InputSpec::Random { seed: 1 },
        sched: Schedule {
            decode_steps: 3,
            ..Schedule::default()
        },
        modes: Modes {
            shadow: true,
            free: false,
        },
        tolerances: ToleranceTable::defaults(),
        tolerance_source: "defaults".into(),
        repeat,
        ..RunOptions::default()
    }
}

fn repeat_run(b: &mut dyn Backend, repeat: usize) -> mla_diff::report::Report {
    let f = GgufFile::open(fixture()).unwrap();
    let info = BackendInfo::of(Kind::Cpu, b);
    mla_diff::run::run(&f, b, &info, &run_opts(repeat)).unwrap()
}

#[test]
fn nondeterminism_fails_the_run_at_its_first_position() {
    let sched = run_opts(1).sched;
    // One ulp of one attn_latent element in the second run; a NaN in another case. Each within or far
    // outside tolerance, the repeat check sees both.
    let cases: [(Stage, usize, Change); 3] = [
        (Stage::AttnLatent, 1234, |v| f64::from_bits(v.to_bits() + 1)),
        (Stage::AttnOut, 5, |_| f64::NAN),
        (Stage::QNope, 0, |v| -v),
    ];
    for (stage, index, value) in cases {
        let mut b = Flaky {
            inner: CpuMirror::new(Dtype::Bf16),
            calls: 0,
            stage,
            index,
            value,
        };
        let rep = repeat_run(&mut b, 3);
        let r = rep.repeat.as_ref().unwrap();
        assert!(
            !r.pass && !rep.pass() && !rep.verdict.pass,
            "{stage}: {}",
            r.message
        );
        assert!(
            rep.verdict.message.contains("NONDETERMINISTIC"),
            "{}",
            rep.verdict.message
        );
        // The compared run is the first (clean) one: nondeterminism is the only failure.
        assert!(
            rep.modes[0].verdict.pass,
            "{}",
            rep.modes[0].verdict.message
        );
        let d = &r.layers[0].differing;
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(
            (d[0].stage.as_str(), d[0].run, d[0].elements),
            (stage.name(), 2, 1)
        );
        assert_eq!(d[0].first_index, index);
        // The position decodes the flat index: attn_latent [decode_token, head, dim].
        if stage == Stage::AttnLatent {
            let cfg =
                mla_diff::model::MlaConfig::from_gguf(&GgufFile::open(fixture()).unwrap()).unwrap();
            let at = d[0].first_at.as_ref().unwrap();
            let per_tok = cfg.n_head * cfg.kv_lora_rank;
            let want = [
                ("token", sched.prompt_len + index / per_tok),
                ("head", index % per_tok / cfg.kv_lora_rank),
                ("dim", index % cfg.kv_lora_rank),
            ];
            for (k, v) in want {
                assert!(at.coords.contains(&(k.to_string(), v)), "{k} {v}: {at}");
            }
            assert_eq!(d[0].first_check, "attn_latent");
        }
        // Every format says it.
        let junit = mla_diff::report::junit::render(&rep);
        assert!(junit.contains("nondeterministic over 3 runs"), "{junit}");
        let md = mla_diff::report::markdown::render(&rep);
        assert!(
            md.starts_with("### ❌") && md.contains(stage.name()),
            "{md}"
        );
        let json: Value = serde_json::from_str(&rep.to_json()).unwrap();
        let errors = common::schema_errors(&common::report_validator(), &json);
        assert!(errors.is_empty(), "{errors:#?}");
        assert_eq!(json["verdict"]["pass"], false);
    }
}

#[test]
fn the_cpu_mirror_is_deterministic() {
    // Both modes, several layers, through the binary: every stage bit-identical over 3 runs.
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("r.json");
    let o = common::run(&[
        "run",
        fixture().to_str().unwrap(),
        "--backend",
        "cpu",
        "--repeat",
        "3",
        "--decode-steps",
        "3",
        "-q",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", common::stderr(&o));
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    assert!(common::schema_errors(&common::report_validator(), &json).is_empty());
    let r = &json["repeat"];
    assert_eq!(
        (r["runs"].as_u64(), r["pass"].as_bool()),
        (Some(3), Some(true))
    );
    let n_layer = json["config"]["n_layer"].as_u64().unwrap() as usize;
    assert_eq!(r["layers"].as_array().unwrap().len(), n_layer);
    assert!(r["layers"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l["identical"] == true));
    // A repeat that passes leaves the verdict as it was.
    assert_eq!(json["verdict"]["pass"], true);
}
