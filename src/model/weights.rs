//! Per-layer attention weights, loaded lazily (one layer at a time) and shape-checked against the config.
//!
//! Everything is held in torch orientation (`[out, in]`, i.e. ggml `ne` reversed) as exact f32 values of
//! the dequantized file contents. The kv_b decompression is normalised to per-head `W_UK[h]: [P, Lkv]`
//! and `W_UV[h]: [Dv, Lkv]`, whichever of the split (`attn_k_b`/`attn_v_b`) or legacy (`attn_kv_b`)
//! layouts the file uses. Non-attention tensors are never read.

use super::config::MlaConfig;
use crate::error::{Error, Result};
use crate::gguf::{dequantize_f32_into, GgufFile};
use crate::precision::Dtype;
use ndarray::{Array1, Array2, Array3, Dimension};
use rayon::prelude::*;
use serde::Serialize;
use std::sync::OnceLock;

/// How the file stores the kv_b decompression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvBLayout {
    /// `attn_k_b` ne `{P, Lkv, H}` (transposed by the converter) and `attn_v_b` ne `{Lkv, Dv, H}`.
    Split,
    /// `attn_kv_b` ne `{Lkv, H·(P+Dv)}`, each head `[k_nope | v]` (legacy DeepSeek, MiniCPM3, PLM).
    Unsplit,
}

/// The query projection.
#[derive(Debug, Clone)]
pub enum QProj {
    /// `q = W_qb · RMSNorm(W_qa · x)`.
    Lora {
        a: Array2<f32>,
        a_norm: Array1<f32>,
        b: Array2<f32>,
    },
    /// `q = W_q · x` (DeepSeek-V2-Lite, PLM).
    Plain { q: Array2<f32> },
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub layer: usize,
    /// `[E]`
    pub attn_norm: Array1<f32>,
    pub q: QProj,
    /// `[Lkv + R, E]`: output rows `[0:Lkv]` latent, `[Lkv:]` k_pe.
    pub kv_a: Array2<f32>,
    /// `[Lkv]`
    pub kv_a_norm: Array1<f32>,
    /// `[H, P, Lkv]`: `k_nope[h] = W_UK[h] · latent`.
    pub w_uk: Array3<f32>,
    /// `[H, Dv, Lkv]`: `v[h] = W_UV[h] · latent`.
    pub w_uv: Array3<f32>,
    /// `[E, H·Dv]`
    pub o: Array2<f32>,
    pub kv_b_layout: KvBLayout,
    /// The same weights rounded to bf16 and fp16 ([`LayerWeights::stored`]), made on first use.
    pub(crate) stored: [OnceLock<Box<LayerWeights>>; 2],
    /// The dtype these values were rounded to in place ([`LayerWeights::round_in_place`]): they are
    /// then their own stored copy, and no longer the file's values.
    pub(crate) rounded: Option<Dtype>,
    /// Tells these weights from any others of the process ([`LayerWeights::id`]).
    pub(crate) id: WeightsId,
}

/// A process-unique number, new for every `LayerWeights` made or cloned (a clone may be edited).
#[derive(Debug)]
pub struct WeightsId(u64);

impl Default for WeightsId {
    fn default() -> WeightsId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        WeightsId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Clone for WeightsId {
    fn clone(&self) -> WeightsId {
        WeightsId::default()
    }
}

/// Tensor names of one layer's attention.
pub fn tensor_names(layer: usize) -> [String; 11] {
    [
        "attn_norm",
        "attn_q",
        "attn_q_a",
        "attn_q_a_norm",
        "attn_q_b",
        "attn_kv_a_mqa",
        "attn_kv_a_norm",
        "attn_kv_b",
        "attn_k_b",
        "attn_v_b",
        "attn_output",
    ]
    .map(|n| format!("blk.{layer}.{n}.weight"))
}

fn fmt_ne(ne: &[u64]) -> String {
    format!(
        "{{{}}}",
        ne.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Load a tensor, checking its `ne` shape exactly.
pub fn load_checked(f: &GgufFile, name: &str, ne: &[usize], why: &str) -> Result<Vec<f32>> {
    load_checked_into(f, name, (ne, why), Vec::new())
}

/// [`load_checked`] into `buf` (`gguf::dequantize_f32_into`: written over where it holds as many).
fn load_checked_into(
    f: &GgufFile,
    name: &str,
    (ne, why): (&[usize], &str),
    buf: Vec<f32>,
) -> Result<Vec<f32>> {
    let t = f.tensor(name).ok_or_else(|| {
        Error::Tensor(format!(
            "{}: tensor {name} is missing ({why})",
            f.path.display()
        ))
    })?;
    let want: Vec<u64> = ne.iter().map(|&d| d as u64).collect();
    if t.ne != want {
        return Err(Error::Tensor(format!(
            "{}: tensor {name} has shape (ne) {}, expected {} ({why})",
            f.path.display(),
            fmt_ne(&t.ne),
            fmt_ne(&want)
        )));
    }
    dequantize_f32_into(f, t, buf)
}

fn mat(v: Vec<f32>, rows: usize, cols: usize) -> Array2<f32> {
    Array2::from_shape_vec((rows, cols), v).expect("shape checked")
}

impl LayerWeights {
    pub fn load(f: &GgufFile, cfg: &MlaConfig, layer: usize) -> Result<LayerWeights> {
        Self::load_reusing(f, cfg, layer, Vec::new())
    }

    /// [`LayerWeights::load`], dequantizing into the buffers `spare` (another layer's, let go:
    /// [`LayerWeights::into_buffers`]) where one holds as many values as a tensor: the same values,
    /// without fresh memory to fault in and zero (#39). Buffers left over are dropped.
    pub fn load_reusing(
        f: &GgufFile,
        cfg: &MlaConfig,
        layer: usize,
        mut spare: Vec<Vec<f32>>,
    ) -> Result<LayerWeights> {
        if layer >= cfg.n_layer {
            return Err(Error::Usage(format!(
                "layer {layer} does not exist: the model has {} layers (0..{})",
                cfg.n_layer, cfg.n_layer
            )));
        }
        let (e, h, r, lkv) = (cfg.hidden, cfg.n_head, cfg.qk_rope, cfg.kv_lora_rank);
        let (p, dk, dv) = (cfg.qk_nope, cfg.qk_head_dim(), cfg.v_head_dim);
        let n = |s: &str| format!("blk.{layer}.{s}.weight");
        let why = format!("layer {layer} attention");
        let why_plain = format!("{why}, no q_lora_rank");
        let why_split =
            format!("{why}; the file has no attn_kv_b, so the split attn_k_b/attn_v_b are needed");
        let unsplit = f.tensor(&n("attn_kv_b")).is_some();
        let (w0, wp, ws) = (why.as_str(), why_plain.as_str(), why_split.as_str());
        // The layer's tensors in this order, with the shape (`ne`) each must have and why it is read.
        let mut wanted: Vec<(String, Vec<usize>, &str)> = vec![(n("attn_norm"), vec![e], w0)];
        match cfg.q_lora_rank {
            Some(lq) => wanted.extend([
                (n("attn_q_a"), vec![e, lq], w0),
                (n("attn_q_a_norm"), vec![lq], w0),
                (n("attn_q_b"), vec![lq, h * dk], w0),
            ]),
            None => wanted.push((n("attn_q"), vec![e, h * dk], wp)),
        }
        wanted.extend([
            (n("attn_kv_a_mqa"), vec![e, lkv + r], w0),
            (n("attn_kv_a_norm"), vec![lkv], w0),
        ]);
        match unsplit {
            true => wanted.push((n("attn_kv_b"), vec![lkv, h * (p + dv)], w0)),
            false => wanted.extend([
                (n("attn_k_b"), vec![p, lkv, h], ws),
                (n("attn_v_b"), vec![lkv, dv, h], ws),
            ]),
        }
        wanted.push((n("attn_output"), vec![h * dv, e], w0));
        // Every tensor at once (each also in parallel over its blocks: `dequant.rs`): one layer's load is
        // on the run loop's path (#39), and a tensor alone (the small ones, the norms) keeps few threads
        // busy. The values do not depend on the order; the error is the first tensor's in this order, as
        // when they were read one after another.
        let bufs: Vec<Vec<f32>> = wanted
            .iter()
            .map(|(_, ne, _)| {
                let n = ne.iter().product::<usize>();
                let i = spare.iter().position(|b| b.len() == n);
                i.map(|i| spare.swap_remove(i)).unwrap_or_default()
            })
            .collect();
        drop(spare);
        let loaded: Vec<Result<Vec<f32>>> = wanted
            .par_iter()
            .zip(bufs)
            .map(|((name, ne, why), buf)| load_checked_into(f, name, (ne, why), buf))
            .collect();
        let mut next = loaded.into_iter();
        let mut next = || next.next().expect("one per tensor wanted");
        let attn_norm = Array1::from(next()?);
        let q = match cfg.q_lora_rank {
            Some(lq) => QProj::Lora {
                a: mat(next()?, lq, e),
                a_norm: Array1::from(next()?),
                b: mat(next()?, h * dk, lq),
            },
            None => QProj::Plain {
                q: mat(next()?, h * dk, e),
            },
        };
        let kv_a = mat(next()?, lkv + r, e);
        let kv_a_norm = Array1::from(next()?);
        let (w_uk, w_uv, kv_b_layout) = if unsplit {
            // Legacy / MiniCPM3 / PLM: torch [H·(P+Dv), Lkv], each head [k_nope(P) | v(Dv)].
            let kv_b = Array3::from_shape_vec((h, p + dv, lkv), next()?).expect("shape checked");
            let uk = kv_b.slice(ndarray::s![.., ..p, ..]).to_owned();
            let uv = kv_b.slice(ndarray::s![.., p.., ..]).to_owned();
            (uk, uv, KvBLayout::Unsplit)
        } else {
            // attn_k_b: torch [H, Lkv, P] (transposed by the converter) -> W_UK [H, P, Lkv].
            let uk = transposed_heads(&next()?, (h, lkv, p));
            let uv = Array3::from_shape_vec((h, dv, lkv), next()?).expect("shape checked");
            (uk, uv, KvBLayout::Split)
        };
        let o = mat(next()?, e, h * dv);
        Ok(LayerWeights {
            layer,
            attn_norm,
            q,
            kv_a,
            kv_a_norm,
            w_uk,
            w_uv,
            o,
            kv_b_layout,
            stored: Default::default(),
            rounded: None,
            id: Default::default(),
        })
    }

    /// The buffers of the weights' values, for another layer's load to write over
    /// ([`LayerWeights::load_reusing`]); any rounded copy is dropped.
    pub fn into_buffers(self) -> Vec<Vec<f32>> {
        fn raw<D: Dimension>(a: ndarray::Array<f32, D>) -> Vec<f32> {
            let n = a.len();
            match a.into_raw_vec_and_offset() {
                (v, Some(0) | None) if v.len() == n => v,
                _ => Vec::new(), // a view into a larger buffer: not one tensor's
            }
        }
        let mut out = match self.q {
            QProj::Lora { a, a_norm, b } => vec![raw(a), raw(a_norm), raw(b)],
            QProj::Plain { q } => vec![raw(q)],
        };
        out.extend([raw(self.attn_norm), raw(self.kv_a), raw(self.kv_a_norm)]);
        out.extend([raw(self.w_uk), raw(self.w_uv), raw(self.o)]);
        out
    }

    /// The weights as an optimized path stores them in `dt`: each value rounded to the dtype (f32 holding
    /// it exactly; `self` for f32). Made once per layer, on first use, and shared by everything that
    /// reads the stored weights (the CPU mirror's shadow and free passes, the stage-local view): rounding
    /// a layer's hundreds of MB several times was a fifth of a run. Edit the weights (tests do) before
    /// the first call, never after.
    pub fn stored(&self, dt: Dtype) -> &LayerWeights {
        let Some(slot) = self.stored_slot(dt) else {
            return self;
        };
        slot.get_or_init(|| {
            let q = match &self.q {
                QProj::Lora { a, a_norm, b } => QProj::Lora {
                    a: rounded(a, dt),
                    a_norm: rounded(a_norm, dt),
                    b: rounded(b, dt),
                },
                QProj::Plain { q } => QProj::Plain { q: rounded(q, dt) },
            };
            Box::new(LayerWeights {
                layer: self.layer,
                attn_norm: rounded(&self.attn_norm, dt),
                q,
                kv_a: rounded(&self.kv_a, dt),
                kv_a_norm: rounded(&self.kv_a_norm, dt),
                w_uk: rounded(&self.w_uk, dt),
                w_uv: rounded(&self.w_uv, dt),
                o: rounded(&self.o, dt),
                kv_b_layout: self.kv_b_layout,
                stored: Default::default(),
                rounded: None,
                id: Default::default(),
            })
        })
    }

    /// Round every value to `dt` in place, so that these weights are their own stored copy
    /// ([`LayerWeights::stored`] then returns `self`) and no second copy of the layer is made: for a
    /// layer whose fp64 reference has read the file's values already and whose later readers all read
    /// the stored ones (`run::footprint`: GLM-5's covering layers, 0.63 GB at bf16). Each value is
    /// what [`LayerWeights::stored`] would have made of it (the same rounding, element for element).
    /// The file's values are gone: the reference refuses these weights, and so does `stored` for
    /// another dtype. For f32 nothing changes.
    pub fn round_in_place(&mut self, dt: Dtype) {
        assert!(
            self.stored_made(dt).is_none_or(|s| std::ptr::eq(s, self)),
            "layer {}: a rounded copy exists already",
            self.layer
        );
        if dt == Dtype::F32 || self.rounded == Some(dt) {
            return;
        }
        assert!(self.rounded.is_none(), "weights rounded twice");
        match &mut self.q {
            QProj::Lora { a, a_norm, b } => {
                round_in(a, dt);
                round_in(a_norm, dt);
                round_in(b, dt);
            }
            QProj::Plain { q } => round_in(q, dt),
        }
        round_in(&mut self.attn_norm, dt);
        round_in(&mut self.kv_a, dt);
        round_in(&mut self.kv_a_norm, dt);
        round_in(&mut self.w_uk, dt);
        round_in(&mut self.w_uv, dt);
        round_in(&mut self.o, dt);
        self.rounded = Some(dt);
    }

    /// Whether these are the file's values (not [`LayerWeights::round_in_place`]d).
    pub fn as_read(&self) -> bool {
        self.rounded.is_none()
    }

    /// Which weights these are, for a backend that keeps what it made of them (the CUDA backend's
    /// uploaded copy, shared by a layer's shadow, free and repeated passes). Edit the weights before a
    /// pass, never after, as for [`LayerWeights::stored`].
    pub fn id(&self) -> u64 {
        self.id.0
    }

    /// [`LayerWeights::stored`] if it was made already (`self` for f32), without making it.
    pub fn stored_made(&self, dt: Dtype) -> Option<&LayerWeights> {
        match self.stored_slot(dt) {
            None => Some(self),
            Some(slot) => slot.get().map(|b| &**b),
        }
    }

    /// The rounded copy's slot for `dt` (none for f32: nothing to round).
    fn stored_slot(&self, dt: Dtype) -> Option<&OnceLock<Box<LayerWeights>>> {
        if let Some(r) = self.rounded {
            // Rounded in place: their own stored copy in that dtype, and nothing else's.
            assert!(
                r == dt,
                "layer {}: weights rounded to {} in place, asked for {}",
                self.layer,
                r.name(),
                dt.name()
            );
            return None;
        }
        match dt {
            Dtype::F32 => None,
            Dtype::Bf16 => Some(&self.stored[0]),
            Dtype::F16 => Some(&self.stored[1]),
        }
    }
}

/// A standard-layout copy of `a` with every value rounded to `dt` (in parallel: it is memory-bound).
fn rounded<D: Dimension>(a: &ndarray::Array<f32, D>, dt: Dtype) -> ndarray::Array<f32, D> {
    let mut out = a.as_standard_layout().into_owned();
    round_in(&mut out, dt);
    out
}

/// `a` rounded to `dt` in place, in standard layout (what [`rounded`] returns a copy of).
fn round_in<D: Dimension>(a: &mut ndarray::Array<f32, D>, dt: Dtype) {
    if !a.is_standard_layout() {
        *a = a.as_standard_layout().into_owned();
    }
    let v = a.as_slice_mut().expect("standard layout");
    v.par_chunks_mut(1 << 16).for_each(|c| dt.round_slice(c));
}

/// `[H, A, B]` values (row-major) as the `[H, B, A]` array of each head's transpose, heads in parallel
/// (the permuted copy one thread made was tens of ms of a GLM-5 layer's load).
fn transposed_heads(v: &[f32], (h, a, b): (usize, usize, usize)) -> Array3<f32> {
    assert_eq!(v.len(), h * a * b, "shape checked");
    let mut out = vec![0f32; v.len()];
    if !out.is_empty() {
        out.par_chunks_mut(a * b)
            .zip(v.par_chunks(a * b))
            .for_each(|(o, i)| {
                for (x, row) in i.chunks_exact(b).enumerate() {
                    for (y, &val) in row.iter().enumerate() {
                        o[y * a + x] = val;
                    }
                }
            });
    }
    Array3::from_shape_vec((h, b, a), out).expect("sized above")
}

/// LongRoPE / rope frequency factors, if the file has them.
pub fn load_freq_factors(f: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    load_checked(f, name, &[n], "rope frequency factors")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::catalogue::Preset;

    /// Every value of `w`, as bits, in one order.
    fn bits(w: &LayerWeights) -> Vec<u32> {
        let q: Vec<&[f32]> = match &w.q {
            QProj::Lora { a, a_norm, b } => vec![
                a.as_slice().unwrap(),
                a_norm.as_slice().unwrap(),
                b.as_slice().unwrap(),
            ],
            QProj::Plain { q } => vec![q.as_slice().unwrap()],
        };
        q.into_iter()
            .chain([
                w.attn_norm.as_slice().unwrap(),
                w.kv_a.as_slice().unwrap(),
                w.kv_a_norm.as_slice().unwrap(),
                w.w_uk.as_slice().unwrap(),
                w.w_uv.as_slice().unwrap(),
                w.o.as_slice().unwrap(),
            ])
            .flatten()
            .map(|v| v.to_bits())
            .collect()
    }

    /// Rounded in place, the weights hold what `stored` makes of them, bit for bit, and are their own
    /// stored copy (no second one made); they are no longer the file's values.
    #[test]
    fn rounded_in_place_is_the_stored_copy() {
        for preset in [Preset::Tiny, Preset::Glm5] {
            let cfg = preset.test_config();
            for dt in [Dtype::Bf16, Dtype::F16] {
                let read = crate::model::synthetic::weights(&cfg, 7);
                let mut w = crate::model::synthetic::weights(&cfg, 7);
                w.round_in_place(dt);
                assert_eq!(bits(&w), bits(read.stored(dt)), "{preset:?} {}", dt.name());
                assert_ne!(bits(&w), bits(&read), "the rounding changed nothing");
                assert!(std::ptr::eq(w.stored(dt), &w));
                assert!(std::ptr::eq(w.stored_made(dt).unwrap(), &w));
                assert!(!w.as_read() && read.as_read());
            }
            // f32: nothing to round, still the file's values.
            let mut w = crate::model::synthetic::weights(&cfg, 7);
            w.round_in_place(Dtype::F32);
            assert!(w.as_read());
        }
    }

    /// A layer loaded over another layer's buffers holds what a fresh load gives it, bit for bit, in
    /// those buffers (the block-quantized tensors').
    #[test]
    fn loaded_over_another_layers_buffers_is_a_fresh_load() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/deepseek-v3-yarn-q4_k.gguf");
        let f = GgufFile::open(&path).unwrap();
        let cfg = MlaConfig::from_gguf(&f).unwrap();
        assert!(cfg.n_layer >= 2);
        let fresh = LayerWeights::load(&f, &cfg, 1).unwrap();
        let before = LayerWeights::load(&f, &cfg, 0).unwrap();
        assert_ne!(
            bits(&before),
            bits(&fresh),
            "two layers alike prove nothing"
        );
        let spare = before.into_buffers();
        let old: Vec<*const f32> = spare.iter().map(|b| b.as_ptr()).collect();
        let reused = LayerWeights::load_reusing(&f, &cfg, 1, spare).unwrap();
        assert_eq!(bits(&reused), bits(&fresh));
        // Block-quantized here (Q4_K): each written over one of layer 0's buffers of its length.
        for p in [reused.o.as_ptr(), reused.kv_a.as_ptr()] {
            assert!(old.contains(&p), "a fresh buffer");
        }
    }

    /// Each head's transpose, heads in parallel, is the permuted copy the loader made before.
    #[test]
    fn transposed_heads_is_the_permuted_copy() {
        for (h, a, b) in [(3, 5, 7), (1, 1, 4), (4, 16, 1), (0, 2, 3)] {
            let v: Vec<f32> = (0..h * a * b).map(|i| i as f32 * 0.5 - 3.0).collect();
            let want = Array3::from_shape_vec((h, a, b), v.clone())
                .unwrap()
                .permuted_axes([0, 2, 1])
                .as_standard_layout()
                .into_owned();
            assert_eq!(transposed_heads(&v, (h, a, b)), want, "{h}x{a}x{b}");
        }
    }

    /// Weights rounded to one dtype are no stored copy in another.
    #[test]
    #[should_panic(expected = "rounded to bf16 in place, asked for fp16")]
    fn rounded_weights_refuse_another_dtype() {
        let mut w = crate::model::synthetic::weights(&Preset::Tiny.test_config(), 7);
        w.round_in_place(Dtype::Bf16);
        w.stored(Dtype::F16);
    }

    /// The reference is of the file's values: it refuses weights rounded in place.
    #[test]
    #[should_panic(expected = "the reference of rounded weights")]
    fn the_reference_refuses_rounded_weights() {
        let cfg = Preset::Tiny.test_config();
        let mut w = crate::model::synthetic::weights(&cfg, 7);
        w.round_in_place(Dtype::Bf16);
        let sched = crate::schedule::Schedule::default();
        let t = sched.total_tokens();
        let rope = crate::rope::RopeTables::for_run(&cfg, None, sched.pos_offset, t).unwrap();
        let x = ndarray::Array2::<f64>::zeros((t, cfg.hidden));
        let _ = crate::reference::run_layer(&cfg, &w, &rope, &x, &sched);
    }
}
