//! Layer inputs `[T, hidden]` (before attn_norm) for the T positions of a run, from one of three sources:
//! token ids through `token_embd`, seeded random hidden states shaped like real ones, or activations
//! captured from a serving engine in a `.npy` file.

use crate::error::{Error, Result};
use crate::gguf::{dequantize_rows, GgufFile};
use crate::model::MlaConfig;
use ndarray::{s, Array2, Array3, Ix2, Ix3};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use std::path::Path;

pub mod npy;

/// The embeddings of `ids` (`[T, hidden]`); only those rows of `token_embd.weight` are read.
pub fn from_token_ids(f: &GgufFile, cfg: &MlaConfig, ids: &[u32]) -> Result<Array2<f64>> {
    let name = "token_embd.weight";
    let t = f.tensor(name).ok_or_else(|| {
        Error::Tensor(format!(
            "{}: {name} is missing, so token ids cannot be embedded (use random or .npy inputs)",
            f.path.display()
        ))
    })?;
    if t.ne.len() != 2 || t.ne[0] as usize != cfg.hidden {
        return Err(Error::Tensor(format!(
            "{}: {name} has shape (ne) {:?}, expected {{{}, vocab}}",
            f.path.display(),
            t.ne,
            cfg.hidden
        )));
    }
    let vocab = t.ne[1] as usize;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::Usage(format!(
            "token id {bad} is out of range: the vocabulary has {vocab} tokens (0..{vocab})"
        )));
    }
    let rows: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
    let v = dequantize_rows(f, t, &rows)?;
    Ok(Array2::from_shape_vec((ids.len(), cfg.hidden), v)
        .expect("rows × hidden")
        .mapv(f64::from))
}

/// Seeded random hidden states with the structure of real residual streams: N(0,1) per element times a
/// per-channel scale (log-normal, spread ~e^±0.5), plus a few outlier channels ×30..×100 ("massive
/// activations"). Outliers are what break low-precision kernels, so the input must have them.
pub fn random_hidden(hidden: usize, n_tokens: usize, seed: u64) -> Array2<f64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut scale: Vec<f64> = (0..hidden)
        .map(|_| {
            let z: f64 = StandardNormal.sample(&mut rng);
            (0.5 * z).exp()
        })
        .collect();
    let n_outliers = (hidden / 1024).clamp(2, 6).min(hidden);
    for _ in 0..n_outliers {
        let c = rng.random_range(0..hidden);
        scale[c] = rng.random_range(30.0..100.0);
    }
    Array2::from_shape_fn((n_tokens, hidden), |(_, c)| {
        let z: f64 = StandardNormal.sample(&mut rng);
        z * scale[c]
    })
}

/// Inputs read from a file: one `[T, hidden]` for every layer, or one per layer.
#[derive(Debug, Clone)]
pub enum LayerInputs {
    Shared(Array2<f64>),
    /// `[layers, T, hidden]`
    PerLayer(Array3<f64>),
    /// A capture's layer inputs (`x`), by layer: both streams restart from them at every layer
    /// (`crate::capture`).
    Captured(std::sync::Arc<std::collections::BTreeMap<usize, Array2<f64>>>),
}

impl LayerInputs {
    /// The input of `layer`.
    pub fn layer(&self, layer: usize) -> Result<Array2<f64>> {
        match self {
            LayerInputs::Shared(x) => Ok(x.clone()),
            LayerInputs::PerLayer(x) if layer < x.dim().0 => {
                Ok(x.slice(s![layer, .., ..]).to_owned())
            }
            LayerInputs::PerLayer(x) => Err(Error::Usage(format!(
                "the .npy inputs hold {} layers; layer {layer} has none",
                x.dim().0
            ))),
            LayerInputs::Captured(m) => m
                .get(&layer)
                .cloned()
                .ok_or_else(|| Error::Usage(format!("the capture has no x for layer {layer}"))),
        }
    }
}

/// Captured activations: `[T, hidden]` (every layer) or `[layers, T, hidden]`; float16/32/64 in either
/// byte order, C or Fortran order (see `npy`).
pub fn load_npy(path: &Path, hidden: usize, n_tokens: usize) -> Result<LayerInputs> {
    let h = npy::read_header(path)?;
    let shown = path.display();
    let fits = |t: usize, e: usize| t == n_tokens && e == hidden;
    // The shape is checked before the data is read (and read_data checks it against the file size).
    match *h.shape.as_slice() {
        [t, e] | [_, t, e] if fits(t, e) => {}
        _ => {
            return Err(Error::Usage(format!(
                "{shown}: shape {:?} does not fit: expected [{n_tokens}, {hidden}] (tokens, hidden) or [layers, {n_tokens}, {hidden}]",
                h.shape
            )))
        }
    }
    let a = npy::read_data(path, &h)?;
    if !a.iter().all(|v| v.is_finite()) {
        return Err(Error::Usage(format!(
            "{shown}: the activations hold NaN or infinite values"
        )));
    }
    let bad_dim = |e: ndarray::ShapeError| Error::Usage(format!("{shown}: {e}"));
    Ok(match h.shape.len() {
        2 => LayerInputs::Shared(a.into_dimensionality::<Ix2>().map_err(bad_dim)?),
        _ => LayerInputs::PerLayer(a.into_dimensionality::<Ix3>().map_err(bad_dim)?),
    })
}

/// The number of dimensions of a `.npy` file (header only): 3 means per-layer captures.
pub fn npy_ndim(path: &Path) -> Result<usize> {
    Ok(npy::read_header(path)?.shape.len())
}
