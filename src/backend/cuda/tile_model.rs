//! The attention kernels a layer gets, predicted on the host without a GPU: `Attn::load`'s choice (the
//! first tile of `decode_tiles` / `prefill_tiles` that compiles for the device and whose shared memory
//! fits), from the same conditions the kernels state in their `#if`s and the same shared-memory layout
//! (`ATT_SMEM` in kernels/attention.cuh, `WG_SMEM` in kernels/attention_sm90.cuh).
//!
//! Coverage uses it to name the production kernel of a device and dims, and the default schedule is made
//! to cross the classes of the kernels it predicts. It is checked against the kernels themselves:
//! `mla-diff kernels check` compares every predicted shared-memory size, row count and tile width with
//! the module's own `attn_*_config`, and a CUDA run reports (as a notice) any kernel choice that differs
//! from the prediction.

use super::kernels::{Dims, Tile};
use super::{decode_tiles, prefill_tiles};
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

/// The attention widths a module is compiled with (prefill.cu / decode.cu defines).
struct Widths {
    da: usize,
    db: usize,
    dv: usize,
    v_in_k: bool,
}

fn widths(d: &Dims, decode: bool) -> Widths {
    if decode {
        Widths {
            da: d.lkv + d.r,
            db: 0,
            dv: d.lkv,
            v_in_k: true,
        }
    } else {
        Widths {
            da: d.p,
            db: d.r,
            dv: d.dv,
            v_in_k: false,
        }
    }
}

/// `ATT_SMEM` of `attn_mma` for tile `t` (kernels/attention.cuh, 2-byte storage).
pub fn mma_smem(d: &Dims, t: &Tile, decode: bool) -> usize {
    let w = widths(d, decode);
    let (wm, wn, bn, stages) = (
        t.wm as usize,
        t.wn as usize,
        t.bn as usize,
        t.stages as usize,
    );
    let (smt, swn, pvm) = (t.smt as usize, t.swn as usize, t.pvm as usize);
    let bm = 16 * wm;
    let dqkp = (w.da + w.db).div_ceil(64) * 64;
    let cq = dqkp / 8;
    let (swm, nw) = (wm / smt, wm * wn);
    let snw = swm * swn;
    let pwn = wn * pvm;
    let psmem = swn > 1 || pvm > 1 || smt > 1 || snw != nw;
    let dvp = w.dv.div_ceil(16 * pwn) * (16 * pwn);
    let cv = if w.v_in_k {
        cq
    } else {
        dvp.div_ceil(64) * 64 / 8
    };
    let sq = bm * dqkp * 2;
    let sk = bn * dqkp * 2;
    let sv = if w.v_in_k { 0 } else { bn * cv * 8 * 2 };
    let sp = if psmem { bm * (bn + 8) * 2 } else { 0 };
    let sred = (swn + 1) * bm * 4;
    sq + stages * (sk + sv) + sp + sred
}

/// Shared memory of `attn_wgmma`: decode (`WG_SMEM`, kernels/attention_sm90.cuh): alignment slack, Q,
/// two K stages, P, row stats; prefill (`PW_SMEM`, kernels/prefill_sm90.cuh): alignment slack, Q of
/// 16·wm rows, two stages of `bn` K and V rows, each in 64-column blocks.
pub fn wgmma_smem(d: &Dims, t: &Tile, decode: bool) -> usize {
    if decode {
        let kb = (d.lkv + d.r).div_ceil(64);
        let tile = kb * 64 * 128;
        1024 + 3 * tile + 64 * 128 + 4 * 64 * 4
    } else {
        let (kb, vb) = ((d.p + d.r).div_ceil(64), d.dv.div_ceil(64));
        let (bm, bn) = (16 * t.wm as usize, t.bn as usize);
        1024 + kb * bm * 128 + 2 * (kb + vb) * bn * 128
    }
}

/// Whether the module holds `attn_wgmma` for these dims and tile: decode.cu, attention_sm90.cuh's `#if`
/// (sm_90a, 16-bit storage, a latent of 512 or 256, key rows a multiple of 8, a 64-row fallback tile);
/// prefill.cu, prefill_sm90.cuh's (sm_90a, 16-bit storage, widths multiples of 8, values at most 256
/// wide, a fallback tile of 64 or 128 rows and 64 or 128 keys).
pub fn wgmma_compiles(d: &Dims, t: &Tile, caps: &Caps, decode: bool) -> bool {
    let common = caps.cc == (9, 0) && d.dtype != Dtype::F32;
    if decode {
        common && (d.lkv == 512 || d.lkv == 256) && (d.lkv + d.r).is_multiple_of(8) && t.wm == 4
    } else {
        common
            && [d.p, d.r, d.dv].iter().all(|w| w.is_multiple_of(8))
            && d.dv <= 256
            && (t.wm == 4 || t.wm == 8)
            && (t.bn == 64 || t.bn == 128)
    }
}

/// The tile `Attn::load` picks for `tiles` (`None`: the scalar kernel).
pub fn select(
    d: &Dims,
    tiles: &[Tile],
    decode: bool,
    caps: &Caps,
    force_scalar: bool,
) -> Option<Tile> {
    if force_scalar || !d.mma_ok(decode) {
        return None;
    }
    tiles.iter().copied().find(|t| {
        let smem = if t.wgmma {
            if !wgmma_compiles(d, t, caps, decode) {
                return false;
            }
            wgmma_smem(d, t, decode)
        } else {
            mma_smem(d, t, decode)
        };
        smem <= caps.smem_optin
    })
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

/// How the kernel of tile `t` cuts a phase's work (kernels/attention.cuh, attention_sm90.cuh,
/// prefill_sm90.cuh).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Active;

    fn dims(dtype: Dtype, lkv: usize, r: usize, p: usize, dv: usize, h: usize) -> Dims {
        Dims {
            dtype,
            lkv,
            r,
            p,
            dv,
            h,
            page: 16,
            neox: false,
            debug: true,
            faults: Active::NONE,
        }
    }

    #[test]
    fn hopper_runs_wgmma_for_64_rows_and_the_small_tile_below() {
        let d = dims(Dtype::Bf16, 512, 64, 128, 128, 8);
        let (pre, dec) = layer_tiles(&d, 64, &HOPPER, false);
        assert!(dec.unwrap().wgmma);
        assert_eq!(pre, Some(prefill_tiles()[0]));
        assert_eq!(family(pre), Family::Wgmma);
        // 8 rows: the 16-row mma tile, and the Hopper kernel is named as the production one.
        let (_, small) = layer_tiles(&d, 8, &HOPPER, false);
        assert_eq!(small, Some(decode_tiles(8)[0]));
        let p = production(&d, Phase::Decode, small, 8, &HOPPER, false).unwrap();
        assert_eq!(p.family, Family::Wgmma);
        assert!(p.why.contains("64 or more decode rows"), "{}", p.why);
        assert_eq!(production(&d, Phase::Decode, dec, 64, &HOPPER, false), None);
        // An A100's 163 KB hold none of the 64-row tiles at 576-wide key rows (about 226 KB): the
        // 32-row tile, the last of the list.
        let (_, a100) = layer_tiles(&d, 64, &AMPERE, false);
        assert_eq!(a100, decode_tiles(64).last().copied());
        assert!(mma_smem(&d, &decode_tiles(64)[1], true) > AMPERE.smem_optin);
        // f32 storage: scalar everywhere, and that is the production kernel too.
        let f = dims(Dtype::F32, 512, 64, 128, 128, 8);
        assert_eq!(layer_tiles(&f, 64, &HOPPER, false), (None, None));
        assert_eq!(
            production(&f, Phase::Decode, None, 64, &HOPPER, false),
            None
        );
        // Forced scalar: the production kernel is named (prefill's on Hopper: wgmma; on an A100: mma).
        let p = production(&d, Phase::Prefill, None, 0, &HOPPER, true).unwrap();
        assert_eq!(p.family, Family::Wgmma);
        let p = production(&d, Phase::Prefill, None, 0, &AMPERE, true).unwrap();
        assert_eq!(p.family, Family::Mma);
    }

    #[test]
    fn shared_memory_matches_the_kernels_at_deepseek_dims() {
        // attn_wgmma at DeepSeek's 576-wide key rows: 1 KB + 3 x 9 blocks of 8 KB + P + stats (the figure
        // in attention_sm90.cuh's header and in `kernels check`'s table).
        let d = dims(Dtype::Bf16, 512, 64, 128, 128, 16);
        let t = decode_tiles(64)[0];
        assert_eq!(wgmma_smem(&d, &t, true), 231_424);
        assert!(wgmma_smem(&d, &t, true) <= HOPPER.smem_optin);
        // Prefill (PW_SMEM): 1 KB + Q 128 x 192 + two stages of 64 K (192) and V (128) rows; at 128 keys
        // 209 KB (fits), at GLM-5's 256 / 256 with 128 keys 328 KB (does not: the 64-key tile runs).
        let pre = prefill_tiles()[0];
        assert!(pre.wgmma && pre.wm == 8 && pre.bn == 64);
        assert_eq!(wgmma_smem(&d, &pre, false), 132_096);
        let bn128 = Tile::wgmma(Tile::new(8, 1, 128, 2, 1));
        assert_eq!(wgmma_smem(&d, &bn128, false), 214_016);
        let glm = dims(Dtype::Bf16, 512, 64, 192, 256, 64);
        assert_eq!(wgmma_smem(&glm, &pre, false), 197_632);
        assert!(wgmma_smem(&glm, &bn128, false) > HOPPER.smem_optin);
        assert_eq!(
            select(&glm, &[bn128, pre], false, &HOPPER, false),
            Some(pre)
        );
        // Its geometry: 128 rows, 64 keys, no key slices (each warpgroup takes every key of its rows).
        let g = geometry(Some(pre), false);
        assert_eq!(
            (g.rows_per_cta, g.keys_per_tile, g.key_slices),
            (128, 64, 1)
        );
        assert_eq!(geometry(Some(decode_tiles(64)[0]), true).key_slices, 2);
        // Off Hopper the module has no wgmma kernel: the mma tile after it.
        assert_eq!(
            select(&d, &prefill_tiles(), false, &AMPERE, false),
            Some(prefill_tiles()[1])
        );
        // MiniCPM3's 288-wide rows take 5 blocks.
        assert_eq!(
            wgmma_smem(&dims(Dtype::Bf16, 256, 32, 64, 64, 4), &t, true),
            133_120
        );
    }
}
