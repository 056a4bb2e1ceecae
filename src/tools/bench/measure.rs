//! Timing and checking on the device: CUDA-event timing, the random filler, rel-L2 of raw 16-bit
//! outputs, and runner tensors from them.

use crate::backend::cuda::device::{arg, DevBuf, Timer};
use crate::backend::cuda::kernels::{launch, Kernels};
use crate::backend::runner::tensors::Named;
use crate::error::Result;
use crate::precision::Dtype;
use crate::tiles::Dims;

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Time `f` (`warm` untimed runs, then `iters` samples of `launches` back-to-back runs between two
/// events, each divided by `launches`); returns (median, min) in µs per run. One launch per sample counts
/// the host's dispatch latency into the time; several keep the GPU's queue fed, as a graph replay would.
pub(super) fn time_us(
    warm: usize,
    iters: usize,
    launches: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..warm {
        f()?;
    }
    let t = Timer::new()?;
    let n = launches.max(1);
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        t.start()?;
        for _ in 0..n {
            f()?;
        }
        v.push(t.stop_ms()? as f64 * 1e3 / n as f64);
    }
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    Ok((median(v), min))
}

#[derive(Clone)]
pub(super) struct Filler {
    f: cudarc::driver::sys::CUfunction,
    _m: std::rc::Rc<crate::backend::cuda::kernels::Module>,
}

impl Filler {
    pub(super) fn new(k: &mut Kernels, dims: &Dims) -> Result<Filler> {
        let m = k.module("fill.cu", dims.defines())?;
        Ok(Filler {
            f: m.func("fill_normal")?,
            _m: m,
        })
    }
    pub(super) fn fill(&self, b: &DevBuf, n: usize, seed: u32, scale: f32) -> Result<()> {
        let n = n as i64;
        launch(
            self.f,
            "fill_normal",
            (1024, 1, 1),
            256,
            0,
            &mut [arg(&b.ptr), arg(&n), arg(&seed), arg(&scale)],
        )
    }
}

/// A 16-bit storage value (bf16 or fp16 bit pattern) as f64.
pub fn bits_to_f64(x: u16, dt: Dtype) -> f64 {
    match dt {
        Dtype::F16 => half::f16::from_bits(x).to_f64(),
        _ => half::bf16::from_bits(x).to_f64(),
    }
}

/// rel-L2 of `a` against `b` (both 16-bit bit patterns of `dt`) and the count of non-finite values in
/// either; a non-finite value is never a match.
pub(super) fn rel_l2(a: &[u16], b: &[u16], dt: Dtype) -> (f64, usize) {
    let (mut num, mut den, mut bad) = (0.0, 0.0, 0);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (bits_to_f64(x, dt), bits_to_f64(y, dt));
        if !x.is_finite() || !y.is_finite() {
            bad += 1;
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    ((num / den.max(1e-300)).sqrt(), bad)
}

/// rel-L2 of `a` against `b` (16-bit bit patterns of `dt`) and the count of non-finite values in
/// either (never a match).
pub(super) fn rel_l2_vs_bits(a: &[f64], b: &[u16], dt: Dtype) -> (f64, usize) {
    let (mut num, mut den, mut bad) = (0.0, 0.0, 0);
    for (&x, &y) in a.iter().zip(b) {
        let y = bits_to_f64(y, dt);
        if !x.is_finite() || !y.is_finite() {
            bad += 1;
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    ((num / den.max(1e-300)).sqrt(), bad)
}

/// A device buffer read back as a runner input of the storage type (the bits as they are).
pub(super) fn bits(name: &'static str, shape: Vec<usize>, v: &[u16], dt: Dtype) -> Named {
    use safetensors::tensor::Dtype as St;
    Named {
        name,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        dtype: if dt == Dtype::F16 { St::F16 } else { St::BF16 },
    }
}
