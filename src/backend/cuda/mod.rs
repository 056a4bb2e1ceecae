//! The CUDA backend: the fused MLA path on the GPU, same schedule and stage trace as the CPU mirror.
//!
//! Per prefill chunk / decode step, the token-local part (RMSNorm, projections through cuBLAS, rope,
//! kv_a_norm) runs on the chunk's rows, the rows `[latent | k_pe]` go into the NaN-poisoned paged cache,
//! then attention: prefill in the decompressed form (causal over the chunk, non-causal over the cached
//! context, LSE merge), decode in the absorbed form with split-KV and an LSE combine; then W_UV and o_proj.
//!
//! Planted bugs (`crate::faults`, `LayerCtx::faults`) change what the CPU mirror's versions change:
//! the kernel faults (`kernels::KERNEL_FAULTS`) are compiled in as `-D MLA_FAULT_…=1` through `Dims`, so a
//! layer-targeted fault gets its own lazily compiled module set next to the clean one (both cached by
//! their defines); the host faults are switched in the host code, each at the one launch, weight or scale
//! it models.
//!
//! Files, along the CPU mirror's seams: `front.rs` (token-local part and cache write), `prefill.rs`,
//! `decode.rs` (and the layer's last launches), `trace.rs` (downloads), `buffers.rs` (device weights and
//! activations), `layer.rs` (what the stages share), `launch.rs` (typed launches of the small kernels
//! and the layer's kernel set), `attn.rs` (the attention modules; their argument struct is `args.rs`,
//! their tensor maps `tma.rs`), `blas.rs` (cuBLAS), `kernels.rs` (NVRTC modules and defines),
//! `device.rs` (context, buffers, events). The tile lists, split rules and the host's model of the
//! kernel choice are `crate::tiles`; the tools around the backend (bench, `kernels check`,
//! `gpu-validate`) are `crate::tools`.

pub mod args;
pub mod attn;
pub mod blas;
pub mod buffers;
pub mod decode;
pub mod device;
pub mod dgemm;
pub mod front;
pub mod indexer;
pub mod kernels;
pub mod kpool;
pub mod launch;
pub mod layer;
pub mod nvrtc;
pub mod prefill;
pub mod serving;
pub mod shared;
pub mod sparse;
pub mod tma;
pub mod trace;
pub mod v4;

use crate::backend::{Backend, LayerCtx};
use crate::error::{Error, Result};
use crate::faults::Fault;
use crate::precision::Dtype;
use crate::tiles::choice;
use crate::tiles::Dims;
use crate::trace::{LayerTrace, Stage, StageSet};
use blas::Blas;
use buffers::{Acts, Sizes, Weights};
use device::Gpu;
use kernels::Kernels;
use launch::LayerKernels;
use layer::Layer;
use std::path::PathBuf;

/// `LayerWeights::id`, dtype, host faults kv_b_swap, k_b_untransposed, q_abs_fp16_accum.
type WeightsKey = (u64, Dtype, [bool; 3]);

#[derive(Debug, Clone)]
pub struct CudaOptions {
    pub dtype: Dtype,
    /// Read kernels from this directory instead of the embedded copy.
    pub kernels_dir: Option<PathBuf>,
    /// Also record decode's internal stages (q_absorbed, split partials and lse); compiled in as MLA_DEBUG.
    pub debug: bool,
    /// Use the scalar attention kernels even where the tensor-core ones apply (a cross-check).
    pub force_scalar: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            dtype: Dtype::Bf16,
            kernels_dir: None,
            debug: true,
            force_scalar: false,
        }
    }
}

pub struct CudaBackend {
    pub gpu: Gpu,
    pub kernels: Kernels,
    pub blas: Blas,
    pub opts: CudaOptions,
    /// Which attention kernels the last layer used ("mma 4x2 warps…" / "scalar").
    pub last_paths: String,
    /// The key tiles of the attention kernels the last layer used (`Judging::key_tiles`).
    pub last_tiles: crate::backend::KeyTiles,
    /// The same, for the coverage section: per phase the kernel, its geometry and the production kernel.
    pub last_kernels: Vec<crate::kernel_use::KernelUse>,
    /// How the last layer's attention summed its scores (`Judging::score_sum`).
    pub last_score_sum: crate::precision::ScoreSum,
    /// Notices for the report (a kernel choice the host did not predict), without repeats.
    pub notices: Vec<String>,
    /// Seconds in `run_layer`: weights converted and uploaded, the layer's launches (to the trace's
    /// download), the trace read back. Printed on drop with `MLA_DIFF_PROFILE=1`.
    pub spent: [f64; 3],
    /// The last layer's weights on the device, and what they were made from (`LayerWeights::id`, the
    /// dtype and the host faults that change them): a layer's shadow, free and repeated passes upload
    /// them once.
    uploaded: Option<(WeightsKey, Weights)>,
    /// The serving batch's checks of every layer run so far (`serving.rs`, JSON `runner_checks`); a
    /// `SharedCuda` view swaps in its own for each layer it runs.
    pub batch: crate::backend::serving::Record,
    /// The latent cache's byte format (`run --kv-cache-dtype`; `auto`: the dtype). Not in `opts`: a
    /// `SharedCuda` view sets it, as its dtype, for each layer it runs.
    pub kv_format: crate::kv_format::KvFormat,
}

impl CudaBackend {
    pub fn new(opts: CudaOptions) -> Result<CudaBackend> {
        let src = nvrtc::Sources::load(opts.kernels_dir.as_deref())?;
        // The driver first: "no GPU" is the more useful message on a machine without either.
        let gpu = Gpu::open()?;
        nvrtc::nvrtc_present()?;
        let blas = Blas::new()?;
        let kernels = Kernels::new(src, &gpu);
        Ok(CudaBackend {
            gpu,
            kernels,
            blas,
            opts,
            last_paths: String::new(),
            last_tiles: Default::default(),
            last_kernels: Vec::new(),
            last_score_sum: crate::precision::ScoreSum::Sequential,
            notices: Vec::new(),
            spent: [0.0; 3],
            uploaded: None,
            batch: Default::default(),
            kv_format: Default::default(),
        })
    }
}

impl CudaBackend {
    /// Record the layer's kernels for coverage, and check them against the host's prediction
    /// (`tiles::choice`: what the coverage tests and the default schedule assume without a GPU).
    fn record_kernels(
        &mut self,
        k: &LayerKernels,
        dims: &Dims,
        q_rows: usize,
        splits: usize,
        n_keys: usize,
    ) {
        use crate::kernel_use::Phase;
        let i = &self.gpu.info;
        let caps = choice::Caps {
            cc: i.cc,
            smem_optin: i.smem_optin,
        };
        let force = self.opts.force_scalar;
        let predicted = choice::layer_tiles(dims, q_rows, &caps, force);
        let mut uses = Vec::new();
        for (phase, attn, pred) in [
            (Phase::Prefill, &k.prefill, predicted.0),
            (Phase::Decode, &k.decode, predicted.1),
        ] {
            let ran = attn.tile.filter(|_| attn.uses_mma());
            let mut note = |m: String| {
                if !self.notices.contains(&m) {
                    self.notices.push(m);
                }
            };
            if ran != pred {
                note(format!(
                    "coverage: the host predicted the {} kernel {} for these dims on this device, but {} loaded (src/tiles/choice.rs disagrees with the device)",
                    phase.name(),
                    choice::label(pred),
                    choice::label(ran)
                ));
            }
            let g = choice::geometry(ran, phase == Phase::Decode);
            if let Some((rows, keys)) = attn.rows_keys() {
                if (rows, keys) != (g.rows_per_cta, g.keys_per_tile) {
                    note(format!(
                        "coverage: the {} kernel's module states {rows} rows x {keys} keys per tile, its tile {} (coverage's geometry)",
                        phase.name(),
                        choice::label(ran)
                    ));
                }
            }
            let prod = choice::production(dims, phase, ran, q_rows, &caps, force);
            let mut u = choice::kernel_use(phase, ran, prod);
            // Same tile and classes, another kernel (kernels/sm90/decode/attn_wgmma_pairs.cuh): the report says
            // which of the two ran (at `n_keys`, the last decode step's: the most keys per split).
            if phase == Phase::Decode && attn.runs_pairs(n_keys as i32, splits as i32) {
                u.label.push_str(", alternating tiles (attn_wgmma_pairs)");
            }
            // Same tile and rows, the few-heads kernel (kernels/sm90/decode/attn_small.cuh): its 32-key
            // tiles start at the split's start rounded down to 32 keys.
            if phase == Phase::Decode && attn.runs_small(n_keys as i32, splits as i32) {
                u.label.push_str(", TMA key ring (attn_small)");
            }
            uses.push(u);
        }
        self.last_kernels = uses;
        // Tensor cores in both phases, or the scalar kernels' lane sums (modelled as sequential).
        self.last_score_sum = match k.prefill.uses_mma() && k.decode.uses_mma() {
            true => crate::precision::ScoreSum::TensorCore,
            false => crate::precision::ScoreSum::Sequential,
        };
    }
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        let i = &self.gpu.info;
        format!(
            "cuda: {} (sm_{}{}, {} SMs), {}{}{}",
            i.name,
            i.cc.0,
            i.cc.1,
            i.sms,
            self.opts.dtype.name(),
            if self.opts.force_scalar {
                ", scalar attention"
            } else {
                ""
            },
            match self.kv_format.is_auto() {
                true => String::new(),
                false => format!(", {} kv cache", self.kv_format.name()),
            }
        )
    }

    fn device(&self) -> Option<String> {
        Some(self.gpu.info.name.clone())
    }

    fn provides(&self) -> StageSet {
        // Decode's internal stages are recorded only with MLA_DEBUG compiled in.
        match self.opts.debug {
            true => StageSet::ALL,
            false => StageSet::ALL
                .without(Stage::QAbsorbed)
                .without(Stage::SplitOut)
                .without(Stage::SplitLse),
        }
    }

    /// A dense layer reads its weights once, to upload them converted to the dtype (`Weights::upload`,
    /// half's round to nearest even, as `LayerWeights::stored`): a value already rounded converts to
    /// itself, so weights rounded in place upload the same bits. Its indexers read the file's values
    /// (`indexer.rs`, `kpool.rs`), but a run rounds no sparse layer's weights (`run::footprint`).
    fn reads_stored_weights_only(&self) -> bool {
        true
    }

    /// Sparse attention over the selection in the absorbed form (`sparse.rs`), its own indexer, and
    /// the score sum and key tiles of the kernels its last layer chose.
    fn judging(&self) -> crate::backend::Judging {
        crate::backend::Judging {
            sparse: true,
            sparse_prefill_absorbed: true,
            has_indexer: true,
            has_kpool_indexer: true,
            score_sum: self.last_score_sum,
            key_tiles: self.last_tiles.clone(),
            ..crate::backend::Judging::default()
        }
    }

    /// Scores and top-k on the GPU, q/k/weights on the host (`indexer`, kernels/indexer.cu).
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &crate::model::IndexerConfig,
        iw: &crate::model::IndexerWeights,
        x: &ndarray::Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        let mut on = indexer::On {
            gpu: &self.gpu,
            kernels: &mut self.kernels,
            dtype: self.opts.dtype,
        };
        Ok(Some(indexer::run(&mut on, ctx, ic, iw, x, keys)?.selection))
    }

    /// glm5-next: pooling, scores and top-k on the GPU (`kpool`, kernels/kpool.cu).
    fn kpool_indexer(
        &mut self,
        ctx: &LayerCtx,
        k: &crate::model::KpoolIndexer,
        kw: &crate::model::KpoolLayer,
        x: &ndarray::Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        let mut on = indexer::On {
            gpu: &self.gpu,
            kernels: &mut self.kernels,
            dtype: self.opts.dtype,
        };
        Ok(Some(kpool::run(&mut on, ctx, k, kw, x, keys)?.selection))
    }

    fn notices(&self) -> Vec<String> {
        self.notices.clone()
    }

    fn kernels(
        &self,
        _cfg: &crate::model::MlaConfig,
        _sched: &crate::schedule::Schedule,
    ) -> Vec<crate::kernel_use::KernelUse> {
        self.last_kernels.clone()
    }

    /// The serving batch its decode kernel also ran (`serving.rs`): counted in the coverage section.
    fn decode_extra(&self, sched: &crate::schedule::Schedule) -> Vec<crate::batch::Request> {
        self.batch.decode_extra(sched)
    }

    fn aimed_variants(&self) -> Vec<String> {
        self.batch.aimed_variants()
    }

    fn runner_checks(&self) -> Option<crate::backend::runner::checks::RunnerChecks> {
        self.batch.runner_checks()
    }

    fn run_layer(&mut self, ctx: &LayerCtx, x: &ndarray::Array2<f64>) -> Result<LayerTrace> {
        let (cfg, w, sched) = (ctx.cfg, ctx.weights, ctx.sched);
        sched.validate()?;
        // The run's cos/sin tables (f64 on the host, uploaded as f32, as the CPU mirror rounds them).
        let tables = ctx.rope;
        crate::reference::check_inputs(cfg, w, tables, x, sched)?;
        self.gpu.bind()?;
        let dt = self.opts.dtype;
        let (t_all, e) = (sched.total_tokens(), cfg.hidden);
        if x.dim() != (t_all, e) {
            return Err(Error::Usage(format!(
                "layer input is {:?}, the schedule needs [{t_all}, {e}]",
                x.dim()
            )));
        }
        let fx = ctx.faults;
        // The softmax scale the attention kernels are given (host faults: mscale² missing, 1/sqrt(Lkv+R)).
        let scale = crate::backend::common::kernel_scale(cfg, fx);
        let kv = self.kv_format;
        let z = Sizes::new(ctx, dt, scale).with_kv_format(kv)?;
        let dims = Dims {
            dtype: dt,
            lkv: z.lkv,
            r: z.r,
            p: z.p,
            dv: z.dv,
            h: z.h,
            page: sched.page_size,
            neox: cfg.rope.pairing == crate::model::config::RopePairing::Neox,
            debug: self.opts.debug,
            faults: fx,
        };
        let k = LayerKernels::load(
            &mut self.kernels,
            &self.gpu,
            &dims,
            sched.q_len * z.h,
            self.opts.force_scalar,
        )?
        .with_kv_format(&mut self.kernels, &dims, kv)?;
        self.last_paths = k.paths();
        self.last_tiles = crate::backend::KeyTiles {
            prefill: k.prefill.key_tiles(),
            decode: k.decode.key_tiles(),
        };
        self.record_kernels(
            &k,
            &dims,
            sched.q_len * z.h,
            sched.num_splits,
            sched.total_tokens(),
        );
        if ctx.selection.is_some() {
            // The dense kernels are loaded but attention runs in sparse_attn: say so, tile classes unknown.
            (self.last_kernels, self.last_tiles) = (sparse::kernel_uses(), Default::default());
            self.last_paths = "prefill and decode: sparse_attn".into();
        }
        // DSA: attention over the run's selection (kernels/sparse_attn.cu).
        let sparse = match ctx.selection {
            Some(sel) => Some(launch::Sparse::load(
                &mut self.kernels,
                &dims,
                sel,
                ctx.block_table,
            )?),
            None => None,
        };
        let t0 = std::time::Instant::now();
        let key: WeightsKey = (
            w.id(),
            dt,
            [Fault::KvBSwap, Fault::KBUntransposed, Fault::QAbsFp16Accum].map(|f| fx.on(f)),
        );
        if self.uploaded.as_ref().is_none_or(|(k, _)| *k != key) {
            self.uploaded = None; // the last layer's device memory first
            self.uploaded = Some((key, Weights::upload(ctx, dt)?));
        }
        let w = &self.uploaded.as_ref().expect("uploaded").1;
        let t1 = std::time::Instant::now();
        let a = Acts::alloc(ctx, &z, x, w.lq)?;
        let mut layer = Layer {
            gpu: &self.gpu,
            blas: &self.blas,
            k: &k,
            w,
            a: &a,
            z,
            fx,
            debug: self.opts.debug,
            sparse: sparse.as_ref(),
        };
        // A quantized cache: the layer over the dtype's cache first (the format's effect is measured
        // against it, and the per-tensor `fp8`'s scale calibrated on its rows, which are this pass's).
        let plain = layer.plain_trace(ctx, x, w.lq, kv)?;
        if let (crate::kv_format::KvFormat::Fp8, Some(p)) = (kv, &plain) {
            layer.z.tensor_scale = trace::tensor_scale(p);
        }
        layer.prefill(sched)?;
        layer.decode(sched)?;
        layer.finish()?;
        if self.batch.first_at(ctx.layer) {
            layer.batches(
                ctx,
                &dims,
                &mut self.kernels,
                &mut self.batch,
                self.opts.force_scalar,
            )?;
        }
        let t2 = std::time::Instant::now();
        let trace = layer
            .trace(ctx.layer)
            .map(|t| trace::with_cache_effect(t, plain.as_ref(), kv, dt));
        let t3 = std::time::Instant::now();
        for (s, d) in self.spent.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2]) {
            *s += d.as_secs_f64();
        }
        trace
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if std::env::var("MLA_DIFF_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0") {
            let [w, l, t] = self.spent;
            eprintln!(
                "mla-diff: profile (CUDA passes, seconds): weights converted + uploaded {w:.2}, activations + launches queued {l:.2}, trace read back (waiting for the GPU) {t:.2}"
            );
        }
    }
}
