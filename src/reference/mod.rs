//! The fp64 references of one layer's attention.
//!
//! Reference A (`mha`) is the decompressed multi-head form, reference B (`absorbed`) the absorbed MQA form
//! over latent rows. Both share the stages before attention (`front`) and agree to f64 rounding; where
//! they do not, one of them misreads a layout. `run_layer` records one trace: the shared stages and the
//! per-token lse from A, the decode-only stages (absorbed query, split partials, latent output) from B.

pub mod absorbed;
pub mod front;
pub mod indexer;
pub mod kpool;
pub mod mha;
pub mod sparse;
pub mod v4;

use crate::error::{Error, Result};
use crate::model::{LayerWeights, MlaConfig, QProj};
use crate::rope::RopeTables;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage, StageTensor};
use ndarray::{Array, Array2, Dimension};

pub use absorbed::LatentAttention;
pub use front::Front;
pub use mha::AttnOutput;

/// Turn scores into probabilities in place; returns their log-sum-exp (natural log, −inf when empty).
pub fn softmax_in_place(s: &mut [f64]) -> f64 {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        s.fill(0.0);
        return f64::NEG_INFINITY;
    }
    let mut l = 0.0;
    for v in s.iter_mut() {
        *v = (*v - m).exp();
        l += *v;
    }
    s.iter_mut().for_each(|v| *v /= l);
    m + l.ln()
}

/// Check that weights, tables, input and schedule fit together (bad input is an error, never a panic).
pub fn check_inputs(
    cfg: &MlaConfig,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    sched: &Schedule,
) -> Result<()> {
    sched.validate()?;
    let t = sched.total_tokens();
    if x.dim() != (t, cfg.hidden) {
        return Err(Error::Usage(format!(
            "layer input is [{}, {}], the schedule needs [{t}, {}] (prompt {} + {} decode steps × {})",
            x.nrows(),
            x.ncols(),
            cfg.hidden,
            sched.prompt_len,
            sched.decode_steps,
            sched.q_len
        )));
    }
    // Non-finite inputs are not rejected here: user inputs are checked when loaded (input.rs), and in
    // free-running mode a NaN produced by the optimized path must flow on, as it would in an engine.
    if rope.pos_start != sched.pos_offset || rope.n_pos() < t || rope.dim != cfg.qk_rope {
        return Err(Error::Usage(format!(
            "rope tables cover {} positions from {} with {} dims; the run needs {t} from {} with {}",
            rope.n_pos(),
            rope.pos_start,
            rope.dim,
            sched.pos_offset,
            cfg.qk_rope
        )));
    }
    check_weights(cfg, w)
}

/// Shapes of the weights against the config (weights built in memory bypass the loader's checks).
pub fn check_weights(cfg: &MlaConfig, w: &LayerWeights) -> Result<()> {
    let (e, h, lkv, r) = (cfg.hidden, cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope);
    let (p, dk, dv) = (cfg.qk_nope, cfg.qk_head_dim(), cfg.v_head_dim);
    let mut want: Vec<(&str, Vec<usize>, Vec<usize>)> = vec![
        ("attn_norm", w.attn_norm.shape().to_vec(), vec![e]),
        ("kv_a", w.kv_a.shape().to_vec(), vec![lkv + r, e]),
        ("kv_a_norm", w.kv_a_norm.shape().to_vec(), vec![lkv]),
        ("w_uk", w.w_uk.shape().to_vec(), vec![h, p, lkv]),
        ("w_uv", w.w_uv.shape().to_vec(), vec![h, dv, lkv]),
        ("o", w.o.shape().to_vec(), vec![e, h * dv]),
    ];
    match (&w.q, cfg.q_lora_rank) {
        (QProj::Lora { a, a_norm, b }, Some(lq)) => {
            want.push(("q_a", a.shape().to_vec(), vec![lq, e]));
            want.push(("q_a_norm", a_norm.shape().to_vec(), vec![lq]));
            want.push(("q_b", b.shape().to_vec(), vec![h * dk, lq]));
        }
        (QProj::Plain { q }, None) => want.push(("q", q.shape().to_vec(), vec![h * dk, e])),
        _ => {
            return Err(Error::Tensor(format!(
                "layer {}: the query projection does not match the config's q_lora_rank {:?}",
                w.layer, cfg.q_lora_rank
            )))
        }
    }
    for (name, got, exp) in want {
        if got != exp {
            return Err(Error::Tensor(format!(
                "layer {}: weight {name} is {got:?}, the config needs {exp:?}",
                w.layer
            )));
        }
    }
    Ok(())
}

fn stage<D: Dimension>(s: Stage, a: &Array<f64, D>) -> StageTensor {
    StageTensor::new(s, a.shape().to_vec(), a.iter().copied().collect())
}

/// The fp64 trace of one layer on the schedule's tokens (`x`: `[T, hidden]`, before attn_norm).
pub fn run_layer(
    cfg: &MlaConfig,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    sched: &Schedule,
) -> Result<LayerTrace> {
    run_layer_sel(cfg, w, rope, x, sched, None)
}

/// `run_layer` for a DSA layer: attention over the keys `sel` keeps (`None`: dense).
pub fn run_layer_sel(
    cfg: &MlaConfig,
    w: &LayerWeights,
    rope: &RopeTables,
    x: &Array2<f64>,
    sched: &Schedule,
    sel: Option<&sparse::Selection>,
) -> Result<LayerTrace> {
    check_inputs(cfg, w, rope, x, sched)?;
    // The reference is of the file's values; weights rounded in place are an optimized path's.
    assert!(
        w.as_read(),
        "layer {}: the reference of rounded weights",
        w.layer
    );
    let t = sched.total_tokens();
    if let Some(s) = sel {
        if s.n_queries() != t {
            return Err(Error::Usage(format!(
                "the DSA selection covers {} queries, the schedule has {t} tokens",
                s.n_queries()
            )));
        }
    }
    let f = front::front(cfg, w, rope, x.view());
    let a = mha::attention_sel(cfg, w, &f, sel);
    let dec = sched.prompt_len..t;
    let b = absorbed::latent_attention_sel(cfg, w, &f, dec.clone(), sel);
    let (split_out, split_lse) = absorbed::split_partials(&b.scores, &f.latent, dec, sched);
    let mut tr = LayerTrace::new(w.layer);
    tr.push(stage(Stage::AttnIn, &f.attn_in));
    tr.push(stage(Stage::QNope, &f.q_nope));
    tr.push(stage(Stage::QPe, &f.q_pe));
    tr.push(stage(Stage::KvLatent, &f.latent));
    tr.push(stage(Stage::KPe, &f.k_pe));
    tr.push(stage(Stage::CacheRows, &front::cache_rows(&f)));
    tr.push(stage(Stage::QAbsorbed, &b.q_abs));
    tr.push(stage(Stage::SplitOut, &split_out));
    tr.push(stage(Stage::SplitLse, &split_lse));
    tr.push(stage(Stage::AttnLatent, &b.latent_out));
    tr.push(stage(Stage::Lse, &a.lse));
    tr.push(stage(Stage::AttnHeads, &a.heads));
    tr.push(stage(Stage::AttnOut, &a.out));
    Ok(tr)
}

/// Floating-point operations of `run_layer` (multiply-add = 2), counting the matrix products and the
/// attention score/value products; norms, rope and softmax are lower-order and left out.
pub fn run_layer_flops(cfg: &MlaConfig, sched: &Schedule) -> f64 {
    let t = sched.total_tokens() as f64;
    let d = sched.decode_tokens() as f64;
    let (e, h, lkv, r) = (
        cfg.hidden as f64,
        cfg.n_head as f64,
        cfg.kv_lora_rank as f64,
        cfg.qk_rope as f64,
    );
    let (p, dk, dv) = (
        cfg.qk_nope as f64,
        cfg.qk_head_dim() as f64,
        cfg.v_head_dim as f64,
    );
    let q = match cfg.q_lora_rank {
        Some(lq) => e * lq as f64 + lq as f64 * h * dk,
        None => e * h * dk,
    };
    let proj = t * (q + e * (lkv + r) + h * dv * e);
    let decompress = t * h * lkv * (p + dv);
    // A computes full T×T score and value products per head (the mask is applied afterwards).
    let mha = t * t * h * (dk + dv);
    // B on the decode rows: absorb, scores over keys up to the last token, latent output; the split
    // partials redo the latent products.
    let absorbed = d * h * (p * lkv + t * (lkv + r) + 2.0 * t * lkv);
    2.0 * (proj + decompress + mha + absorbed)
}
