//! Which attention kernel and tile the CUDA backend launches for a model's dims on a device, worked out
//! on the host without a GPU or NVRTC: the one model of that choice, for `lint --backend cuda`, the
//! coverage section and `run`'s default schedule, sweep's key tiles, and the backend's own check of
//! what it loaded (a notice when the device disagrees).
//!
//! `Attn::load` (backend/cuda/attn.rs) walks a tile list (`decode_tiles` / `prefill_tiles`), compiles
//! each and takes the first whose shared memory fits the device, else the scalar kernel. The conditions it
//! meets at run time are the preprocessor guards of kernels/attention.cuh, sm90/decode/attn_wgmma.cuh and
//! sm90/prefill/attn_wgmma.cuh and the shared-memory sizes they export (`attn_mma_config`, `attn_wgmma_config`);
//! this module restates them. `mla-diff kernels check` compares every predicted shared-memory size, row
//! count and tile width with the sizes the compiled PTX holds for every job it compiles and fails if they
//! ever disagree, so the restatement cannot drift silently.

use super::KeyTile;
use super::{decode_tiles, prefill_tiles, Dims, Tile};
use crate::kernel_use::{Family, Geometry, KernelUse, Phase, Production};
use crate::precision::Dtype;

/// What the tile choice needs to know about a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Compute capability.
    pub cc: (i32, i32),
    /// Largest dynamic shared memory per block (opt-in), bytes.
    pub smem_optin: usize,
}

/// H100 / H200: sm_90 (compiled as sm_90a, so the wgmma kernel exists), 227 KB of shared memory.
pub const HOPPER: Caps = Caps {
    cc: (9, 0),
    smem_optin: 232_448,
};
/// A100: sm_80, 163 KB.
pub const AMPERE: Caps = Caps {
    cc: (8, 0),
    smem_optin: 166_912,
};

impl Caps {
    /// The NVRTC target the backend compiles for on this device (`arch`).
    pub fn arch(&self) -> String {
        arch(self.cc)
    }
}

/// NVRTC target for compute capability `cc`, e.g. "sm_80". Hopper gets the arch-specific "sm_90a",
/// whose wgmma the attention kernels use (the image then runs on sm_90 devices only, which is all it is
/// built for).
pub fn arch(cc: (i32, i32)) -> String {
    match cc {
        (9, 0) => "sm_90a".to_string(),
        (major, minor) => format!("sm_{major}{minor}"),
    }
}

/// Largest dynamic shared memory per block (opt-in), by NVRTC target.
pub fn smem_limit(arch: &str) -> Option<usize> {
    match arch {
        "sm_90" | "sm_90a" | "sm_100" | "sm_100a" => Some(232_448),
        "sm_80" | "sm_87" => Some(166_912),
        "sm_86" | "sm_89" | "sm_120" | "sm_120a" => Some(101_376),
        _ => None,
    }
}

/// The attention widths an attention unit is compiled with (`ATT_DA`, `ATT_DB`, `ATT_DV`, `ATT_V_IN_K`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Widths {
    pub da: usize,
    pub db: usize,
    pub dv: usize,
    pub v_in_k: bool,
}

impl Widths {
    /// decode.cu: absorbed MQA, keys `[latent | k_pe]`, values the latent inside the key row.
    pub fn decode(d: &Dims) -> Widths {
        Widths {
            da: d.lkv + d.r,
            db: 0,
            dv: d.lkv,
            v_in_k: true,
        }
    }
    /// The widths of decode.cu (`decode`) or prefill.cu.
    pub fn of(d: &Dims, decode: bool) -> Widths {
        if decode {
            Widths::decode(d)
        } else {
            Widths::prefill(d)
        }
    }
    /// prefill.cu: decompressed MHA, keys `[k_nope | k_pe]`, values of their own.
    pub fn prefill(d: &Dims) -> Widths {
        Widths {
            da: d.p,
            db: d.r,
            dv: d.dv,
            v_in_k: false,
        }
    }
}

/// Why the tensor-core kernel (`attn_mma`) does not apply, or `None` when it does: attention.cuh compiles
/// it only for 16-bit storage and widths that are multiples of 8 (16-byte copies).
pub fn mma_blocker(dtype: Dtype, w: &Widths) -> Option<String> {
    if dtype == Dtype::F32 {
        return Some("f32 storage (the tensor-core kernels take bf16/fp16 only)".into());
    }
    let bad: Vec<String> = [("key A", w.da), ("key B", w.db), ("value", w.dv)]
        .iter()
        .filter(|(_, v)| v % 8 != 0)
        .map(|(n, v)| format!("{n} width {v}"))
        .collect();
    (!bad.is_empty()).then(|| format!("{} not a multiple of 8", bad.join(", ")))
}

/// `ATT_SMEM` of attention.cuh for `attn_mma` (bytes): Q tile, `stages` key (and value) tiles, the P
/// tile when P goes through shared memory, the row-max/row-sum exchange.
pub fn mma_smem(w: &Widths, t: &Tile) -> usize {
    let (wm, wn, bn) = (t.wm as usize, t.wn as usize, t.bn as usize);
    let (stages, pvm, smt, swn) = (
        t.stages as usize,
        t.pvm as usize,
        t.smt as usize,
        t.swn as usize,
    );
    let bm = 16 * wm;
    let dqkp = (w.da + w.db).div_ceil(64) * 64;
    let pwn = wn * pvm;
    let dvp = w.dv.div_ceil(16 * pwn) * (16 * pwn);
    let sq = bm * dqkp * 2;
    let sk = bn * dqkp * 2;
    let sv = if w.v_in_k {
        0
    } else {
        bn * (dvp.div_ceil(64) * 64 / 8) * 8 * 2
    };
    let snw = (wm / smt) * swn;
    let psmem = swn > 1 || pvm > 1 || smt > 1 || snw != wm * wn;
    let sp = if psmem { bm * (bn + 8) * 2 } else { 0 };
    let sred = (swn + 1) * bm * 4;
    sq + stages * (sk + sv) + sp + sred
}

/// Why Hopper's warpgroup-MMA kernel (`attn_wgmma`) does not exist in the module, or `None` when it
/// does. Decode: sm90/decode/attn_wgmma.cuh's guard (sm_90a, absorbed decode, 16-bit storage, a latent of 512
/// or 256, a key row that is a multiple of 8, and a fallback tile of 64 rows); prefill:
/// sm90/prefill/attn_wgmma.cuh's (sm_90a, 16-bit storage, values at most 256 wide, a fallback tile of 64 or 128
/// rows and 64, 80 or 128 keys; widths multiples of 8, as `mma_blocker` already requires).
pub fn wgmma_blocker(arch: &str, dtype: Dtype, w: &Widths, fallback: &Tile) -> Option<String> {
    let mut why = Vec::new();
    if arch != "sm_90a" {
        why.push(format!("target {arch} (it is compiled for sm_90a only)"));
    }
    if dtype == Dtype::F32 {
        why.push("f32 storage".to_string());
    }
    if !w.v_in_k {
        if w.dv > 256 {
            why.push(format!(
                "value width {} (one wgmma of at most 256 columns)",
                w.dv
            ));
        }
        if !(fallback.wm == 4 || fallback.wm == 8) || ![64, 80, 128].contains(&fallback.bn) {
            why.push("a tile of other than 64 or 128 rows and 64, 80 or 128 keys".to_string());
        }
        return (!why.is_empty()).then(|| why.join(", "));
    }
    if !(w.dv == 512 || w.dv == 256) {
        why.push(format!(
            "kv_lora_rank {} (its P·V halves are specialised for a latent of 512 or 256)",
            w.dv
        ));
    }
    if !w.da.is_multiple_of(8) {
        why.push(format!("key row {} not a multiple of 8", w.da));
    }
    if fallback.wm != 4 {
        why.push("a tile of other than 64 rows".to_string());
    }
    (!why.is_empty()).then(|| why.join(", "))
}

/// Shared memory of `attn_wgmma` (bytes). Decode, `WG_SMEM` of sm90/decode/attn_wgmma.cuh: alignment slack, Q
/// and two key stages of 64-column blocks, the P tile, the row-max/row-sum exchange. Prefill, `PW_SMEM`
/// of sm90/prefill/attn_wgmma.cuh: alignment slack, Q of 16·wm rows, two stages of `bn` K and V rows.
pub fn wgmma_smem(w: &Widths, t: &Tile) -> usize {
    let kb = (w.da + w.db).div_ceil(64);
    if w.v_in_k {
        let blk = 64 * 128;
        1024 + 3 * kb * blk + blk + 4 * 64 * 4
    } else {
        let (bm, bn, vb) = (16 * t.wm as usize, t.bn as usize, w.dv.div_ceil(64));
        1024 + kb * bm * 128 + 2 * (kb + vb) * bn * 128
    }
}

/// The kernel one attention unit ends up launching.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// `attn_wgmma`, `attn_mma` or `attn_scalar`.
    pub kernel: &'static str,
    pub tile: Option<Tile>,
    /// Dynamic shared memory per CTA (0 for the scalar kernel).
    pub smem: usize,
    /// Rows (query rows, or (query, head) rows in decode) and keys per CTA tile.
    pub rows: usize,
    pub keys: usize,
    /// Why the faster kernels were passed over, best first.
    pub passed_over: Vec<String>,
}

/// What `Attn::load` picks for `unit` (decode or prefill) on a device with `smem_limit` bytes of opt-in
/// shared memory, compiled for `arch`; `q_rows` is q_len × heads (decode's tile list depends on it).
pub fn plan(dims: &Dims, decode: bool, q_rows: usize, arch: &str, smem_limit: usize) -> Plan {
    let tiles = if decode {
        decode_tiles(q_rows)
    } else {
        prefill_tiles()
    };
    plan_tiles(dims, decode, &tiles, arch, smem_limit)
}

/// `Attn::load`'s walk of `tiles`: the first whose kernel the module holds for these dims and `arch`
/// (the kernels' `#if`s) and whose shared memory fits `smem_limit`, else the scalar kernel.
pub fn plan_tiles(
    dims: &Dims,
    decode: bool,
    tiles: &[Tile],
    arch: &str,
    smem_limit: usize,
) -> Plan {
    let w = Widths::of(dims, decode);
    let mut passed = Vec::new();
    if let Some(why) = mma_blocker(dims.dtype, &w) {
        passed.push(format!("tensor-core kernels: {why}"));
    } else {
        for t in tiles {
            if t.wgmma {
                if let Some(why) = wgmma_blocker(arch, dims.dtype, &w, t) {
                    passed.push(format!("attn_wgmma: {why}"));
                    continue;
                }
                let smem = wgmma_smem(&w, t);
                if smem > smem_limit {
                    passed.push(format!(
                        "attn_wgmma: {smem} bytes of shared memory > {smem_limit}"
                    ));
                    continue;
                }
                return Plan {
                    kernel: "attn_wgmma",
                    tile: Some(*t),
                    smem,
                    rows: 16 * t.wm as usize,
                    keys: t.bn as usize,
                    passed_over: passed,
                };
            }
            let smem = mma_smem(&w, t);
            if smem > smem_limit {
                passed.push(format!(
                    "attn_mma {}: {smem} bytes of shared memory > {smem_limit}",
                    t.label()
                ));
                continue;
            }
            return Plan {
                kernel: "attn_mma",
                tile: Some(*t),
                smem,
                rows: 16 * t.wm as usize,
                keys: t.bn as usize,
                passed_over: passed,
            };
        }
    }
    Plan {
        kernel: "attn_scalar",
        tile: None,
        smem: 0,
        // kernels/attention.cuh's scalar kernel: 4 rows per 128-thread block, one key at a time.
        rows: 4,
        keys: 1,
        passed_over: passed,
    }
}

/// The label `LayerKernels::paths` gives one attention unit: `mma (TILE)` for either tensor-core kernel,
/// `scalar` otherwise.
pub fn path_label(tile: Option<Tile>, mma: bool) -> String {
    match tile {
        Some(t) if mma => format!("mma ({})", t.label()),
        _ => "scalar".to_string(),
    }
}

/// What `LayerKernels::paths` will say after a layer with these dims runs on a device compiled for
/// `arch` with `smem_limit` bytes (gpu-validate compares the two on the GPU).
pub fn paths(dims: &Dims, q_rows: usize, arch: &str, smem_limit: usize) -> String {
    let label = |p: Plan| path_label(p.tile, p.kernel != "attn_scalar");
    format!(
        "prefill: {}; decode: {}",
        label(plan(dims, false, 0, arch, smem_limit)),
        label(plan(dims, true, q_rows, arch, smem_limit))
    )
}

/// The tile `Attn::load` picks for `tiles` (`None`: the scalar kernel).
pub fn select(
    d: &Dims,
    tiles: &[Tile],
    decode: bool,
    caps: &Caps,
    force_scalar: bool,
) -> Option<Tile> {
    if force_scalar {
        return None;
    }
    plan_tiles(d, decode, tiles, &caps.arch(), caps.smem_optin).tile
}

/// The (prefill, decode) tiles of a layer whose decode steps have `q_rows` rows (q_len · heads).
pub fn layer_tiles(
    d: &Dims,
    q_rows: usize,
    caps: &Caps,
    force_scalar: bool,
) -> (Option<Tile>, Option<Tile>) {
    (
        select(d, &prefill_tiles(), false, caps, force_scalar),
        select(d, &decode_tiles(q_rows), true, caps, force_scalar),
    )
}

/// The family of a chosen tile.
pub fn family(t: Option<Tile>) -> Family {
    match t {
        None => Family::Scalar,
        Some(t) if t.wgmma => Family::Wgmma,
        Some(_) => Family::Mma,
    }
}

/// The kernel's name in reports.
pub fn label(t: Option<Tile>) -> String {
    match t {
        None => "32-key tiles, a warp per row".into(),
        Some(t) => t.label(),
    }
}

/// How the kernel of tile `t` cuts a phase's work (kernels/attention.cuh, sm90/decode/attn_wgmma.cuh,
/// sm90/prefill/attn_wgmma.cuh).
pub fn geometry(t: Option<Tile>, decode: bool) -> Geometry {
    match t {
        // SC_ROWS rows (warps) per CTA, each with its own key range, 32 keys per tile, no pipeline.
        None => Geometry {
            rows_per_cta: 4,
            keys_per_tile: 32,
            key_slices: 1,
            stages: 1,
            per_row_ranges: true,
        },
        // Decode: WG_BM rows, WG_BN keys, one 32-key half per warpgroup, K double-buffered.
        Some(t) if t.wgmma && decode => Geometry {
            rows_per_cta: 64,
            keys_per_tile: 64,
            key_slices: 2,
            stages: 2,
            per_row_ranges: false,
        },
        // Prefill: ATT_BM rows, 64 per warpgroup over every key of an ATT_BN tile, K and V double-buffered.
        Some(t) if t.wgmma => Geometry {
            rows_per_cta: 16 * t.wm as usize,
            keys_per_tile: t.bn as usize,
            key_slices: 1,
            stages: 2,
            per_row_ranges: false,
        },
        Some(t) => Geometry {
            rows_per_cta: 16 * t.wm as usize,
            keys_per_tile: t.bn as usize,
            key_slices: t.swn as usize,
            stages: t.stages as usize,
            per_row_ranges: false,
        },
    }
}

/// The key-count periods of the kernel of tile `t` (`None`: the scalar kernel) in decode (`decode`) or
/// prefill: its tile and the keys one warp (or warpgroup) takes of it, both counted from the start of
/// the key range (`Judging::key_tiles`, what sweep's lengths are made from).
pub fn key_tiles(t: Option<Tile>, decode: bool) -> Vec<KeyTile> {
    match t {
        // kernels/sm90/prefill/attn_wgmma.cuh: ATT_BN-key tiles, each warpgroup takes every key of its rows.
        Some(t) if t.wgmma && !decode => vec![KeyTile::new("wgmma tile", t.bn as usize)],
        // kernels/sm90/decode/attn_wgmma.cuh: 64-key tiles, warpgroup g takes keys [32g, 32g + 32). With the
        // TMA loads (page a multiple of 64) the tiles sit on page boundaries: a split starting inside a
        // page begins with a partial tile (its keys below the split masked).
        Some(t) if t.wgmma => vec![
            KeyTile::new("wgmma tile", 64),
            KeyTile::new("warpgroup key slice", 32),
        ],
        // kernels/attention.cuh: ATT_BN keys per tile, ATT_BNW = ATT_BN / ATT_SWN per warp in the S phase.
        Some(t) => vec![
            KeyTile::new(format!("mma tile ({})", t.label()), t.bn as usize),
            KeyTile::new("warp key slice", (t.bn / t.swn) as usize),
        ],
        // attn_scalar: one warp per row, keys in tiles of 32.
        None => vec![KeyTile::new("scalar tile", 32)],
    }
}

/// The kernel use of `phase` for tile `t`, with the production kernel when another one would run.
pub fn kernel_use(phase: Phase, t: Option<Tile>, production: Option<Production>) -> KernelUse {
    KernelUse {
        phase,
        family: family(t),
        label: label(t),
        geometry: Some(geometry(t, phase == Phase::Decode)),
        production,
    }
}

/// The production kernel of a phase, when it differs from the one that ran (`ran`): the device's choice
/// for these dims without a forced scalar path and, for decode, with at least 64 rows, the row count
/// the 64-row kernels are made for (a serving batch or 64+ heads).
pub fn production(
    d: &Dims,
    phase: Phase,
    ran: Option<Tile>,
    q_rows: usize,
    caps: &Caps,
    force_scalar: bool,
) -> Option<Production> {
    let decode = phase == Phase::Decode;
    let rows = if decode { q_rows.max(64) } else { q_rows };
    let tiles = if decode {
        decode_tiles(rows)
    } else {
        prefill_tiles()
    };
    let best = select(d, &tiles, decode, caps, false);
    if family(best) == family(ran) && label(best) == label(ran) {
        return None;
    }
    let why = if force_scalar && best.is_some() {
        "the scalar kernels were forced".to_string()
    } else if decode && q_rows < 64 {
        let h = d.h.max(1);
        format!(
            "it takes 64 or more decode rows and this run has q_len x heads = {} x {h} = {q_rows}; --q-len {} runs it",
            q_rows / h,
            64usize.div_ceil(h)
        )
    } else {
        "its module did not load as predicted (see the run's notices)".to_string()
    };
    Some(Production {
        family: family(best),
        label: label(best),
        why,
    })
}
