//! `mla-diff calibrate`: derive the default tolerances from the measured noise of the CPU mirror.
//!
//! For each dtype, the mirror runs against the fp64 reference on the given files over a set of schedules
//! that cross chunk, page and split boundaries. Per check we record the worst rel-L2 and the worst
//! elementwise excess `max(|o − r| − rtol·|r|) / rms(r)` (with the dtype's fixed `rtol`), then multiply
//! both by `margin`. The result is `src/compare/tolerances.json`, compiled into the binary.

use crate::backend::cpu::CpuMirror;
use crate::backend::{Backend, RunTables};
use crate::compare::{checks_for, metrics, rows_of, ToleranceTable};
use crate::error::Result;
use crate::faults::Active;
use crate::gguf::GgufFile;
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::schedule::Schedule;
use crate::tolerance::Tolerance;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The elementwise relative part of the tolerance: four unit roundoffs of the storage type. A stored
/// value passes through several roundings (input, weight, output: three for `attn_in`), so one unit
/// roundoff is too tight for the large-magnitude channels, where the RMS-relative part cannot help
/// (seen on the H200 at GLM-5 dims: a 68.4 activation off by 0.8%). 4u is FlashMLA's `2.01/128` for
/// bf16 outputs.
pub fn base_rtol(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Bf16 => 4.0 / 256.0,
        Dtype::F16 => 4.0 / 2048.0,
        Dtype::F32 => 1e-6,
    }
}

/// Schedules used for calibration: boundaries of chunks, pages and splits, multi-token decode.
pub fn calibration_schedules() -> Vec<Schedule> {
    let d = Schedule::default();
    vec![
        d.clone(),
        Schedule {
            prompt_len: 1,
            chunk: 1,
            decode_steps: 40,
            page_size: 8,
            num_splits: 3,
            ..d.clone()
        },
        Schedule {
            prompt_len: 70,
            chunk: 17,
            decode_steps: 8,
            q_len: 3,
            page_size: 1,
            num_splits: 7,
            ..d.clone()
        },
        Schedule {
            prompt_len: 64,
            chunk: 64,
            decode_steps: 20,
            page_size: 64,
            num_splits: 1,
            shuffle_seed: None,
            ..d.clone()
        },
        Schedule {
            prompt_len: 33,
            chunk: 8,
            decode_steps: 0,
            ..d
        },
    ]
}

#[derive(Debug, Default, Clone, Copy)]
struct Worst {
    rel_l2: f64,
    atol_rms: f64,
}

/// Measure, and return the table (margin applied) plus a human summary of the raw figures.
pub fn calibrate(
    files: &[PathBuf],
    margin: f64,
    dtypes: &[Dtype],
    seeds: &[u64],
) -> Result<(ToleranceTable, String)> {
    let mut table = ToleranceTable {
        derived_from: String::new(),
        margin,
        dtypes: BTreeMap::new(),
        overridden: Default::default(),
    };
    let mut summary = String::new();
    for &dt in dtypes {
        let rtol = base_rtol(dt);
        let mut worst: BTreeMap<String, Worst> = BTreeMap::new();
        for path in files {
            let f = GgufFile::open(path)?;
            let cfg = MlaConfig::from_gguf(&f)?;
            let factors = RopeFactors::load(&f, &cfg)?;
            for (sched, &seed) in calibration_schedules()
                .into_iter()
                .flat_map(|s| seeds.iter().map(move |x| (s.clone(), x)))
            {
                let t = sched.total_tokens();
                let tables = RunTables::new(&cfg, factors.as_ref(), &sched)?;
                let x = crate::input::random_hidden(cfg.hidden, t, seed);
                let mut mirror = CpuMirror::new(dt);
                for l in 0..cfg.n_layer {
                    let w = LayerWeights::load(&f, &cfg, l)?;
                    let r = crate::reference::run_layer(&cfg, &w, &tables.rope, &x, &sched)?;
                    let o = mirror.run_layer(&tables.ctx(&cfg, &w, &sched, Active::NONE), &x)?;
                    for check in checks_for(&sched) {
                        let (Some(rt), Some(ot)) = (r.get(check.stage), o.get(check.stage)) else {
                            continue;
                        };
                        let rows = check.rows(&sched);
                        let (rv, ov) = (rows_of(rt, &rows).0, rows_of(ot, &rows).0);
                        let nf = metrics::nonfinite(rv, ov);
                        if nf.mismatches > 0 {
                            summary.push_str(&format!(
                                "warning: {} {} layer {l} {}: {} non-finite mismatches (excluded from calibration)\n",
                                dt.name(),
                                path.display(),
                                check.name(),
                                nf.mismatches
                            ));
                            continue;
                        }
                        let rms = metrics::rms(rv).max(f64::MIN_POSITIVE);
                        let excess = rv
                            .iter()
                            .zip(ov)
                            .filter(|(a, b)| a.is_finite() && b.is_finite())
                            .map(|(a, b)| ((b - a).abs() - rtol * a.abs()).max(0.0))
                            .fold(0.0, f64::max);
                        let w = worst.entry(check.name()).or_default();
                        w.rel_l2 = w.rel_l2.max(metrics::rel_l2(rv, ov));
                        w.atol_rms = w.atol_rms.max(excess / rms);
                    }
                }
            }
        }
        summary.push_str(&format!(
            "{} (rtol {rtol:.3e}): worst observed rel-L2 / atol_rms per check\n",
            dt.name()
        ));
        let m = table.dtypes.entry(dt.name().to_string()).or_default();
        for (k, w) in &worst {
            summary.push_str(&format!(
                "  {k:<22} rel_l2 {:.3e}  atol_rms {:.3e}\n",
                w.rel_l2, w.atol_rms
            ));
            // Round up to 2 significant digits so the file stays readable; floor at a tiny value so a
            // bit-exact stage (e.g. f32 cache rows) still gets a non-zero tolerance.
            let up = |v: f64| {
                let v = (v * margin).max(1e-12);
                let e = 10f64.powf(v.log10().floor() - 1.0);
                (v / e).ceil() * e
            };
            m.insert(
                k.clone(),
                Tolerance {
                    rel_l2: up(w.rel_l2),
                    atol_rms: up(w.atol_rms),
                    rtol,
                },
            );
        }
    }
    table.derived_from = format!(
        "mla-diff calibrate --margin {margin} --seeds {} over {} and {} schedules (see calibration_schedules)",
        seeds.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","),
        files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        calibration_schedules().len()
    );
    Ok((table, summary))
}
