//! f64 matrix products for the reference and the stage-local view, through the `gemm` crate (already in
//! the build through candle): it dispatches at run time to AVX-512 kernels where the CPU has them and
//! spreads one product over rayon's threads, where `ndarray`'s matrixmultiply stops at AVX2 and four
//! threads. Measured on this project's 2-core AVX-512 machine: 1.6–2.5× the f64 GEMM throughput at the
//! shapes of a layer's projections (64–395 rows × 6144–16384 × 1024–2048).

use ndarray::{Array2, ArrayView2};

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
