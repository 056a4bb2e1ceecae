//! Planted bugs: the selftest catches and attributes every fault of the catalogue on the CPU mirror, it
//! fails when a backend does not honour the injection, faults stay in their layer, and `run --inject`
//! validates its names and records them in the report.

use crate::common;

use mla_diff::backend::cpu::CpuMirror;
use mla_diff::backend::{Backend, BackendInfo, Kind, LayerCtx, RunTables};
use mla_diff::faults::{Active, Fault, FaultSet, Injection};
use mla_diff::model::synthetic::Family;
use mla_diff::precision::Dtype;
use mla_diff::schedule::Schedule;
use mla_diff::selftest::{self, Outcome, Summary, TARGET};
use mla_diff::trace::{LayerTrace, StageSet};
use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_mla-diff");

/// The mirror, honouring each layer's faults (`None`) or running every layer with `Some(faults)`.
struct Mirror {
    inner: CpuMirror,
    faults: Option<Active>,
}

impl Backend for Mirror {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn provides(&self) -> StageSet {
        self.inner.provides()
    }
    fn run_layer(
        &mut self,
        ctx: &LayerCtx,
        x: &ndarray::Array2<f64>,
    ) -> mla_diff::Result<LayerTrace> {
        let ctx = LayerCtx {
            faults: self.faults.unwrap_or(ctx.faults),
            ..*ctx
        };
        self.inner.run_layer(&ctx, x)
    }
    // What it forwarded before the descriptor: the mirror's DSA abilities and batch cache format, not
    // its score sum or tiles (the mirror's view of its own traces is the default's here).
    fn judging(&self) -> mla_diff::judging::Judging {
        let j = self.inner.judging();
        mla_diff::judging::Judging {
            sparse: j.sparse,
            batch_cache_in_format: j.batch_cache_in_format,
            has_indexer: j.has_indexer,
            has_kpool_indexer: j.has_kpool_indexer,
            ..Default::default()
        }
    }
    // The batches' checks (where the kernel-variant faults show: `variant_batch`).
    fn runner_checks(&self) -> Option<mla_diff::backend::runner::checks::RunnerChecks> {
        self.inner.runner_checks()
    }
    fn aimed_variants(&self) -> Vec<String> {
        self.inner.aimed_variants()
    }
    fn decode_extra(&self, sched: &Schedule) -> Vec<mla_diff::batch::Request> {
        self.inner.decode_extra(sched)
    }
    fn kpool_indexer(
        &mut self,
        ctx: &LayerCtx,
        k: &mla_diff::model::KpoolIndexer,
        kw: &mla_diff::model::KpoolLayer,
        x: &ndarray::Array2<f64>,
        keys: mla_diff::precision::KeyPrecision,
    ) -> mla_diff::Result<Option<mla_diff::reference::sparse::Selection>> {
        let ctx = LayerCtx {
            faults: self.faults.unwrap_or(ctx.faults),
            ..*ctx
        };
        self.inner.kpool_indexer(&ctx, k, kw, x, keys)
    }
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &mla_diff::model::IndexerConfig,
        iw: &mla_diff::model::IndexerWeights,
        x: &ndarray::Array2<f64>,
        keys: mla_diff::precision::KeyPrecision,
    ) -> mla_diff::Result<Option<mla_diff::reference::sparse::Selection>> {
        let ctx = LayerCtx {
            faults: self.faults.unwrap_or(ctx.faults),
            ..*ctx
        };
        self.inner.indexer(&ctx, ic, iw, x, keys)
    }
}

fn mirror(
    dtype: Dtype,
    kv: mla_diff::kv_format::KvFormat,
    faults: Option<Active>,
) -> mla_diff::Result<(Box<dyn Backend>, BackendInfo)> {
    let b = Mirror {
        inner: CpuMirror::new(dtype).with_kv_format(kv),
        faults,
    };
    let info = BackendInfo::of(Kind::Cpu, &b);
    Ok((Box::new(b), info))
}

/// The self-test through `factory` on `only` (empty: the whole catalogue); DeepSeek-V4's faults (on
/// V4's own path, which `factory` does not make) with `v4`, else left out.
fn selftest_with(factory: &mut selftest::BackendFactory, v4: bool, only: Vec<Fault>) -> Summary {
    let opts = selftest::Options {
        fixtures: None,
        only,
        seed: 0,
        v4: v4.then_some(mla_diff::run::v4::engine::V4Backend::Cpu),
    };
    selftest::run(&opts, factory, &mut |_| {}).unwrap()
}

/// A fault whose site is not the backend's: a glm5-next shared layer's routing (`run::kpool`), which the
/// run applies from the layer's faults whatever the backend does with them.
fn routed_by_the_run(o: &&Outcome) -> bool {
    o.case.fault.is_some_and(|f| {
        f.info()
            .needs
            .contains(&mla_diff::faults::Need::SharedIndexer)
    })
}

fn fault_outcomes(s: &Summary) -> impl Iterator<Item = &Outcome> {
    s.outcomes
        .iter()
        .filter(|o| o.case.fault.is_some() && o.case.lacking.is_none())
}

#[test]
fn every_fault_is_caught_in_its_layer_at_its_stage() {
    let s = selftest_with(&mut |dt, kv, _| mirror(dt, kv, None), true, vec![]);
    let failing: Vec<String> = s
        .outcomes
        .iter()
        .filter(|o| !o.ok)
        .map(|o| o.line())
        .collect();
    assert!(failing.is_empty(), "{}", failing.join("\n"));
    assert!(s.pass());
    // Every fault of the catalogue ran once, and was caught where it was planted.
    let mut seen: Vec<Fault> = fault_outcomes(&s).filter_map(|o| o.case.fault).collect();
    seen.sort();
    // DeepSeek-V4's faults and glm5-next's (k-pool, NoPE) included, each in its fixture's layer.
    assert_eq!(seen, Fault::ALL.to_vec());
    assert!(s.left_out.is_empty(), "{:?}", s.left_out);
    for o in fault_outcomes(&s) {
        assert!(o.detected);
        assert_eq!(o.first_layer, Some(o.case.target));
        assert_eq!(o.first_check.as_deref(), o.expected());
        let f = o.case.fault.unwrap();
        match (
            f.is_v4(),
            f.is_kpool() || f.info().needs.contains(&mla_diff::faults::Need::NoPe),
        ) {
            (true, _) => assert_eq!(o.case.model, selftest::Model::DeepseekV4),
            (_, true) => assert_eq!(o.case.model, selftest::Model::Glm5Next),
            _ => assert_eq!(o.case.target, TARGET),
        }
    }
    // The clean runs of every setup passed, and so did every control.
    assert!(s
        .outcomes
        .iter()
        .filter(|o| o.case.fault.is_none() || o.case.lacking.is_some())
        .all(|o| !o.detected));
    assert!(s.outcomes.iter().any(|o| o.case.fault.is_none()));
    assert!(s.outcomes.iter().any(|o| o.case.lacking.is_some()));
    assert!(s.matrix().lines().count() > Fault::ALL.len() + 2);
}

/// A backend that drops the injection: no fault is found, so the selftest fails (and says why).
#[test]
fn selftest_fails_when_the_backend_ignores_faults() {
    let s = selftest_with(
        &mut |dt, kv, _ignored| mirror(dt, kv, Some(Active::NONE)),
        false,
        vec![],
    );
    assert!(!s.pass());
    for o in fault_outcomes(&s).filter(|o| !routed_by_the_run(o)) {
        assert!(!o.ok && !o.detected, "{}", o.line());
        assert!(
            o.problems.iter().any(|p| p == "not detected"),
            "{}",
            o.line()
        );
    }
}

/// One MLA fault of each setup the selftest runs (model, dtype, schedule, indexer keys and cache format,
/// all from the fault's needs: `Case::for_fault`), of each layer it is planted in and of each kind of
/// verdict it shows in (the layer's stages, or a serving batch's: `Fault::is_batch`): what the
/// attribution of a detection depends on. A fault's own site is not (that it is caught where planted
/// is `every_fault_is_caught_in_its_layer_at_its_stage`'s, over the whole catalogue).
fn one_per_setup() -> Vec<Fault> {
    let mut keys = Vec::new();
    let mut faults = Vec::new();
    for f in Fault::ALL.into_iter().filter(|f| !f.is_v4()) {
        let c = selftest::Case::for_fault(f);
        let key = format!(
            "{} {:?} {:?} layer {} batch {}",
            c.vars(),
            c.keys,
            c.kv,
            c.target,
            f.is_batch()
        );
        if !keys.contains(&key) {
            keys.push(key);
            faults.push(f);
        }
    }
    faults
}

/// A backend that plants each fault in every layer: detection moves to layer 0, which the selftest
/// reports as a wrong attribution. On `one_per_setup`: whether the selftest sees the attribution is
/// wrong depends on the case's setup and verdict, not on which fault moved it.
#[test]
fn selftest_fails_when_a_fault_leaks_into_other_layers() {
    let only = one_per_setup();
    // Every fixture an MLA fault runs on.
    let models = |fs: &[Fault]| {
        let mut m: Vec<String> = fs
            .iter()
            .map(|&f| format!("{:?}", selftest::Case::for_fault(f).model))
            .collect();
        m.sort();
        m.dedup();
        m
    };
    let mla: Vec<Fault> = Fault::ALL.into_iter().filter(|f| !f.is_v4()).collect();
    assert_eq!(models(&only), models(&mla));
    assert!(only.len() < mla.len(), "{} of {}", only.len(), mla.len());
    let s = selftest_with(
        &mut |dt, kv, set: &FaultSet| {
            let everywhere = set
                .0
                .iter()
                .map(|i| Injection { layer: None, ..*i })
                .collect();
            mirror(dt, kv, Some(FaultSet(everywhere).active(0)))
        },
        false,
        only.clone(),
    );
    assert!(!s.pass());
    let mut ran: Vec<Fault> = fault_outcomes(&s).filter_map(|o| o.case.fault).collect();
    ran.sort();
    let mut want = only;
    want.sort();
    assert_eq!(ran, want);
    // (A shared-layer fault has one layer to be in: glm5-next's fixture has one shared layer.)
    for o in fault_outcomes(&s).filter(|o| !routed_by_the_run(o)) {
        assert!(!o.ok, "{}", o.line());
        // Its fixture's first compared layer: glm5-next's first MLA layer is 3.
        let first = match o.case.model {
            selftest::Model::Glm5Next => 3,
            _ => 0,
        };
        assert_eq!(o.first_layer, Some(first), "{}", o.line());
    }
}

/// A fault aimed at layer 1 leaves layer 0's trace bit for bit what the clean mirror computes.
#[test]
fn a_targeted_fault_leaves_other_layers_untouched() {
    let cfg = Family::DeepseekV3.test_config();
    let w = mla_diff::model::synthetic::weights(&cfg, 3);
    assert_eq!(w.layer, 0);
    let sched = Schedule {
        prompt_len: 12,
        chunk: 5,
        decode_steps: 4,
        q_len: 2,
        page_size: 4,
        num_splits: 3,
        ..Schedule::default()
    };
    let x = mla_diff::input::random_hidden(cfg.hidden, sched.total_tokens(), 4);
    let bits = |t: &mla_diff::trace::LayerTrace| -> Vec<Vec<u64>> {
        t.stages
            .iter()
            .map(|s| s.data.iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    let tables = RunTables::new(&cfg, None, &sched).unwrap();
    let clean = CpuMirror::new(Dtype::Bf16)
        .run_layer(&tables.ctx(&cfg, &w, &sched, Active::NONE), &x)
        .unwrap();
    for f in Fault::ALL {
        let at1 = FaultSet(vec![Injection {
            name: f,
            layer: Some(1),
        }]);
        // The driver hands each layer the faults active in it (`FaultSet::active`).
        let t = CpuMirror::new(Dtype::Bf16)
            .run_layer(&tables.ctx(&cfg, &w, &sched, at1.active(w.layer)), &x)
            .unwrap();
        assert_eq!(bits(&t), bits(&clean), "{f} changed layer 0");
    }
}

fn tiny3() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("mla-diff-fault-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        common::make_fixture(&dir, "tiny3.gguf", &["--preset", "tiny", "--layers", "3"])
    })
    .clone()
}

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inject_names_and_layers_are_checked() {
    let fx = tiny3().display().to_string();
    let (code, _, err) = cli(&["run", &fx, "--inject", "rope_sideways"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one-line error: {err}");
    for f in Fault::ALL {
        assert!(err.contains(f.name()), "the catalogue is listed: {err}");
    }
    let (code, _, err) = cli(&["run", &fx, "--inject", "rope_neox@layer=3"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("3 layers"), "{err}");
    let (code, _, err) = cli(&["run", &fx, "--inject", "rope_neox@layer=1", "--layers", "0"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = cli(&["run", &fx, "--inject", "rope_neox@3"]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn injected_faults_are_reported_and_validate() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json").display().to_string();
    let fx = tiny3().display().to_string();
    let (code, out, err) = cli(&[
        "run",
        &fx,
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--inject",
        "cache_pe_first@layer=2",
        "--inject",
        "page_off_by_one",
        "--page-size",
        "64",
        "--json",
        &json,
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    // page_off_by_one cannot show with every token in one page; the run says so.
    assert!(
        err.contains("page_off_by_one") && err.contains("page boundaries"),
        "{err}"
    );
    assert!(
        out.contains("injected faults: cache_pe_first@layer=2, page_off_by_one"),
        "{out}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        report["run"]["injected"],
        serde_json::json!([
            {"name": "cache_pe_first", "layer": 2},
            {"name": "page_off_by_one", "layer": null}
        ])
    );
    assert_eq!(report["verdict"]["first_layer"], 2);
    assert_eq!(report["verdict"]["first_check"], "cache_rows");
    let validator = common::report_validator();
    let errors = common::schema_errors(&validator, &report);
    assert!(errors.is_empty(), "schema errors: {errors:#?}");
    let mut bad = report.clone();
    bad["run"]["injected"][0]["name"] = serde_json::json!("Rope Neox");
    assert!(!validator.is_valid(&bad));

    // Without --inject the report has no `injected` field (reports of real runs are unchanged).
    let (code, _, err) = cli(&["run", &fx, "--backend", "cpu", "--json", &json]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report["run"].get("injected").is_none());
}

#[test]
fn selftest_command() {
    let (code, out, err) = cli(&[
        "selftest",
        "--fault",
        "split_drop_last",
        "--fault",
        "rope-norm",
        "--fault",
        "rope_on_nope",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("| split_drop_last@layer=1"), "{out}");
    assert!(out.contains("| rope_norm@layer=1"), "{out}");
    // A glm5-next fault, on its fixture's first MLA layer; its control too.
    assert!(out.contains("| rope_on_nope@layer=3 "), "{out}");
    assert!(out.contains("| rope_on_nope@layer=3 | pos>0"), "{out}");
    assert!(out.contains("PASS"), "{out}");
    let (code, _, err) = cli(&["selftest", "--fault", "nope"]);
    assert_eq!(code, 2, "{err}");
    let (code, out, _) = cli(&["selftest", "--list"]);
    assert_eq!(code, 0);
    for f in Fault::ALL {
        assert!(out.contains(f.info().define), "{out}");
    }
}
