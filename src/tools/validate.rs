//! `mla-diff gpu-validate`: the CUDA path against the CPU mirror (same algorithm: agreement at rounding
//! level) and the fp64 reference (the calibrated tolerance table), every stage, on synthetic layers with
//! real model dims, over schedules that cross page and split boundaries.
//!
//! The GPU runs are serial; the CPU work (reference and mirror of every case) runs on all cores at once,
//! so a whole sweep fits a short lease.

use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::compare::{self, metrics, ToleranceTable};
use crate::error::{Error, Result};
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::trace::{LayerTrace, Stage};
use std::fmt::Write;
use std::path::PathBuf;

/// What `mla-diff gpu-validate` runs (its flags: `cli/gpu_validate.rs`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Storage types to run.
    pub dtype: Vec<Dtype>,
    /// Only the small cases (a quick smoke test).
    pub quick: bool,
    /// Read the kernel sources from this directory instead of the embedded copy.
    pub kernels: Option<PathBuf>,
    /// Write the per-case, per-stage figures as JSON here.
    pub json: Option<PathBuf>,
    /// Only the cases whose name contains this text.
    pub case: Option<String>,
    /// CPU threads for the reference and the mirror (default: all cores).
    pub threads: Option<usize>,
}

pub mod cases;
pub mod dgemm;
mod jobs;
pub use cases::{cases, Case, CaseSpec, CASES};
use jobs::{GpuRes, Job};

pub fn case_layer(c: &Case) -> (MlaConfig, LayerWeights, Option<RopeFactors>) {
    c.layer()
}

/// Per-stage figures of one comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageFig {
    pub stage: String,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub nonfinite_mismatch: usize,
}

fn figs(a: &LayerTrace, b: &LayerTrace) -> Vec<StageFig> {
    Stage::ALL
        .iter()
        .filter_map(|&s| {
            let (x, y) = (a.get(s)?, b.get(s)?);
            let nf = metrics::nonfinite(&x.data, &y.data);
            Some(StageFig {
                stage: s.name().into(),
                rel_l2: metrics::rel_l2(&x.data, &y.data),
                max_abs: metrics::max_abs_diff(&x.data, &y.data).0,
                nonfinite_mismatch: nf.mismatches,
            })
        })
        .collect()
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CaseResult {
    pub case: String,
    pub dtype: String,
    pub dims: String,
    pub schedule: String,
    pub kernels: String,
    pub pass: bool,
    pub verdict: String,
    pub failures: Vec<String>,
    /// CUDA vs CPU mirror.
    pub cuda_vs_mirror: Vec<StageFig>,
    /// CUDA vs fp64 reference.
    pub cuda_vs_ref: Vec<StageFig>,
    /// CPU mirror vs fp64 reference (the rounding noise the CUDA path should match).
    pub mirror_vs_ref: Vec<StageFig>,
    /// Tensor-core kernels vs the scalar CUDA kernels.
    pub mma_vs_scalar: Vec<StageFig>,
    pub gpu_ms: f64,
}

/// Agreement "at rounding level": per stage, CUDA may differ from the mirror by no more than the
/// mirror differs from the reference (plus a floor of a quarter ulp of the dtype for stages the mirror
/// reproduces exactly), and never in where values are finite.
fn rounding_level(dt: Dtype, cm: &[StageFig], mr: &[StageFig]) -> Vec<String> {
    let ulp = match dt {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::F32 => 2f64.powi(-24),
    };
    let mut bad = Vec::new();
    for c in cm {
        let m = mr
            .iter()
            .find(|m| m.stage == c.stage)
            .map(|m| m.rel_l2)
            .unwrap_or(0.0);
        let bound = m.max(0.25 * ulp);
        if c.nonfinite_mismatch > 0 {
            bad.push(format!(
                "{}: {} non-finite mismatches vs the mirror",
                c.stage, c.nonfinite_mismatch
            ));
        } else if c.rel_l2.is_nan() || c.rel_l2 > bound {
            bad.push(format!(
                "{}: rel-L2 vs mirror {:.2e} > {:.2e} (mirror vs reference)",
                c.stage, c.rel_l2, bound
            ));
        }
    }
    bad
}

/// Each stage of `got` (vs the reference) within twice the mirror's distance to the reference (floor:
/// a quarter ulp of the dtype), with no non-finite mismatch.
fn within_mirror_error(dt: Dtype, what: &str, got: &[StageFig], mr: &[StageFig]) -> Vec<String> {
    let ulp = match dt {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::F32 => 2f64.powi(-24),
    };
    let mut bad = Vec::new();
    for c in got {
        let m = mr
            .iter()
            .find(|m| m.stage == c.stage)
            .map(|m| m.rel_l2)
            .unwrap_or(0.0);
        let bound = (2.0 * m).max(0.25 * ulp);
        if c.nonfinite_mismatch > 0 {
            bad.push(format!(
                "{what} {}: {} non-finite mismatches",
                c.stage, c.nonfinite_mismatch
            ));
        } else if c.rel_l2.is_nan() || c.rel_l2 > bound {
            bad.push(format!(
                "{what} {}: rel-L2 {:.2e} > {:.2e} (2 x mirror vs reference)",
                c.stage, c.rel_l2, bound
            ));
        }
    }
    bad
}

pub fn run(a: &Options) -> Result<i32> {
    // Fail early and clearly when there is no GPU.
    println!(
        "{}",
        CudaBackend::new(jobs::cuda_options(a, Dtype::Bf16, false))?.describe()
    );
    let tols = ToleranceTable::defaults();
    let cases: Vec<Case> = cases(a.quick)
        .into_iter()
        .filter(|c| a.case.as_ref().is_none_or(|f| c.name.contains(f.as_str())))
        .collect();
    let threads = a
        .threads
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
        })
        .max(1);
    let layers = jobs::layers(&cases);
    let mut results = jobs::run_all(a, &cases, &layers, threads);

    // Compare.
    let mut out = Vec::new();
    let mut text = String::new();
    let mut errors = Vec::new();
    for (ci, c) in cases.iter().enumerate() {
        let reference = match results.cpu(Job::Reference(ci)) {
            Ok(r) => r,
            Err(e) => {
                errors.push(format!("{}: fp64 reference: {e}", c.name));
                continue;
            }
        };
        for &dt in &a.dtype {
            let g = match results.gpu(ci, dt) {
                Ok(g) => g,
                Err(e) => {
                    errors.push(format!("{} [{}]: CUDA: {e}", c.name, dt.name()));
                    continue;
                }
            };
            let mirror = match results.cpu(Job::Mirror(ci, dt)) {
                Ok(m) => m,
                Err(e) => {
                    errors.push(format!("{} [{}]: mirror: {e}", c.name, dt.name()));
                    continue;
                }
            };
            let res = judge_case(c, &layers[ci].0, g, &mirror, &reference, &tols)?;
            case_text(&res, &mut text);
            out.push(res);
        }
    }
    finish(a, &out, text, &errors)
}

/// One case in one dtype: CUDA at rounding level of the mirror, the kernels that ran the ones the
/// host's plan names, and the tensor-core and scalar kernels each within tolerance of fp64.
fn judge_case(
    c: &Case,
    cfg: &MlaConfig,
    g: GpuRes,
    mirror: &LayerTrace,
    reference: &LayerTrace,
    tols: &ToleranceTable,
) -> Result<CaseResult> {
    let table = c.sched.block_table();
    let ctx = compare::Ctx {
        elementwise: true,
        layer: 0,
        sched: &c.sched,
        block_table: &table,
        // Both GPU backends run with `debug` on: every stage.
        provided: crate::trace::StageSet::ALL,
    };
    let cm = figs(&g.mma, mirror);
    let mr = figs(mirror, reference);
    let cr = figs(&g.mma, reference);
    let sr = figs(&g.sc, reference);
    let mut failures = rounding_level(g.dt, &cm, &mr);
    // `lint --backend cuda` reports src/tiles/choice.rs's choice without a GPU: it must be what ran.
    if g.planned != g.paths {
        failures.push(format!(
            "kernel plan (src/tiles/choice.rs, what lint reports) says \"{}\", the backend launched \"{}\"",
            g.planned, g.paths
        ));
    }
    // Against the reference: the calibrated tolerance table when it covers this dtype; otherwise
    // (an uncalibrated table) each stage may be at most twice as far from the reference as the
    // mirror is: the same algorithm, so the same rounding error up to summation order.
    let verdict = match compare::compare_layer(&ctx, reference, &g.mma, g.dt, tols, None) {
        Ok(lr) => {
            for ch in lr.checks.iter().filter(|c| !c.pass) {
                failures.push(format!(
                    "vs reference {}: {}",
                    ch.check,
                    ch.reasons.join("; ")
                ));
            }
            // The scalar kernels compute the same function: they must pass too.
            let lr_s = compare::compare_layer(&ctx, reference, &g.sc, g.dt, tols, None)?;
            for ch in lr_s.checks.iter().filter(|c| !c.pass) {
                failures.push(format!(
                    "scalar kernels vs reference {}: {}",
                    ch.check,
                    ch.reasons.join("; ")
                ));
            }
            compare::verdict(&[lr]).message
        }
        Err(e) => {
            failures.extend(within_mirror_error(g.dt, "vs reference", &cr, &mr));
            failures.extend(within_mirror_error(
                g.dt,
                "scalar kernels vs reference",
                &sr,
                &mr,
            ));
            format!("tolerance table: {e}; criterion: per stage rel-L2(CUDA, reference) <= 2 x rel-L2(mirror, reference)")
        }
    };
    Ok(CaseResult {
        case: c.name.clone(),
        dtype: g.dt.name().into(),
        dims: format!(
            "E={} H={} q_lora={:?} Lkv={} R={} P={} Dv={} rope={:?}",
            cfg.hidden,
            cfg.n_head,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.qk_rope,
            cfg.qk_nope,
            cfg.v_head_dim,
            cfg.rope.pairing
        ),
        schedule: c.spec.sched_vars(),
        kernels: g.paths.clone(),
        pass: failures.is_empty(),
        verdict,
        failures,
        cuda_vs_mirror: cm,
        cuda_vs_ref: cr,
        mirror_vs_ref: mr,
        mma_vs_scalar: figs(&g.mma, &g.sc),
        gpu_ms: g.ms,
    })
}

/// A case's block of the printed report: a rel-L2 row per stage, the verdict, each failure.
fn case_text(res: &CaseResult, text: &mut String) {
    writeln!(
        text,
        "\n== {} [{}] {} | {} | {}",
        res.case, res.dtype, res.dims, res.schedule, res.kernels
    )
    .unwrap();
    writeln!(
        text,
        "   {:<12} {:>12} {:>12} {:>12} {:>12}",
        "stage", "cuda~mirror", "cuda~ref", "mirror~ref", "mma~scalar"
    )
    .unwrap();
    for f in &res.cuda_vs_mirror {
        let get = |v: &[StageFig]| {
            v.iter()
                .find(|x| x.stage == f.stage)
                .map(|x| x.rel_l2)
                .unwrap_or(f64::NAN)
        };
        writeln!(
            text,
            "   {:<12} {:>12.2e} {:>12.2e} {:>12.2e} {:>12.2e}{}",
            f.stage,
            f.rel_l2,
            get(&res.cuda_vs_ref),
            get(&res.mirror_vs_ref),
            get(&res.mma_vs_scalar),
            if f.nonfinite_mismatch > 0 {
                format!("  ({} non-finite mismatches)", f.nonfinite_mismatch)
            } else {
                String::new()
            }
        )
        .unwrap();
    }
    writeln!(
        text,
        "   {}: {}",
        if res.pass { "PASS" } else { "FAIL" },
        res.verdict
    )
    .unwrap();
    for f in &res.failures {
        writeln!(text, "   - {f}").unwrap();
    }
}

/// The fp64 products a CUDA run sends to the GPU (`dgemm`) against the host's, then the report, the
/// summary line, the JSON, and the exit code.
fn finish(a: &Options, out: &[CaseResult], mut text: String, errors: &[String]) -> Result<i32> {
    let (lines, dgemm_failures) = dgemm::validate()?;
    for l in &lines {
        writeln!(text, "{}{l}", if l.starts_with(' ') { "" } else { "\n== " }).unwrap();
    }
    let n_fail = out.iter().filter(|r| !r.pass).count() + dgemm_failures.len();
    print!("{text}");
    for e in errors {
        println!("ERROR {e}");
    }
    println!(
        "\ngpu-validate: {} of {} case runs pass, fp64 products {}, {} errors (rel-L2 per stage: CUDA vs mirror / vs fp64 reference)",
        out.iter().filter(|r| r.pass).count(),
        out.len(),
        if dgemm_failures.is_empty() { "OK" } else { "FAIL" },
        errors.len()
    );
    if !errors.is_empty() {
        return Err(Error::Environment(format!(
            "{} validation runs failed to run: {}",
            errors.len(),
            errors.join(" | ")
        )));
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&out).expect("json"))
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(if n_fail == 0 { 0 } else { 1 })
}
