//! `mla-diff kernels check`: compile every kernel with NVRTC (no GPU needed) to PTX and CUBIN for several
//! architectures, model dims and storage types; report ptxas registers, spills and shared memory.

use crate::backend::cuda::launch::kv_format_code;
use crate::backend::cuda::nvrtc::{self, parse_ptxas, Sources};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::kv_format::KvFormat;
use crate::precision::Dtype;
use crate::tiles::choice::{self as plan, smem_limit, Widths};
use crate::tiles::{decode_tiles, prefill_tiles, Dims, Tile};
use std::collections::HashMap;
use std::fmt::Write;

mod variants;

/// Named dim sets: (name, Lkv, R, P, Dv, H, NEOX rope).
pub const DIM_SETS: [(&str, usize, usize, usize, usize, usize, bool); 5] = [
    ("deepseek-v3", 512, 64, 128, 128, 128, false),
    ("glm-5", 512, 64, 192, 256, 64, false),
    ("minicpm3", 256, 32, 64, 64, 40, true),
    // DeepSeek-V4's 448 + 64 row: FlashMLA V4.1's cache formats (fp8_v41, fp4_v41)
    ("v4-row", 448, 64, 128, 128, 64, false),
    // dims that are not multiples of 8: only the scalar attention applies
    ("odd", 20, 6, 10, 12, 3, false),
];

/// Parse a kernel's `{name}_config` (dynamic smem bytes, threads, rows, keys) from PTX.
pub fn ptx_attn_config(ptx: &str, kernel: &str) -> Option<[i32; 4]> {
    let key = format!("{kernel}_config[");
    let l = ptx.lines().find(|l| l.contains(&key))?;
    let inner = &l[l.find('{')? + 1..l.find('}')?];
    let mut bytes: Vec<u8> = inner
        .split(',')
        .filter_map(|b| b.trim().parse().ok())
        .collect();
    bytes.resize(16, 0);
    let w = |i: usize| {
        i32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    Some([w(0), w(1), w(2), w(3)])
}

/// The (dim set, dtype) pairs each kernel fault is compiled for: the tensor-core path on a NORM model and
/// the scalar path on a NEOX one (so each rope fault changes code in one of them).
const FAULT_SETS: [(&str, Dtype); 2] = [("deepseek-v3", Dtype::Bf16), ("minicpm3", Dtype::F32)];

/// The architecture the kernel faults are compiled for: sm_90a if asked for (its decode module holds both
/// tensor-core kernels), else sm_90, else the first one.
fn fault_arch(archs: &[String]) -> Option<&String> {
    ["sm_90a", "sm_90"]
        .iter()
        .find_map(|p| archs.iter().find(|a| a == p))
        .or(archs.first())
}

/// One compile job: unit, attention tile, and the quantized cache format cache_write.cu's writer is
/// compiled for (`MLA_KV_FORMAT`).
type Job = (&'static str, Option<Tile>, Option<KvFormat>);

/// The jobs of a model's dims: every unit, and cache_write.cu once per per-row cache format the dims fit.
fn jobs(lkv: usize, r: usize) -> Vec<Job> {
    let mut j: Vec<Job> = vec![
        ("norm_rope.cu", None, None),
        ("cache_write.cu", None, None),
        ("fill.cu", None, None),
        ("sparse_attn.cu", None, None),
        ("indexer.cu", None, None),
        ("kpool.cu", None, None),
        ("v4/attn.cu", None, None),
        ("v4/compress.cu", None, None),
        ("v4/indexer.cu", None, None),
        ("prefill.cu", Some(prefill_tiles()[0]), None),
        ("decode.cu", Some(decode_tiles(64)[0]), None),
        ("decode.cu", Some(decode_tiles(1)[0]), None),
    ];
    for f in KvFormat::ALL {
        if kv_format_code(f).is_some() && f.fits(lkv, r).is_ok() {
            j.push(("cache_write.cu", None, Some(f)));
        }
    }
    j
}

fn job_defines(
    dims: &Dims,
    unit: &str,
    tile: Option<Tile>,
    kv: Option<KvFormat>,
) -> Vec<(String, String)> {
    let mut defs = dims.defines();
    if let Some(t) = tile {
        defs.extend(t.defines());
    }
    if let Some(code) = kv.and_then(kv_format_code) {
        defs.push(("MLA_KV_FORMAT".into(), code.to_string()));
    }
    // DeepSeek-V4's units at the dim set's row width as their head width (v4-row: V4-Flash's 512).
    if unit.starts_with("v4/") {
        defs.push(("V4_D".into(), (dims.lkv + dims.r).to_string()));
    }
    defs
}

/// The file name (without extension) `--dump` writes a job's PTX and CUBIN under.
fn dump_stem(arch: &str, name: &str, dt: Dtype, (unit, tile, kv): Job) -> String {
    format!(
        "{arch}-{name}-{}-{}{}{}",
        dt.name(),
        unit.trim_end_matches(".cu").replace('/', "-"),
        tile.map(|t| format!("-{}", t.label().replace([' ', ':', '/'], "-")))
            .unwrap_or_default(),
        kv.map(|f| format!("-{f}")).unwrap_or_default()
    )
}

fn job_label(unit: &str, tile: Option<Tile>, kv: Option<KvFormat>) -> String {
    match (tile, kv) {
        (Some(t), _) => format!("{unit} ({})", t.label()),
        (None, Some(f)) => format!("{unit} ({f})"),
        (None, None) => unit.to_string(),
    }
}

/// The host's model of a tensor-core kernel (`plan`: shared memory, threads, rows per CTA, keys per tile;
/// what the tile choice is predicted from and coverage's geometry) against the kernel's own
/// `attn_*_config`, so that a kernel edit that changes its layout cannot leave the two apart.
fn check_plan(dims: &Dims, unit: &str, t: Tile, kernel: &str, c: [i32; 4]) -> Result<()> {
    let decode = unit == "decode.cu";
    let g = plan::geometry(
        Some(Tile {
            wgmma: kernel == "attn_wgmma",
            ..t
        }),
        decode,
    );
    let want = match kernel {
        // Decode's kernel: two warpgroups; prefill's: one per 64 rows and the producer warpgroup.
        "attn_wgmma" => [
            plan::wgmma_smem(&Widths::of(dims, decode), &t),
            if decode {
                256
            } else {
                32 * t.wm as usize + 128
            },
        ],
        "attn_mma" => [
            plan::mma_smem(&Widths::of(dims, decode), &t),
            32 * (t.wm * t.wn) as usize,
        ],
        _ => return Ok(()),
    };
    let want = [want[0], want[1], g.rows_per_cta, g.keys_per_tile];
    let got = c.map(|x| x as usize);
    if got != want {
        return Err(Error::Environment(format!(
            "{} {unit} ({}) {kernel}: the kernel states {{smem, threads, rows, keys}} = {got:?}, src/tiles/choice.rs predicts {want:?}",
            dims.dtype.name(),
            t.label()
        )));
    }
    Ok(())
}

/// A compiler log line worth failing on: a warning, or ptxas's C75xx "Potential Performance Loss" notes
/// (wgmma serialized: C7510 extern calls, C7511 registers, C7515 accumulators touched mid-pipeline, …),
/// which ptxas prints at *info* level, so a filter on "warning" alone never sees them.
pub fn is_ptxas_warning(line: &str) -> bool {
    line.contains("warning") || line.contains("Potential Performance Loss") || line.contains("(C75")
}

/// The `.entry` functions of a PTX file with their text (up to the next entry).
fn ptx_entries(ptx: &str) -> Vec<(&str, &str)> {
    let starts: Vec<usize> = ptx.match_indices(".entry ").map(|(i, _)| i).collect();
    starts
        .iter()
        .enumerate()
        .map(|(n, &i)| {
            let end = starts.get(n + 1).copied().unwrap_or(ptx.len());
            let text = &ptx[i..end];
            let name = text[7..].split(['(', ' ', '\n']).next().unwrap_or("");
            (name, text)
        })
        .collect()
}

pub struct CheckSummary {
    pub report: String,
    pub compiles: usize,
    pub spilling: Vec<String>,
    /// ptxas warnings, e.g. wgmma serialized (the Hopper kernel then runs without its pipelining).
    pub warnings: Vec<String>,
}

/// `dump`: also write each compile's PTX and CUBIN there (for `cuobjdump --dump-sass`).
pub fn kernels_check(
    archs: &[String],
    kernels_dir: Option<&std::path::Path>,
    dump: Option<&std::path::Path>,
) -> Result<CheckSummary> {
    let src = Sources::load(kernels_dir)?;
    let (maj, min) = nvrtc::nvrtc_version()?;
    // `--dump DIR` makes DIR, as `-o` makes a file (it failed on the first write when DIR was new).
    if let Some(d) = dump {
        std::fs::create_dir_all(d)
            .map_err(|e| Error::io(format!("creating --dump {}", d.display()), e))?;
    }
    let mut sv = Survey::new(&src, maj, min);
    let fault_arch = fault_arch(archs);
    // Every job of the table, compiled on every core, then surveyed in the table's order.
    let mut specs = Vec::new();
    for arch in archs {
        for &(name, lkv, r, p, dv, h, neox) in DIM_SETS.iter() {
            for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
                let dims = Dims {
                    dtype: dt,
                    lkv,
                    r,
                    p,
                    dv,
                    h,
                    page: 64,
                    neox,
                    debug: true,
                    faults: Active::NONE,
                };
                let keep_clean = Some(arch) == fault_arch && FAULT_SETS.contains(&(name, dt));
                for job in jobs(lkv, r) {
                    specs.push((arch, name, dims, job, keep_clean));
                }
            }
        }
    }
    let work: Vec<nvrtc::Job> = specs
        .iter()
        .map(|(arch, _, dims, (unit, tile, kv), _)| {
            (
                *unit,
                job_defines(dims, unit, *tile, *kv),
                arch.as_str(),
                true,
            )
        })
        .collect();
    for ((arch, name, dims, job, keep_clean), c) in
        specs.iter().zip(nvrtc::compile_all(&src, &work))
    {
        sv.survey(arch, name, dims, *job, *keep_clean, dump, c?)?;
    }
    if !sv.smem_model.is_empty() {
        return Err(Error::Environment(format!(
            "the host's shared-memory model of the attention kernels (src/tiles/choice.rs, used by `lint`) disagrees with the compiled kernels: {}",
            sv.smem_model.join("; ")
        )));
    }
    if let Some(arch) = fault_arch {
        sv.compiles += variants::check_faults(&src, arch, &sv.clean_ptx, &mut sv.rep)?;
        sv.compiles += variants::check_all_tiles(&src, arch, &mut sv.rep)?;
    }
    Ok(CheckSummary {
        report: sv.rep,
        compiles: sv.compiles,
        spilling: sv.spilling,
        warnings: sv.warnings,
    })
}

/// What the table's compiles found so far: the report, what spills or warns, where the host's
/// shared-memory model disagrees with a kernel, and the clean PTX the fault compiles are diffed against.
struct Survey {
    rep: String,
    compiles: usize,
    spilling: Vec<String>,
    warnings: Vec<String>,
    smem_model: Vec<String>,
    clean_ptx: HashMap<(String, Dtype, String), Vec<u8>>,
}

impl Survey {
    /// The report's first lines: the compiler and sources, then the table's header.
    fn new(src: &Sources, maj: i32, min: i32) -> Survey {
        let inc = nvrtc::include_paths();
        let mut rep = String::new();
        writeln!(
            rep,
            "NVRTC {maj}.{min}; kernels from {}; include path {}",
            src.dir.display(),
            if inc.is_empty() {
                "(none: set MLA_DIFF_CUDA_INCLUDE)".to_string()
            } else {
                inc.join(":")
            }
        )
        .unwrap();
        writeln!(
            rep,
            "{:<7} {:<12} {:<5} {:<15} {:<28} {:<15} {:>5} {:>7} {:>7} {:>6} {:>9}",
            "arch",
            "dims",
            "dtype",
            "unit",
            "tile",
            "kernel",
            "regs",
            "spill-st",
            "spill-ld",
            "stack",
            "dyn-smem"
        )
        .unwrap();
        Survey {
            rep,
            compiles: 0,
            spilling: Vec::new(),
            warnings: Vec::new(),
            smem_model: Vec::new(),
            clean_ptx: HashMap::new(),
        }
    }

    /// One job compiled for `arch` at `dims` (dim set `name`): it must give PTX and an ELF CUBIN; its
    /// ptxas warnings, its kernels' shared memory against the host's model, and a row per kernel.
    #[allow(clippy::too_many_arguments)]
    fn survey(
        &mut self,
        arch: &str,
        name: &str,
        dims: &Dims,
        job: Job,
        keep_clean: bool,
        dump: Option<&std::path::Path>,
        c: nvrtc::Compiled,
    ) -> Result<()> {
        let (unit, tile, kv) = job;
        let dt = dims.dtype;
        self.compiles += 1;
        if keep_clean {
            self.clean_ptx.insert(
                (name.to_string(), dt, job_label(unit, tile, kv)),
                c.ptx.clone(),
            );
        }
        if c.cubin
            .as_ref()
            .is_none_or(|b| b.len() < 4 || &b[..4] != b"\x7fELF")
        {
            return Err(Error::Environment(format!(
                "{unit} for {arch}: NVRTC returned no ELF CUBIN"
            )));
        }
        if let Some(d) = dump {
            let stem = dump_stem(arch, name, dt, job);
            let w = |ext: &str, bytes: &[u8]| {
                let p = d.join(format!("{stem}.{ext}"));
                std::fs::write(&p, bytes)
                    .map_err(|e| Error::io(format!("writing {}", p.display()), e))
            };
            w("ptx", c.ptx.strip_suffix(&[0]).unwrap_or(&c.ptx))?;
            w("cubin", c.cubin.as_deref().unwrap_or_default())?;
        }
        let ptx = String::from_utf8_lossy(&c.ptx);
        if !ptx.contains(".target") {
            return Err(Error::Environment(format!(
                "{unit} for {arch}: NVRTC returned no PTX"
            )));
        }
        for w in c.log.lines().filter(|l| is_ptxas_warning(l)) {
            self.warnings
                .push(format!("{arch} {name} {} {unit}: {}", dt.name(), w.trim()));
        }
        let kernels = parse_ptxas(&c.log);
        // On sm_90a a decode module carries both tensor-core kernels: show the one its tile runs.
        let runs_wgmma =
            tile.is_some_and(|t| t.wgmma) && kernels.iter().any(|k| k.name == "attn_wgmma");
        // The host's model of the attention kernels' shared memory (src/tiles/choice.rs, which `lint`
        // reports from) must say what the compiled kernel says, for every kernel built.
        for k in kernels
            .iter()
            .filter(|k| k.name == "attn_mma" || k.name == "attn_wgmma")
        {
            let (Some(t), Some(cfg)) = (tile, ptx_attn_config(&ptx, &k.name)) else {
                continue;
            };
            let w = if unit == "decode.cu" {
                Widths::decode(dims)
            } else {
                Widths::prefill(dims)
            };
            let host = if k.name == "attn_wgmma" {
                plan::wgmma_smem(&w, &t)
            } else {
                plan::mma_smem(&w, &t)
            };
            if host != cfg[0] as usize {
                self.smem_model.push(format!(
                    "{arch} {name} {} {unit} {} {}: kernel {} bytes, src/tiles/choice.rs {host}",
                    dt.name(),
                    t.label(),
                    k.name,
                    cfg[0]
                ));
            }
        }
        for k in kernels {
            if (k.name == "attn_wgmma" && !runs_wgmma) || (k.name == "attn_mma" && runs_wgmma) {
                continue;
            }
            if let (Some(t), Some(c)) = (tile, ptx_attn_config(&ptx, &k.name)) {
                check_plan(dims, unit, t, &k.name, c)
                    .map_err(|e| Error::Environment(format!("{arch} {name} {e}")))?;
            }
            self.row(arch, name, dt, unit, tile, runs_wgmma, &k, &ptx);
        }
        Ok(())
    }

    /// A kernel's row of the table (its dynamic shared memory, for the attention kernels, against the
    /// architecture's limit); a spilling kernel is listed.
    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        arch: &str,
        name: &str,
        dt: Dtype,
        unit: &str,
        tile: Option<Tile>,
        runs_wgmma: bool,
        k: &nvrtc::KernelResources,
        ptx: &str,
    ) {
        let smem = if k.name == "attn_mma" || k.name == "attn_wgmma" {
            ptx_attn_config(ptx, &k.name)
                .map(|c| {
                    let fits = smem_limit(arch)
                        .map(|l| if c[0] as usize <= l { "" } else { " (too big)" })
                        .unwrap_or("");
                    format!("{}{fits}", c[0])
                })
                .unwrap_or_default()
        } else {
            String::new()
        };
        writeln!(
            self.rep,
            "{:<7} {:<12} {:<5} {:<15} {:<28} {:<15} {:>5} {:>7} {:>7} {:>6} {:>9}",
            arch,
            name,
            dt.name(),
            unit,
            tile.map(|t| Tile {
                wgmma: runs_wgmma,
                ..t
            }
            .label())
                .unwrap_or("-".into()),
            k.name,
            k.registers,
            k.spill_stores,
            k.spill_loads,
            k.stack,
            smem
        )
        .unwrap();
        if k.spill_stores > 0 || k.spill_loads > 0 {
            self.spilling
                .push(format!("{arch} {name} {} {unit} {}", dt.name(), k.name));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_is_split_into_entries() {
        let ptx = ".global .b8 x[4];\n.visible .entry a(\n.param .u64 p)\n{ ret; }\n.visible .entry bb(\n)\n{ exit; }\n";
        let e = ptx_entries(ptx);
        assert_eq!(e.iter().map(|x| x.0).collect::<Vec<_>>(), ["a", "bb"]);
        assert!(e[0].1.contains("ret;") && !e[0].1.contains("exit;"));
        assert!(e[1].1.ends_with("{ exit; }\n"));
    }

    #[test]
    fn faults_compile_for_hopper_first() {
        let v = |s: &[&str]| s.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        assert_eq!(
            fault_arch(&v(&["sm_80", "sm_90", "sm_90a"])).unwrap(),
            "sm_90a"
        );
        assert_eq!(fault_arch(&v(&["sm_80", "sm_90"])).unwrap(), "sm_90");
        assert_eq!(fault_arch(&v(&["sm_120"])).unwrap(), "sm_120");
        assert_eq!(fault_arch(&[]), None);
    }

    #[test]
    fn wgmma_serialization_notes_count_as_warnings() {
        // ptxas prints these at info level (NVIDIA/cutlass#1840, TensorRT-LLM#2116).
        let c7511 = "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function 'attn_wgmma'";
        let c7515 = "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function 'attn_wgmma'";
        assert!(is_ptxas_warning(c7511) && is_ptxas_warning(c7515));
        assert!(is_ptxas_warning("ptxas warning : Registers are spilled"));
        assert!(!is_ptxas_warning(
            "ptxas info    : Used 168 registers, 464 bytes cmem[0]"
        ));
        assert!(!is_ptxas_warning(
            "ptxas info    : Function properties for attn_wgmma"
        ));
    }

    #[test]
    fn attn_config_is_read_from_ptx() {
        let ptx = ".global .align 4 .b8 attn_mma_config[16] = {0, 136, 3, 0, 0, 1, 0, 0, 64, 0, 0, 0, 64};";
        assert_eq!(
            ptx_attn_config(ptx, "attn_mma"),
            Some([231_424, 256, 64, 64])
        );
        assert_eq!(ptx_attn_config(ptx, "attn_wgmma"), None);
    }
}
