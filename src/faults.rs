//! The catalogue of planted bugs: real MLA bug classes (mla-conventions.md §5) that can be switched on in
//! the optimized path, for every layer or one layer only (`mla-diff run --inject NAME[@layer=L]`).
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
    /// q_absorbed beyond the fp16 range (large activations; checked on the reference values).
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
        }
    }
    /// Whether the model and schedule provide this; `None` when it depends on values or the dtype.
    pub fn met(self, cfg: &MlaConfig, s: &Schedule) -> Option<bool> {
        let decode = s.decode_steps > 0;
        Some(match self {
            Need::NormRope => cfg.rope.pairing == RopePairing::Norm,
            Need::NeoxRope => cfg.rope.pairing == RopePairing::Neox,
            Need::Yarn => (cfg.mscale - 1.0).abs() > 1e-3,
            Need::QkNotV => cfg.qk_head_dim() != cfg.v_head_dim,
            Need::LargeQAbs | Need::F32 => return None,
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
        })
    }
}

/// A fault's catalogue entry.
#[derive(Debug, Clone, Copy)]
pub struct Info {
    pub fault: Fault,
    /// The name `--inject` takes.
    pub name: &'static str,
    /// The CUDA compile-time define (or host switch) that turns it on.
    pub define: &'static str,
    /// What goes wrong, in one line.
    pub summary: &'static str,
    /// The real bug it models, with its source (mla-conventions.md §5 unless stated).
    pub models: &'static str,
    /// The earliest comparator check it must fail (`compare::Check::name`).
    pub expected: &'static str,
    /// What a run needs to expose it.
    pub needs: &'static [Need],
    /// Where it sits in the CUDA backend (kernels/*.cu, or host code in src/backend/cuda).
    pub cuda_site: &'static str,
}

impl Fault {
    pub const ALL: [Fault; 17] = [
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
    ];

    pub fn info(self) -> Info {
        use Need::*;
        let i = |name, define, summary, models, expected, needs, cuda_site| Info {
            fault: self,
            name,
            define,
            summary,
            models,
            expected,
            needs,
            cuda_site,
        };
        match self {
            Fault::RopeNeox => i(
                "rope_neox",
                "MLA_FAULT_ROPE_NEOX",
                "rope pairs (x[i], x[i+R/2]) (NEOX) on a model whose pairs are (x[2i], x[2i+1]) (NORM)",
                "interleaved vs NeoX rope mix-up: transformers PR #46372 (GlmMoeDsa applied split-half rope to interleaved MLA), §5.1",
                "q_pe",
                &[NormRope, Positions, Prefill],
                "kernels/norm_rope.cu `rope`: the NEOX branch regardless of MLA_ROPE_NEOX (q_pe and k_pe)",
            ),
            Fault::RopeNorm => i(
                "rope_norm",
                "MLA_FAULT_ROPE_NORM",
                "rope pairs (x[2i], x[2i+1]) (NORM) on a NEOX model (MiniCPM3)",
                "the reverse mix-up: MiniCPM3 is NEOX (llama_model_rope_type, §1.4); llama.cpp conversion/glm.py must permute for the NEOX-only M-RoPE kernel, §5.1",
                "q_pe",
                &[NeoxRope, Positions, Prefill],
                "kernels/norm_rope.cu `rope`: the NORM branch regardless of MLA_ROPE_NEOX",
            ),
            Fault::YarnMscaleMissing => i(
                "yarn_mscale_missing",
                "MLA_FAULT_YARN_MSCALE_MISSING",
                "softmax scale 1/sqrt(P+R) without YaRN's mscale²",
                "onnxruntime/mobius PR #548 and transformers PR #47435 (rope attention_scaling kept, softmax mscale² dropped), §5.2",
                "lse[prefill]",
                &[Yarn, Prefill],
                "host, src/backend/cuda/mod.rs: `scale_log2` for prefill.cu and decode.cu from 1/sqrt(P+R) (attention.cuh applies it to q·k)",
            ),
            Fault::Scale576 => i(
                "scale_576",
                "MLA_FAULT_SCALE_576",
                "softmax scale 1/sqrt(Lkv+R) (576^-0.5 for DeepSeek: the absorbed head width) instead of the model's",
                "FlashMLA's default softmax_scale = 576^-0.5 where DeepSeek needs 192^-0.5·mscale² (interface trap, §5; §3 softmax scale)",
                "lse[prefill]",
                &[Prefill],
                "host, src/backend/cuda/mod.rs: `scale_log2` from 1/sqrt(Lkv+R)",
            ),
            Fault::KvBSwap => i(
                "kv_b_swap",
                "MLA_FAULT_KV_B_SWAP",
                "kv_b split per head as [v | k_nope] instead of [k_nope | v]: W_UK and W_UV read from each other's rows",
                "kv_b_proj is [W_UK; W_UV] per head (vLLM process_weights_after_loading, §3; converter split §1.3); layout assumptions, §5.10",
                "lse[prefill]",
                &[Prefill],
                "host, src/backend/cuda/mod.rs weight upload: w_uk/w_uv taken from the swapped halves of each head's kv_b block",
            ),
            Fault::KBUntransposed => i(
                "k_b_untransposed",
                "MLA_FAULT_K_B_UNTRANSPOSED",
                "attn_k_b (W_UKᵀ, torch [H, Lkv, P]) used as [H, P, Lkv] without its transpose in the absorbed query",
                "the converter stores k_b transposed (§1.3, PR #12801) and vLLM keeps W_UK_T (§3); a reader that skips the transpose, §5.10",
                "q_absorbed",
                &[Decode],
                "host, src/backend/cuda/mod.rs: the q_absorbed batched GEMM reads each head's W_UK buffer as [Lkv, P] row-major (no transpose)",
            ),
            Fault::LatentBeforeNorm => i(
                "latent_before_norm",
                "MLA_FAULT_LATENT_BEFORE_NORM",
                "cache rows written with the latent before kv_a_norm",
                "the cache holds the RMS-normed latent (llama.cpp deepseek2 graph §1.5; vLLM concat_and_cache_mla(k_c_normed) §3)",
                "cache_rows",
                &[],
                "host, src/backend/cuda/mod.rs token_local(): `cache_write` launched before the kv_a_norm `rmsnorm` (after the k_pe `rope`; kernels/cache_write.cu unchanged)",
            ),
            Fault::KPeBeforeRope => i(
                "k_pe_before_rope",
                "MLA_FAULT_K_PE_BEFORE_ROPE",
                "cache rows written with k_pe before rope",
                "the cache holds the roped k_pe (llama.cpp §1.5: 'holding the RMS-normed latent and the RoPE'd k_pe'; vLLM §3)",
                "cache_rows",
                &[Positions],
                "host, src/backend/cuda/mod.rs token_local(): `cache_write` launched before the k_pe `rope`",
            ),
            Fault::CachePeFirst => i(
                "cache_pe_first",
                "MLA_FAULT_CACHE_PE_FIRST",
                "cache rows written [k_pe | latent] while every reader expects [latent | k_pe]",
                "llama.cpp PR #18986 changed the row from [pe, kv] to [kv, pe]; CUDA FA had the old layout hard-coded (§1.5, §5.10)",
                "cache_rows",
                &[],
                "kernels/cache_write.cu `cache_write`: k_pe to columns [0, R), the latent to [R, R+Lkv) (`cache_gather` and attention unchanged)",
            ),
            Fault::PageOffByOne => i(
                "page_off_by_one",
                "MLA_FAULT_PAGE_OFF_BY_ONE",
                "the cache writer takes the page of token t from (t−1)/page: a page's first row lands on row 0 of the previous page",
                "paged-cache addressing bugs: ROCm/aiter #2996/#3095 (page_size > 1 ignored), sglang-jax #1074, cutlass PR #2221, §5.7",
                "cache_rows",
                &[PageCrossing],
                "kernels/cache_write.cu `cache_write` only: slot = table[(t−1)/MLA_PAGE]·MLA_PAGE + t%MLA_PAGE for t > 0 (`cache_gather` keeps `cache_slot`)",
            ),
            Fault::LseLog2Merge => i(
                "lse_log2_merge",
                "MLA_FAULT_LSE_LOG2_MERGE",
                "the split combine treats the natural-log split LSEs as base 2 (exp2/log2)",
                "sglang issue #40903 (base-2 LSE merged with the natural-log formula); flashinfer PR #787 (log2e in sm_scale), §5.6",
                "attn_latent",
                &[Decode, MultiSplit, F32],
                "kernels/decode.cu `combine_splits`: exp2f(lse_k − max) weights and max + log2f(Σw)",
            ),
            Fault::EmptyCtxLseInf => i(
                "empty_ctx_lse_inf",
                "MLA_FAULT_EMPTY_CTX_LSE_INF",
                "the context pass also runs for a chunk without context and returns lse +inf (FA2), merged as if −inf",
                "vLLM PR #15492 (FA2 gives +inf for an empty context, merge_attn_states assumed −inf) and PR #49294, §5.6",
                "lse[prefill]",
                &[Prefill],
                "host: run the context pass and `merge_states` (kernels/prefill.cu) for the first chunk too (0 keys); kernels/attention.cuh (prefill.cu): a row that sees no key writes lse = +inf; `merge_states` then merges it without its isinf guard",
            ),
            Fault::CausalOffByOne => i(
                "causal_off_by_one",
                "MLA_FAULT_CAUSAL_OFF_BY_ONE",
                "the causal mask lets each query see one key past itself",
                "a mask boundary bug (issue #6's list; no single §5 entry: the masking/boundary class of §5.6-§5.7)",
                "lse[prefill]",
                &[Prefill],
                "kernels/attention.cuh: causal limit of query i is key i+1 instead of i (prefill's own chunk and decode within a step)",
            ),
            Fault::QAbsFp16Accum => i(
                "q_abs_fp16_accum",
                "MLA_FAULT_Q_ABS_FP16_ACCUM",
                "q_absorbed = W_UKᵀ·q_nope in fp16 (fp16 operands, accumulator and result) instead of with f32 accumulation",
                "llama.cpp PR #13137: the wk_b batched GEMM ran in fp16 on CUDA (GGML_PREC_F32 ignored) and overflowed (V2-Lite ppl 27.6 vs 7.9); PR #12801 discussion, §5.5",
                "q_absorbed",
                &[Decode, LargeQAbs],
                "host, src/backend/cuda/mod.rs: the q_absorbed cuBLAS batched GEMM with fp16 operands, CUBLAS_COMPUTE_16F and an fp16 result (operands and result converted on the host)",
            ),
            Fault::ReadPastEnd => i(
                "read_past_end",
                "MLA_FAULT_READ_PAST_END",
                "the last split's key loop runs one row past the sequence end (an unwritten, NaN-poisoned row)",
                "paged-cache boundary bugs, §5.7 (cutlass PR #2221 pages-per-sequence vs pool, ROCm/aiter PR #4452 offsets); NaN-poisoned pool as in peer harnesses",
                "split_out",
                &[Decode, EndInsidePage],
                "kernels/attention.cuh (decode.cu, ATT_PAGED): the last split's key end and each row's causal limit one key further, i.e. min(split end, limit) + 1",
            ),
            Fault::SplitDropLast => i(
                "split_drop_last",
                "MLA_FAULT_SPLIT_DROP_LAST",
                "the split combine merges splits 0..S−1 and drops the last one",
                "split-KV combine bugs (Triton decode stage 2 merges every non-empty split, §3; merge class §5.6)",
                "attn_latent",
                &[Decode, MultiSplit],
                "kernels/decode.cu `combine_splits`: loops over num_splits − 1",
            ),
            Fault::HeadStrideQk => i(
                "head_stride_qk",
                "MLA_FAULT_HEAD_STRIDE_QK",
                "o_proj reads the heads with head stride P+R (the qk dim) where Dv is meant",
                "llama.cpp PR #7327 (n_embd_head_k used for n_embd_head_v when reshaping kqv), §5.13; local-inference-lab/vllm PR #17 (head stride 192 vs 128), §5.6",
                "attn_out[prefill]",
                &[QkNotV, Prefill],
                "host, src/backend/cuda/mod.rs: the o_proj input re-strided with `copy_heads` (kernels/cache_write.cu) using a source head stride of P+R, once over all rows after every head is computed (reads past the end hit NaN padding)",
            ),
        }
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
pub struct Active(u32);

impl Active {
    pub const NONE: Active = Active(0);
    pub fn on(self, f: Fault) -> bool {
        self.0 & (1 << f as u32) != 0
    }
    pub fn with(self, f: Fault) -> Active {
        Active(self.0 | 1 << f as u32)
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
    /// Layer targets must exist in the model and be among the layers the run compares.
    pub fn check_layers(&self, n_layer: usize, run_layers: &[usize]) -> Result<()> {
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
    /// Faults this run may not show, each with the needs it lacks (value and dtype needs are not checked).
    pub fn blind_spots(&self, cfg: &MlaConfig, sched: &Schedule) -> Vec<String> {
        self.0
            .iter()
            .filter_map(|i| {
                let missing: Vec<&str> = i
                    .name
                    .info()
                    .needs
                    .iter()
                    .filter(|n| n.met(cfg, sched) == Some(false))
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
            assert!(
                Check::parse(i.expected).is_some(),
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
