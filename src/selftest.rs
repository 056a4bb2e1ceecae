//! `mla-diff selftest`: plant every fault of the catalogue (`crate::faults`) in the optimized path, one run
//! each, and prove that the comparator catches it — at the fault's earliest stage, in the targeted layer
//! only — and that the same runs without the fault pass.
//!
//! A fault is only visible on a run that exercises what it breaks, so each fault's needs pick the run:
//! the fixture (a NORM or NEOX model with YaRN; a model whose absorbed query leaves the fp16 range) and
//! the schedule, grown from a minimal one (one short prefill chunk at position 0 in one page) by each
//! need. Every fault is injected into the middle layer of a 3-layer fixture; in shadow mode the other
//! layers get the reference's input, so they must stay clean.

use crate::backend::{Backend, BackendInfo, Dtype};
use crate::compare::ToleranceTable;
use crate::error::{Error, Result};
use crate::faults::{Fault, FaultSet, Injection, Need};
use crate::fixture::{self, Preset};
use crate::gguf::{GgmlType, GgufFile};
use crate::model::MlaConfig;
use crate::report::Report;
use crate::run::{InputSpec, Modes, RunOptions};
use crate::schedule::Schedule;
use std::path::{Path, PathBuf};

/// Layers of every selftest fixture, and the layer each fault is injected into.
pub const LAYERS: usize = 3;
pub const TARGET: usize = 1;

/// The selftest's fixtures: small synthetic files with the real models' head dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Model {
    /// DeepSeek-V3 dims (P 128, R 64, Dv 128, Lkv 512), NORM rope, YaRN factor 40 (mscale² 1.87).
    DeepseekV3,
    /// MiniCPM3 dims (64/32/64, Lkv 256), NEOX rope, LongRoPE factors.
    Minicpm3,
    /// DeepSeek-V2-Lite dims (no q-LoRA, the model of llama.cpp #13137) with `attn_k_b` and `attn_v_b`
    /// × 2^K and `attn_kv_a_norm` × 2^-K: q_absorbed = W_UKᵀ·q_nope leaves the fp16 range (and the latent
    /// shrinks by 2^-K), while scores, k_nope, v, the heads, attn_out and so every layer's input stay what
    /// they were. Power-of-two scaling is exact in bf16 and f32, so every relative error is unchanged too
    /// (fp16 cannot hold the small latent: this fixture is for bf16 runs).
    V2LiteLargeQAbs,
    /// GLM-5 dims (P 192, R 64, Dv 256: P+R = Dv), no YaRN: for the controls.
    Glm5,
}

/// The exponent K of `Model::V2LiteLargeQAbs`: puts the rms of q_absorbed above 65504 (checked on the
/// reference values of every run that needs it).
pub const LARGE_QABS_LOG2: i32 = 18;

impl Model {
    pub fn for_needs(needs: &[Need]) -> Model {
        if needs.contains(&Need::NeoxRope) {
            Model::Minicpm3
        } else if needs.contains(&Need::LargeQAbs) {
            Model::V2LiteLargeQAbs
        } else {
            Model::DeepseekV3
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Model::DeepseekV3 => "deepseek-v3",
            Model::Minicpm3 => "minicpm3",
            Model::V2LiteLargeQAbs => "v2-lite-large-qabs",
            Model::Glm5 => "glm-5",
        }
    }
    pub fn file_name(self) -> String {
        format!("selftest-{}.gguf", self.name())
    }
    fn spec(self) -> Result<fixture::Spec> {
        let (preset, q_lora) = match self {
            Model::DeepseekV3 => (Preset::DeepseekV3, Some(128)),
            Model::Minicpm3 => (Preset::Minicpm3, Some(128)),
            Model::V2LiteLargeQAbs => (Preset::DeepseekV2Lite, None),
            Model::Glm5 => (Preset::Glm5, Some(64)),
        };
        fixture::Spec::from_options(&fixture::Options {
            preset,
            layers: Some(LAYERS),
            quant: GgmlType::from_name("BF16").expect("bf16"),
            seed: 0,
            legacy_kv_b: false,
            hidden: Some(256),
            heads: Some(4),
            q_lora_rank: q_lora,
            vocab: Some(64),
        })
    }
    /// Write the fixture to `path`.
    pub fn write(self, path: &Path) -> Result<()> {
        fixture::write(&self.spec()?, path)?;
        if self == Model::V2LiteLargeQAbs {
            let k = LARGE_QABS_LOG2;
            let mut scales = Vec::new();
            for l in 0..LAYERS {
                scales.push((format!("blk.{l}.attn_k_b.weight"), 2f32.powi(k)));
                scales.push((format!("blk.{l}.attn_v_b.weight"), 2f32.powi(k)));
                scales.push((format!("blk.{l}.attn_kv_a_norm.weight"), 2f32.powi(-k)));
            }
            scale_tensors(path, &scales)?;
        }
        Ok(())
    }
}

/// Multiply tensors of a GGUF file in place (F32, F16 or BF16 data).
pub fn scale_tensors(path: &Path, scales: &[(String, f32)]) -> Result<()> {
    let bytes = {
        let f = GgufFile::open(path)?;
        let mut bytes = std::fs::read(path)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        for (name, s) in scales {
            let t = f.tensor(name).ok_or_else(|| {
                Error::Tensor(format!("{}: no tensor {name} to scale", path.display()))
            })?;
            let start = (f.data_offset + t.offset) as usize;
            let n = t.n_elements() as usize;
            let ty = t.ty.to_string();
            let data = bytes.get_mut(start..).unwrap_or_default();
            match ty.as_str() {
                "F32" => data.chunks_exact_mut(4).take(n).for_each(|c| {
                    let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * s;
                    c.copy_from_slice(&v.to_le_bytes());
                }),
                "BF16" => data.chunks_exact_mut(2).take(n).for_each(|c| {
                    let v = half::bf16::from_le_bytes([c[0], c[1]]).to_f32() * s;
                    c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }),
                "F16" => data.chunks_exact_mut(2).take(n).for_each(|c| {
                    let v = half::f16::from_le_bytes([c[0], c[1]]).to_f32() * s;
                    c.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }),
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: cannot scale {name} of type {other}",
                        path.display()
                    )))
                }
            }
        }
        bytes
    };
    // Write through a temporary file: the mapping above is closed, the original stays intact on error.
    let tmp = path.with_extension("scaled.tmp");
    std::fs::write(&tmp, &bytes)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

/// The schedule for a fault's needs: a minimal run (one prefill chunk of 6 tokens at position 0, all in
/// one page, no decode) grown by each need.
pub fn schedule_for(needs: &[Need]) -> Schedule {
    let mut s = Schedule {
        prompt_len: 6,
        chunk: 6,
        decode_steps: 0,
        q_len: 1,
        page_size: 64,
        num_splits: 1,
        shuffle_seed: Some(7),
        spare_pages: 1,
        pos_offset: 0,
    };
    for n in needs {
        match n {
            Need::Positions => s.pos_offset = 5,
            Need::Decode | Need::EndInsidePage => s.decode_steps = s.decode_steps.max(3),
            Need::MultiSplit => {
                s.decode_steps = s.decode_steps.max(3);
                s.num_splits = 3;
            }
            Need::PageCrossing => (s.page_size, s.spare_pages) = (4, 2),
            Need::NormRope
            | Need::NeoxRope
            | Need::Yarn
            | Need::QkNotV
            | Need::LargeQAbs
            | Need::F32
            | Need::Prefill => {}
        }
    }
    if needs.contains(&Need::EndInsidePage) && s.total_tokens().is_multiple_of(s.page_size) {
        s.decode_steps += 1;
    }
    s
}

/// One run of the selftest: a fault (or none) on a fixture and schedule.
#[derive(Debug, Clone)]
pub struct Case {
    pub fault: Option<Fault>,
    /// A control: the fault on a run that lacks this one need, where it must stay invisible.
    pub lacking: Option<Need>,
    pub model: Model,
    pub dtype: Dtype,
    pub sched: Schedule,
}

/// The controls: each fault on a run that lacks one of its needs (and has the others) must not be
/// detected there, which shows that the need is real and that the exposing run is not arbitrary.
pub fn controls() -> Vec<Case> {
    use Fault::*;
    use Need::*;
    let control = |f: Fault, lacking: Need, model: Option<Model>, sched: Option<Schedule>| {
        let c = Case::for_fault(f);
        Case {
            lacking: Some(lacking),
            model: model.unwrap_or(c.model),
            sched: sched.unwrap_or(c.sched.clone()),
            ..c
        }
    };
    let base = schedule_for(&[]);
    vec![
        control(RopeNeox, NormRope, Some(Model::Minicpm3), None),
        control(RopeNorm, NeoxRope, Some(Model::DeepseekV3), None),
        control(YarnMscaleMissing, Yarn, Some(Model::Glm5), None),
        control(HeadStrideQk, QkNotV, Some(Model::Glm5), None),
        control(QAbsFp16Accum, LargeQAbs, Some(Model::DeepseekV3), None),
        control(
            KPeBeforeRope,
            Positions,
            None,
            Some(Schedule {
                prompt_len: 1,
                chunk: 1,
                ..base.clone()
            }),
        ),
        control(
            CausalOffByOne,
            Prefill,
            None,
            Some(Schedule {
                chunk: 1,
                ..base.clone()
            }),
        ),
        control(
            EmptyCtxLseInf,
            Prefill,
            None,
            Some(Schedule {
                prompt_len: 0,
                chunk: 1,
                decode_steps: 3,
                ..base.clone()
            }),
        ),
        control(KBUntransposed, Decode, None, Some(base.clone())),
        control(PageOffByOne, PageCrossing, None, Some(base.clone())),
        control(
            LseLog2Merge,
            MultiSplit,
            None,
            Some(Schedule {
                num_splits: 1,
                ..Case::for_fault(LseLog2Merge).sched
            }),
        ),
    ]
}

impl Case {
    pub fn for_fault(f: Fault) -> Case {
        let needs = f.info().needs;
        Case {
            fault: Some(f),
            lacking: None,
            model: Model::for_needs(needs),
            dtype: match needs.contains(&Need::F32) {
                true => Dtype::F32,
                false => Dtype::Bf16,
            },
            sched: schedule_for(needs),
        }
    }
    fn clean(&self) -> Case {
        Case {
            fault: None,
            lacking: None,
            ..self.clone()
        }
    }
    fn setup_key(&self) -> String {
        format!(
            "{} {} {}",
            self.model.name(),
            self.dtype.name(),
            self.params()
        )
    }
    /// The run's parameters, test-backend-ops style.
    pub fn params(&self) -> String {
        let s = &self.sched;
        format!(
            "prompt={} chunk={} decode={} q_len={} page={} splits={} pos={}",
            s.prompt_len, s.chunk, s.decode_steps, s.q_len, s.page_size, s.num_splits, s.pos_offset
        )
    }
}

/// What one run showed.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub case: Case,
    pub detected: bool,
    pub first_layer: Option<usize>,
    pub first_check: Option<String>,
    /// Worst metric ÷ tolerance of the first failing check (∞: non-finite values).
    pub margin: Option<f64>,
    /// The first failing check's reasons.
    pub reason: String,
    pub ok: bool,
    /// Why the case is not ok.
    pub problems: Vec<String>,
}

impl Outcome {
    /// The check the fault must be first detected at; `None` for clean runs and controls.
    pub fn expected(&self) -> Option<&'static str> {
        match self.case.lacking {
            Some(_) => None,
            None => self.case.fault.map(|f| f.info().expected),
        }
    }
    /// How the case names itself in the matrix.
    pub fn label(&self) -> String {
        match (self.case.fault, self.case.lacking) {
            (None, _) => "(clean)".into(),
            (Some(f), None) => format!("{f}@layer={TARGET}"),
            (Some(f), Some(n)) => format!("{f}@layer={TARGET} without {}", n.name()),
        }
    }
    /// One line per case, test-backend-ops style.
    pub fn line(&self) -> String {
        let c = &self.case;
        let what = self.label();
        let found = match (&self.first_layer, &self.first_check) {
            (Some(l), Some(ch)) => format!(
                "detected at layer {l} {ch} ({})",
                margin_text(self.margin.unwrap_or(f64::NAN))
            ),
            _ => "no divergence".into(),
        };
        let expect = match self.expected() {
            Some(e) => format!(", expected layer {TARGET} {e}"),
            None => ", expected no divergence".into(),
        };
        let mut s = format!(
            "  {what}: model={} dtype={} {}: {found}{expect}  {}",
            c.model.name(),
            c.dtype.name(),
            c.params(),
            if self.ok { "OK" } else { "FAIL" }
        );
        for p in &self.problems {
            s.push_str(&format!("\n      {p}"));
        }
        s
    }
}

fn margin_text(m: f64) -> String {
    if m.is_infinite() {
        "non-finite".into()
    } else if m >= 100.0 {
        format!("{m:.0e}× tol")
    } else {
        format!("{m:.1}× tol")
    }
}

pub struct Options {
    /// Where the fixtures are written (kept); `None`: a temporary directory, removed afterwards.
    pub fixtures: Option<PathBuf>,
    /// Only these faults (empty: the whole catalogue).
    pub only: Vec<Fault>,
    /// Input seed of every run.
    pub seed: u64,
}

/// Makes the optimized path for a case's dtype (`backend::Factory::open`, which shares one GPU context
/// across cases). The case's faults reach the backend through each layer's `LayerCtx`; they are passed
/// here too so that a test can wrap a backend that misuses them.
pub type BackendFactory<'a> =
    dyn FnMut(Dtype, &FaultSet) -> Result<(Box<dyn Backend>, BackendInfo)> + 'a;

/// All outcomes: clean runs first, then one per fault.
pub struct Summary {
    pub backend: String,
    pub outcomes: Vec<Outcome>,
    pub seconds: f64,
}

impl Summary {
    pub fn pass(&self) -> bool {
        !self.outcomes.is_empty() && self.outcomes.iter().all(|o| o.ok)
    }
    /// The matrix of clean runs and faults, as a Markdown table.
    pub fn matrix(&self) -> String {
        let head = [
            "fault",
            "fixture",
            "schedule",
            "detected",
            "first layer",
            "first stage",
            "expected",
            "margin",
            "ok",
        ];
        let rows = self.outcomes.iter().filter(|o| o.case.lacking.is_none());
        table(
            &head,
            rows.map(|o| {
                let c = &o.case;
                vec![
                    o.label(),
                    format!("{} {}", c.model.name(), c.dtype.name()),
                    c.params(),
                    yes_no(o.detected),
                    o.first_layer.map_or("-".into(), |l| l.to_string()),
                    o.first_check.clone().unwrap_or("-".into()),
                    match o.expected() {
                        Some(e) => format!("{TARGET} {e}"),
                        None => "none".into(),
                    },
                    o.margin.map_or("-".into(), margin_text),
                    ok_text(o.ok),
                ]
            }),
        )
    }

    /// The controls (each fault on a run lacking one need: must stay undetected), as a Markdown table.
    pub fn controls_matrix(&self) -> String {
        let head = ["fault", "lacking", "fixture", "schedule", "detected", "ok"];
        let rows = self.outcomes.iter().filter(|o| o.case.lacking.is_some());
        table(
            &head,
            rows.map(|o| {
                let c = &o.case;
                vec![
                    format!("{}@layer={TARGET}", c.fault.map_or("-", |f| f.name())),
                    c.lacking.map_or("-", |n| n.name()).to_string(),
                    format!("{} {}", c.model.name(), c.dtype.name()),
                    c.params(),
                    match (&o.first_layer, &o.first_check) {
                        (Some(l), Some(ch)) => format!("yes (layer {l} {ch})"),
                        _ => "no".into(),
                    },
                    ok_text(o.ok),
                ]
            }),
        )
    }
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

fn ok_text(b: bool) -> String {
    if b { "OK" } else { "FAIL" }.into()
}

/// A Markdown table with aligned columns.
fn table(head: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut rows: Vec<Vec<String>> = rows.collect();
    rows.insert(0, head.iter().map(|h| h.to_string()).collect());
    let widths: Vec<usize> = (0..head.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let line = |r: &[String]| {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, &w)| format!("{c:<w$}"))
            .collect();
        format!("| {} |\n", cells.join(" | "))
    };
    let mut s = line(&rows[0]);
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    s.push_str(&format!("|-{}-|\n", rule.join("-|-")));
    for r in &rows[1..] {
        s.push_str(&line(r));
    }
    s
}

/// Run the selftest. `on_outcome` sees each outcome as it is made (for progress lines).
pub fn run(
    opts: &Options,
    make_backend: &mut BackendFactory,
    on_outcome: &mut dyn FnMut(&Outcome),
) -> Result<Summary> {
    let started = std::time::Instant::now();
    let faults: Vec<Fault> = if opts.only.is_empty() {
        Fault::ALL.to_vec()
    } else {
        opts.only.clone()
    };
    let mut cases: Vec<Case> = faults.iter().map(|&f| Case::for_fault(f)).collect();
    cases.extend(
        controls()
            .into_iter()
            .filter(|c| c.fault.is_some_and(|f| faults.contains(&f))),
    );
    let (dir, temporary) = match &opts.fixtures {
        Some(d) => (d.clone(), false),
        None => {
            // Unique per call: several selftests may run at once in one process (tests).
            static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("mla-diff-selftest-{}-{n}", std::process::id());
            (std::env::temp_dir().join(name), true)
        }
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    let result = run_cases(&cases, &dir, opts, make_backend, on_outcome);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (backend, outcomes) = result?;
    Ok(Summary {
        backend,
        outcomes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn run_cases(
    cases: &[Case],
    dir: &Path,
    opts: &Options,
    make_backend: &mut BackendFactory,
    on_outcome: &mut dyn FnMut(&Outcome),
) -> Result<(String, Vec<Outcome>)> {
    let mut files = std::collections::HashMap::new();
    for c in cases {
        if let std::collections::hash_map::Entry::Vacant(e) = files.entry(c.model) {
            let p = dir.join(c.model.file_name());
            c.model.write(&p)?;
            e.insert(GgufFile::open(&p)?);
        }
    }
    let mut backend_name = String::new();
    let mut outcomes = Vec::new();
    // The clean run of each distinct setup, first: a fault's detection counts only where its setup passes.
    let mut clean: Vec<(String, Report)> = Vec::new();
    for c in cases.iter().filter(|c| c.lacking.is_none()) {
        if clean.iter().any(|(k, _)| *k == c.setup_key()) {
            continue;
        }
        let cc = c.clean();
        let (rep, name) = run_case(&cc, &files[&c.model], opts, make_backend)?;
        // The backend without its dtype (the runs use several): "cpu-mirror", "cuda: NVIDIA H200".
        backend_name = name.split(" (").next().unwrap_or(&name).to_string();
        let o = judge(&cc, &rep, &files[&c.model], None);
        on_outcome(&o);
        outcomes.push(o);
        clean.push((c.setup_key(), rep));
    }
    for c in cases {
        let file = &files[&c.model];
        let (rep, _) = run_case(c, file, opts, make_backend)?;
        let clean_rep = clean
            .iter()
            .find(|(k, _)| *k == c.setup_key())
            .map(|(_, r)| r);
        let o = judge(c, &rep, file, clean_rep);
        on_outcome(&o);
        outcomes.push(o);
    }
    Ok((backend_name, outcomes))
}

fn run_case(
    c: &Case,
    file: &GgufFile,
    o: &Options,
    make_backend: &mut BackendFactory,
) -> Result<(Report, String)> {
    let faults = FaultSet(
        c.fault
            .map(|f| {
                vec![Injection {
                    name: f,
                    layer: Some(TARGET),
                }]
            })
            .unwrap_or_default(),
    );
    let (mut backend, info) = make_backend(c.dtype, &faults)?;
    let opts = RunOptions {
        layers: None,
        input: InputSpec::Random { seed: o.seed },
        sched: c.sched.clone(),
        dtype: c.dtype,
        modes: Modes {
            shadow: true,
            free: false,
        },
        tolerances: ToleranceTable::defaults(),
        tolerance_source: "defaults (calibrated, src/compare/tolerances.json)".into(),
        dump: None,
        faults,
        progress: false,
    };
    let rep = crate::run::run(file, backend.as_mut(), &info, &opts)?;
    Ok((rep, info.description))
}

/// Judge one run. A clean run must pass. A fault must be detected in layer `TARGET` only, first at its
/// expected check, on a setup whose clean run passed and which meets the fault's needs. A control must
/// not be detected, on a run that really lacks the need it is about.
fn judge(c: &Case, rep: &Report, file: &GgufFile, clean: Option<&Report>) -> Outcome {
    let shadow = &rep.modes[0];
    let v = &shadow.verdict;
    let first = shadow
        .layers
        .iter()
        .find(|l| !l.pass)
        .and_then(|l| l.checks.iter().find(|ch| !ch.pass));
    let mut problems = Vec::new();
    let q_abs_large = q_abs_rms(rep).map(|r| (r, r > 65504.0));
    let cfg = MlaConfig::from_gguf(file);
    if let Err(e) = &cfg {
        problems.push(format!("cannot read the fixture's config: {e}"));
    }
    match (c.fault, c.lacking) {
        (None, _) => {
            if !v.pass {
                problems.push(format!("false alarm: {}", v.message));
            }
        }
        (Some(_), Some(n)) => {
            let lacks = match n {
                Need::LargeQAbs => q_abs_large.map(|(_, large)| !large),
                Need::F32 => Some(c.dtype != Dtype::F32),
                _ => cfg
                    .as_ref()
                    .ok()
                    .and_then(|cfg| n.met(cfg, &c.sched).map(|m| !m)),
            };
            if lacks != Some(true) {
                problems.push(format!("the control run does not lack {}", n.name()));
            }
            if !v.pass {
                problems.push(format!(
                    "detected without {}: the need is not real ({})",
                    n.name(),
                    v.message
                ));
            }
        }
        (Some(f), None) => {
            let info = f.info();
            if clean.is_none_or(|r| !r.verdict.pass) {
                problems
                    .push("the clean run of this setup fails, so detection proves nothing".into());
            }
            if let Ok(cfg) = &cfg {
                for n in info.needs {
                    if n.met(cfg, &c.sched) == Some(false) {
                        problems.push(format!("the run lacks what the fault needs: {}", n.name()));
                    }
                }
            }
            if info.needs.contains(&Need::LargeQAbs) {
                if let Some((r, false)) = q_abs_large {
                    problems.push(format!(
                        "q_absorbed rms {r:.3e} is within the fp16 range: no overflow to expose"
                    ));
                }
            }
            if v.pass {
                problems.push("not detected".into());
            } else {
                if v.first_layer != Some(TARGET) {
                    problems.push(format!(
                        "attributed to layer {:?}, injected into layer {TARGET}",
                        v.first_layer
                    ));
                }
                if v.first_check.as_deref() != Some(info.expected) {
                    problems.push(format!(
                        "first diverging check {:?}, expected {}: {}",
                        v.first_check.as_deref().unwrap_or("-"),
                        info.expected,
                        v.reasons.join("; ")
                    ));
                }
                let others: Vec<usize> = shadow
                    .layers
                    .iter()
                    .filter(|l| l.layer != TARGET && !l.pass)
                    .map(|l| l.layer)
                    .collect();
                if !others.is_empty() {
                    problems.push(format!(
                        "layers {others:?} fail too; only {TARGET} was injected"
                    ));
                }
            }
        }
    }
    Outcome {
        case: c.clone(),
        detected: !v.pass,
        first_layer: v.first_layer,
        first_check: v.first_check.clone(),
        margin: first.map(|ch| ch.ratio()),
        reason: v.reasons.join("; "),
        ok: problems.is_empty(),
        problems,
    }
}

/// The rms of the reference q_absorbed in the target layer of a report (the exposure of fp16 overflow).
fn q_abs_rms(r: &Report) -> Option<f64> {
    r.modes[0]
        .layers
        .iter()
        .find(|l| l.layer == TARGET)?
        .checks
        .iter()
        .find(|c| c.check == "q_absorbed")
        .map(|c| c.metrics.ref_rms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_meet_static_needs() {
        for f in Fault::ALL {
            let c = Case::for_fault(f);
            c.sched.validate().unwrap();
            // Model needs are checked against the fixture in `judge`; here the schedule needs.
            for n in f.info().needs {
                let cfg = crate::model::synthetic::Family::DeepseekV3.test_config();
                if matches!(
                    n,
                    Need::Positions
                        | Need::Prefill
                        | Need::Decode
                        | Need::MultiSplit
                        | Need::PageCrossing
                        | Need::EndInsidePage
                ) {
                    assert_eq!(n.met(&cfg, &c.sched), Some(true), "{f}: {}", n.name());
                }
            }
        }
    }
}
