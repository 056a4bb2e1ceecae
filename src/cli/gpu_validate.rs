//! `mla-diff gpu-validate`: the CUDA path against the CPU mirror and the fp64 reference.

use mla_diff::error::Error;
use mla_diff::precision::Dtype;
use mla_diff::tools::validate;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Storage types to run.
    #[arg(long, value_delimiter = ',', default_value = "bf16,f16")]
    dtype: Vec<Dtype>,
    /// Only the small cases (a quick smoke test).
    #[arg(long)]
    quick: bool,
    /// Read the kernel sources from this directory instead of the embedded copy.
    #[arg(long)]
    kernels: Option<PathBuf>,
    /// Write the per-case, per-stage figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only the cases whose name contains this text.
    #[arg(long)]
    case: Option<String>,
    /// CPU threads for the reference and the mirror (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

impl Args {
    fn options(&self) -> validate::Options {
        validate::Options {
            dtype: self.dtype.clone(),
            quick: self.quick,
            kernels: self.kernels.clone(),
            json: self.json.clone(),
            case: self.case.clone(),
            threads: self.threads,
        }
    }
}

pub fn exec(a: Args) -> Result<i32, Error> {
    validate::run(&a.options())
}
