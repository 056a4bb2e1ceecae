//! `mla-diff export`: one layer of a model as a self-contained capsule directory, for a bug report.

use super::run::{InputArgs, ScheduleArgs};
use mla_diff::capsule::{self, ExportOptions};
use mla_diff::error::Error;
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::precision::Dtype;
use mla_diff::run::plan::check_dense_beyond_top_k;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The MLA GGUF file.
    file: PathBuf,
    /// The layer to export: `L`, or the layer list of the run it reproduces (`0..=L`, as `run
    /// --layers` takes it), whose last layer is exported with the input that run fed it in shadow mode
    /// (the reference's residual stream through the earlier layers).
    #[arg(long, value_name = "L")]
    layers: String,
    /// Keep only query heads A..B (half-open): a smaller but consistent layer whose attn_out sums those
    /// heads only. attn_output's columns are cut byte-exact, so A·v_head_dim and B·v_head_dim must fall
    /// on its quant blocks.
    #[arg(long, value_name = "A..B")]
    heads: Option<String>,
    /// Storage precision of the optimized path the capsule is replayed with.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Export a DSA model (GLM-5, DeepSeek-V3.2) on a schedule beyond the indexer's top_k (see `run`).
    #[arg(long)]
    allow_dense_beyond_topk: bool,
    /// The capsule directory: new, empty, or an earlier capsule (replaced).
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    output: PathBuf,
    // The groups last: clap keeps a group's help heading for the arguments after it.
    #[command(flatten)]
    input: InputArgs,
    #[command(flatten)]
    schedule: ScheduleArgs,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let file = GgufFile::open(&a.file)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let sched = a.schedule.overrides().schedule()?;
    let layers = mla_diff::run::parse_layers(&a.layers, cfg.n_layer)?;
    let heads = match &a.heads {
        Some(h) => Some(capsule::heads::parse(h, cfg.n_head)?),
        None => None,
    };
    check_dense_beyond_top_k(&file, &cfg, &sched, a.allow_dense_beyond_topk)?;
    let s = capsule::export(
        &file,
        &ExportOptions {
            layers,
            heads,
            input: a.input.spec(),
            sched,
            dtype: a.dtype,
            dir: a.output.clone(),
        },
    )?;
    println!(
        "wrote capsule {} (layer {}, {} tensors): {:.2} MB",
        a.output.display(),
        s.layer,
        s.tensors,
        s.total_bytes() as f64 / 1e6
    );
    for (f, n) in &s.files {
        println!("  {n:>12}  {f}");
    }
    println!("replay: mla-diff replay {}", a.output.display());
    Ok(0)
}
