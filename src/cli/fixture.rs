//! `mla-diff fixture`: write a synthetic MLA GGUF.

use mla_diff::error::Error;
use mla_diff::fixture::{self, Preset};
use std::path::PathBuf;

/// `--preset`: a catalogue MLA model, or DeepSeek-V4 (a kind of its own: `fixture::v4`).
#[derive(Clone, Copy, Debug)]
enum PresetArg {
    Mla(Preset),
    DeepseekV4,
}

const PRESET_ARGS: [PresetArg; 11] = [
    PresetArg::Mla(Preset::ALL[0]),
    PresetArg::Mla(Preset::ALL[1]),
    PresetArg::Mla(Preset::ALL[2]),
    PresetArg::Mla(Preset::ALL[3]),
    PresetArg::Mla(Preset::ALL[4]),
    PresetArg::Mla(Preset::ALL[5]),
    PresetArg::Mla(Preset::ALL[6]),
    PresetArg::Mla(Preset::ALL[7]),
    PresetArg::Mla(Preset::ALL[8]),
    PresetArg::Mla(Preset::ALL[9]),
    PresetArg::DeepseekV4,
];

impl clap::ValueEnum for PresetArg {
    fn value_variants<'a>() -> &'a [Self] {
        &PRESET_ARGS
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self {
            PresetArg::Mla(p) => p.to_possible_value(),
            PresetArg::DeepseekV4 => {
                Some(clap::builder::PossibleValue::new("deepseek-v4").help(
                    "DeepSeek-V4-Flash attention (not MLA): window, CSA and HCA layers in turn",
                ))
            }
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_enum)]
    preset: PresetArg,
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
        let PresetArg::Mla(preset) = self.preset else {
            unreachable!("deepseek-v4 is written by exec_v4")
        };
        Ok(fixture::Options {
            preset,
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

/// `--preset deepseek-v4`: DeepSeek-V4-Flash's attention dims; the MLA-only options are refused.
fn exec_v4(a: &Args) -> Result<i32, Error> {
    if a.legacy_kv_b || a.q_lora_rank.is_some() || a.vocab.is_some() {
        return Err(Error::Usage(
            "--legacy-kv-b, --q-lora-rank and --vocab are MLA options; --preset deepseek-v4 takes --layers, --hidden, --heads, --quant (f32, f16, bf16) and --seed".into(),
        ));
    }
    let quant = mla_diff::gguf::GgmlType::from_name(&a.quant)
        .ok_or_else(|| Error::Usage(format!("--quant {}: unknown type", a.quant)))?;
    let o = fixture::v4::V4Options {
        layers: a.layers,
        hidden: a.hidden,
        heads: a.heads,
        quant,
        seed: a.seed,
    };
    let (n, bytes) = fixture::v4::write(&o, &a.output)?;
    println!(
        "wrote {}: {n} tensors, {:.1} MB",
        a.output.display(),
        bytes as f64 / 1e6
    );
    Ok(0)
}

pub fn exec(a: Args) -> Result<i32, Error> {
    if matches!(a.preset, PresetArg::DeepseekV4) {
        return exec_v4(&a);
    }
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
