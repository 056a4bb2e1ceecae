//! LongRoPE per-frequency divisors (`rope_factors_short` / `rope_factors_long`, or `rope_freqs`), read
//! from the file once, so that the rope math in `crate::rope` stays a pure function of its inputs.

use super::config::MlaConfig;
use super::weights::load_freq_factors;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// The frequency factors of a model, and the context length that selects between them.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFactors {
    /// Used while every position is below `original_context` (also `rope_freqs.weight`).
    pub short: Option<Vec<f32>>,
    /// Used once a position reaches `original_context`.
    pub long: Option<Vec<f32>>,
    pub original_context: usize,
}

impl RopeFactors {
    /// The factors for a run whose positions are all below `end_pos`: `short` while
    /// `end_pos <= original_context`, else `long` (llama.cpp picks by context size the same way; with no
    /// tensor for the chosen side, no factors apply, as in llama.cpp).
    pub fn choose(&self, end_pos: usize) -> Option<&[f32]> {
        if end_pos > self.original_context {
            self.long.as_deref()
        } else {
            self.short.as_deref()
        }
    }

    /// Read the factors named by the config, if any. Each must have `qk_rope / 2` finite, positive entries.
    pub fn load(f: &GgufFile, cfg: &MlaConfig) -> Result<Option<RopeFactors>> {
        let n = cfg.qk_rope / 2;
        let read = |name: &Option<String>| -> Result<Option<Vec<f32>>> {
            let Some(name) = name else { return Ok(None) };
            let v = load_freq_factors(f, name, n)?;
            if let Some(bad) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(Error::Tensor(format!(
                    "{}: rope factor tensor {name} holds {bad}; factors divide the rope angle and must be finite and positive",
                    f.path.display()
                )));
            }
            Ok(Some(v))
        };
        let short = read(&cfg.rope.freq_factors_short)?;
        let long = read(&cfg.rope.freq_factors_long)?;
        if short.is_none() && long.is_none() {
            return Ok(None);
        }
        let arch = cfg.arch.gguf_name();
        let original_context = match &cfg.rope.yarn {
            Some(y) => Some(y.original_context as usize),
            None => {
                let k = super::keys::MlaKeys::read(f, arch);
                k.original_context
                    .value
                    .or(k.context_length.value)
                    .map(|v| v as usize)
            }
        };
        let original_context = match (original_context, &long) {
            (Some(c), _) => c,
            // Only short factors: the choice never matters.
            (None, None) => usize::MAX,
            (None, Some(_)) => {
                return Err(Error::Unsupported(format!(
                    "{}: the file has long rope factors but neither {arch}.rope.scaling.original_context_length nor {arch}.context_length, so it cannot tell when they apply",
                    f.path.display()
                )))
            }
        };
        Ok(Some(RopeFactors {
            short,
            long,
            original_context,
        }))
    }
}
