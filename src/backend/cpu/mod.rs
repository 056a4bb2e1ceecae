//! The CPU mirror of the fused serving path: the executable specification the CUDA kernels implement.
//!
//! Precision: weights and activations are stored in `dtype` (bf16, fp16 or f32); every dot product is
//! accumulated in f32; `round` below means `Dtype::round`, applied wherever a kernel writes a result to
//! memory. Scores, softmax statistics and split partials stay in f32.
//!
//! Row-wise stages (every token independently, `front.rs`):
//! - `x = round(x)`; `attn_in = round(RMSNorm_f32(x) · round(w_attn_norm))`
//!   (RMSNorm: `r = 1/sqrt(Σx²/n + eps)` in f32, `y = x·r·w`);
//! - q-LoRA: `q_a = round(attn_in·W_qaᵀ)`, `q_a = round(RMSNorm(q_a)·w)`, `q = round(q_a·W_qbᵀ)`;
//!   plain: `q = round(attn_in·W_qᵀ)`; per head `[q_nope(P) | q_pe(R)]`, `q_pe = round(rope_f32(q_pe))`;
//! - `kv = round(attn_in·W_kvaᵀ)`, `latent = round(RMSNorm(kv[:Lkv])·w)`, `k_pe = round(rope_f32(kv[Lkv:]))`;
//! - rope uses the f64 tables of `crate::rope` cast to f32: `x0' = round(x0·c − x1·s)`, `x1' = round(x0·s + x1·c)`.
//!
//! Paged cache (`cache.rs`): a pool of `Schedule::pool_pages()·page_size` rows of width `Lkv+R`, all NaN
//! at start. The rows `[latent | k_pe]` of a prefill chunk or decode step are written through the block
//! table (`table[t / page] · page + t % page`) before that chunk's or step's attention.
//!
//! Flash attention (`flash.rs`): online softmax over tiles of 64 keys from the start of the key range,
//! score `s = (q_a·k_a + q_b·k_b)·scale` in f32 (two dot products, nope/latent and rope parts), per tile
//! `m' = max(m, max s)`, `l, acc *= exp(m − m')`, `p = exp(s − m')`, `l += p` (unrounded f32),
//! `acc += round(p)·v`; result `out = acc/l`, `lse = m + ln l` (natural log); no key: out 0, lse −inf.
//! A merge of parts by lse: `m = max lse`, weights `exp(lse − m)` (0 for lse −inf), `out = Σw·o/Σw`,
//! `lse = m + ln Σw`, all f32.
//!
//! Prefill (`prefill.rs`), chunks of `Schedule::prefill_chunks`: keys/values of the chunk from its fresh
//! latent, `k_nope = round(W_UK·latent)`, `v = round(W_UV·latent)`, causal flash attention → `o = round(out)`.
//! With cached context (`c0 > 0`): rows `0..c0` gathered from the cache, decompressed the same way,
//! non-causal flash attention → `o_ctx = round(out)`, then the merge of (context, chunk) → `round(out)`,
//! merged lse (vLLM `merge_attn_states`).
//!
//! Decode (`decode.rs`), steps of `Schedule::decode_ranges` (q_len ≥ 1, keys `0..seq_len` with `seq_len`
//! the step's end, causal within the step): `q_abs = round(W_UK[h]ᵀ·q_nope[h])` (f32 accumulation; fp16
//! may overflow to inf, as real engines do), query `[q_abs | q_pe]` over cache rows `[latent | k_pe]`
//! read through the block table, splits of `Schedule::split_ranges(seq_len)`, each a flash attention over
//! its keys visible to the query with value = latent (a split with none: out 0, lse −inf), partials kept
//! in f32; merged → `attn_latent = round(out)`, lse; `attn_heads = round(W_UV[h]·attn_latent)`.
//!
//! Finally `attn_out = round(attn_heads·W_oᵀ)`. The trace has every stage in the reference's shapes;
//! `cache_rows` is read back from the pool in token order after all writes.
//!
//! Planted bugs (`crate::faults`, `LayerCtx::faults`): each fault changes only the stage function it
//! models, through a small match at that point; with no fault active the path above is unchanged.

pub mod cache;
pub mod decode;
pub mod flash;
pub mod front;
pub mod indexer;
pub mod kpool;
pub mod ops;
pub mod prefill;
pub mod serving;
pub mod v4;

use super::common::kernel_scale;
use super::{Backend, LayerCtx};
use crate::error::Result;
use crate::faults::Fault;
use crate::precision::Dtype;
use crate::trace::{LayerTrace, Stage, StageSet, StageTensor};
use ndarray::{Array, Array2, Array3, Dimension};

/// The row-wise stages of all tokens, in the dtype.
#[derive(Debug, Clone)]
pub struct MirrorFront {
    pub attn_in: Array2<f32>,
    pub q_nope: Array3<f32>,
    pub q_pe: Array3<f32>,
    pub latent: Array2<f32>,
    pub k_pe: Array2<f32>,
    /// The stored kv_a output `[T, Lkv+R]` before kv_a_norm and rope (read only by cache-write faults).
    pub kv_raw: Array2<f32>,
}

/// `a[i, j, :]` of a standard-layout array.
#[inline]
pub fn row3(a: &Array3<f32>, i: usize, j: usize) -> &[f32] {
    let (_, n1, n2) = a.dim();
    let at = (i * n1 + j) * n2;
    &a.as_slice().expect("standard layout")[at..at + n2]
}

/// The serving path at the engine's precision, on the CPU.
#[derive(Debug, Clone)]
pub struct CpuMirror {
    pub dtype: Dtype,
    /// The serving batch's checks of every layer run so far (`serving`, JSON `runner_checks`).
    batch: crate::backend::serving::Record,
    /// A bug planted in the serving batch's combine (tests only, `serving::Plant`).
    plant: Option<serving::Plant>,
    /// The latent cache's byte format (`run --kv-cache-dtype`; `auto`: the dtype).
    kv: crate::kv_format::KvFormat,
}

impl CpuMirror {
    pub fn new(dtype: Dtype) -> CpuMirror {
        CpuMirror {
            dtype,
            batch: Default::default(),
            plant: None,
            kv: Default::default(),
        }
    }

    /// The mirror storing its latent cache in `kv` (`crate::kv_format`).
    pub fn with_kv_format(mut self, kv: crate::kv_format::KvFormat) -> CpuMirror {
        self.kv = kv;
        self
    }

    /// The mirror with a bug planted in its serving batch's combine (`serving::Plant`).
    pub fn with_plant(mut self, plant: serving::Plant) -> CpuMirror {
        self.plant = Some(plant);
        self
    }
}

fn stage<D: Dimension>(s: Stage, a: &Array<f32, D>) -> StageTensor {
    StageTensor::new(s, a.shape().to_vec(), a.iter().map(|&v| v as f64).collect())
}

impl MirrorFront {
    /// The row-wise stages of every token (`front.rs`): the stored input, attn_in, the query split
    /// into q_nope and roped q_pe, the normed latent and roped k_pe.
    fn new(
        cfg: &crate::model::MlaConfig,
        mw: &front::MirrorWeights,
        x: &Array2<f64>,
        rope: &front::RopeF32,
        nope: Option<&front::RopeF32>,
        dt: Dtype,
    ) -> MirrorFront {
        let x = front::input(x, dt);
        let attn_in = front::attn_in(cfg, mw, x.view(), dt);
        let q = front::query(cfg, mw, attn_in.view(), dt);
        let (q_nope, q_pe) = front::split_query(cfg, q, rope, dt);
        let (latent, k_pe, kv_raw) = front::kv(cfg, mw, attn_in.view(), rope, nope, dt);
        MirrorFront {
            attn_in,
            q_nope,
            q_pe,
            latent,
            k_pe,
            kv_raw,
        }
    }
}

/// A layer's attention after its row-wise stages: cache writes, prefill, decode and o_proj. Run once
/// over the cache's format and, for a quantized cache, once more over the dtype's (its effect).
struct Attention<'a> {
    ctx: &'a LayerCtx<'a>,
    /// The attention kernels' view of the config (their softmax scale).
    acfg: &'a crate::model::MlaConfig,
    mw: &'a front::MirrorWeights<'a>,
    f: &'a MirrorFront,
    dt: Dtype,
}

impl Attention<'_> {
    /// The row parts token `tt` writes to the cache.
    fn parts(&self, tt: usize) -> (&[f32], &[f32]) {
        let (f, fx, lkv) = (self.f, self.ctx.faults, self.ctx.cfg.kv_lora_rank);
        let raw = f.kv_raw.row(tt).to_slice().expect("contiguous");
        // Faults: the cache written from the kv_a output before kv_a_norm / before rope.
        let latent = match fx.on(Fault::LatentBeforeNorm) {
            true => &raw[..lkv],
            false => f.latent.row(tt).to_slice().expect("contiguous"),
        };
        let k_pe = match fx.on(Fault::KPeBeforeRope) {
            true => &raw[lkv..],
            false => f.k_pe.row(tt).to_slice().expect("contiguous"),
        };
        (latent, k_pe)
    }

    /// The cache's codec for format `kv`: `fp8`'s one scale per layer, calibrated on the rows the
    /// layer writes.
    fn codec(&self, kv: crate::kv_format::KvFormat) -> crate::kv_format::Codec {
        let (cfg, t) = (self.ctx.cfg, self.ctx.sched.total_tokens());
        let scale = crate::kv_format::tensor_scale((0..t).flat_map(|tt| {
            let (a, b) = self.parts(tt);
            a.iter().chain(b)
        }));
        crate::kv_format::Codec::new(kv, cfg.kv_lora_rank, cfg.qk_rope)
            .with_tensor_scale(scale)
            .with_faults(self.ctx.faults)
    }

    /// Cache writes, prefill, decode and o_proj over a cache in `codec`'s format (`None`: the dtype's).
    fn run(
        &self,
        codec: Option<crate::kv_format::Codec>,
    ) -> (cache::PagedCache, decode::DecodeStages, [StageTensor; 8]) {
        let (cfg, sched, fx, dt) = (self.ctx.cfg, self.ctx.sched, self.ctx.faults, self.dt);
        let (acfg, mw, f) = (self.acfg, self.mw, self.f);
        // DSA: attention over the selection the run gives (the reference's, or the mirror's own).
        let sel = self.ctx.selection;
        let t = sched.total_tokens();
        let (h, dv) = (cfg.n_head, cfg.v_head_dim);
        // Fault: a NoPE model's row padded to DeepSeek's 576 (`front::DEEPSEEK_ROPE` more), the pad never
        // written; the readers take it for the rope part (the run's dtype only: a format has its own row).
        let pad = match fx.on(Fault::NopePadAsRope) && cfg.qk_rope == 0 && codec.is_none() {
            true => front::DEEPSEEK_ROPE,
            false => 0,
        };
        let mut cache = cache::PagedCache::new(sched, cfg.cache_row() + pad).with_faults(fx);
        if let Some(c) = codec {
            cache = cache.with_codec(c);
        }
        let write = |cache: &mut cache::PagedCache, r: std::ops::Range<usize>| {
            for tt in r {
                let (latent, k_pe) = self.parts(tt);
                cache.write(tt, latent, k_pe);
            }
        };
        let mut heads = Array3::<f32>::zeros((t, h, dv));
        let mut lse = Array2::<f32>::zeros((t, h));
        for c in sched.prefill_chunks() {
            write(&mut cache, c.clone());
            prefill::chunk(acfg, mw, f, &cache, c, dt, fx, sel, &mut heads, &mut lse);
        }
        let mut dec = decode::DecodeStages::new(cfg, sched);
        for r in sched.decode_ranges() {
            write(&mut cache, r.clone());
            decode::step(
                acfg, mw, f, &cache, r, sched, dt, fx, sel, &mut dec, &mut heads, &mut lse,
            );
        }
        let attn_out = match fx.on(Fault::HeadStrideQk) {
            // Fault: o_proj's view of the heads uses the qk head dim as head stride (llama.cpp #7327).
            true => front::o_proj(mw, &front::restride_heads(&heads, cfg.qk_head_dim()), dt),
            false => front::o_proj(mw, &heads, dt),
        };
        let stages = [
            stage(Stage::CacheRows, &cache.rows(0..t, cfg.cache_row())),
            stage(Stage::QAbsorbed, &dec.q_abs),
            stage(Stage::SplitOut, &dec.split_out),
            stage(Stage::SplitLse, &dec.split_lse),
            stage(Stage::AttnLatent, &dec.attn_latent),
            stage(Stage::Lse, &lse),
            stage(Stage::AttnHeads, &heads),
            stage(Stage::AttnOut, &attn_out),
        ];
        (cache, dec, stages)
    }
}

impl Backend for CpuMirror {
    fn describe(&self) -> String {
        match self.kv.is_auto() {
            true => format!("cpu-mirror ({}, f32 accumulation)", self.dtype.name()),
            false => format!(
                "cpu-mirror ({}, f32 accumulation, {} kv cache)",
                self.dtype.name(),
                self.kv.name()
            ),
        }
    }

    fn provides(&self) -> StageSet {
        StageSet::ALL
    }

    /// Its dense layer reads `LayerWeights::stored` only (`front::MirrorWeights`); its indexers read
    /// the file's q_a too, but a run rounds no sparse layer's weights (`run::footprint`).
    fn reads_stored_weights_only(&self) -> bool {
        true
    }

    /// Sparse attention over the selection, its own indexer, every batch's cache through the layer's
    /// format (`cache::PagedCache::for_batch`), scores summed in 8 lanes (`ops::dot`), and one
    /// online-softmax loop for both phases: tiles of `flash::TILE` keys from each range's start.
    fn judging(&self) -> super::Judging {
        let t = || vec![super::KeyTile::new("flash tile", flash::TILE)];
        super::Judging {
            sparse: true,
            batch_cache_in_format: true,
            has_indexer: true,
            has_kpool_indexer: true,
            score_sum: crate::precision::ScoreSum::Lanes8,
            key_tiles: super::KeyTiles {
                prefill: t(),
                decode: t(),
            },
            ..super::Judging::default()
        }
    }

    fn kernels(
        &self,
        _cfg: &crate::model::MlaConfig,
        _sched: &crate::schedule::Schedule,
    ) -> Vec<crate::kernel_use::KernelUse> {
        mirror_kernels()
    }

    /// The serving batch its decode also ran (`serving`): counted in the coverage section.
    fn decode_extra(&self, sched: &crate::schedule::Schedule) -> Vec<crate::batch::Request> {
        self.batch.decode_extra(sched)
    }

    fn aimed_variants(&self) -> Vec<String> {
        self.batch.aimed_variants()
    }

    fn runner_checks(&self) -> Option<crate::backend::runner::checks::RunnerChecks> {
        self.batch.runner_checks()
    }

    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &crate::model::IndexerConfig,
        iw: &crate::model::IndexerWeights,
        x: &Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        let plan = crate::backend::cpu::indexer::plan_for(ctx.faults, keys);
        let o = indexer::run(ctx.cfg, ic, iw, ctx.weights, ctx.rope, x, self.dtype, plan)?;
        Ok(Some(o.selection))
    }

    fn kpool_indexer(
        &mut self,
        ctx: &LayerCtx,
        k: &crate::model::KpoolIndexer,
        kw: &crate::model::KpoolLayer,
        x: &Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        let plan = kpool::plan_for(ctx.faults, keys, ctx.sched.pos_offset);
        let o = kpool::run(ctx.cfg, k, kw, ctx.weights, ctx.rope, x, self.dtype, plan)?;
        Ok(Some(o.selection))
    }

    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace> {
        let (cfg, w, sched, tables) = (ctx.cfg, ctx.weights, ctx.sched, ctx.rope);
        crate::reference::check_inputs(cfg, w, tables, x, sched)?;
        let dt = self.dtype;
        let fx = ctx.faults;
        self.kv
            .fits(cfg.kv_lora_rank, cfg.qk_rope)
            .map_err(crate::error::Error::Usage)?;
        let rope = front::RopeF32::new(tables, fx);
        let mw = front::MirrorWeights::new(cfg, w, dt, fx);
        let nope = front::nope_rope(cfg, tables, fx);
        let f = MirrorFront::new(cfg, &mw, x, &rope, nope.as_ref(), dt);
        // The attention kernels' view of the config: the same model, the softmax scale they are given.
        let mut acfg = cfg.clone();
        acfg.softmax_scale = kernel_scale(cfg, fx);
        let l = Attention {
            ctx,
            acfg: &acfg,
            mw: &mw,
            f: &f,
            dt,
        };
        let codec = (!self.kv.is_auto()).then(|| l.codec(self.kv));
        let (cache, dec, stages) = l.run(codec);
        let stored = serving::Stored {
            q_abs: &dec.q_abs,
            q_pe: &f.q_pe,
            cache: &cache,
        };
        serving::run(ctx, &acfg, &stored, dt, self.plant, &mut self.batch);

        let mut tr = LayerTrace::new(ctx.layer);
        tr.cache_format = self.kv;
        tr.push(stage(Stage::AttnIn, &f.attn_in));
        tr.push(stage(Stage::QNope, &f.q_nope));
        tr.push(stage(Stage::QPe, &f.q_pe));
        tr.push(stage(Stage::KvLatent, &f.latent));
        tr.push(stage(Stage::KPe, &f.k_pe));
        // A quantized cache: its effect on each stage it reaches (this layer with the format's cache minus
        // with the dtype's), which widens the end-to-end checks as a runner's fp8 cache does
        // (`trace::CacheEffect`); the stage-local view bounds them by the format's rounding instead.
        if codec.is_some() {
            let (_, _, plain) = l.run(None);
            tr.cache_effect = crate::trace::CacheEffect::between(&stages, &plain, self.kv.name());
        }
        tr.stages.extend(stages);
        Ok(tr)
    }
}

/// The CPU mirror's kernels: one query at a time, tiles of `cpu::flash::TILE` keys, no warps.
pub fn mirror_kernels() -> Vec<crate::kernel_use::KernelUse> {
    use crate::kernel_use::{Family, Geometry, KernelUse, Phase};
    let g = Geometry {
        rows_per_cta: 1,
        keys_per_tile: flash::TILE,
        key_slices: 1,
        stages: 1,
        per_row_ranges: true,
    };
    [Phase::Prefill, Phase::Decode]
        .into_iter()
        .map(|phase| KernelUse {
            phase,
            family: Family::Mirror,
            label: format!("{}-key tiles, a query at a time", g.keys_per_tile),
            geometry: Some(g),
            production: None,
        })
        .collect()
}
