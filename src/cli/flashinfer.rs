//! `mla-diff flashinfer DIR`: the MLA calls of a FlashInfer API-logging dump, each checked against fp64
//! attention from its own inputs (`mla_diff::capture::flashinfer`). A command of its own rather than a
//! mode of `replay`: a capsule is a layer of a model (weights, input, reference) run through a backend,
//! while a logged call is a kernel call with no weights, so none of replay's backend, tolerance, dump or
//! baseline flags would mean anything here.

use mla_diff::capture::flashinfer::{self, ModelExpect};
use mla_diff::error::Error;
use mla_diff::gguf::GgufFile;
use mla_diff::model::MlaConfig;
use mla_diff::report::output::{file_targets, Target};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The dump folder (FLASHINFER_DUMP_DIR): one `<time>_pid<pid>_<function>_call<NNNN>/` folder per call.
    dir: PathBuf,
    /// The model's GGUF: also check each call's softmax scale (YaRN mscale² included) and head dims
    /// against the model's.
    #[arg(long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// Write the JSON report here (`flashinfer_report_version` 1). `-` is stdout for every format (one
    /// of them at most; the lines then go to stderr).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write JUnit XML here (one test case per call; `-` for stdout).
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Write a Markdown summary here (`-` for stdout).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Print only the verdict line (and errors).
    #[arg(short, long)]
    quiet: bool,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let targets = file_targets(&[
        ("--json", a.json.as_deref()),
        ("--junit", a.junit.as_deref()),
        ("--markdown", a.markdown.as_deref()),
    ])?;
    let model = match &a.model {
        None => None,
        Some(p) => {
            let f = GgufFile::open(p)?;
            let cfg = MlaConfig::from_gguf(&f)?;
            Some(ModelExpect {
                name: p
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_else(|| p.display().to_string()),
                n_head: cfg.n_head,
                kv_lora_rank: cfg.kv_lora_rank,
                qk_rope: cfg.qk_rope,
                softmax_scale: cfg.softmax_scale,
                mscale: cfg.mscale,
            })
        }
    };
    let report = flashinfer::check(&a.dir, model.as_ref(), false)?;
    let stdout_taken = targets.iter().any(|t| t.as_ref() == Some(&Target::Stdout));
    let renders = [report.json(), report.junit(), report.markdown()];
    for (t, text) in targets.iter().zip(renders) {
        if let Some(t) = t {
            t.write(&text)?;
        }
    }
    let text = match a.quiet {
        true => format!("{}\n", report.message),
        false => report.text(),
    };
    match stdout_taken {
        true => eprint!("{text}"),
        false => print!("{text}"),
    }
    Ok(report.exit_code())
}
