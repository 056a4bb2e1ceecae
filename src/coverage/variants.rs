//! The production variants the selection rules can pick for a model's dims on a device, and which of
//! them a run reached (issue #35): the `variants` of the coverage section.

use super::{covering, decode_requests, phase_runs};
use crate::kernel_use::Phase;
use crate::model::MlaConfig;
use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};

/// The production variants of a model's dims on a device, and which this run reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Variants {
    /// The device the rules were evaluated for, and why that one (e.g. no GPU here: sm_90a assumed).
    pub device: String,
    pub list: Vec<VariantRun>,
}

/// One production variant and whether the run reached it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariantRun {
    pub phase: Phase,
    /// `tiles::variants::Variant::id`.
    pub id: String,
    pub kernel: String,
    /// A launch of the serving matrix that selects it.
    pub when: String,
    /// Whether a launch of this run (its schedule's decode steps, a serving batch's requests, the
    /// prompt; on a DSA file a query past top_k) selects it on `device`: on the CUDA backend of that
    /// device the kernel ran; on the CPU mirror the same launch shapes ran.
    pub reached: bool,
    /// Reached only by a batch aimed at it (`backend::serving::aims`, checked as `variant_batch` in
    /// `runner_checks`), not by the schedule's own launches.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub aimed: bool,
}

impl Variants {
    /// One line for the table and Markdown.
    pub fn line(&self) -> String {
        let n = self.list.iter().filter(|v| v.reached).count();
        format!(
            "production variants ({}): {n} of {} reached: {}",
            self.device,
            self.list.len(),
            self.list
                .iter()
                .map(|v| format!(
                    "{} {}",
                    v.id,
                    match (v.reached, v.aimed) {
                        (true, false) => "yes",
                        (true, true) => "yes (aimed batch)",
                        _ => "NO",
                    }
                ))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// The production variants of `cfg` on `caps` (`device` says which and why) and which of them this
/// run reached: the prompt's prefill kernel, every decode launch of the schedule and of `extra` (with
/// the run's heads, q_len, page and splits), the variants the backend aimed batches at (`aimed`:
/// `backend::serving::aims`, `sparse_aim`), and `sparse_attn` when `sparse_queries > 0` on a DSA file
/// (`top_k`). Each variant not reached adds a warning.
pub fn variants(
    cfg: &MlaConfig,
    s: &Schedule,
    extra: &[crate::batch::Request],
    aimed: &[String],
    caps: &crate::tiles::choice::Caps,
    device: &str,
    dsa: Option<(usize, usize)>,
) -> (Variants, Vec<String>) {
    use crate::tiles::variants as tv;
    let d = covering::cuda_dims(cfg, crate::precision::Dtype::Bf16);
    let all = tv::variants(&d, caps, dsa.map(|(k, _)| k));
    let mut hit: Vec<String> = Vec::new();
    if phase_runs(Phase::Prefill, s) {
        hit.extend(
            all.iter()
                .filter(|v| v.phase == Phase::Prefill)
                .map(|v| v.id.clone()),
        );
    }
    if phase_runs(Phase::Decode, s) {
        for (keys, q) in decode_requests(s, extra) {
            let l = tv::Launch {
                heads: cfg.n_head,
                q_len: q,
                page: s.page_size,
                splits: s.num_splits,
                n_keys: keys,
            };
            let (k, loads) = tv::decode_variant(&d, caps, &l);
            hit.push(tv::decode_id(k, loads));
        }
    }
    if dsa.is_some_and(|(_, sparse)| sparse > 0) {
        hit.push(tv::SPARSE_ID.into());
    }
    let list: Vec<VariantRun> = all
        .into_iter()
        .map(|v| VariantRun {
            reached: hit.contains(&v.id) || aimed.contains(&v.id),
            aimed: !hit.contains(&v.id) && aimed.contains(&v.id),
            phase: v.phase,
            id: v.id,
            kernel: v.kernel.into(),
            when: v.when,
        })
        .collect();
    let warnings = list
        .iter()
        .filter(|v| !v.reached)
        .map(|v| {
            format!(
                "coverage: production variant {} ({device}) not reached by this run: it runs at {}",
                v.id, v.when
            )
        })
        .collect();
    (
        Variants {
            device: device.into(),
            list,
        },
        warnings,
    )
}
