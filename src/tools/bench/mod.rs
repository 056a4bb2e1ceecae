//! `mla-diff bench decode|prefill|table --backend cuda`: kernel-only time of the attention kernels (CUDA
//! events, warm-up, median of many), achieved GB/s and TFLOP/s, against ceilings measured in the same run:
//! a device-to-device copy (bytes read + written) and a cuBLAS bf16 8192³ GEMM.
//!
//! Byte and FLOP counts follow peer-kernels-h200.md so the numbers compare with the peers there:
//! decode bytes = B·S·(Lkv+R)·2 + B·H·(Lkv+R)·2 + B·H·Lkv·2, FLOPs = 2·B·H·S·((Lkv+R)+Lkv);
//! causal prefill FLOPs = H·T²·(dqk+dv) (half of the full T×T score matrix).

use super::peers::Peer;
use crate::backend::cuda::args::AttnArgs;
use crate::backend::cuda::attn::{Attn, PrefillLaunch};
use crate::backend::cuda::blas::{Blas, GemmPrecision};
use crate::backend::cuda::device::{arg, DevBuf, Gpu, Timer};
use crate::backend::cuda::kernels::{launch, Kernels};
use crate::backend::cuda::nvrtc::Sources;
use crate::backend::runner::tensors::{ints, Named};
use crate::error::Result;
use crate::model::catalogue::{Entry, Preset};
use crate::precision::Dtype;
use crate::tiles::{decode_tiles, prefill_tiles, Dims, Tile};
use cudarc::cublas::sys::cublasOperation_t as Op;
use serde::Serialize;
use std::fmt::Write;

#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub kernel: String,
    pub shape: String,
    pub config: String,
    pub median_us: f64,
    pub min_us: f64,
    pub gbps: f64,
    pub tflops: f64,
    pub pct_copy_bw: f64,
    pub pct_matmul: f64,
    pub check: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub gpu: String,
    pub copy_gbps: f64,
    pub matmul_tflops: f64,
    pub rows: Vec<BenchRow>,
    pub nvrtc_ms: f64,
    /// Back-to-back launches per timed sample (ours and the peers alike; see `Session::launches`).
    pub launches: usize,
}

pub struct BenchOptions {
    pub kernels_dir: Option<std::path::PathBuf>,
    pub decode: bool,
    pub prefill: bool,
    pub iters: usize,
    /// Decode head counts to time.
    pub decode_heads: Vec<usize>,
    /// Decode: only the first tile of each shape (the one `run` uses); prefill: only the wgmma tiles.
    pub best_only: bool,
    /// Other projects' decode kernels to time on the same inputs (`peers::command`).
    pub peers: Vec<String>,
    /// Back-to-back launches per timed sample (`Session::launches`).
    pub launches: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Time `f` (`warm` untimed runs, then `iters` samples of `launches` back-to-back runs between two
/// events, each divided by `launches`); returns (median, min) in µs per run. One launch per sample counts
/// the host's dispatch latency into the time; several keep the GPU's queue fed, as a graph replay would.
fn time_us(
    warm: usize,
    iters: usize,
    launches: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..warm {
        f()?;
    }
    let t = Timer::new()?;
    let n = launches.max(1);
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        t.start()?;
        for _ in 0..n {
            f()?;
        }
        v.push(t.stop_ms()? as f64 * 1e3 / n as f64);
    }
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    Ok((median(v), min))
}

#[derive(Clone)]
struct Filler {
    f: cudarc::driver::sys::CUfunction,
    _m: std::rc::Rc<crate::backend::cuda::kernels::Module>,
}

impl Filler {
    fn new(k: &mut Kernels, dims: &Dims) -> Result<Filler> {
        let m = k.module("fill.cu", dims.defines())?;
        Ok(Filler {
            f: m.func("fill_normal")?,
            _m: m,
        })
    }
    fn fill(&self, b: &DevBuf, n: usize, seed: u32, scale: f32) -> Result<()> {
        let n = n as i64;
        launch(
            self.f,
            "fill_normal",
            (1024, 1, 1),
            256,
            0,
            &mut [arg(&b.ptr), arg(&n), arg(&seed), arg(&scale)],
        )
    }
}

/// A 16-bit storage value (bf16 or fp16 bit pattern) as f64.
pub fn bits_to_f64(x: u16, dt: Dtype) -> f64 {
    match dt {
        Dtype::F16 => half::f16::from_bits(x).to_f64(),
        _ => half::bf16::from_bits(x).to_f64(),
    }
}

/// rel-L2 of `a` against `b` (both 16-bit bit patterns of `dt`) and the count of non-finite values in
/// either; a non-finite value is never a match.
fn rel_l2(a: &[u16], b: &[u16], dt: Dtype) -> (f64, usize) {
    let (mut num, mut den, mut bad) = (0.0, 0.0, 0);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (bits_to_f64(x, dt), bits_to_f64(y, dt));
        if !x.is_finite() || !y.is_finite() {
            bad += 1;
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    ((num / den.max(1e-300)).sqrt(), bad)
}

/// rel-L2 of `a` against `b` (16-bit bit patterns of `dt`) and the count of non-finite values in
/// either (never a match).
fn rel_l2_vs_bits(a: &[f64], b: &[u16], dt: Dtype) -> (f64, usize) {
    let (mut num, mut den, mut bad) = (0.0, 0.0, 0);
    for (&x, &y) in a.iter().zip(b) {
        let y = bits_to_f64(y, dt);
        if !x.is_finite() || !y.is_finite() {
            bad += 1;
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    ((num / den.max(1e-300)).sqrt(), bad)
}

/// A device buffer read back as a runner input of the storage type (the bits as they are).
fn bits(name: &'static str, shape: Vec<usize>, v: &[u16], dt: Dtype) -> Named {
    use safetensors::tensor::Dtype as St;
    Named {
        name,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        dtype: if dt == Dtype::F16 { St::F16 } else { St::BF16 },
    }
}

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

fn v3_dims(dt: Dtype) -> Dims {
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

    fn filler(&mut self, dt: Dtype) -> Result<Filler> {
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

    fn timed(
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
    fn time_peers(
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

    /// Absorbed MQA decode over a paged latent cache (block table: a random permutation of the pool):
    /// each tile × split count, checked against the scalar kernel (one split), then the peers on the
    /// same q, cache and block table read back from the device.
    pub fn decode(
        &mut self,
        dc: DecodeCase,
        tiles: &[Tile],
        splits_list: &[usize],
    ) -> Result<CaseResult> {
        let DecodeCase {
            bsz,
            h,
            s,
            page,
            dt,
        } = dc;
        let base = v3_dims(dt);
        let filler = self.filler(dt)?;
        let (lkv, r) = (base.lkv, base.r);
        let row = lkv + r;
        let pages = bsz * s / page;
        let mut c = CaseResult {
            kernel: "decode",
            shape: format!(
                "B={bsz} H={h} s_k={s} page={page} d={row}/{lkv} {}",
                dt.name()
            ),
            bytes: (bsz * s * row * 2 + bsz * h * row * 2 + bsz * h * lkv * 2) as f64,
            flops: 2.0 * (bsz * h * s) as f64 * (row + lkv) as f64,
            ours: Vec::new(),
            peers: Vec::new(),
            notes: Vec::new(),
        };
        let pool = DevBuf::alloc(pages * page * row * 2)?;
        filler.fill(&pool, pages * page * row, 11, 1.0)?;
        // Each request owns s/page pages of a random permutation of the whole pool.
        let mut perm: Vec<i32> = (0..pages as i32).collect();
        {
            use rand::seq::SliceRandom;
            use rand::SeedableRng;
            perm.shuffle(&mut rand::rngs::StdRng::seed_from_u64(5));
        }
        let table = DevBuf::upload(&perm)?;
        // The model's softmax scale 1/sqrt(P+R) (without YaRN's mscale: timing does not depend on it).
        let scale = 1.0 / ((base.p + base.r) as f64).sqrt();
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let dims = Dims { h, page, ..base };
        let q = DevBuf::alloc(bsz * h * row * 2)?;
        filler.fill(&q, bsz * h * row, 12 + h as u32, 1.0)?;
        let o = DevBuf::alloc(bsz * h * lkv * 2)?;
        let lse = DevBuf::alloc(bsz * h * 4)?;
        let max_splits = splits_list.iter().copied().max().unwrap_or(1);
        let po = DevBuf::alloc(bsz * h * max_splits * lkv * 4)?;
        let pl = DevBuf::alloc(bsz * h * max_splits * 4)?;
        let args = |splits: usize| AttnArgs {
            q: q.ptr,
            ka: pool.ptr,
            kb: pool.ptr,
            v: pool.ptr,
            table: table.ptr,
            out: o.ptr,
            lse: lse.ptr,
            part_out: po.ptr,
            part_lse: pl.ptr,
            n_keys: s as i32,
            num_splits: splits as i32,
            scale_log2,
            ..AttnArgs::decode_batch(h, lkv, r, s / page)
        };
        // Reference output for the self-check: the scalar kernel, one split.
        let scalar = Attn::load(&mut self.k, &self.gpu, "decode.cu", &dims, &[], true)?;
        scalar.run(&args(1), bsz as u32)?;
        self.gpu.sync("decode (scalar reference)")?;
        let want: Vec<u16> = o.read(0, bsz * h * lkv)?;
        let mut best_out: Option<(f64, Vec<u16>)> = None;
        for &tile in tiles {
            let att = match Attn::load(&mut self.k, &self.gpu, "decode.cu", &dims, &[tile], false) {
                Ok(a) if a.uses_mma() => a,
                Ok(_) => {
                    c.notes.push(format!(
                        "decode H={h}: tile {} not available here (shared memory, or wgmma off Hopper), skipped",
                        tile.label()
                    ));
                    continue;
                }
                Err(e) => {
                    c.notes
                        .push(format!("decode H={h}: tile {}: {e}", tile.label()));
                    continue;
                }
            };
            // Where the module has both decode schedules, each split count runs on both (`run` picks
            // by keys per split: attn::pairs_rule); where it has attn_small (few heads, TMA key ring),
            // on it and on attn_mma (`run` picks by keys per split: attn::small_rule). The label names the kernel.
            #[derive(Clone, Copy, PartialEq)]
            enum Sched {
                Plain,
                Pairs,
                OneTile,
                Small,
                Mma,
            }
            let schedules: &[Sched] = if att.has_pairs() {
                &[Sched::Pairs, Sched::OneTile]
            } else if att.has_small() {
                &[Sched::Small, Sched::Mma]
            } else {
                &[Sched::Plain]
            };
            for &splits in splits_list {
                for &sched in schedules {
                    let a = args(splits);
                    let run = || -> Result<()> {
                        match sched {
                            Sched::Small => att.run_small(&a, bsz as u32)?,
                            _ => att.run_on(&a, bsz as u32, sched == Sched::Pairs)?,
                        }
                        if splits > 1 {
                            att.combine(&a, bsz * h)?;
                        }
                        Ok(())
                    };
                    o.write(&vec![0xffffu16; bsz * h * lkv])?; // NaN poison: every output must be rewritten
                    run()?;
                    self.gpu.sync("decode (tensor cores)")?;
                    let got: Vec<u16> = o.read(0, bsz * h * lkv)?;
                    let kernel = match sched {
                        Sched::Plain => "",
                        Sched::Pairs => " pairs",
                        Sched::OneTile => " one-tile",
                        Sched::Small => " attn_small (TMA ring)",
                        Sched::Mma => " attn_mma",
                    };
                    let t = Self::timed(
                        format!("{}{kernel}; splits {splits}", tile.label()),
                        time_us(5, 50, self.launches, run)?,
                        &got,
                        &want,
                        dt,
                    );
                    if t.correct && best_out.as_ref().is_none_or(|b| t.median_us < b.0) {
                        best_out = Some((t.median_us, got));
                    }
                    c.ours.push(t);
                }
            }
        }
        if self.peers.iter().all(|(_, p)| !p.has("decode")) {
            return Ok(c);
        }
        // The peers' inputs: our q split as [q_nope | q_pe], the pool, each request's pages.
        let host_q: Vec<u16> = q.read(0, bsz * h * row)?;
        let host_pool: Vec<u16> = pool.read(0, pages * page * row)?;
        let (mut qn, mut qp) = (Vec::new(), Vec::new());
        for x in host_q.chunks_exact(row) {
            qn.extend_from_slice(&x[..lkv]);
            qp.extend_from_slice(&x[lkv..]);
        }
        let inputs = [
            bits("q_nope", vec![bsz, 1, h, lkv], &qn, dt),
            bits("q_pe", vec![bsz, 1, h, r], &qp, dt),
            bits("kv_cache", vec![pages, page, row], &host_pool, dt),
            ints("block_table", vec![bsz, s / page], &perm),
            ints("cache_seqlens", vec![bsz], &vec![s as i32; bsz]),
        ];
        drop(host_pool);
        // vLLM's TRITON_MLA uses 4 splits (TritonMLAImpl); FlashMLA plans its own.
        let meta = serde_json::json!({
            "dtype": dt.name(), "softmax_scale": scale, "heads": h, "kv_lora_rank": lkv,
            "qk_nope": base.p, "qk_rope": r, "v_head_dim": base.dv, "page_size": page,
            "num_splits": 4, "q_len": 1, "causal": true,
            "bench": {"warmup": 5, "iters": 50, "launches": self.launches},
        });
        let ours = best_out.as_ref().map(|b| &b.1[..]);
        self.time_peers(
            &mut c,
            "decode",
            &inputs,
            &meta,
            "attn_latent",
            &[bsz, 1, h, lkv],
            &want,
            ours,
            dt,
        );
        Ok(c)
    }

    /// Causal prefill flash attention over T tokens in the decompressed (MHA) form at `m`'s head dims.
    pub fn prefill(
        &mut self,
        m: &Entry,
        t: usize,
        dt: Dtype,
        tiles: &[Tile],
    ) -> Result<CaseResult> {
        let (h, p, r, dv) = (m.heads, m.qk_nope, m.qk_rope, m.v_head);
        let dqk = p + r;
        let filler = self.filler(dt)?;
        let dims = Dims {
            h,
            p,
            r,
            dv,
            lkv: m.kv_lora,
            page: 64,
            ..v3_dims(dt)
        };
        let mut c = CaseResult {
            kernel: "prefill",
            shape: format!("T={t} H={h} qk {dqk} / v {dv} causal {}", dt.name()),
            bytes: ((t * h * (dqk + p + dv + dv)) * 2 + t * r * 2) as f64,
            flops: (h * t * t) as f64 * (dqk + dv) as f64,
            ours: Vec::new(),
            peers: Vec::new(),
            notes: Vec::new(),
        };
        let q = DevBuf::alloc(t * h * dqk * 2)?;
        let kn = DevBuf::alloc(t * h * p * 2)?;
        let kpe = DevBuf::alloc(t * r * 2)?;
        let v = DevBuf::alloc(t * h * dv * 2)?;
        let o = DevBuf::alloc(t * h * dv * 2)?;
        let lse = DevBuf::alloc(t * h * 4)?;
        filler.fill(&q, t * h * dqk, 21, 1.0)?;
        filler.fill(&kn, t * h * p, 22, 1.0)?;
        filler.fill(&kpe, t * r, 23, 1.0)?;
        filler.fill(&v, t * h * dv, 24, 1.0)?;
        let a = AttnArgs {
            q: q.ptr,
            ka: kn.ptr,
            kb: kpe.ptr,
            v: v.ptr,
            out: o.ptr,
            lse: lse.ptr,
            n_keys: t as i32,
            n_q: t as i32,
            causal: 1,
            scale_log2: (1.0 / (dqk as f64).sqrt() * std::f64::consts::LOG2_E) as f32,
            ..AttnArgs::prefill_layout(h, p, r, dv, r)
        };
        let scalar = Attn::load(&mut self.k, &self.gpu, "prefill.cu", &dims, &[], true)?;
        scalar.run(&a, 1)?;
        self.gpu.sync("prefill (scalar reference)")?;
        let want: Vec<u16> = o.read(0, t * h * dv)?;
        let mut best_out: Option<(f64, Vec<u16>)> = None;
        for &tile in tiles {
            let att = match Attn::load(&mut self.k, &self.gpu, "prefill.cu", &dims, &[tile], false)
            {
                Ok(a) if a.uses_mma() => a,
                Ok(_) => continue,
                Err(e) => {
                    c.notes
                        .push(format!("prefill H={h}: tile {}: {e}", tile.label()));
                    continue;
                }
            };
            // The Hopper kernel takes its operands' tensor maps as a parameter (TMA loads where they
            // encode, cp.async otherwise): launched through PrefillLaunch, not Attn::run.
            let wg = PrefillLaunch::find(&mut self.k, &att, &dims)?;
            let maps = match &wg {
                Some(l) => l.maps(&a)?,
                None => crate::backend::cuda::tma::PrefillMaps::OFF,
            };
            if maps.on() {
                c.notes
                    .push(format!("prefill H={h}: tile {}: TMA loads", tile.label()));
            }
            let go = || match &wg {
                Some(l) => l.run_with(&a, &maps),
                None => att.run(&a, 1),
            };
            o.write(&vec![0xffffu16; t * h * dv])?;
            go()?;
            self.gpu.sync("prefill (tensor cores)")?;
            let got: Vec<u16> = o.read(0, t * h * dv)?;
            let tm = Self::timed(
                tile.label(),
                time_us(3, 20, self.launches, go)?,
                &got,
                &want,
                dt,
            );
            if tm.correct && best_out.as_ref().is_none_or(|b| tm.median_us < b.0) {
                best_out = Some((tm.median_us, got));
            }
            c.ours.push(tm);
        }
        if self.peers.iter().all(|(_, p)| !p.has("prefill")) {
            return Ok(c);
        }
        // The peers' inputs (decompressed MHA form): q, k = [k_nope | k_pe broadcast], v.
        let (hq, hkn, hkpe, hv): (Vec<u16>, Vec<u16>, Vec<u16>, Vec<u16>) = (
            q.read(0, t * h * dqk)?,
            kn.read(0, t * h * p)?,
            kpe.read(0, t * r)?,
            v.read(0, t * h * dv)?,
        );
        let mut hk = Vec::with_capacity(t * h * dqk);
        for j in 0..t {
            for hh in 0..h {
                hk.extend_from_slice(&hkn[(j * h + hh) * p..(j * h + hh + 1) * p]);
                hk.extend_from_slice(&hkpe[j * r..(j + 1) * r]);
            }
        }
        let inputs = [
            bits("q", vec![t, h, dqk], &hq, dt),
            bits("k", vec![t, h, dqk], &hk, dt),
            bits("v", vec![t, h, dv], &hv, dt),
        ];
        let meta = serde_json::json!({
            "dtype": dt.name(), "softmax_scale": 1.0 / (dqk as f64).sqrt(), "heads": h,
            "kv_lora_rank": m.kv_lora, "qk_nope": p, "qk_rope": r, "v_head_dim": dv,
            "page_size": 64, "num_splits": 1, "q_len": 1, "causal": true, "context_len": 0,
            "bench": {"warmup": 3, "iters": 20, "launches": self.launches},
        });
        let ours = best_out.as_ref().map(|b| &b.1[..]);
        self.time_peers(
            &mut c,
            "prefill",
            &inputs,
            &meta,
            "attn_heads",
            &[t, h, dv],
            &want,
            ours,
            dt,
        );
        Ok(c)
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

/// `bench decode|prefill`: every tile (or the first), bf16, at the fixed shapes.
pub fn bench(opts: &BenchOptions) -> Result<(BenchReport, String)> {
    let mut ses = Session::open(opts.kernels_dir.as_deref(), &opts.peers)?;
    ses.launches = opts.launches;
    let dt = Dtype::Bf16;
    let mut rows: Vec<BenchRow> = Vec::new();
    if opts.decode {
        for &h in &opts.decode_heads {
            let mut tiles: Vec<Tile> = decode_tiles(h);
            tiles.truncate(if opts.best_only { 1 } else { 3 });
            if h < 64 && !opts.best_only {
                // A deeper pipeline: 1.45x slower on the H200 (one CTA per SM instead of two), kept as
                // the measured alternative; st4, 16-key 2-warp tiles (3-4 CTAs per SM) and 16 splits were
                // slower too (H200, 2026-12-01: 147 µs at st3 vs 100.7 at st2, bench/RESULTS.md history).
                tiles.push(Tile::new(1, 4, 32, 3, 1));
            }
            // One split fills the GPU at 128 heads (2 CTAs per request); 16 heads needs more.
            let splits: &[usize] = if h >= 64 { &[1, 2] } else { &[2, 4, 8] };
            let (bsz, s, page) = (64, 4096, 64);
            let c = ses.decode(
                DecodeCase {
                    bsz,
                    h,
                    s,
                    page,
                    dt,
                },
                &tiles,
                splits,
            )?;
            rows.extend(ses.rows(&c));
            for n in &c.notes {
                writeln!(ses.log, "{n}").unwrap();
            }
        }
    }
    if opts.prefill {
        // The first three tiles with Hopper's other wgmma tiles after the first.
        let mut tiles = prefill_tiles();
        tiles.truncate(3);
        tiles.splice(1..1, crate::tiles::prefill_wgmma_variants());
        if opts.best_only {
            tiles.retain(|t| t.wgmma);
        } else {
            tiles.push(Tile::new(8, 1, 64, 2, 2));
            tiles.push(Tile::new(8, 1, 32, 2, 1));
        }
        for m in [Preset::DeepseekV3, Preset::Glm5].map(Preset::entry) {
            let c = ses.prefill(m, 4096, dt, &tiles)?;
            rows.extend(ses.rows(&c));
            for n in &c.notes {
                writeln!(ses.log, "{n}").unwrap();
            }
        }
    }
    let mut out = std::mem::take(&mut ses.log);
    out.push_str(&Session::table_text(&rows));
    let rep = BenchReport {
        gpu: ses.gpu.info.name.clone(),
        copy_gbps: ses.copy_gbps,
        matmul_tflops: ses.matmul_tflops,
        rows,
        nvrtc_ms: ses.k.compile_ms,
        launches: ses.launches,
    };
    Ok((rep, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits_of(v: &[f32], dt: Dtype) -> Vec<u16> {
        v.iter()
            .map(|&x| match dt {
                Dtype::F16 => half::f16::from_f32(x).to_bits(),
                _ => half::bf16::from_f32(x).to_bits(),
            })
            .collect()
    }

    #[test]
    fn a_configuration_is_correct_only_finite_and_within_four_roundoffs() {
        for dt in [Dtype::Bf16, Dtype::F16] {
            let want: Vec<f32> = (0..256).map(|i| ((i as f32) * 0.37).sin()).collect();
            let w = bits_of(&want, dt);
            let same = Session::timed("x".into(), (1.0, 1.0), &w, &w, dt);
            assert!(same.correct && same.rel_l2_vs_scalar == 0.0);
            // 10 % off everywhere: far outside 4u of either type.
            let off: Vec<f32> = want.iter().map(|x| x * 1.1).collect();
            let t = Session::timed("x".into(), (1.0, 1.0), &bits_of(&off, dt), &w, dt);
            assert!(!t.correct, "{dt:?}: {}", t.rel_l2_vs_scalar);
            // One NaN: never correct, however close the rest.
            let mut nan = w.clone();
            nan[7] = bits_of(&[f32::NAN], dt)[0];
            let t = Session::timed("x".into(), (1.0, 1.0), &nan, &w, dt);
            assert!(!t.correct && t.non_finite == 1);
        }
    }

    #[test]
    fn fp16_bits_are_read_as_fp16() {
        let h = half::f16::from_f32(1.5).to_bits();
        assert_eq!(bits_to_f64(h, Dtype::F16), 1.5);
        let b = half::bf16::from_f32(1.5).to_bits();
        assert_eq!(bits_to_f64(b, Dtype::Bf16), 1.5);
        assert_ne!(bits_to_f64(h, Dtype::Bf16), 1.5);
    }
}
