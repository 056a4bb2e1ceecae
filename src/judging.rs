//! [`Judging`]: what an optimized path tells the judges about how to read its traces — not computation,
//! but which model of its roundings the stage-local view takes (`compare::local`), which stages that
//! view leaves to the end-to-end checks, what a DSA run may ask of it (`run::dsa`, the selftest's case
//! filter), and where `sweep` puts its boundary lengths. A backend answers with one value
//! (`Backend::judging`); a wrapper forwards its inner path's value, changing only what it changes.
//!
//! It stands below `backend/` (floor 2), so `compare/` and the driver read it without naming a backend.
//! None of it takes the layer (`sparse_layers` says what a sparse layer loses): a path answers for the whole run (CUDA's `score_sum` and `key_tiles` are
//! those of the last layer it ran, so they are asked after a run or after each layer).

use crate::precision::ScoreSum;
use crate::tiles::KeyTiles;
use crate::trace::StageSet;

/// DSA: what a layer that runs sparse (`LayerCtx::selection` set: past top_k) takes from the judges
/// besides what every layer does: stages its trace does not hold as this path computed them (left out
/// of `provides` there) and stages outside the stage-local view there. The run's dense layers keep
/// both (`Judging::sparse_layers`; the judges decide per layer, `run::layers`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SparseLayers {
    pub not_provided: StageSet,
    pub outside_local_view: StageSet,
}

/// How the judges read one optimized path's traces (`Backend::judging`). `Judging::default()` is a
/// dense path with no DSA abilities whose attention is an online softmax with stored split partials
/// (`known_attention`), its scores summed as the conservative model has it (`Sequential`), every stage
/// modelled by the stage-local view, and no known tiles.
#[derive(Debug, Clone, PartialEq)]
pub struct Judging {
    /// DSA: whether `run_layer` attends over `ctx.selection` only (sparse attention). A run past a DSA
    /// file's top_k refuses a path that does not (`run::dsa`).
    pub sparse: bool,
    /// Whether the serving batches it runs read their cache through the layer's cache format
    /// (`--kv-cache-dtype`): a fault of a write launch over several requests (`faults::BATCH_CHECK`)
    /// shows only there (the CPU mirror's batches do; CUDA's take the dtype's rows so far).
    pub batch_cache_in_format: bool,
    /// DSA: whether `Backend::indexer` is this path's own (planted indexer faults reach it); without one
    /// the run's stand-in (the CPU mirror's) takes no faults, so the selftest leaves the indexer faults
    /// out.
    pub has_indexer: bool,
    /// glm5-next: whether `Backend::kpool_indexer` is this path's own (the k-pool faults reach it);
    /// without one `run::kpool` stands the CPU mirror's in, without faults, and the selftest leaves the
    /// k-pool faults out.
    pub has_kpool_indexer: bool,
    /// DSA: whether its sparse prefill attends in the absorbed form over the cache rows (FlashMLA's
    /// sparse prefill, CUDA's `sparse_attn`), not decompressed over the own chunk and the context. The
    /// stage-local view does not model that form (its shared q_abs rounding moves every score of a row
    /// together: measured on the H200, prefill lse 4× the predicted error), so such a path's sparse
    /// layers have none and are judged end to end (docs/dsa.md).
    pub sparse_prefill_absorbed: bool,
    /// Stages whose stage-local view (`compare::local`) does not model this path, judged end to end
    /// instead: a tensor-parallel all-reduce's roundings of the partial o_proj outputs (`crate::tp`), a
    /// runner's sparse decode over an fp8 cache. The same set on every layer.
    pub outside_local_view: StageSet,
    /// DSA: what a layer that runs sparse takes away besides (a runner's sparse decode); the run's
    /// dense layers keep every check (`Judging::layer_stages` decides per layer).
    pub sparse_layers: SparseLayers,
    /// Whether its attention is known to the stage-local view: P computed as exp(s − m) against a
    /// running row max before P·V (an online softmax: the max key's P is exactly 1, a key's P rounded
    /// in its binade against the final max unless its tile came before the max's), and `attn_latent`
    /// the LSE combine of the split partials it stores. External kernels are not known to do either
    /// (numpy's normalises P first and computes `attn_latent` apart from its splits): the view then
    /// takes every P, the max's too, rounded at the worst place of its binade, and the stored partials
    /// with the noise of a fresh computation.
    pub known_attention: bool,
    /// Whether its prefill reads the context's keys rounded to the attention type: a runner's prefill
    /// op is sent them in the dtype, so the rope keys of a per-tensor `fp8` cache (e4m3·amax/448,
    /// generally off the bf16/fp16 grid) arrive rounded. The stage-local view then carries each
    /// rounding's exact error (`Att::key_round_errors`); a path that attends over the rows as decoded
    /// (the CPU mirror) has none to carry.
    pub context_keys_in_dtype: bool,
    /// Whether its decode reads the cache rows rounded to the attention type after dequantizing them
    /// (a runner's `conventions.cache_dequant: "dtype"`, vLLM's Triton decode over the `fp8` cache): the
    /// stage-local view attends over the rows so rounded, exactly.
    pub decode_cache_in_dtype: bool,
    /// Whether its decode rounds P (exp(s − running max), ≤ 1) to float8 e4m3, unscaled, before P·V,
    /// its row sum and LSE from P unrounded (a runner's `conventions.p_fp8`, FlashMLA's dense fp8
    /// decode): the stage-local view's P rounding is e4m3's, not the attention type's.
    pub decode_p_e4m3: bool,
    /// The fraction bits of its decode's QKᵀ accumulator where it is not f32 (a runner's
    /// `conventions.qk_acc: "e8mN"`, FlashMLA's fp8 WGMMA: 13): each k-step of 32 truncates the
    /// running sum toward zero to that many bits, so the stage-local view's scores carry that
    /// truncation (`compare::local::qk_acc`) in place of an f32 sum's.
    pub decode_qk_acc: Option<u32>,
    /// How it sums an attention score's dot product: the stage-local view models that sum's noise
    /// (and, on tensor cores, the truncating accumulator's one-signed bias: on the H200 most of a GLM-5
    /// split_lse's error). Unknown kernels get the conservative model.
    pub score_sum: ScoreSum,
    /// The key counts at which its attention kernels' loop structure changes (tiles, per-warp key
    /// slices), per phase: what `mla-diff sweep` puts boundary lengths around. A GPU backend knows its
    /// tiles once a layer has chosen them, so this is asked after a run; empty when unknown.
    pub key_tiles: KeyTiles,
}

impl Default for Judging {
    fn default() -> Judging {
        Judging {
            sparse: false,
            batch_cache_in_format: false,
            has_indexer: false,
            has_kpool_indexer: false,
            sparse_prefill_absorbed: false,
            outside_local_view: StageSet::NONE,
            sparse_layers: SparseLayers::default(),
            known_attention: true,
            context_keys_in_dtype: false,
            decode_cache_in_dtype: false,
            decode_p_e4m3: false,
            decode_qk_acc: None,
            score_sum: ScoreSum::Sequential,
            key_tiles: KeyTiles::default(),
        }
    }
}

impl Judging {
    /// A layer's stages provided and outside its stage-local view: the run's (`provided`,
    /// `outside_local_view`), less and plus what `sparse_layers` takes away where the layer runs
    /// sparse (DSA past top_k).
    pub fn layer_stages(&self, provided: StageSet, sparse: bool) -> (StageSet, StageSet) {
        match sparse {
            false => (provided, self.outside_local_view),
            true => (
                provided.minus(self.sparse_layers.not_provided),
                self.outside_local_view
                    .union(self.sparse_layers.outside_local_view),
            ),
        }
    }

    /// What a wrapper that runs its inner path dense and whole keeps of the inner path's value: how
    /// its attention is computed (`known_attention`, the roundings of what it reads, `score_sum`,
    /// `key_tiles`), and nothing of DSA,
    /// the batches' cache format or the stages outside the local view (`tp`'s ranks, which put their
    /// own `outside_local_view` back).
    pub fn attention_only(self) -> Judging {
        Judging {
            known_attention: self.known_attention,
            context_keys_in_dtype: self.context_keys_in_dtype,
            decode_cache_in_dtype: self.decode_cache_in_dtype,
            decode_p_e4m3: self.decode_p_e4m3,
            decode_qk_acc: self.decode_qk_acc,
            score_sum: self.score_sum,
            key_tiles: self.key_tiles,
            ..Judging::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default is the old trait methods' defaults; `attention_only` keeps exactly the attention
    /// fields (what `tp` forwarded one by one before).
    #[test]
    fn default_and_attention_only() {
        let d = Judging::default();
        assert!(!d.sparse && !d.batch_cache_in_format && !d.has_indexer && !d.has_kpool_indexer);
        assert!(!d.sparse_prefill_absorbed && d.known_attention);
        assert!(!d.context_keys_in_dtype && !d.decode_cache_in_dtype && !d.decode_p_e4m3);
        assert_eq!(d.decode_qk_acc, None);
        assert_eq!(d.outside_local_view, StageSet::NONE);
        assert_eq!(d.score_sum, ScoreSum::Sequential);
        let all = Judging {
            sparse: true,
            batch_cache_in_format: true,
            has_indexer: true,
            has_kpool_indexer: true,
            sparse_prefill_absorbed: true,
            outside_local_view: StageSet::ALL,
            sparse_layers: SparseLayers {
                not_provided: StageSet::ALL,
                outside_local_view: StageSet::ALL,
            },
            known_attention: false,
            context_keys_in_dtype: true,
            decode_cache_in_dtype: true,
            decode_p_e4m3: true,
            decode_qk_acc: Some(13),
            score_sum: ScoreSum::Lanes8,
            key_tiles: KeyTiles {
                prefill: vec![crate::tiles::KeyTile::new("t", 64)],
                decode: Vec::new(),
            },
        };
        let kept = all.clone().attention_only();
        assert_eq!(
            kept,
            Judging {
                known_attention: false,
                context_keys_in_dtype: true,
                decode_cache_in_dtype: true,
                decode_p_e4m3: true,
                decode_qk_acc: Some(13),
                score_sum: ScoreSum::Lanes8,
                key_tiles: all.key_tiles,
                ..Judging::default()
            }
        );
    }
}
