//! The compiles of `kernels check` beyond the table: every kernel fault's define (it must compile and
//! change some unit's PTX) and every tile a device may choose (its config against the host's model).

use super::{
    check_plan, job_defines, job_label, jobs, ptx_attn_config, ptx_entries, DIM_SETS, FAULT_SETS,
};
use crate::backend::cuda::kernels::KERNEL_FAULTS;
use crate::backend::cuda::nvrtc::{self, Sources};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::precision::Dtype;
use crate::tiles::{decode_tiles, prefill_tiles, Dims, Tile};
use std::collections::HashMap;
use std::fmt::Write;

/// Kernels a module may hold beside another that does the same work, so a planted fault that changes
/// the first must change the second: (first, second, what the second is).
const SAME_WORK: [(&str, &str, &str); 3] = [
    ("attn_mma", "attn_wgmma", "the Hopper kernel"),
    (
        "attn_wgmma",
        "attn_wgmma_pairs",
        "the alternating-tile kernel",
    ),
    ("attn_mma", "attn_small", "the few-heads TMA kernel"),
];

/// Compile every unit with each kernel fault's define (`-D MLA_FAULT_…=1`): each must compile, and
/// must change the PTX of at least one unit (a misspelt switch changes nothing). `clean` holds the
/// clean PTX of the same jobs, by (dim set, dtype, job label).
pub(super) fn check_faults(
    src: &Sources,
    arch: &str,
    clean: &HashMap<(String, Dtype, String), Vec<u8>>,
    rep: &mut String,
) -> Result<usize> {
    writeln!(
        rep,
        "\nkernel faults, {arch}, on {}:",
        FAULT_SETS
            .iter()
            .map(|(n, d)| format!("{n} {}", d.name()))
            .collect::<Vec<_>>()
            .join(" and ")
    )
    .unwrap();
    // Every (fault, dim set, job) whose unit mentions the fault's define (a unit that does not cannot
    // change), compiled on every core.
    let mut specs = Vec::new();
    for f in KERNEL_FAULTS {
        let define = f.info().define;
        for &(name, dt) in FAULT_SETS.iter() {
            let &(_, lkv, r, p, dv, h, neox) = DIM_SETS
                .iter()
                .find(|d| d.0 == name)
                .expect("a named dim set");
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
                faults: Active::NONE.with(f),
            };
            for (unit, tile, kv) in jobs(lkv, r) {
                if src.mentions(unit, define) {
                    specs.push((
                        f,
                        name,
                        dt,
                        (unit, tile, kv),
                        job_defines(&dims, unit, tile, kv),
                    ));
                }
            }
        }
    }
    let work: Vec<nvrtc::Job> = specs
        .iter()
        .map(|(_, _, _, (unit, _, _), defs)| (*unit, defs.clone(), arch, true))
        .collect();
    let mut compiled = nvrtc::compile_all(src, &work).into_iter();
    let compiles = work.len();
    let mut at = 0;
    for f in KERNEL_FAULTS {
        let define = f.info().define;
        let mut changed = Vec::new();
        while at < specs.len() && specs[at].0 == f {
            let (_, name, dt, (unit, tile, kv), _) = specs[at];
            at += 1;
            let c = compiled.next().expect("one result per job").map_err(|e| {
                Error::Environment(format!("{unit} with {define}=1 for {arch}: {e}"))
            })?;
            let label = job_label(unit, tile, kv);
            let base = clean
                .get(&(name.to_string(), dt, label.clone()))
                .expect("the clean compile of every job");
            let (before, after) = (
                String::from_utf8_lossy(base),
                String::from_utf8_lossy(&c.ptx),
            );
            let (before, after) = (ptx_entries(&before), ptx_entries(&after));
            let kernels: Vec<&str> = after
                .iter()
                .filter(|(k, body)| {
                    before.iter().find(|(b, _)| b == k).map(|(_, b)| b) != Some(body)
                })
                .map(|(k, _)| *k)
                .collect();
            if kernels.is_empty() {
                continue;
            }
            // A fault in the attention core must reach every kernel of the module that does the
            // same work: where it changes `from`, it must change `to` too (when the module has it).
            for (from, to, what) in SAME_WORK {
                let has = after.iter().any(|(k, _)| *k == to);
                if has && kernels.contains(&from) && !kernels.contains(&to) {
                    return Err(Error::Environment(format!(
                        "{define}=1 changes {from} but not {to} ({name} {} {unit}): {what} misses the fault's switch",
                        dt.name()
                    )));
                }
            }
            changed.push(format!(
                "{name} {} {label} [{}]",
                dt.name(),
                kernels.join(", ")
            ));
        }
        if changed.is_empty() {
            return Err(Error::Environment(format!(
                "{define}=1 compiles but changes no kernel's PTX: its switch in kernels/ is missing or misspelt"
            )));
        }
        writeln!(rep, "  {define}: changes {}", changed.join("; ")).unwrap();
    }
    Ok(compiles)
}

/// Every tile a device may choose (not only the first ones the table shows), at DeepSeek dims in bf16:
/// each module's own config against the host's model (`check_plan`), so that the tile the host predicts
/// for a device with less shared memory is the one that loads there.
pub(super) fn check_all_tiles(src: &Sources, arch: &str, rep: &mut String) -> Result<usize> {
    let &(_, lkv, r, p, dv, h, neox) = &DIM_SETS[0];
    let dims = Dims {
        dtype: Dtype::Bf16,
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
    let mut jobs: Vec<(&str, Option<Tile>)> = Vec::new();
    for t in prefill_tiles() {
        jobs.push(("prefill.cu", Some(t)));
    }
    for t in decode_tiles(64).into_iter().chain(decode_tiles(1)) {
        if !jobs.contains(&("decode.cu", Some(t))) {
            jobs.push(("decode.cu", Some(t)));
        }
    }
    let work: Vec<nvrtc::Job> = jobs
        .iter()
        .map(|&(unit, tile)| (unit, job_defines(&dims, unit, tile, None), arch, false))
        .collect();
    let mut checked = 0;
    for (&(unit, tile), c) in jobs.iter().zip(nvrtc::compile_all(src, &work)) {
        let c = c?;
        let ptx = String::from_utf8_lossy(&c.ptx);
        let t = tile.expect("attention jobs have a tile");
        let mut found = 0;
        for k in ["attn_mma", "attn_wgmma"] {
            if let Some(cfg) = ptx_attn_config(&ptx, k) {
                check_plan(&dims, unit, t, k, cfg)
                    .map_err(|e| Error::Environment(format!("{arch} deepseek-v3 {e}")))?;
                found += 1;
                checked += 1;
            }
        }
        if found == 0 {
            return Err(Error::Environment(format!(
                "{arch} deepseek-v3 bf16 {unit} ({}): no attn_*_config in the PTX to check the tile model against",
                t.label()
            )));
        }
    }
    writeln!(
        rep,
        "\ntile model (src/tiles/choice.rs), {arch}, deepseek-v3 bf16: {} tiles, {checked} kernel configs match",
        jobs.len()
    )
    .unwrap();
    Ok(jobs.len())
}
