//! The work of a `gpu-validate` sweep as jobs on a pool of threads: the CUDA runs of each case and
//! dtype (tensor-core and scalar kernels), the fp64 reference of each case, the CPU mirror of each case
//! and dtype. The GPU jobs go first (their NVRTC compiles run in parallel too), then the CPU jobs,
//! longest cases first, so a whole sweep fits a short lease.

use super::{Case, Options};
use crate::backend::cpu::CpuMirror;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::{Backend, RunTables};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::rope::RopeTables;
use crate::trace::LayerTrace;
use ndarray::Array2;

/// A case's synthetic layer and its input.
pub(super) type Layer = (MlaConfig, LayerWeights, Array2<f64>, Option<RopeFactors>);

/// One unit of work of the sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Job {
    /// CUDA (tensor-core and scalar kernels) for a case and dtype.
    Gpu(usize, Dtype),
    /// The fp64 reference of a case.
    Reference(usize),
    /// The CPU mirror of a case in a dtype.
    Mirror(usize, Dtype),
}

impl Job {
    fn case(self) -> usize {
        match self {
            Job::Gpu(c, _) | Job::Reference(c) | Job::Mirror(c, _) => c,
        }
    }
}

enum JobOut {
    Gpu(GpuRes),
    Cpu(LayerTrace),
}

/// What the CUDA backends computed for a case in a dtype.
pub(super) struct GpuRes {
    pub mma: LayerTrace,
    pub sc: LayerTrace,
    pub ms: f64,
    pub paths: String,
    /// What src/tiles/choice.rs (and so `lint --backend cuda`) says the layer launches.
    pub planned: String,
    pub dt: Dtype,
}

/// Both GPU backends run with `debug` on: every stage.
pub(super) fn cuda_options(a: &Options, dt: Dtype, scalar: bool) -> CudaOptions {
    CudaOptions {
        dtype: dt,
        kernels_dir: a.kernels.clone(),
        debug: true,
        force_scalar: scalar,
    }
}

/// Layers and inputs, built in parallel.
pub(super) fn layers(cases: &[Case]) -> Vec<Layer> {
    std::thread::scope(|s| {
        let hs: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(ci, c)| {
                s.spawn(move || {
                    let (cfg, w, rf) = super::case_layer(c);
                    let x = crate::input::random_hidden(
                        cfg.hidden,
                        c.sched.total_tokens(),
                        77 + ci as u64,
                    );
                    (cfg, w, x, rf)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("layer generation"))
            .collect()
    })
}

/// The results of every job, taken one by one as the comparison needs them.
pub(super) struct Results(Vec<(Job, Result<JobOut>)>);

impl Results {
    fn take(&mut self, job: Job) -> Result<JobOut> {
        let i = self
            .0
            .iter()
            .position(|(j, _)| *j == job)
            .ok_or_else(|| Error::Environment(format!("missing result of {job:?}")))?;
        self.0.swap_remove(i).1
    }
    pub fn cpu(&mut self, job: Job) -> Result<LayerTrace> {
        match self.take(job)? {
            JobOut::Cpu(t) => Ok(t),
            JobOut::Gpu(_) => unreachable!("CPU job"),
        }
    }
    pub fn gpu(&mut self, ci: usize, dt: Dtype) -> Result<GpuRes> {
        match self.take(Job::Gpu(ci, dt))? {
            JobOut::Gpu(g) => Ok(g),
            JobOut::Cpu(_) => unreachable!("GPU job"),
        }
    }
}

/// Every job of the sweep, on `threads` workers; each job's time (or error) is one line on stderr.
pub(super) fn run_all(a: &Options, cases: &[Case], layers: &[Layer], threads: usize) -> Results {
    let mut jobs: Vec<Job> = Vec::new();
    for ci in 0..cases.len() {
        for &dt in &a.dtype {
            jobs.push(Job::Gpu(ci, dt));
        }
    }
    let mut order: Vec<usize> = (0..cases.len()).collect();
    order.sort_by_key(|&ci| {
        std::cmp::Reverse(cases[ci].sched.prompt_len * cases[ci].sched.prompt_len)
    });
    for &ci in &order {
        jobs.push(Job::Reference(ci));
        for &dt in &a.dtype {
            jobs.push(Job::Mirror(ci, dt));
        }
    }
    let results: std::sync::Mutex<Vec<(Job, Result<JobOut>)>> = std::sync::Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| {
                let mut gpu: Option<(CudaBackend, CudaBackend)> = None;
                loop {
                    let j = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some(&job) = jobs.get(j) else { break };
                    let t = std::time::Instant::now();
                    let out = match job {
                        Job::Gpu(ci, dt) => gpu_job(a, &mut gpu, &cases[ci], &layers[ci], dt),
                        Job::Reference(ci) => reference_job(&cases[ci], &layers[ci]),
                        Job::Mirror(ci, dt) => mirror_job(&cases[ci], &layers[ci], dt),
                    };
                    eprintln!(
                        "{:?} {} ({:.1} s){}",
                        job,
                        cases[job.case()].name,
                        t.elapsed().as_secs_f64(),
                        out.as_ref()
                            .err()
                            .map(|e| format!(": ERROR {e}"))
                            .unwrap_or_default()
                    );
                    results.lock().unwrap().push((job, out));
                }
            });
        }
    });
    Results(results.into_inner().unwrap())
}

/// The case through the tensor-core and the scalar kernels (the worker's two backends, made on its
/// first GPU job), with what the host's kernel plan says should have launched.
fn gpu_job(
    a: &Options,
    gpu: &mut Option<(CudaBackend, CudaBackend)>,
    case: &Case,
    (cfg, w, x, rf): &Layer,
    dt: Dtype,
) -> Result<JobOut> {
    if gpu.is_none() {
        *gpu = Some((
            CudaBackend::new(cuda_options(a, dt, false))?,
            CudaBackend::new(cuda_options(a, dt, true))?,
        ));
    }
    let (cu, sc) = gpu.as_mut().unwrap();
    for b in [&mut *cu, &mut *sc] {
        b.opts.dtype = dt;
    }
    let sched = &case.sched;
    let tables = RunTables::new(cfg, rf.as_ref(), sched)?;
    let ctx = tables.ctx(cfg, w, sched, Active::NONE);
    let t = std::time::Instant::now();
    let mma = cu.run_layer(&ctx, x)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let sct = sc.run_layer(&ctx, x)?;
    let dims = crate::tiles::Dims {
        dtype: dt,
        lkv: cfg.kv_lora_rank,
        r: cfg.qk_rope,
        p: cfg.qk_nope,
        dv: cfg.v_head_dim,
        h: cfg.n_head,
        page: sched.page_size,
        neox: false,
        debug: false,
        faults: Active::NONE,
    };
    let info = &cu.gpu.info;
    Ok(JobOut::Gpu(GpuRes {
        mma,
        sc: sct,
        ms,
        paths: cu.last_paths.clone(),
        planned: crate::tiles::choice::paths(
            &dims,
            sched.q_len * cfg.n_head,
            &info.arch(),
            info.smem_optin,
        ),
        dt,
    }))
}

fn reference_job(case: &Case, (cfg, w, x, rf): &Layer) -> Result<JobOut> {
    let sched = &case.sched;
    let rt = RopeTables::for_run(cfg, rf.as_ref(), sched.pos_offset, sched.total_tokens())?;
    Ok(JobOut::Cpu(crate::reference::run_layer(
        cfg, w, &rt, x, sched,
    )?))
}

fn mirror_job(case: &Case, (cfg, w, x, rf): &Layer, dt: Dtype) -> Result<JobOut> {
    let sched = &case.sched;
    let tables = RunTables::new(cfg, rf.as_ref(), sched)?;
    Ok(JobOut::Cpu(
        CpuMirror::new(dt).run_layer(&tables.ctx(cfg, w, sched, Active::NONE), x)?,
    ))
}
