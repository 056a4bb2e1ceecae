//! The bench session (a GPU, the kernels, the ceilings, the peers) and what a timed case yields.

use super::measure::{rel_l2, rel_l2_vs_bits, time_us, Filler};
use super::BenchRow;
use crate::backend::cuda::blas::{Blas, GemmPrecision};
use crate::backend::cuda::device::{DevBuf, Gpu};
use crate::backend::cuda::kernels::Kernels;
use crate::backend::cuda::nvrtc::Sources;
use crate::backend::runner::tensors::Named;
use crate::error::Result;
use crate::model::catalogue::Preset;
use crate::precision::Dtype;
use crate::tiles::Dims;
use crate::tools::peers::Peer;
use cudarc::cublas::sys::cublasOperation_t as Op;
use serde::Serialize;
use std::fmt::Write;

/// One timed output: one of our configurations, or a peer's kernel.
#[derive(Debug, Clone, Serialize)]
pub struct Timed {
    /// Our configuration's label, or the peer's name (`--peers` key).
    pub config: String,
    pub median_us: f64,
    pub min_us: f64,
    /// Against our scalar kernel's output on the same inputs.
    pub rel_l2_vs_scalar: f64,
    pub non_finite: usize,
    /// A peer's output against our fastest correct configuration's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rel_l2_vs_ours: Option<f64>,
    /// Finite everywhere and within four unit roundoffs of the storage type (rel-L2) of the scalar
    /// kernel: the tolerance's elementwise base (calibrate::base_rtol).
    pub correct: bool,
}

impl Timed {
    fn check(&self) -> String {
        let ours = self
            .rel_l2_vs_ours
            .map(|r| format!("; vs ours: rel-L2 {r:.2e}"))
            .unwrap_or_default();
        format!(
            "vs scalar kernel: rel-L2 {:.2e}, non-finite {}{ours}{}",
            self.rel_l2_vs_scalar,
            self.non_finite,
            if self.correct { "" } else { " WRONG" }
        )
    }
}

/// A peer's result on one case.
#[derive(Debug, Clone, Serialize)]
pub struct PeerTimed {
    /// The `--peers` key (`flashmla`, `vllm-triton`, `torch`).
    pub peer: String,
    /// The runner's name and version line (torch's names its SDPA backend).
    pub name: String,
    pub version: String,
    #[serde(flatten)]
    pub timed: Timed,
}

/// One shape, one dtype: every configuration of ours that ran, the peers, and what could not run.
pub struct CaseResult {
    pub kernel: &'static str,
    pub shape: String,
    pub bytes: f64,
    pub flops: f64,
    pub ours: Vec<Timed>,
    pub peers: Vec<PeerTimed>,
    pub notes: Vec<String>,
}

impl CaseResult {
    /// Our fastest configuration whose output is correct.
    pub fn best(&self) -> Option<&Timed> {
        self.ours
            .iter()
            .filter(|t| t.correct)
            .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
    }
}

/// A decode shape at DeepSeek-V3's latent dims (512 + 64): batch, heads, keys per request, page size.
#[derive(Debug, Clone, Copy)]
pub struct DecodeCase {
    pub bsz: usize,
    pub h: usize,
    pub s: usize,
    pub page: usize,
    pub dt: Dtype,
}

/// A GPU, the kernels, the ceilings measured once, and the peers started once (importing torch and
/// initialising CUDA once); one that cannot start is noted in `log`.
pub struct Session {
    pub gpu: Gpu,
    blas: Blas,
    pub k: Kernels,
    fillers: Vec<(Dtype, Filler)>,
    pub copy_gbps: f64,
    pub matmul_tflops: f64,
    pub peers: Vec<(String, Peer)>,
    /// Back-to-back launches per timed sample, ours and the peers' (`meta.bench.launches`) alike, so a
    /// ratio near 1x compares kernels rather than host dispatch latencies (set before timing).
    pub launches: usize,
    /// What the run printed so far (GPU, ceilings, peers, skipped tiles, ratios).
    pub log: String,
}

pub(super) fn v3_dims(dt: Dtype) -> Dims {
    let v3 = Preset::DeepseekV3.entry();
    Dims {
        dtype: dt,
        lkv: v3.kv_lora,
        r: v3.qk_rope,
        p: v3.qk_nope,
        dv: v3.v_head,
        h: v3.heads,
        page: 64,
        neox: false,
        debug: false,
        faults: crate::faults::Active::NONE,
    }
}

impl Session {
    pub fn open(kernels_dir: Option<&std::path::Path>, peers: &[String]) -> Result<Session> {
        let gpu = Gpu::open()?;
        let blas = Blas::new()?;
        let k = Kernels::new(Sources::load(kernels_dir)?, &gpu);
        let mut s = Session {
            gpu,
            blas,
            k,
            fillers: Vec::new(),
            copy_gbps: 0.0,
            matmul_tflops: 0.0,
            peers: Vec::new(),
            launches: 1,
            log: String::new(),
        };
        let info = &s.gpu.info;
        writeln!(
            s.log,
            "GPU: {} (sm_{}{}, {} SMs, {:.0} GiB), driver {}",
            info.name,
            info.cc.0,
            info.cc.1,
            info.sms,
            info.total_mem as f64 / (1u64 << 30) as f64,
            info.driver_version
        )
        .unwrap();
        s.ceilings()?;
        for p in peers {
            match Peer::start(p) {
                Ok(peer) => {
                    writeln!(s.log, "peer {}: {}", peer.desc.name, peer.desc.version).unwrap();
                    s.peers.push((p.clone(), peer));
                }
                Err(e) => writeln!(s.log, "peer {p}: not timed: {e}").unwrap(),
            }
        }
        Ok(s)
    }

    pub(super) fn filler(&mut self, dt: Dtype) -> Result<Filler> {
        if let Some((_, f)) = self.fillers.iter().find(|(d, _)| *d == dt) {
            return Ok(f.clone());
        }
        let f = Filler::new(&mut self.k, &v3_dims(dt))?;
        self.fillers.push((dt, f.clone()));
        Ok(f)
    }

    /// A device-to-device copy (2 GiB, read + written) and a cuBLAS bf16 8192³ GEMM, medians of 20.
    fn ceilings(&mut self) -> Result<()> {
        let filler = self.filler(Dtype::Bf16)?;
        let copy_bytes = 1usize << 31;
        let a = DevBuf::alloc(copy_bytes)?;
        let b = DevBuf::alloc(copy_bytes)?;
        filler.fill(&a, copy_bytes / 2, 1, 1.0)?;
        let (copy_us, _) = time_us(3, 20, 1, || {
            unsafe {
                cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                    b.ptr,
                    a.ptr,
                    copy_bytes,
                    std::ptr::null_mut(),
                )
            }
            .result()
            .map_err(crate::backend::cuda::device::drv_err("cuMemcpyDtoD"))
        })?;
        drop((a, b));
        self.copy_gbps = 2.0 * copy_bytes as f64 / (copy_us * 1e-6) / 1e9;
        let nm = 8192usize;
        let ga = DevBuf::alloc(nm * nm * 2)?;
        let gb = DevBuf::alloc(nm * nm * 2)?;
        let gc = DevBuf::alloc(nm * nm * 2)?;
        filler.fill(&ga, nm * nm, 2, 1.0)?;
        filler.fill(&gb, nm * nm, 3, 1.0)?;
        let blas = &self.blas;
        let (mm_us, _) = time_us(3, 20, 1, || {
            blas.batched(
                GemmPrecision::Storage(Dtype::Bf16),
                Op::CUBLAS_OP_N,
                nm,
                nm,
                nm,
                ga.ptr,
                nm,
                0,
                gb.ptr,
                nm,
                0,
                gc.ptr,
                nm,
                0,
                1,
            )
        })?;
        drop((ga, gb, gc));
        self.matmul_tflops = 2.0 * (nm as f64).powi(3) / (mm_us * 1e-6) / 1e12;
        writeln!(self.log, "ceilings: device-to-device copy {:.0} GB/s (read+write, 2 GiB, median of 20); cuBLAS bf16 8192^3 GEMM {:.1} TFLOP/s (random data, median of 20)", self.copy_gbps, self.matmul_tflops).unwrap();
        Ok(())
    }

    /// A bench row of `t` at `c`'s byte and FLOP counts, against this session's ceilings.
    pub fn row(&self, c: &CaseResult, t: &Timed, config: String) -> BenchRow {
        let (bytes, flops, med) = (c.bytes, c.flops, t.median_us);
        BenchRow {
            kernel: c.kernel.into(),
            shape: c.shape.clone(),
            config,
            median_us: med,
            min_us: t.min_us,
            gbps: bytes / (med * 1e-6) / 1e9,
            tflops: flops / (med * 1e-6) / 1e12,
            pct_copy_bw: 100.0 * bytes / (med * 1e-6) / 1e9 / self.copy_gbps,
            pct_matmul: 100.0 * flops / (med * 1e-6) / 1e12 / self.matmul_tflops,
            check: t.check(),
        }
    }

    /// Every row of a case: ours, then the peers (`peer NAME`).
    pub fn rows(&self, c: &CaseResult) -> Vec<BenchRow> {
        let mut v: Vec<BenchRow> = c
            .ours
            .iter()
            .map(|t| self.row(c, t, t.config.clone()))
            .collect();
        v.extend(
            c.peers
                .iter()
                .map(|p| self.row(c, &p.timed, format!("peer {}", p.name))),
        );
        v
    }

    pub(super) fn timed(
        config: String,
        (med, min): (f64, f64),
        got: &[u16],
        want: &[u16],
        dt: Dtype,
    ) -> Timed {
        let (err, bad) = rel_l2(got, want, dt);
        Timed {
            config,
            median_us: med,
            min_us: min,
            rel_l2_vs_scalar: err,
            non_finite: bad,
            rel_l2_vs_ours: None,
            correct: bad == 0 && err <= crate::calibrate::base_rtol(dt),
        }
    }

    /// The peers' kernels for `op` on `inputs`; each output checked against the scalar kernel's
    /// (`want`) and our fastest correct configuration's.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn time_peers(
        &mut self,
        c: &mut CaseResult,
        op: &'static str,
        inputs: &[Named],
        meta: &serde_json::Value,
        out_name: &str,
        shape: &[usize],
        want: &[u16],
        ours_out: Option<&[u16]>,
        dt: Dtype,
    ) {
        for (key, peer) in self.peers.iter_mut() {
            if !peer.has(op) {
                continue;
            }
            let name = peer.desc.name.clone();
            match peer.time_op(op, inputs, meta, out_name, shape) {
                Ok((tm, out)) => {
                    let (err, bad) = rel_l2_vs_bits(&out, want, dt);
                    c.peers.push(PeerTimed {
                        peer: key.clone(),
                        name: name.clone(),
                        version: peer.desc.version.clone(),
                        timed: Timed {
                            config: key.clone(),
                            median_us: tm.median,
                            min_us: tm.min,
                            rel_l2_vs_scalar: err,
                            non_finite: bad,
                            rel_l2_vs_ours: ours_out.map(|o| rel_l2_vs_bits(&out, o, dt).0),
                            correct: bad == 0 && err <= crate::calibrate::base_rtol(dt),
                        },
                    });
                    if let Some(b) = c.best() {
                        c.notes.push(format!(
                            "{}: ours ({}) {:.1} us vs {name} {:.1} us: ours takes {:.2}x the peer's time",
                            c.shape,
                            b.config,
                            b.median_us,
                            tm.median,
                            b.median_us / tm.median
                        ));
                    }
                }
                Err(e) => c.notes.push(format!("{}: peer {name}: {e}", c.shape)),
            }
        }
    }

    /// The text table of `rows` (the format `bench decode|prefill` print).
    pub fn table_text(rows: &[BenchRow]) -> String {
        let mut out = String::new();
        writeln!(
            out,
            "\n{:<8} {:<42} {:<44} {:>9} {:>8} {:>8} {:>7} {:>8} {:>7}  check",
            "kernel",
            "shape",
            "config",
            "median us",
            "GB/s",
            "%copy",
            "TFLOP/s",
            "%matmul",
            "min us"
        )
        .unwrap();
        for r in rows {
            writeln!(
                out,
                "{:<8} {:<42} {:<44} {:>9.1} {:>8.0} {:>7.1}% {:>7.1} {:>7.1}% {:>7.1}  {}",
                r.kernel,
                r.shape,
                r.config,
                r.median_us,
                r.gbps,
                r.pct_copy_bw,
                r.tflops,
                r.pct_matmul,
                r.min_us,
                r.check
            )
            .unwrap();
        }
        out
    }
}
