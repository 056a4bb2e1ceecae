//! f64 matrix products for the reference and the stage-local view. On the host through the `gemm`
//! crate (already in the build through candle): it dispatches at run time to AVX-512 kernels where the
//! CPU has them and spreads one product over rayon's threads, where `ndarray`'s matrixmultiply stops at
//! AVX2 and four threads. Measured on this project's 2-core AVX-512 machine: 1.6–2.5× the f64 GEMM
//! throughput at the shapes of a layer's projections (64–395 rows × 6144–16384 × 1024–2048).
//!
//! A run with a GPU installs a device [`Engine`] (cuBLAS DGEMM, `backend::cuda::dgemm`): the products
//! against a layer's weights ([`linear_f32`]) are then the bulk of the host's fp64 work moved to the
//! GPU, still fp64, the weights widened exactly as here.

use crate::error::{Error, Result};
use crate::precision::Dtype;
use ndarray::{s, Array2, ArrayView2};
use std::sync::{Mutex, OnceLock};

/// `a · bᵀ` for `a [m, k]` and `b [n, k]` of any strides (a projection `x · Wᵀ` with torch-orientation
/// weights). Sums are f64 in the library's order (not a sequential sum's: within a few ulps of it).
pub fn mat_mul_t(a: ArrayView2<f64>, b: ArrayView2<f64>) -> Array2<f64> {
    let (m, k) = a.dim();
    let (n, kb) = b.dim();
    assert_eq!(k, kb, "inner dimensions");
    let mut y = Array2::<f64>::zeros((m, n));
    if m == 0 || n == 0 || k == 0 {
        return y;
    }
    let (a_rs, a_cs) = (a.strides()[0], a.strides()[1]);
    let (b_rs, b_cs) = (b.strides()[0], b.strides()[1]);
    // SAFETY: every pointer addresses a live array of the dims and strides given (in elements); `y` is
    // standard layout `[m, n]`, written only (alpha 0: never read), and borrowed mutably here alone.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs,
            a_rs,
            // rhs[kk, j] = b[j, kk]
            b.as_ptr(),
            b_rs,
            b_cs,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    y
}

/// `y = a·wᵀ` and, given `sq_in`, `sq = sq_in·(w∘w)ᵀ` (the stage-local view's variance product), for a
/// torch-orientation f32 weight `w [n, k]` widened to f64 exactly, after rounding to `round` if given.
pub struct Linear {
    pub y: Array2<f64>,
    pub sq: Option<Array2<f64>>,
}

/// Where [`linear_f32`]'s products run when not on the host.
pub trait Engine: Send + Sync {
    /// Said in the report's environment.
    fn name(&self) -> String;
    fn linear(
        &self,
        a: ArrayView2<f64>,
        sq_in: Option<ArrayView2<f64>>,
        w: ArrayView2<f32>,
        round: Option<Dtype>,
    ) -> Result<Linear>;
}

static ENGINE: OnceLock<Box<dyn Engine>> = OnceLock::new();
/// The engine's first error: later products run on the host, and the run stops at its next check.
static FAILED: Mutex<Option<String>> = Mutex::new(None);

/// Send the process's [`linear_f32`] products to `e` (the first install wins: one GPU per process).
pub fn install(e: Box<dyn Engine>) {
    let _ = ENGINE.set(e);
}

/// The installed engine's name, `None` on the host.
pub fn engine() -> Option<String> {
    ENGINE.get().map(|e| e.name())
}

/// The engine's failure, if any (a panicked holder leaves it readable).
fn failed() -> std::sync::MutexGuard<'static, Option<String>> {
    FAILED.lock().unwrap_or_else(|p| p.into_inner())
}

/// `Err` once the installed engine has failed (a device error): the products since were the host's,
/// so the run is not what it says it is.
pub fn check_engine() -> Result<()> {
    match failed().as_ref() {
        Some(e) => Err(Error::Environment(format!(
            "the fp64 products on the GPU failed: {e}"
        ))),
        None => Ok(()),
    }
}

/// [`Linear`] through the installed engine, or on the host (also once the engine has failed).
pub fn linear_f32(
    a: ArrayView2<f64>,
    sq_in: Option<ArrayView2<f64>>,
    w: ArrayView2<f32>,
    round: Option<Dtype>,
) -> Linear {
    if let Some(e) = ENGINE.get().filter(|_| failed().is_none()) {
        match e.linear(a, sq_in, w, round) {
            Ok(l) => return l,
            Err(err) => {
                failed().get_or_insert(err.to_string());
            }
        }
    }
    linear_f32_host(a, sq_in, w, round)
}

/// Bytes of f64 weight rows widened at a time on the host: large enough for an efficient GEMM, small
/// enough that no f64 copy of a whole weight is ever made (memory and page faults dominate otherwise).
pub(crate) const BLOCK_BYTES: usize = 16 << 20;

/// [`linear_f32`] on the host: `w` rounded and widened a block of rows at a time, the blocks in
/// parallel (each output column is the same dot product whichever block holds it).
pub fn linear_f32_host(
    a: ArrayView2<f64>,
    sq_in: Option<ArrayView2<f64>>,
    w: ArrayView2<f32>,
    round: Option<Dtype>,
) -> Linear {
    use rayon::prelude::*;
    let (n_out, n_in) = w.dim();
    let rows = (BLOCK_BYTES / 8 / n_in.max(1)).clamp(1, n_out.max(1));
    let blocks: Vec<_> = (0..n_out)
        .step_by(rows)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|r0| {
            let r1 = (r0 + rows).min(n_out);
            let mut b32 = w.slice(s![r0..r1, ..]).as_standard_layout().into_owned();
            if let Some(dt) = round {
                dt.round_slice(b32.as_slice_mut().expect("standard layout"));
            }
            let b = b32.mapv(|v| v as f64);
            let y = mat_mul_t(a, b.view());
            let sq = sq_in.map(|s| mat_mul_t(s, b.mapv(|v| v * v).view()));
            (r0..r1, y, sq)
        })
        .collect();
    let mut y = Array2::zeros((a.nrows(), n_out));
    let mut sq = sq_in.map(|s| Array2::zeros((s.nrows(), n_out)));
    for (r, yb, sb) in blocks {
        y.slice_mut(s![.., r.clone()]).assign(&yb);
        if let (Some(sq), Some(sb)) = (sq.as_mut(), sb) {
            sq.slice_mut(s![.., r]).assign(&sb);
        }
    }
    Linear { y, sq }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::s;

    /// Against ndarray's product, on standard, transposed and sliced operands, and empty ones.
    #[test]
    fn is_the_product() {
        let a = Array2::from_shape_fn((37, 300), |(i, j)| ((i * 7 + j * 13) % 17) as f64 - 8.0);
        let b = Array2::from_shape_fn((300, 53), |(i, j)| ((i * 5 + j * 3) % 11) as f64 - 5.0);
        let want = a.dot(&b);
        // Integers: every product and sum exact, so equal whatever the order.
        assert_eq!(mat_mul_t(a.view(), b.t()), want);
        let bt = b.t().as_standard_layout().to_owned();
        assert_eq!(mat_mul_t(a.view(), bt.view()), want);
        let sub = mat_mul_t(a.slice(s![1..30;2, ..]), bt.slice(s![5.., ..]));
        assert_eq!(sub, a.slice(s![1..30;2, ..]).dot(&b.slice(s![.., 5..])));
        assert_eq!(mat_mul_t(a.slice(s![..0, ..]), bt.view()).dim(), (0, 53));
        let z = mat_mul_t(a.slice(s![.., ..0]), bt.slice(s![.., ..0]));
        assert!(z.iter().all(|&v| v == 0.0) && z.dim() == (37, 53));
    }
}
