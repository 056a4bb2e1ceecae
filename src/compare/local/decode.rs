//! The decode tokens' attention stages: q_absorbed ← q_nope; split_out and split_lse ← q_absorbed,
//! q_pe and cache_rows; attn_latent and lse[decode] ← the splits merged (from the stored partials when
//! the backend exposes them); attn_heads[decode] ← the stored attn_latent through W_UV.

use super::super::noise::Store;
use super::attend::{attend, cos2, merge, Attn, Gram, Path, Rows};
use super::attention::{Att, Heads, Lse};
use super::linear::{hidden_round, linear, row};
use super::qk_acc::score_acc;
use super::score::{dot_var, score, Score};
use super::{opt2, Local, View};
use crate::trace::{Stage, StageTensor};
use ndarray::{s, Array2, Zip};
use rayon::prelude::*;

/// What every decode query's splits read, made once per layer.
struct Splits<'a> {
    /// The cache rows `[T, Lkv+R]` as the path's decode reads them: the stored rows, or, where it
    /// rounds them to the attention type after dequantizing (`Judging::decode_cache_in_dtype`), those
    /// rows rounded: their error is known exactly (`Att::key_round_errors`), so it is applied, not
    /// modelled as noise.
    rows: std::borrow::Cow<'a, Array2<f64>>,
    /// How the splits attend: the path's, P rounded to e4m3 where it declares so.
    path: Path,
    /// The query the splits see `[D·H, Lkv]` and its variance.
    qa: Array2<f64>,
    vqa: Array2<f64>,
    /// The decode rows of q_pe `[D·H, R]` on the e4m3 grid the path read q on (`LayerTrace::q_scale`;
    /// `qa` then on it too); `None`: the stored q_pe as it is.
    qp: Option<Array2<f64>>,
    /// The fraction bits of the path's QKᵀ accumulator where it is not f32 (`Judging::decode_qk_acc`).
    qk_acc: Option<u32>,
    ns: usize,
    /// cos² between the cache's latent rows (`None`: too many tokens).
    gram: Option<Vec<f32>>,
    /// The stored partials (split_out, split_lse) where the backend exposes them.
    stored: Option<(&'a StageTensor, &'a StageTensor)>,
    /// The types the stored partials were returned in, for a backend whose attention is unknown.
    types: Option<(Store, Store)>,
}

/// The decode tokens' stages, their rows of lse and attn_heads into `heads`; false where the trace
/// lacks the attn_latent attn_heads[decode] needs.
pub(super) fn attend_decode(vw: &View, att: &Att, heads: &mut Heads, out: &mut Local) -> bool {
    let (h, lkv) = (vw.h, vw.lkv);
    let (f, opt, sched) = (vw.f, vw.opt, vw.f.sched);
    let (pl, nd) = (sched.prompt_len, sched.decode_tokens());
    if nd == 0 {
        return true;
    }
    let (mut qa, vqa) = q_absorbed(vw, att, out);
    // A kernel that reads q in e4m3 attends over q on the grid it was sent (`conventions.q_fp8`):
    // the same rounding of the same stored q, so the splits the view merges are over the q the
    // kernel read, not the q computed (that difference is q's exact effect, the end-to-end checks').
    let qp = vw.opt.q_scale.map(|s| {
        let grid = |v: f64| crate::kv_format::e4m3_on_grid(v, s);
        qa.mapv_inplace(grid);
        att.o_qpe.slice(s![pl * h..(pl + nd) * h, ..]).mapv(grid)
    });
    let ns = sched.num_splits;
    let stored = match (opt.get(Stage::SplitOut), opt.get(Stage::SplitLse)) {
        (Some(o), Some(l))
            if f.provided.contains(Stage::SplitOut) && f.provided.contains(Stage::SplitLse) =>
        {
            Some((o, l))
        }
        _ => None,
    };
    let rows = match f.judging.decode_cache_in_dtype {
        true => match att.key_round_errors(att.cache.view()) {
            Some(d) => std::borrow::Cow::Owned(&att.cache + &d),
            None => std::borrow::Cow::Borrowed(&att.cache),
        },
        false => std::borrow::Cow::Borrowed(&att.cache),
    };
    let sp = Splits {
        path: Path {
            p_e4m3: f.judging.decode_p_e4m3,
            ..att.path
        },
        qa,
        vqa,
        qp,
        qk_acc: f.judging.decode_qk_acc,
        ns,
        // cos² between the cache's latent rows (the decode values), once per layer: what a split
        // row's degrees of freedom need (`attend`); up to 4096 tokens (64 MB), else the old estimate.
        gram: (vw.t_all <= 4096).then(|| cos2(rows.slice(s![.., ..lkv]))),
        stored,
        rows,
        // The types the stored partials were returned in (inferred from their values, as the judge
        // infers every stored type).
        types: stored
            .filter(|_| !f.judging.known_attention)
            .map(|(o, l)| (Store::infer(&o.data), Store::infer(&l.data))),
    };
    let mut split_out = Rows::new(nd * h * ns, lkv);
    let mut split_lse = Lse::new(nd * h * ns);
    let mut latent = Rows::new(nd * h, lkv);
    for d in 0..nd {
        let t = pl + d;
        // Each head's splits and combine: independent, so in parallel.
        let per_head: Vec<(Vec<Attn>, Attn)> = (0..h)
            .into_par_iter()
            .map(|hh| head(vw, att, &sp, d, hh))
            .collect();
        for (hh, (parts, merged)) in per_head.into_iter().enumerate() {
            let qi = d * h + hh;
            for (k, pa) in parts.iter().enumerate() {
                split_out.put(qi * ns + k, pa);
                split_lse.set(qi * ns + k, pa);
            }
            latent.put(qi, &merged);
            heads.lse.set(t * h + hh, &merged);
        }
    }
    split_out.push_to(out, Stage::SplitOut, att.tc);
    split_lse.push_to(out, Stage::SplitLse, att);
    latent.push_to(out, Stage::AttnLatent, att.tc);
    heads_from_latent(vw, att, heads)
}

/// q_absorbed ← the stored q_nope through W_UK; returns the query the splits see: the stored
/// q_absorbed when exposed, else ours with its rounding.
fn q_absorbed(vw: &View, att: &Att, out: &mut Local) -> (Array2<f64>, Array2<f64>) {
    let (h, p, lkv) = (vw.h, vw.p, vw.lkv);
    let (pl, nd) = (vw.f.sched.prompt_len, vw.f.sched.decode_tokens());
    let o_qabs = opt2(vw.opt, Stage::QAbsorbed)
        .filter(|_| vw.f.provided.contains(Stage::QAbsorbed))
        .map(|a| a.into_shape_with_order((nd * h, lkv)).expect("[D, H, Lkv]"));
    let mut qabs = Array2::<f64>::zeros((nd * h, lkv));
    let mut vqabs = Array2::<f64>::zeros((nd * h, lkv));
    for hh in 0..h {
        let uk = att.w_uk.slice(s![hh * p..(hh + 1) * p, ..]).to_owned();
        let rows: Vec<usize> = (0..nd).map(|d| (pl + d) * h + hh).collect();
        let qn = att.o_qn.select(ndarray::Axis(0), &rows);
        let (a, va) = linear(qn.view(), &uk.t().to_owned());
        for d in 0..nd {
            qabs.row_mut(d * h + hh).assign(&a.row(d));
            vqabs.row_mut(d * h + hh).assign(&va.row(d));
        }
    }
    out.push(
        Stage::QAbsorbed,
        qabs.iter().copied().collect(),
        vqabs.iter().copied().collect(),
    );
    match o_qabs {
        Some(o) => {
            let z = Array2::zeros(o.dim());
            (o, z)
        }
        None => {
            let mut v = vqabs.clone();
            Zip::from(&mut v)
                .and(&qabs)
                .for_each(|x, &y| *x += hidden_round(vw.adt, y));
            (qabs, v)
        }
    }
}

/// Decode token `d`, head `hh`: its splits and their combine.
fn head(vw: &View, att: &Att, sp: &Splits, d: usize, hh: usize) -> (Vec<Attn>, Attn) {
    let (h, lkv, sched) = (vw.h, vw.lkv, vw.f.sched);
    let (scale, sum, cache) = (att.scale, att.sum, &*sp.rows);
    let t = sched.prompt_len + d;
    let seq_len = sched.prompt_len + (d / sched.q_len + 1) * sched.q_len;
    let qi = d * h + hh;
    let (qa, vqa) = (row(&sp.qa, qi), row(&sp.vqa, qi));
    let qp = match &sp.qp {
        Some(q) => row(q, qi),
        None => row(&att.o_qpe, t * h + hh),
    };
    // q_pe on its e4m3 grid is what the kernel reads (exact in the dtype): no rounding on the way.
    let qp_wide = att.qp_wide && sp.qp.is_none();
    let score_of = |j: usize| {
        let (lt, kp) = row(cache, j).split_at(lkv);
        let mut sc = match sp.qk_acc {
            Some(nb) => score_acc(lt, qa, vqa, kp, qp, nb, scale),
            None => score(dot_var(lt, qa, vqa, kp, qp, sum, sp.path.dt), scale, sum),
        };
        sc.var += scale * scale * att.q_round(qp_wide, qp, kp);
        sc
    };
    let parts: Vec<Attn> = sched
        .split_ranges(seq_len)
        .iter()
        .map(|sr| {
            let keys: Vec<usize> = (sr.start..sr.end.min(t + 1))
                .filter(|&j| vw.keep(t, j))
                .collect();
            let sc: Vec<Score> = keys.iter().map(|&j| score_of(j)).collect();
            let vals: Vec<&[f64]> = keys.iter().map(|&j| &row(cache, j)[..lkv]).collect();
            let g = sp.gram.as_ref().map(|g| Gram {
                g,
                stride: vw.t_all,
                keys: &keys,
            });
            attend(&sc, &vals, None, lkv, sp.path, g)
        })
        .collect();
    // The combine, from the stored partials when the backend exposes them.
    // (Exact when the path merges what it stored; else with a fresh computation's noise.)
    let merged = match sp.stored {
        Some((o, l)) => {
            let stored: Vec<Attn> = (0..sp.ns)
                .map(|k| stored_part(vw, sp, (o, l), qi * sp.ns + k, &parts[k]))
                .collect();
            merge(&stored, att.path.sum)
        }
        None => merge(&parts, att.path.sum),
    };
    (parts, merged)
}

/// The stored partial `at` (of split_out `o`, split_lse `l`) as the merge sees it; `ours`: the split
/// recomputed.
fn stored_part(
    vw: &View,
    sp: &Splits,
    (o, l): (&StageTensor, &StageTensor),
    at: usize,
    ours: &Attn,
) -> Attn {
    let lkv = vw.lkv;
    let out = o.data[at * lkv..(at + 1) * lkv].to_vec();
    let lse = l.data[at];
    match vw.f.judging.known_attention {
        true => Attn {
            out,
            lse,
            ..Attn::empty(lkv)
        },
        // An external kernel merges its own (unstored) partials: ours carry a fresh computation's
        // noise plus the rounding of the type it returned them in (a bf16 split_lse moves the
        // weights by up to 2⁻⁹·|lse|).
        false => {
            let (so, sl) = sp.types.expect("with splits");
            let mut var = ours.var.clone();
            var.iter_mut()
                .zip(&out)
                .for_each(|(v, &o)| *v += so.round_var(o));
            Attn {
                var_lse: ours.var_lse + sl.round_var(lse),
                out,
                lse,
                var,
                bias_out: ours.bias_out.clone(),
                ..*ours
            }
        }
    }
}

/// attn_heads[decode] ← the stored attn_latent, in the run's dtype: what W_UV multiplies (an engine
/// stores the latent in it; a runner may return it wider, and is then rounded the same way,
/// `runner::decode::put_decode_outputs`). A no-op for paths that store it in the dtype. False where the
/// trace lacks attn_latent.
fn heads_from_latent(vw: &View, att: &Att, heads: &mut Heads) -> bool {
    let (h, dv, lkv) = (vw.h, vw.dv, vw.lkv);
    let (pl, nd) = (vw.f.sched.prompt_len, vw.f.sched.decode_tokens());
    let Some(o_att) = opt2(vw.opt, Stage::AttnLatent) else {
        return false;
    };
    let o_att = o_att
        .mapv(|v| vw.dt_of(Stage::AttnLatent).round(v as f32) as f64)
        .into_shape_with_order((nd * h, lkv))
        .expect("[D, H, Lkv]");
    for hh in 0..h {
        let uv = att.w_uv.slice(s![hh * dv..(hh + 1) * dv, ..]).to_owned();
        let rows: Vec<usize> = (0..nd).map(|d| d * h + hh).collect();
        let (y, v) = linear(o_att.select(ndarray::Axis(0), &rows).view(), &uv);
        for d in 0..nd {
            let at = ((pl + d) * h + hh) * dv;
            heads.rows.out[at..at + dv].copy_from_slice(y.row(d).as_slice().expect("row"));
            heads.rows.var[at..at + dv].copy_from_slice(v.row(d).as_slice().expect("row"));
        }
    }
    true
}
