//! What gets compared: each stage tensor, and for the attention outputs each phase (prefill rows vs
//! decode rows) separately, in the order the data flows through a serving step.
//!
//! Splitting by phase matters for localisation: a split-KV merge bug shows in `attn_heads[decode]`
//! while `attn_heads[prefill]` stays clean, and a chunked-prefill merge bug the other way round.

use crate::schedule::Schedule;
use crate::trace::Stage;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Prefill,
    Decode,
}

/// One comparison: a stage, optionally restricted to one phase's token rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Check {
    pub stage: Stage,
    pub phase: Option<Phase>,
}

impl Check {
    pub fn name(&self) -> String {
        match self.phase {
            None => self.stage.name().to_string(),
            Some(Phase::Prefill) => format!("{}[prefill]", self.stage.name()),
            Some(Phase::Decode) => format!("{}[decode]", self.stage.name()),
        }
    }
    pub fn parse(s: &str) -> Option<Check> {
        let (st, phase) = match s.split_once('[') {
            None => (s, None),
            Some((st, rest)) => match rest {
                "prefill]" => (st, Some(Phase::Prefill)),
                "decode]" => (st, Some(Phase::Decode)),
                _ => return None,
            },
        };
        Some(Check {
            stage: Stage::from_name(st)?,
            phase,
        })
    }
    /// The rows (first axis) of the stage tensor this check covers.
    pub fn rows(&self, sched: &Schedule) -> Range<usize> {
        match self.phase {
            None if self.stage.axes()[0] == "decode_token" => 0..sched.decode_tokens(),
            None => 0..sched.total_tokens(),
            Some(Phase::Prefill) => 0..sched.prompt_len,
            Some(Phase::Decode) => sched.prompt_len..sched.total_tokens(),
        }
    }
}

/// The terminal table's column name of a stage (`StageInfo::short`); `--tol` and `--tol-file` accept
/// it too, with `.p` / `.d` for the phase, as the table prints it.
pub fn short_name(stage: Stage) -> &'static str {
    stage.info().short
}

/// The table's column name of a check: short stage name and `.p` / `.d` for the phase.
pub fn short_check_name(c: &Check) -> String {
    let phase = match c.phase {
        None => "",
        Some(Phase::Prefill) => ".p",
        Some(Phase::Decode) => ".d",
    };
    format!("{}{phase}", short_name(c.stage))
}

/// All checks for a schedule, in dataflow order: projections, cache, prefill attention, decode attention,
/// output projection. Checks with no rows under the schedule are left out.
pub fn checks_for(sched: &Schedule) -> Vec<Check> {
    let plain = |stage| Check { stage, phase: None };
    let pre = |stage| Check {
        stage,
        phase: Some(Phase::Prefill),
    };
    let dec = |stage| Check {
        stage,
        phase: Some(Phase::Decode),
    };
    let mut v = vec![
        plain(Stage::AttnIn),
        plain(Stage::QNope),
        plain(Stage::QPe),
        plain(Stage::KvLatent),
        plain(Stage::KPe),
        plain(Stage::CacheRows),
        pre(Stage::Lse),
        pre(Stage::AttnHeads),
        plain(Stage::QAbsorbed),
        plain(Stage::SplitOut),
        plain(Stage::SplitLse),
        plain(Stage::AttnLatent),
        dec(Stage::Lse),
        dec(Stage::AttnHeads),
        pre(Stage::AttnOut),
        dec(Stage::AttnOut),
    ];
    debug_assert!(v.iter().all(|c| c.phase.is_none() != c.stage.info().phased));
    v.retain(|c| !c.rows(sched).is_empty());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in checks_for(&Schedule::default()) {
            assert_eq!(Check::parse(&c.name()), Some(c));
        }
    }

    #[test]
    fn prefill_only_schedule_has_no_decode_checks() {
        let s = Schedule {
            decode_steps: 0,
            ..Schedule::default()
        };
        assert!(checks_for(&s)
            .iter()
            .all(|c| c.phase != Some(Phase::Decode) && c.stage.axes()[0] != "decode_token"));
    }
}
