//! The stage-local view: every stage recomputed in fp64 from the optimized path's *own stored inputs*
//! to that stage (weights rounded to the run's dtype, as the path stores them), with the noise the
//! path's own roundings predict (`noise.rs`). A stage's allowance is then its own rounding only, not
//! everything upstream, so an error a couple of times the noise at one stage is caught there.
//!
//! Inputs of each stage, as the serving path has them:
//! - `attn_in` ← the layer input in the dtype; `q_nope`, `q_pe`, `kv_latent`, `k_pe` ← `attn_in`;
//! - `cache_rows` ← `kv_latent`, `k_pe` (an exact copy; in a quantized cache format, the trace's
//!   `cache_format`, within the format's rounding bound per element, `kv_format::Codec::bound`; the
//!   stages below read the stored, dequantized rows, so they carry the cache's rounding themselves);
//! - `q_absorbed` ← `q_nope`; `split_out`/`split_lse` ← `q_absorbed`, `q_pe`, `cache_rows`;
//!   `attn_latent`, `lse[decode]` ← the splits (or, when the backend does not expose them, the whole
//!   decode attention from `q_nope`, `q_pe`, `cache_rows`); `attn_heads[decode]` ← `attn_latent`;
//! - `lse[prefill]`, `attn_heads[prefill]` ← `q_nope`, `q_pe`, the chunk's own `kv_latent`/`k_pe` and
//!   the context's `cache_rows` (decompressed with W_UK/W_UV, as prefill does);
//! - `attn_out` ← `attn_heads`.

use super::noise::Store;
use crate::backend::cpu::front::RopeF32;
use crate::faults::Active;
use crate::judging::Judging;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::rope::RopeTables;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage, StageSet};
use ndarray::Array2;

// Each stage's rule lives with its stage: `front` (attn_in, q_nope, q_pe, kv_latent, k_pe), `cache`
// (cache_rows), `prefill` (lse and attn_heads of the prompt), `decode` (q_absorbed, split_out,
// split_lse, attn_latent, lse and attn_heads of the decode tokens), and `front::out` (attn_out); the
// attention stages share `attention`'s inputs. Below them: `attend` (one softmax attention and the
// merge), `score` (one score), `linear` (products, norms, rope).
mod attend;
mod attention;
mod cache;
mod decode;
mod f32ops;
mod front;
mod linear;
mod prefill;
mod qk_acc;
mod score;
mod simd;
pub mod sparse;
pub use front::{prepare, Prepared};
pub use sparse::Sparse;

// What `simd` compiles for AVX2, from the modules below.
use attend::{attend_in, Attn, Gram, Path};
#[cfg(test)]
use attend::{key_cols, key_cols_scalar};
#[cfg(test)]
use score::terms_scalar;
use score::{Score, Terms};

/// fp64 of each stage from the optimized path's inputs, and the variance its hidden roundings and f32
/// arithmetic predict (the output's own rounding is added by the judge, from the stored values).
#[derive(Debug, Clone, Default)]
pub struct Local {
    pub stages: Vec<LocalStage>,
}

#[derive(Debug, Clone)]
pub struct LocalStage {
    pub stage: Stage,
    pub values: Vec<f64>,
    pub hidden_var: Vec<f64>,
    /// Per row of the last axis, where its errors share sources (an attention row: each key's P
    /// rounding moves the whole row): the part of the row's hidden variance that does, and how many
    /// independent sources it has. The judge's degrees of freedom come from it.
    pub coherent: Option<Vec<(f64, f64)>>,
    /// A copy of values already stored in their type (the cache): must match exactly (within `bound`).
    pub exact: bool,
    /// Per element: the largest error a quantized cache format's rounding allows (`cache_rows` in a
    /// format other than the dtype); any element beyond it fails the check.
    pub bound: Option<Vec<f64>>,
    /// Per element: the bias a truncating tensor-core accumulator puts into the scores, carried here,
    /// at κ = 1 (`noise::Prediction::truncation`); `None` where the backend's accumulators round to
    /// nearest or the stage does not depend on scores.
    pub truncation: Option<Vec<f64>>,
    /// The type the backend stores this stage in by contract, where it has one (our kernels keep every
    /// LSE in f32); `None`: inferred from the values, as for a runner that returns what it likes. A
    /// contract keeps an LSE rounded to bf16 from being judged as a bf16 tensor (#35: the fault
    /// `split_lse_bf16` passed every run while the type was inferred).
    pub store: Option<Store>,
}

impl Local {
    pub fn get(&self, s: Stage) -> Option<&LocalStage> {
        self.stages.iter().find(|l| l.stage == s)
    }
    fn push(&mut self, stage: Stage, values: Vec<f64>, hidden_var: Vec<f64>) {
        debug_assert_eq!(values.len(), hidden_var.len());
        self.stages.push(LocalStage {
            stage,
            values,
            hidden_var,
            coherent: None,
            exact: false,
            bound: None,
            truncation: None,
            store: None,
        });
    }
    fn push_rows(
        &mut self,
        stage: Stage,
        values: Vec<f64>,
        hidden_var: Vec<f64>,
        rows: Vec<(f64, f64)>,
    ) {
        self.push(stage, values, hidden_var);
        self.stages.last_mut().expect("pushed").coherent = Some(rows);
    }
    /// The stage last pushed is stored in `store` by the backend's contract (`Some`), or of a type
    /// inferred from its values (`None`).
    fn with_store(&mut self, store: Option<Store>) {
        self.stages.last_mut().expect("pushed").store = store;
    }
    /// Attach the truncation bias to the stage last pushed (where the backend truncates).
    fn with_truncation(&mut self, on: bool, bias: Vec<f64>) {
        if on {
            self.stages.last_mut().expect("pushed").truncation = Some(bias);
        }
    }
}

/// What the local view needs besides the optimized trace: the layer's weights and the rest.
pub struct Inputs<'a> {
    pub weights: &'a LayerWeights,
    pub frame: Frame<'a>,
}

/// What the local view needs besides the optimized trace and the layer's weights.
#[derive(Clone, Copy)]
pub struct Frame<'a> {
    pub cfg: &'a MlaConfig,
    pub rope: &'a RopeTables,
    pub sched: &'a Schedule,
    /// The layer input `[T, hidden]` before attn_norm (the path rounds it to `dtype`).
    pub x: &'a Array2<f64>,
    pub dtype: Dtype,
    /// The stages the backend provides: a decode attention without exposed splits is recomputed whole.
    pub provided: StageSet,
    /// How to read the path (`Backend::judging`): here its `known_attention` (an online softmax, and
    /// `attn_latent` merged from the stored partials) and `score_sum` (how its scores are summed).
    pub judging: &'a Judging,
}

/// The optimized trace's stage as a 2-D `[rows, last axes…]` f64 array.
fn opt2(tr: &LayerTrace, s: Stage) -> Option<Array2<f64>> {
    let t = tr.get(s)?;
    let rows = *t.shape.first()?;
    let cols = t.data.len().checked_div(rows).unwrap_or(0);
    Array2::from_shape_vec((rows, cols), t.data.clone()).ok()
}

/// Compute the local view of every stage whose inputs the optimized trace holds.
pub fn compute(inp: &Inputs, opt: &LayerTrace) -> Local {
    let pre = prepare(inp.frame.cfg, inp.weights, inp.frame.dtype, opt);
    finish(inp.frame, opt, pre, None)
}

/// The local view of a DSA layer (`sparse::Sparse`): every attention over the keys the path attended
/// over, in the path's form of sparse prefill.
pub fn compute_sparse(inp: &Inputs, opt: &LayerTrace, sp: sparse::Sparse) -> Local {
    let pre = prepare(inp.frame.cfg, inp.weights, inp.frame.dtype, opt);
    finish(inp.frame, opt, pre, Some(sp))
}

/// What every stage's rule reads: the frame, the optimized trace, the DSA selection, the layer's
/// shapes and the attention's type.
struct View<'a> {
    f: Frame<'a>,
    opt: &'a LayerTrace,
    sp: Option<Sparse<'a>>,
    /// The attention computes in the type of the cache it reads (ggml converts the query to K's type,
    /// MMA kernels take their operands in it): its P, keys, values and a wider query's rounding.
    adt: Dtype,
    h: usize,
    p: usize,
    r: usize,
    dv: usize,
    lkv: usize,
    t_all: usize,
}

impl View<'_> {
    /// DSA: whether query t attends to key j (all visible ones on a dense layer).
    fn keep(&self, t: usize, j: usize) -> bool {
        self.sp.is_none_or(|sp| sp.selection.allows(t, j))
    }
    /// Each stage's storage type: the backend's declared one (a capture's `stage_dtypes`), else the
    /// run's.
    fn dt_of(&self, st: Stage) -> Dtype {
        self.opt.dtype_of(st, self.f.dtype)
    }
}

/// The view from what [`prepare`] made of the weights: each stage's rule in the order of the stages,
/// as far as the trace holds their inputs.
pub fn finish(f: Frame, opt: &LayerTrace, pre: Prepared, sp: Option<sparse::Sparse>) -> Local {
    let mut out = Local::default();
    finish_into(f, opt, pre, sp, &mut |l| out.stages.push(l));
    out
}

/// [`finish`], each stage handed to `sink` as soon as its rule has made it (in the stages' order),
/// so that a judge can compare it and let it go before the next stages are made: one stage group's
/// values and variances alive at a time instead of the whole view (#39).
pub fn finish_into(
    f: Frame,
    opt: &LayerTrace,
    pre: Prepared,
    sp: Option<sparse::Sparse>,
    sink: &mut dyn FnMut(LocalStage),
) {
    let cfg = f.cfg;
    let mut vw = View {
        f,
        opt,
        sp,
        adt: f.dtype,
        h: cfg.n_head,
        p: cfg.qk_nope,
        r: cfg.qk_rope,
        dv: cfg.v_head_dim,
        lkv: cfg.kv_lora_rank,
        t_all: f.sched.total_tokens(),
    };
    vw.adt = vw.dt_of(Stage::CacheRows);
    let rope = RopeF32::new(f.rope, Active::NONE);
    let mut out = Local::default();
    // Hands on what the rules made so far: each stage with its declared storage type, the backend's
    // contract where it has one (as our kernels' f32 LSE is).
    let mut give = |out: &mut Local| {
        for mut l in std::mem::take(&mut out.stages) {
            if l.store.is_none() {
                l.store = opt.declared(l.stage).map(Store::from);
            }
            sink(l);
        }
    };
    front::attn_in(&vw, &pre.attn_norm, &mut out);
    give(&mut out);
    let (Some(q), Some(kv)) = (pre.q, pre.kv) else {
        return;
    };
    front::query(&vw, q, &rope, &mut out);
    give(&mut out);
    front::keys(&vw, kv, &pre.kv_a_norm, &rope, &mut out);
    give(&mut out);
    let (Some(o_lat), Some(o_kpe)) = (opt2(opt, Stage::KvLatent), opt2(opt, Stage::KPe)) else {
        return;
    };
    cache::rows(&vw, &o_lat, &o_kpe, &mut out);
    give(&mut out);
    let Some(att) = attention::Att::new(&vw, &pre.w_uk, &pre.w_uv) else {
        return;
    };
    let mut heads = attention::Heads::new(vw.t_all * vw.h, vw.dv);
    prefill::attend_prompt(&vw, &att, &o_lat, &o_kpe, &mut heads);
    drop((o_lat, o_kpe));
    let heads_ok = decode::attend_decode(&vw, &att, &mut heads, &mut out);
    give(&mut out);
    heads.push_to(&mut out, &att, heads_ok);
    drop(att);
    drop((pre.w_uk, pre.w_uv));
    give(&mut out);
    front::out(pre.o, &mut out);
    give(&mut out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

    /// A bf16 run of the CPU mirror over a small layer with a planted fault (`fault`, or none), its
    /// fp64 reference, and what its stage-local view needs.
    fn small_layer(fault: Option<&str>) -> (LayerTrace, LayerTrace, MlaConfig, Schedule, Fixture) {
        use crate::model::synthetic::{self, Family};
        let cfg = Family::DeepseekV3.test_config();
        let w = synthetic::weights(&cfg, 3);
        let sched = Schedule {
            prompt_len: 12,
            chunk: 8,
            decode_steps: 2,
            num_splits: 2,
            page_size: 4,
            ..Schedule::default()
        };
        let tables = crate::backend::RunTables::new(&cfg, None, &sched).unwrap();
        let x = crate::input::random_hidden(cfg.hidden, sched.total_tokens(), 5);
        let active = fault.map_or(Active::NONE, |f| {
            Active::NONE.with(crate::faults::Fault::from_name(f).expect("a fault"))
        });
        let mut b = crate::backend::cpu::CpuMirror::new(Dtype::Bf16);
        let opt = b
            .run_layer(&tables.ctx(&cfg, &w, &sched, active), &x)
            .unwrap();
        let reference = crate::reference::run_layer(&cfg, &w, &tables.rope, &x, &sched).unwrap();
        let fx = Fixture {
            w,
            tables,
            x,
            judging: b.judging(),
            provided: b.provides(),
        };
        (opt, reference, cfg, sched, fx)
    }

    struct Fixture {
        w: LayerWeights,
        tables: crate::backend::RunTables,
        x: Array2<f64>,
        judging: Judging,
        provided: StageSet,
    }

    impl Fixture {
        fn frame<'a>(&'a self, cfg: &'a MlaConfig, sched: &'a Schedule) -> Frame<'a> {
            Frame {
                cfg,
                rope: &self.tables.rope,
                sched,
                x: &self.x,
                dtype: Dtype::Bf16,
                provided: self.provided,
                judging: &self.judging,
            }
        }
    }

    /// Every row of the stage table (`trace::STAGES`) has a stage-local rule, called from [`finish`]:
    /// the view of the CPU mirror's trace of a small layer holds each stage. A new stage row without a
    /// rule fails here (ARCHITECTURE.md, "A stage check", step 6).
    #[test]
    fn every_stage_row_has_a_local_rule() {
        let (opt, _, cfg, sched, fx) = small_layer(None);
        let inp = Inputs {
            weights: &fx.w,
            frame: fx.frame(&cfg, &sched),
        };
        let local = compute(&inp, &opt);
        for row in crate::trace::STAGES {
            assert!(
                local.stages.iter().any(|l| l.stage == row.stage),
                "stage {} has no stage-local rule",
                row.name
            );
        }
    }

    /// The judge's streamed comparison (the end-to-end part first, then each stage's view as
    /// [`finish_into`] hands it on, fed here in reverse order) reports what `compare_layer` reports
    /// over the whole view, byte for byte in JSON, on a clean layer and on one with a planted fault
    /// that the view catches.
    #[test]
    fn streamed_view_judges_as_the_whole_view() {
        for fault in [None, Some("kv_b_swap")] {
            let (opt, reference, cfg, sched, fx) = small_layer(fault);
            let block_table = sched.block_table();
            let ctx = crate::compare::Ctx {
                layer: 0,
                elementwise: true,
                sched: &sched,
                block_table: &block_table,
                provided: fx.provided,
            };
            let tols = crate::compare::ToleranceTable::defaults();
            let pre = || prepare(&cfg, &fx.w, Dtype::Bf16, &opt);
            let whole = finish(fx.frame(&cfg, &sched), &opt, pre(), None);
            let want = crate::compare::compare_layer(
                &ctx,
                &reference,
                &opt,
                Dtype::Bf16,
                &tols,
                Some(&whole),
            )
            .unwrap();
            let cmp = crate::compare::Streamed::new(&ctx, &reference, &opt, Dtype::Bf16, &tols);
            let mut given = Vec::new();
            finish_into(fx.frame(&cfg, &sched), &opt, pre(), None, &mut |l| {
                given.push(l)
            });
            assert_eq!(given.len(), whole.stages.len());
            for l in given.iter().rev() {
                cmp.stage(l);
            }
            let got = cmp.finish().0.unwrap();
            assert!(got.checks.iter().filter(|c| c.local.is_some()).count() > 5);
            assert_eq!(fault.is_some(), !want.pass, "{fault:?}");
            let json = |r: &crate::compare::LayerResult| serde_json::to_string(r).unwrap();
            assert_eq!(json(&got), json(&want), "{fault:?}");
        }
    }
}
