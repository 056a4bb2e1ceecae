//! Capsules: one layer of a model, self-contained, for a bug report (`mla-diff export`, `mla-diff
//! replay`).
//!
//! A capsule is a directory:
//! - `layer.gguf`: the model's metadata (`block_count` 1) and only the tensors layer L's attention reads,
//!   renamed `blk.L.*` → `blk.0.*`, their bytes copied unchanged (no requantization, so the replayed
//!   layer computes exactly what the model's layer does), plus the global rope factor tensors if any;
//! - `input.npy`: the layer input `[T, hidden]` (float64) that the run fed layer L in shadow mode;
//! - `reference/STAGE.npy`: the fp64 reference stages of the layer on that input (float64), so that a
//!   kernel author can check against them without mla-diff;
//! - `capsule.json` (the manifest, [`manifest::Manifest`]) and a short `README.md`.
//!
//! `--heads A..B` keeps only those query heads (`heads`): a smaller model that is still consistent,
//! whose `attn_out` sums the kept heads only. Replay (`replay`) runs the ordinary run pipeline on the
//! capsule's `layer.gguf` after checking that its weights still give its reference.

pub mod export;
pub mod heads;
pub mod manifest;
pub mod replay;

pub use export::{export, ExportOptions, Summary};
pub use manifest::Manifest;
pub use replay::Capsule;

/// The version of the capsule layout this build writes and reads (`capsule_version` in the manifest).
pub const CAPSULE_VERSION: u32 = 1;
/// The manifest's file name in the capsule directory.
pub const MANIFEST: &str = "capsule.json";
/// The one-layer GGUF.
pub const WEIGHTS: &str = "layer.gguf";
/// The layer input, `[T, hidden]` float64.
pub const INPUT: &str = "input.npy";
/// The directory of the reference stage tensors (`STAGE.npy`).
pub const REFERENCE_DIR: &str = "reference";
pub const README: &str = "README.md";
/// Largest rel-L2 between a recomputed reference stage and the capsule's copy that still counts as the
/// same: an exported capsule replays bit for bit on the same build; the margin covers another build or
/// platform (libm's exp/sin, matrix-product summation order), and is far below what changing a single
/// stored weight does (`tests/it/capsule.rs` flips one byte).
pub const REFERENCE_REL_L2: f64 = 1e-12;
