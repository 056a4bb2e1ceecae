//! Stage traces: the named intermediate tensors of one layer's attention, in dataflow order.
//!
//! Both sides of a comparison produce a `LayerTrace` with the same stages, shapes and axis names:
//! the fp64 reference and an optimized backend (CPU mirror, CUDA kernels, or an external kernel through
//! a capsule). Values are stored as f64 (an f32/bf16 value converts exactly). Everything is in one
//! canonical layout: rope pairs in the file's order, heads before dims, tokens in position order.

use serde::{Deserialize, Serialize};

/// One named stage of the MLA dataflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// RMSNorm(x, attn_norm): `[token, hidden]`.
    AttnIn,
    /// Per-head no-rope query part: `[token, head, dim]`.
    QNope,
    /// Per-head rope query part after rotation: `[token, head, dim]`.
    QPe,
    /// The kv latent after kv_a_norm: `[token, dim]`.
    KvLatent,
    /// The shared key rope part after rotation: `[token, dim]`.
    KPe,
    /// Rows read back from the paged latent cache, `[latent | k_pe]`, in token order: `[token, dim]`.
    CacheRows,
    /// Absorbed decode query `W_UKᵀ q_nope`: `[decode_token, head, dim]`.
    QAbsorbed,
    /// Split-KV partial outputs (latent space) of decode: `[decode_token, head, split, dim]`.
    SplitOut,
    /// Split-KV partial log-sum-exps (natural log; −inf for an empty split): `[decode_token, head, split]`.
    SplitLse,
    /// Decode attention output in latent space, after the split combine: `[decode_token, head, dim]`.
    AttnLatent,
    /// Log-sum-exp of the scaled scores per query and head (natural log): `[token, head]`.
    Lse,
    /// Per-head attention output in v space: `[token, head, dim]`.
    AttnHeads,
    /// Layer attention output after o_proj: `[token, hidden]`.
    AttnOut,
}

/// What the rest of the tool knows about a stage: one row per stage, in `Stage` order, so that a new
/// stage is one variant and one row here (plus its place in `compare::checks_for`).
#[derive(Debug, Clone, Copy)]
pub struct StageInfo {
    pub stage: Stage,
    /// The name in traces, reports, `--tol` and `.npy` dumps.
    pub name: &'static str,
    /// The terminal table's column name (so that ~16 checks fit in ~120 columns); `--tol` accepts it.
    pub short: &'static str,
    /// Axis names, outermost first.
    pub axes: &'static [&'static str],
    /// Computed differently for prefill and decode tokens: compared as `[prefill]` and `[decode]` rows.
    pub phased: bool,
    /// Distinct storage roundings on the CPU mirror's path to this stage without q-LoRA (q-LoRA adds
    /// `Q_LORA_ROUNDINGS` to the query side), counted from the mirror's spec: x, attn_norm weight,
    /// attn_in (3); q adds W_q(b) and q (2), rope 1; the kv branch W_kva, kv, kv norm weight, latent, k_pe
    /// rope (5); W_UK and q_abs / k_nope (2); P (1); the attention output stores and merge (2); W_UV and
    /// its output (2); W_o and its output (2). The mirror tests bound its error by `sqrt(n)·u`.
    pub mirror_roundings: usize,
    /// Whether the count grows with q-LoRA (the stage depends on the query).
    pub after_q: bool,
}

/// q-LoRA's extra roundings on the query side: W_qa, q_a, its norm weight and output.
pub const Q_LORA_ROUNDINGS: usize = 4;

const TOKEN_HIDDEN: &[&str] = &["token", "hidden"];
const TOKEN_HEAD_DIM: &[&str] = &["token", "head", "dim"];
const TOKEN_DIM: &[&str] = &["token", "dim"];
const DECODE_HEAD_DIM: &[&str] = &["decode_token", "head", "dim"];

/// The stage table, in `Stage` (dataflow) order.
#[rustfmt::skip]
pub const STAGES: [StageInfo; 13] = [
    StageInfo { stage: Stage::AttnIn, name: "attn_in", short: "in", axes: TOKEN_HIDDEN, phased: false, mirror_roundings: 3, after_q: false },
    StageInfo { stage: Stage::QNope, name: "q_nope", short: "qnope", axes: TOKEN_HEAD_DIM, phased: false, mirror_roundings: 5, after_q: true },
    StageInfo { stage: Stage::QPe, name: "q_pe", short: "qpe", axes: TOKEN_HEAD_DIM, phased: false, mirror_roundings: 6, after_q: true },
    StageInfo { stage: Stage::KvLatent, name: "kv_latent", short: "latnt", axes: TOKEN_DIM, phased: false, mirror_roundings: 7, after_q: false },
    StageInfo { stage: Stage::KPe, name: "k_pe", short: "kpe", axes: TOKEN_DIM, phased: false, mirror_roundings: 6, after_q: false },
    StageInfo { stage: Stage::CacheRows, name: "cache_rows", short: "cache", axes: TOKEN_DIM, phased: false, mirror_roundings: 7, after_q: false },
    StageInfo { stage: Stage::QAbsorbed, name: "q_absorbed", short: "qabs", axes: DECODE_HEAD_DIM, phased: false, mirror_roundings: 7, after_q: true },
    StageInfo { stage: Stage::SplitOut, name: "split_out", short: "splO", axes: &["decode_token", "head", "split", "dim"], phased: false, mirror_roundings: 14, after_q: true },
    StageInfo { stage: Stage::SplitLse, name: "split_lse", short: "splL", axes: &["decode_token", "head", "split"], phased: false, mirror_roundings: 13, after_q: true },
    StageInfo { stage: Stage::AttnLatent, name: "attn_latent", short: "attL", axes: DECODE_HEAD_DIM, phased: false, mirror_roundings: 15, after_q: true },
    StageInfo { stage: Stage::Lse, name: "lse", short: "lse", axes: &["token", "head"], phased: true, mirror_roundings: 13, after_q: true },
    StageInfo { stage: Stage::AttnHeads, name: "attn_heads", short: "heads", axes: TOKEN_HEAD_DIM, phased: true, mirror_roundings: 18, after_q: true },
    StageInfo { stage: Stage::AttnOut, name: "attn_out", short: "out", axes: TOKEN_HIDDEN, phased: true, mirror_roundings: 20, after_q: true },
];

/// DeepSeek-V4's stages (docs/deepseek-v4.md, "The math, in stages"), in dataflow order. V4 is not
/// latent MLA, so its stages are a vocabulary of their own: `reference::v4` records them; the MLA
/// stage table above (and every MLA report) is unchanged by them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum V4Stage {
    /// RMSNorm(x)·attn_norm: `[token, hidden]`.
    AttnIn,
    /// RMSNorm(W_qa·attn_in)·q_a_norm (transformers' `q_residual`): `[token, q_lora]`.
    QA,
    /// Per head: unweighted RMSNorm of W_qb·q_a, rope on the trailing R: `[token, head, dim]`.
    Q,
    /// RMSNorm(W_kv·attn_in)·kv_norm, rope on the trailing R: the K = V row: `[token, dim]`.
    CacheRows,
    /// The compressed entries of the closed windows (CSA/HCA): `[entry, dim]`.
    Compressed,
    /// The CSA indexer's score of each entry for each query (−inf past the causal threshold).
    IndexScores,
    /// The CSA indexer's top-k entries per query (−1: none).
    TopkIndices,
    /// Attention over window rows, entries and the sink: `[token, head, dim]`.
    AttnHeads,
    /// Log-sum-exp per query and head, the sink included: `[token, head]`.
    Lse,
    /// attn_heads with the trailing R rotated back by −p: `[token, head, dim]`.
    AttnDerot,
    /// The grouped output projection: `[token, hidden]`.
    AttnOut,
}

/// `(stage, name, axes)` of each V4 stage, in `V4Stage` order.
pub const V4_STAGES: [(V4Stage, &str, &[&str]); 11] = [
    (V4Stage::AttnIn, "attn_in", TOKEN_HIDDEN),
    (V4Stage::QA, "q_a", &["token", "q_lora"]),
    (V4Stage::Q, "q", TOKEN_HEAD_DIM),
    (V4Stage::CacheRows, "cache_rows", TOKEN_DIM),
    (V4Stage::Compressed, "compressed", &["entry", "dim"]),
    (V4Stage::IndexScores, "index_scores", &["token", "entry"]),
    (V4Stage::TopkIndices, "topk_indices", &["token", "k"]),
    (V4Stage::AttnHeads, "attn_heads", TOKEN_HEAD_DIM),
    (V4Stage::Lse, "lse", &["token", "head"]),
    (V4Stage::AttnDerot, "attn_derot", TOKEN_HEAD_DIM),
    (V4Stage::AttnOut, "attn_out", TOKEN_HIDDEN),
];

impl V4Stage {
    pub fn name(self) -> &'static str {
        V4_STAGES[self as usize].1
    }
    pub fn axes(self) -> &'static [&'static str] {
        V4_STAGES[self as usize].2
    }
}

impl Stage {
    /// All stages in dataflow order.
    pub const ALL: [Stage; STAGES.len()] = {
        let mut all = [Stage::AttnIn; STAGES.len()];
        let mut i = 0;
        while i < STAGES.len() {
            all[i] = STAGES[i].stage;
            i += 1;
        }
        all
    };
    /// Its row of the stage table.
    pub fn info(self) -> &'static StageInfo {
        &STAGES[self as usize]
    }
    pub fn name(self) -> &'static str {
        self.info().name
    }
    pub fn from_name(s: &str) -> Option<Stage> {
        Stage::ALL.iter().copied().find(|st| st.name() == s)
    }
    /// Axis names, outermost first.
    pub fn axes(self) -> &'static [&'static str] {
        self.info().axes
    }
    /// Position in dataflow order.
    pub fn order(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of stages: what a backend declares it provides (`Backend::provides`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StageSet(u16);

impl StageSet {
    pub const NONE: StageSet = StageSet(0);
    pub const ALL: StageSet = StageSet((1 << Stage::ALL.len()) - 1);
    pub fn of(stages: &[Stage]) -> StageSet {
        stages.iter().fold(StageSet::NONE, |s, &st| s.with(st))
    }
    pub fn with(self, s: Stage) -> StageSet {
        StageSet(self.0 | 1 << s.order())
    }
    pub fn without(self, s: Stage) -> StageSet {
        StageSet(self.0 & !(1 << s.order()))
    }
    pub fn contains(self, s: Stage) -> bool {
        self.0 & (1 << s.order()) != 0
    }
    /// The stages in both.
    pub fn intersect(self, o: StageSet) -> StageSet {
        StageSet(self.0 & o.0)
    }
    /// The stages of `self` not in `o`.
    pub fn minus(self, o: StageSet) -> StageSet {
        StageSet(self.0 & !o.0)
    }
    /// The stages in either.
    pub fn union(self, o: StageSet) -> StageSet {
        StageSet(self.0 | o.0)
    }
}

/// One stage tensor: row-major data with the stage's axes.
#[derive(Debug, Clone, PartialEq)]
pub struct StageTensor {
    pub stage: Stage,
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl StageTensor {
    pub fn new(stage: Stage, shape: Vec<usize>, data: Vec<f64>) -> StageTensor {
        assert_eq!(
            shape.len(),
            stage.axes().len(),
            "stage {stage} has axes {:?}",
            stage.axes()
        );
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "stage {stage}: shape {shape:?} vs {} values",
            data.len()
        );
        StageTensor { stage, shape, data }
    }
    pub fn from_f32(stage: Stage, shape: Vec<usize>, data: &[f32]) -> StageTensor {
        Self::new(stage, shape, data.iter().map(|&v| v as f64).collect())
    }
    /// Decode a flat index into per-axis indices.
    pub fn unravel(&self, mut i: usize) -> Vec<usize> {
        let mut idx = vec![0; self.shape.len()];
        for (k, &d) in self.shape.iter().enumerate().rev() {
            idx[k] = i % d;
            i /= d;
        }
        idx
    }
}

/// A stage an external runner produced (docs/runners.md), next to fp64 attention computed
/// from exactly the tensors the runner was given: compared as `CHECK@runner`, it isolates the error
/// the runner's kernel itself introduces from the rounding upstream of it.
#[derive(Debug, Clone, PartialEq)]
pub struct AtRunner {
    /// The end-to-end check it belongs to (`attn_latent`, `lse[decode]`, …).
    pub check: String,
    pub reference: StageTensor,
    pub optimized: StageTensor,
    /// Derived from the storage precision (`runner::local::tolerance`).
    pub tolerance: crate::tolerance::Tolerance,
    /// The dtype the runner returned this output in.
    pub out_dtype: &'static str,
}

/// The exact effect of a cache precision the reference does not model, on one check: fp64 attention
/// over the cache a runner's kernel reads (FlashMLA's fp8 cache, `runner::fp8_cache`) minus fp64 over
/// the rows as sent, carried to the check's stage. The check's end-to-end tolerance is widened by it
/// (triangle inequality: the kernel's own error is the `@runner` check's, upstream rounding the
/// calibrated tolerance's); `compare::compare_layer`.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheEffect {
    pub check: String,
    /// The cache's name (`fp8_v32`).
    pub cache: &'static str,
    /// In the stage's shape (zero on rows the runner did not compute).
    pub effect: StageTensor,
}

impl CacheEffect {
    /// The stages a latent cache reaches, in dataflow order; the token-local ones before them are the
    /// same over any cache.
    pub const REACHED: [Stage; 8] = [
        Stage::CacheRows,
        Stage::QAbsorbed,
        Stage::SplitOut,
        Stage::SplitLse,
        Stage::AttnLatent,
        Stage::Lse,
        Stage::AttnHeads,
        Stage::AttnOut,
    ];

    /// A quantized cache's effect on a layer: each stage of `quantized` that the cache reaches minus
    /// the same stage of `plain` (the layer run again over the dtype's cache), as [`CacheEffect::of`];
    /// the CPU mirror's and the CUDA path's one computation of it.
    pub fn between(
        quantized: &[StageTensor],
        plain: &[StageTensor],
        cache: &'static str,
    ) -> Vec<CacheEffect> {
        quantized
            .iter()
            .filter(|q| CacheEffect::REACHED.contains(&q.stage))
            .filter_map(|q| Some((q, plain.iter().find(|p| p.stage == q.stage)?)))
            .flat_map(|(q, p)| CacheEffect::of(q, p, cache))
            .collect()
    }

    /// A quantized cache's effect on one stage (`quantized` minus `plain`, the same stage run over the
    /// dtype's cache), under each check of the stage; none where it changed nothing.
    pub fn of(
        quantized: &StageTensor,
        plain: &StageTensor,
        cache: &'static str,
    ) -> Vec<CacheEffect> {
        let (q, p) = (quantized, plain);
        let effect: Vec<f64> = q.data.iter().zip(&p.data).map(|(a, b)| a - b).collect();
        if effect.iter().all(|&e| e == 0.0) {
            return Vec::new();
        }
        let checks = match q.stage.info().phased {
            true => vec![
                format!("{}[prefill]", q.stage.name()),
                format!("{}[decode]", q.stage.name()),
            ],
            false => vec![q.stage.name().to_string()],
        };
        checks
            .into_iter()
            .map(|check| CacheEffect {
                check,
                cache,
                effect: StageTensor::new(q.stage, q.shape.clone(), effect.clone()),
            })
            .collect()
    }
}

/// All stage tensors of one layer, in dataflow order.
#[derive(Debug, Clone, Default)]
pub struct LayerTrace {
    pub layer: usize,
    pub stages: Vec<StageTensor>,
    /// The stages an external runner produced, with their yardstick; empty for other backends.
    pub at_runner: Vec<AtRunner>,
    /// Where a runner's kernel reads a cache of lower precision than the rows it was sent.
    pub cache_effect: Vec<CacheEffect>,
    /// The storage type of each stage the backend declares one for (a capture's `stage_dtypes`:
    /// docs/captures.md); every other stage is in the run's dtype. It sets the stage's end-to-end
    /// tolerance ([`LayerTrace::tolerance_dtype`]) and the stage-local view's rounding model.
    pub storage: Vec<(Stage, crate::precision::Dtype)>,
    /// The byte format the path stored its latent cache in (`auto`: the run's dtype); `cache_rows` is
    /// then the rows as its reader decodes them, and the judge bounds them by the format's rounding.
    pub cache_format: crate::kv_format::KvFormat,
    /// The type the path's reader rounds a quantized cache's decoded rows to (`None`: read as the f32
    /// `q · s`): the per-tensor `fp8` on CUDA, whose staging pool is the run's dtype, as vLLM's Triton
    /// decode reads its fp8 cache (`(k · k_scale).to(q.dtype)`). The judge adds that rounding to the
    /// format's bound on `cache_rows`.
    pub cache_dequant: Option<crate::precision::Dtype>,
    /// The power-of-two scale of the e4m3 grid the path's decode reads q on (a runner's
    /// `conventions.q_fp8`: the `meta.q_scale` it was sent, `kv_format::e4m3_on_grid`); `None`: q as
    /// stored. The stage-local view's decode attends over q so rounded, as the kernel did.
    pub q_scale: Option<f32>,
}

impl LayerTrace {
    pub fn new(layer: usize) -> LayerTrace {
        LayerTrace {
            layer,
            stages: Vec::new(),
            at_runner: Vec::new(),
            cache_effect: Vec::new(),
            storage: Vec::new(),
            cache_format: Default::default(),
            cache_dequant: None,
            q_scale: None,
        }
    }
    pub fn push(&mut self, t: StageTensor) {
        self.stages.push(t);
        self.stages.sort_by_key(|s| s.stage.order());
    }
    pub fn get(&self, stage: Stage) -> Option<&StageTensor> {
        self.stages.iter().find(|s| s.stage == stage)
    }
    pub fn get_mut(&mut self, stage: Stage) -> Option<&mut StageTensor> {
        self.stages.iter_mut().find(|s| s.stage == stage)
    }
    /// The storage type declared for `stage` (`storage`), if any.
    pub fn declared(&self, stage: Stage) -> Option<crate::precision::Dtype> {
        self.storage
            .iter()
            .find(|(s, _)| *s == stage)
            .map(|&(_, d)| d)
    }
    /// `stage`'s storage type: declared, else the run's `dtype`.
    pub fn dtype_of(
        &self,
        stage: Stage,
        dtype: crate::precision::Dtype,
    ) -> crate::precision::Dtype {
        self.declared(stage).unwrap_or(dtype)
    }
    /// The dtype whose calibrated end-to-end tolerance bounds `stage`: the coarsest storage type of it
    /// and of the trace's stages before it in dataflow order, whose error it carries (an f32 o_proj
    /// of heads from an f16 attention is f16-accurate). The run's `dtype` where nothing is declared.
    pub fn tolerance_dtype(
        &self,
        stage: Stage,
        dtype: crate::precision::Dtype,
    ) -> crate::precision::Dtype {
        if self.storage.is_empty() {
            return dtype;
        }
        self.stages
            .iter()
            .map(|t| t.stage)
            .filter(|s| s.order() <= stage.order())
            .chain([stage])
            .map(|s| self.dtype_of(s, dtype))
            .fold(self.dtype_of(stage, dtype), |a, b| {
                if b.round_unit() > a.round_unit() {
                    b
                } else {
                    a
                }
            })
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    /// A cache's effect is taken stage by stage, matched by stage (not position), only where a cache
    /// reaches and the stage changed; phased stages under both of their checks.
    #[test]
    fn cache_effect_between_matches_stages_the_cache_reaches() {
        let t = |s: Stage, v: f64| {
            let mut shape = vec![1; s.axes().len()];
            shape[0] = 2;
            StageTensor::new(s, shape, vec![v, 1.0])
        };
        let quantized = [
            t(Stage::QPe, 9.0),
            t(Stage::Lse, 3.0),
            t(Stage::AttnOut, 5.0),
        ];
        let plain = [
            t(Stage::AttnOut, 4.0),
            t(Stage::QPe, 1.0),
            t(Stage::Lse, 3.0),
        ];
        let e = CacheEffect::between(&quantized, &plain, "fp8");
        let checks: Vec<&str> = e.iter().map(|c| c.check.as_str()).collect();
        assert_eq!(checks, ["attn_out[prefill]", "attn_out[decode]"]);
        assert_eq!(e[0].effect.data, [1.0, 0.0]);
        let quantized = [t(Stage::CacheRows, 2.0), t(Stage::Lse, 2.0)];
        let e = CacheEffect::between(&quantized, &plain, "fp8");
        let checks: Vec<&str> = e.iter().map(|c| c.check.as_str()).collect();
        // No plain cache_rows to subtract: nothing, rather than a guess.
        assert_eq!(checks, ["lse[prefill]", "lse[decode]"]);
    }

    /// A declared storage type bounds its stage and every stage after it in dataflow order, the
    /// coarsest winning; nothing declared, the run's dtype.
    #[test]
    fn a_stage_is_bounded_by_the_coarsest_type_up_to_it() {
        use crate::precision::Dtype;
        let mut t = LayerTrace::new(0);
        for s in [
            Stage::KvLatent,
            Stage::CacheRows,
            Stage::AttnLatent,
            Stage::AttnOut,
        ] {
            t.push(StageTensor::new(s, vec![1; s.axes().len()], vec![0.0]));
        }
        assert_eq!(t.tolerance_dtype(Stage::AttnOut, Dtype::F32), Dtype::F32);
        t.storage = vec![(Stage::CacheRows, Dtype::F16), (Stage::AttnOut, Dtype::F32)];
        assert_eq!(t.tolerance_dtype(Stage::KvLatent, Dtype::F32), Dtype::F32);
        assert_eq!(t.tolerance_dtype(Stage::CacheRows, Dtype::F32), Dtype::F16);
        assert_eq!(t.tolerance_dtype(Stage::AttnOut, Dtype::F32), Dtype::F16);
        assert_eq!(t.dtype_of(Stage::AttnOut, Dtype::Bf16), Dtype::F32);
        t.storage.push((Stage::KvLatent, Dtype::Bf16));
        assert_eq!(
            t.tolerance_dtype(Stage::AttnLatent, Dtype::F32),
            Dtype::Bf16
        );
    }

    /// `Stage::info` indexes the table by the variant's value: each row must sit at its own index, and
    /// names must be unique (they key traces, reports and `--tol`).
    #[test]
    fn rows_are_in_variant_order_with_unique_names() {
        for (i, row) in STAGES.iter().enumerate() {
            assert_eq!(row.stage as usize, i, "{}", row.name);
            assert_eq!(Stage::from_name(row.name), Some(row.stage));
        }
        let mut names: Vec<&str> = STAGES.iter().flat_map(|r| [r.name, r.short]).collect();
        names.sort();
        names.dedup();
        assert_eq!(
            names.len() + 1,
            2 * STAGES.len(),
            "one shared name: lse is its own short name"
        );
    }
}
