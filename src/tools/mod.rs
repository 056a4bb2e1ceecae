//! Developer tools around the CUDA backend, kept out of it (the backend holds only what a run needs):
//! `bench` (kernel timing, `mla-diff bench decode|prefill|table`) with `table` (the summary table) and
//! `peers` (other projects' kernels through their runners), `check` (`mla-diff kernels check`: every
//! kernel compiled with NVRTC, ptxas registers and spills, shared memory against the host's tile model)
//! and `validate` (`mla-diff gpu-validate`: the CUDA path against the CPU mirror and fp64, and the fp64
//! products a CUDA run installs against the host's).

pub mod bench;
pub mod check;
pub mod peers;
pub mod table;
pub mod validate;
