//! The attention modules (prefill.cu, decode.cu): the argument struct they share with
//! kernels/attention.cuh, tile selection, and their launches.

use super::device::{arg, Gpu};
use super::kernels::{launch, Dims, Kernels, Module, Tile};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::rc::Rc;

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
    /// (function, dynamic smem bytes, threads, rows per CTA, keys per tile): the module's own
    /// `attn_*_config`; None: scalar only.
    mma: Option<(sys::CUfunction, u32, u32, u32, u32)>,
    /// The kernel `run` launches.
    pub name: &'static str,
    scalar: sys::CUfunction,
    /// decode.cu's `combine_splits` (None for prefill).
    combine: Option<sys::CUfunction>,
    pub mqa: bool,
    pub tile: Option<Tile>,
    /// `attn_wgmma` takes its key tiles by TMA (the module's `attn_wgmma_tma` is 1): (key columns,
    /// element bytes) of the tensor map `run` passes, and the last one encoded.
    tma: Option<(usize, usize)>,
    /// Decode's `attn_wgmma_pairs` (kernels/attention_sm90_pairs.cuh: the warpgroups on alternate tiles),
    /// present at 576/512 with the TMA loads; `run` takes it by `runs_pairs` (keys per split).
    pairs: Option<sys::CUfunction>,
    maps: super::tma::MapCache,
    /// Decode's `attn_small` (kernels/attention_sm90_small.cuh: 16-row tiles, key tiles by TMA into a
    /// ring of stages), present on sm_90a where the module's tile is attn_mma's 16 x 32 and the page a
    /// multiple of 32: (function, dynamic smem bytes, threads, key columns). `run` takes it over `attn_mma`.
    small: Option<(sys::CUfunction, u32, u32, usize)>,
    small_maps: super::tma::MapCache,
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

/// Rows of `attn_small`'s TMA boxes: one 32-key tile (kernels/attention_sm90_small.cuh).
const SMALL_BOX_ROWS: u32 = 32;

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
                let f = m.func_smem(name, smem)?;
                let scalar = m.func("attn_scalar")?;
                // Decode's attn_wgmma states whether it takes the tensor map (not looked up elsewhere:
                // a missing symbol is an API error to compute-sanitizer).
                let tma = (t.wgmma && mqa && m.global_i32s("attn_wgmma_tma", 1)?[0] == 1)
                    .then(|| (dims.lkv + dims.r, super::device::elem_bytes(dims.dtype)));
                let pairs = if tma.is_some() && m.global_i32s("attn_wgmma_pairs_on", 1)?[0] == 1 {
                    Some(m.func_smem("attn_wgmma_pairs", smem)?)
                } else {
                    None
                };
                // A kernel directory from before attn_small has no `attn_small_on`: attn_mma alone.
                let small = if !t.wgmma
                    && mqa
                    && m.has_global("attn_small_on")
                    && m.global_i32s("attn_small_on", 1)?[0] == 1
                {
                    // (smem, threads, rows, keys); a ring that does not fit the device: attn_mma alone
                    // (checked before raising the limit, which the driver refuses past the device's).
                    let c = m.global_i32s("attn_small_config", 4)?;
                    let smem = c[0] as usize;
                    match smem <= gpu.info.smem_optin {
                        true => Some((
                            m.func_smem("attn_small", smem)?,
                            smem as u32,
                            c[1] as u32,
                            dims.lkv + dims.r,
                        )),
                        false => None,
                    }
                } else {
                    None
                };
                return Ok(Attn {
                    combine: combine(&m)?,
                    _m: m,
                    mma: Some((f, smem as u32, cfg[1] as u32, cfg[2] as u32, cfg[3] as u32)),
                    name,
                    scalar,
                    mqa,
                    tile: Some(*t),
                    tma,
                    pairs,
                    maps: Default::default(),
                    small,
                    small_maps: Default::default(),
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
            tma: None,
            pairs: None,
            maps: Default::default(),
            small: None,
            small_maps: Default::default(),
        })
    }

    pub fn uses_mma(&self) -> bool {
        self.mma.is_some()
    }

    /// The key-count periods of the kernel `run` launches (`Backend::key_tiles`): its tile and the keys
    /// one warp (or warpgroup) takes of it, both counted from the start of the key range.
    pub fn key_tiles(&self) -> Vec<crate::backend::KeyTile> {
        use crate::backend::KeyTile;
        match (self.mma, self.tile) {
            // kernels/prefill_sm90.cuh: ATT_BN-key tiles, each warpgroup takes every key of its rows.
            (Some(_), Some(t)) if t.wgmma && !self.mqa => {
                vec![KeyTile::new("wgmma tile", t.bn as usize)]
            }
            // kernels/attention_sm90.cuh: 64-key tiles, warpgroup g takes keys [32g, 32g + 32). With the
            // TMA loads (page a multiple of 64) the tiles sit on page boundaries: a split starting inside a
            // page begins with a partial tile (its keys below the split masked).
            (Some(_), Some(t)) if t.wgmma => vec![
                KeyTile::new("wgmma tile", 64),
                KeyTile::new("warpgroup key slice", 32),
            ],
            // kernels/attention.cuh: ATT_BN keys per tile, ATT_BNW = ATT_BN / ATT_SWN per warp in the S phase.
            (Some(_), Some(t)) => vec![
                KeyTile::new(format!("mma tile ({})", t.label()), t.bn as usize),
                KeyTile::new("warp key slice", (t.bn / t.swn) as usize),
            ],
            // attn_scalar: one warp per row, keys in tiles of 32.
            _ => vec![KeyTile::new("scalar tile", 32)],
        }
    }

    /// The tensor-core kernel's rows per CTA and keys per tile, as its module states them.
    pub fn rows_keys(&self) -> Option<(usize, usize)> {
        self.mma.map(|m| (m.3 as usize, m.4 as usize))
    }

    /// Whether the module has `attn_wgmma_pairs` (decode at 576/512 with TMA key loads).
    pub fn has_pairs(&self) -> bool {
        self.pairs.is_some()
    }

    /// Whether `run` launches `attn_wgmma_pairs` for a launch of `n_keys` keys (the launch's `a.n_keys`)
    /// in `splits` splits (vLLM's partition: ceil(n_keys / splits) keys per split).
    pub fn runs_pairs(&self, n_keys: i32, splits: i32) -> bool {
        self.pairs.is_some() && pairs_rule(n_keys, splits)
    }

    /// Whether the module has `attn_small` (few heads on sm_90a, TMA key ring).
    pub fn has_small(&self) -> bool {
        self.small.is_some()
    }

    /// Whether `run` launches `attn_small` instead of `attn_mma` for a launch of `n_keys` keys in
    /// `splits` splits.
    pub fn runs_small(&self, n_keys: i32, splits: i32) -> bool {
        self.small.is_some() && small_rule(n_keys, splits)
    }

    /// Launch over `batch` independent problems; heads `a.n_heads`, queries `a.n_q`.
    pub fn run(&self, a: &AttnArgs, batch: u32) -> Result<()> {
        if self.runs_small(a.n_keys, a.num_splits) {
            return self.run_small(a, batch);
        }
        self.run_on(a, batch, self.runs_pairs(a.n_keys, a.num_splits))
    }

    /// Decode on `attn_small` (none in the module: an Environment error); grid as `attn_mma`'s.
    pub fn run_small(&self, a: &AttnArgs, batch: u32) -> Result<()> {
        let (f, smem, threads, cols) = self
            .small
            .ok_or_else(|| Error::Environment("attn_small is not in this decode module".into()))?;
        // 16-bit elements only (the kernel exists only for bf16 / fp16).
        let map = self
            .small_maps
            .get_box(a, cols, 2, SMALL_BOX_ROWS, "attn_small")?;
        let rows = (a.n_q * a.n_heads) as u32;
        let mut p = [
            a as *const AttnArgs as *mut c_void,
            &map as *const sys::CUtensorMap as *mut c_void,
        ];
        launch(
            f,
            "attn_small",
            (a.num_splits as u32, rows.div_ceil(16), batch),
            threads,
            smem,
            &mut p,
        )
    }

    /// `run` with the decode schedule chosen: `pairs` launches `attn_wgmma_pairs` (ignored where the
    /// module has none), else `attn_wgmma`. `bench decode` times both.
    pub fn run_on(&self, a: &AttnArgs, batch: u32, pairs: bool) -> Result<()> {
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
            Some((f, smem, threads, bm, _)) => match self.tma {
                Some((cols, elem)) => {
                    let map = self.maps.get(a, cols, elem)?;
                    let mut p2 = [p[0], &map as *const sys::CUtensorMap as *mut c_void];
                    let (f, name) = match self.pairs {
                        Some(fp) if pairs => (fp, "attn_wgmma_pairs"),
                        _ => (f, self.name),
                    };
                    launch(f, name, rows(bm), threads, smem, &mut p2)
                }
                None => launch(f, self.name, rows(bm), threads, smem, &mut p),
            },
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
    fn pairs_rule_by_keys_per_split() {
        // The measured points (H200, 2026-12-02): s_k 4k at 1, 2, 4, 8 splits; 32k at 1 to 8.
        for splits in [1, 2, 4, 8] {
            assert!(pairs_rule(4096, splits) && pairs_rule(32768, splits));
        }
        // The fixtures' short runs at one or two splits stay on pairs; more splits of them do not.
        assert!(pairs_rule(77, 1) && pairs_rule(330, 2) && !pairs_rule(77, 3));
        // Keys per split round up (vLLM's partition): 2,046 keys in 4 splits is 512 per split.
        assert!(pairs_rule(2046, 4) && !pairs_rule(2044, 4));
    }

    #[test]
    fn small_rule_by_keys_per_split() {
        // Measured: 1, 2 and 4 splits of s_k=4k on attn_small, 8 splits of 512 keys on attn_mma.
        assert!(small_rule(4096, 1) && small_rule(4096, 2) && small_rule(4096, 4));
        assert!(!small_rule(4096, 8) && small_rule(8192, 8));
        // The fixtures' schedules (3 splits of ~67 keys) stay on it.
        assert!(small_rule(200, 3) && small_rule(77, 1) && !small_rule(200, 5));
    }
}
