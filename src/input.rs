//! Layer inputs `[T, hidden]` (before attn_norm) for the T positions of a run, from one of three sources:
//! token ids through `token_embd`, seeded random hidden states shaped like real ones, or activations
//! captured from a serving engine in a `.npy` file.

use crate::error::{Error, Result};
use crate::gguf::{dequantize_rows, GgufFile};
use crate::model::MlaConfig;
use ndarray::{s, Array2, Array3, ArrayD, Ix2, Ix3};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use std::path::Path;

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
        }
    }
}

fn read_any(path: &Path) -> Result<ArrayD<f64>> {
    use ndarray_npy::{read_npy, ReadNpyError};
    let shown = path.display();
    let err = |e: ReadNpyError| match e {
        ReadNpyError::Io(e) => Error::io(format!("reading {shown}"), e),
        e => Error::Usage(format!("{shown}: not a readable .npy array: {e}")),
    };
    match read_npy::<_, ArrayD<f32>>(path) {
        Ok(a) => Ok(a.mapv(f64::from)),
        Err(ReadNpyError::WrongDescriptor(_)) => match read_npy::<_, ArrayD<f64>>(path) {
            Ok(a) => Ok(a),
            Err(ReadNpyError::WrongDescriptor(d)) => Err(Error::Usage(format!(
                "{shown}: element type {d} is not supported; save the activations as float32 or float64"
            ))),
            Err(e) => Err(err(e)),
        },
        Err(e) => Err(err(e)),
    }
}

/// Captured activations: `[T, hidden]` (every layer) or `[layers, T, hidden]`, f32 or f64.
pub fn load_npy(path: &Path, hidden: usize, n_tokens: usize) -> Result<LayerInputs> {
    let a = read_any(path)?;
    let shown = path.display();
    let shape = a.shape().to_vec();
    let fits = |t: usize, e: usize| t == n_tokens && e == hidden;
    let out = match *shape.as_slice() {
        [t, e] if fits(t, e) => LayerInputs::Shared(a.into_dimensionality::<Ix2>().expect("2-D")),
        [_, t, e] if fits(t, e) => {
            LayerInputs::PerLayer(a.into_dimensionality::<Ix3>().expect("3-D"))
        }
        _ => {
            return Err(Error::Usage(format!(
                "{shown}: shape {shape:?} does not fit: expected [{n_tokens}, {hidden}] (tokens, hidden) or [layers, {n_tokens}, {hidden}]"
            )))
        }
    };
    let finite = match &out {
        LayerInputs::Shared(x) => x.iter().all(|v| v.is_finite()),
        LayerInputs::PerLayer(x) => x.iter().all(|v| v.is_finite()),
    };
    if !finite {
        return Err(Error::Usage(format!(
            "{shown}: the activations hold NaN or infinite values"
        )));
    }
    Ok(out)
}
