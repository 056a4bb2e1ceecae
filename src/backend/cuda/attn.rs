//! The attention modules (prefill.cu, decode.cu): tile selection over the host model's lists
//! (`crate::tiles`), and their launches (the argument struct they share with kernels/attention.cuh is
//! `args.rs`); the Hopper prefill kernel's own launch with its tensor maps (`PrefillLaunch`).

use super::args::AttnArgs;
use super::device::{arg, Gpu};
use super::kernels::{launch, Kernels, Module};
use super::tma::PrefillMaps;
use crate::error::{Error, Result};
use crate::tiles::{pairs_rule, small_rule, Dims, Tile};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::rc::Rc;

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
    /// Decode's `attn_wgmma_pairs` (kernels/sm90/decode/attn_wgmma_pairs.cuh: the warpgroups on alternate tiles),
    /// present at 576/512 with the TMA loads; `run` takes it by `runs_pairs` (keys per split).
    pairs: Option<sys::CUfunction>,
    maps: super::tma::MapCache,
    /// Decode's `attn_small` (kernels/sm90/decode/attn_small.cuh: 16-row tiles, key tiles by TMA into a
    /// ring of stages), present on sm_90a where the module's tile is attn_mma's 16 x 32 and the page a
    /// multiple of 32: (function, dynamic smem bytes, threads, key columns). `run` takes it over `attn_mma`.
    small: Option<(sys::CUfunction, u32, u32, usize)>,
    small_maps: super::tma::MapCache,
}

/// Rows of `attn_small`'s TMA boxes: one 32-key tile (kernels/sm90/decode/attn_small.cuh).
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

    /// The key-count periods of the kernel `run` launches (`Judging::key_tiles`, what sweep's lengths
    /// are made from): the host model's for its tile (`tiles::choice::key_tiles`).
    pub fn key_tiles(&self) -> Vec<crate::backend::KeyTile> {
        crate::tiles::choice::key_tiles(self.mma.and(self.tile), self.mqa)
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

    /// The kernel `run` launches for `n_keys` keys in `splits` splits (for a report's label).
    pub fn launches(&self, n_keys: i32, splits: i32) -> &'static str {
        if self.runs_small(n_keys, splits) {
            return "attn_small";
        }
        match (self.mma, self.tma) {
            (Some(_), Some(_)) if self.runs_pairs(n_keys, splits) => "attn_wgmma_pairs",
            (Some(_), _) => self.name,
            (None, _) => "attn_scalar",
        }
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
        if self.mqa && self.tile.is_some_and(|t| t.wgmma) && !pair_stores_fit(a) {
            return Err(Error::Environment(format!(
                "attn_wgmma decode: its epilogue stores column pairs, which needs part_out 8-byte aligned, out 4-byte aligned and even out strides; got part_out {:#x}, out {:#x}, strides {}/{}/{}",
                a.part_out, a.out, a.out_bs, a.out_rs, a.out_hs
            )));
        }
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

/// Whether decode's `attn_wgmma` / `attn_wgmma_pairs` epilogue (kernels/sm90/decode/attn_wgmma.cuh
/// `wg_finish`) may store a thread's two adjacent columns at once: an 8-byte store of f32 partials and
/// a 4-byte store of 16-bit output need those rows aligned (a misaligned one is a fault, not a
/// slower store). Every launch of ours holds it; the check names a caller's layout that does not.
pub fn pair_stores_fit(a: &AttnArgs) -> bool {
    let even = |s: i64| s % 2 == 0;
    a.part_out.is_multiple_of(8)
        && a.out.is_multiple_of(4)
        && even(a.out_bs)
        && even(a.out_rs)
        && even(a.out_hs)
}

/// The launch of the Hopper prefill kernel (kernels/sm90/prefill/attn_wgmma.cuh `attn_wgmma`), which takes its
/// operands' tensor maps as a second, `__grid_constant__` parameter (`Attn::run` passes one argument
/// struct): every launch of it goes through here, with the maps where TMA can address the operands and
/// `PrefillMaps::OFF` (cp.async loads) where not.
pub struct PrefillLaunch {
    f: sys::CUfunction,
    /// (dynamic shared bytes, threads, rows, keys) of the module's `attn_wgmma_config`.
    cfg: (u32, u32, u32, u32),
    /// The module encodes maps (`attn_wgmma_tma_param`): (p, r, dv) of its dims; None: cp.async only.
    tma: Option<(usize, usize, usize)>,
    _m: Rc<Module>,
}

impl PrefillLaunch {
    /// The launch of `att`'s kernel (its module compiled with `dims`), when that is the wgmma kernel.
    pub fn find(k: &mut Kernels, att: &Attn, dims: &Dims) -> Result<Option<PrefillLaunch>> {
        let Some(tile) = att.tile else {
            return Ok(None);
        };
        if !tile.wgmma || att.mqa || att.name != "attn_wgmma" {
            return Ok(None);
        }
        let mut d = dims.defines();
        d.extend(tile.defines());
        // Attn::load's module, from the cache.
        let m = k.module("prefill.cu", d)?;
        // Kernel sources older than the maps parameter lack the flag: `Attn::run` launches them.
        if !m.has_global("attn_wgmma_tma_param") {
            return Ok(None);
        }
        let c = m.global_i32s("attn_wgmma_config", 4)?;
        let tma = (m.global_i32s("attn_wgmma_tma_param", 1)?[0] == 1
            && super::device::elem_bytes(dims.dtype) == 2)
            .then_some((dims.p, dims.r, dims.dv));
        Ok(Some(PrefillLaunch {
            // Attn::load raised this function's shared-memory limit (same module, same handle).
            f: m.func("attn_wgmma")?,
            cfg: (c[0] as u32, c[1] as u32, c[2] as u32, c[3] as u32),
            tma,
            _m: m,
        }))
    }

    /// The kernel's parameter for `a`: its operands' maps, or OFF where TMA cannot address them.
    pub fn maps(&self, a: &AttnArgs) -> Result<PrefillMaps> {
        let Some((p, r, dv)) = self.tma else {
            return Ok(PrefillMaps::OFF);
        };
        Ok(PrefillMaps::encode(a, p, r, dv, self.cfg.2, self.cfg.3)?.unwrap_or(PrefillMaps::OFF))
    }

    /// Launch over one request (heads `a.n_heads`, queries `a.n_q`) with `maps` (from `maps`).
    pub fn run_with(&self, a: &AttnArgs, maps: &PrefillMaps) -> Result<()> {
        let (smem, threads, bm, _) = self.cfg;
        let grid = ((a.n_q as u32).div_ceil(bm), a.n_heads as u32, 1);
        let mut p = [
            a as *const AttnArgs as *mut c_void,
            maps as *const PrefillMaps as *mut c_void,
        ];
        launch(self.f, "attn_wgmma", grid, threads, smem, &mut p)
    }

    /// `run_with` the maps of `a`.
    pub fn run(&self, a: &AttnArgs) -> Result<()> {
        self.run_with(a, &self.maps(a)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_stores_need_aligned_rows() {
        let ok = AttnArgs {
            part_out: 0x1000,
            out: 0x2004,
            out_bs: 8 * 512,
            out_rs: 64 * 512,
            out_hs: 512,
            ..Default::default()
        };
        assert!(pair_stores_fit(&ok));
        assert!(!pair_stores_fit(&AttnArgs {
            part_out: 0x1004,
            ..ok
        }));
        assert!(!pair_stores_fit(&AttnArgs { out: 0x2002, ..ok }));
        assert!(!pair_stores_fit(&AttnArgs { out_hs: 511, ..ok }));
        assert!(!pair_stores_fit(&AttnArgs { out_rs: 1, ..ok }));
        assert!(!pair_stores_fit(&AttnArgs { out_bs: 3, ..ok }));
    }
}
