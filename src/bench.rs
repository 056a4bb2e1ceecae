//! Benchmarks (commands, not timed tests). `reference`: the fp64 reference of one synthetic layer next
//! to a plain f64 matrix product of the same FLOP count on this machine.

pub mod load;

use crate::error::Result;
use crate::input::random_hidden;
use crate::model::synthetic::{self, Dims, Family};
use crate::reference;
use crate::rope::RopeTables;
use crate::schedule::Schedule;
use ndarray::Array2;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct ReferenceBench {
    pub family: String,
    pub hidden: usize,
    pub n_head: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
    pub tokens: usize,
    pub decode_tokens: usize,
    pub threads: usize,
    /// Counted FLOPs of one `reference::run_layer` (`reference::run_layer_flops`).
    pub flops: f64,
    /// Best of `reps` runs.
    pub reference_s: f64,
    /// `[tokens, hidden] · [hidden, n]` in f64 with `2·tokens·hidden·n ≈ flops`, best of `reps`.
    pub gemm_s: f64,
    pub gemm_n: usize,
    pub ratio: f64,
    pub reference_gflops: f64,
    pub gemm_gflops: f64,
}

fn time(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t0 = Instant::now();
    f()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Time the fp64 reference of one synthetic layer of `family` with `dims` on a schedule of `tokens`
/// tokens (the last `decode_steps` of them decoded one at a time).
pub fn reference(
    family: Family,
    dims: Dims,
    tokens: usize,
    decode_steps: usize,
    reps: usize,
) -> Result<ReferenceBench> {
    let cfg = family.config(dims);
    let sched = Schedule {
        prompt_len: tokens.saturating_sub(decode_steps),
        decode_steps: decode_steps.min(tokens),
        q_len: 1,
        ..Schedule::default()
    };
    sched.validate()?;
    let t = sched.total_tokens();
    let w = synthetic::weights(&cfg, 1);
    let factors = synthetic::rope_factors(&cfg, 2);
    let rope = RopeTables::for_run(&cfg, factors.as_ref(), sched.pos_offset, t)?;
    let x = random_hidden(cfg.hidden, t, 3);
    let flops = reference::run_layer_flops(&cfg, &sched);
    let gemm_n = ((flops / (2.0 * t as f64 * cfg.hidden as f64)).round() as usize).max(1);
    let a = Array2::from_shape_fn((t, cfg.hidden), |(i, j)| {
        ((i * 7 + j * 13) % 17) as f64 - 8.0
    });
    let b = Array2::from_shape_fn((cfg.hidden, gemm_n), |(i, j)| {
        ((i * 5 + j * 11) % 19) as f64 - 9.0
    });
    // Interleaved, best of each: other load on the machine hits both sides alike.
    let (mut reference_s, mut gemm_s) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps.max(1) {
        reference_s = reference_s.min(time(|| {
            reference::run_layer(&cfg, &w, &rope, &x, &sched).map(|_| ())
        })?);
        gemm_s = gemm_s.min(time(|| {
            std::hint::black_box(a.dot(&b));
            Ok(())
        })?);
    }
    let gemm_flops = 2.0 * t as f64 * cfg.hidden as f64 * gemm_n as f64;
    Ok(ReferenceBench {
        family: family.name().into(),
        hidden: cfg.hidden,
        n_head: cfg.n_head,
        q_lora_rank: cfg.q_lora_rank,
        kv_lora_rank: cfg.kv_lora_rank,
        qk_nope: cfg.qk_nope,
        qk_rope: cfg.qk_rope,
        v_head_dim: cfg.v_head_dim,
        tokens: t,
        decode_tokens: sched.decode_tokens(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        flops,
        reference_s,
        gemm_s,
        gemm_n,
        ratio: reference_s / gemm_s,
        reference_gflops: flops / reference_s / 1e9,
        gemm_gflops: gemm_flops / gemm_s / 1e9,
    })
}

impl ReferenceBench {
    pub fn text(&self) -> String {
        format!(
            "fp64 reference, one {} layer (hidden {}, {} heads, q_lora {}, kv_lora {}, {}/{}/{}), {} tokens ({} decode), {} threads\n\
             reference   {:8.3} s   {:6.1} GFLOP counted   {:6.2} GFLOP/s\n\
             f64 GEMM    {:8.3} s   [{} x {}]·[{} x {}]        {:6.2} GFLOP/s\n\
             ratio       {:8.2}x  (goal <= 2x)\n",
            self.family,
            self.hidden,
            self.n_head,
            self.q_lora_rank.map_or("none".into(), |r| r.to_string()),
            self.kv_lora_rank,
            self.qk_nope,
            self.qk_rope,
            self.v_head_dim,
            self.tokens,
            self.decode_tokens,
            self.threads,
            self.reference_s,
            self.flops / 1e9,
            self.reference_gflops,
            self.gemm_s,
            self.tokens,
            self.hidden,
            self.hidden,
            self.gemm_n,
            self.gemm_gflops,
            self.ratio
        )
    }
}
