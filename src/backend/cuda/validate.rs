//! `mla-diff gpu-validate`: the CUDA path against the CPU mirror (same algorithm: agreement at rounding
//! level) and the fp64 reference (the calibrated tolerance table), every stage, on synthetic layers with
//! real model dims, over schedules that cross page and split boundaries.
//!
//! The GPU runs are serial; the CPU work (reference and mirror of every case) runs on all cores at once,
//! so a whole sweep fits a short lease.

use super::{CudaBackend, CudaOptions};
use crate::backend::cpu::CpuMirror;
use crate::backend::{Backend, Dtype};
use crate::compare::{self, metrics, ToleranceTable};
use crate::error::{Error, Result};
use crate::model::synthetic::{self, Family};
use crate::model::{LayerWeights, MlaConfig};
use crate::rope::RopeTables;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage};
use std::fmt::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ValidateArgs {
    /// Storage types to run.
    #[arg(long, value_delimiter = ',', default_value = "bf16,f16")]
    pub dtype: Vec<Dtype>,
    /// Only the small cases (a quick smoke test).
    #[arg(long)]
    pub quick: bool,
    /// Read the kernel sources from this directory instead of the embedded copy.
    #[arg(long)]
    pub kernels: Option<PathBuf>,
    /// Write the per-case, per-stage figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// CPU threads for the reference and the mirror (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// One validation case: a layer shape and a schedule.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub family: Family,
    pub hidden: Option<usize>,
    pub heads: Option<usize>,
    pub q_lora: Option<usize>,
    pub sched: Schedule,
}

fn sched(prompt: usize, chunk: usize, steps: usize, q_len: usize, page: usize, splits: usize) -> Schedule {
    Schedule {
        prompt_len: prompt,
        chunk,
        decode_steps: steps,
        q_len,
        page_size: page,
        num_splits: splits,
        shuffle_seed: Some(prompt as u64 * 31 + steps as u64),
        spare_pages: 3,
        pos_offset: 0,
    }
}

/// The sweep. Full model dims at short schedules; reduced hidden/heads (attention dims unchanged) at
/// long ones, so the fp64 reference stays cheap. Every case crosses page and split boundaries.
pub fn cases(quick: bool) -> Vec<Case> {
    let c = |name: &str, family, hidden, heads, q_lora, s| Case {
        name: name.into(),
        family,
        hidden,
        heads,
        q_lora,
        sched: s,
    };
    let mut v = vec![
        c("deepseek-v3 full dims", Family::DeepseekV3, None, None, None, sched(40, 16, 64, 1, 16, 4)),
        c("glm-5 full dims, MTP q_len 2", Family::Glm5, None, None, None, sched(37, 16, 64, 2, 16, 3)),
        c("minicpm3 full dims", Family::Minicpm3, None, None, None, sched(45, 20, 64, 1, 16, 4)),
        c("deepseek-v3 dims, prompt 1", Family::DeepseekV3, Some(512), Some(16), Some(256), sched(1, 1, 70, 1, 16, 4)),
    ];
    if !quick {
        v.extend([
            c("deepseek-v3 dims H16, prompt 2048", Family::DeepseekV3, Some(1024), Some(16), Some(512), sched(2048, 512, 64, 1, 64, 8)),
            c("glm-5 dims H8, prompt 777, q_len 2", Family::Glm5, Some(1024), Some(8), Some(512), sched(777, 256, 64, 2, 32, 5)),
            c("minicpm3 dims, prompt 1500", Family::Minicpm3, Some(1024), None, Some(384), sched(1500, 600, 64, 1, 64, 3)),
            c("deepseek-v3 dims H128, prompt 300", Family::DeepseekV3, Some(1024), None, Some(512), sched(300, 128, 64, 1, 64, 4)),
        ]);
    }
    v
}

pub fn case_layer(c: &Case) -> (MlaConfig, LayerWeights) {
    let mut d = c.family.full_dims();
    if let Some(h) = c.hidden {
        d.hidden = h;
    }
    if let Some(h) = c.heads {
        d.n_head = h;
    }
    if c.q_lora.is_some() {
        d.q_lora = c.q_lora;
    }
    let cfg = c.family.config(d);
    let w = synthetic::weights(&cfg, 1234);
    (cfg, w)
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
        let m = mr.iter().find(|m| m.stage == c.stage).map(|m| m.rel_l2).unwrap_or(0.0);
        let bound = m.max(0.25 * ulp);
        if c.nonfinite_mismatch > 0 {
            bad.push(format!("{}: {} non-finite mismatches vs the mirror", c.stage, c.nonfinite_mismatch));
        } else if !(c.rel_l2 <= bound) {
            bad.push(format!("{}: rel-L2 vs mirror {:.2e} > {:.2e} (mirror vs reference)", c.stage, c.rel_l2, bound));
        }
    }
    bad
}

pub fn run(a: &ValidateArgs) -> Result<i32> {
    let opts = |dt, scalar| CudaOptions {
        dtype: dt,
        kernels_dir: a.kernels.clone(),
        debug: true,
        force_scalar: scalar,
    };
    let mut cuda = CudaBackend::new(opts(Dtype::Bf16, false))?;
    let mut scalar = CudaBackend::new(opts(Dtype::Bf16, true))?;
    println!("{}", cuda.describe());
    let tols = ToleranceTable::defaults();
    let cases = cases(a.quick);

    // 1. GPU: every case and dtype, tensor-core and scalar kernels.
    struct GpuOut {
        ci: usize,
        dt: Dtype,
        mma: LayerTrace,
        sc: LayerTrace,
        ms: f64,
        paths: String,
    }
    let mut gpu_out = Vec::new();
    let mut layers = Vec::new();
    for (ci, c) in cases.iter().enumerate() {
        let (cfg, w) = case_layer(c);
        let x = crate::input::random_hidden(cfg.hidden, c.sched.total_tokens(), 77 + ci as u64);
        for &dt in &a.dtype {
            cuda.opts.dtype = dt;
            scalar.opts.dtype = dt;
            let t = std::time::Instant::now();
            let mma = cuda.run_layer(&cfg, &w, &x, &c.sched)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let sc = scalar.run_layer(&cfg, &w, &x, &c.sched)?;
            gpu_out.push(GpuOut {
                ci,
                dt,
                mma,
                sc,
                ms,
                paths: cuda.last_paths.clone(),
            });
            eprintln!("gpu: {} {} done ({ms:.0} ms)", c.name, dt.name());
        }
        layers.push((cfg, w, x));
    }

    // 2. CPU: reference per case, mirror per case and dtype, in parallel.
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2));
    let mut jobs: Vec<(usize, Option<Dtype>)> = Vec::new();
    for ci in 0..cases.len() {
        jobs.push((ci, None));
        for &dt in &a.dtype {
            jobs.push((ci, Some(dt)));
        }
    }
    let results: std::sync::Mutex<Vec<(usize, Option<Dtype>, Result<LayerTrace>)>> = std::sync::Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()).max(1) {
            s.spawn(|| loop {
                let j = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(&(ci, dt)) = jobs.get(j) else { break };
                let (cfg, w, x) = &layers[ci];
                let sched = &cases[ci].sched;
                let r = match dt {
                    None => RopeTables::for_run(cfg, None, sched.pos_offset, sched.total_tokens())
                        .and_then(|rt| crate::reference::run_layer(cfg, w, &rt, x, sched)),
                    Some(dt) => CpuMirror::new(dt).run_layer(cfg, w, x, sched),
                };
                eprintln!("cpu: {} {} done", cases[ci].name, dt.map(|d| d.name()).unwrap_or("fp64 reference"));
                results.lock().unwrap().push((ci, dt, r));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    let mut take = |ci: usize, dt: Option<Dtype>| -> Result<LayerTrace> {
        let i = results
            .iter()
            .position(|(c, d, _)| *c == ci && *d == dt)
            .ok_or_else(|| Error::Environment("missing CPU result".into()))?;
        results.swap_remove(i).2
    };
    let mut refs: Vec<Option<LayerTrace>> = (0..cases.len()).map(|_| None).collect();
    for (ci, slot) in refs.iter_mut().enumerate() {
        *slot = Some(take(ci, None)?);
    }

    // 3. Compare.
    let mut out = Vec::new();
    let mut text = String::new();
    for g in gpu_out {
        let c = &cases[g.ci];
        let (cfg, _, _) = &layers[g.ci];
        let reference = refs[g.ci].as_ref().unwrap();
        let mirror = take(g.ci, Some(g.dt))?;
        let table = c.sched.block_table();
        let ctx = compare::Ctx {
            layer: 0,
            sched: &c.sched,
            block_table: &table,
        };
        let lr = compare::compare_layer(&ctx, reference, &g.mma, g.dt, &tols)?;
        let cm = figs(&g.mma, &mirror);
        let mr = figs(&mirror, reference);
        let mut failures = rounding_level(g.dt, &cm, &mr);
        for ch in lr.checks.iter().filter(|c| !c.pass) {
            failures.push(format!("vs reference {}: {}", ch.check, ch.reasons.join("; ")));
        }
        // The scalar kernels compute the same function: they must also pass against the reference.
        let lr_s = compare::compare_layer(&ctx, reference, &g.sc, g.dt, &tols)?;
        for ch in lr_s.checks.iter().filter(|c| !c.pass) {
            failures.push(format!("scalar kernels vs reference {}: {}", ch.check, ch.reasons.join("; ")));
        }
        let s = &c.sched;
        let res = CaseResult {
            case: c.name.clone(),
            dtype: g.dt.name().into(),
            dims: format!(
                "E={} H={} q_lora={:?} Lkv={} R={} P={} Dv={} rope={:?}",
                cfg.hidden, cfg.n_head, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope, cfg.qk_nope, cfg.v_head_dim, cfg.rope.pairing
            ),
            schedule: format!(
                "prompt {} chunk {} decode {}x{} page {} splits {}",
                s.prompt_len, s.chunk, s.decode_steps, s.q_len, s.page_size, s.num_splits
            ),
            kernels: g.paths.clone(),
            pass: failures.is_empty(),
            verdict: compare::verdict(&[lr]).message,
            failures,
            cuda_vs_mirror: cm,
            cuda_vs_ref: figs(&g.mma, reference),
            mirror_vs_ref: mr,
            mma_vs_scalar: figs(&g.mma, &g.sc),
            gpu_ms: g.ms,
        };
        writeln!(text, "\n== {} [{}] {} | {} | {}", res.case, res.dtype, res.dims, res.schedule, res.kernels).unwrap();
        writeln!(text, "   {:<12} {:>12} {:>12} {:>12} {:>12}", "stage", "cuda~mirror", "cuda~ref", "mirror~ref", "mma~scalar").unwrap();
        for f in &res.cuda_vs_mirror {
            let get = |v: &[StageFig]| v.iter().find(|x| x.stage == f.stage).map(|x| x.rel_l2).unwrap_or(f64::NAN);
            writeln!(
                text,
                "   {:<12} {:>12.2e} {:>12.2e} {:>12.2e} {:>12.2e}{}",
                f.stage,
                f.rel_l2,
                get(&res.cuda_vs_ref),
                get(&res.mirror_vs_ref),
                get(&res.mma_vs_scalar),
                if f.nonfinite_mismatch > 0 { format!("  ({} non-finite mismatches)", f.nonfinite_mismatch) } else { String::new() }
            )
            .unwrap();
        }
        writeln!(text, "   {}: {}", if res.pass { "PASS" } else { "FAIL" }, res.verdict).unwrap();
        for f in &res.failures {
            writeln!(text, "   - {f}").unwrap();
        }
        out.push(res);
    }
    let n_fail = out.iter().filter(|r| !r.pass).count();
    print!("{text}");
    println!("\ngpu-validate: {} of {} case runs pass (rel-L2 per stage: CUDA vs mirror / vs fp64 reference)", out.len() - n_fail, out.len());
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&out).expect("json")).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(if n_fail == 0 { 0 } else { 1 })
}
