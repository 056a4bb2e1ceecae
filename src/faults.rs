//! The catalogue of planted bugs: real MLA bug classes (each row cites the public reports) that can be
//! switched on in the optimized path, for every layer or one layer only (`mla-diff run --inject NAME[@layer=L]`).
//!
//! The CPU mirror (`backend::cpu`) injects each fault at the one stage function it models. The CUDA
//! kernels switch the same fault on with the compile-time define `Info::define` (`MLA_FAULT_…`); faults in
//! host code (weight upload, cuBLAS calls, launch order, kernel arguments) are switched by the host from the
//! same `FaultSet`. `Info::cuda_site` says where each one sits.
//!
//! Each fault names the earliest comparator check it must fail (the names of `compare::checks`, which are
//! in dataflow order) and what a run needs to expose it (`Need`). `mla-diff selftest` builds such a run
//! for every fault and proves it is caught there, at that check, in the targeted layer only.

use crate::error::{Error, Result};
use crate::model::{MlaConfig, RopePairing};
use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};

mod catalogue;
mod text;
pub use catalogue::CATALOGUE;
pub use text::{list_text, markdown};

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    RopeNeox,
    RopeNorm,
    YarnMscaleMissing,
    Scale576,
    KvBSwap,
    KBUntransposed,
    LatentBeforeNorm,
    KPeBeforeRope,
    CachePeFirst,
    PageOffByOne,
    LseLog2Merge,
    EmptyCtxLseInf,
    CausalOffByOne,
    QAbsFp16Accum,
    ReadPastEnd,
    SplitDropLast,
    HeadStrideQk,
    Wg2KeysDropped,
    SplitTailDropped,
    IndexerRopeSwap,
    IndexerNonCausal,
    IndexerNoRelu,
    IndexerTopkOffByOne,
    SparseIndexPageBase,
    IndexerFp8Scale,
    SplitLseBf16,
    KvScaleTwice,
    KvScaleInverted,
    KvRopeQuantized,
    KvScaleWrongGroup,
    KvSaturate240,
    KvScaleUnwritten,
    PairsHandoverStale,
    SmallRingWrap,
    TmaPageTile,
    WindowOffByOne,
    CompressGroupOffByOne,
    CompressorStateDropped,
    SinkDropped,
    KpoolNoApe,
    KpoolFromPositionZero,
    KpoolNoTail,
    KpoolSharedOwnIndexer,
    KpoolSharedWrongLayer,
    KpoolSoftmaxChannels,
    RopeOnNope,
    NopePadAsRope,
}

/// What a run needs for a fault to be visible at all. Model needs are properties of the file; run
/// needs are properties of the schedule (`Need::met` checks both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Need {
    /// A NORM-pairing architecture (DeepSeek2 family, GLM, PLM).
    NormRope,
    /// A NEOX-pairing architecture (MiniCPM3).
    NeoxRope,
    /// YaRN with mscale ≠ 1 (DeepSeek-V2/V3, Kimi-K2).
    Yarn,
    /// A qk head dim (P+R) different from the v head dim (not GLM, where both are 256).
    QkNotV,
    /// q_absorbed beyond the fp16 range (large activations; checked on the reference values): where
    /// the fault overflows, as in the bug report. (The stage-local view also sees the fault's fp16
    /// accumulation without overflow, so it has no control run.)
    LargeQAbs,
    /// An f32 run: the fault's effect on its earliest stage is a few percent, within the bf16 noise
    /// there, so only f32 pins it to that stage (bf16 catches it one stage later).
    F32,
    /// A prefill chunk of at least 2 tokens.
    Prefill,
    /// Tokens at positions > 0 (rope is the identity at position 0).
    Positions,
    /// Decode steps (the absorbed path: q_absorbed, split-KV, combine).
    Decode,
    /// Decode with at least 2 non-empty splits, the last one included.
    MultiSplit,
    /// More rows than one page: page boundaries inside the sequence.
    PageCrossing,
    /// Decode, with the row after the sequence end inside an owned page (unwritten, so NaN-poisoned,
    /// rather than memory the sequence does not own).
    EndInsidePage,
    /// Decode with a split of more than 32 keys: keys in the second half of a 64-key tile (the second
    /// warpgroup's in the Hopper kernel).
    SplitOverHalfTile,
    /// Decode with a split longer than one 64-key tile whose length is not a multiple of 32: a partial
    /// last tile after a full one, for 64- and 32-key tiles alike.
    SplitTail,
    /// q_len × heads ≥ 64 decode rows: what the CUDA backend runs Hopper's warpgroup kernel for (the
    /// CPU mirror and the CUDA kernels of fewer rows show a fault that needs it without it).
    DecodeRows64,
    /// A DSA file with an indexer and queries that see more than its top_k keys (the indexer's
    /// selection matters only there; a file property, checked on the report's coverage).
    Dsa,
    /// The indexer on fp8 keys (`--indexer-keys fp8`, a run option), over enough queries (176 prompt
    /// tokens on the selftest's DSA fixture) for a per-key fault of a few σ to show in the count of far
    /// flips (`compare::selection::FLIP_SIGMAS`).
    Fp8Keys,
    /// A quantized latent cache (`run --kv-cache-dtype`, a run option) in a format the fault applies to
    /// (`kv_format::fault_fits`).
    KvCache,
    /// Decode on a model whose production variants (`tiles::variants`, sm_90a) include
    /// `attn_wgmma_pairs`: 576/512 rows and 64+ decode rows (a plain run's batch aimed at it reaches it
    /// where its own launches do not).
    PairsKernel,
    /// Decode on a model whose production variants include `attn_small` (fewer than 64 rows, 16-bit).
    SmallKernel,
    /// Decode on a model whose production variants include `attn_wgmma` or `attn_wgmma_pairs` taking
    /// key tiles by TMA from pages of two or more 64-key tiles (page 128).
    MultiTilePage,
    /// A glm5-next file with its k-pool indexer, past top_k (a file property; `run --inject` on it).
    Kpool,
    /// Shared indexer layers (`indexer.types`): a layer reusing an earlier full layer's selection.
    SharedIndexer,
    /// A DeepSeek-V4 file (`deepseek4`): the fault sits in the V4 mirror (`backend::cpu::v4`), not
    /// the MLA path.
    V4,
    /// A NoPE model (qk_rope 0: glm5-next), whose latent row is 512 wide with no rope part.
    NoPe,
}

impl Need {
    pub fn name(self) -> &'static str {
        match self {
            Need::NormRope => "NORM rope",
            Need::NeoxRope => "NEOX rope",
            Need::Yarn => "YaRN",
            Need::QkNotV => "P+R≠Dv",
            Need::LargeQAbs => "q_abs beyond fp16",
            Need::F32 => "f32",
            Need::Prefill => "prefill",
            Need::Positions => "pos>0",
            Need::Decode => "decode",
            Need::MultiSplit => "≥2 splits",
            Need::PageCrossing => "page boundaries",
            Need::EndInsidePage => "end inside a page",
            Need::SplitOverHalfTile => "a split > 32 keys",
            Need::SplitTail => "a split tail after a full tile",
            Need::DecodeRows64 => "q_len×heads ≥ 64",
            Need::Dsa => "DSA past top_k",
            Need::Fp8Keys => "fp8 indexer keys",
            Need::KvCache => "a quantized kv cache",
            Need::PairsKernel => "the attn_wgmma_pairs kernel",
            Need::SmallKernel => "the attn_small kernel",
            Need::MultiTilePage => "attn_wgmma by TMA on multi-tile pages",
            Need::V4 => "a DeepSeek-V4 file",
            Need::Kpool => "a glm5-next k-pool indexer past top_k",
            Need::SharedIndexer => "shared indexer layers",
            Need::NoPe => "NoPE (qk_rope 0)",
        }
    }
    /// Whether the model and schedule provide this; `None` when it depends on values, the dtype or the
    /// kernels' selection rules (`tiles::variants::need_met` answers those).
    pub fn met(self, cfg: &MlaConfig, s: &Schedule) -> Option<bool> {
        let decode = s.decode_steps > 0;
        Some(match self {
            Need::NormRope => cfg.rope.pairing == RopePairing::Norm,
            Need::NeoxRope => cfg.rope.pairing == RopePairing::Neox,
            Need::Yarn => (cfg.mscale - 1.0).abs() > 1e-3,
            Need::QkNotV => cfg.qk_head_dim() != cfg.v_head_dim,
            Need::NoPe => cfg.qk_rope == 0,
            Need::LargeQAbs | Need::F32 | Need::Dsa | Need::Fp8Keys | Need::KvCache => return None,
            Need::Kpool | Need::SharedIndexer => cfg.arch == crate::model::Arch::Glm5Next,
            // An MLA config is never a V4 file (`MlaConfig::from_gguf` refuses one).
            Need::V4 => false,
            Need::Prefill => s.prompt_len >= 2 && s.chunk >= 2,
            Need::Positions => s.pos_offset > 0 || s.total_tokens() >= 2,
            Need::Decode => decode,
            Need::MultiSplit => {
                decode
                    && s.num_splits >= 2
                    && s.split_ranges(s.prompt_len + 1)
                        .last()
                        .is_some_and(|r| !r.is_empty())
            }
            Need::PageCrossing => s.total_tokens() > s.page_size,
            Need::EndInsidePage => decode && !s.total_tokens().is_multiple_of(s.page_size),
            // The last query of each step sees its splits whole: their lengths are the longest ranges.
            Need::SplitOverHalfTile => decode_split_lens(s).any(|n| n > 32),
            Need::SplitTail => decode_split_lens(s).any(|n| n > 64 && n % 32 != 0),
            Need::DecodeRows64 => decode && s.q_len.saturating_mul(cfg.n_head) >= 64,
            // The kernel selection rules' answer (`tiles::variants::need_met`, a floor above).
            Need::PairsKernel | Need::SmallKernel | Need::MultiTilePage => return None,
        })
    }
}

/// The key counts of every decode step's non-empty splits, as the step's last query sees them (uncut):
/// vLLM's partition gives `ceil(seq/S)` keys to every full split and the rest to the last non-empty one,
/// so these two per step are all there are (O(steps), whatever the number of splits).
pub fn decode_split_lens(s: &Schedule) -> impl Iterator<Item = usize> + '_ {
    s.decode_ranges().into_iter().flat_map(move |r| {
        let seq = r.end;
        let per = seq.div_ceil(s.num_splits.max(1)).max(1);
        [per.min(seq), seq - (seq - 1) / per * per]
    })
}

/// The name an indexer fault's first check has: the DSA selection check of `run::dsa`, beside the
/// stage checks.
pub const SELECTION_CHECK: &str = "selection";

/// The name a kernel-variant fault's first check has: the batch aimed at its kernel's variant
/// (`backend::serving::aims`, reported in `runner_checks`), beside the stage checks.
pub const VARIANT_CHECK: &str = "variant_batch";

/// The name a serving-batch fault's first check has: the run's serving batch of mixed lengths
/// (`backend::serving::Batch::of`, reported in `runner_checks`), for a fault that needs a batch of more
/// than one request (the run's own launches are one sequence each).
pub const BATCH_CHECK: &str = "serving_batch";

/// A fault's row of the catalogue.
#[derive(Debug, Clone, Copy)]
pub struct Info {
    pub fault: Fault,
    /// The name `--inject` takes.
    pub name: &'static str,
    /// The CUDA compile-time define (or host switch) that turns it on.
    pub define: &'static str,
    /// What goes wrong, in one line.
    pub summary: &'static str,
    /// The real bug (or bug class) it models, in the project's words.
    pub models: &'static str,
    /// Public reports of that bug (issue and pull-request pages); empty where there is no single one.
    pub sources: &'static [&'static str],
    /// The earliest comparator check it must fail (`compare::Check::name`).
    pub expected: &'static str,
    /// What a run needs to expose it.
    pub needs: &'static [Need],
    /// Where it sits in the CUDA backend (kernels/*.cu, or host code in src/backend/cuda).
    pub cuda_site: &'static str,
}

impl Fault {
    pub const ALL: [Fault; 47] = [
        Fault::RopeNeox,
        Fault::RopeNorm,
        Fault::YarnMscaleMissing,
        Fault::Scale576,
        Fault::KvBSwap,
        Fault::KBUntransposed,
        Fault::LatentBeforeNorm,
        Fault::KPeBeforeRope,
        Fault::CachePeFirst,
        Fault::PageOffByOne,
        Fault::LseLog2Merge,
        Fault::EmptyCtxLseInf,
        Fault::CausalOffByOne,
        Fault::QAbsFp16Accum,
        Fault::ReadPastEnd,
        Fault::SplitDropLast,
        Fault::HeadStrideQk,
        Fault::Wg2KeysDropped,
        Fault::SplitTailDropped,
        Fault::IndexerRopeSwap,
        Fault::IndexerNonCausal,
        Fault::IndexerNoRelu,
        Fault::IndexerTopkOffByOne,
        Fault::SparseIndexPageBase,
        Fault::IndexerFp8Scale,
        Fault::SplitLseBf16,
        Fault::KvScaleTwice,
        Fault::KvScaleInverted,
        Fault::KvRopeQuantized,
        Fault::KvScaleWrongGroup,
        Fault::KvSaturate240,
        Fault::KvScaleUnwritten,
        Fault::PairsHandoverStale,
        Fault::SmallRingWrap,
        Fault::TmaPageTile,
        Fault::WindowOffByOne,
        Fault::CompressGroupOffByOne,
        Fault::CompressorStateDropped,
        Fault::SinkDropped,
        Fault::KpoolNoApe,
        Fault::KpoolFromPositionZero,
        Fault::KpoolNoTail,
        Fault::KpoolSharedOwnIndexer,
        Fault::KpoolSharedWrongLayer,
        Fault::KpoolSoftmaxChannels,
        Fault::RopeOnNope,
        Fault::NopePadAsRope,
    ];

    /// A fault of DeepSeek-V4 attention (`Need::V4`): planted in the V4 mirror, judged at a V4 stage
    /// (`trace::V4Stage`); an MLA run refuses it, and the MLA self-test does not run it.
    pub fn is_v4(self) -> bool {
        self.info().needs.contains(&Need::V4)
    }

    /// A fault of glm5-next's k-pool indexer (`Need::Kpool`): planted in the k-pool mirror
    /// (`backend::cpu::kpool`) or a shared layer's reuse (`run::kpool`); the self-test's fixtures have
    /// runs it on its glm5-next fixture.
    pub fn is_kpool(self) -> bool {
        self.info().needs.contains(&Need::Kpool)
    }

    /// Whether the CUDA path has a site for it (a define or a host switch); the catalogue's `cuda_site` of
    /// one without says "not planted in the CUDA path yet".
    pub fn in_cuda(self) -> bool {
        !self
            .info()
            .cuda_site
            .starts_with("not planted in the CUDA path")
    }

    /// A fault of the DSA indexer: caught by the selection check (`SELECTION_CHECK`), not a stage check.
    pub fn is_indexer(self) -> bool {
        self.info().expected == SELECTION_CHECK
    }

    /// A fault of one kernel variant (`tiles::variants`): caught by the batch aimed at that variant
    /// (`VARIANT_CHECK`), which a plain run runs where its schedule does not reach the kernel.
    pub fn is_variant(self) -> bool {
        self.info().expected == VARIANT_CHECK
    }

    /// A fault of a write launch over several requests: caught by the run's serving batch
    /// (`BATCH_CHECK`), the first launch of more than one request a run has.
    pub fn is_batch(self) -> bool {
        self.info().expected == BATCH_CHECK
    }

    /// The fault's row of the catalogue.
    pub fn info(self) -> &'static Info {
        &CATALOGUE[self as usize]
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    pub fn from_name(s: &str) -> Option<Fault> {
        let s = s.replace('-', "_");
        Fault::ALL.iter().copied().find(|f| f.name() == s)
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The faults active in one layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Active(u64);

impl Active {
    pub const NONE: Active = Active(0);
    pub fn on(self, f: Fault) -> bool {
        self.0 & (1u64 << f as u32) != 0
    }
    pub fn with(self, f: Fault) -> Active {
        Active(self.0 | 1u64 << f as u32)
    }
    pub fn without(self, f: Fault) -> Active {
        Active(self.0 & !(1u64 << f as u32))
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// One `--inject NAME[@layer=L]`: a fault in every layer (`layer: None`) or in one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Injection {
    #[serde(with = "by_name")]
    pub name: Fault,
    pub layer: Option<usize>,
}

mod by_name {
    use super::Fault;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(f: &Fault, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(f.name())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Fault, D::Error> {
        let s = String::deserialize(d)?;
        Fault::from_name(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown fault {s:?}")))
    }
}

impl Injection {
    /// Parse `NAME` or `NAME@layer=L`.
    pub fn parse(spec: &str) -> Result<Injection> {
        let (name, layer) = match spec.split_once('@') {
            None => (spec, None),
            Some((n, rest)) => {
                let l = rest
                    .strip_prefix("layer=")
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .ok_or_else(|| {
                        Error::Usage(format!(
                            "--inject {spec:?}: expected NAME or NAME@layer=L (L a layer number)"
                        ))
                    })?;
                (n, Some(l))
            }
        };
        let fault = Fault::from_name(name.trim()).ok_or_else(|| {
            Error::Usage(format!(
                "--inject {spec:?}: unknown fault {name:?}; the catalogue: {} (`mla-diff selftest --list` describes each)",
                catalogue_names()
            ))
        })?;
        Ok(Injection { name: fault, layer })
    }
}

impl std::fmt::Display for Injection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            None => write!(f, "{}", self.name),
            Some(l) => write!(f, "{}@layer={l}", self.name),
        }
    }
}

/// The faults of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultSet(pub Vec<Injection>);

impl FaultSet {
    pub fn active(&self, layer: usize) -> Active {
        self.0
            .iter()
            .filter(|i| i.layer.is_none_or(|l| l == layer))
            .fold(Active::NONE, |a, i| a.with(i.name))
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// An MLA run's faults: MLA's only (`refuse_v4`), their layer targets as `check_targets` says.
    pub fn check_layers(&self, n_layer: usize, run_layers: &[usize]) -> Result<()> {
        self.refuse_v4()?;
        self.check_targets(n_layer, run_layers)
    }
    /// Layer targets must exist in the model and be among the layers the run compares.
    pub fn check_targets(&self, n_layer: usize, run_layers: &[usize]) -> Result<()> {
        for i in &self.0 {
            if let Some(l) = i.layer {
                if l >= n_layer {
                    return Err(Error::Usage(format!(
                        "--inject {i}: the model has {n_layer} layers (0..{n_layer})"
                    )));
                }
                if !run_layers.contains(&l) {
                    return Err(Error::Usage(format!(
                        "--inject {i}: layer {l} is not among the layers this run compares (--layers)"
                    )));
                }
            }
        }
        Ok(())
    }
    /// An MLA run refuses DeepSeek-V4's faults (`Fault::is_v4`): they sit in the V4 mirror alone.
    pub fn refuse_v4(&self) -> Result<()> {
        match self.0.iter().find(|i| i.name.is_v4()) {
            Some(i) => Err(Error::Usage(format!(
                "--inject {i}: a DeepSeek-V4 fault; plant it in a run of a V4 (deepseek4) file"
            ))),
            None => Ok(()),
        }
    }
    /// Faults this run may not show, each with the needs it lacks (value and dtype needs are not checked):
    /// `met` answers each need (`Need::met`, or `tiles::variants::need_met` with the kernel rules).
    pub fn blind_spots(&self, met: &dyn Fn(Need) -> Option<bool>) -> Vec<String> {
        self.0
            .iter()
            .filter_map(|i| {
                let missing: Vec<&str> = i
                    .name
                    .info()
                    .needs
                    .iter()
                    .filter(|&&n| met(n) == Some(false))
                    .map(|n| n.name())
                    .collect();
                (!missing.is_empty()).then(|| format!("{i} (needs {})", missing.join(", ")))
            })
            .collect()
    }
}

impl std::fmt::Display for FaultSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v: Vec<String> = self.0.iter().map(|i| i.to_string()).collect();
        f.write_str(&v.join(", "))
    }
}

/// The catalogue's names, comma-separated (for one-line errors; `mla-diff selftest --list` describes each).
pub fn catalogue_names() -> String {
    Fault::ALL.map(|f| f.name()).join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::Check;

    #[test]
    fn catalogue_is_consistent() {
        let mut names = std::collections::HashSet::new();
        for f in Fault::ALL {
            let i = f.info();
            assert_eq!(i.fault, f);
            assert!(names.insert(i.name), "duplicate {}", i.name);
            assert_eq!(i.define, format!("MLA_FAULT_{}", i.name.to_uppercase()));
            let v4_stage = crate::trace::V4_STAGES.iter().any(|s| s.1 == i.expected);
            assert!(
                (f.is_v4() && v4_stage)
                    || Check::parse(i.expected).is_some()
                    || i.expected == SELECTION_CHECK
                    || i.expected == VARIANT_CHECK
                    || i.expected == BATCH_CHECK,
                "{}: {}",
                i.name,
                i.expected
            );
            assert_eq!(Fault::from_name(i.name), Some(f));
        }
    }

    #[test]
    fn injections_parse() {
        assert_eq!(
            Injection::parse("rope_neox@layer=3").unwrap(),
            Injection {
                name: Fault::RopeNeox,
                layer: Some(3)
            }
        );
        assert_eq!(Injection::parse("split-drop-last").unwrap().layer, None);
        for bad in ["nope", "rope_neox@3", "rope_neox@layer=x", ""] {
            assert!(Injection::parse(bad).is_err(), "{bad}");
        }
        let set = FaultSet(vec![
            Injection::parse("rope_neox@layer=1").unwrap(),
            Injection::parse("scale_576").unwrap(),
        ]);
        assert!(set.active(1).on(Fault::RopeNeox) && set.active(1).on(Fault::Scale576));
        assert!(!set.active(0).on(Fault::RopeNeox) && set.active(0).on(Fault::Scale576));
    }
}
