//! Device probing, the context, device buffers and events — raw driver calls through cudarc's
//! dynamically loaded bindings. cudarc panics when libcuda is missing, so `Gpu::open` checks first.

use crate::error::{Error, Result};
use crate::precision::Dtype;
use cudarc::driver::{result as drv, sys, DriverError};
use std::ffi::c_void;

/// Map a driver error to an environment error naming what was being done.
pub fn drv_err(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| {
        let name = e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let msg = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Error::Environment(format!("CUDA {what} failed: {name} ({msg})"))
    }
}

#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub name: String,
    pub cc: (i32, i32),
    pub sms: i32,
    pub smem_optin: usize,
    pub driver_version: i32,
    pub total_mem: usize,
}

impl DeviceInfo {
    /// NVRTC target for this device, e.g. "sm_80". Hopper gets the arch-specific "sm_90a", whose wgmma
    /// the decode kernel uses (the image then runs on sm_90 devices only, which is all it is built for).
    pub fn arch(&self) -> String {
        crate::tiles::choice::arch(self.cc)
    }
}

/// Whether a CUDA GPU can be used here (driver library loads, at least one device). Never panics.
pub fn gpu_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    let lib = unsafe { sys::is_culib_present() };
    lib && drv::init().is_ok() && drv::device::get_count().map(|n| n > 0).unwrap_or(false)
}

/// How many CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`); no driver or no device is
/// `Error::Environment`.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Environment(
            "--gpus needs an NVIDIA driver: libcuda.so.1 was not found (no GPU on this machine?)"
                .into(),
        ));
    }
    drv::init().map_err(drv_err("cuInit (is a GPU visible?)"))?;
    let n = drv::device::get_count().map_err(drv_err("cuDeviceGetCount"))?;
    if n < 1 {
        return Err(Error::Environment("no CUDA device found".into()));
    }
    Ok(n as usize)
}

/// An initialised device with its primary context current on this thread.
pub struct Gpu {
    pub dev: sys::CUdevice,
    ctx: sys::CUcontext,
    pub info: DeviceInfo,
}

impl Gpu {
    /// Open GPU 0. Every failure (no driver library, no device, init error) is `Error::Environment`.
    pub fn open() -> Result<Gpu> {
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Environment(
                "the CUDA backend needs an NVIDIA driver: libcuda.so.1 was not found (no GPU on this machine?)".into(),
            ));
        }
        drv::init().map_err(drv_err("cuInit (is a GPU visible?)"))?;
        let n = drv::device::get_count().map_err(drv_err("cuDeviceGetCount"))?;
        if n < 1 {
            return Err(Error::Environment("no CUDA device found".into()));
        }
        let dev = drv::device::get(0).map_err(drv_err("cuDeviceGet"))?;
        // SAFETY: dev is a valid device handle.
        let ctx = unsafe { drv::primary_ctx::retain(dev) }
            .map_err(drv_err("cuDevicePrimaryCtxRetain"))?;
        unsafe { drv::ctx::set_current(ctx) }.map_err(drv_err("cuCtxSetCurrent"))?;
        let attr = |a| {
            unsafe { drv::device::get_attribute(dev, a) }.map_err(drv_err("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute as A;
        let cc = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smem_optin = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize;
        let mut driver_version = 0;
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(drv_err("cuDriverGetVersion"))?;
        let total_mem =
            unsafe { drv::device::total_mem(dev) }.map_err(drv_err("cuDeviceTotalMem"))?;
        let name = drv::device::get_name(dev).map_err(drv_err("cuDeviceGetName"))?;
        Ok(Gpu {
            dev,
            ctx,
            info: DeviceInfo {
                name,
                cc,
                sms,
                smem_optin,
                driver_version,
                total_mem,
            },
        })
    }

    /// Make the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        unsafe { drv::ctx::set_current(self.ctx) }.map_err(drv_err("cuCtxSetCurrent"))
    }

    /// Wait for all queued work; a kernel fault surfaces here, named by `what`.
    pub fn sync(&self, what: &str) -> Result<()> {
        drv::ctx::synchronize().map_err(drv_err(what))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: the context was retained in `open`.
        let _ = unsafe { drv::primary_ctx::release(self.dev) };
    }
}

/// A device allocation (freed on drop). Holds raw bytes; the element type is the caller's business.
pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl DevBuf {
    pub fn alloc(bytes: usize) -> Result<DevBuf> {
        // A zero-byte request still gets a distinct, valid pointer so kernels may be passed it.
        let ptr = unsafe { drv::malloc_sync(bytes.max(256)) }.map_err(drv_err(&format!(
            "allocating {} MiB of device memory",
            bytes >> 20
        )))?;
        Ok(DevBuf { ptr, bytes })
    }
    pub fn zeros(bytes: usize) -> Result<DevBuf> {
        let b = DevBuf::alloc(bytes)?;
        unsafe { drv::memset_d8_sync(b.ptr, 0, bytes.max(256)) }.map_err(drv_err("cuMemsetD8"))?;
        Ok(b)
    }
    /// Fill with the storage type's quiet NaN (cache-pool poison).
    pub fn fill_nan(&self, dt: Dtype) -> Result<()> {
        let r = match dt {
            Dtype::Bf16 => unsafe {
                sys::cuMemsetD16Async(self.ptr, 0x7fc0, self.bytes / 2, std::ptr::null_mut())
            },
            Dtype::F16 => unsafe {
                sys::cuMemsetD16Async(self.ptr, 0x7e00, self.bytes / 2, std::ptr::null_mut())
            },
            Dtype::F32 => unsafe {
                sys::cuMemsetD32Async(self.ptr, 0x7fc0_0000, self.bytes / 4, std::ptr::null_mut())
            },
        };
        r.result().map_err(drv_err("cuMemset (NaN poison)"))
    }
    pub fn upload<T: Copy>(data: &[T]) -> Result<DevBuf> {
        let b = DevBuf::alloc(std::mem::size_of_val(data))?;
        b.write(data)?;
        Ok(b)
    }
    /// f32 values stored in `dt` on the device: [`DevBuf::upload`] of [`encode_f32`]'s bytes, without
    /// their whole host copy (a GLM-5 layer's attn_output is 200 MB in bf16, in fresh pages every
    /// layer) and with each piece's conversion beside the copy of the one before ([`staged`]): the
    /// weights' conversion and upload were 15–23 s of the 78-layer GLM-5 file's run loop (#39).
    pub fn upload_f32(dt: Dtype, v: &[f32]) -> Result<DevBuf> {
        let b = DevBuf::alloc(v.len() * elem_bytes(dt))?;
        // The copies on this thread, where the CUDA context is bound.
        staged(dt, v, STAGE, |at, bytes| b.write_at(at, bytes))?;
        Ok(b)
    }
    pub fn write<T: Copy>(&self, data: &[T]) -> Result<()> {
        self.write_at(0, data)
    }
    /// [`DevBuf::write`] from byte `at` of the buffer on.
    pub fn write_at<T: Copy>(&self, at: usize, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        assert!(
            at + std::mem::size_of_val(data) <= self.bytes,
            "upload larger than buffer"
        );
        unsafe { drv::memcpy_htod_sync(self.ptr + at as u64, data) }
            .map_err(drv_err("host-to-device copy"))
    }
    /// Copy `n` elements of type T starting at element `offset` back to the host.
    pub fn read<T: Copy + Default>(&self, offset: usize, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        if n == 0 {
            return Ok(v);
        }
        let sz = std::mem::size_of::<T>();
        assert!(
            (offset + n) * sz <= self.bytes,
            "download past the end of a device buffer"
        );
        unsafe { drv::memcpy_dtoh_sync(&mut v, self.ptr + (offset * sz) as u64) }.map_err(
            drv_err("device-to-host copy (an earlier kernel may have faulted)"),
        )?;
        Ok(v)
    }
    /// Device address of element `offset` of a buffer of `elem`-byte elements.
    pub fn at(&self, offset: usize, elem: usize) -> u64 {
        self.ptr + (offset * elem) as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = unsafe { drv::free_sync(self.ptr) };
    }
}

/// A pair of events around a region on the default stream.
pub struct Timer {
    start: sys::CUevent,
    stop: sys::CUevent,
}

impl Timer {
    pub fn new() -> Result<Timer> {
        let f = sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(Timer {
            start: drv::event::create(f).map_err(drv_err("cuEventCreate"))?,
            stop: drv::event::create(f).map_err(drv_err("cuEventCreate"))?,
        })
    }
    pub fn start(&self) -> Result<()> {
        unsafe { drv::event::record(self.start, std::ptr::null_mut()) }
            .map_err(drv_err("cuEventRecord"))
    }
    /// Record the stop event, wait for it, and return the elapsed milliseconds.
    pub fn stop_ms(&self) -> Result<f32> {
        unsafe {
            drv::event::record(self.stop, std::ptr::null_mut())
                .map_err(drv_err("cuEventRecord"))?;
            drv::event::synchronize(self.stop).map_err(drv_err("kernel execution (event sync)"))?;
            drv::event::elapsed(self.start, self.stop).map_err(drv_err("cuEventElapsedTime"))
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        unsafe {
            let _ = drv::event::destroy(self.start);
            let _ = drv::event::destroy(self.stop);
        }
    }
}

/// Storage bytes per element.
pub fn elem_bytes(dt: Dtype) -> usize {
    match dt {
        Dtype::Bf16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
    }
}

/// Encode f64 values in the storage type (round to nearest even), as raw little-endian bytes.
pub fn encode(dt: Dtype, vals: impl Iterator<Item = f64>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in vals {
        match dt {
            // via f32, exactly as `Dtype::round` does (f64 -> f32 -> storage type)
            Dtype::Bf16 => {
                out.extend_from_slice(&half::bf16::from_f32(v as f32).to_bits().to_le_bytes())
            }
            Dtype::F16 => {
                out.extend_from_slice(&half::f16::from_f32(v as f32).to_bits().to_le_bytes())
            }
            Dtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        }
    }
    out
}

/// Elements converted per parallel task by [`encode_f32`] and [`decode`].
const CHUNK: usize = 1 << 16;

/// [`encode`] of f32 values, bit for bit (f32 -> storage type, to nearest even), in parallel chunks: a
/// layer's weights are hundreds of MB, and converting them on one thread was most of a GPU layer's
/// host time (measured on the H200 host: ~1 s of each pass at GLM-5 dims).
pub fn encode_f32(dt: Dtype, v: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; v.len() * elem_bytes(dt)];
    encode_f32_into(dt, v, &mut out);
    out
}

/// [`encode_f32`] into `out`, which holds exactly `v`'s values in `dt`.
pub fn encode_f32_into(dt: Dtype, v: &[f32], out: &mut [u8]) {
    use rayon::prelude::*;
    let es = elem_bytes(dt);
    assert_eq!(out.len(), v.len() * es, "one stored value per value");
    out.par_chunks_mut(CHUNK * es)
        .zip(v.par_chunks(CHUNK))
        .for_each(|(o, c)| {
            let o = o.chunks_exact_mut(es);
            match dt {
                Dtype::Bf16 => o.zip(c).for_each(|(o, &x)| {
                    o.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes())
                }),
                Dtype::F16 => o.zip(c).for_each(|(o, &x)| {
                    o.copy_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes())
                }),
                Dtype::F32 => o
                    .zip(c)
                    .for_each(|(o, &x)| o.copy_from_slice(&x.to_le_bytes())),
            }
        });
}

/// Values per piece of [`DevBuf::upload_f32`] (16 MiB of f32).
const STAGE: usize = 1 << 22;

/// `v` in `dt` ([`encode_f32`]'s bytes) handed to `copy` in pieces of `stage` values, each with its
/// byte offset, in order, through two host buffers reused piece after piece: each piece is converted
/// (in parallel, on a thread of its own) while `copy` takes the one before it on this thread.
fn staged(
    dt: Dtype,
    v: &[f32],
    stage: usize,
    mut copy: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    fn fill(dt: Dtype, buf: &mut Vec<u8>, piece: &[f32]) {
        buf.resize(piece.len() * elem_bytes(dt), 0);
        encode_f32_into(dt, piece, buf);
    }
    let pieces: Vec<&[f32]> = v.chunks(stage.max(1)).collect();
    let (mut cur, mut next) = (Vec::new(), Vec::new());
    if let Some(first) = pieces.first() {
        fill(dt, &mut cur, first);
    }
    for (i, _) in pieces.iter().enumerate() {
        let following = pieces.get(i + 1).copied();
        let copied = std::thread::scope(|s| {
            let conv = following.map(|p| s.spawn(|| fill(dt, &mut next, p)));
            let r = copy(i * stage * elem_bytes(dt), &cur);
            if let Some(h) = conv {
                h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            }
            r
        });
        copied?;
        std::mem::swap(&mut cur, &mut next);
    }
    Ok(())
}

/// Decode storage-type bytes to f64 (in parallel chunks: a trace is tens of MB).
pub fn decode(dt: Dtype, bytes: &[u8]) -> Vec<f64> {
    use rayon::prelude::*;
    let es = elem_bytes(dt);
    let mut out = vec![0f64; bytes.len() / es];
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * es))
        .for_each(|(o, c)| {
            let c = c.chunks_exact(es);
            match dt {
                Dtype::Bf16 => o.iter_mut().zip(c).for_each(|(o, c)| {
                    *o = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()
                }),
                Dtype::F16 => o.iter_mut().zip(c).for_each(|(o, c)| {
                    *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()
                }),
                Dtype::F32 => o
                    .iter_mut()
                    .zip(c)
                    .for_each(|(o, c)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64),
            }
        });
    out
}

/// Raw pointer helper for kernel parameter arrays.
pub fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The parallel conversions are the one-value-at-a-time ones, bit for bit, over random bit patterns
    /// (NaN payloads, subnormals, ties) across chunk boundaries.
    #[test]
    fn parallel_conversions_are_the_serial_ones() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut v: Vec<f32> = (0..3 * CHUNK + 17)
            .map(|_| f32::from_bits(rng.random()))
            .collect();
        v.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65520.0,
            1.0 + f32::EPSILON,
        ]);
        for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            let serial = encode(dt, v.iter().map(|&x| x as f64));
            let bytes = encode_f32(dt, &v);
            assert!(serial == bytes, "{dt:?} encode");
            let want: Vec<u64> = bytes
                .chunks_exact(elem_bytes(dt))
                .map(|c| match dt {
                    Dtype::Bf16 => half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64(),
                    Dtype::F16 => half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64(),
                    Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                })
                .map(f64::to_bits)
                .collect();
            let got: Vec<u64> = decode(dt, &bytes).into_iter().map(f64::to_bits).collect();
            assert!(want == got, "{dt:?} decode");
        }
    }

    /// Weights rounded in place to the dtype (`Dtype::round_slice`, what `LayerWeights::round_in_place`
    /// does) upload the same bits as the file's values (`CudaBackend::reads_stored_weights_only`), over
    /// random bit patterns (NaN payloads, subnormals, ties, overflow to infinity).
    #[test]
    fn rounded_weights_upload_the_same_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let mut v: Vec<f32> = (0..CHUNK + 9)
            .map(|_| f32::from_bits(rng.random()))
            .collect();
        v.extend([
            65520.0,
            -65519.0,
            1.0 + f32::EPSILON,
            f32::MIN_POSITIVE / 3.0,
        ]);
        for dt in [Dtype::Bf16, Dtype::F16] {
            let mut rounded = v.clone();
            dt.round_slice(&mut rounded);
            let changed = rounded
                .iter()
                .zip(&v)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            assert!(changed.count() > CHUNK / 2, "{dt:?}: most values change");
            assert!(encode_f32(dt, &rounded) == encode_f32(dt, &v), "{dt:?}");
        }
    }

    /// The staged pieces are the whole conversion's bytes, in order and at their offsets, for a last
    /// piece short or whole, a single piece and none; an error of the copy ends it.
    #[test]
    fn staged_pieces_are_the_whole_conversion() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let v: Vec<f32> = (0..3 * CHUNK + 17)
            .map(|_| f32::from_bits(rng.random()))
            .collect();
        for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            let whole = encode_f32(dt, &v);
            for (n, stage) in [(v.len(), CHUNK + 5), (2 * CHUNK, CHUNK), (9, 64), (0, 8)] {
                let mut got = vec![0xa5u8; whole[..n * elem_bytes(dt)].len()];
                let mut next_at = 0;
                staged(dt, &v[..n], stage, |at, b| {
                    assert_eq!(at, next_at, "in order, no gap");
                    got[at..at + b.len()].copy_from_slice(b);
                    next_at += b.len();
                    Ok(())
                })
                .unwrap();
                assert_eq!(next_at, got.len(), "{dt:?} {n}");
                assert!(got == whole[..got.len()], "{dt:?} {n} values per {stage}");
            }
            let mut calls = 0;
            let r = staged(dt, &v, CHUNK, |_, _| {
                calls += 1;
                Err(crate::error::Error::Usage("device gone".into()))
            });
            assert!(r.is_err() && calls == 1, "{dt:?}");
        }
    }
}
