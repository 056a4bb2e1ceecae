//! DSA goldens (issue #17): transformers' `GlmMoeDsa` and `DeepseekV32` tiny models with `index_topk` 8
//! over T = 24 tokens (queries 8..23 attend to 8 of their keys), converted by llama.cpp's own converter
//! (fixtures/golden/make_goldens.py, README there). The fp64 indexer must select the keys transformers
//! selected and the sparse reference must give transformers' attention output within 1e-6; every
//! deliberate misreading of the indexer must move that output by far more.

use crate::common::{fixture, golden_per_layer, DsaFile};
use mla_diff::compare::metrics::rel_l2;
use mla_diff::model::LayerWeights;
use mla_diff::reference::indexer::{self, Reading};
use mla_diff::reference::sparse::Selection;
use mla_diff::rope::RopeTables;
use mla_diff::schedule::Schedule;
use mla_diff::trace::Stage;
use ndarray::{Array2, Array3, Axis};
use std::path::{Path, PathBuf};

/// As the dense goldens (tests/it/golden): transformers' float32 roundings put the floor near 1e-7.
const TOL: f64 = 1e-6;
/// A misreading must move the output by at least this much.
const DETECT: f64 = 100.0 * TOL;

/// GLM-5 (interleaved indexer rope) and DeepSeek-V3.2 (NeoX indexer rope, DeepSeek's YaRN); the latter
/// converted under transformers 4.57 (its converter class asserts `add_bos_token`, which transformers 5
/// drops: fixtures/golden/README.md).
const FAMILIES: [&str; 2] = ["glm-5-dsa", "deepseek-v3.2-dsa"];

fn dir() -> PathBuf {
    fixture("golden")
}

struct Golden {
    name: &'static str,
    dsa: DsaFile,
    x: Array3<f64>,
    /// transformers with llama.cpp's eps convention (q_a/kv_a RMSNorm at rms_norm_eps).
    out: Array3<f64>,
    /// `[layers, T, top_k]`: transformers' selection (rows past the causal end pick masked keys).
    topk: Vec<Vec<Vec<u32>>>,
}

/// An int32 `[L, T, K]` .npy (the only integer array the goldens hold).
pub fn load_topk(path: &Path) -> Vec<Vec<Vec<u32>>> {
    let bytes = std::fs::read(path).unwrap();
    let hl = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hl]).unwrap();
    assert!(header.contains("'<i4'"), "{header}");
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let data: Vec<u32> = bytes[10 + hl..]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32)
        .collect();
    let (l, t, k) = (shape[0], shape[1], shape[2]);
    assert_eq!(data.len(), l * t * k);
    (0..l)
        .map(|li| {
            (0..t)
                .map(|ti| data[(li * t + ti) * k..(li * t + ti + 1) * k].to_vec())
                .collect()
        })
        .collect()
}

fn load(name: &'static str) -> Golden {
    let d = dir();
    let dsa = DsaFile::open(&d.join(format!("{name}.gguf")));
    let cfg = &dsa.cfg;
    let t = 24;
    let x = golden_per_layer(&d.join(format!("{name}.attn_in.npy")), cfg, t);
    let unified = d.join(format!("{name}.attn_out.eps_unified.npy"));
    let out_path = if unified.exists() {
        unified
    } else {
        d.join(format!("{name}.attn_out.npy"))
    };
    let out = golden_per_layer(&out_path, cfg, t);
    let topk = load_topk(&d.join(format!("{name}.topk.npy")));
    Golden {
        name,
        dsa,
        x,
        out,
        topk,
    }
}

struct LayerRun {
    selection: Selection,
    out: Array2<f64>,
    /// The smallest gap between the k-th and the (k+1)-th visible score over the sparse queries,
    /// relative to the row's largest |score|: how far the golden's selections are from a tie.
    min_gap: f64,
}

impl Golden {
    fn tokens(&self) -> usize {
        self.x.dim().1
    }
    /// The sparse reference of layer `l` with the indexer read as `r`.
    fn run(&self, l: usize, r: Reading) -> LayerRun {
        let t = self.tokens();
        let sched = Schedule {
            prompt_len: t,
            chunk: t,
            decode_steps: 0,
            ..Schedule::default()
        };
        let rope = RopeTables::for_run(&self.dsa.cfg, self.dsa.factors.as_ref(), 0, t).unwrap();
        let (w, iw) = self.dsa.layer(l);
        let x = self.x.index_axis(Axis(0), l).to_owned();
        let attn_in = mla_diff::reference::front::attn_in(&self.dsa.cfg, &w, x.view());
        let idx = indexer::run(
            &self.dsa.cfg,
            &self.dsa.ic,
            &iw,
            &w,
            &rope,
            attn_in.view(),
            r,
        );
        let tr = mla_diff::reference::run_layer_sel(
            &self.dsa.cfg,
            &w,
            &rope,
            &x,
            &sched,
            Some(&idx.selection),
        )
        .unwrap();
        let o = tr.get(Stage::AttnOut).unwrap();
        let k = self.dsa.ic.top_k;
        let min_gap = (k..t)
            .map(|q| {
                let mut row: Vec<f64> = idx.scores.row(q).iter().take(q + 1).copied().collect();
                row.sort_by(|a, b| b.total_cmp(a));
                (row[k - 1] - row[k]) / row[0].abs().max(row[q].abs())
            })
            .fold(f64::INFINITY, f64::min);
        LayerRun {
            selection: idx.selection,
            out: Array2::from_shape_vec((o.shape[0], o.shape[1]), o.data.clone()).unwrap(),
            min_gap,
        }
    }
    fn error(&self, l: usize, out: &Array2<f64>) -> f64 {
        let theirs: Vec<f64> = self.out.index_axis(Axis(0), l).iter().copied().collect();
        let ours: Vec<f64> = out.iter().copied().collect();
        if ours.iter().any(|v| !v.is_finite()) {
            return f64::INFINITY;
        }
        rel_l2(&theirs, &ours)
    }
    /// transformers' selection of query `q` in layer `l`, its masked (future) picks removed.
    fn theirs(&self, l: usize, q: usize) -> Vec<u32> {
        let mut v: Vec<u32> = self.topk[l][q]
            .iter()
            .copied()
            .filter(|&j| j as usize <= q)
            .collect();
        v.sort_unstable();
        v
    }
}

fn fmt(e: &[f64]) -> String {
    e.iter()
        .map(|v| format!("{v:.2e}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn present() -> Vec<Golden> {
    FAMILIES
        .iter()
        .filter(|n| dir().join(format!("{n}.gguf")).exists())
        .map(|n| load(n))
        .collect()
}

#[test]
fn goldens_are_sparse_and_present() {
    let gs = present();
    for name in FAMILIES {
        assert!(
            gs.iter().any(|g| g.name == name),
            "fixtures/golden/{name}.* missing"
        );
    }
    // The two families differ in the indexer's rope pairing, each as its architecture says.
    let pairing = |n: &str| {
        gs.iter()
            .find(|g| g.name == n)
            .map(|g| (g.dsa.cfg.arch, g.dsa.ic.rope))
    };
    use mla_diff::model::{Arch, RopePairing};
    assert_eq!(
        pairing("glm-5-dsa"),
        Some((Arch::GlmDsa, RopePairing::Norm))
    );
    assert_eq!(
        pairing("deepseek-v3.2-dsa"),
        Some((Arch::Deepseek32, RopePairing::Neox))
    );
    for g in &gs {
        assert!(g.dsa.ic.top_k < g.tokens(), "{}: top_k must bite", g.name);
    }
}

/// The fp64 indexer selects transformers' keys and the sparse reference gives transformers' output.
#[test]
fn sparse_reference_matches_transformers() {
    let mut failures = Vec::new();
    for g in present() {
        for l in 0..g.dsa.cfg.n_layer {
            let run = g.run(l, Reading::default());
            for q in 0..g.tokens() {
                if run.selection.keys[q] != g.theirs(l, q) {
                    failures.push(format!(
                        "{} layer {l} query {q}: selected {:?}, transformers {:?}",
                        g.name,
                        run.selection.keys[q],
                        g.theirs(l, q)
                    ));
                }
            }
            let e = g.error(l, &run.out);
            println!(
                "{} layer {l}: sparse rel-L2 {e:.2e}, sparse queries {}, smallest k-th gap {:.2e}",
                g.name,
                run.selection.sparse_queries(),
                run.min_gap
            );
            if e > TOL {
                failures.push(format!("{} layer {l}: rel-L2 {e:.2e} > {TOL:.0e}", g.name));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Dense attention (what mla-diff checked before #17) is not the model here: sparsity bites.
#[test]
fn dense_attention_is_not_the_model_past_top_k() {
    for g in present() {
        for l in 0..g.dsa.cfg.n_layer {
            let t = g.tokens();
            let run = g.run(l, Reading::default());
            let dense = Selection::dense(g.dsa.ic.top_k, t);
            let sched = Schedule {
                prompt_len: t,
                chunk: t,
                decode_steps: 0,
                ..Schedule::default()
            };
            let rope = RopeTables::for_run(&g.dsa.cfg, g.dsa.factors.as_ref(), 0, t).unwrap();
            let w = LayerWeights::load(&g.dsa.file, &g.dsa.cfg, l).unwrap();
            let x = g.x.index_axis(Axis(0), l).to_owned();
            let tr =
                mla_diff::reference::run_layer_sel(&g.dsa.cfg, &w, &rope, &x, &sched, Some(&dense))
                    .unwrap();
            let o = tr.get(Stage::AttnOut).unwrap();
            let o = Array2::from_shape_vec((t, g.dsa.cfg.hidden), o.data.clone()).unwrap();
            let e = g.error(l, &o);
            println!("{} layer {l}: dense rel-L2 {e:.2e}", g.name);
            assert!(e > DETECT, "{} layer {l}: dense {e:.2e}", g.name);
            assert!(g.error(l, &run.out) < e);
        }
    }
}

/// Each misreading of the indexer moves the output measurably, except the weights' `Hi^-0.5`, which
/// scales every score of a row alike and cannot change a top-k: shown equal, not claimed caught.
#[test]
fn indexer_misreadings_move_the_output() {
    let readings: [(&str, Reading); 5] = [
        (
            "rope pairing swapped (GLM interleaved <-> DeepSeek NeoX)",
            Reading {
                swap_rope: true,
                ..Reading::default()
            },
        ),
        (
            "rope on the last R dims (MLA order)",
            Reading {
                rope_last: true,
                ..Reading::default()
            },
        ),
        (
            "no ReLU",
            Reading {
                no_relu: true,
                ..Reading::default()
            },
        ),
        (
            "top_k - 1",
            Reading {
                top_k_minus_one: true,
                ..Reading::default()
            },
        ),
        (
            "non-causal indexer",
            Reading {
                non_causal: true,
                ..Reading::default()
            },
        ),
    ];
    let mut failures = Vec::new();
    for g in present() {
        for (what, r) in readings {
            let e: Vec<f64> = (0..g.dsa.cfg.n_layer)
                .map(|l| g.error(l, &g.run(l, r).out))
                .collect();
            println!("{} {what}: {}", g.name, fmt(&e));
            if e.iter().all(|&v| v <= DETECT) {
                failures.push(format!(
                    "{} {what}: {} not above {DETECT:.0e}",
                    g.name,
                    fmt(&e)
                ));
            }
        }
        let unscaled = Reading {
            no_weight_scale: true,
            ..Reading::default()
        };
        for l in 0..g.dsa.cfg.n_layer {
            assert_eq!(
                g.run(l, unscaled).selection,
                g.run(l, Reading::default()).selection,
                "{}: a positive scale of the weights cannot change the top-k",
                g.name
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
