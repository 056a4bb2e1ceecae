//! DeepSeek-V4 (`deepseek4`): the hyper-parameters and attention tensors of a V4 GGUF, as llama.cpp's
//! converter writes them (`conversion/deepseek.py::DeepseekV4Model`) and its loader reads them
//! (`src/models/deepseek4.cpp`, `load_arch_hparams` / `load_arch_tensors`).
//!
//! V4 is not latent MLA (docs/deepseek-v4.md): each layer projects straight to one shared K = V head
//! of `head_dim` that every query head attends to, over a sliding window plus, on compressed layers,
//! entries pooled from windows of `compress_ratio` tokens (4: CSA, with an indexer; 128: HCA). So it has
//! a config of its own, not an `MlaConfig`: `inspect` and `lint` read it, the reference runs it
//! (`reference::v4`), and the MLA commands refuse it with one line (`not_built`).

use crate::error::{Error, Result};

mod weights;
use crate::gguf::{GgufFile, Value};
use serde::Serialize;
pub use weights::{CompressorWeights, V4Rope, V4Weights};

/// The GGUF architecture name.
pub const ARCH: &str = "deepseek4";

/// The one line every command not built for V4 exits 2 with.
pub fn not_built(f: &GgufFile) -> Error {
    Error::Unsupported(format!(
        "{}: architecture \"deepseek4\" (DeepSeek-V4) is not latent MLA: `inspect` and `lint` read it, this command is not built for V4 yet (#37, docs/deepseek-v4.md)",
        f.path.display()
    ))
}

/// What a layer attends to besides its sliding window (`attention.compress_ratios`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Ratio 0: the sliding window only ("main" rope).
    Window,
    /// Ratio 4: compressed sparse attention, overlapping windows, the indexer's top-k ("compress" rope).
    Csa,
    /// Ratio 128: heavily compressed attention, every causal entry ("compress" rope).
    Hca,
}

impl LayerKind {
    pub fn ratio(self) -> usize {
        match self {
            LayerKind::Window => 0,
            LayerKind::Csa => 4,
            LayerKind::Hca => 128,
        }
    }
    /// The compressor's width in head_dims: CSA's two series (Ca | Cb), HCA's one.
    pub fn coff(self) -> usize {
        match self {
            LayerKind::Csa => 2,
            _ => 1,
        }
    }
}

/// The "compress" rope's YaRN (`rope.scaling.*`; llama.cpp applies it to compressed layers only, with
/// its magnitude cancelled: cos/sin × 1, as transformers' `attention_factor` 1.0).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct V4Yarn {
    pub factor: f64,
    pub original_context: u64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct V4Indexer {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HyperConnections {
    pub count: usize,
    pub sinkhorn_iterations: usize,
    pub epsilon: f64,
}

/// The MoE keys (outside attention; read so that `inspect` shows every key the loader takes).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct V4Experts {
    pub count: Option<usize>,
    pub used: Option<usize>,
    pub feed_forward_length: Option<usize>,
    pub shared: Option<usize>,
    pub weights_scale: Option<f64>,
    pub weights_norm: Option<bool>,
    /// llama.cpp `LLAMA_EXPERT_GATING_FUNC_TYPE_*`: its loader takes only 4 (sqrtsoftplus).
    pub gating_func: Option<usize>,
    pub hash_layer_count: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct V4Config {
    pub n_layer: usize,
    pub hidden: usize,
    pub n_head: usize,
    /// K = V = query head width (`key_length` = `value_length`).
    pub head_dim: usize,
    /// Rope on the trailing `rope_dim` of each head, interleaved pairs.
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub sliding_window: usize,
    pub kinds: Vec<LayerKind>,
    /// "main" rope base (`rope.freq_base`: transformers' `rope_theta`), window-only layers.
    pub rope_base: f64,
    /// "compress" rope base (`attention.compress_rope_freq_base`), CSA/HCA layers and compressors.
    pub compress_rope_base: f64,
    pub yarn: Option<V4Yarn>,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub indexer: V4Indexer,
    pub hc: HyperConnections,
    pub rms_eps: f64,
    pub context_length: Option<usize>,
    pub nextn_predict_layers: usize,
    pub experts: V4Experts,
    /// 1/sqrt(head_dim) on every layer kind (no mscale).
    pub softmax_scale: f64,
}

/// A key the reader refuses: its name, what it holds, what it should, why.
#[derive(Debug, Clone, PartialEq)]
pub struct BadKey {
    pub key: String,
    pub found: String,
    pub expected: String,
    pub why: String,
}

impl BadKey {
    fn new(key: &str, found: impl Into<String>, expected: impl Into<String>, why: &str) -> Self {
        BadKey {
            key: key.to_string(),
            found: found.into(),
            expected: expected.into(),
            why: why.to_string(),
        }
    }
    pub fn into_error(self, f: &GgufFile) -> Error {
        Error::Unsupported(format!(
            "{}: {}: found {}; expected {} ({})",
            f.path.display(),
            self.key,
            self.found,
            self.expected,
            self.why
        ))
    }
}

type R<T> = std::result::Result<T, BadKey>;

struct Keys<'a>(&'a GgufFile);

impl Keys<'_> {
    fn full(k: &str) -> String {
        format!("{ARCH}.{k}")
    }
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(&Self::full(k))
    }
    fn opt_u(&self, k: &str) -> R<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                BadKey::new(
                    &Self::full(k),
                    v.display_short(),
                    "an unsigned integer",
                    "llama.cpp reads it as one",
                )
            }),
        }
    }
    fn req_u(&self, k: &str, why: &str) -> R<usize> {
        self.opt_u(k)?
            .ok_or_else(|| BadKey::new(&Self::full(k), "absent", "an unsigned integer", why))
    }
    /// A required dimension: present and at least 1.
    fn dim(&self, k: &str, why: &str) -> R<usize> {
        let v = self.req_u(k, why)?;
        if v == 0 || v > 1 << 20 {
            return Err(BadKey::new(
                &Self::full(k),
                v.to_string(),
                "1 ..= 2^20",
                why,
            ));
        }
        Ok(v)
    }
    fn opt_f(&self, k: &str) -> R<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| {
                    BadKey::new(
                        &Self::full(k),
                        v.display_short(),
                        "a finite number",
                        "llama.cpp reads it as a float",
                    )
                }),
        }
    }
    fn req_f(&self, k: &str, why: &str) -> R<f64> {
        self.opt_f(k)?
            .ok_or_else(|| BadKey::new(&Self::full(k), "absent", "a number", why))
    }
}

const LOADER: &str = "llama.cpp's deepseek4 loader requires it";

impl V4Config {
    pub fn kind(&self, layer: usize) -> LayerKind {
        self.kinds[layer]
    }
    /// The "nope" width of a head: `head_dim − rope_dim` leading dims without rope.
    pub fn nope_dim(&self) -> usize {
        self.head_dim - self.rope_dim
    }

    /// Read a `deepseek4` file's header; `Err` names the first key it refuses.
    pub fn from_gguf(f: &GgufFile) -> Result<V4Config> {
        Self::read(f).map_err(|b| b.into_error(f))
    }

    /// As `from_gguf`, with the refusal as a `BadKey` (what `lint` reports).
    pub fn read(f: &GgufFile) -> R<V4Config> {
        if f.architecture() != Some(ARCH) {
            return Err(BadKey::new(
                "general.architecture",
                format!("{:?}", f.architecture().unwrap_or("(none)")),
                "\"deepseek4\"",
                "a DeepSeek-V4 file",
            ));
        }
        let k = Keys(f);
        let (n_layer, nextn) = Self::layers(&k)?;
        let n_head = k.dim("attention.head_count", LOADER)?;
        let head_dim = Self::head_dims(&k)?;
        let rope_dim = k.req_u("rope.dimension_count", LOADER)?;
        if rope_dim == 0 || rope_dim % 2 == 1 || rope_dim > head_dim {
            return Err(BadKey::new(
                &Keys::full("rope.dimension_count"),
                rope_dim.to_string(),
                format!("even, 2 ..= key_length {head_dim}"),
                "rope rotates interleaved pairs of each head's trailing dims",
            ));
        }
        let kinds = Self::kinds(&k, n_layer)?;
        let o_groups = k.dim("attention.output_group_count", LOADER)?;
        if n_head % o_groups != 0 {
            return Err(BadKey::new(
                &Keys::full("attention.output_group_count"),
                o_groups.to_string(),
                format!("a divisor of head_count {n_head}"),
                "the grouped output projection splits the heads into equal groups",
            ));
        }
        let indexer = V4Indexer {
            n_head: k.dim("attention.indexer.head_count", LOADER)?,
            head_dim: k.dim("attention.indexer.key_length", LOADER)?,
            top_k: k.dim("attention.indexer.top_k", LOADER)?,
        };
        if kinds.contains(&LayerKind::Csa) && indexer.head_dim < rope_dim {
            return Err(BadKey::new(
                &Keys::full("attention.indexer.key_length"),
                indexer.head_dim.to_string(),
                format!(">= rope.dimension_count {rope_dim}"),
                "the indexer ropes the trailing rope dims of its heads",
            ));
        }
        let hc = HyperConnections {
            count: k.dim("hyper_connection.count", LOADER)?,
            sinkhorn_iterations: k.req_u("hyper_connection.sinkhorn_iterations", LOADER)?,
            epsilon: k.req_f("hyper_connection.epsilon", LOADER)?,
        };
        let rms_eps = k.req_f("attention.layer_norm_rms_epsilon", LOADER)?;
        if !(rms_eps > 0.0 && rms_eps < 1e-2) {
            return Err(BadKey::new(
                &Keys::full("attention.layer_norm_rms_epsilon"),
                rms_eps.to_string(),
                "in (0, 1e-2)",
                "every RMSNorm of the layer adds it under the root",
            ));
        }
        Ok(V4Config {
            n_layer,
            hidden: k.dim("embedding_length", LOADER)?,
            n_head,
            head_dim,
            rope_dim,
            q_lora_rank: k.dim("attention.q_lora_rank", LOADER)?,
            sliding_window: k.dim("attention.sliding_window", LOADER)?,
            kinds,
            rope_base: k.opt_f("rope.freq_base")?.unwrap_or(10000.0),
            compress_rope_base: k.req_f("attention.compress_rope_freq_base", LOADER)?,
            yarn: Self::yarn(&k)?,
            o_groups,
            o_lora_rank: k.dim("attention.output_lora_rank", LOADER)?,
            indexer,
            hc,
            rms_eps,
            context_length: k.opt_u("context_length")?,
            nextn_predict_layers: nextn,
            experts: Self::experts(&k)?,
            softmax_scale: 1.0 / (head_dim as f64).sqrt(),
        })
    }

    /// Trunk layers: `block_count` less the appended MTP blocks (`nextn_predict_layers`).
    fn layers(k: &Keys) -> R<(usize, usize)> {
        let blocks = k.dim("block_count", LOADER)?;
        let nextn = k.opt_u("nextn_predict_layers")?.unwrap_or(0);
        if nextn >= blocks {
            return Err(BadKey::new(
                &Keys::full("nextn_predict_layers"),
                nextn.to_string(),
                format!("< block_count {blocks}"),
                "the MTP blocks follow the trunk; an MTP-only file has no attention to check",
            ));
        }
        Ok((blocks - nextn, nextn))
    }

    /// One shared K = V head: `head_count_kv` 1, `key_length` = `value_length`.
    fn head_dims(k: &Keys) -> R<usize> {
        let kv = k.req_u("attention.head_count_kv", LOADER)?;
        if kv != 1 {
            return Err(BadKey::new(
                &Keys::full("attention.head_count_kv"),
                kv.to_string(),
                "1",
                "V4 attends every query head to one shared K = V head (MQA)",
            ));
        }
        let kl = k.dim("attention.key_length", LOADER)?;
        let vl = k.dim("attention.value_length", LOADER)?;
        if kl != vl {
            return Err(BadKey::new(
                &Keys::full("attention.value_length"),
                vl.to_string(),
                format!("key_length {kl}"),
                "K = V: the cache row is both key and value (llama.cpp asserts n_embd_head_k == n_embd_head_v)",
            ));
        }
        Ok(kl)
    }

    fn kinds(k: &Keys, n_layer: usize) -> R<Vec<LayerKind>> {
        let key = Keys::full("attention.compress_ratios");
        let arr = match k.get("attention.compress_ratios") {
            Some(Value::Array(a)) => a,
            Some(v) => {
                return Err(BadKey::new(&key, v.display_short(), "an array", LOADER));
            }
            None => {
                return Err(BadKey::new(
                    &key,
                    "absent",
                    "an array, one ratio per layer",
                    LOADER,
                ))
            }
        };
        if arr.len() < n_layer {
            return Err(BadKey::new(
                &key,
                format!("{} entries", arr.len()),
                format!(">= {n_layer} (one per layer)"),
                "llama.cpp refuses a compress_ratios shorter than block_count",
            ));
        }
        (0..n_layer)
            .map(|l| match arr.get(l).and_then(|v| v.as_u64()) {
                Some(0) => Ok(LayerKind::Window),
                Some(4) => Ok(LayerKind::Csa),
                Some(128) => Ok(LayerKind::Hca),
                other => Err(BadKey::new(
                    &key,
                    format!(
                        "{} at layer {l}",
                        other.map_or("not an integer".into(), |v| v.to_string())
                    ),
                    "0, 4 or 128",
                    "llama.cpp's loader supports compression ratios 0, 4 and 128 only",
                )),
            })
            .collect()
    }

    fn yarn(k: &Keys) -> R<Option<V4Yarn>> {
        let ty = k.get("rope.scaling.type").and_then(|v| v.as_str());
        match ty {
            None | Some("none") => Ok(None),
            Some("yarn") => Ok(Some(V4Yarn {
                factor: k.req_f("rope.scaling.factor", "YaRN needs its factor")?,
                original_context: k.req_u(
                    "rope.scaling.original_context_length",
                    "YaRN needs the original context",
                )? as u64,
                beta_fast: k.opt_f("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                beta_slow: k.opt_f("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
            })),
            Some(other) => Err(BadKey::new(
                &Keys::full("rope.scaling.type"),
                format!("{other:?}"),
                "\"yarn\" or none",
                "the converter writes YaRN (the \"compress\" rope) or nothing",
            )),
        }
    }

    fn experts(k: &Keys) -> R<V4Experts> {
        Ok(V4Experts {
            count: k.opt_u("expert_count")?,
            used: k.opt_u("expert_used_count")?,
            feed_forward_length: k.opt_u("expert_feed_forward_length")?,
            shared: k.opt_u("expert_shared_count")?,
            weights_scale: k.opt_f("expert_weights_scale")?,
            weights_norm: k.get("expert_weights_norm").and_then(|v| v.as_bool()),
            gating_func: k.opt_u("expert_gating_func")?,
            hash_layer_count: k.req_u("hash_layer_count", LOADER)?,
        })
    }

    /// The attention tensors of `layer` with the `ne` llama.cpp's loader creates them with, in dataflow
    /// order. `attn_output_a` is stored 2-D (`{H·D/G, G·o_lora}`); the loader views it as 3-D.
    pub fn attention_tensors(&self, layer: usize) -> Vec<(String, Vec<usize>)> {
        let (e, h, d, q) = (self.hidden, self.n_head, self.head_dim, self.q_lora_rank);
        let (g, ol, hc) = (self.o_groups, self.o_lora_rank, self.hc.count);
        let mix = (2 + hc) * hc;
        let mut v: Vec<(&str, Vec<usize>)> = vec![
            ("hc_attn_fn", vec![hc * e, mix]),
            ("hc_attn_base", vec![mix]),
            ("hc_attn_scale", vec![3]),
            ("attn_norm", vec![e]),
            ("attn_q_a", vec![e, q]),
            ("attn_q_a_norm", vec![q]),
            ("attn_q_b", vec![q, h * d]),
            ("attn_kv", vec![e, d]),
            ("attn_kv_a_norm", vec![d]),
        ];
        let kind = self.kind(layer);
        if kind != LayerKind::Window {
            let (c, m) = (kind.coff() * d, kind.ratio());
            v.extend([
                ("attn_compressor_kv", vec![e, c]),
                ("attn_compressor_gate", vec![e, c]),
                ("attn_compressor_ape", vec![c, m]),
                ("attn_compressor_norm", vec![d]),
            ]);
        }
        if kind == LayerKind::Csa {
            let (hi, di) = (self.indexer.n_head, self.indexer.head_dim);
            v.extend([
                ("indexer_compressor_kv", vec![e, 2 * di]),
                ("indexer_compressor_gate", vec![e, 2 * di]),
                ("indexer_compressor_ape", vec![2 * di, 4]),
                ("indexer_compressor_norm", vec![di]),
                ("indexer.attn_q_b", vec![q, hi * di]),
                ("indexer.proj", vec![e, hi]),
            ]);
        }
        v.extend([
            ("attn_sinks", vec![h]),
            ("attn_output_a", vec![h * d / g, g * ol]),
            ("attn_output_b", vec![g * ol, e]),
        ]);
        v.into_iter()
            .map(|(n, ne)| (format!("blk.{layer}.{n}.weight"), ne))
            .collect()
    }

    /// Each attention tensor that is missing or of another shape: (name, found `ne` or `None`, expected).
    pub fn tensor_issues(&self, f: &GgufFile) -> Vec<(String, Option<Vec<u64>>, Vec<usize>)> {
        let mut out = Vec::new();
        for l in 0..self.n_layer {
            for (name, ne) in self.attention_tensors(l) {
                let want: Vec<u64> = ne.iter().map(|&x| x as u64).collect();
                let ok3 = |t: &[u64]| {
                    // attn_output_a as the loader's 3-D view {H·D/G, o_lora, G}.
                    name.ends_with("attn_output_a.weight")
                        && t == [want[0], self.o_lora_rank as u64, self.o_groups as u64]
                };
                match f.tensor(&name) {
                    None => out.push((name, None, ne)),
                    Some(t) if t.ne != want && !ok3(&t.ne) => {
                        out.push((name, Some(t.ne.clone()), ne))
                    }
                    Some(_) => {}
                }
            }
        }
        out
    }
}

/// A released V4 model's attention dims (the catalogue's V4 kind; `lint` names a file that has them).
#[derive(Debug, Clone, Copy)]
pub struct V4Model {
    pub name: &'static str,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rope: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub sliding_window: usize,
    /// Indexer heads, head dim, top_k.
    pub indexer: (usize, usize, usize),
    pub source: &'static str,
}

impl V4Model {
    /// (heads, head_dim, rope, q_lora, o_groups, o_lora): what `lint` compares.
    pub fn dims(&self) -> (usize, usize, usize, usize, usize, usize) {
        let m = self;
        (m.heads, m.head_dim, m.rope, m.q_lora, m.o_groups, m.o_lora)
    }
}

pub const V4_CATALOGUE: [V4Model; 1] = [V4Model {
    name: "DeepSeek-V4-Flash",
    layers: 43,
    hidden: 4096,
    heads: 64,
    head_dim: 512,
    rope: 64,
    q_lora: 1024,
    o_groups: 8,
    o_lora: 1024,
    sliding_window: 128,
    indexer: (64, 128, 512),
    source: "transformers 5.24.0 DeepseekV4Config defaults (checkpoint deepseek-ai/DeepSeek-V4-Flash-Base)",
}];
