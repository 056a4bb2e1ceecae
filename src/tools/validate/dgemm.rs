//! `gpu-validate`'s check of the fp64 engine a CUDA run installs (`backend::cuda::dgemm`) against the
//! host's products.

use crate::backend::cuda::dgemm::DeviceProducts;
use crate::error::Result;
use crate::linalg::Engine;
use crate::precision::Dtype;
use ndarray::Array2;

/// `gpu-validate`'s check of the engine: its products against the host's at a layer's shapes (GLM-5's
/// projections at 64 tokens, DeepSeek-V3's q_a at the default schedule, the local view's rounded weights
/// with their squares), each element within `1e-12` of the sum of absolute products (`|a|·|w|ᵀ`: the
/// scale of a GEMM's rounding error; fp64 summed in two orders differs by ~1e-16 of it). Returns the
/// report lines and the failures.
pub fn validate() -> Result<(Vec<String>, Vec<String>)> {
    use rand::{Rng, SeedableRng};
    let e = DeviceProducts::new()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let mut lines = vec![format!(
        "fp64 products: {} vs the host (gemm crate)",
        e.name()
    )];
    let mut failures = Vec::new();
    // (what, rows, k, n, squares, round)
    let shapes = [
        ("GLM-5 q_a, 64 tokens", 64, 6144, 2048, false, None),
        (
            "GLM-5 q_b, 64 tokens, bf16 + squares",
            64,
            2048,
            16384,
            true,
            Some(Dtype::Bf16),
        ),
        (
            "GLM-5 o_proj, 64 tokens, bf16 + squares",
            64,
            16384,
            6144,
            true,
            Some(Dtype::Bf16),
        ),
        (
            "DeepSeek-V3 q_a, 395 tokens, fp16 + squares",
            395,
            7168,
            1536,
            true,
            Some(Dtype::F16),
        ),
    ];
    for (what, m, k, n, squares, round) in shapes {
        let a = Array2::from_shape_fn((m, k), |_| rng.random_range(-3.0..3.0));
        let w = Array2::from_shape_fn((n, k), |_| rng.random_range(-0.05f32..0.05));
        let sq_in = squares.then(|| a.mapv(|v| v * v));
        let t = std::time::Instant::now();
        let host = crate::linalg::linear_f32_host(
            a.view(),
            sq_in.as_ref().map(|s| s.view()),
            w.view(),
            round,
        );
        let host_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let dev = e.linear(a.view(), sq_in.as_ref().map(|s| s.view()), w.view(), round)?;
        let dev_s = t.elapsed().as_secs_f64();
        let wa = w.mapv(|v| round.map_or(v, |d| d.round(v)).abs() as f64);
        let scale = crate::linalg::mat_mul_t(a.mapv(f64::abs).view(), wa.view());
        let worst = |x: &Array2<f64>, y: &Array2<f64>, s: &Array2<f64>| {
            ndarray::Zip::from(x)
                .and(y)
                .and(s)
                .fold(0f64, |m, &p, &q, &s| {
                    let r = (p - q).abs() / s.max(f64::MIN_POSITIVE);
                    if r.is_nan() {
                        f64::INFINITY
                    } else {
                        m.max(r)
                    }
                })
        };
        let mut err = worst(&host.y, &dev.y, &scale);
        if let (Some(hs), Some(ds)) = (&host.sq, &dev.sq) {
            // Every term of the squares' product is non-negative: it is its own scale.
            err = err.max(worst(hs, ds, hs));
        }
        let gflop = 2.0 * (m * k * n) as f64 * if squares { 2.0 } else { 1.0 } / 1e9;
        let ok = err <= 1e-12;
        lines.push(format!(
            "   {:<46} [{m}, {k}] x [{n}, {k}]T: worst |diff| / (|a||w|) {err:.1e} {}  host {:.1} ms, GPU {:.1} ms (with copies; {gflop:.1} GFLOP)",
            what,
            if ok { "OK" } else { "FAIL (> 1e-12)" },
            host_s * 1e3,
            dev_s * 1e3
        ));
        if !ok {
            failures.push(format!("fp64 products {what}: {err:.1e} > 1e-12"));
        }
    }
    Ok((lines, failures))
}
