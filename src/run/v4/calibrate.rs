//! The DeepSeek-V4 tolerance table (`src/compare/v4_tolerances.json`), measured as `mla-diff calibrate`
//! measures MLA's: over clean runs (files × schedules × seeds), per dtype and stage the worst rel-L2 and
//! the worst elementwise excess over `rtol·|ref|` in units of rms(ref), times the margin (4), rounded up
//! to two digits. The seeds are 0 and 5–7, so the no-false-alarm tests' seeds 1–4 are runs it never saw.
//! Regenerate: `MLA_DIFF_BLESS=1 cargo test --release --lib run::v4::calibrate -- --ignored`.

use super::{default_schedule, V4Options};
use crate::backend::cpu::v4::V4Mirror;
use crate::calibrate::base_rtol;
use crate::compare::metrics;
use crate::compare::v4::{pairs, V4Tolerances};
use crate::error::Result;
use crate::faults::{Active, FaultSet};
use crate::gguf::GgufFile;
use crate::model::v4::{V4Config, V4Weights};
use crate::precision::Dtype;
use crate::schedule::Schedule;
use crate::tolerance::Tolerance;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// `x` rounded up to two significant digits (1e-12 for 0: a stage the dtype leaves exact).
fn up2(x: f64) -> f64 {
    if x <= 0.0 {
        return 1e-12;
    }
    let e = 10f64.powf(x.log10().floor() - 1.0);
    format!("{:.1e}", (x / e).ceil() * e)
        .parse()
        .expect("a number")
}

/// The schedules measured on a file: the default, and a ragged one (chunks of 24, 12 decode steps).
pub fn schedules(c: &V4Config) -> Vec<Schedule> {
    let d = default_schedule(c);
    vec![
        d.clone(),
        Schedule {
            prompt_len: (c.sliding_window + 13).max(133),
            chunk: 24,
            decode_steps: 12,
            ..d
        },
    ]
}

/// The table over `files` (`names` says which, for the record), `dtypes` and `seeds`.
pub fn calibrate(
    files: &[PathBuf],
    names: &str,
    margin: f64,
    dtypes: &[Dtype],
    seeds: &[u64],
) -> Result<V4Tolerances> {
    let mut table = BTreeMap::new();
    for &dt in dtypes {
        let rtol = base_rtol(dt);
        let mut worst: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for path in files {
            let f = GgufFile::open(path)?;
            let c = V4Config::from_gguf(&f)?;
            for sched in schedules(&c) {
                let o = V4Options {
                    layers: (0..c.n_layer).collect(),
                    seed: 0,
                    sched,
                    dtype: dt,
                    faults: FaultSet::default(),
                    backend: Default::default(),
                };
                let ps = super::passes(&o.sched);
                for &seed in seeds {
                    let mut h = crate::input::random_hidden(c.hidden, o.sched.total_tokens(), seed);
                    for l in 0..c.n_layer {
                        let w = V4Weights::load(&f, &c, l)?;
                        let opt =
                            V4Mirror::new(dt).run_layer(&c, &w, l, h.view(), &ps, Active::NONE);
                        let sel = opt.topk_indices.as_ref();
                        let r = crate::reference::v4::run_layer_selecting(&c, &w, l, h.view(), sel);
                        for (stage, _, rv, ov) in pairs(l, &r, &opt)? {
                            let rms = metrics::rms(&rv).max(f64::MIN_POSITIVE);
                            let excess = rv
                                .iter()
                                .zip(&ov)
                                .filter(|(a, b)| a.is_finite() && b.is_finite())
                                .map(|(a, b)| ((b - a).abs() - rtol * a.abs()).max(0.0))
                                .fold(0.0, f64::max);
                            let e = worst.entry(stage.name().to_string()).or_default();
                            e.0 = e.0.max(metrics::rel_l2(&rv, &ov));
                            e.1 = e.1.max(excess / rms);
                        }
                        h += &r.attn_out;
                    }
                }
            }
        }
        // The selection's worth is index scores: where no near tie flipped in these runs, the scores'
        // own noise is its floor (a flip among near ties moves it by that much).
        if let Some(sc) = worst.get("index_scores").copied() {
            if let Some(tk) = worst.get_mut("topk_indices") {
                *tk = (tk.0.max(sc.0), tk.1.max(sc.1));
            }
        }
        let stages = worst
            .into_iter()
            .map(|(s, (r, a))| {
                let t = Tolerance {
                    rel_l2: up2(margin * r),
                    atol_rms: up2(margin * a),
                    rtol,
                };
                (s, t)
            })
            .collect();
        table.insert(dt.name().to_string(), stages);
    }
    let seeds: Vec<String> = seeds.iter().map(|s| s.to_string()).collect();
    Ok(V4Tolerances {
        derived_from: format!(
            "run::v4::calibrate, margin {margin}, seeds {} over {names}, the default and a ragged schedule",
            seeds.join(",")
        ),
        margin,
        dtypes: table,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::V4_STAGES;

    /// Every dtype has every stage; `MLA_DIFF_BLESS=1 … -- --ignored` measures the table anew.
    #[test]
    fn the_table_has_every_stage_of_every_dtype() {
        let t = V4Tolerances::builtin();
        for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            for (s, _, _) in V4_STAGES {
                let tol = t.get(dt, s).unwrap();
                assert!(
                    tol.rel_l2 > 0.0 && tol.rel_l2 < 0.2,
                    "{} {}",
                    dt.name(),
                    s.name()
                );
            }
        }
    }

    #[test]
    #[ignore = "measures the table (about a minute): MLA_DIFF_BLESS=1 writes it"]
    fn measure_the_table() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let d = tempfile::tempdir().unwrap();
        let fx = d.path().join("v4.gguf");
        let o = crate::fixture::v4::V4Options {
            layers: Some(3),
            hidden: Some(256),
            heads: Some(8),
            quant: crate::gguf::GgmlType::from_name("bf16").unwrap(),
            seed: 0,
        };
        crate::fixture::v4::write(&o, &fx).unwrap();
        let files = [root.join("fixtures/golden/deepseek-v4.gguf"), fx];
        let names = "fixtures/golden/deepseek-v4.gguf and `fixture --preset deepseek-v4 --layers 3 --hidden 256 --heads 8 --quant bf16`";
        let dts = [Dtype::Bf16, Dtype::F16, Dtype::F32];
        let t = calibrate(&files, names, 4.0, &dts, &[0, 5, 6, 7]).unwrap();
        let text = serde_json::to_string_pretty(&t).unwrap() + "\n";
        println!("{text}");
        if std::env::var_os("MLA_DIFF_BLESS").is_some() {
            std::fs::write(root.join("src/compare/v4_tolerances.json"), text).unwrap();
        }
    }
}
