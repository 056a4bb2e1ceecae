//! The fp64 products of the reference and the stage-local view on the GPU (`linalg::Engine`): cuBLAS
//! DGEMM (the H200's fp64 tensor cores: IEEE fp64 fused multiply-adds, summed in another order than the
//! host's) against each weight widened to f64 on the device, exactly as the host widens it. A layer's
//! weights are hundreds of millions of values: on the host their products are most of the run's CPU
//! time, on the GPU milliseconds plus one f32 copy over PCIe.
//!
//! One engine per process, shared by the run's threads (the reference, the judges) under a mutex: the
//! device work per call is short and one context and cuBLAS handle serve them all. Its work goes on its
//! own non-blocking stream: on the legacy default stream, where the kernels under test are queued, each
//! product waited for the optimized pass's queued kernels and they for it.

use super::device::{drv_err, DevBuf, Gpu};
use super::kernels::{Kernels, Module};
use super::nvrtc::Sources;
use crate::error::{Error, Result};
use crate::linalg::{Engine, Linear};
use crate::precision::Dtype;
use cudarc::cublas::sys as blas;
use cudarc::driver::result as drv;
use ndarray::{Array2, ArrayView2};
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::Mutex;

/// f32 weight elements moved and widened at a time: 64 MiB of f32 staging, 128 MiB per f64 copy.
const CHUNK: usize = 16 << 20;

pub struct DeviceProducts {
    name: String,
    state: Mutex<State>,
}

struct State {
    gpu: Gpu,
    /// The engine's stream (non-blocking: no implicit order with the default stream).
    stream: cudarc::driver::sys::CUstream,
    blas: blas::cublasHandle_t,
    widen: cudarc::driver::sys::CUfunction,
    _module: Rc<Module>,
    /// Pinned host staging for a chunk of f32 rows (DMA at the bus's speed, not the driver's bounce).
    pinned: *mut f32,
    w32: DevBuf,
    w64: DevBuf,
    w2: DevBuf,
    /// Activations and results, grown as needed.
    bufs: [Option<DevBuf>; 4],
}

// SAFETY: the raw handles and the pinned pointer are used only under the mutex, by one thread at a
// time, each binding the context first; the Rc'd module is never cloned out of the state.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        let _ = unsafe { drv::free_host(self.pinned as *mut c_void) };
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.blas) };
        let _ = unsafe { drv::stream::destroy(self.stream) };
    }
}

fn blas_err(what: &str) -> impl Fn(cudarc::cublas::result::CublasError) -> Error + '_ {
    move |e| Error::Environment(format!("cuBLAS {what} failed: {:?}", e.0))
}

impl DeviceProducts {
    /// On GPU 0: compiles the widening kernel (kernels/fill.cu, the embedded copy: harness code, not
    /// the kernels under test), makes a cuBLAS handle, pinned staging and the chunk buffers.
    pub fn new() -> Result<DeviceProducts> {
        let gpu = Gpu::open()?;
        super::nvrtc::nvrtc_present()?;
        let mut k = Kernels::new(Sources::embedded(), &gpu);
        let module = k.module("fill.cu", vec![("MLA_DTYPE".into(), "2".into())])?;
        let widen = module.func("widen_f32_f64")?;
        // SAFETY: only tries to dlopen the library.
        if !unsafe { blas::is_culib_present() } {
            return Err(Error::Environment(
                "cuBLAS (libcublas.so.13) was not found: add /usr/local/cuda/lib64 to LD_LIBRARY_PATH".into(),
            ));
        }
        let h = cudarc::cublas::result::create_handle().map_err(blas_err("cublasCreate"))?;
        // Native fp64 (never the fixed-point emulation CUDA 13 offers as a math mode).
        unsafe { blas::cublasSetMathMode(h, blas::cublasMath_t::CUBLAS_DEFAULT_MATH) }
            .result()
            .map_err(blas_err("cublasSetMathMode"))?;
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
            .map_err(drv_err("creating the fp64 products' stream"))?;
        unsafe { blas::cublasSetStream_v2(h, stream as blas::cudaStream_t) }
            .result()
            .map_err(blas_err("cublasSetStream"))?;
        let pinned = unsafe { drv::malloc_host(CHUNK * 4, 0) }
            .map_err(drv_err("allocating pinned host memory"))? as *mut f32;
        let name = format!("cuBLAS DGEMM on {}", gpu.info.name);
        let state = State {
            w32: DevBuf::alloc(CHUNK * 4)?,
            w64: DevBuf::alloc(CHUNK * 8)?,
            w2: DevBuf::alloc(CHUNK * 8)?,
            gpu,
            stream,
            blas: h,
            widen,
            _module: module,
            pinned,
            bufs: [None, None, None, None],
        };
        Ok(DeviceProducts {
            name,
            state: Mutex::new(state),
        })
    }
}

/// Send the process's fp64 products (`linalg::linear_f32`) to GPU 0, once.
pub fn install() -> Result<()> {
    if crate::linalg::engine().is_none() {
        crate::linalg::install(Box::new(DeviceProducts::new()?));
    }
    Ok(())
}

/// `bufs[i]` with room for `bytes`.
fn room(bufs: &mut [Option<DevBuf>; 4], i: usize, bytes: usize) -> Result<u64> {
    if bufs[i].as_ref().is_none_or(|b| b.bytes < bytes) {
        bufs[i] = None;
        bufs[i] = Some(DevBuf::alloc(bytes.next_power_of_two())?);
    }
    Ok(bufs[i].as_ref().expect("allocated").ptr)
}

/// Upload a row-major f64 matrix (any strides) to `bufs[i]`, on `stream` (from pageable memory: staged
/// by the driver before the call returns, so `a` may go at once).
fn put(
    bufs: &mut [Option<DevBuf>; 4],
    i: usize,
    a: ArrayView2<f64>,
    stream: cudarc::driver::sys::CUstream,
) -> Result<u64> {
    let ptr = room(bufs, i, a.len() * 8)?;
    let a = a.as_standard_layout();
    unsafe { drv::memcpy_htod_async(ptr, a.as_slice().expect("standard layout"), stream) }
        .map_err(drv_err("host-to-device copy"))?;
    Ok(ptr)
}

/// `[rows, cols]` f64 back from the device (row-major), once `stream`'s work is done.
fn get(
    ptr: u64,
    rows: usize,
    cols: usize,
    stream: cudarc::driver::sys::CUstream,
) -> Result<Array2<f64>> {
    let mut v = vec![0f64; rows * cols];
    unsafe { drv::memcpy_dtoh_async(&mut v, ptr, stream) }
        .map_err(drv_err("device-to-host copy"))?;
    unsafe { drv::stream::synchronize(stream) }.map_err(drv_err("the fp64 products"))?;
    Ok(Array2::from_shape_vec((rows, cols), v).expect("sized"))
}

impl State {
    /// `C[m, n] (row-major, ldc = ld) = X[m, k] · W[n, k]ᵀ` for the chunk's rows of W: column-major
    /// that is `Cᵀ = W · Xᵀ`, i.e. `op(A) = Wᵀ` read as `[k, n]` transposed.
    fn dgemm(&self, [n, m, k]: [usize; 3], w: u64, x: u64, c: u64, ld: usize) -> Result<()> {
        let (one, zero) = (1.0f64, 0.0f64);
        unsafe {
            cudarc::cublas::result::dgemm(
                self.blas,
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &one,
                w as *const f64,
                k as i32,
                x as *const f64,
                k as i32,
                &zero,
                c as *mut f64,
                ld as i32,
            )
        }
        .map_err(blas_err("DGEMM"))
    }

    fn linear(
        &mut self,
        a: ArrayView2<f64>,
        sq_in: Option<ArrayView2<f64>>,
        w: ArrayView2<f32>,
        round: Option<Dtype>,
    ) -> Result<Linear> {
        use rayon::prelude::*;
        self.gpu.bind()?;
        let ((m, k), (n, kw)) = (a.dim(), w.dim());
        let m2 = sq_in.map_or(0, |s| s.nrows());
        if k != kw || sq_in.is_some_and(|s| s.ncols() != k) {
            return Err(Error::Usage(format!(
                "fp64 product of [{m}, {k}] by [{n}, {kw}]ᵀ"
            )));
        }
        if m == 0 || n == 0 || k == 0 || k > CHUNK {
            // Nothing to do, or a row longer than a chunk (no real weight): the host's.
            return Ok(crate::linalg::linear_f32_host(a, sq_in, w, round));
        }
        let s = self.stream;
        let xa = put(&mut self.bufs, 0, a, s)?;
        let ya = room(&mut self.bufs, 1, m * n * 8)?;
        let (xs, ys) = match sq_in {
            Some(sq) => (
                put(&mut self.bufs, 2, sq, s)?,
                room(&mut self.bufs, 3, m2 * n * 8)?,
            ),
            None => (0, 0),
        };
        let rows = CHUNK / k;
        for r0 in (0..n).step_by(rows) {
            let r1 = (r0 + rows).min(n);
            let len = (r1 - r0) * k;
            // SAFETY: `pinned` holds CHUNK ≥ len f32s, written here only, under the mutex.
            let stage = unsafe { std::slice::from_raw_parts_mut(self.pinned, len) };
            stage.par_chunks_mut(k).enumerate().for_each(|(i, dst)| {
                let row = w.row(r0 + i);
                dst.iter_mut().zip(row.iter()).for_each(|(d, &v)| *d = v);
                if let Some(dt) = round {
                    dt.round_slice(dst);
                }
            });
            // Waited for: the next chunk refills the pinned stage.
            unsafe { drv::memcpy_htod_async(self.w32.ptr, &stage[..], s) }
                .map_err(drv_err("host-to-device copy of weights"))?;
            unsafe { drv::stream::synchronize(s) }
                .map_err(drv_err("host-to-device copy of weights"))?;
            let mut src = self.w32.ptr;
            let mut dst = self.w64.ptr;
            let mut dst2 = if sq_in.is_some() { self.w2.ptr } else { 0 };
            let mut cnt = len as u64;
            let mut params = [
                &mut src as *mut u64 as *mut c_void,
                &mut dst as *mut u64 as *mut c_void,
                &mut dst2 as *mut u64 as *mut c_void,
                &mut cnt as *mut u64 as *mut c_void,
            ];
            let blocks = len.div_ceil(256).min(8192) as u32;
            unsafe {
                drv::launch_kernel(self.widen, (blocks, 1, 1), (256, 1, 1), 0, s, &mut params)
            }
            .map_err(drv_err("launching widen_f32_f64"))?;
            let r = r1 - r0;
            self.dgemm([r, m, k], self.w64.ptr, xa, ya + (r0 * 8) as u64, n)?;
            if sq_in.is_some() {
                self.dgemm([r, m2, k], self.w2.ptr, xs, ys + (r0 * 8) as u64, n)?;
            }
        }
        let y = get(ya, m, n, s)?;
        let sq = match sq_in {
            Some(_) => Some(get(ys, m2, n, s)?),
            None => None,
        };
        Ok(Linear { y, sq })
    }
}

impl Engine for DeviceProducts {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn linear(
        &self,
        a: ArrayView2<f64>,
        sq_in: Option<ArrayView2<f64>>,
        w: ArrayView2<f32>,
        round: Option<Dtype>,
    ) -> Result<Linear> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .linear(a, sq_in, w, round)
    }
}
