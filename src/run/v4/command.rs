//! `run` on a DeepSeek-V4 file as a library operation: the [`Request`] options a V4 run takes turned
//! into [`V4Options`] (the rest refused, one line each), the run, the same outputs as an MLA run.

use super::engine::V4Backend;
use super::{default_schedule, V4Options};
use crate::backend::open::{Choice, Kind};
use crate::error::{Error, Result, EXIT_DIVERGENCE, EXIT_PASS};
use crate::gguf::GgufFile;
use crate::model::v4::V4Config;
use crate::report::outputs::Outputs;
use crate::run::request::Request;
use crate::run::{InputSpec, Mode};

/// The first option a V4 run does not take, with why.
fn refused(r: &Request) -> Option<&'static str> {
    let (b, s, o) = (&r.backend, &r.schedule, &r.report);
    [
        (b.runner.is_some(), "--runner: no runner op takes DeepSeek-V4 attention yet (#37)"),
        (b.kernels_dir.is_some() && b.choice == Choice::Cpu, "--kernels: DeepSeek-V4's kernels are CUDA's; --backend cpu runs the V4 mirror"),
        (!b.kv_format.is_auto(), "--kv-cache-dtype: the V4 mirror stores its caches in the run's dtype only"),
        (r.tp.is_some() || r.shard.is_some() || r.gpus.is_some(), "--tp, --shard and --gpus do not run DeepSeek-V4 yet"),
        (!r.capture.is_empty() || r.write_capture.is_some(), "--capture and --write-capture do not carry DeepSeek-V4 stages yet"),
        (r.repeat > 1, "--repeat: not for DeepSeek-V4 yet (the V4 mirror is deterministic by construction: no threads)"),
        (r.mode == Some(Mode::Free), "--mode free: DeepSeek-V4 runs in shadow mode only"),
        (s.page_size.is_some() || s.num_splits.is_some() || s.no_shuffle, "--page-size, --num-splits, --no-shuffle: the V4 mirror has no paged cache or split-KV"),
        (!r.tol.entries.is_empty() || r.tol.file.is_some(), "--tol and --tol-file: DeepSeek-V4 is judged by its own table (src/compare/v4_tolerances.json) only, so far"),
        (o.baseline.is_some() || o.write_baseline.is_some(), "--baseline and --write-baseline: not for DeepSeek-V4 yet"),
        (o.dump_dir.is_some() || o.plot.is_some(), "--dump-dir and --plot: not for DeepSeek-V4 yet"),
        (r.allow_dense_beyond_topk, "--allow-dense-beyond-topk: a DSA option; DeepSeek-V4 runs its own indexer"),
    ]
    .into_iter()
    .find(|(on, _)| *on)
    .map(|(_, why)| why)
}

/// `run` on the V4 file `file`, already open; the exit code.
pub fn exec(r: &Request, file: &GgufFile) -> Result<i32> {
    let usage = |why: &str| Error::Usage(format!("{}: DeepSeek-V4: {why}", file.path.display()));
    if let Some(why) = refused(r) {
        return Err(usage(why));
    }
    let InputSpec::Random { seed } = r.input else {
        return Err(usage(
            "--tokens and --hidden: a DeepSeek-V4 run takes seeded inputs only (--seed)",
        ));
    };
    let c = V4Config::from_gguf(file)?;
    let o = V4Options {
        layers: crate::run::parse_layers(&r.layers, c.n_layer)?,
        seed,
        sched: r.schedule.over(default_schedule(&c))?,
        dtype: r.dtype,
        faults: r.faults.clone(),
        // `auto` as for an MLA file: the CUDA kernels with a GPU present or a kernel directory given.
        backend: match r.backend.choice.resolve(r.backend.kernels_dir.as_deref()) {
            Kind::Cuda => V4Backend::Cuda {
                kernels_dir: r.backend.kernels_dir.clone(),
            },
            _ => V4Backend::Cpu,
        },
    };
    let outputs = Outputs::check(&r.report)?;
    let rep = super::run(file, &o)?;
    outputs.write(&rep, &r.report)?;
    Ok(match rep.pass() {
        true => EXIT_PASS,
        false => EXIT_DIVERGENCE,
    })
}
