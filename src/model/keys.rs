//! The one reader of an MLA file's metadata keys. `MlaKeys::read` reads every key of the header that
//! anything in mla-diff looks at, once, with its type: each is a `Read` (present or not, its typed
//! value, its short display, and a `Diagnostic` when it holds another type). The loaders work from it
//! (`MlaConfig::from_gguf_diagnosed`, `HybridLayout`, `KpoolConfig`, `IndexerConfig`): each key they
//! need and each rule they hold records a `Diagnostic` instead of returning on the first, and `lint`
//! reports those diagnostics as findings naming the key. Nothing else calls `as_u64`/`as_f64` on an
//! MLA key: a new key is a field here (its name and type in `MlaKeys::read`).

use crate::error::Error;
use crate::gguf::{GgufFile, Value};

/// One thing wrong with a key: the key, what it holds, what was expected, why it matters, and the
/// loader's one-line message for it (without the file's path: `run`'s error when it is the first).
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnostic {
    pub key: String,
    pub found: String,
    pub expected: String,
    pub why: String,
    pub message: String,
    /// Which rule made it: `type` (a key of the wrong type), `missing` (a required key absent), or the
    /// loader rule's name (`no_trunk`, `mla_pair`, `zero`, `limit`, …).
    pub rule: &'static str,
    /// Which error kind the loader refuses with (a key of the file's format, or an unsupported file).
    pub format: bool,
}

impl Diagnostic {
    /// The loader's error for this diagnostic.
    pub fn error(&self, f: &GgufFile) -> Error {
        if self.format {
            Error::format(f.path.display(), self.message.clone())
        } else {
            Error::Unsupported(format!("{}: {}", f.path.display(), self.message))
        }
    }
}

/// Every diagnostic of one load, in the order the loader met them; the first is its error.
#[derive(Debug, Clone, Default)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn push(&mut self, d: Diagnostic) {
        self.0.push(d);
    }
    /// A rule's diagnostic whose message names the key's finding in the loader's words.
    pub fn rule(
        &mut self,
        rule: &'static str,
        key: &str,
        found: impl Into<String>,
        expected: impl Into<String>,
        why: impl Into<String>,
        message: String,
    ) {
        self.push(Diagnostic {
            key: key.to_string(),
            found: found.into(),
            expected: expected.into(),
            why: why.into(),
            message,
            rule,
            format: false,
        });
    }
    /// The value of a required key; a missing key or one of the wrong type is recorded.
    pub fn need<T: Clone>(&mut self, r: &Read<T>) -> Option<T> {
        if !r.present {
            self.push(r.missing());
            return None;
        }
        self.opt(r)
    }
    /// The value of an optional key; one of the wrong type is recorded.
    pub fn opt<T: Clone>(&mut self, r: &Read<T>) -> Option<T> {
        if let Some(d) = &r.bad_type {
            self.push(d.clone());
        }
        r.value.clone()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The loader's error: the first diagnostic's.
    pub fn error(&self, f: &GgufFile) -> Option<Error> {
        self.0.first().map(|d| d.error(f))
    }
}

/// One key as read: whether it is there, its value as the reader's type (`None` when absent or of
/// another type), its short display, and the diagnostic of a wrong type.
#[derive(Debug, Clone)]
pub struct Read<T> {
    pub key: String,
    pub present: bool,
    pub value: Option<T>,
    /// `Value::display_short` of what the file holds.
    pub shown: Option<String>,
    pub bad_type: Option<Diagnostic>,
}

impl<T> Read<T> {
    /// The diagnostic of a required key that is absent.
    pub fn missing(&self) -> Diagnostic {
        Diagnostic {
            key: self.key.clone(),
            found: "absent".into(),
            expected: "present".into(),
            why: "the loader (and llama.cpp) refuse an MLA file without it".into(),
            message: format!("required metadata key {} is missing", self.key),
            rule: "missing",
            format: false,
        }
    }
}

const TYPE_WHY: &str =
    "llama.cpp and mla-diff read this key as that type and refuse the file otherwise";

fn read<T>(f: &GgufFile, key: String, what: &str, conv: impl Fn(&Value) -> Option<T>) -> Read<T> {
    let v = f.get(&key);
    let value = v.and_then(&conv);
    let bad_type = match v {
        Some(v) if value.is_none() => Some(Diagnostic {
            key: key.clone(),
            found: v.display_short(),
            expected: what.to_string(),
            why: TYPE_WHY.into(),
            message: format!(
                "metadata key {key} should be {what}, found {}",
                v.display_short()
            ),
            rule: "type",
            format: false,
        }),
        _ => None,
    };
    Read {
        present: v.is_some(),
        shown: v.map(|v| v.display_short()),
        value,
        bad_type,
        key,
    }
}

/// `attention.indexer.types`: an array of bools (true = full), as llama.cpp's converter writes it.
fn bools(f: &GgufFile, key: String) -> Read<Vec<bool>> {
    let v = f.get(&key);
    let value = match v {
        Some(Value::Array(a)) => a.iter().map(|v| v.as_bool()).collect::<Option<Vec<bool>>>(),
        _ => None,
    };
    let bad_type = match v {
        Some(v) if value.is_none() => Some(Diagnostic {
            key: key.clone(),
            found: v.display_short(),
            expected: "an array of bools (true = full)".into(),
            why: "llama.cpp's converter writes [t == \"full\" for t in indexer_types]".into(),
            message: match v {
                Value::Array(_) => format!("{key} should be an array of bools"),
                _ => format!("{key} is {}, expected an array of bools", v.display_short()),
            },
            rule: "type",
            format: true,
        }),
        _ => None,
    };
    Read {
        present: v.is_some(),
        shown: v.map(|v| v.display_short()),
        value,
        bad_type,
        key,
    }
}

/// Every metadata key of an MLA header that mla-diff reads, each read once with its type. Field names
/// follow the key after `{arch}.`.
#[derive(Debug, Clone)]
pub struct MlaKeys {
    /// The architecture name the keys are prefixed with.
    pub arch: String,
    pub block_count: Read<u64>,
    pub nextn_predict_layers: Read<u64>,
    pub embedding_length: Read<u64>,
    pub context_length: Read<u64>,
    pub head_count: Read<u64>,
    /// As one number; glm5-next's per-layer array is `HybridLayout`'s (`head_count_kv_raw`).
    pub head_count_kv: Read<u64>,
    pub head_count_kv_raw: Option<Value>,
    pub kv_lora_rank: Read<u64>,
    pub q_lora_rank: Read<u64>,
    pub key_length_mla: Read<u64>,
    pub value_length_mla: Read<u64>,
    pub key_length: Read<u64>,
    pub value_length: Read<u64>,
    pub rms_eps: Read<f64>,
    pub rope_dim: Read<u64>,
    pub rope_freq_base: Read<f64>,
    /// M-RoPE sections (no MLA model has them): only whether present and what they hold.
    pub rope_sections: Read<()>,
    pub scaling_type: Read<String>,
    pub scaling_factor: Read<f64>,
    /// The old key llama.cpp reads where `rope.scaling.factor` is absent.
    pub scale_linear: Read<f64>,
    pub original_context: Read<u64>,
    pub yarn_log_multiplier: Read<f64>,
    pub yarn_beta_fast: Read<f64>,
    pub yarn_beta_slow: Read<f64>,
    pub yarn_ext_factor: Read<f64>,
    pub scaling_attn_factor: Read<f64>,
    pub indexer_head_count: Read<u64>,
    pub indexer_key_length: Read<u64>,
    pub indexer_top_k: Read<u64>,
    pub indexer_kpool: Read<u64>,
    pub indexer_kpool_select_tail: Read<bool>,
    pub indexer_types: Read<Vec<bool>>,
}

impl MlaKeys {
    /// Read every key of architecture `arch` from `f`.
    pub fn read(f: &GgufFile, arch: &str) -> MlaKeys {
        let full = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| read(f, full(k), "an unsigned integer", |v| v.as_u64());
        let x = |k: &str| read(f, full(k), "a number", |v| v.as_f64());
        MlaKeys {
            arch: arch.to_string(),
            block_count: u("block_count"),
            nextn_predict_layers: u("nextn_predict_layers"),
            embedding_length: u("embedding_length"),
            context_length: u("context_length"),
            head_count: u("attention.head_count"),
            head_count_kv: u("attention.head_count_kv"),
            head_count_kv_raw: f.get(&full("attention.head_count_kv")).cloned(),
            kv_lora_rank: u("attention.kv_lora_rank"),
            q_lora_rank: u("attention.q_lora_rank"),
            key_length_mla: u("attention.key_length_mla"),
            value_length_mla: u("attention.value_length_mla"),
            key_length: u("attention.key_length"),
            value_length: u("attention.value_length"),
            rms_eps: x("attention.layer_norm_rms_epsilon"),
            rope_dim: u("rope.dimension_count"),
            rope_freq_base: x("rope.freq_base"),
            rope_sections: read(f, full("rope.dimension_sections"), "anything", |_| Some(())),
            scaling_type: read(f, full("rope.scaling.type"), "a string", |v| {
                v.as_str().map(str::to_string)
            }),
            scaling_factor: x("rope.scaling.factor"),
            scale_linear: x("rope.scale_linear"),
            original_context: u("rope.scaling.original_context_length"),
            yarn_log_multiplier: x("rope.scaling.yarn_log_multiplier"),
            yarn_beta_fast: x("rope.scaling.yarn_beta_fast"),
            yarn_beta_slow: x("rope.scaling.yarn_beta_slow"),
            yarn_ext_factor: x("rope.scaling.yarn_ext_factor"),
            scaling_attn_factor: x("rope.scaling.attn_factor"),
            indexer_head_count: u("attention.indexer.head_count"),
            indexer_key_length: u("attention.indexer.key_length"),
            indexer_top_k: u("attention.indexer.top_k"),
            indexer_kpool: u("attention.indexer.kpool"),
            indexer_kpool_select_tail: read(
                f,
                full("attention.indexer.kpool_select_tail"),
                "a bool",
                |v| v.as_bool(),
            ),
            indexer_types: bools(f, full("attention.indexer.types")),
        }
    }
}
