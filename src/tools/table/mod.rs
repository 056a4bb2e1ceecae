//! `mla-diff bench table`: issue #16's whole table in one run — six shapes (four decode, two prefill) in
//! each storage type, our fastest correct configuration, the peers on the very same inputs, the ceilings
//! measured by the same process — with each shape's ratios, correctness and floor verdict in one record.

use super::bench::{BenchRow, CaseResult, DecodeCase, PeerTimed, Session, Timed};
use crate::error::Result;
use crate::model::catalogue::Preset;
use crate::precision::Dtype;
use crate::tiles::{decode_tiles, prefill_tiles, prefill_wgmma_variants, Tile};
use serde::Serialize;
use std::fmt::Write;

/// What a shape must reach (issue #16).
#[derive(Debug, Clone, Copy)]
pub enum Floor {
    /// At least `min` × the peer's speed (its time ÷ ours); `backend`: the peer's version line must name
    /// it (torch SDPA's kernel: the floor is against cuDNN, not flash).
    PeerSpeed {
        peer: &'static str,
        backend: Option<&'static str>,
        min: f64,
    },
    /// At least this fraction of the measured device-to-device copy bandwidth.
    CopyBw(f64),
}

impl Floor {
    fn text(&self) -> String {
        match self {
            Floor::PeerSpeed { peer, backend, min } => format!(
                ">= {min}x {peer}{}'s speed",
                backend.map(|b| format!(" ({b})")).unwrap_or_default()
            ),
            Floor::CopyBw(f) => format!(">= {:.0}% of copy bandwidth", f * 100.0),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub enum Shape {
    /// DeepSeek-V3 latent dims (512 + 64), one query token, page 64.
    Decode { bsz: usize, h: usize, s: usize },
    /// T = 4096 causal, at a model's head dims.
    Prefill(Preset),
}

/// Issue #16's rows, in its order.
pub const CASES: [(Shape, Floor); 6] = {
    const FLASHMLA: Floor = Floor::PeerSpeed {
        peer: "flashmla",
        backend: None,
        min: 0.9,
    };
    const CUDNN: Floor = Floor::PeerSpeed {
        peer: "torch",
        backend: Some("cudnn"),
        min: 0.8,
    };
    [
        (
            Shape::Decode {
                bsz: 64,
                h: 128,
                s: 4096,
            },
            FLASHMLA,
        ),
        (
            Shape::Decode {
                bsz: 64,
                h: 16,
                s: 4096,
            },
            Floor::CopyBw(0.85),
        ),
        (
            Shape::Decode {
                bsz: 128,
                h: 64,
                s: 4096,
            },
            FLASHMLA,
        ),
        (
            Shape::Decode {
                bsz: 16,
                h: 128,
                s: 32768,
            },
            FLASHMLA,
        ),
        (Shape::Prefill(Preset::DeepseekV3), CUDNN),
        (Shape::Prefill(Preset::Glm5), CUDNN),
    ]
};

/// Our candidates per shape: decode, the tile `run` chooses at every split count; prefill, six tiles.
fn our_tiles(shape: Shape) -> Vec<Tile> {
    match shape {
        Shape::Decode { h, .. } => decode_tiles(h).into_iter().take(1).collect(),
        // The first prefill tile (Hopper's wgmma, 128 rows by 64 keys) and its other wgmma tiles (a tile
        // too big for the dims is skipped there), and off Hopper the mma tile with its P·V on 32-row
        // tiles (the faster one at 256-wide values).
        Shape::Prefill(_) => {
            let mut t = vec![prefill_tiles()[0]];
            t.extend(prefill_wgmma_variants());
            t.extend([prefill_tiles()[1], Tile::new(8, 1, 64, 2, 2)]);
            t
        }
    }
}

const SPLITS: [usize; 4] = [1, 2, 4, 8];

/// Our configuration or a peer, with its speed against the ceilings.
#[derive(Debug, Clone, Serialize)]
pub struct Speed {
    #[serde(flatten)]
    pub timed: Timed,
    pub tflops: f64,
    pub gbps: f64,
    pub pct_copy_bw: f64,
    pub pct_matmul: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PeerSpeed {
    pub peer: String,
    pub name: String,
    pub version: String,
    #[serde(flatten)]
    pub speed: Speed,
    /// Ours ÷ the peer's speed (the peer's time ÷ ours): above 1, ours is faster.
    pub ours_speed_ratio: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FloorVerdict {
    pub floor: String,
    /// met / missed / not measured (with why).
    pub verdict: String,
    pub met: Option<bool>,
    /// The figure the floor is about (speed ratio, or fraction of copy bandwidth).
    pub measured: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TableEntry {
    pub kernel: String,
    pub shape: String,
    pub dtype: String,
    /// Our fastest correct configuration (none: no configuration ran correctly).
    pub ours: Option<Speed>,
    /// How many of our configurations ran, and how many of them were correct.
    pub configs: usize,
    pub configs_correct: usize,
    pub peers: Vec<PeerSpeed>,
    pub floor: FloorVerdict,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TableReport {
    pub gpu: String,
    pub sms: i32,
    /// cuDriverGetVersion (13000: CUDA 13.0).
    pub driver: i32,
    pub copy_gbps: f64,
    pub matmul_tflops: f64,
    pub peers: Vec<String>,
    pub entries: Vec<TableEntry>,
    /// Every timing of the run (ours at each configuration, the peers), as `bench decode` prints them.
    pub rows: Vec<BenchRow>,
    pub floors_met: usize,
    pub floors_missed: usize,
    pub floors_not_measured: usize,
    /// Every configuration of ours that ran was correct (finite, within 4u of the scalar kernel).
    pub correct: bool,
    pub nvrtc_ms: f64,
    /// Back-to-back launches per timed sample, ours and the peers' alike (`Session::launches`).
    pub launches: usize,
}

pub struct TableOptions {
    pub kernels_dir: Option<std::path::PathBuf>,
    pub dtypes: Vec<Dtype>,
    pub peers: Vec<String>,
    /// Back-to-back launches per timed sample (`Session::launches`).
    pub launches: usize,
    /// Only these of `CASES` (0-based, in order); empty: all.
    pub only: Vec<usize>,
}

fn speed(ses: &Session, c: &CaseResult, t: &Timed) -> Speed {
    let r = ses.row(c, t, t.config.clone());
    Speed {
        timed: t.clone(),
        tflops: r.tflops,
        gbps: r.gbps,
        pct_copy_bw: r.pct_copy_bw,
        pct_matmul: r.pct_matmul,
    }
}

/// The floor's verdict from what ran: a floor whose peer did not run, ran wrong, or is not the kernel
/// the floor names is not measured — never met.
pub fn verdict(floor: Floor, ours: Option<&Speed>, peers: &[PeerSpeed]) -> FloorVerdict {
    let done = |met: Option<bool>, measured: Option<f64>, verdict: String| FloorVerdict {
        floor: floor.text(),
        verdict,
        met,
        measured,
    };
    let Some(ours) = ours else {
        return done(
            None,
            None,
            "not measured: no configuration of ours ran correctly".into(),
        );
    };
    match floor {
        Floor::CopyBw(min) => {
            let f = ours.pct_copy_bw / 100.0;
            let met = f >= min;
            done(
                Some(met),
                Some(f),
                format!(
                    "{}: {:.1}% of copy bandwidth",
                    if met { "met" } else { "missed" },
                    100.0 * f
                ),
            )
        }
        Floor::PeerSpeed { peer, backend, min } => {
            let Some(p) = peers.iter().find(|p| p.peer == peer) else {
                return done(None, None, format!("not measured: peer {peer} did not run"));
            };
            if let Some(b) = backend {
                if !p.version.to_lowercase().contains(b) {
                    return done(
                        None,
                        None,
                        format!("not measured: {peer} is not running {b} ({})", p.version),
                    );
                }
            }
            if !p.speed.timed.correct {
                return done(
                    None,
                    None,
                    format!("not measured: {peer}'s output is wrong"),
                );
            }
            let Some(ratio) = p.ours_speed_ratio else {
                return done(None, None, format!("not measured: no time against {peer}"));
            };
            let met = ratio >= min;
            // Three decimals: at two, 0.8955 would read "0.90x" beside "missed" for a 0.9x floor.
            done(
                Some(met),
                Some(ratio),
                format!(
                    "{}: ours at {ratio:.3}x {peer}'s speed",
                    if met { "met" } else { "missed" }
                ),
            )
        }
    }
}

fn entry(ses: &Session, c: &CaseResult, dt: Dtype, floor: Floor) -> TableEntry {
    let ours = c.best().map(|t| speed(ses, c, t));
    let peers: Vec<PeerSpeed> = c
        .peers
        .iter()
        .map(|p: &PeerTimed| PeerSpeed {
            peer: p.peer.clone(),
            name: p.name.clone(),
            version: p.version.clone(),
            speed: speed(ses, c, &p.timed),
            ours_speed_ratio: ours.as_ref().map(|o| p.timed.median_us / o.timed.median_us),
        })
        .collect();
    TableEntry {
        kernel: c.kernel.into(),
        shape: c.shape.clone(),
        dtype: dt.name().into(),
        floor: verdict(floor, ours.as_ref(), &peers),
        ours,
        configs: c.ours.len(),
        configs_correct: c.ours.iter().filter(|t| t.correct).count(),
        peers,
        notes: c.notes.clone(),
    }
}

pub fn table(opts: &TableOptions) -> Result<(TableReport, String)> {
    let mut ses = Session::open(opts.kernels_dir.as_deref(), &opts.peers)?;
    ses.launches = opts.launches;
    let mut entries = Vec::new();
    let mut rows = Vec::new();
    for &dt in &opts.dtypes {
        for (i, &(shape, floor)) in CASES.iter().enumerate() {
            if !opts.only.is_empty() && !opts.only.contains(&i) {
                continue;
            }
            let tiles = our_tiles(shape);
            let c = match shape {
                Shape::Decode { bsz, h, s } => ses.decode(
                    DecodeCase {
                        bsz,
                        h,
                        s,
                        page: 64,
                        dt,
                    },
                    &tiles,
                    &SPLITS,
                )?,
                Shape::Prefill(p) => ses.prefill(p.entry(), 4096, dt, &tiles)?,
            };
            rows.extend(ses.rows(&c));
            let e = entry(&ses, &c, dt, floor);
            writeln!(ses.log, "{} {}: {}", e.kernel, e.shape, e.floor.verdict).unwrap();
            entries.push(e);
        }
    }
    let count = |m: Option<bool>| entries.iter().filter(|e| e.floor.met == m).count();
    let rep = TableReport {
        gpu: ses.gpu.info.name.clone(),
        sms: ses.gpu.info.sms,
        driver: ses.gpu.info.driver_version,
        copy_gbps: ses.copy_gbps,
        matmul_tflops: ses.matmul_tflops,
        peers: ses
            .peers
            .iter()
            .map(|(_, p)| format!("{}: {}", p.desc.name, p.desc.version))
            .collect(),
        floors_met: count(Some(true)),
        floors_missed: count(Some(false)),
        floors_not_measured: count(None),
        correct: entries.iter().all(|e| e.configs_correct == e.configs),
        entries,
        rows,
        nvrtc_ms: ses.k.compile_ms,
        launches: ses.launches,
    };
    let mut out = std::mem::take(&mut ses.log);
    out.push_str(&Session::table_text(&rep.rows));
    out.push('\n');
    out.push_str(&markdown(&rep));
    Ok((rep, out))
}

/// The summary table (Markdown): one line per shape and dtype, ours against each peer and the ceilings.
pub fn markdown(rep: &TableReport) -> String {
    let mut peers: Vec<&str> = Vec::new();
    for e in &rep.entries {
        for p in &e.peers {
            if !peers.contains(&p.peer.as_str()) {
                peers.push(&p.peer);
            }
        }
    }
    let mut s = String::new();
    writeln!(
        s,
        "{} ({} SMs, CUDA driver API {}); ceilings in the same run: copy {:.0} GB/s, cuBLAS bf16 {:.1} TFLOP/s; \
         times: median per launch over samples of {} back-to-back launches, ours and the peers alike.\n",
        rep.gpu, rep.sms, rep.driver, rep.copy_gbps, rep.matmul_tflops, rep.launches
    )
    .unwrap();
    let mut head = String::from(
        "| shape | dtype | ours (fastest correct config) | µs | TFLOP/s | % copy BW | % cuBLAS |",
    );
    let mut rule = String::from("|---|---|---|---:|---:|---:|---:|");
    for p in &peers {
        write!(head, " {p} µs (ours ÷ its speed) |").unwrap();
        rule.push_str("---:|");
    }
    head.push_str(" rel-L2 vs scalar (ours; peers) | floor | verdict |");
    rule.push_str("---|---|---|");
    writeln!(s, "{head}\n{rule}").unwrap();
    for e in &rep.entries {
        let shape = e.shape.trim_end_matches(&format!(" {}", e.dtype));
        let (cfg, us, tf, bw, mm, err) = match &e.ours {
            Some(o) => (
                o.timed.config.clone(),
                format!("{:.1}", o.timed.median_us),
                format!("{:.0}", o.tflops),
                format!("{:.1}", o.pct_copy_bw),
                format!("{:.1}", o.pct_matmul),
                format!("{:.1e}", o.timed.rel_l2_vs_scalar),
            ),
            None => (
                "none correct".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ),
        };
        write!(
            s,
            "| {} {shape} | {} | {cfg} | {us} | {tf} | {bw} | {mm} |",
            e.kernel, e.dtype
        )
        .unwrap();
        let mut errs = vec![err];
        for name in &peers {
            match e.peers.iter().find(|p| p.peer == *name) {
                Some(p) => {
                    let ratio = p
                        .ours_speed_ratio
                        .map(|r| format!(" ({r:.2}x)"))
                        .unwrap_or_default();
                    let wrong = if p.speed.timed.correct { "" } else { " WRONG" };
                    write!(s, " {:.1}{ratio}{wrong} |", p.speed.timed.median_us).unwrap();
                    errs.push(format!("{:.1e}", p.speed.timed.rel_l2_vs_scalar));
                }
                None => s.push_str(" - |"),
            }
        }
        writeln!(
            s,
            " {} | {} | {} |",
            errs.join("; "),
            e.floor.floor,
            e.floor.verdict
        )
        .unwrap();
    }
    writeln!(
        s,
        "\nFloors: {} met, {} missed, {} not measured; our configurations {}.",
        rep.floors_met,
        rep.floors_missed,
        rep.floors_not_measured,
        if rep.correct {
            "all correct (finite, rel-L2 within 4 unit roundoffs of the scalar kernel)"
        } else {
            "NOT all correct"
        }
    )
    .unwrap();
    s
}

#[cfg(test)]
mod tests;
