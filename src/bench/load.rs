//! `mla-diff bench load FILE`: the floor under a whole-file run's time (#39). A run reads every layer's
//! attention tensors from the file and dequantizes them to f32 (`LayerWeights::load`); it cannot finish
//! faster than that work spread over all cores. Two passes, both over every layer, layers in parallel:
//! reading each tensor's bytes (the file's pages, from the page cache or the disk), then loading the
//! layer's weights as `run` does. Nothing is judged.

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::{weights::tensor_names, LayerWeights, MlaConfig, QProj};
use crate::run::profile::cpu_time;
use rayon::prelude::*;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct LoadFloor {
    pub file: String,
    pub layers: usize,
    pub threads: usize,
    /// Bytes of the layers' attention tensors as stored.
    pub tensor_bytes: u64,
    /// Wall seconds to read those bytes, and the rate.
    pub read_s: f64,
    pub read_gb_s: f64,
    /// Wall and CPU seconds (user + system, all threads) to load every layer's weights as `run` does.
    pub load_s: f64,
    pub load_cpu_s: f64,
    /// f32 bytes the loads produced.
    pub f32_bytes: u64,
}

/// Measure both passes on `path`.
pub fn measure(path: &Path) -> Result<LoadFloor> {
    let file = GgufFile::open(path)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let layers: Vec<usize> = (0..cfg.n_layer).collect();
    let t0 = Instant::now();
    let tensor_bytes = layers
        .par_iter()
        .map(|&l| {
            let mut n = 0u64;
            for t in tensor_names(l).iter().filter_map(|s| file.tensor(s)) {
                let b = file.tensor_bytes(t)?;
                // One byte of each page, so that every page is read; the sum keeps it from being elided.
                std::hint::black_box(b.iter().step_by(4096).map(|&x| x as u64).sum::<u64>());
                n += b.len() as u64;
            }
            Ok(n)
        })
        .sum::<Result<u64>>()?;
    let read_s = t0.elapsed().as_secs_f64();
    let (t1, c1) = (Instant::now(), cpu_time());
    let f32_bytes = layers
        .par_iter()
        .map(|&l| {
            let w = LayerWeights::load(&file, &cfg, l)?;
            let n = f32_bytes(&w);
            drop(w);
            file.release(tensor_names(l).iter().filter_map(|s| file.tensor(s)));
            Ok(n)
        })
        .sum::<Result<u64>>()?;
    let load_s = t1.elapsed().as_secs_f64();
    Ok(LoadFloor {
        file: path.display().to_string(),
        layers: cfg.n_layer,
        threads: rayon::current_num_threads(),
        tensor_bytes,
        read_s,
        read_gb_s: tensor_bytes as f64 / read_s.max(1e-9) / 1e9,
        load_s,
        load_cpu_s: (cpu_time() - c1).as_secs_f64(),
        f32_bytes,
    })
}

/// The bytes of a layer's f32 weights.
fn f32_bytes(w: &LayerWeights) -> u64 {
    let q = match &w.q {
        QProj::Lora { a, a_norm, b } => a.len() + a_norm.len() + b.len(),
        QProj::Plain { q } => q.len(),
    };
    let n = w.attn_norm.len() + q + w.kv_a.len() + w.kv_a_norm.len() + w.w_uk.len() + w.w_uv.len();
    4 * (n + w.o.len()) as u64
}

impl LoadFloor {
    pub fn text(&self) -> String {
        format!(
            "{}: {} layers, {:.2} GB of attention tensors, {} threads\n  read:              {:.2} s ({:.2} GB/s)\n  load + dequantize: {:.2} s wall, {:.1} CPU s ({:.2} GB of f32)\n",
            self.file,
            self.layers,
            self.tensor_bytes as f64 / 1e9,
            self.threads,
            self.read_s,
            self.read_gb_s,
            self.load_s,
            self.load_cpu_s,
            self.f32_bytes as f64 / 1e9
        )
    }
}
