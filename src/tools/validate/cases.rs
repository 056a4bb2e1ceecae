//! gpu-validate's cases: a layer shape from the model catalogue and a schedule, one literal per case,
//! each printing itself test-backend-ops style (`vars`).

use crate::model::catalogue::Preset;
use crate::model::rope_factors::RopeFactors;
use crate::model::synthetic;
use crate::model::{LayerWeights, MlaConfig};
use crate::schedule::Schedule;

/// One validation case as the table states it: a layer shape and a schedule.
#[derive(Debug, Clone)]
pub struct CaseSpec {
    pub name: &'static str,
    pub preset: Preset,
    /// Overrides of the model's real dims (`None`: the model's).
    pub hidden: Option<usize>,
    pub heads: Option<usize>,
    pub q_lora: Option<usize>,
    pub prompt: usize,
    pub chunk: usize,
    pub decode: usize,
    pub q_len: usize,
    pub page: usize,
    pub splits: usize,
    /// Part of `--quick`.
    pub quick: bool,
}

/// The sweep. Full model dims at short schedules; reduced hidden/heads (attention dims unchanged) at
/// long ones, so the fp64 reference stays cheap. Every case crosses page and split boundaries.
pub const CASES: [CaseSpec; 9] = [
    CaseSpec {
        name: "deepseek-v3 full dims",
        preset: Preset::DeepseekV3,
        hidden: None,
        heads: None,
        q_lora: None,
        prompt: 40,
        chunk: 16,
        decode: 64,
        q_len: 1,
        page: 16,
        splits: 4,
        quick: true,
    },
    CaseSpec {
        // page 64: the quick sweep's run of the TMA key loads (kernels/sm90/tma.cuh), splits not page-aligned.
        name: "glm-5 full dims, MTP q_len 2",
        preset: Preset::Glm5,
        hidden: None,
        heads: None,
        q_lora: None,
        prompt: 37,
        chunk: 16,
        decode: 64,
        q_len: 2,
        page: 64,
        splits: 3,
        quick: true,
    },
    CaseSpec {
        name: "minicpm3 full dims",
        preset: Preset::Minicpm3,
        hidden: None,
        heads: None,
        q_lora: None,
        prompt: 45,
        chunk: 20,
        decode: 64,
        q_len: 1,
        page: 16,
        splits: 4,
        quick: true,
    },
    CaseSpec {
        name: "deepseek-v3 dims, prompt 1",
        preset: Preset::DeepseekV3,
        hidden: Some(512),
        heads: Some(16),
        q_lora: Some(256),
        prompt: 1,
        chunk: 1,
        decode: 70,
        q_len: 1,
        page: 16,
        splits: 4,
        quick: true,
    },
    CaseSpec {
        name: "deepseek-v3 dims H16, prompt 2048",
        preset: Preset::DeepseekV3,
        hidden: Some(1024),
        heads: Some(16),
        q_lora: Some(512),
        prompt: 2048,
        chunk: 512,
        decode: 64,
        q_len: 1,
        page: 64,
        splits: 8,
        quick: false,
    },
    CaseSpec {
        name: "glm-5 dims H8, prompt 777, q_len 2",
        preset: Preset::Glm5,
        hidden: Some(1024),
        heads: Some(8),
        q_lora: Some(512),
        prompt: 777,
        chunk: 256,
        decode: 64,
        q_len: 2,
        page: 32,
        splits: 5,
        quick: false,
    },
    CaseSpec {
        name: "minicpm3 dims, prompt 1500",
        preset: Preset::Minicpm3,
        hidden: Some(1024),
        heads: None,
        q_lora: Some(384),
        prompt: 1500,
        chunk: 600,
        decode: 64,
        q_len: 1,
        page: 64,
        splits: 3,
        quick: false,
    },
    // 40 heads x q_len 2 = 80 rows: Hopper's wgmma decode (64-row tiles, the second one partly empty)
    // with MiniCPM3's 256-wide latent and 288-wide key rows; page 64: its key tiles by TMA (the last of
    // the five 64-column boxes half past the row, zero-filled by the copy).
    CaseSpec {
        name: "minicpm3 dims, MTP q_len 2, prompt 700",
        preset: Preset::Minicpm3,
        hidden: Some(1024),
        heads: None,
        q_lora: Some(384),
        prompt: 700,
        chunk: 256,
        decode: 64,
        q_len: 2,
        page: 64,
        splits: 3,
        quick: false,
    },
    CaseSpec {
        name: "deepseek-v3 dims H128, prompt 300",
        preset: Preset::DeepseekV3,
        hidden: Some(1024),
        heads: None,
        q_lora: Some(512),
        prompt: 300,
        chunk: 128,
        decode: 64,
        q_len: 1,
        page: 64,
        splits: 4,
        quick: false,
    },
];

/// A case of a sweep: its row and the schedule it makes.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub spec: &'static CaseSpec,
    pub sched: Schedule,
}

/// The cases of a sweep (`quick`: the small ones only).
pub fn cases(quick: bool) -> Vec<Case> {
    CASES
        .iter()
        .filter(|c| c.quick || !quick)
        .map(|spec| Case {
            name: spec.name.into(),
            spec,
            sched: spec.schedule(),
        })
        .collect()
}

impl Case {
    /// See `CaseSpec::vars`.
    pub fn vars(&self) -> String {
        self.spec.vars()
    }
    /// The case's synthetic layer and rope factors.
    pub fn layer(&self) -> (MlaConfig, LayerWeights, Option<RopeFactors>) {
        self.spec.layer()
    }
}

impl CaseSpec {
    pub fn schedule(&self) -> Schedule {
        Schedule {
            prompt_len: self.prompt,
            chunk: self.chunk,
            decode_steps: self.decode,
            q_len: self.q_len,
            page_size: self.page,
            num_splits: self.splits,
            shuffle_seed: Some(self.prompt as u64 * 31 + self.decode as u64),
            spare_pages: 3,
            pos_offset: 0,
        }
    }

    /// The case, test-backend-ops style: `deepseek-v3 hidden=7168 heads=128 q_lora=1536 prompt=40 …`.
    pub fn vars(&self) -> String {
        let d = self.dims();
        format!(
            "{} hidden={} heads={} q_lora={} {}",
            self.preset,
            d.hidden,
            d.n_head,
            d.q_lora.map_or("none".into(), |r| r.to_string()),
            self.sched_vars()
        )
    }

    /// The schedule part of `vars`.
    pub fn sched_vars(&self) -> String {
        format!(
            "prompt={} chunk={} decode={} q_len={} page={} splits={}",
            self.prompt, self.chunk, self.decode, self.q_len, self.page, self.splits
        )
    }

    fn dims(&self) -> synthetic::Dims {
        let mut d = self.preset.full_dims();
        d.hidden = self.hidden.unwrap_or(d.hidden);
        d.n_head = self.heads.unwrap_or(d.n_head);
        d.q_lora = self.q_lora.or(d.q_lora);
        d
    }

    /// The case's synthetic layer and rope factors.
    pub fn layer(&self) -> (MlaConfig, LayerWeights, Option<RopeFactors>) {
        let cfg = self.preset.config(self.dims());
        let w = synthetic::weights(&cfg, 1234);
        let rf = synthetic::rope_factors(&cfg, 99);
        (cfg, w, rf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_print_themselves_and_are_valid() {
        assert_eq!(cases(true).len(), 4);
        for c in cases(false) {
            c.sched.validate().unwrap();
            // Every case crosses page and split boundaries.
            let s = &c.sched;
            assert!(
                s.total_tokens() > s.page_size && s.num_splits >= 2,
                "{}",
                c.name
            );
        }
        assert_eq!(
            CASES[0].vars(),
            "deepseek-v3 hidden=7168 heads=128 q_lora=1536 prompt=40 chunk=16 decode=64 q_len=1 page=16 splits=4"
        );
    }
}
