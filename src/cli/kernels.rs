//! `mla-diff kernels check`: compile every kernel with NVRTC and report registers and spills.

use clap::Subcommand;
use mla_diff::error::Error;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: KernelsCmd,
}

#[derive(Subcommand)]
enum KernelsCmd {
    /// Compile every kernel with NVRTC to PTX and CUBIN for several architectures, dims and dtypes;
    /// print ptxas registers and spills per kernel. Exit 2 on a compile error, or when the attention
    /// kernels' shared memory differs from src/tiles/choice.rs's (what `lint --backend cuda` reports).
    Check(CheckArgs),
}

#[derive(clap::Args)]
struct CheckArgs {
    /// Comma-separated target architectures.
    #[arg(
        long,
        default_value = "sm_90a,sm_90,sm_80,sm_120",
        value_delimiter = ','
    )]
    arch: Vec<String>,
    /// Read the kernel sources from this directory instead of the embedded copy.
    #[arg(long)]
    kernels: Option<PathBuf>,
    /// Also write every compiled PTX and CUBIN into this directory.
    #[arg(long)]
    dump: Option<PathBuf>,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let KernelsCmd::Check(a) = a.cmd;
    let s =
        mla_diff::tools::check::kernels_check(&a.arch, a.kernels.as_deref(), a.dump.as_deref())?;
    print!("{}", s.report);
    println!(
        "{} compilations OK (PTX + CUBIN); {} kernel(s) with register spills{}",
        s.compiles,
        s.spilling.len(),
        if s.spilling.is_empty() {
            String::new()
        } else {
            format!(": {}", s.spilling.join("; "))
        }
    );
    for w in &s.warnings {
        println!("ptxas: {w}");
    }
    // A serialized wgmma still computes the right answer, only slowly: fail so it is seen.
    if let Some(w) = s.warnings.iter().find(|w| w.contains("wgmma")) {
        return Err(Error::Environment(format!(
            "ptxas serialized the warpgroup MMAs: {w}"
        )));
    }
    Ok(0)
}
