//! Compiled kernel modules (cached by their defines) and launches. The attention modules are in
//! `attn.rs`, the cuBLAS projections in `blas.rs`.

use super::device::{drv_err, Gpu};
use super::nvrtc::{self, Sources};
use crate::error::{Error, Result};
use crate::faults::Fault;
use crate::precision::Dtype;
use crate::tiles::{Dims, Tile};
use cudarc::driver::{result as drv, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::rc::Rc;

/// The faults switched inside the kernels (kernels/*.cu); every other fault is a host switch in the
/// layer's host code (mod.rs, buffers.rs, front.rs, decode.rs; `faults::Info::cuda_site` says which).
pub const KERNEL_FAULTS: [Fault; 32] = [
    Fault::RopeNeox,
    Fault::RopeNorm,
    Fault::CachePeFirst,
    Fault::PageOffByOne,
    Fault::LseLog2Merge,
    Fault::SplitLseBf16,
    Fault::EmptyCtxLseInf,
    Fault::CausalOffByOne,
    Fault::ReadPastEnd,
    Fault::SplitDropLast,
    Fault::Wg2KeysDropped,
    Fault::SplitTailDropped,
    // kernels/sm90/decode: one kernel variant each (`tiles::variants::fault_in`).
    Fault::PairsHandoverStale,
    Fault::SmallRingWrap,
    Fault::TmaPageTile,
    // kernels/indexer.cu (the DSA indexer's scores and top-k).
    Fault::IndexerNonCausal,
    Fault::IndexerNoRelu,
    Fault::IndexerTopkOffByOne,
    Fault::IndexerFp8Scale,
    // kernels/kpool.cu (glm5-next's k-pool indexer: pooling and the tail).
    Fault::KpoolNoApe,
    Fault::KpoolSoftmaxChannels,
    Fault::KpoolNoTail,
    // kernels/cache_write.cu `cache_write_format` (a quantized cache's writer and reader).
    Fault::KvScaleTwice,
    Fault::KvScaleInverted,
    Fault::KvRopeQuantized,
    Fault::KvScaleWrongGroup,
    Fault::KvSaturate240,
    Fault::KvScaleUnwritten,
    // kernels/v4/ (DeepSeek-V4): the window edge, the compressor's groups and state in v4/v4.cuh, the
    // sink in v4/attn.cu.
    Fault::WindowOffByOne,
    Fault::CompressGroupOffByOne,
    Fault::CompressorStateDropped,
    Fault::SinkDropped,
];

// The defines NVRTC compiles the host model's dims and tiles (src/tiles) with.
impl Dims {
    pub fn defines(&self) -> Vec<(String, String)> {
        let d = |k: &str, v: usize| (k.to_string(), v.to_string());
        let mut defs = vec![
            d(
                "MLA_DTYPE",
                match self.dtype {
                    Dtype::Bf16 => 0,
                    Dtype::F16 => 1,
                    Dtype::F32 => 2,
                },
            ),
            d("MLA_LKV", self.lkv),
            d("MLA_R", self.r),
            d("MLA_P", self.p),
            d("MLA_DV", self.dv),
            d("MLA_H", self.h),
            d("MLA_PAGE", self.page),
            d("MLA_ROPE_NEOX", self.neox as usize),
            d("MLA_DEBUG", self.debug as usize),
        ];
        // Only the kernel faults: a host fault must not cost a second compile of unchanged kernels.
        for f in KERNEL_FAULTS.iter().filter(|f| self.faults.on(**f)) {
            defs.push(d(f.info().define, 1));
        }
        defs
    }
}

impl Tile {
    pub fn defines(&self) -> Vec<(String, String)> {
        let mut d: Vec<(String, String)> = vec![
            ("ATT_WM".into(), self.wm.to_string()),
            ("ATT_WN".into(), self.wn.to_string()),
            ("ATT_BN".into(), self.bn.to_string()),
            ("ATT_STAGES".into(), self.stages.to_string()),
            ("ATT_PVM".into(), self.pvm.to_string()),
            ("ATT_SMT".into(), self.smt.to_string()),
            ("ATT_SWN".into(), self.swn.to_string()),
        ];
        if self.su > 0 {
            d.push(("ATT_SUNROLL".into(), self.su.to_string()));
        }
        d
    }
}

/// A loaded module.
pub struct Module {
    m: sys::CUmodule,
    pub unit: String,
}

impl Module {
    pub fn func(&self, name: &str) -> Result<sys::CUfunction> {
        let c = CString::new(name).unwrap();
        unsafe { drv::module::get_function(self.m, c) }
            .map_err(drv_err(&format!("finding kernel {name} in {}", self.unit)))
    }
    /// `func`, with its dynamic shared memory allowed up to `bytes` (above 48 KiB a launch needs it).
    pub fn func_smem(&self, name: &str, bytes: usize) -> Result<sys::CUfunction> {
        let f = self.func(name)?;
        unsafe {
            drv::function::set_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(drv_err(&format!(
            "raising {name}'s shared-memory limit to {bytes} bytes"
        )))?;
        Ok(f)
    }
    /// Device address and size of the module's global `name`.
    fn global(&self, name: &str) -> Result<(u64, usize)> {
        let c = CString::new(name).unwrap();
        let (mut ptr, mut bytes) = (0u64, 0usize);
        unsafe { sys::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, self.m, c.as_ptr()) }
            .result()
            .map_err(drv_err(&format!("reading {name} from {}", self.unit)))?;
        Ok((ptr, bytes))
    }
    /// Device address of the module's global `name`.
    pub fn global_ptr(&self, name: &str) -> Result<u64> {
        self.global(name).map(|g| g.0)
    }
    /// Whether the module defines a global named `name`.
    pub fn has_global(&self, name: &str) -> bool {
        self.global(name).is_ok()
    }
    /// Read a small `__device__ const int[]` table (the kernel's own account of its launch config).
    pub fn global_i32s(&self, name: &str, n: usize) -> Result<Vec<i32>> {
        let (ptr, bytes) = self.global(name)?;
        if bytes < n * 4 {
            return Err(Error::Environment(format!(
                "{}: {name} is {bytes} bytes, expected {}",
                self.unit,
                n * 4
            )));
        }
        let mut v = vec![0i32; n];
        unsafe { drv::memcpy_dtoh_sync(&mut v, ptr) }
            .map_err(drv_err("reading a module global"))?;
        Ok(v)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = unsafe { drv::module::unload(self.m) };
    }
}

/// A compiled unit: file name and its `-D` defines.
type ModuleKey = (String, Vec<(String, String)>);

/// Compiles kernels on first use for the device's architecture and keeps the modules, in the process and
/// on disk (`DiskCache`).
pub struct Kernels {
    pub src: Sources,
    pub arch: String,
    cache: HashMap<ModuleKey, Rc<Module>>,
    disk: Option<DiskCache>,
    /// Milliseconds spent in NVRTC.
    pub compile_ms: f64,
}

/// Environment variable naming the folder of compiled modules kept between runs; `0` (or empty): none.
pub const CACHE_ENV: &str = "MLA_DIFF_KERNEL_CACHE";

/// Compiled modules kept between runs, one file per `nvrtc::cache_key`: a run compiles ~10–20 modules
/// (a second decode module per production variant its batches aim at, issue #35), seconds of NVRTC each
/// time for the same sources. The key covers every input of the compile, so an entry is never stale;
/// an entry that does not load is compiled again.
struct DiskCache {
    dir: std::path::PathBuf,
    nvrtc: (i32, i32),
}

impl DiskCache {
    /// `MLA_DIFF_KERNEL_CACHE`, else `$XDG_CACHE_HOME/mla-diff/kernels`, else `~/.cache/mla-diff/kernels`.
    fn open() -> Option<DiskCache> {
        let dir = cache_dir(
            std::env::var_os(CACHE_ENV),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        )?;
        let nvrtc = super::nvrtc::nvrtc_version().ok()?;
        Some(DiskCache { dir, nvrtc })
    }
    fn path(&self, key: &str) -> std::path::PathBuf {
        self.dir.join(format!("{key}.bin"))
    }
    fn get(&self, key: &str) -> Option<Vec<u8>> {
        std::fs::read(self.path(key)).ok()
    }
    /// Written whole or not at all (a temporary file renamed); a cache that cannot be written is no error.
    fn put(&self, key: &str, image: &[u8]) {
        let tmp = self.dir.join(format!("{key}.{}.tmp", std::process::id()));
        let ok = std::fs::create_dir_all(&self.dir).is_ok() && std::fs::write(&tmp, image).is_ok();
        if !ok || std::fs::rename(&tmp, self.path(key)).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// The cache folder from the environment's values (see `DiskCache::open`); `None`: no cache.
fn cache_dir(
    env: Option<std::ffi::OsString>,
    xdg: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Option<std::path::PathBuf> {
    let nonempty = |v: Option<std::ffi::OsString>| v.filter(|v| !v.is_empty());
    match nonempty(env) {
        Some(v) if v == "0" => None,
        Some(v) => Some(v.into()),
        None => nonempty(xdg)
            .map(std::path::PathBuf::from)
            .or_else(|| nonempty(home).map(|h| std::path::PathBuf::from(h).join(".cache")))
            .map(|c| c.join("mla-diff").join("kernels")),
    }
}

impl Kernels {
    pub fn new(src: Sources, gpu: &Gpu) -> Kernels {
        Kernels {
            src,
            arch: gpu.info.arch(),
            cache: HashMap::new(),
            disk: DiskCache::open(),
            compile_ms: 0.0,
        }
    }
    pub fn module(&mut self, unit: &str, defines: Vec<(String, String)>) -> Result<Rc<Module>> {
        let key = (unit.to_string(), defines);
        if let Some(m) = self.cache.get(&key) {
            return Ok(m.clone());
        }
        let load =
            |image: &[u8]| unsafe { drv::module::load_data(image.as_ptr() as *const c_void) };
        let disk_key = self
            .disk
            .as_ref()
            .map(|d| nvrtc::cache_key(&self.src, unit, &key.1, &self.arch, d.nvrtc));
        let kept = match (&self.disk, &disk_key) {
            (Some(d), Some(k)) => d.get(k).and_then(|image| load(&image).ok()),
            _ => None,
        };
        let m = match kept {
            Some(m) => m,
            None => {
                let t = std::time::Instant::now();
                let c = nvrtc::compile(&self.src, unit, &key.1, &self.arch, false)?;
                self.compile_ms += t.elapsed().as_secs_f64() * 1e3;
                let image = c.cubin.unwrap_or(c.ptx);
                let m = load(&image).map_err(drv_err(&format!(
                    "loading module {unit} (arch {})",
                    self.arch
                )))?;
                if let (Some(d), Some(k)) = (&self.disk, &disk_key) {
                    d.put(k, &image);
                }
                m
            }
        };
        let m = Rc::new(Module {
            m,
            unit: unit.to_string(),
        });
        self.cache.insert(key, m.clone());
        Ok(m)
    }
}

/// Launch a kernel on the default stream. `f` comes from a loaded `Module` and every entry of `params`
/// points to a live value of the kernel parameter's type (the driver copies them during the call).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn launch(
    f: sys::CUfunction,
    what: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    params: &mut [*mut c_void],
) -> Result<()> {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    unsafe { drv::launch_kernel(f, grid, (block, 1, 1), smem, std::ptr::null_mut(), params) }
        .map_err(drv_err(&format!("launching {what}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Active;

    #[test]
    fn the_kernel_cache_folder_follows_the_environment() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        let p = |s: &str| Some(std::path::PathBuf::from(s));
        assert_eq!(cache_dir(os("/c"), os("/x"), os("/h")), p("/c"));
        assert_eq!(cache_dir(os("0"), os("/x"), os("/h")), None);
        assert_eq!(
            cache_dir(None, os("/x"), os("/h")),
            p("/x/mla-diff/kernels")
        );
        assert_eq!(
            cache_dir(os(""), None, os("/h")),
            p("/h/.cache/mla-diff/kernels")
        );
        assert_eq!(cache_dir(None, None, None), None);
    }

    #[test]
    fn a_cache_key_changes_with_every_input_of_the_compile() {
        use super::super::nvrtc::{cache_key, Sources};
        let src = Sources::embedded();
        let d = |v: &str| vec![("MLA_H".to_string(), v.to_string())];
        let k = cache_key(&src, "decode.cu", &d("4"), "sm_90a", (13, 0));
        assert_eq!(k, cache_key(&src, "decode.cu", &d("4"), "sm_90a", (13, 0)));
        assert_eq!(k.len(), 64);
        for other in [
            cache_key(&src, "decode.cu", &d("8"), "sm_90a", (13, 0)),
            cache_key(&src, "prefill.cu", &d("4"), "sm_90a", (13, 0)),
            cache_key(&src, "decode.cu", &d("4"), "sm_80", (13, 0)),
            cache_key(&src, "decode.cu", &d("4"), "sm_90a", (13, 1)),
        ] {
            assert_ne!(k, other);
        }
        // An edited header is another key (a `--kernels` copy).
        let dir = tempfile::tempdir().unwrap();
        for (n, text) in super::super::nvrtc::KERNEL_FILES {
            let p = dir.path().join(n);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let text = match n.ends_with("wgmma.cuh") {
                true => format!("{text}\n// edited"),
                false => text.to_string(),
            };
            std::fs::write(p, text).unwrap();
        }
        let edited = Sources::from_dir(dir.path()).unwrap();
        assert_ne!(
            k,
            cache_key(&edited, "decode.cu", &d("4"), "sm_90a", (13, 0))
        );
    }

    #[test]
    fn kernel_faults_are_exactly_the_defines_the_kernels_test() {
        // Every kernel fault has a switch in kernels/ and no host fault has one (a host fault's define in
        // a kernel would never be set, as `Dims::defines` passes kernel faults only).
        let src: String = super::super::nvrtc::KERNEL_FILES
            .iter()
            .map(|(_, text)| *text)
            .collect();
        for f in Fault::ALL {
            let define = f.info().define;
            assert_eq!(
                src.contains(define),
                KERNEL_FAULTS.contains(&f),
                "{define} in kernels/"
            );
        }
    }

    /// DeepSeek-V3 attention dims, 16 heads, bf16, no fault.
    fn deepseek_bf16() -> Dims {
        Dims {
            dtype: Dtype::Bf16,
            lkv: 512,
            r: 64,
            p: 128,
            dv: 128,
            h: 16,
            page: 64,
            neox: false,
            debug: true,
            faults: Active::NONE,
        }
    }

    #[test]
    fn only_kernel_faults_become_defines() {
        let d = Dims {
            faults: Active::NONE
                .with(Fault::SplitDropLast)
                .with(Fault::Scale576),
            ..deepseek_bf16()
        };
        let faults: Vec<String> = d
            .defines()
            .into_iter()
            .filter(|(k, _)| k.starts_with("MLA_FAULT_"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(faults, ["MLA_FAULT_SPLIT_DROP_LAST=1"]);
        // A host fault alone compiles the same modules as the clean path (no second compile).
        let host_only = Dims {
            faults: Active::NONE.with(Fault::KvBSwap),
            ..d
        };
        let clean = Dims {
            faults: Active::NONE,
            ..d
        };
        assert_eq!(host_only.defines(), clean.defines());
    }

    #[test]
    fn dims_become_defines_and_gate_the_tensor_cores() {
        let d = deepseek_bf16();
        let defs = d.defines();
        assert!(defs.contains(&("MLA_LKV".to_string(), "512".to_string())));
        assert!(defs.contains(&("MLA_DTYPE".to_string(), "0".to_string())));
        assert!(d.mma_ok(true) && d.mma_ok(false));
        assert!(!Dims {
            dtype: Dtype::F32,
            ..d
        }
        .mma_ok(true));
        assert!(!Dims { p: 10, ..d }.mma_ok(false));
    }
}
