//! Compiled kernel modules (cached by their defines), launches, and the cuBLAS projections.

use super::device::{arg, drv_err, Gpu};
use super::nvrtc::{self, Sources};
use crate::backend::Dtype;
use crate::error::{Error, Result};
use crate::faults::{Active, Fault};
use cudarc::cublas::sys as blas;
use cudarc::driver::{result as drv, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::rc::Rc;

/// Model dims and schedule constants compiled into the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    pub dtype: Dtype,
    pub lkv: usize,
    pub r: usize,
    pub p: usize,
    pub dv: usize,
    pub h: usize,
    pub page: usize,
    pub neox: bool,
    pub debug: bool,
    /// Planted bugs of the layer; those in `KERNEL_FAULTS` are compiled in as `-D MLA_FAULT_…=1`.
    pub faults: Active,
}

/// The faults switched inside the kernels (kernels/*.cu); every other fault is a host switch in
/// `CudaBackend::run_layer` (`faults::Info::cuda_site` says which).
pub const KERNEL_FAULTS: [Fault; 9] = [
    Fault::RopeNeox,
    Fault::RopeNorm,
    Fault::CachePeFirst,
    Fault::PageOffByOne,
    Fault::LseLog2Merge,
    Fault::EmptyCtxLseInf,
    Fault::CausalOffByOne,
    Fault::ReadPastEnd,
    Fault::SplitDropLast,
];

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
    /// Whether the tensor-core attention applies (16-bit storage, dims multiples of 8).
    pub fn mma_ok(&self, decode: bool) -> bool {
        let dims = if decode {
            [self.lkv + self.r, 0, self.lkv]
        } else {
            [self.p, self.r, self.dv]
        };
        self.dtype != Dtype::F32 && dims.iter().all(|d| d % 8 == 0)
    }
}

/// Attention tile configuration: `wm x wn` warps, `16*wm` rows, `bn` keys per tile, `stages`-deep pipeline;
/// in the P·V phase each warp takes `pvm` 16-row m-tiles; in the S phase `smt` m-tiles and one of `swn` key
/// groups (kernels/attention.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tile {
    pub wm: u32,
    pub wn: u32,
    pub bn: u32,
    pub stages: u32,
    pub pvm: u32,
    pub smt: u32,
    pub swn: u32,
    /// S-phase k-loop unroll (0: the kernel's default).
    pub su: u32,
    /// Decode on Hopper's warpgroup MMA (`attn_wgmma`, kernels/attention_sm90.cuh: 64 rows, 64 keys,
    /// fixed layout); the other fields then only configure the module's fallback `attn_mma`.
    pub wgmma: bool,
}

impl Tile {
    pub const fn new(wm: u32, wn: u32, bn: u32, stages: u32, pvm: u32) -> Tile {
        Tile {
            wm,
            wn,
            bn,
            stages,
            pvm,
            smt: 1,
            swn: wn,
            su: 0,
            wgmma: false,
        }
    }
    /// The Hopper decode kernel; its module still carries `attn_mma` with the tile `fallback`.
    pub const fn wgmma(fallback: Tile) -> Tile {
        let mut t = fallback;
        t.wgmma = true;
        t
    }
    pub const fn unroll(mut self, su: u32) -> Tile {
        self.su = su;
        self
    }
    /// The S phase with `smt` m-tiles per warp over `swn` key groups.
    pub const fn s_phase(mut self, smt: u32, swn: u32) -> Tile {
        self.smt = smt;
        self.swn = swn;
        self
    }
    /// The tile defines used when only the scalar kernel runs (they must still compile).
    pub const SCALAR_ONLY: Tile = Tile::new(1, 1, 32, 2, 1);
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
    pub fn label(&self) -> String {
        if self.wgmma {
            return "wgmma 2 warpgroups bn64 st2".to_string();
        }
        // e.g. "4x2w bn64 st2 S:2m/2k PV:2m": warps, keys per tile, stages, S-phase m-tiles per warp and key
        // groups, PV-phase m-tiles per warp.
        format!(
            "{}x{}w bn{} st{} S:{}m/{}k{} PV:{}m",
            self.wm,
            self.wn,
            self.bn,
            self.stages,
            self.smt,
            self.swn,
            if self.su > 0 {
                format!(" u{}", self.su)
            } else {
                String::new()
            },
            self.pvm
        )
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
    /// Device address and size of the module's global `name`.
    fn global(&self, name: &str) -> Result<(u64, usize)> {
        let c = CString::new(name).unwrap();
        let (mut ptr, mut bytes) = (0u64, 0usize);
        unsafe { sys::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, self.m, c.as_ptr()) }
            .result()
            .map_err(drv_err(&format!("reading {name} from {}", self.unit)))?;
        Ok((ptr, bytes))
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

/// Compiles kernels on first use for the device's architecture and keeps the modules.
pub struct Kernels {
    pub src: Sources,
    pub arch: String,
    cache: HashMap<ModuleKey, Rc<Module>>,
    /// Milliseconds spent in NVRTC.
    pub compile_ms: f64,
}

impl Kernels {
    pub fn new(src: Sources, gpu: &Gpu) -> Kernels {
        Kernels {
            src,
            arch: gpu.info.arch(),
            cache: HashMap::new(),
            compile_ms: 0.0,
        }
    }
    pub fn module(&mut self, unit: &str, defines: Vec<(String, String)>) -> Result<Rc<Module>> {
        let key = (unit.to_string(), defines);
        if let Some(m) = self.cache.get(&key) {
            return Ok(m.clone());
        }
        let t = std::time::Instant::now();
        let c = nvrtc::compile(&self.src, unit, &key.1, &self.arch, false)?;
        self.compile_ms += t.elapsed().as_secs_f64() * 1e3;
        let image = c.cubin.unwrap_or(c.ptx);
        let m = unsafe { drv::module::load_data(image.as_ptr() as *const c_void) }.map_err(
            drv_err(&format!("loading module {unit} (arch {})", self.arch)),
        )?;
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

/// Arguments of `attn_mma` / `attn_scalar` (kernels/attention.cuh `AttnArgs`, same order, repr(C)).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnArgs {
    pub q: u64,
    pub ka: u64,
    pub kb: u64,
    pub v: u64,
    pub table: u64,
    pub seq_lens: u64,
    pub out: u64,
    pub lse: u64,
    pub part_out: u64,
    pub part_lse: u64,
    pub q_bs: i64,
    pub q_rs: i64,
    pub q_hs: i64,
    pub ka_bs: i64,
    pub ka_rs: i64,
    pub ka_hs: i64,
    pub kb_bs: i64,
    pub kb_rs: i64,
    pub v_bs: i64,
    pub v_rs: i64,
    pub v_hs: i64,
    pub out_bs: i64,
    pub out_rs: i64,
    pub out_hs: i64,
    pub table_bs: i64,
    pub n_keys: i32,
    pub n_q: i32,
    pub n_heads: i32,
    pub num_splits: i32,
    pub causal: i32,
    pub scale_log2: f32,
}

impl AttnArgs {
    /// Strides of prefill over one request: q `[query][head][P+R]`, k_nope `[key][head][P]`, k_pe rows of
    /// `kb_rs` elements shared by the heads, v and out `[.][head][Dv]`; one split.
    pub fn prefill_layout(h: usize, p: usize, r: usize, dv: usize, kb_rs: usize) -> AttnArgs {
        let dqk = p + r;
        AttnArgs {
            q_rs: (h * dqk) as i64,
            q_hs: dqk as i64,
            ka_rs: (h * p) as i64,
            ka_hs: p as i64,
            kb_rs: kb_rs as i64,
            v_rs: (h * dv) as i64,
            v_hs: dv as i64,
            out_rs: (h * dv) as i64,
            out_hs: dv as i64,
            n_heads: h as i32,
            num_splits: 1,
            ..Default::default()
        }
    }
    /// Strides of absorbed decode over one request: q `[query][head][Lkv+R]`, cache rows `[latent | k_pe]`
    /// (the value is the latent: key and value read the same row), out `[query][head][Lkv]`.
    pub fn decode_layout(h: usize, lkv: usize, r: usize) -> AttnArgs {
        let row = lkv + r;
        AttnArgs {
            q_rs: (h * row) as i64,
            q_hs: row as i64,
            ka_rs: row as i64,
            kb_rs: row as i64,
            v_rs: row as i64,
            out_rs: (h * lkv) as i64,
            out_hs: lkv as i64,
            n_heads: h as i32,
            ..Default::default()
        }
    }
}

/// One attention module (prefill.cu or decode.cu) with its tensor-core and scalar kernels.
pub struct Attn {
    _m: Rc<Module>,
    /// (function, dynamic smem bytes, threads, rows per CTA); None: scalar only.
    mma: Option<(sys::CUfunction, u32, u32, u32)>,
    /// The kernel `run` launches.
    pub name: &'static str,
    scalar: sys::CUfunction,
    /// decode.cu's `combine_splits` (None for prefill).
    combine: Option<sys::CUfunction>,
    pub mqa: bool,
    pub tile: Option<Tile>,
}

impl Attn {
    /// Load `unit` with `dims`; use the first tile in `tiles` whose shared memory fits the device
    /// (none, or `force_scalar`: the scalar kernel only).
    pub fn load(
        k: &mut Kernels,
        gpu: &Gpu,
        unit: &str,
        dims: &Dims,
        tiles: &[Tile],
        force_scalar: bool,
    ) -> Result<Attn> {
        let mqa = unit == "decode.cu";
        let combine = |m: &Module| -> Result<Option<sys::CUfunction>> {
            Ok(if mqa {
                Some(m.func("combine_splits")?)
            } else {
                None
            })
        };
        let mut base = dims.defines();
        let use_mma = !force_scalar && dims.mma_ok(mqa);
        if use_mma {
            for t in tiles {
                let mut d = base.clone();
                d.extend(t.defines());
                let m = k.module(unit, d)?;
                let (config, name) = if t.wgmma {
                    // Present only when compiled for sm_90a with dims the kernel supports.
                    if !m.has_global("attn_wgmma_config") {
                        continue;
                    }
                    ("attn_wgmma_config", "attn_wgmma")
                } else {
                    ("attn_mma_config", "attn_mma")
                };
                let cfg = m.global_i32s(config, 4)?;
                let smem = cfg[0] as usize;
                if smem > gpu.info.smem_optin {
                    continue;
                }
                let f = m.func(name)?;
                unsafe {
                    drv::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                }
                .map_err(drv_err("raising the kernel's shared-memory limit"))?;
                let scalar = m.func("attn_scalar")?;
                return Ok(Attn {
                    combine: combine(&m)?,
                    _m: m,
                    mma: Some((f, smem as u32, cfg[1] as u32, cfg[2] as u32)),
                    name,
                    scalar,
                    mqa,
                    tile: Some(*t),
                });
            }
        }
        // The default tile (mma disabled for f32 / odd dims) still has to compile.
        base.extend(Tile::SCALAR_ONLY.defines());
        let m = k.module(unit, base)?;
        let scalar = m.func("attn_scalar")?;
        Ok(Attn {
            combine: combine(&m)?,
            _m: m,
            mma: None,
            name: "attn_scalar",
            scalar,
            mqa,
            tile: None,
        })
    }

    pub fn uses_mma(&self) -> bool {
        self.mma.is_some()
    }

    /// Launch over `batch` independent problems; heads `a.n_heads`, queries `a.n_q`.
    pub fn run(&self, a: &AttnArgs, batch: u32) -> Result<()> {
        let rows = |bm: u32| -> (u32, u32, u32) {
            if self.mqa {
                let r = (a.n_q * a.n_heads) as u32;
                (a.num_splits as u32, r.div_ceil(bm), batch)
            } else {
                ((a.n_q as u32).div_ceil(bm), a.n_heads as u32, batch)
            }
        };
        let mut p = [a as *const AttnArgs as *mut c_void];
        match self.mma {
            Some((f, smem, threads, bm)) => launch(f, self.name, rows(bm), threads, smem, &mut p),
            None => launch(self.scalar, "attn_scalar", rows(4), 128, 0, &mut p),
        }
    }

    /// Decode: merge the split partials (`a.part_out`, `a.part_lse`) of `rows` (query, head) rows into
    /// `a.out` and `a.lse` (decode.cu `combine_splits`; a batch folds into the rows through `a.out_rs`).
    pub fn combine(&self, a: &AttnArgs, rows: usize) -> Result<()> {
        let f = self.combine.ok_or_else(|| {
            Error::Environment("combine_splits belongs to the decode module".into())
        })?;
        let (po, pl, o, l) = (a.part_out, a.part_lse, a.out, a.lse);
        let (ors, ohs, hh, ns) = (a.out_rs, a.out_hs, a.n_heads, a.num_splits);
        launch(
            f,
            "combine_splits",
            (rows as u32, 1, 1),
            128,
            0,
            &mut [
                arg(&po),
                arg(&pl),
                arg(&o),
                arg(&ors),
                arg(&ohs),
                arg(&l),
                arg(&hh),
                arg(&ns),
            ],
        )
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attn_args_match_the_kernel_struct() {
        // kernels/attention.cuh: 10 pointers, 15 long longs, 5 ints and a float (checked again at run time
        // against the module's `attn_args_size`).
        assert_eq!(std::mem::size_of::<AttnArgs>(), 10 * 8 + 15 * 8 + 6 * 4);
        assert_eq!(std::mem::align_of::<AttnArgs>(), 8);
    }

    #[test]
    fn kernel_faults_are_exactly_the_defines_the_kernels_test() {
        // Every kernel fault has a switch in kernels/ and no host fault has one (a host fault's define in
        // a kernel would never be set, as `Dims::defines` passes kernel faults only).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let src: String = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
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
