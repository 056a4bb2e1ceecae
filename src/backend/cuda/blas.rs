//! cuBLAS: every projection is a GEMM with f32 accumulation and storage-type output.

use crate::error::{Error, Result};
use crate::precision::Dtype;
use cudarc::cublas::sys as blas;
use std::ffi::c_void;

/// Operand/result type and accumulator of a GEMM.
#[derive(Debug, Clone, Copy)]
pub enum GemmPrecision {
    /// Storage-type operands and result, f32 accumulation: every real projection.
    Storage(Dtype),
    /// fp16 operands, accumulator and result (CUBLAS_COMPUTE_16F): the planted bug `q_abs_fp16_accum`
    /// (llama.cpp #13137), never the real path.
    Fp16Accum,
}

/// cuBLAS handle; every projection is a GEMM with f32 accumulation and storage-type output.
pub struct Blas {
    h: blas::cublasHandle_t,
}

fn blas_err(what: &str) -> impl Fn(cudarc::cublas::result::CublasError) -> Error + '_ {
    move |e| Error::Environment(format!("cuBLAS {what} failed: {:?}", e.0))
}

pub fn blas_type(dt: Dtype) -> blas::cudaDataType {
    match dt {
        Dtype::Bf16 => blas::cudaDataType::CUDA_R_16BF,
        Dtype::F16 => blas::cudaDataType::CUDA_R_16F,
        Dtype::F32 => blas::cudaDataType::CUDA_R_32F,
    }
}

impl Blas {
    pub fn new() -> Result<Blas> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { blas::is_culib_present() } {
            return Err(Error::Environment(
                "cuBLAS (libcublas.so.13) was not found: add /usr/local/cuda/lib64 to LD_LIBRARY_PATH".into(),
            ));
        }
        let h = cudarc::cublas::result::create_handle().map_err(blas_err("cublasCreate"))?;
        Ok(Blas { h })
    }

    /// `y[n, out] = x[n, k] · Wᵀ` with W row-major `[out, k]` (torch orientation), leading dims in elements.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        dt: Dtype,
        n: usize,
        out: usize,
        k: usize,
        x: u64,
        ldx: usize,
        w: u64,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        self.batched(
            GemmPrecision::Storage(dt),
            blas::cublasOperation_t::CUBLAS_OP_T,
            out,
            n,
            k,
            w,
            k,
            0,
            x,
            ldx,
            0,
            y,
            ldy,
            0,
            1,
        )
    }

    /// Column-major strided batched GEMM `C_b (m×n) = op(A_b) (m×k) · B_b (k×n)`, B not transposed.
    #[allow(clippy::too_many_arguments)]
    pub fn batched(
        &self,
        prec: GemmPrecision,
        op_a: blas::cublasOperation_t,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        lda: usize,
        sa: usize,
        b: u64,
        ldb: usize,
        sb: usize,
        c: u64,
        ldc: usize,
        sc: usize,
        batch: usize,
    ) -> Result<()> {
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        // alpha = 1, beta = 0 in the compute type (cuBLAS reads them as fp16 with a 16F compute type).
        let ab32 = [1.0f32, 0.0];
        let ab16 = [half::f16::ONE, half::f16::ZERO];
        let (ty, compute, alpha, beta) = match prec {
            GemmPrecision::Storage(dt) => (
                blas_type(dt),
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                &ab32[0] as *const f32 as *const c_void,
                &ab32[1] as *const f32 as *const c_void,
            ),
            GemmPrecision::Fp16Accum => (
                blas::cudaDataType::CUDA_R_16F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_16F,
                &ab16[0] as *const half::f16 as *const c_void,
                &ab16[1] as *const half::f16 as *const c_void,
            ),
        };
        self.gemm(
            ty,
            compute,
            alpha,
            beta,
            op_a,
            [m, n, k],
            (a, lda, sa),
            (b, ldb, sb),
            (c, ldc, sc),
            batch,
        )
    }

    /// One `cublasGemmStridedBatchedEx`; each operand as (pointer, leading dim, batch stride).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        ty: blas::cudaDataType,
        compute: blas::cublasComputeType_t,
        alpha: *const c_void,
        beta: *const c_void,
        op_a: blas::cublasOperation_t,
        [m, n, k]: [usize; 3],
        (a, lda, sa): (u64, usize, usize),
        (b, ldb, sb): (u64, usize, usize),
        (c, ldc, sc): (u64, usize, usize),
        batch: usize,
    ) -> Result<()> {
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                self.h,
                op_a,
                blas::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                alpha,
                a as *const c_void,
                ty,
                lda as i32,
                sa as i64,
                b as *const c_void,
                ty,
                ldb as i32,
                sb as i64,
                beta,
                c as *mut c_void,
                ty,
                ldc as i32,
                sc as i64,
                batch as i32,
                compute,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("GEMM"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.h) };
    }
}
