//! `mla-diff bench decode|prefill|table --backend cuda`: kernel-only time of the attention kernels (CUDA
//! events, warm-up, median of many), achieved GB/s and TFLOP/s, against ceilings measured in the same run:
//! a device-to-device copy (bytes read + written) and a cuBLAS bf16 8192³ GEMM.
//!
//! Byte and FLOP counts follow peer-kernels-h200.md so the numbers compare with the peers there:
//! decode bytes = B·S·(Lkv+R)·2 + B·H·(Lkv+R)·2 + B·H·Lkv·2, FLOPs = 2·B·H·S·((Lkv+R)+Lkv);
//! causal prefill FLOPs = H·T²·(dqk+dv) (half of the full T×T score matrix).

//!
//! One file per concern: `measure` (event timing, the filler, rel-L2 of raw outputs), `session` (the
//! GPU, ceilings and peers; what a case yields), `decode` and `prefill` (the two kernels' cases).

mod decode;
mod measure;
mod prefill;
mod session;

pub use measure::bits_to_f64;
pub use session::{CaseResult, DecodeCase, PeerTimed, Session, Timed};

use crate::error::Result;
use crate::model::catalogue::Preset;
use crate::precision::Dtype;
use crate::tiles::{decode_tiles, prefill_tiles, Tile};
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
mod tests;
