//! `mla-diff fixture`: write a synthetic MLA GGUF.

use mla_diff::error::Error;
use mla_diff::fixture::{self, Preset};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_enum)]
    preset: Preset,
    /// Number of layers (default: the model's).
    #[arg(long)]
    layers: Option<usize>,
    /// Weight type: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k..q6_k. 1-D tensors stay F32;
    /// rows that do not fit the block size fall back as llama.cpp's quantizer does.
    #[arg(long, default_value = "bf16")]
    quant: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Pre-llama.cpp-#12801 layout: one unsplit attn_kv_b, head_count_kv = heads, no *_mla keys.
    #[arg(long)]
    legacy_kv_b: bool,
    /// Override the hidden size (keeps the real head dims; for small files).
    #[arg(long)]
    hidden: Option<usize>,
    /// Override the number of attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Override the q-LoRA rank (0: no q-LoRA, plain attn_q).
    #[arg(long)]
    q_lora_rank: Option<usize>,
    /// Rows of token_embd.weight.
    #[arg(long)]
    vocab: Option<usize>,
    /// Output file.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: PathBuf,
}

impl Args {
    fn options(&self) -> Result<fixture::Options, Error> {
        let quant = mla_diff::gguf::GgmlType::from_name(&self.quant).ok_or_else(|| {
            Error::Usage(format!(
                "--quant {}: unknown type (choose one of: {})",
                self.quant,
                fixture::quant_names().join(", ")
            ))
        })?;
        Ok(fixture::Options {
            preset: self.preset,
            layers: self.layers,
            quant,
            seed: self.seed,
            legacy_kv_b: self.legacy_kv_b,
            hidden: self.hidden,
            heads: self.heads,
            q_lora_rank: self.q_lora_rank,
            vocab: self.vocab,
        })
    }
}

pub fn exec(a: Args) -> Result<i32, Error> {
    let spec = fixture::Spec::from_options(&a.options()?)?;
    let s = fixture::write(&spec, &a.output)?;
    let types: Vec<String> = s.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "wrote {}: {} tensors ({}), {:.1} MB",
        a.output.display(),
        s.tensors,
        types.join(", "),
        s.bytes as f64 / 1e6
    );
    Ok(0)
}
