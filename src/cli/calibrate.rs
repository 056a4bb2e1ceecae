//! `mla-diff calibrate`: the CPU mirror's noise on GGUF files, as a tolerance table.

use mla_diff::error::Error;
use mla_diff::precision::Dtype;
use mla_diff::report;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    files: Vec<PathBuf>,
    /// Factor applied to the worst observed noise.
    #[arg(long, default_value_t = 4.0)]
    margin: f64,
    /// Input seeds; every schedule runs with each (the worst case over all is kept).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3,4")]
    seeds: Vec<u64>,
    /// Output file (default: stdout).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    if a.files.is_empty() {
        return Err(Error::Usage(
            "calibrate needs at least one GGUF file".into(),
        ));
    }
    let (table, summary) = mla_diff::calibrate::calibrate(
        &a.files,
        a.margin,
        &[Dtype::Bf16, Dtype::F16, Dtype::F32],
        &a.seeds,
    )?;
    eprint!("{summary}");
    let json = serde_json::to_string_pretty(&table).expect("json") + "\n";
    match a.output {
        Some(p) => report::write_file(&p, &json)?,
        None => print!("{json}"),
    }
    Ok(0)
}
