//! cache_rows ← the stored kv_latent and k_pe: a copy, exact in the dtype or in a cache type of its own,
//! within the format's rounding bound in a quantized cache format.

use super::super::noise::Store;
use super::linear::rows_f32;
use super::{Local, View};
use crate::trace::Stage;
use ndarray::Array2;

/// cache_rows from the stored latent `o_lat` and k_pe `o_kpe`.
pub(super) fn rows(vw: &View, o_lat: &Array2<f64>, o_kpe: &Array2<f64>, out: &mut Local) {
    let (opt, lkv, r, t_all) = (vw.opt, vw.lkv, vw.r, vw.t_all);
    let mut rows = Vec::with_capacity(t_all * (lkv + r));
    for t in 0..t_all {
        rows.extend(o_lat.row(t).iter().chain(o_kpe.row(t).iter()));
    }
    // In a cache of a type of its own (an f16 cache of f32 rows): a copy rounded to it.
    if let Some(c) = opt.declared(Stage::CacheRows) {
        rows.iter_mut().for_each(|v| *v = Store::from(c).round(*v));
    }
    let n_rows = rows.len();
    // A quantized cache: each element within the format's rounding bound b, its variance b²/3 (rounding
    // uniform over a step of 2b).
    let bound = (!opt.cache_format.is_auto()).then(|| {
        let codec = crate::kv_format::Codec::new(opt.cache_format, lkv, r)
            .with_tensor_scale(crate::kv_format::tensor_scale(&rows_f32(&rows)));
        rows.chunks(lkv + r)
            .flat_map(|x| codec.bound(x))
            .collect::<Vec<f64>>()
    });
    let mut var: Vec<f64> = match &bound {
        Some(b) => b.iter().map(|b| b * b / 3.0).collect(),
        None => vec![0.0; n_rows],
    };
    // A reader that rounds the decoded q·s to its type: half that type's spacing at |q·s| ≤ |x| + b
    // more, rounding uniform over it.
    let bound = match (bound, opt.cache_dequant.map(Store::from)) {
        (Some(mut b), Some(st)) => {
            for ((b, v), x) in b.iter_mut().zip(&mut var).zip(&rows) {
                let half = st.ulp(x.abs() + *b) / 2.0;
                *b += half;
                *v += half * half / 3.0;
            }
            Some(b)
        }
        (b, _) => b,
    };
    out.push(Stage::CacheRows, rows, var);
    let last = out.stages.last_mut().expect("pushed");
    last.exact = true;
    last.bound = bound;
}
