//! The selftest's runs: for each fault, the run its needs call for, and the controls (the fault on a run
//! that lacks one need), as a table.

use super::fixtures::{Model, HEADS};
use crate::faults::{Fault, Need};
use crate::kv_format::KvFormat;
use crate::precision::{Dtype, KeyPrecision};
use crate::schedule::Schedule;

/// The minimal run: one prefill chunk of 6 tokens at position 0, all in one page, no decode.
pub const MINIMAL: Schedule = Schedule {
    prompt_len: 6,
    chunk: 6,
    decode_steps: 0,
    q_len: 1,
    page_size: 64,
    num_splits: 1,
    shuffle_seed: Some(7),
    spare_pages: 1,
    pos_offset: 0,
};

/// Prompt tokens of the kernel-variant faults' runs: the aimed batches' longest request (256 keys, each
/// the run's row `j mod T`) then reads rows that do not repeat within a 64-key tile pair.
pub const VARIANT_PROMPT: usize = 128;

/// The schedule for a fault's needs: `MINIMAL` grown by each need.
pub fn schedule_for(needs: &[Need]) -> Schedule {
    let mut s = MINIMAL;
    for n in needs {
        match n {
            Need::Positions => s.pos_offset = 5,
            Need::Decode | Need::EndInsidePage => s.decode_steps = s.decode_steps.max(3),
            Need::MultiSplit => {
                s.decode_steps = s.decode_steps.max(3);
                s.num_splits = 3;
            }
            Need::PageCrossing => (s.page_size, s.spare_pages) = (4, 2),
            // The fixtures' rows per query are their heads: 16 queries of 4 heads fill one 64-row tile.
            Need::DecodeRows64 => {
                s.decode_steps = s.decode_steps.max(3);
                s.q_len = 64usize.div_ceil(HEADS);
            }
            // Prompts that put a good share of the keys where the fault is (a margin, not a bare pass):
            // 16+ keys in the second half of a tile; a 25+-key tail after the first full tile.
            Need::SplitOverHalfTile => {
                s.decode_steps = s.decode_steps.max(3);
                s.prompt_len = s.prompt_len.max(48);
            }
            Need::SplitTail => {
                s.decode_steps = s.decode_steps.max(3);
                s.prompt_len = s.prompt_len.max(88);
            }
            // Past the fixture's top_k (16) in prefill and decode.
            Need::Dsa => {
                s.prompt_len = s.prompt_len.max(40);
                s.chunk = 16;
                s.decode_steps = s.decode_steps.max(3);
            }
            // Enough sparse queries for the flip count (measured: `tests/it/dsa.rs`).
            Need::Fp8Keys => {
                s.prompt_len = s.prompt_len.max(176);
                s.chunk = s.chunk.max(16);
            }
            // The default run's page (16): no launch of the schedule's own takes the kernel (TMA needs
            // pages of 64+ keys), a batch aimed at it does (`backend::serving::aims`: 256 keys), over
            // stored rows that do not repeat within it, so that a key read from another key's row shows.
            Need::PairsKernel | Need::SmallKernel | Need::MultiTilePage => {
                s.decode_steps = s.decode_steps.max(3);
                s.page_size = 16;
                s.spare_pages = 2;
                s.prompt_len = s.prompt_len.max(VARIANT_PROMPT);
                s.chunk = s.chunk.max(VARIANT_PROMPT);
            }
            // glm5-next's fixture past its top_k (32): 96 prompt tokens (6 pools of 16) in chunks of 32 and
            // one decode step (tests/it/kpool_run.rs).
            Need::Kpool => {
                (s.prompt_len, s.chunk) = (96, 32);
                s.decode_steps = s.decode_steps.max(1);
            }
            // The V4 fixture's run (src/run/v4/tests.rs): 136 prompt tokens in chunks of 64 (past the
            // window of 128 and HCA's first window, which spans two passes), 4 decode steps.
            Need::V4 => (s.prompt_len, s.chunk, s.decode_steps) = (136, 64, 4),
            Need::SharedIndexer
            | Need::NoPe
            | Need::NormRope
            | Need::NeoxRope
            | Need::Yarn
            | Need::QkNotV
            | Need::LargeQAbs
            | Need::F32
            | Need::Prefill
            | Need::KvCache => {}
        }
    }
    // Split lengths follow from the whole schedule (3 splits of `MultiSplit` share the keys): grow the
    // prompt until one split is long enough.
    let long_enough = |n: Need, s: &Schedule| {
        let mut lens = crate::faults::decode_split_lens(s);
        match n {
            Need::SplitOverHalfTile => lens.any(|n| n > 32),
            _ => lens.any(|n| n > 64 && n % 32 != 0),
        }
    };
    for n in [Need::SplitOverHalfTile, Need::SplitTail] {
        while needs.contains(&n) && !long_enough(n, &s) {
            s.prompt_len += 1;
        }
    }
    if needs.contains(&Need::EndInsidePage) && s.total_tokens().is_multiple_of(s.page_size) {
        s.decode_steps += 1;
    }
    s
}

/// One run of the selftest: a fault (or none) on a fixture and schedule.
#[derive(Debug, Clone)]
pub struct Case {
    pub fault: Option<Fault>,
    /// A control: the fault on a run that lacks this one need, where it must stay invisible.
    pub lacking: Option<Need>,
    pub model: Model,
    pub dtype: Dtype,
    pub sched: Schedule,
    /// How the optimized indexer stores q and k (`Need::Fp8Keys`: fp8).
    pub keys: KeyPrecision,
    /// How the optimized path stores its latent cache (`Need::KvCache`: `fp8_ds_mla`, which every cache
    /// fault fits on the selftest's DeepSeek-V3 fixture).
    pub kv: KvFormat,
    /// The layer the fault is planted in (`TARGET` but on the glm5-next and V4 fixtures: `target_for`).
    pub target: usize,
}

/// The layer a fault is planted in: `TARGET` (the middle one of 3), except on glm5-next's fixture
/// (MLA on 3, 7, 11; 11 shares 7's selection): its first MLA layer, or the shared layer for a
/// shared-layer fault; and for DeepSeek-V4's faults the layer kind each was measured on
/// (src/run/v4/tests.rs): the compressor's groups and the sink on the HCA layer 2, the window edge
/// and the carried state on the CSA layer 1.
pub fn target_for(f: Fault) -> usize {
    let needs = f.info().needs;
    match f {
        Fault::CompressGroupOffByOne | Fault::SinkDropped => 2,
        _ if needs.contains(&Need::SharedIndexer) => super::fixtures::GLM5_NEXT.shared,
        _ if Model::for_needs(needs) == Model::Glm5Next => 3,
        _ => super::TARGET,
    }
}

/// A control: a fault on a run that lacks one of its needs (and has the others), where it must not be
/// detected. This shows that the need is real and that the exposing run is not arbitrary.
#[derive(Debug, Clone)]
pub struct Control {
    pub fault: Fault,
    pub lacking: Need,
    /// `None`: the fault's own fixture.
    pub model: Option<Model>,
    /// `None`: the fault's own schedule.
    pub sched: Option<Schedule>,
}

pub const CONTROLS: [Control; 14] = [
    Control {
        fault: Fault::RopeNeox,
        lacking: Need::NormRope,
        model: Some(Model::Minicpm3),
        sched: None,
    },
    Control {
        fault: Fault::RopeNorm,
        lacking: Need::NeoxRope,
        model: Some(Model::DeepseekV3),
        sched: None,
    },
    Control {
        fault: Fault::YarnMscaleMissing,
        lacking: Need::Yarn,
        model: Some(Model::Glm5),
        sched: None,
    },
    Control {
        fault: Fault::HeadStrideQk,
        lacking: Need::QkNotV,
        model: Some(Model::Glm5),
        sched: None,
    },
    Control {
        fault: Fault::KPeBeforeRope,
        lacking: Need::Positions,
        model: None,
        sched: Some(Schedule {
            prompt_len: 1,
            chunk: 1,
            ..MINIMAL
        }),
    },
    Control {
        fault: Fault::CausalOffByOne,
        lacking: Need::Prefill,
        model: None,
        sched: Some(Schedule {
            chunk: 1,
            ..MINIMAL
        }),
    },
    Control {
        fault: Fault::EmptyCtxLseInf,
        lacking: Need::Prefill,
        model: None,
        sched: Some(Schedule {
            prompt_len: 0,
            chunk: 1,
            decode_steps: 3,
            ..MINIMAL
        }),
    },
    Control {
        fault: Fault::KBUntransposed,
        lacking: Need::Decode,
        model: None,
        sched: Some(MINIMAL),
    },
    Control {
        fault: Fault::PageOffByOne,
        lacking: Need::PageCrossing,
        model: None,
        sched: Some(MINIMAL),
    },
    // Its own run (decode, 3 splits) with one split.
    Control {
        fault: Fault::LseLog2Merge,
        lacking: Need::MultiSplit,
        model: None,
        sched: Some(Schedule {
            decode_steps: 3,
            ..MINIMAL
        }),
    },
    // The Hopper kernel's 64 rows (16 queries of 4 heads) but one step: its splits hold at most 22 keys,
    // all in the first half of a tile.
    Control {
        fault: Fault::Wg2KeysDropped,
        lacking: Need::SplitOverHalfTile,
        model: None,
        sched: Some(Schedule {
            decode_steps: 1,
            q_len: 16,
            ..MINIMAL
        }),
    },
    // The pre-#14 default `run` schedule (48 + 16 tokens, 4 splits): no split spans more than one tile.
    Control {
        fault: Fault::SplitTailDropped,
        lacking: Need::SplitTail,
        model: None,
        sched: Some(Schedule {
            prompt_len: 48,
            chunk: 32,
            decode_steps: 16,
            q_len: 1,
            page_size: 16,
            num_splits: 4,
            shuffle_seed: Some(7),
            spare_pages: 3,
            pos_offset: 0,
        }),
    },
    // The kernel-variant faults' run on 4 heads: 4 (or 8) decode rows, below the Hopper kernels' 64,
    // so neither attn_wgmma_pairs nor attn_wgmma by TMA is among its production variants; the faults
    // must not show (no false pass: the report says "needs the … kernel", `FaultSet::blind_spots`).
    Control {
        fault: Fault::PairsHandoverStale,
        lacking: Need::PairsKernel,
        model: Some(Model::DeepseekV3),
        sched: None,
    },
    Control {
        fault: Fault::TmaPageTile,
        lacking: Need::MultiTilePage,
        model: Some(Model::DeepseekV3),
        sched: None,
    },
];

/// The NoPE faults' controls (glm5-next's fixture): rope at position 0 alone is the identity; a
/// single prefill chunk reads no cache row (its keys are its own fresh latents), so no pad.
const NOPE_CONTROLS: [Control; 2] = [
    Control {
        fault: Fault::RopeOnNope,
        lacking: Need::Positions,
        model: None,
        sched: Some(Schedule {
            prompt_len: 1,
            chunk: 1,
            ..MINIMAL
        }),
    },
    Control {
        fault: Fault::NopePadAsRope,
        lacking: Need::Decode,
        model: None,
        sched: Some(MINIMAL),
    },
];

/// The controls as runs.
pub fn controls() -> Vec<Case> {
    CONTROLS
        .iter()
        .chain(&NOPE_CONTROLS)
        .map(|k| {
            let c = Case::for_fault(k.fault);
            Case {
                lacking: Some(k.lacking),
                model: k.model.unwrap_or(c.model),
                sched: k.sched.clone().unwrap_or(c.sched.clone()),
                ..c
            }
        })
        .collect()
}

impl Model {
    /// The fixture a fault's model needs.
    pub fn for_needs(needs: &[Need]) -> Model {
        if needs.contains(&Need::V4) {
            Model::DeepseekV4
        } else if needs.contains(&Need::Kpool) || needs.contains(&Need::NoPe) {
            Model::Glm5Next
        } else if needs.contains(&Need::Dsa) {
            Model::Glm5Dsa
        } else if needs.iter().any(|n| {
            matches!(
                n,
                Need::PairsKernel | Need::SmallKernel | Need::MultiTilePage
            )
        }) {
            Model::DeepseekV3Wide
        } else if needs.contains(&Need::NeoxRope) {
            Model::Minicpm3
        } else if needs.contains(&Need::LargeQAbs) {
            Model::V2LiteLargeQAbs
        } else {
            Model::DeepseekV3
        }
    }
}

impl Case {
    pub fn for_fault(f: Fault) -> Case {
        let needs = f.info().needs;
        Case {
            fault: Some(f),
            lacking: None,
            model: Model::for_needs(needs),
            dtype: match needs.contains(&Need::F32) {
                true => Dtype::F32,
                false => Dtype::Bf16,
            },
            sched: schedule_for(needs),
            keys: match needs.contains(&Need::Fp8Keys) {
                true => KeyPrecision::Fp8,
                false => KeyPrecision::Storage,
            },
            kv: match needs.contains(&Need::KvCache) {
                true => KvFormat::Fp8DsMla,
                false => KvFormat::Auto,
            },
            target: target_for(f),
        }
    }
    pub(super) fn clean(&self) -> Case {
        Case {
            fault: None,
            lacking: None,
            ..self.clone()
        }
    }
    pub(super) fn setup_key(&self) -> String {
        format!(
            "{} {} {}{}{}",
            self.model.name(),
            self.dtype.name(),
            self.params(),
            match self.keys {
                KeyPrecision::Fp8 => " fp8-keys",
                KeyPrecision::Storage => "",
            },
            match self.kv {
                KvFormat::Auto => String::new(),
                kv => format!(" kv={kv}"),
            }
        )
    }
    /// The run's schedule, test-backend-ops style.
    pub fn params(&self) -> String {
        let s = &self.sched;
        format!(
            "prompt={} chunk={} decode={} q_len={} page={} splits={} pos={}",
            s.prompt_len, s.chunk, s.decode_steps, s.q_len, s.page_size, s.num_splits, s.pos_offset
        )
    }
    /// The whole run, test-backend-ops style: `model=deepseek-v3 dtype=bf16 prompt=6 chunk=6 …`.
    pub fn vars(&self) -> String {
        format!(
            "model={} dtype={} {}",
            self.model.name(),
            self.dtype.name(),
            self.params()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_meet_static_needs() {
        for f in Fault::ALL {
            let c = Case::for_fault(f);
            c.sched.validate().unwrap();
            // Model needs are checked against the fixture in `judge`; here the schedule needs.
            for n in f.info().needs {
                let mut cfg = crate::model::catalogue::Preset::DeepseekV3.test_config();
                cfg.n_head = HEADS;
                if matches!(
                    n,
                    Need::Positions
                        | Need::Prefill
                        | Need::Decode
                        | Need::MultiSplit
                        | Need::PageCrossing
                        | Need::EndInsidePage
                        | Need::SplitOverHalfTile
                        | Need::SplitTail
                        | Need::DecodeRows64
                ) {
                    assert_eq!(n.met(&cfg, &c.sched), Some(true), "{f}: {}", n.name());
                }
            }
        }
    }

    /// Each control's run is the fault's own run without the one need (the schedule ones checked here;
    /// model and value needs in `judge`).
    #[test]
    fn controls_lack_their_need() {
        let mut cfg = crate::model::catalogue::Preset::DeepseekV3.test_config();
        cfg.n_head = HEADS;
        for c in controls() {
            let (f, n) = (c.fault.unwrap(), c.lacking.unwrap());
            assert!(f.info().needs.contains(&n), "{f}: {}", n.name());
            c.sched.validate().unwrap();
            if let Some(met) = crate::tiles::variants::need_met(n, &cfg, &c.sched).filter(|_| {
                !matches!(
                    n,
                    Need::NormRope | Need::NeoxRope | Need::Yarn | Need::QkNotV
                )
            }) {
                assert!(!met, "{f}: the control run has {}", n.name());
            }
        }
    }

    /// The kernel-variant faults run on the 64-head fixture at the default run's page, where each
    /// fault's kernel runs only in a batch aimed at it; on the 4-head fixtures neither Hopper kernel
    /// can run (their controls), attn_small can.
    #[test]
    fn variant_faults_run_where_only_an_aimed_batch_reaches_their_kernel() {
        use super::super::fixtures::WIDE_HEADS;
        use crate::tiles::variants::need_met;
        let mut wide = crate::model::catalogue::Preset::DeepseekV3.test_config();
        wide.n_head = WIDE_HEADS;
        let mut narrow = wide.clone();
        narrow.n_head = HEADS;
        for f in [
            Fault::PairsHandoverStale,
            Fault::SmallRingWrap,
            Fault::TmaPageTile,
        ] {
            let c = Case::for_fault(f);
            assert_eq!((c.model, c.sched.page_size), (Model::DeepseekV3Wide, 16));
            let need = *f.info().needs.last().unwrap();
            assert_eq!(need_met(need, &wide, &c.sched), Some(true), "{f}");
            assert_eq!(
                need_met(need, &narrow, &c.sched),
                Some(f == Fault::SmallRingWrap),
                "{f}"
            );
            // Its kernel is not among the schedule's own launches: a batch aimed at it runs it.
            let aimed: Vec<String> = crate::backend::serving::aims(&wide, &c.sched)
                .into_iter()
                .map(|a| a.id)
                .collect();
            let kernel = match f {
                Fault::PairsHandoverStale => "attn_wgmma_pairs/",
                Fault::SmallRingWrap => "attn_small/",
                _ => "/tma-multi-tile-page",
            };
            assert!(aimed.iter().any(|id| id.contains(kernel)), "{f}: {aimed:?}");
        }
    }
}
