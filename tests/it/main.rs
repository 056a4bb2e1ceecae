//! The integration tests, as one binary: one link of candle, cudarc and plotters instead of one per
//! file. Run one area with `cargo test --release --test it golden::` (module path as the filter).
//!
//! tests/fuzz.rs stays a binary of its own: it installs the fuzz driver's counting global allocator,
//! which would otherwise sit under every test here.

mod bad_input;
mod bench_smoke;
mod capsule;
mod capture;
mod ci_recipe;
mod common;
mod coverage;
mod cuda_env;
mod deploy;
mod detection;
mod dsa;
mod dsa_golden;
mod dsa_run;
mod dsa_v32;
mod fixture_roundtrip;
mod fixtures;
mod flash;
mod flashinfer;
mod floors;
mod gguf_crosscheck;
mod glm5_next;
mod golden;
mod input;
mod kimi;
mod kpool;
mod kpool_golden;
mod kpool_kernels_host;
mod kpool_run;
mod kv_format;
mod kv_format_kernel;
mod lint;
mod mirror;
mod no_false_alarms;
mod poison;
mod reference_ab;
mod rope;
mod run_options;
mod run_report;
mod runner_cache;
mod runner_cache_sparse;
mod runner_q_fp8;
mod runner_qk_acc;
mod runner_reads;
mod runners;
mod runners_reach;
mod runners_sparse;
mod schedule_invariance;
mod selfcheck_cache;
mod selftest;
mod shard;
mod sizes;
mod split;
mod sweep;
mod tp;
mod v4_kernels_host;
mod v4_reader;
mod v4_run;
