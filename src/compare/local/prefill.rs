//! lse[prefill] and attn_heads[prefill] ← the stored q_nope and q_pe, the chunk's own kv_latent and k_pe
//! and the context's cache_rows, decompressed with W_UK/W_UV as prefill does; chunk by chunk, each
//! chunk's own part and its context's merged.

use super::attend::{attend, cos2, merge, Attn, Gram};
use super::attention::{k_round, Att, Heads};
use super::linear::{hidden_round, linear, sl};
use super::score::{dot_var, score, Score};
use super::View;
use ndarray::{s, Array2, ArrayView2, Zip};
use rayon::prelude::*;

/// Keys and values decompressed from latent rows: k, its variance, v, its variance.
type Decompressed = (Array2<f64>, Array2<f64>, Array2<f64>, Array2<f64>);

/// Rope key parts and their rounding errors onto the attention type's grid (`Att::key_round_errors`;
/// `None`: all on it, or a path that reads them unrounded), shared by every head.
struct Kpe<'a> {
    rows: ArrayView2<'a, f64>,
    round: Option<Array2<f64>>,
}

impl<'a> Kpe<'a> {
    fn new(att: &Att, rows: ArrayView2<'a, f64>) -> Kpe<'a> {
        // Only a path that rounds them has their errors (a runner's prefill op, sent the keys in the
        // dtype); the CPU mirror attends over a quantized cache's rows as decoded, in f32.
        Kpe {
            rows,
            round: match att.context_keys_in_dtype {
                true => att.key_round_errors(rows),
                false => None,
            },
        }
    }
}

/// The prompt's rows of lse and attn_heads, from the stored latent `o_lat` and k_pe `o_kpe`.
pub(super) fn attend_prompt(
    vw: &View,
    att: &Att,
    o_lat: &Array2<f64>,
    o_kpe: &Array2<f64>,
    heads: &mut Heads,
) {
    let (h, pl) = (vw.h, vw.f.sched.prompt_len);
    if pl == 0 {
        return;
    }
    // The rope key parts are shared by every head: their rounding errors are found once.
    let kpe_own = Kpe::new(att, o_kpe.slice(s![..pl, ..]));
    let kpe_ctx = Kpe::new(att, att.cache.slice(s![..pl, vw.lkv..]));
    // Each head's prefill: independent, so in parallel.
    let per_head: Vec<Vec<Attn>> = (0..h)
        .into_par_iter()
        .map(|hh| head(vw, att, o_lat, (&kpe_own, &kpe_ctx), hh))
        .collect();
    for (hh, rows) in per_head.into_iter().enumerate() {
        // Chunks cover the prompt in order, so row t is token t.
        for (t, res) in rows.into_iter().enumerate() {
            heads.rows.put(t * h + hh, &res);
            heads.lse.set(t * h + hh, &res);
        }
    }
}

/// Head `hh`'s prefill rows, token by token.
fn head(
    vw: &View,
    att: &Att,
    o_lat: &Array2<f64>,
    (kpe_own, kpe_ctx): (&Kpe, &Kpe),
    hh: usize,
) -> Vec<Attn> {
    let (h, p, dv, lkv) = (vw.h, vw.p, vw.dv, vw.lkv);
    let (sched, pl, adt) = (vw.f.sched, vw.f.sched.prompt_len, vw.adt);
    let mut rows = Vec::with_capacity(pl);
    let uk = att.w_uk.slice(s![hh * p..(hh + 1) * p, ..]).to_owned();
    let uv = att.w_uv.slice(s![hh * dv..(hh + 1) * dv, ..]).to_owned();
    let decompress = |lat: ArrayView2<f64>| -> Decompressed {
        let (k, mut vk) = linear(lat, &uk);
        Zip::from(&mut vk)
            .and(&k)
            .for_each(|v, &y| *v += hidden_round(adt, y));
        let (v, mut vv) = linear(lat, &uv);
        Zip::from(&mut vv)
            .and(&v)
            .for_each(|x, &y| *x += hidden_round(adt, y));
        if att.latent_values {
            let r = lat.mapv(|y| super::super::noise::Store::from(adt).worst_round_var(y));
            vv += &r.dot(&uv.mapv(|w| w * w).t());
        }
        (k, vk, v, vv)
    };
    let own = decompress(o_lat.slice(s![..pl, ..]));
    // cos² between this head's values, for a row's degrees of freedom (`attend`); the
    // context's, decompressed from the cache, are the same rows rounded alike.
    let gram = (pl <= 2048).then(|| cos2(own.2.view()));
    // Context keys only where a chunk has context.
    let ctx =
        (sched.prefill_chunks().len() > 1).then(|| decompress(att.cache.slice(s![..pl, ..lkv])));
    let g = gram.as_deref();
    for c in sched.prefill_chunks() {
        for t in c.clone() {
            let qi = t * h + hh;
            let mine = part(vw, att, qi, c.start..t + 1, &own, kpe_own, g);
            let res = if c.start > 0 {
                // Each part's output is stored before the merge.
                let ctx = ctx.as_ref().expect("a chunk with context");
                let mut parts = [part(vw, att, qi, 0..c.start, ctx, kpe_ctx, g), mine];
                for pa in parts.iter_mut() {
                    for (v, &o) in pa.var.iter_mut().zip(&pa.out) {
                        *v += hidden_round(adt, o);
                    }
                }
                merge(&parts, att.path.sum)
            } else {
                mine
            };
            rows.push(res);
        }
    }
    rows
}

/// Query row `qi`'s attention over `keys` (those of them its token keeps) of `kv` with rope parts
/// `kpe`; `gram`: cos² between the prompt's values.
fn part(
    vw: &View,
    att: &Att,
    qi: usize,
    keys: std::ops::Range<usize>,
    (k, vk, v, vv): &Decompressed,
    kpe: &Kpe,
    gram: Option<&[f32]>,
) -> Attn {
    let t = qi / vw.h;
    let (scale, sum) = (att.scale, att.sum);
    let (qn, qp) = (att.o_qn.row(qi), att.o_qpe.row(qi));
    let keys: Vec<usize> = keys.filter(|&j| vw.keep(t, j)).collect();
    let sc: Vec<Score> = keys
        .iter()
        .map(|&j| {
            let d = dot_var(
                sl(qn),
                sl(k.row(j)),
                sl(vk.row(j)),
                sl(qp),
                sl(kpe.rows.row(j)),
                sum,
                att.path.dt,
            );
            let mut sc = score(d, scale, sum);
            sc.var += scale
                * scale
                * (att.q_round(att.qn_wide, sl(qn), sl(k.row(j)))
                    + att.q_round(att.qp_wide, sl(qp), sl(kpe.rows.row(j)))
                    + kpe
                        .round
                        .as_ref()
                        .map_or(0.0, |d| k_round(sl(qp), sl(d.row(j)))));
            sc
        })
        .collect();
    let g = gram.map(|g| Gram {
        g,
        stride: vw.f.sched.prompt_len,
        keys: &keys,
    });
    let vals: Vec<&[f64]> = keys
        .iter()
        .map(|&j| v.row(j).to_slice().expect("row"))
        .collect();
    let vvs: Vec<&[f64]> = keys
        .iter()
        .map(|&j| vv.row(j).to_slice().expect("row"))
        .collect();
    attend(&sc, &vals, Some(&vvs), vw.dv, att.path, g)
}
