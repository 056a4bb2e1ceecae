//! `mla-diff inspect`: the file's header, or one layer's weight norms.

use mla_diff::error::Error;
use mla_diff::gguf::GgufFile;
use mla_diff::inspect;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Load layer L's attention weights (dequantized, shape-checked) and print per-tensor L2 norms.
    #[arg(long, value_name = "L")]
    load_layer: Option<usize>,
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let f = GgufFile::open(&a.file)?;
    if let Some(layer) = a.load_layer {
        let norms = inspect::layer_norms(&f, layer)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&norms).expect("json"));
        } else {
            print!("{}", inspect::layer_norms_text(&norms));
        }
    } else if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&inspect::inspect_json(&f)?).expect("json")
        );
    } else {
        print!("{}", inspect::text(&f)?);
    }
    Ok(0)
}
