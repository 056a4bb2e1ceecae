//! What the attention stages share: their inputs as the path stored them (the queries, the cache),
//! W_UK and W_UV, how the path attends ([`Att`]), and the rows prefill and decode fill together: lse
//! and attn_heads ([`Heads`]).

use super::super::noise::Store;
use super::attend::{Attn, Path, Rows};
use super::linear::hidden_round;
use super::{opt2, Local, View};
use crate::precision::{Dtype, ScoreSum};
use crate::trace::Stage;
use ndarray::{Array2, ArrayView2};

/// The attention's inputs and how the path computes it.
pub(super) struct Att<'a> {
    /// `[T·H, ·]` views of the stored per-head query parts.
    pub(super) o_qn: Array2<f64>,
    pub(super) o_qpe: Array2<f64>,
    /// The stored cache rows `[T, Lkv+R]`.
    pub(super) cache: Array2<f64>,
    pub(super) w_uk: &'a Array2<f64>,
    pub(super) w_uv: &'a Array2<f64>,
    pub(super) scale: f64,
    pub(super) sum: ScoreSum,
    /// Whether the scores' sum truncates (`ScoreSum::truncates`).
    pub(super) tc: bool,
    /// Our kernels (the mirror's and CUDA's) store every LSE, split or merged, in f32.
    pub(super) lse_store: Option<Store>,
    pub(super) path: Path,
    /// A query part stored wider than the attention's type, rounded to it on the way in.
    pub(super) qn_wide: bool,
    pub(super) qp_wide: bool,
    /// An engine whose attention is unknown, over a cache in a type of its own, may attend in latent
    /// space (llama.cpp's absorbed MLA prefill: P·V over the cache's latent rows, summed in its type,
    /// then W_UV): each key's value rounded there, carried through W_UV, as well as in v space.
    pub(super) latent_values: bool,
    /// Whether the path's prefill reads the context's keys rounded to the attention type
    /// (`Judging::context_keys_in_dtype`): only then do their rounding errors enter the scores.
    pub(super) context_keys_in_dtype: bool,
    adt: Dtype,
}

impl<'a> Att<'a> {
    /// `None` where the trace lacks the stored q_nope, q_pe or cache_rows.
    pub(super) fn new(vw: &View, w_uk: &'a Array2<f64>, w_uv: &'a Array2<f64>) -> Option<Att<'a>> {
        let (f, opt, adt) = (vw.f, vw.opt, vw.adt);
        let (Some(o_qn), Some(o_qpe), Some(cache)) = (
            opt2(opt, Stage::QNope),
            opt2(opt, Stage::QPe),
            opt2(opt, Stage::CacheRows),
        ) else {
            return None;
        };
        let o_qn = o_qn
            .into_shape_with_order((vw.t_all * vw.h, vw.p))
            .expect("[T, H, P]");
        let o_qpe = o_qpe
            .into_shape_with_order((vw.t_all * vw.h, vw.r))
            .expect("[T, H, R]");
        let sum = f.judging.score_sum;
        let widen = |qs: Stage| vw.dt_of(qs).round_unit() < adt.round_unit();
        Some(Att {
            o_qn,
            o_qpe,
            cache,
            w_uk,
            w_uv,
            scale: f.cfg.softmax_scale,
            sum,
            tc: sum.truncates(),
            lse_store: f.judging.known_attention.then_some(Store::F32),
            path: Path {
                dt: adt,
                online: f.judging.known_attention,
                sum,
                p_e4m3: false,
            },
            qn_wide: widen(Stage::QNope),
            qp_wide: widen(Stage::QPe),
            latent_values: !f.judging.known_attention && opt.declared(Stage::CacheRows).is_some(),
            context_keys_in_dtype: f.judging.context_keys_in_dtype,
            adt,
        })
    }

    /// The variance a query part `q` stored wider than the attention's type (`wide`) adds to a score
    /// against the key part `k` (nothing where q is stored in the attention's type).
    pub(super) fn q_round(&self, wide: bool, q: &[f64], k: &[f64]) -> f64 {
        match wide {
            true => q
                .iter()
                .zip(k)
                .map(|(&a, &b)| b * b * hidden_round(self.adt, a))
                .sum(),
            false => 0.0,
        }
    }

    /// Each element's rounding error `round(k) − k` onto the attention type's grid, for key parts `k`
    /// an engine rounds on the way in; `None` where every one is on the grid (what a path stores in its
    /// own type: the common case, whose scores then carry nothing for it). The context's rows read
    /// from a quantized cache are such keys: `fp8`'s e4m3·scale with a scale of amax/448 is generally
    /// not a bf16/fp16 value, and vLLM's prefill gathers them dequantized into the model's dtype.
    /// Once per key, not per query and key ([`k_round`]).
    pub(super) fn key_round_errors(&self, k: ArrayView2<f64>) -> Option<Array2<f64>> {
        let st = Store::from(self.adt);
        let d = k.mapv(|b| st.round(b) - b);
        d.iter().any(|&x| x != 0.0).then_some(d)
    }
}

/// The variance a key part's rounding errors `d` ([`Att::key_round_errors`]) add to a score against the
/// query part `q`: each element's error exactly, as independent terms.
pub(super) fn k_round(q: &[f64], d: &[f64]) -> f64 {
    q.iter().zip(d).map(|(&a, &d)| a * a * d * d).sum()
}

/// An lse stage being assembled: values, variances and truncation biases.
pub(super) struct Lse {
    v: Vec<f64>,
    var: Vec<f64>,
    bias: Vec<f64>,
}

impl Lse {
    pub(super) fn new(n: usize) -> Lse {
        Lse {
            v: vec![0.0; n],
            var: vec![0.0; n],
            bias: vec![0.0; n],
        }
    }
    pub(super) fn set(&mut self, i: usize, a: &Attn) {
        self.v[i] = a.lse;
        self.var[i] = a.var_lse - a.lse_last;
        self.bias[i] = a.bias_lse;
    }
    pub(super) fn push_to(self, out: &mut Local, stage: Stage, att: &Att) {
        out.push(stage, self.v, self.var);
        out.with_truncation(att.tc, self.bias);
        out.with_store(att.lse_store);
    }
}

/// lse and attn_heads `[T·H, ·]`, filled by prefill's and decode's rules.
pub(super) struct Heads {
    pub(super) rows: Rows,
    pub(super) lse: Lse,
}

impl Heads {
    pub(super) fn new(n: usize, dv: usize) -> Heads {
        Heads {
            rows: Rows::new(n, dv),
            lse: Lse::new(n),
        }
    }
    /// lse, and attn_heads where the decode tokens' could be made (`heads_ok`: from the stored
    /// attn_latent).
    pub(super) fn push_to(self, out: &mut Local, att: &Att, heads_ok: bool) {
        self.lse.push_to(out, Stage::Lse, att);
        if heads_ok {
            self.rows.push_to(out, Stage::AttnHeads, att.tc);
        }
    }
}
