//! What one fuzz execution runs: the library path a file takes through `inspect`, `inspect --json`,
//! `lint` (its file side), `inspect --load-layer 0` and the front of `run` (header → config → rope
//! factors → token rows → layer-0 weights → dequantization of each attention tensor), plus the memory
//! bound it must keep.

use crate::alloc;
use crate::gguf::{dequantize_f32, GgmlType, GgufFile};
use crate::model::rope_factors::RopeFactors;
use crate::model::MlaConfig;
use std::path::Path;

/// How far an execution got before the file was rejected (all rejections are fine; panics are not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    Rejected,
    Opened,
    Config,
    Layer0,
}

/// Fixed allowance per execution: error strings, hash maps, JSON of a few small values.
pub const BASE_ALLOWANCE: u64 = 1 << 20;
/// Heap bytes per header byte: a metadata array element takes ≥ 1 file byte but is a 32-byte `Value`,
/// and a growing `Vec` may hold up to 2× its length (tensor infos are cheaper than that per byte).
pub const HEADER_FACTOR: u64 = 64;
/// Transient copies of a dequantized tensor: the output, candle's chunk and its `to_vec1` copy (kv_b's
/// head split and k_b's transpose hold at most two).
pub const DEQUANT_COPIES: u64 = 3;

/// Fewest bits per weight of any ggml type (IQ1_S: 50 bytes per 256): a tensor of `b` bytes holds at most
/// `b·8/bpw` values, so its f32 form is at most 4·8/bpw ≈ 20.5× its bytes.
fn min_bits_per_weight() -> f64 {
    GgmlType::all()
        .iter()
        .map(|t| t.type_size as f64 * 8.0 / t.block as f64)
        .fold(f64::INFINITY, f64::min)
}

/// The heap an execution may use for a file of `file_size` bytes before its header is parsed.
pub fn header_allowance(file_size: u64) -> u64 {
    BASE_ALLOWANCE + HEADER_FACTOR * file_size
}

/// The allowance once the header is known: the header's, plus every tensor the target may dequantize as
/// f32 (each counted at most as many values as the file's bytes can hold), times `DEQUANT_COPIES`.
pub fn allowance(f: &GgufFile) -> u64 {
    let max_values = (f.file_size as f64 * 8.0 / min_bits_per_weight()) as u64;
    let mut names: Vec<String> = crate::model::weights::tensor_names(0).into();
    names.extend(
        [
            "rope_factors_short.weight",
            "rope_factors_long.weight",
            "rope_freqs.weight",
        ]
        .map(String::from),
    );
    let values: u64 = names
        .iter()
        .filter_map(|n| f.tensor(n))
        .map(|t| t.n_elements().min(max_values))
        .sum();
    // Two token rows.
    let rows = f
        .tensor("token_embd.weight")
        .map(|t| t.ne[0].saturating_mul(2).min(max_values))
        .unwrap_or(0);
    header_allowance(f.data_offset.min(f.file_size)).saturating_add(
        DEQUANT_COPIES
            .saturating_mul(4)
            .saturating_mul(values + rows),
    )
}

/// An error the user would see as `mla-diff: error: …` must stay one line with no raw control
/// characters (names from the file are attacker-controlled).
pub fn check_message(e: &crate::Error) -> Option<String> {
    let m = e.to_string();
    m.chars()
        .any(|c| c.is_control())
        .then(|| format!("error message with a raw control character: {m:?}"))
}

/// What one execution did.
pub struct Outcome {
    pub stage: Stage,
    /// An oracle violation that is not a panic (a bad error message).
    pub bad: Option<String>,
    /// The heap allowance it ran under, bytes.
    pub allowance: u64,
}

/// Run the target over the file at `path`. `base` is the allocator base of this execution (see
/// `alloc::arm`, armed with `header_allowance`); the allowance is raised once the header is parsed.
pub fn exec(path: &Path, base: usize, file_size: u64) -> Outcome {
    let mut allowed = header_allowance(file_size);
    let mut bad = None;
    let mut note = |r: &crate::Error| {
        if bad.is_none() {
            bad = check_message(r);
        }
    };
    let f = match GgufFile::open(path) {
        Ok(f) => f,
        Err(e) => {
            note(&e);
            return Outcome {
                stage: Stage::Rejected,
                bad,
                allowance: allowed,
            };
        }
    };
    allowed = allowance(&f);
    alloc::set_allowance(base, allowed as usize);
    if let Err(e) = crate::inspect::inspect_text(&f) {
        note(&e);
    }
    match crate::inspect::inspect_json(&f) {
        Ok(j) => drop(std::hint::black_box(serde_json::to_string(&j))),
        Err(e) => note(&e),
    }
    // `lint` reports every diagnostic of the loader's key reads and goes on past what the loader
    // refuses (the keys against the tensors): every file must lint without a panic.
    let mut findings = crate::lint::Findings::default();
    match crate::lint::model::lint(&f, &mut findings) {
        Ok(_) => drop(std::hint::black_box(findings)),
        Err(e) => note(&e),
    }
    let cfg = match MlaConfig::from_gguf(&f) {
        Ok(c) => c,
        Err(e) => {
            note(&e);
            return Outcome {
                stage: Stage::Opened,
                bad,
                allowance: allowed,
            };
        }
    };
    if let Err(e) = RopeFactors::load(&f, &cfg) {
        note(&e);
    }
    if let Err(e) = crate::input::from_token_ids(&f, &cfg, &[0, 1]) {
        note(&e);
    }
    // Every attention tensor of layer 0 as stored, shape-checked or not.
    for n in crate::model::weights::tensor_names(0) {
        if let Some(t) = f.tensor(&n) {
            if let Err(e) = dequantize_f32(&f, t) {
                note(&e);
            }
        }
    }
    let stage = match crate::inspect::layer_norms(&f, 0) {
        Ok(n) => {
            std::hint::black_box(crate::inspect::layer_norms_text(&n));
            Stage::Layer0
        }
        Err(e) => {
            note(&e);
            Stage::Config
        }
    };
    Outcome {
        stage,
        bad,
        allowance: allowed,
    }
}
