//! Kernel sources (embedded, or read from `--kernels DIR` at run time) and their NVRTC compilation to
//! PTX and CUBIN through the raw NVRTC API (cudarc's safe API has no CUBIN getter and no headers).
//! Compile errors come back as `Error::Environment` with the log rewritten to `path:line:` form.

use crate::error::{Error, Result};
use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// Every kernel file, headers first. The `.cu` files are compiled; the `.cuh` files are passed to NVRTC
/// as named headers.
pub const KERNEL_FILES: [(&str, &str); 20] = [
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    (
        "attention.cuh",
        include_str!("../../../kernels/attention.cuh"),
    ),
    (
        "sm90/decode/attn_wgmma.cuh",
        include_str!("../../../kernels/sm90/decode/attn_wgmma.cuh"),
    ),
    (
        "sm90/decode/attn_wgmma_pairs.cuh",
        include_str!("../../../kernels/sm90/decode/attn_wgmma_pairs.cuh"),
    ),
    (
        "sm90/decode/attn_small.cuh",
        include_str!("../../../kernels/sm90/decode/attn_small.cuh"),
    ),
    (
        "sm90/wgmma.cuh",
        include_str!("../../../kernels/sm90/wgmma.cuh"),
    ),
    (
        "sm90/tma.cuh",
        include_str!("../../../kernels/sm90/tma.cuh"),
    ),
    (
        "sm90/prefill/attn_wgmma.cuh",
        include_str!("../../../kernels/sm90/prefill/attn_wgmma.cuh"),
    ),
    // DeepSeek-V4 (docs/deepseek-v4.md): its index arithmetic, then its units.
    ("v4/v4.cuh", include_str!("../../../kernels/v4/v4.cuh")),
    (
        "norm_rope.cu",
        include_str!("../../../kernels/norm_rope.cu"),
    ),
    (
        "cache_write.cu",
        include_str!("../../../kernels/cache_write.cu"),
    ),
    ("prefill.cu", include_str!("../../../kernels/prefill.cu")),
    ("decode.cu", include_str!("../../../kernels/decode.cu")),
    ("fill.cu", include_str!("../../../kernels/fill.cu")),
    (
        "sparse_attn.cu",
        include_str!("../../../kernels/sparse_attn.cu"),
    ),
    ("indexer.cu", include_str!("../../../kernels/indexer.cu")),
    ("kpool.cu", include_str!("../../../kernels/kpool.cu")),
    ("v4/attn.cu", include_str!("../../../kernels/v4/attn.cu")),
    (
        "v4/compress.cu",
        include_str!("../../../kernels/v4/compress.cu"),
    ),
    (
        "v4/indexer.cu",
        include_str!("../../../kernels/v4/indexer.cu"),
    ),
];

/// The kernel sources a run uses.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Where they came from, for error messages ("kernels" for the embedded copy).
    pub dir: PathBuf,
    files: Vec<(String, String)>,
}

impl Sources {
    /// The repository's kernels/, compiled into the binary.
    pub fn embedded() -> Sources {
        Sources {
            dir: PathBuf::from("kernels"),
            files: KERNEL_FILES
                .iter()
                .map(|(n, s)| (n.to_string(), s.to_string()))
                .collect(),
        }
    }
    /// Edited kernels from a directory (every file of `KERNEL_FILES` must be there).
    pub fn from_dir(dir: &Path) -> Result<Sources> {
        let mut files = Vec::new();
        for (name, _) in KERNEL_FILES {
            let p = dir.join(name);
            let text = std::fs::read_to_string(&p).map_err(|e| {
                Error::Usage(format!(
                    "--kernels {}: cannot read {name}: {e} (the directory must hold {})",
                    dir.display(),
                    KERNEL_FILES.map(|f| f.0).join(", ")
                ))
            })?;
            files.push((name.to_string(), text));
        }
        Ok(Sources {
            dir: dir.to_path_buf(),
            files,
        })
    }
    pub fn load(dir: Option<&Path>) -> Result<Sources> {
        match dir {
            Some(d) => Sources::from_dir(d),
            None => Ok(Sources::embedded()),
        }
    }
    pub fn get(&self, name: &str) -> &str {
        &self
            .files
            .iter()
            .find(|(n, _)| n == name)
            .expect("known kernel file")
            .1
    }
    fn headers(&self) -> impl Iterator<Item = &(String, String)> {
        self.files.iter().filter(|(n, _)| n.ends_with(".cuh"))
    }
    /// Whether `word` occurs in `unit` or in a header it includes, transitively (`#include "…"` by
    /// its name here): a define the text does not mention cannot change the unit's code.
    pub fn mentions(&self, unit: &str, word: &str) -> bool {
        let mut seen = vec![unit];
        let mut next = 0;
        while next < seen.len() {
            let Some((_, text)) = self.files.iter().find(|(n, _)| n == seen[next]) else {
                next += 1;
                continue;
            };
            if text.contains(word) {
                return true;
            }
            for l in text.lines() {
                let inc = l.trim_start().strip_prefix("#include \"");
                if let Some(name) = inc.and_then(|r| r.split('"').next()) {
                    if !seen.contains(&name) {
                        seen.push(name);
                    }
                }
            }
            next += 1;
        }
        false
    }
    /// The compiled translation units.
    pub fn units(&self) -> Vec<&str> {
        self.files
            .iter()
            .filter(|(n, _)| n.ends_with(".cu"))
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

/// A compiled module's identity in the disk cache (`kernels::DiskCache`): SHA-256 over everything the
/// compile reads — the NVRTC version, the target, the include paths, the unit, every kernel source and
/// header text (an edited `--kernels` copy is another key) and the defines — as hex.
pub fn cache_key(
    src: &Sources,
    unit: &str,
    defines: &[(String, String)],
    arch: &str,
    nvrtc: (i32, i32),
) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut put = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    put(format!("nvrtc {}.{} {arch} {unit}", nvrtc.0, nvrtc.1).as_bytes());
    for inc in include_paths() {
        put(inc.as_bytes());
    }
    for (n, text) in &src.files {
        put(n.as_bytes());
        put(text.as_bytes());
    }
    for (k, v) in defines {
        put(format!("-D{k}={v}").as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Check that libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Environment(
            "NVRTC (libnvrtc.so.13) was not found: on a GPU host add /usr/local/cuda/lib64 to LD_LIBRARY_PATH; \
             elsewhere `pip install nvidia-cuda-nvrtc==13.0.88` and add its nvidia/cu13/lib to LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_present()?;
    let (mut a, mut b) = (0, 0);
    unsafe { sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| Error::Environment(format!("nvrtcVersion: {e}")))?;
    Ok((a, b))
}

/// Include directories holding cuda_bf16.h / cuda_fp16.h: $MLA_DIFF_CUDA_INCLUDE, then the toolkit's.
pub fn include_paths() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("MLA_DIFF_CUDA_INCLUDE") {
        v.extend(p.split(':').filter(|s| !s.is_empty()).map(String::from));
    }
    for cand in [
        std::env::var("CUDA_HOME")
            .ok()
            .map(|h| format!("{h}/include")),
        Some("/usr/local/cuda/include".to_string()),
    ]
    .into_iter()
    .flatten()
    {
        if Path::new(&cand).join("cuda_bf16.h").exists() && !v.contains(&cand) {
            v.push(cand);
        }
    }
    v
}

/// A compiled translation unit.
pub struct Compiled {
    /// NUL-terminated PTX.
    pub ptx: Vec<u8>,
    /// Device code for a real `sm_XX` target.
    pub cubin: Option<Vec<u8>>,
    /// The compiler log (ptxas resource usage with `ptxas_verbose`).
    pub log: String,
}

struct Prog(sys::nvrtcProgram);
impl Drop for Prog {
    fn drop(&mut self) {
        unsafe {
            let _ = sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn nv(r: sys::nvrtcResult, what: &str) -> Result<()> {
    r.result()
        .map_err(|e| Error::Environment(format!("NVRTC {what}: {e}")))
}

/// Rewrite NVRTC's `name(line): ` locations to `dir/name:line: `.
pub fn rewrite_log(log: &str, dir: &Path) -> String {
    log.lines()
        .map(|l| {
            if let Some(open) = l.find('(') {
                let (name, rest) = l.split_at(open);
                if let Some(close) = rest.find("): ") {
                    let num = &rest[1..close];
                    if !name.is_empty()
                        && !name.contains(' ')
                        && (name.ends_with(".cu") || name.ends_with(".cuh"))
                        && num.chars().all(|c| c.is_ascii_digit())
                    {
                        return format!(
                            "{}:{}: {}",
                            dir.join(name).display(),
                            num,
                            &rest[close + 3..]
                        );
                    }
                }
            }
            l.to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// One [`compile`]'s arguments: unit, defines, arch, ptxas_verbose.
pub type Job<'a> = (&'a str, Vec<(String, String)>, &'a str, bool);

/// [`compile`] every job, on as many threads as the machine has cores (NVRTC compiles independent
/// programs concurrently; `kernels check` is hundreds of compiles), the results in the jobs' order.
pub fn compile_all(src: &Sources, jobs: &[Job]) -> Vec<Result<Compiled>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Mutex::new(Vec::with_capacity(jobs.len()));
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((unit, defines, arch, verbose)) = jobs.get(i) else {
                    break;
                };
                let r = compile(src, unit, defines, arch, *verbose);
                done.lock().unwrap_or_else(|e| e.into_inner()).push((i, r));
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Compile one `.cu` file with `-D` defines for `arch` ("sm_90", "compute_90").
pub fn compile(
    src: &Sources,
    unit: &str,
    defines: &[(String, String)],
    arch: &str,
    ptxas_verbose: bool,
) -> Result<Compiled> {
    nvrtc_present()?;
    let code = CString::new(src.get(unit))
        .map_err(|_| Error::Usage(format!("{unit}: NUL byte in source")))?;
    let name = CString::new(unit).unwrap();
    let hdrs: Vec<(CString, CString)> = src
        .headers()
        .map(|(n, s)| {
            (
                CString::new(s.as_str()).unwrap_or_default(),
                CString::new(n.as_str()).unwrap(),
            )
        })
        .collect();
    let hsrc: Vec<*const std::ffi::c_char> = hdrs.iter().map(|h| h.0.as_ptr()).collect();
    let hname: Vec<*const std::ffi::c_char> = hdrs.iter().map(|h| h.1.as_ptr()).collect();
    let mut prog = Prog(std::ptr::null_mut());
    nv(
        unsafe {
            sys::nvrtcCreateProgram(
                &mut prog.0,
                code.as_ptr(),
                name.as_ptr(),
                hdrs.len() as i32,
                hsrc.as_ptr(),
                hname.as_ptr(),
            )
        },
        "create program",
    )?;
    let mut opts: Vec<String> = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    if ptxas_verbose {
        opts.push("--ptxas-options=-v".into());
    }
    for inc in include_paths() {
        opts.push(format!("--include-path={inc}"));
    }
    for (k, v) in defines {
        opts.push(format!("-D{k}={v}"));
    }
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).unwrap())
        .collect();
    let optp: Vec<*const std::ffi::c_char> = copts.iter().map(|o| o.as_ptr()).collect();
    let rc = unsafe { sys::nvrtcCompileProgram(prog.0, optp.len() as i32, optp.as_ptr()) };
    let log = {
        let mut n = 0usize;
        nv(
            unsafe { sys::nvrtcGetProgramLogSize(prog.0, &mut n) },
            "log size",
        )?;
        let mut buf = vec![0u8; n.max(1)];
        nv(
            unsafe { sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut _) },
            "log",
        )?;
        CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let log = rewrite_log(&log, &src.dir);
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        let defs: Vec<String> = defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let hint = if log.contains("cuda_bf16.h") || log.contains("cuda_fp16.h") {
            "\n(hint: set MLA_DIFF_CUDA_INCLUDE to a directory with cuda_bf16.h, e.g. /usr/local/cuda/include or a pip nvidia-cuda-runtime's nvidia/cu13/include)"
        } else {
            ""
        };
        return Err(Error::Environment(format!(
            "NVRTC failed to compile {} for {arch} ({}):\n{}{hint}",
            src.dir.join(unit).display(),
            defs.join(" "),
            log.trim_end()
        )));
    }
    let mut n = 0usize;
    nv(unsafe { sys::nvrtcGetPTXSize(prog.0, &mut n) }, "PTX size")?;
    let mut ptx = vec![0u8; n];
    nv(
        unsafe { sys::nvrtcGetPTX(prog.0, ptx.as_mut_ptr() as *mut _) },
        "PTX",
    )?;
    let cubin = if arch.starts_with("sm_") {
        let mut n = 0usize;
        nv(
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut n) },
            "CUBIN size",
        )?;
        let mut c = vec![0u8; n];
        nv(
            unsafe { sys::nvrtcGetCUBIN(prog.0, c.as_mut_ptr() as *mut _) },
            "CUBIN",
        )?;
        Some(c)
    } else {
        None
    };
    Ok(Compiled { ptx, cubin, log })
}

/// ptxas resource usage of one kernel, parsed from a `--ptxas-options=-v` log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack: u32,
    pub smem_static: u32,
}

pub fn parse_ptxas(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let num_before = |s: &str, key: &str| -> Option<u32> {
        let i = s.find(key)?;
        s[..i].split_whitespace().last()?.parse().ok()
    };
    for l in log.lines() {
        if let Some(i) = l.find("Function properties for ") {
            out.push(KernelResources {
                name: l[i + 24..].trim().to_string(),
                ..Default::default()
            });
        } else if let Some(k) = out.last_mut() {
            if l.contains("bytes stack frame") {
                k.stack = num_before(l, "bytes stack frame").unwrap_or(0);
                k.spill_stores = num_before(l, "bytes spill stores").unwrap_or(0);
                k.spill_loads = num_before(l, "bytes spill loads").unwrap_or(0);
            } else if l.contains("Used ") && l.contains("registers") {
                k.registers = num_before(l, "registers").unwrap_or(0);
                if let Some(i) = l.find("bytes smem") {
                    k.smem_static = l[..i]
                        .split_whitespace()
                        .last()
                        .and_then(|x| x.parse().ok())
                        .unwrap_or(0);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unit_mentions_what_its_headers_say() {
        let src = Sources::embedded();
        // attn_small.cuh is reached from decode.cu only, through no other header.
        assert!(src.mentions("decode.cu", "MLA_FAULT_SMALL_RING_WRAP"));
        assert!(!src.mentions("prefill.cu", "MLA_FAULT_SMALL_RING_WRAP"));
        // Two levels down: decode.cu -> sm90/decode/attn_wgmma.cuh -> sm90/decode/attn_wgmma_pairs.cuh.
        assert!(src.mentions("decode.cu", "MLA_FAULT_PAIRS_HANDOVER_STALE"));
        assert!(!src.mentions("fill.cu", "attn_wgmma"));
    }

    #[test]
    fn log_locations_become_path_line() {
        let log = "attention.cuh(42): error: identifier \"x\" is undefined\nother line";
        let r = rewrite_log(log, Path::new("kernels"));
        assert_eq!(
            r,
            "kernels/attention.cuh:42: error: identifier \"x\" is undefined\nother line"
        );
    }

    #[test]
    fn ptxas_figures_are_parsed() {
        let log = "ptxas info    : Compiling entry function 'attn_mma' for 'sm_90'\n\
ptxas info    : Function properties for attn_mma\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 168 registers, used 1 barriers, 248 bytes cmem[0]\n";
        let k = parse_ptxas(log);
        assert_eq!(k.len(), 1);
        assert_eq!(k[0].name, "attn_mma");
        assert_eq!(
            (
                k[0].registers,
                k[0].spill_stores,
                k[0].spill_loads,
                k[0].stack
            ),
            (168, 4, 12, 8)
        );
    }
}
