//! `mla-diff inspect`: what the file says about its attention, read from the header alone.

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::v4::{self, V4Config};
use crate::model::MlaConfig;
use serde_json::json;
use std::fmt::Write;

/// `1.23 GB` / `4.9 MB` / `512 B`.
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1_000_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b if b >= 1_000 => format!("{:.1} kB", b as f64 / 1e3),
        b => format!("{b} B"),
    }
}

/// The tensors of `names` the file has, as stored: what every `inspect --json` layer lists (an MLA
/// layer's attention and DSA indexer tensors, a DeepSeek-V4 layer's attention tensors).
fn tensors_json<I>(f: &GgufFile, names: I) -> Vec<serde_json::Value>
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    names
        .into_iter()
        .filter_map(|n| f.tensor(n.as_ref()))
        .map(|t| {
            json!({
                "name": t.name,
                "type": t.ty.to_string(),
                "ne": t.ne,
                "bytes": t.n_bytes(),
            })
        })
        .collect()
}

/// The files the model was read from (one unless it is split).
fn shards_json(f: &GgufFile) -> serde_json::Value {
    f.shards
        .iter()
        .map(|s| json!({ "file": s.path.display().to_string(), "size": s.file_size, "tensors": s.n_tensors }))
        .collect()
}

/// `fields` with the file's own (schema version, path, size, GGUF version, name, tensors, shards),
/// what every `inspect --json` document starts from.
fn with_file(f: &GgufFile, mut fields: serde_json::Value) -> serde_json::Value {
    let file = json!({
        "schema_version": 1,
        "file": f.path.display().to_string(),
        "file_size": f.file_size,
        "gguf_version": f.version,
        "name": f.get("general.name").and_then(|v| v.as_str()),
        "tensor_count": f.tensors.len(),
        "shards": shards_json(f),
    });
    if let (Some(o), serde_json::Value::Object(file)) = (fields.as_object_mut(), file) {
        o.extend(file);
    }
    fields
}

/// The inspect report as JSON (stable keys; `schema_version` bumps on breaking change).
pub fn inspect_json(f: &GgufFile) -> Result<serde_json::Value> {
    if f.architecture() == Some(v4::ARCH) {
        return v4_json(f);
    }
    let cfg = MlaConfig::from_gguf(f)?;
    let layers: Vec<_> = (0..cfg.n_layer)
        .map(|l| {
            let tensors = tensors_json(f, crate::model::weights::tensor_names(l));
            // The DSA indexer's (none on a dense file or a GLM-5.2 shared layer).
            let indexer = tensors_json(f, crate::model::indexer::tensor_names(l));
            json!({ "layer": l, "tensors": tensors, "indexer_tensors": indexer })
        })
        .collect();
    let attn_bytes: u64 = layers
        .iter()
        .flat_map(|l| l["tensors"].as_array().unwrap().iter())
        .filter_map(|t| t["bytes"].as_u64())
        .sum();
    let mut out = with_file(
        f,
        json!({
            "config": cfg,
            // The DSA indexer (GLM-5, DeepSeek-V3.2; null for a dense file): heads, head_dim, top_k, rope pairing.
            "indexer": crate::model::indexer::IndexerConfig::from_gguf(f, &cfg)?,
            "qk_head_dim": cfg.qk_head_dim(),
            "cache_row": cfg.cache_row(),
            // The catalogue model whose attention this is (`--preset` name; null: none).
            "catalogue": crate::model::catalogue::known(&cfg).map(|e| e.name),
            "attention_bytes": attn_bytes,
            "layers": layers,
        }),
    );
    // glm5-next only (absent elsewhere, so other files' JSON is unchanged): which layers are MLA and
    // which are linear attention (skipped), and the k-pool indexer keys.
    if let Some(h) = crate::model::HybridLayout::from_gguf(f)? {
        out["hybrid_layout"] = json!({ "mla_layers": h.mla_layers, "linear_layers": h.linear_layers, "skipped": h.skip_message() });
    }
    if let Some(k) = crate::model::KpoolConfig::from_gguf(f, &cfg)? {
        out["indexer_kpool"] =
            json!({ "kpool": k.kpool, "select_tail": k.select_tail, "full": k.full });
    }
    Ok(out)
}

/// The catalogue model the file's attention is (`catalogue::known`), for the text report.
fn catalogue_text(c: &MlaConfig) -> String {
    match crate::model::catalogue::known(c) {
        Some(e) if e.hidden == c.hidden && e.heads == c.n_head => {
            format!("{} (preset {}, at full size)", e.model_name, e.name)
        }
        Some(e) => format!(
            "{} (preset {}; hidden/heads {} / {}, the model's {} / {})",
            e.model_name, e.name, c.hidden, c.n_head, e.hidden, e.heads
        ),
        None => "no known model has this attention (dims, rope, YaRN, eps)".into(),
    }
}

/// Human-readable inspect report of any file `inspect` reads (MLA, DeepSeek-V4).
pub fn text(f: &GgufFile) -> Result<String> {
    if f.architecture() == Some(v4::ARCH) {
        v4_text(f)
    } else {
        inspect_text(f)
    }
}

/// A DeepSeek-V4 file's attention tensors of one layer, as stored.
fn v4_layer_tensors(f: &GgufFile, c: &V4Config, layer: usize) -> Vec<serde_json::Value> {
    tensors_json(f, c.attention_tensors(layer).into_iter().map(|(n, _)| n))
}

/// `inspect --json` of a DeepSeek-V4 file: its `V4Config` and each layer's kind and attention tensors.
fn v4_json(f: &GgufFile) -> Result<serde_json::Value> {
    let c = V4Config::from_gguf(f)?;
    let layers: Vec<_> = (0..c.n_layer)
        .map(|l| json!({ "layer": l, "kind": c.kind(l), "tensors": v4_layer_tensors(f, &c, l) }))
        .collect();
    Ok(with_file(
        f,
        json!({
            "architecture": v4::ARCH,
            "deepseek_v4": c,
            "cache_row": c.head_dim,
            "layers": layers,
        }),
    ))
}

/// `inspect` of a DeepSeek-V4 file.
fn v4_text(f: &GgufFile) -> Result<String> {
    let c = V4Config::from_gguf(f)?;
    let name = f.get("general.name").and_then(|v| v.as_str());
    let kinds: Vec<String> = c
        .kinds
        .iter()
        .enumerate()
        .map(|(l, k)| format!("{l}:{}", serde_json::to_value(k).unwrap().as_str().unwrap()))
        .collect();
    let compress = match &c.yarn {
        Some(y) => format!(
            "θ={}, YaRN factor {}, original context {}, β {}/{}, cos/sin × 1",
            c.compress_rope_base, y.factor, y.original_context, y.beta_fast, y.beta_slow
        ),
        None => format!("θ={}, no scaling", c.compress_rope_base),
    };
    let e = &c.experts;
    let opt = |v: Option<usize>| v.map_or("-".to_string(), |x| x.to_string());
    let bytes: u64 = (0..c.n_layer)
        .flat_map(|l| v4_layer_tensors(f, &c, l))
        .filter_map(|t| t["bytes"].as_u64())
        .sum();
    let lines = [
        format!(
            "{}  GGUF v{}, {} tensors, {}",
            f.path.display(),
            f.version,
            f.tensors.len(),
            human_bytes(f.file_size)
        ),
        format!("name          {}", name.unwrap_or("(unnamed)")),
        "architecture  deepseek4 (DeepSeek-V4: not latent MLA, one shared K = V head; docs/deepseek-v4.md)".into(),
        format!("layers        {} (+{} MTP)  kinds {}", c.n_layer, c.nextn_predict_layers, kinds.join(" ")),
        format!("hidden        {}   heads {}   head_dim {} = nope {} + rope {} (trailing, interleaved pairs); K = V, cache row {}",
            c.hidden, c.n_head, c.head_dim, c.nope_dim(), c.rope_dim, c.head_dim),
        format!("q_lora        {} (each head's q: RMSNorm without weight)", c.q_lora_rank),
        format!("output        {} groups x o_lora {} (grouped low-rank o_proj)", c.o_groups, c.o_lora_rank),
        format!("window        {} tokens", c.sliding_window),
        format!("rope main     θ={} (window-only layers)", c.rope_base),
        format!("rope compress {compress} (CSA/HCA layers, compressors, indexer)"),
        format!("indexer       {} heads x {}, top_k {} (CSA layers)", c.indexer.n_head, c.indexer.head_dim, c.indexer.top_k),
        format!("softmax scale {:.6} = 1/sqrt({}), a sink logit per head", c.softmax_scale, c.head_dim),
        format!("rms eps       {:e}", c.rms_eps),
        format!("hyper-conn.   {} streams, sinkhorn {}, eps {:e} (outside attention)", c.hc.count, c.hc.sinkhorn_iterations, c.hc.epsilon),
        format!("experts       {} ({} used, ff {}, shared {}, gating func {}), hash layers {}",
            opt(e.count), opt(e.used), opt(e.feed_forward_length), opt(e.shared), opt(e.gating_func), e.hash_layer_count),
        format!("attention weights: {} in {} layers", human_bytes(bytes), c.n_layer),
    ];
    Ok(lines.join("\n") + "\n")
}

/// Human-readable inspect report.
pub fn inspect_text(f: &GgufFile) -> Result<String> {
    let c = MlaConfig::from_gguf(f)?;
    let mut s = String::new();
    file_lines(&mut s, f);
    config_lines(&mut s, f, &c);
    sparse_lines(&mut s, f, &c)?;
    writeln!(s).ok();
    tensor_table(&mut s, f, &c);
    Ok(s)
}

/// The file, its GGUF version and size, and its shards.
fn file_lines(s: &mut String, f: &GgufFile) {
    writeln!(
        s,
        "{}  GGUF v{}, {} tensors, {}",
        f.path.display(),
        f.version,
        f.tensors.len(),
        human_bytes(f.file_size)
    )
    .ok();
    if f.shards.len() > 1 {
        writeln!(s, "split         {} shards:", f.shards.len()).ok();
        for (i, sh) in f.shards.iter().enumerate() {
            writeln!(
                s,
                "  {:>5}  {}  {} tensors, {}",
                i + 1,
                sh.path.display(),
                sh.n_tensors,
                human_bytes(sh.file_size)
            )
            .ok();
        }
    }
}

/// The attention's configuration: dims, rope, norms, softmax scale.
fn config_lines(s: &mut String, f: &GgufFile, c: &MlaConfig) {
    let name = f
        .get("general.name")
        .and_then(|v| v.as_str())
        .unwrap_or("(unnamed)");
    writeln!(
        s,
        "model         {name}  (architecture {})",
        c.arch.gguf_name()
    )
    .ok();
    writeln!(s, "catalogue     {}", catalogue_text(c)).ok();
    writeln!(
        s,
        "layers        {}   hidden {}   heads {} (head_count_kv {})",
        c.n_layer, c.hidden, c.n_head, c.n_head_kv
    )
    .ok();
    let q = c
        .q_lora_rank
        .map(|r| r.to_string())
        .unwrap_or_else(|| "none (plain attn_q)".into());
    writeln!(s, "q_lora_rank   {q}   kv_lora_rank {}", c.kv_lora_rank).ok();
    writeln!(
        s,
        "head dims     qk_nope {} + qk_rope {} = {}, v {}   latent cache row {} ({})",
        c.qk_nope,
        c.qk_rope,
        c.qk_head_dim(),
        c.v_head_dim,
        c.cache_row(),
        if c.mla_keys {
            "from *_mla keys"
        } else {
            "legacy key_length/value_length"
        }
    )
    .ok();
    writeln!(
        s,
        "rope          {:?} pairing, base {}, dims {}, cos/sin factor {}",
        c.rope.pairing, c.rope.base, c.rope.dim, c.rope.attn_factor
    )
    .ok();
    match &c.rope.yarn {
        Some(y) => writeln!(
            s,
            "yarn          factor {}, original context {}, mscale_all_dim {} (file: yarn_log_multiplier {}), beta fast {} / slow {}",
            y.factor, y.original_context, y.mscale_all_dim, y.log_multiplier_raw, y.beta_fast, y.beta_slow
        )
        .ok(),
        None => writeln!(s, "yarn          none").ok(),
    };
    if let Some(ff) = &c.rope.freq_factors_short {
        writeln!(
            s,
            "rope factors  {ff}{}",
            c.rope
                .freq_factors_long
                .as_ref()
                .map(|l| format!(", {l}"))
                .unwrap_or_default()
        )
        .ok();
    }
    writeln!(
        s,
        "rms eps       {:e} (q_a/kv_a norms: {:e})",
        c.rms_eps, c.lora_norm_eps
    )
    .ok();
    writeln!(
        s,
        "softmax scale {:.6}  (mscale {:.5}² / sqrt({}))",
        c.softmax_scale,
        c.mscale,
        c.qk_head_dim()
    )
    .ok();
}

/// Hybrid layouts (which layers are MLA), NoPE, and the DSA indexer with glm5-next's k-pool.
fn sparse_lines(s: &mut String, f: &GgufFile, c: &MlaConfig) -> Result<()> {
    if let Some(h) = crate::model::HybridLayout::from_gguf(f)? {
        writeln!(
            s,
            "mla layers    {} ({} of {})",
            crate::model::config::ranges(&h.mla_layers),
            h.mla_layers.len(),
            c.n_layer
        )
        .ok();
        if let Some(m) = h.skip_message() {
            writeln!(s, "skipped       {m}").ok();
        }
    }
    if c.arch == crate::model::Arch::Glm5Next && c.qk_rope == 0 {
        writeln!(
            s,
            "nope          no rope part (rope.dimension_count 0): cache row = kv_lora_rank {}",
            c.kv_lora_rank
        )
        .ok();
    }
    if let Some(k) = crate::model::KpoolConfig::from_gguf(f, c)? {
        let shared = match &k.full {
            Some(_) => {
                let mla: Vec<usize> = match crate::model::HybridLayout::from_gguf(f)? {
                    Some(h) => h.mla_layers,
                    None => (0..c.n_layer).collect(),
                };
                let sh = k.shared_layers(&mla);
                if sh.is_empty() {
                    "every MLA layer full".to_string()
                } else {
                    format!(
                        "shared (reuse the previous full layer's top-k) on layers {}",
                        crate::model::config::ranges(&sh)
                    )
                }
            }
            None => "no indexer.types (every layer full)".to_string(),
        };
        writeln!(
            s,
            "dsa k-pool    kpool {} (keys pooled {} tokens at a time), select tail {}; {shared}",
            k.kpool, k.kpool, k.select_tail
        )
        .ok();
    }
    if let Some(ic) = crate::model::indexer::IndexerConfig::from_gguf(f, c)? {
        writeln!(
            s,
            "dsa indexer   {} heads x {} (rope on the first {}, {:?} pairing), top_k {}",
            ic.heads, ic.head_dim, ic.rope_dim, ic.rope, ic.top_k
        )
        .ok();
    }
    Ok(())
}

/// Every attention (and indexer) tensor of every layer, and the attention weights' total.
fn tensor_table(s: &mut String, f: &GgufFile, c: &MlaConfig) {
    writeln!(
        s,
        "{:<32} {:>8} {:>22} {:>14}",
        "tensor", "type", "ne", "bytes"
    )
    .ok();
    let mut total = 0u64;
    for l in 0..c.n_layer {
        // The indexer's tensors are listed but not counted in the total (as in the JSON's attention_bytes).
        let mla = crate::model::weights::tensor_names(l).map(|n| (n, true));
        let idx = crate::model::indexer::tensor_names(l).map(|n| (n, false));
        for (n, counted) in mla.into_iter().chain(idx) {
            if let Some(t) = f.tensor(&n) {
                let ne = format!("{:?}", t.ne);
                let b = t.n_bytes();
                if counted {
                    total += b.unwrap_or(0);
                }
                writeln!(
                    s,
                    "{:<32} {:>8} {:>22} {:>14}",
                    t.name,
                    t.ty.to_string(),
                    ne,
                    b.map(|b| b.to_string()).unwrap_or("?".into())
                )
                .ok();
            }
        }
    }
    writeln!(
        s,
        "attention weights: {} in {} layers",
        human_bytes(total),
        c.n_layer
    )
    .ok();
}

/// One loaded weight's L2 norm.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TensorNorm {
    /// The `LayerWeights` field.
    pub weight: &'static str,
    /// The GGUF tensor it came from.
    pub tensor: String,
    /// Torch-orientation shape as held in memory.
    pub shape: Vec<usize>,
    pub l2: f64,
}

/// `inspect --load-layer`: what loading one layer's attention weights gives.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerNorms {
    pub file: String,
    pub layer: usize,
    pub kv_b_layout: crate::model::KvBLayout,
    pub tensors: Vec<TensorNorm>,
}

/// Load layer `layer` (dequantized and shape-checked, as a run would) and measure each weight.
pub fn layer_norms(f: &GgufFile, layer: usize) -> Result<LayerNorms> {
    use crate::model::{KvBLayout, LayerWeights, QProj};
    let cfg = MlaConfig::from_gguf(f)?;
    let w = LayerWeights::load(f, &cfg, layer)?;
    let n = |s: &str| format!("blk.{layer}.{s}.weight");
    let norm = |weight, tensor: String, shape: &[usize], v: ndarray::ArrayViewD<f32>| TensorNorm {
        weight,
        tensor,
        shape: shape.to_vec(),
        l2: v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt(),
    };
    let mut t = vec![norm(
        "attn_norm",
        n("attn_norm"),
        w.attn_norm.shape(),
        w.attn_norm.view().into_dyn(),
    )];
    match &w.q {
        QProj::Lora { a, a_norm, b } => {
            t.push(norm("q_a", n("attn_q_a"), a.shape(), a.view().into_dyn()));
            t.push(norm(
                "q_a_norm",
                n("attn_q_a_norm"),
                a_norm.shape(),
                a_norm.view().into_dyn(),
            ));
            t.push(norm("q_b", n("attn_q_b"), b.shape(), b.view().into_dyn()));
        }
        QProj::Plain { q } => t.push(norm("q", n("attn_q"), q.shape(), q.view().into_dyn())),
    }
    t.push(norm(
        "kv_a",
        n("attn_kv_a_mqa"),
        w.kv_a.shape(),
        w.kv_a.view().into_dyn(),
    ));
    t.push(norm(
        "kv_a_norm",
        n("attn_kv_a_norm"),
        w.kv_a_norm.shape(),
        w.kv_a_norm.view().into_dyn(),
    ));
    let (uk, uv) = match w.kv_b_layout {
        KvBLayout::Split => (n("attn_k_b"), n("attn_v_b")),
        KvBLayout::Unsplit => (n("attn_kv_b"), n("attn_kv_b")),
    };
    t.push(norm("w_uk", uk, w.w_uk.shape(), w.w_uk.view().into_dyn()));
    t.push(norm("w_uv", uv, w.w_uv.shape(), w.w_uv.view().into_dyn()));
    t.push(norm(
        "o",
        n("attn_output"),
        w.o.shape(),
        w.o.view().into_dyn(),
    ));
    Ok(LayerNorms {
        file: f.path.display().to_string(),
        layer,
        kv_b_layout: w.kv_b_layout,
        tensors: t,
    })
}

pub fn layer_norms_text(n: &LayerNorms) -> String {
    let mut s = String::new();
    writeln!(
        s,
        "{}  layer {} attention weights (kv_b layout: {:?})",
        n.file, n.layer, n.kv_b_layout
    )
    .ok();
    writeln!(
        s,
        "{:<10} {:<28} {:>18} {:>14}",
        "weight", "from tensor", "shape", "L2 norm"
    )
    .ok();
    for t in &n.tensors {
        writeln!(
            s,
            "{:<10} {:<28} {:>18} {:>14.6}",
            t.weight,
            t.tensor,
            format!("{:?}", t.shape),
            t.l2
        )
        .ok();
    }
    s
}
