//! Synthetic MLA GGUF files in llama.cpp's exact conventions, with seeded random weights.
//!
//! Every weight is first generated in torch (HF) layout, then emitted the way the converter would:
//! `ne` = reversed torch shape, `kv_b_proj` split per head into `[k_nope | v]` with `k_b` transposed
//! (`attn_k_b` ne `{P, Lkv, H}`, `attn_v_b` ne `{Lkv, Dv, H}`) — or, for legacy files and MiniCPM3,
//! one unsplit `attn_kv_b`. Metadata keys and values follow `conversion/deepseek.py`, `glm.py` and
//! `minicpm.py` (see the README's "Conventions"). Only attention tensors and `token_embd` are written:
//! no FFN/MoE, output or tokenizer, so the files are small and not runnable by llama.cpp itself.
//!
//! Values are a pure function of (seed, tensor name, row): each torch row has its own RNG stream, so
//! the bytes do not depend on chunking or thread count, and tests can regenerate any tensor on its own.

use crate::error::{Error, Result};
use crate::gguf::write::{quantize, storage_type, GgufWriter, TensorSink};
use crate::gguf::{GgmlType, Value};
use crate::model::Arch;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use crate::model::catalogue::{Preset, YarnSpec};

/// Everything that determines a fixture file.
#[derive(Debug, Clone)]
pub struct Spec {
    pub preset: Preset,
    pub model_name: &'static str,
    pub arch: Arch,
    pub layers: usize,
    pub hidden: usize,
    pub n_head: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
    /// `None`: the converter writes no `rope.freq_base` (MiniCPM3; llama.cpp then uses 10000).
    pub rope_base: Option<f32>,
    pub yarn: Option<YarnSpec>,
    pub rms_eps: f32,
    pub context_length: u32,
    pub vocab: usize,
    /// Pre-PR #12801 layout: unsplit `attn_kv_b`, MHA-style head sizes, no `*_mla` keys.
    pub legacy_kv_b: bool,
    /// DSA indexer keys (head_count, key_length, top_k) written by the GLM-5 converter.
    pub indexer: Option<(u32, u32, u32)>,
    pub quant: GgmlType,
    pub seed: u64,
}

/// Command-line choices layered over a preset.
#[derive(Debug, Clone)]
pub struct Options {
    pub preset: Preset,
    pub layers: Option<usize>,
    pub quant: GgmlType,
    pub seed: u64,
    pub legacy_kv_b: bool,
    pub hidden: Option<usize>,
    pub heads: Option<usize>,
    /// `Some(0)` removes the q-LoRA (plain `attn_q`).
    pub q_lora_rank: Option<usize>,
    pub vocab: Option<usize>,
}

/// Rows of `token_embd` in a fixture unless `--vocab` says otherwise (not the real model's vocabulary).
const VOCAB: usize = 512;

impl Preset {
    /// The fixture of the model as the catalogue states it (BF16, seed 0).
    pub fn spec(self) -> Spec {
        let e = self.entry();
        Spec {
            preset: self,
            model_name: e.model_name,
            arch: e.arch,
            layers: e.layers,
            hidden: e.hidden,
            n_head: e.heads,
            q_lora_rank: e.q_lora,
            kv_lora_rank: e.kv_lora,
            qk_nope: e.qk_nope,
            qk_rope: e.qk_rope,
            v_head_dim: e.v_head,
            rope_base: e.rope_base.map(|b| b as f32),
            yarn: e.yarn.clone(),
            rms_eps: e.rms_eps as f32,
            context_length: e.context_length,
            vocab: VOCAB,
            legacy_kv_b: e.unsplit_kv_b,
            indexer: e.indexer.map(|i| (i.heads, i.key_length, i.top_k)),
            quant: GgmlType::from_name("BF16").unwrap(),
            seed: 0,
        }
    }
}

impl Spec {
    pub fn from_options(o: &Options) -> Result<Spec> {
        let mut s = o.preset.spec();
        if o.legacy_kv_b && s.arch == Arch::Minicpm3 {
            return Err(Error::Usage(
                "--legacy-kv-b: minicpm3 files always have an unsplit attn_kv_b already".into(),
            ));
        }
        s.legacy_kv_b |= o.legacy_kv_b;
        s.layers = o.layers.unwrap_or(s.layers);
        s.hidden = o.hidden.unwrap_or(s.hidden);
        s.n_head = o.heads.unwrap_or(s.n_head);
        if let Some(r) = o.q_lora_rank {
            s.q_lora_rank = (r > 0).then_some(r);
        }
        s.vocab = o.vocab.unwrap_or(s.vocab);
        s.quant = o.quant;
        s.seed = o.seed;
        for (what, v) in [
            ("--layers", s.layers),
            ("--hidden", s.hidden),
            ("--heads", s.n_head),
            ("--vocab", s.vocab),
        ] {
            if v == 0 || v > 1 << 20 {
                return Err(Error::Usage(format!("{what} {v} is out of range")));
            }
        }
        if !crate::gguf::write::can_quantize(s.quant) {
            return Err(Error::Usage(format!(
                "--quant {}: cannot produce this type (choose one of: {})",
                s.quant.name.to_lowercase(),
                quant_names().join(", ")
            )));
        }
        Ok(s)
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
    fn kv_b_rows(&self) -> usize {
        self.n_head * (self.qk_nope + self.v_head_dim)
    }
    /// The metadata, in the order the converter writes it.
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let a = self.arch.gguf_name();
        let k = |s: &str| format!("{a}.{s}");
        let u = |v: usize| Value::U32(v as u32);
        let mut m: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(a.into())),
            (
                "general.name".into(),
                Value::String(format!("{} (mla-diff synthetic fixture)", self.model_name)),
            ),
            (
                "general.description".into(),
                Value::String(format!(
                    "mla-diff fixture: preset {:?}, {} layers, hidden {}, heads {}, q_lora {:?}, quant {}, seed {}{}; attention tensors only, random weights",
                    self.preset,
                    self.layers,
                    self.hidden,
                    self.n_head,
                    self.q_lora_rank,
                    self.quant,
                    self.seed,
                    if self.legacy_kv_b && self.arch != Arch::Minicpm3 { ", legacy kv_b" } else { "" }
                )),
            ),
        ];
        let mut push = |key: String, v: Value| m.push((key, v));
        if self.arch == Arch::Minicpm3 {
            // conversion/minicpm.py MiniCPM3Model.set_gguf_parameters (no base-class call).
            push("general.file_type".into(), u(file_type(self.quant)));
            push(k("context_length"), Value::U32(self.context_length));
            push(k("embedding_length"), u(self.hidden));
            push(k("block_count"), u(self.layers));
            push(k("attention.head_count"), u(self.n_head));
            push(k("attention.head_count_kv"), u(self.n_head));
            push(
                k("attention.layer_norm_rms_epsilon"),
                Value::F32(self.rms_eps),
            );
            push(k("vocab_size"), u(self.vocab));
            if let Some(r) = self.q_lora_rank {
                push(k("attention.q_lora_rank"), u(r));
            }
            push(k("attention.kv_lora_rank"), u(self.kv_lora_rank));
            push(k("attention.key_length"), u(self.qk_head_dim()));
            // The converter writes no value_length: llama.cpp's default hidden/heads equals v_head_dim in
            // the real model. Reduced fixtures break that identity, so they state it.
            if self.hidden / self.n_head != self.v_head_dim
                || !self.hidden.is_multiple_of(self.n_head)
            {
                push(k("attention.value_length"), u(self.v_head_dim));
            }
            push(k("rope.dimension_count"), u(self.qk_rope));
        } else {
            // conversion/base.py TextModel.set_gguf_parameters, then DeepseekV2Model's additions.
            push(k("block_count"), u(self.layers));
            push(k("context_length"), Value::U32(self.context_length));
            push(k("embedding_length"), u(self.hidden));
            push(k("attention.head_count"), u(self.n_head));
            // MLA is exposed as MQA (num_key_value_heads = 1); legacy files kept the HF value (= n_head).
            push(
                k("attention.head_count_kv"),
                u(if self.legacy_kv_b { self.n_head } else { 1 }),
            );
            if let (Some(y), false) = (&self.yarn, self.legacy_kv_b) {
                push(k("rope.scaling.type"), Value::String("yarn".into()));
                push(k("rope.scaling.factor"), Value::F32(y.factor));
                push(
                    k("rope.scaling.original_context_length"),
                    Value::U32(y.original_context),
                );
                if let Some(b) = y.beta_fast {
                    push(k("rope.scaling.yarn_beta_fast"), Value::F32(b));
                }
                if let Some(b) = y.beta_slow {
                    push(k("rope.scaling.yarn_beta_slow"), Value::F32(b));
                }
            }
            if let Some(b) = self.rope_base {
                push(k("rope.freq_base"), Value::F32(b));
            }
            push(
                k("attention.layer_norm_rms_epsilon"),
                Value::F32(self.rms_eps),
            );
            push("general.file_type".into(), u(file_type(self.quant)));
            push(k("vocab_size"), u(self.vocab));
            if let Some(r) = self.q_lora_rank {
                push(k("attention.q_lora_rank"), u(r));
            }
            push(k("attention.kv_lora_rank"), u(self.kv_lora_rank));
            if self.legacy_kv_b {
                push(k("attention.key_length"), u(self.qk_head_dim()));
                push(k("attention.value_length"), u(self.v_head_dim));
            } else {
                push(
                    k("attention.key_length"),
                    u(self.kv_lora_rank + self.qk_rope),
                );
                push(k("attention.value_length"), u(self.kv_lora_rank));
                push(k("attention.key_length_mla"), u(self.qk_head_dim()));
                push(k("attention.value_length_mla"), u(self.v_head_dim));
            }
            push(k("rope.dimension_count"), u(self.qk_rope));
            if let Some(y) = &self.yarn {
                if self.legacy_kv_b {
                    // The pre-#12801 converter wrote the YaRN keys here, without the betas.
                    push(k("rope.scaling.type"), Value::String("yarn".into()));
                    push(k("rope.scaling.factor"), Value::F32(y.factor));
                    push(
                        k("rope.scaling.original_context_length"),
                        Value::U32(y.original_context),
                    );
                }
                if let Some(m) = y.mscale_all_dim {
                    // [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: the converter stores 0.1·mscale_all_dim.
                    push(
                        k("rope.scaling.yarn_log_multiplier"),
                        Value::F32((0.1 * m) as f32),
                    );
                }
            }
            if let Some((heads, key_len, top_k)) = self.indexer {
                push(k("attention.indexer.head_count"), Value::U32(heads));
                push(k("attention.indexer.key_length"), Value::U32(key_len));
                push(k("attention.indexer.top_k"), Value::U32(top_k));
            }
        }
        m.push(("general.quantization_version".into(), Value::U32(2)));
        m
    }

    /// Every tensor of the file, in write order.
    pub fn plan(&self) -> Vec<TensorPlan> {
        let (e, h, r, lkv) = (self.hidden, self.n_head, self.qk_rope, self.kv_lora_rank);
        let (p, dk, dv) = (self.qk_nope, self.qk_head_dim(), self.v_head_dim);
        let mut v = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, src: Source| {
            let ne: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            let ty = storage_type(&ne, self.quant);
            v.push(TensorPlan {
                name,
                torch_shape: shape,
                ty,
                src,
            });
        };
        add(
            "token_embd.weight".into(),
            vec![self.vocab, e],
            Source::Embedding,
        );
        if self.arch == Arch::Minicpm3 {
            // MiniCPM3Model.generate_extra_tensors: LongRoPE factors, long then short, F32.
            add(
                "rope_factors_long.weight".into(),
                vec![r / 2],
                Source::RopeFactors { long: true },
            );
            add(
                "rope_factors_short.weight".into(),
                vec![r / 2],
                Source::RopeFactors { long: false },
            );
        }
        for l in 0..self.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            add(n("attn_norm"), vec![e], Source::Norm { outliers: true });
            match self.q_lora_rank {
                Some(lq) => {
                    add(n("attn_q_a"), vec![lq, e], Source::linear(e));
                    add(
                        n("attn_q_a_norm"),
                        vec![lq],
                        Source::Norm { outliers: false },
                    );
                    add(n("attn_q_b"), vec![h * dk, lq], Source::linear(lq));
                }
                None => add(n("attn_q"), vec![h * dk, e], Source::linear(e)),
            }
            add(
                n("attn_kv_a_mqa"),
                vec![lkv + r, e],
                Source::Linear {
                    fan_in: e,
                    outlier_rows: true,
                },
            );
            add(
                n("attn_kv_a_norm"),
                vec![lkv],
                Source::Norm { outliers: true },
            );
            if self.legacy_kv_b {
                add(n("attn_kv_b"), vec![self.kv_b_rows(), lkv], Source::KvB);
            } else {
                add(n("attn_k_b"), vec![h, lkv, p], Source::KB);
                add(n("attn_v_b"), vec![h, dv, lkv], Source::VB);
            }
            add(n("attn_output"), vec![e, h * dv], Source::linear(h * dv));
        }
        v
    }

    /// A tensor's generated values in torch layout (before any quantization).
    pub fn torch_values(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .plan()
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::Usage(format!("fixture has no tensor {name}")))?;
        Ok(self.rows(&t, 0, t.rows()))
    }

    /// The HF `kv_b_proj` weight of a layer, torch `[H·(P+Dv), Lkv]`, each head `[k_nope | v]` — what
    /// `attn_kv_b`, or the split `attn_k_b`/`attn_v_b`, were made from.
    pub fn kv_b_proj(&self, layer: usize) -> Vec<f32> {
        let name = kv_b_name(layer);
        let lkv = self.kv_lora_rank;
        let mut out = Vec::with_capacity(self.kv_b_rows() * lkv);
        for row in 0..self.kv_b_rows() {
            self.linear_row(&name, row, lkv, lkv, &[], &mut out);
        }
        out
    }

    /// Rows `[r0, r1)` of a tensor (torch rows: runs of `ne[0]` elements), in torch layout.
    fn rows(&self, t: &TensorPlan, r0: usize, r1: usize) -> Vec<f32> {
        let ne0 = *t.torch_shape.last().unwrap();
        let mut out = Vec::with_capacity((r1 - r0) * ne0);
        let (p, dv, lkv) = (self.qk_nope, self.v_head_dim, self.kv_lora_rank);
        match t.src {
            Source::Embedding => {
                for row in r0..r1 {
                    let mut rng = row_rng(self.seed, &t.name, row as u64);
                    out.extend((0..ne0).map(|_| rng.sample::<f32, _>(StandardNormal)));
                }
            }
            Source::Norm { outliers } => {
                // Log-normal around 1 (never all ones, always positive), plus a few ×8 channels as real
                // attn_norm / kv_a_norm weights have.
                let mut rng = row_rng(self.seed, &t.name, 0);
                out.extend((0..ne0).map(|_| (0.3 * rng.sample::<f32, _>(StandardNormal)).exp()));
                if outliers {
                    for i in self.outliers(&t.name, 0, ne0) {
                        out[i] *= OUTLIER;
                    }
                }
            }
            Source::Linear {
                fan_in,
                outlier_rows,
            } => {
                let big = if outlier_rows {
                    // kv_a: a few large latent channels and one large k_pe channel.
                    let lkv = self.kv_lora_rank;
                    let mut b = self.outliers(&t.name, 0, lkv);
                    b.extend(
                        self.outliers(&format!("{}#pe", t.name), 0, self.qk_rope)
                            .into_iter()
                            .take(1)
                            .map(|i| lkv + i),
                    );
                    b
                } else {
                    Vec::new()
                };
                for row in r0..r1 {
                    self.linear_row(&t.name, row, ne0, fan_in, &big, &mut out);
                }
            }
            Source::KvB => {
                for row in r0..r1 {
                    self.linear_row(&t.name, row, ne0, lkv, &[], &mut out);
                }
            }
            Source::VB => {
                // torch [H, Dv, Lkv]: row (h, d) is kv_b_proj row h·(P+Dv) + P + d.
                let layer = layer_of(&t.name);
                for row in r0..r1 {
                    let (h, d) = (row / dv, row % dv);
                    let src = h * (p + dv) + p + d;
                    self.linear_row(&kv_b_name(layer), src, lkv, lkv, &[], &mut out);
                }
            }
            Source::KB => {
                // torch [H, Lkv, P] = per head, the transpose of kv_b_proj rows h·(P+Dv) .. h·(P+Dv)+P.
                // Callers ask for whole heads (see `TensorPlan::unit`).
                let layer = layer_of(&t.name);
                let mut head = Vec::with_capacity(p * lkv);
                for h in r0 / lkv..r1 / lkv {
                    head.clear();
                    for i in 0..p {
                        self.linear_row(
                            &kv_b_name(layer),
                            h * (p + dv) + i,
                            lkv,
                            lkv,
                            &[],
                            &mut head,
                        );
                    }
                    for l in 0..lkv {
                        out.extend((0..p).map(|i| head[i * lkv + l]));
                    }
                }
            }
            Source::RopeFactors { long } => {
                // Synthetic LongRoPE divisors: ≥ 1 and growing toward the low frequencies, like real ones.
                let n = ne0.max(2) - 1;
                out.extend((0..ne0).map(|i| {
                    let x = i as f32 / n as f32;
                    if long {
                        1.0 + 39.0 * x * x * x
                    } else {
                        1.0 + 0.5 * x * x
                    }
                }));
            }
        }
        out
    }

    fn linear_row(
        &self,
        name: &str,
        row: usize,
        n: usize,
        fan_in: usize,
        big_rows: &[usize],
        out: &mut Vec<f32>,
    ) {
        let mut std = 1.0 / (fan_in as f32).sqrt();
        if big_rows.contains(&row) {
            std *= OUTLIER;
        }
        let mut rng = row_rng(self.seed, name, row as u64);
        out.extend((0..n).map(|_| std * rng.sample::<f32, _>(StandardNormal)));
    }

    /// A few distinct channel indices in `[lo, lo+n)`, fixed by (seed, name).
    fn outliers(&self, name: &str, lo: usize, n: usize) -> Vec<usize> {
        let k = if n >= 64 { 4 } else { 1 };
        let mut rng = row_rng(self.seed, name, u64::MAX);
        let mut v: Vec<usize> = rand::seq::index::sample(&mut rng, n, k.min(n))
            .into_iter()
            .map(|i| lo + i)
            .collect();
        v.sort_unstable();
        v
    }
}

/// Magnitude of the large channels.
const OUTLIER: f32 = 8.0;

/// Where a tensor's values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Embedding,
    Norm {
        outliers: bool,
    },
    /// N(0, 1/fan_in) entries; `outlier_rows` scales a few output channels.
    Linear {
        fan_in: usize,
        outlier_rows: bool,
    },
    /// Unsplit `attn_kv_b` (= `kv_b_proj`).
    KvB,
    /// `attn_k_b`, split from `kv_b_proj` and transposed.
    KB,
    /// `attn_v_b`, split from `kv_b_proj`.
    VB,
    RopeFactors {
        long: bool,
    },
}

impl Source {
    fn linear(fan_in: usize) -> Source {
        Source::Linear {
            fan_in,
            outlier_rows: false,
        }
    }
}

/// One tensor to write.
#[derive(Debug, Clone)]
pub struct TensorPlan {
    pub name: String,
    /// PyTorch shape; `ne` is its reverse.
    pub torch_shape: Vec<usize>,
    /// Storage type after llama.cpp's fallbacks.
    pub ty: GgmlType,
    pub src: Source,
}

impl TensorPlan {
    pub fn ne(&self) -> Vec<u64> {
        self.torch_shape.iter().rev().map(|&d| d as u64).collect()
    }
    fn row_len(&self) -> usize {
        *self.torch_shape.last().unwrap()
    }
    fn rows(&self) -> usize {
        self.torch_shape.iter().product::<usize>() / self.row_len()
    }
    /// Rows generated together: a whole head for the transposed `attn_k_b`, else one row.
    fn unit(&self) -> usize {
        match self.src {
            Source::KB => self.torch_shape[1],
            _ => 1,
        }
    }
}

fn kv_b_name(layer: usize) -> String {
    format!("blk.{layer}.attn_kv_b.weight")
}

fn layer_of(name: &str) -> usize {
    name.split('.')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("layer tensor name")
}

/// splitmix64: a full-avalanche mix so nearby (seed, row) pairs give unrelated streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn row_rng(seed: u64, name: &str, row: u64) -> StdRng {
    // FNV-1a of the name: stable across platforms and Rust versions (unlike std's hasher).
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    StdRng::seed_from_u64(mix(mix(seed) ^ h) ^ mix(row))
}

/// llama.cpp `llama_ftype` for a file whose weights are mostly `ty` (what `general.file_type` says).
fn file_type(ty: GgmlType) -> usize {
    match ty.name {
        "F32" => 0,
        "F16" => 1,
        "Q4_0" => 2,
        "Q4_1" => 3,
        "Q8_0" => 7,
        "Q5_0" => 8,
        "Q5_1" => 9,
        "Q2_K" => 10,
        "Q3_K" => 12, // Q3_K_M
        "Q4_K" => 15, // Q4_K_M
        "Q5_K" => 17, // Q5_K_M
        "Q6_K" => 18,
        "BF16" => 32,
        _ => 0,
    }
}

/// `--quant` values, lower case.
pub fn quant_names() -> Vec<String> {
    GgmlType::all()
        .iter()
        .filter(|t| crate::gguf::write::can_quantize(**t))
        .map(|t| t.name.to_lowercase())
        .collect()
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Summary {
    pub tensors: usize,
    pub bytes: u64,
    /// (type, tensor count), in first-seen order.
    pub types: Vec<(GgmlType, usize)>,
}

/// Elements generated and quantized per work item.
const CHUNK_ELEMS: usize = 1 << 20;

/// Write the fixture to `path` (through a temporary file, renamed at the end).
pub fn write(spec: &Spec, path: &Path) -> Result<Summary> {
    let plan = spec.plan();
    let mut w = GgufWriter::new();
    for (k, v) in spec.metadata() {
        w.add(k, v)?;
    }
    for t in &plan {
        w.add_tensor(&t.name, &t.ne(), t.ty)?;
    }
    let bytes = w.file_size();
    let tmp = path.with_extension("tmp.gguf");
    let file = std::fs::File::create(&tmp)
        .map_err(|e| Error::io(format!("cannot create {}", tmp.display()), e))?;
    let result = (|| {
        let mut sink = w.start(std::io::BufWriter::with_capacity(8 << 20, file))?;
        write_tensors(spec, &plan, &mut sink)?;
        sink.finish()?
            .into_inner()
            .map_err(|e| Error::io(format!("writing {}", tmp.display()), e.into_error()))?
            .sync_all()
            .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)
        .map_err(|e| Error::io(format!("cannot rename to {}", path.display()), e))?;
    let mut types: Vec<(GgmlType, usize)> = Vec::new();
    for t in &plan {
        match types.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, n)) => *n += 1,
            None => types.push((t.ty, 1)),
        }
    }
    Ok(Summary {
        tensors: plan.len(),
        bytes,
        types,
    })
}

/// Generate and encode every tensor in chunks on all cores; this thread writes the chunks in file order.
/// Workers take chunks in order, so only about one chunk per worker is ever waiting to be written.
fn write_tensors<W: Write>(
    spec: &Spec,
    plan: &[TensorPlan],
    sink: &mut TensorSink<W>,
) -> Result<()> {
    let mut chunks: Vec<(&TensorPlan, usize, usize)> = Vec::new();
    for t in plan {
        let unit = t.unit();
        let per_chunk = ((CHUNK_ELEMS / (t.row_len() * unit)).max(1)) * unit;
        let rows = t.rows();
        chunks.extend(
            (0..rows)
                .step_by(per_chunk)
                .map(|r0| (t, r0, (r0 + per_chunk).min(rows))),
        );
    }
    // MLA_DIFF_FIXTURE_THREADS pins the worker count (the bytes never depend on it).
    let threads = std::env::var("MLA_DIFF_FIXTURE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let next = AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Result<Vec<u8>>)>(threads);
    std::thread::scope(|s| {
        for _ in 0..threads {
            let (tx, next, chunks) = (tx.clone(), &next, &chunks);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(t, r0, r1)) = chunks.get(i) else {
                    break;
                };
                let bytes = quantize(&spec.rows(t, r0, r1), t.row_len(), t.ty);
                // The receiver is gone only after an error: stop quietly.
                if tx.send((i, bytes)).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        let mut pending = BTreeMap::new();
        let mut want = 0;
        for (i, bytes) in rx {
            pending.insert(i, bytes);
            while let Some(b) = pending.remove(&want) {
                sink.write(&b?)?;
                want += 1;
            }
        }
        Ok(())
    })
}
