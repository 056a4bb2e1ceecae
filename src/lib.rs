//! mla-diff: where does a fused Multi-head Latent Attention path stop computing the model?
//!
//! Data flow, one module per step:
//! `gguf` (container, dequantization) → `model` (config, per-layer weights) → `reference` (fp64) |
//! `backend` (CPU mirror of the fused path, CUDA kernels) → `trace` (named stage tensors) → `compare` →
//! `report`. `fixture` writes synthetic GGUF files in llama.cpp's conventions. The value types every step
//! names (`precision`, `tolerance`, `kernel_use`) are the ground floor: nothing imports upward
//! (docs/ARCHITECTURE.md, "Floors").

pub mod alloc;
pub mod backend;
pub mod batch;
pub mod bench;
pub mod calibrate;
pub mod capsule;
pub mod capture;
pub mod compare;
pub mod coverage;
pub mod error;
pub mod faults;
pub mod fixture;
pub mod fuzz;
pub mod gguf;
pub mod gpus;
pub mod input;
pub mod inspect;
pub mod judging;
pub mod kernel_use;
pub mod kv_format;
pub mod linalg;
pub mod lint;
pub mod merge;
pub mod model;
pub mod precision;
pub mod reference;
pub mod report;
pub mod rope;
pub mod run;
pub mod schedule;
pub mod selftest;
pub mod shard;
pub mod sweep;
pub mod tiles;
pub mod tolerance;
pub mod tools;
pub mod tp;
pub mod trace;

pub use error::{Error, Result};
