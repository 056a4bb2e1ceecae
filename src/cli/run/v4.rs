//! `mla-diff run` on a DeepSeek-V4 file: the options the V4 run takes turned into `run::v4::V4Options`
//! (the rest refused, one line each), the run (`mla_diff::run::v4`), the same outputs as an MLA run.

use super::{Args, ModeArg, Outputs};
use mla_diff::backend::open::Choice;
use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_PASS};
use mla_diff::faults::FaultSet;
use mla_diff::gguf::GgufFile;
use mla_diff::model::v4::V4Config;
use mla_diff::run::v4::{default_schedule, V4Options};

/// The options a V4 run does not take, each with why.
fn refused(a: &Args) -> Option<&'static str> {
    let b = &a.backend;
    let s = &a.schedule;
    let r = &a.report;
    [
        (b.backend == Choice::Cuda, "--backend cuda: the CUDA path for DeepSeek-V4 is not built (#37); run on the CPU mirror (--backend cpu)"),
        (b.runner.is_some(), "--runner: no runner op takes DeepSeek-V4 attention yet (#37)"),
        (b.kernels.is_some(), "--kernels: the CUDA path for DeepSeek-V4 is not built (#37)"),
        (!b.kv_cache_dtype.is_auto(), "--kv-cache-dtype: the V4 mirror stores its caches in the run's dtype only"),
        (a.tp.is_some() || a.shard.is_some() || a.gpus.is_some(), "--tp, --shard and --gpus do not run DeepSeek-V4 yet"),
        (!a.capture.is_empty() || a.write_capture.is_some(), "--capture and --write-capture do not carry DeepSeek-V4 stages yet"),
        (a.repeat > 1, "--repeat: not for DeepSeek-V4 yet (the V4 mirror is deterministic by construction: no threads)"),
        (a.mode == Some(ModeArg::Free), "--mode free: DeepSeek-V4 runs in shadow mode only"),
        (a.input.tokens.is_some() || a.input.hidden.is_some(), "--tokens and --hidden: a DeepSeek-V4 run takes seeded inputs only (--seed)"),
        (s.page_size.is_some() || s.num_splits.is_some() || s.no_shuffle, "--page-size, --num-splits, --no-shuffle: the V4 mirror has no paged cache or split-KV"),
        (!a.tol.tol.is_empty() || a.tol.tol_file.is_some(), "--tol and --tol-file: DeepSeek-V4 is judged by its own table (src/compare/v4_tolerances.json) only, so far"),
        (r.baseline.is_some() || r.write_baseline.is_some(), "--baseline and --write-baseline: not for DeepSeek-V4 yet"),
        (r.dump_dir.is_some() || r.plot.is_some(), "--dump-dir and --plot: not for DeepSeek-V4 yet"),
        (a.allow_dense_beyond_topk, "--allow-dense-beyond-topk: a DSA option; DeepSeek-V4 runs its own indexer"),
    ]
    .into_iter()
    .find(|(on, _)| *on)
    .map(|(_, why)| why)
}

/// `run` on the V4 file `file`, already open.
pub fn exec(a: &Args, file: &GgufFile, faults: FaultSet) -> Result<i32, Error> {
    if let Some(why) = refused(a) {
        return Err(Error::Usage(format!(
            "{}: DeepSeek-V4: {why}",
            file.path.display()
        )));
    }
    let c = V4Config::from_gguf(file)?;
    let sched = a.schedule.over(default_schedule(&c))?;
    let o = V4Options {
        layers: mla_diff::run::parse_layers(&a.layers, c.n_layer)?,
        seed: a.input.seed,
        sched,
        dtype: a.dtype,
        faults,
    };
    let outputs = Outputs::check(&a.report)?;
    let rep = mla_diff::run::v4::run(file, &o)?;
    outputs.write(&rep, &a.report)?;
    Ok(match rep.pass() {
        true => EXIT_PASS,
        false => EXIT_DIVERGENCE,
    })
}
