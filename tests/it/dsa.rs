//! DSA on the CPU mirror (issue #17): the glm-5-dsa golden's weights (top_k 8) on the default serving
//! schedule (48 prompt tokens in chunks of 32, 16 decode steps, shuffled pages of 16, 4 splits), far past
//! top_k. The mirror over the reference's selection passes every stage check; its own bf16 / f32
//! indexer passes the tie-aware selection check; each planted indexer bug fails the selection check
//! while the kernel checks stay clean, and a planted kernel bug does the reverse.

use crate::common::{fixture, selftest_dsa_fixture, DsaFile};
use mla_diff::backend::cpu::indexer::{self as mirror_indexer, Plan};
use mla_diff::backend::cpu::CpuMirror;
use mla_diff::backend::RunTables;
use mla_diff::compare::selection::{ScoreNoise, FLIP_P, MARGIN_SIGMAS};
use mla_diff::compare::{self, ToleranceTable};
use mla_diff::faults::{Active, Fault};
use mla_diff::model::{IndexerConfig, IndexerWeights, LayerWeights, MlaConfig};
use mla_diff::precision::{Dtype, KeyPrecision};
use mla_diff::reference::indexer::Reading;
use mla_diff::reference::sparse::{flashmla_indices, Selection};
use mla_diff::run::dsa::{self, DsaLayer};
use mla_diff::schedule::Schedule;
use ndarray::Array2;
use std::path::Path;

struct Case {
    cfg: MlaConfig,
    ic: IndexerConfig,
    w: LayerWeights,
    iw: IndexerWeights,
    tables: RunTables,
    sched: Schedule,
    x: Array2<f64>,
}

fn case(layer: usize) -> Case {
    case_of(&fixture("golden/glm-5-dsa.gguf"), layer)
}

fn case_of(path: &Path, layer: usize) -> Case {
    case_sched(path, layer, Schedule::default())
}

fn case_sched(path: &Path, layer: usize, sched: Schedule) -> Case {
    let d = DsaFile::open(path);
    let (w, iw) = d.layer(layer);
    let tables = RunTables::new(&d.cfg, d.factors.as_ref(), &sched).unwrap();
    let t = sched.total_tokens();
    // Deterministic O(1) inputs (an xorshift, centred), like the goldens' embeddings.
    let mut s = 0x9e3779b97f4a7c15u64 + layer as u64;
    let x = Array2::from_shape_fn((t, d.cfg.hidden), |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 3.4 - 1.7
    });
    Case {
        cfg: d.cfg,
        ic: d.ic,
        w,
        iw,
        tables,
        sched,
        x,
    }
}

impl Case {
    fn run(&self, dt: Dtype, plan: Plan, fx: Active) -> DsaLayer {
        let ctx = mla_diff::backend::LayerCtx {
            faults: fx,
            ..self
                .tables
                .ctx(&self.cfg, &self.w, &self.sched, Active::NONE)
        };
        let mut m = CpuMirror::new(dt);
        dsa::run_layer(&ctx, &self.ic, &self.iw, &mut m, &self.x, dt, plan).unwrap()
    }
    /// The stage-local view of `opt`, run with `sel` by the mirror: over the selection, or (`sel`
    /// `None`) dense, as before sparse layers had one.
    fn local(
        &self,
        opt: &mla_diff::trace::LayerTrace,
        dt: Dtype,
        sel: Option<&Selection>,
    ) -> compare::local::Local {
        let inp = compare::local::Inputs {
            weights: &self.w,
            frame: compare::local::Frame {
                cfg: &self.cfg,
                rope: &self.tables.rope,
                sched: &self.sched,
                x: &self.x,
                dtype: dt,
                provided: mla_diff::trace::StageSet::ALL,
                judging: &mla_diff::judging::Judging {
                    score_sum: mla_diff::precision::ScoreSum::Lanes8,
                    ..Default::default()
                },
            },
        };
        match sel {
            Some(selection) => {
                compare::local::compute_sparse(&inp, opt, compare::local::Sparse { selection })
            }
            None => compare::local::compute(&inp, opt),
        }
    }
    /// The stage checks of the path over the reference's selection, the local view deciding.
    fn kernel_checks_pass(&self, d: &DsaLayer, dt: Dtype) -> (bool, String) {
        let local = self.local(&d.optimized, dt, Some(&d.ref_selection));
        self.checks_with(d, dt, Some(&local))
    }
    fn checks_with(
        &self,
        d: &DsaLayer,
        dt: Dtype,
        local: Option<&compare::local::Local>,
    ) -> (bool, String) {
        let ctx = compare::Ctx {
            layer: self.w.layer,
            elementwise: true,
            sched: &self.sched,
            block_table: &self.tables.block_table,
            provided: mla_diff::trace::StageSet::ALL,
        };
        let r = compare::compare_layer(
            &ctx,
            &d.reference,
            &d.optimized,
            dt,
            &ToleranceTable::defaults(),
            local,
        )
        .unwrap();
        let first = r
            .checks
            .iter()
            .find(|c| !c.pass)
            .map(|c| c.check.clone())
            .unwrap_or_default();
        (r.pass, first)
    }
}

#[test]
fn the_schedule_is_sparse() {
    let c = case(0);
    let d = c.run(Dtype::F32, Plan::default(), Active::NONE);
    assert!(c.sched.total_tokens() > 4 * c.ic.top_k);
    assert_eq!(
        d.ref_selection.sparse_queries(),
        c.sched.total_tokens() - c.ic.top_k
    );
}

/// Over the reference's selection the mirror is the sparse model within the calibrated tolerances, and
/// its own indexer picks the reference's keys up to near-ties.
#[test]
fn mirror_passes_with_the_reference_selection_and_its_own() {
    for layer in 0..2 {
        let c = case(layer);
        for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            let d = c.run(dt, Plan::default(), Active::NONE);
            let (pass, first) = c.kernel_checks_pass(&d, dt);
            println!(
                "layer {layer} {}: kernel checks {} ({first}), {}, own path attn_out rel-L2 {:.2e}, selection effect {:.2e}",
                dt.name(),
                if pass { "PASS" } else { "FAIL" },
                d.selection.summary(),
                d.own_path_error,
                d.selection_effect
            );
            assert!(pass, "layer {layer} {}: {first}", dt.name());
            assert!(d.selection.pass, "{}", d.selection.summary());
        }
    }
}

/// The measured error of the mirror's scores against the noise `ScoreNoise` predicts for them: per
/// visible score `(s_mirror − s_fp64) / σ`, its rms and largest magnitude, on `c`'s layer.
fn score_error_in_sigmas(c: &Case, dt: Dtype, keys: KeyPrecision) -> (f64, f64) {
    let ctx = c.tables.ctx(&c.cfg, &c.w, &c.sched, Active::NONE);
    let (_, o) = dsa::ref_selection(&ctx, &c.ic, Some(&c.iw), None, &c.x).unwrap();
    let o = o.unwrap();
    let noise = ScoreNoise::new(&o, dt, keys);
    let plan = Plan {
        keys,
        ..Plan::default()
    };
    let m =
        mirror_indexer::run(&c.cfg, &c.ic, &c.iw, &c.w, &c.tables.rope, &c.x, dt, plan).unwrap();
    let (mut sq, mut n, mut worst) = (0.0, 0.0, 0f64);
    for t in 0..c.x.nrows() {
        for j in 0..=t {
            let (err, sigma) = (
                m.scores[[t, j]] as f64 - o.scores[[t, j]],
                noise.sigma(t, j, None),
            );
            // Every head cut by ReLU far from its kink: both sides' score is 0 exactly.
            if sigma == 0.0 && err == 0.0 {
                continue;
            }
            let z = err / sigma;
            sq += z * z;
            n += 1.0;
            worst = worst.max(z.abs());
        }
    }
    ((sq / n).sqrt(), worst)
}

/// The noise model is not a fudge: the mirror's measured score errors are below the σ it predicts
/// (rms and worst in units of σ; the selection check allows `MARGIN_SIGMAS` σ of a score difference).
#[test]
fn mirror_score_error_is_within_its_predicted_noise() {
    let c = case(0);
    for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
        let (rms, worst) = score_error_in_sigmas(&c, dt, KeyPrecision::Storage);
        println!("{}: score error rms {rms:.3} σ, worst {worst:.2} σ (margin {MARGIN_SIGMAS} σ of a difference)", dt.name());
        assert!(rms < 1.0 && worst < MARGIN_SIGMAS, "{}", dt.name());
    }
    // GLM-5's indexer dims (2 heads of 128): fp8 keys too.
    let c = case_of(&selftest_dsa_fixture(), 1);
    for keys in [KeyPrecision::Storage, KeyPrecision::Fp8] {
        let (rms, worst) = score_error_in_sigmas(&c, Dtype::Bf16, keys);
        println!("glm-5-dsa selftest fixture, bf16, {keys:?} keys: score error rms {rms:.3} σ, worst {worst:.2} σ");
        assert!(rms < 1.0 && worst < MARGIN_SIGMAS, "{keys:?}");
    }
}

/// `--indexer-keys fp8` on GLM-5's indexer dims: a clean run passes the selection check at fp8's
/// noise, the coverage says how the indexer computed, and a misreading is still caught there.
#[test]
fn fp8_indexer_keys_pass_clean_and_catch_a_misreading() {
    let f = selftest_dsa_fixture();
    let f = f.to_str().unwrap();
    let args = |extra: &[&str]| {
        let mut a = vec![
            "run",
            f,
            "--backend",
            "cpu",
            "--prompt-len",
            "40",
            "--chunk",
            "16",
            "--decode-steps",
            "3",
            "--mode",
            "shadow",
            "--indexer-keys",
            "fp8",
            "--json",
            "-",
        ];
        a.extend_from_slice(extra);
        let o = crate::common::run(&a);
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (o.status.code(), r)
    };
    let (code, r) = args(&[]);
    assert_eq!(code, Some(0), "{r}");
    let ix = r["coverage"]["dsa"]["indexer"].as_str().unwrap();
    assert!(ix.contains("fp8 e4m3"), "{ix}");
    for l in r["dsa"]["layers"].as_array().unwrap() {
        assert_eq!(l["selection"]["pass"], true, "{l}");
    }
    let (code, r) = args(&["--inject", "indexer_rope_swap@layer=1", "--pos-offset", "5"]);
    assert_eq!(code, Some(1), "{r}");
    assert_eq!(r["dsa"]["first_layer"], 1, "{r}");
    assert_eq!(r["modes"][0]["verdict"]["pass"], true, "{r}");
}

/// fp8 keys on the golden's 40-dim indexer heads: refused (exit 2, one line), not a panic.
#[test]
fn fp8_indexer_keys_on_a_non_power_of_two_dim_exit_2() {
    let g = fixture("golden/glm-5-dsa.gguf");
    let o = crate::common::run(&[
        "run",
        g.to_str().unwrap(),
        "--backend",
        "cpu",
        "--indexer-keys",
        "fp8",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("mla-diff: error: fp8 indexer keys need a power-of-two head dim"),
        "{e}"
    );
}

/// Each indexer bug fails the selection check (with its gap, query and key) while the attention over the
/// reference's selection stays clean: attributed to the indexer, not the kernels.
#[test]
fn indexer_faults_are_caught_by_the_selection_check_only() {
    let c = case(0);
    let faults: [(&str, Reading); 4] = [
        (
            "rope pairing swapped",
            Reading {
                swap_rope: true,
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
    ];
    for (what, reading) in faults {
        let plan = Plan {
            reading,
            ..Plan::default()
        };
        let d = c.run(Dtype::Bf16, plan, Active::NONE);
        println!("{what}: {}", d.selection.summary());
        assert!(!d.selection.pass, "{what}");
        assert!(c.kernel_checks_pass(&d, Dtype::Bf16).0, "{what}");
    }
}

/// The stage-local view of a sparse layer recomputes each attention over the selection the path was
/// given: the mirror passes it, in every dtype; the dense view of the same trace (every visible key)
/// fails at the first attention stage, so the selection is what the view's pass rests on.
#[test]
fn the_local_view_attends_over_the_selection() {
    let c = case(1);
    for dt in [Dtype::Bf16, Dtype::F32] {
        let d = c.run(dt, Plan::default(), Active::NONE);
        let (pass, first) = c.kernel_checks_pass(&d, dt);
        assert!(pass, "{}: {first}", dt.name());
        let dense = c.local(&d.optimized, dt, None);
        let (pass, first) = c.checks_with(&d, dt, Some(&dense));
        assert!(!pass && first == "lse[prefill]", "{}: {first}", dt.name());
    }
}

/// A kernel bug (the 576^-0.5 softmax scale) fails the kernel checks while the selection passes.
#[test]
fn a_kernel_fault_is_not_blamed_on_the_selection() {
    let c = case(0);
    let d = c.run(
        Dtype::Bf16,
        Plan::default(),
        Active::NONE.with(Fault::Scale576),
    );
    let (pass, first) = c.kernel_checks_pass(&d, Dtype::Bf16);
    assert!(!pass && d.selection.pass, "{first}");
}

/// fp8 keys need a power-of-two head dim (the Hadamard rotation): refused, not panicking, on Di = 40.
#[test]
fn fp8_keys_on_a_non_power_of_two_head_dim_are_refused() {
    let c = case(0);
    let plan = Plan {
        keys: KeyPrecision::Fp8,
        ..Plan::default()
    };
    let e = mirror_indexer::run(
        &c.cfg,
        &c.ic,
        &c.iw,
        &c.w,
        &c.tables.rope,
        &c.x,
        Dtype::Bf16,
        plan,
    );
    assert!(matches!(e, Err(mla_diff::Error::Usage(_))));
}

/// FlashMLA's sparse indices address each selected key's row in the paged pool, and the pool row read
/// there is that key's cache row (the seam a CUDA sparse decode plugs into).
#[test]
fn flashmla_indices_address_the_selected_cache_rows() {
    let c = case(0);
    let d = c.run(Dtype::F32, Plan::default(), Active::NONE);
    let page = c.sched.page_size;
    let sel: &Selection = &d.ref_selection;
    let t = c.sched.total_tokens() - 1;
    let idx = flashmla_indices(&sel.keys[t], c.ic.top_k, &c.tables.block_table, page);
    assert_eq!(idx.len(), c.ic.top_k);
    for (&i, &j) in idx.iter().zip(&sel.keys[t]) {
        let (p, o) = (i as usize / page, i as usize % page);
        assert_eq!(c.tables.block_table[j as usize / page], p);
        assert_eq!(j as usize % page, o);
    }
}

/// The fp8-scale fault (`Plan::fp8_scale_dropped`: the key's block scale left out of the logit) moves
/// many keys by a few σ each. At 128 tokens on the selftest fixture's layer 1 every moved key stays
/// within the per-key margin and the flip-count test alone catches it (`FLIP_SIGMAS`, `FLIP_P`); at
/// 192 tokens both layers fail it; the clean fp8 runs pass.
#[test]
fn fp8_scale_dropped_is_caught_by_the_flip_count() {
    for (prompt, layers) in [(112, 1..2), (176, 0..2)] {
        for layer in layers {
            let sched = Schedule {
                prompt_len: prompt,
                ..Schedule::default()
            };
            let c = case_sched(&selftest_dsa_fixture(), layer, sched);
            for dropped in [false, true] {
                let plan = Plan {
                    keys: KeyPrecision::Fp8,
                    fp8_scale_dropped: dropped,
                    ..Plan::default()
                };
                let s = c.run(Dtype::Bf16, plan, Active::NONE).selection;
                println!(
                    "{} tokens, layer {layer}, scale {}: {}",
                    c.sched.total_tokens(),
                    if dropped { "dropped" } else { "kept" },
                    s.summary()
                );
                assert_eq!(s.pass, !dropped, "{}", s.summary());
                if dropped {
                    assert!(s.far_flip_p < FLIP_P, "{}", s.summary());
                }
                if dropped && prompt == 112 {
                    assert!(s.worst.is_none(), "{}", s.summary());
                }
            }
        }
    }
}
