//! The host's model of the CUDA backend's kernel choice, below both the backend and its users: the dims
//! and tiles the attention modules are compiled with (`Dims`, `Tile`), the tile lists `Attn::load` walks
//! best first (`decode_tiles`, `prefill_tiles`), the split rules that pick decode's alternative kernels
//! (`pairs_rule`, `small_rule`), and in `choice` which kernel and tile a device takes for given dims,
//! worked out without a GPU or NVRTC. The backend loads from these lists and launches by these rules;
//! lint, sweep, coverage and `kernels check` predict and check from the same ones.

pub mod choice;
#[cfg(test)]
mod tests;
pub mod variants;

use crate::faults::Active;
use crate::precision::Dtype;
use serde::{Deserialize, Serialize};

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

impl Dims {
    /// The dims of a model's layer as the CUDA backend compiles them (page 16: page size and faults
    /// do not change the tile choice).
    pub fn of_model(cfg: &crate::model::MlaConfig, dtype: Dtype) -> Dims {
        Dims {
            dtype,
            lkv: cfg.kv_lora_rank,
            r: cfg.qk_rope,
            p: cfg.qk_nope,
            dv: cfg.v_head_dim,
            h: cfg.n_head,
            page: 16,
            neox: cfg.rope.pairing == crate::model::config::RopePairing::Neox,
            debug: true,
            faults: Active::NONE,
        }
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
    /// Hopper's warpgroup MMA (`attn_wgmma`): decode in kernels/sm90/decode/attn_wgmma.cuh (64 rows, 64 keys, a
    /// 4x2-warp fallback), prefill in kernels/sm90/prefill/attn_wgmma.cuh (16·wm = 64 or 128 rows, a warpgroup per
    /// 64, `bn` keys; its tiles have one warp column); the other fields then only configure the module's
    /// fallback `attn_mma`.
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
    pub fn label(&self) -> String {
        if self.wgmma {
            // Prefill's tiles have one warp column, decode's (64 rows, 64 keys) two.
            return match self.wn {
                1 => format!(
                    "wgmma {} warpgroup{} bm{} bn{} st2",
                    self.wm / 4,
                    if self.wm > 4 { "s" } else { "" },
                    16 * self.wm,
                    self.bn
                ),
                _ => "wgmma 2 warpgroups bn64 st2".to_string(),
            };
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

/// Tile choices for decode, best first (by `mla-diff bench decode` on an H200, bench/RESULTS.md); the
/// first whose shared memory fits the device is used.
pub fn decode_tiles(rows: usize) -> Vec<Tile> {
    if rows >= 64 {
        vec![
            // Hopper: warpgroup MMA (sm_90a; skipped elsewhere or for dims it does not take).
            Tile::wgmma(Tile::new(4, 2, 64, 2, 2)),
            // 8 warps: S on 16x32 warp tiles, P·V on 32x256 (two m-tiles share each V fragment).
            Tile::new(4, 2, 64, 2, 2),
            // S on 32x32 warp tiles by 4 warps: fewer fragment bytes, but slower on the H200.
            Tile::new(4, 2, 64, 2, 2).s_phase(2, 2),
            // 16 warps (8 compute S), P·V on 32x64: 128 registers, no spills, but slower on the H200.
            Tile::new(4, 4, 64, 2, 2).s_phase(1, 2),
            Tile::new(4, 2, 64, 2, 1),
            Tile::new(2, 2, 32, 2, 1),
        ]
    } else {
        vec![
            Tile::new(1, 4, 32, 2, 1),
            Tile::new(1, 8, 64, 2, 1),
            Tile::new(1, 4, 64, 2, 1),
        ]
    }
}

/// Tile choices for prefill, best first (with one warp column P stays in registers).
pub fn prefill_tiles() -> Vec<Tile> {
    vec![
        // Hopper: warpgroup MMA (sm_90a; kernels/sm90/prefill/attn_wgmma.cuh), 128 rows by two warpgroups.
        Tile::wgmma(Tile::new(8, 1, 64, 2, 1)),
        Tile::new(8, 1, 64, 2, 1),
        Tile::new(4, 1, 64, 2, 1),
        Tile::new(4, 1, 32, 2, 1),
        Tile::new(2, 1, 32, 2, 1),
    ]
}

/// The Hopper prefill kernel's other tiles, timed by `bench prefill` and `bench table` beside
/// `prefill_tiles()[0]`: 128-key tiles (only 192/128 fits: 209 KB), 80-key tiles (256/256's widest that
/// fits: 225 KB, 20 % fewer key tiles than 64 keys) and one consumer warpgroup of 64 rows.
pub fn prefill_wgmma_variants() -> [Tile; 3] {
    [
        Tile::wgmma(Tile::new(8, 1, 128, 2, 1)),
        Tile::wgmma(Tile::new(8, 1, 80, 2, 1)),
        Tile::wgmma(Tile::new(4, 1, 64, 2, 1)),
    ]
}

/// `run` takes `attn_wgmma_pairs` over `attn_wgmma` unless a launch has more than
/// `PAIRS_MAX_SPLITS` splits of fewer than `PAIRS_MIN_SPLIT_KEYS` keys each (`runs_pairs`). Measured on
/// the H200 (2026-12-02; bench/RESULTS.md, "Pairs vs one-tile"), both in one run: pairs is faster at every
/// split count timed — 4,096 down to 512 keys per split (s_k 4k at 1, 2, 4 and 8 splits, B=64 H=128 and
/// B=128 H=64, bf16 and fp16) and 32,768 down to 4,096 (B=16 H=128 s_k=32k, 1–8 splits), by 3 % (8 splits)
/// to 28 % (one split of 32k); the kernel before its per-tile cuts lost at 1,024 and 512, the cuts turned
/// that. Fewer keys per split at more than two splits are unmeasured and stay on `attn_wgmma`; one or two
/// splits of a few hundred keys (the fixtures' runs) stay on pairs, so `run`'s checks keep exercising it.
pub const PAIRS_MAX_SPLITS: i32 = 2;
/// See `PAIRS_MAX_SPLITS`: the fewest keys per split measured (pairs won there).
pub const PAIRS_MIN_SPLIT_KEYS: i32 = 512;

/// `runs_pairs` without the module: pairs unless more than `PAIRS_MAX_SPLITS` splits of fewer than
/// `PAIRS_MIN_SPLIT_KEYS` keys.
pub fn pairs_rule(n_keys: i32, splits: i32) -> bool {
    split_rule(n_keys, splits, PAIRS_MAX_SPLITS, PAIRS_MIN_SPLIT_KEYS)
}

/// `run` takes `attn_small` over `attn_mma` unless a launch has more than `SMALL_MAX_SPLITS` splits of
/// fewer than `SMALL_MIN_SPLIT_KEYS` keys each (`runs_small`). Measured on the H200, both kernels in one
/// run (2026-12-02, B=64 H=16 s_k=4k, bf16 and fp16; bench/RESULTS.md): `attn_small` is 46 % faster at one split
/// of 4,096 keys and 34 % at two of 2,048, level at four of 1,024 (99.2 vs 100.1 µs) and 4 % slower at
/// eight of 512 (116.2 vs 111.7). The fixtures' runs (a few splits of a few hundred keys) stay on it.
pub const SMALL_MAX_SPLITS: i32 = 4;
/// See `SMALL_MAX_SPLITS`: the fewest keys per split where `attn_small` was measured not slower.
pub const SMALL_MIN_SPLIT_KEYS: i32 = 1024;

/// `runs_small` without the module.
pub fn small_rule(n_keys: i32, splits: i32) -> bool {
    split_rule(n_keys, splits, SMALL_MAX_SPLITS, SMALL_MIN_SPLIT_KEYS)
}

/// A launch of `splits` splits over `n_keys` keys (vLLM's partition: ceil(n_keys / splits) keys per
/// split) stays on the kernel measured faster on long splits unless it has more than `max_splits` splits
/// of fewer than `min_keys` keys, where the other kernel measured level or faster (or was not measured).
fn split_rule(n_keys: i32, splits: i32, max_splits: i32, min_keys: i32) -> bool {
    let per = if splits > 0 {
        (n_keys.max(0) as i64 + splits as i64 - 1) / splits as i64
    } else {
        0
    };
    splits <= max_splits || per >= min_keys as i64
}

/// The key-count periods of a backend's attention kernels (`Judging::key_tiles`): each a name and a
/// number of keys counted from the start of a key range (a prefill chunk's context or own keys, a decode
/// split's keys).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyTiles {
    pub prefill: Vec<KeyTile>,
    pub decode: Vec<KeyTile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyTile {
    /// What it is: "flash tile", "mma tile 4x2w bn64 …", "warp key slice", …
    pub name: String,
    pub keys: usize,
}

impl KeyTile {
    pub fn new(name: impl Into<String>, keys: usize) -> KeyTile {
        KeyTile {
            name: name.into(),
            keys,
        }
    }
}
