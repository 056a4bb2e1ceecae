//! The tensor map `attn_wgmma` loads key tiles through when its module exports `attn_wgmma_tma`
//! (kernels/sm90/decode/attn_wgmma.cuh, kernels/sm90/tma.cuh): a 2-D view of the paged latent cache — columns × every
//! row of the pool's allocation — with 64 × 64 boxes and the 128-byte swizzle wgmma reads.

use super::args::AttnArgs;
use super::device::drv_err;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::cell::Cell;

/// Box of one copy: 64 columns (128 bytes of a 16-bit type, the swizzle's span) × 64 rows (a tile).
const BOX: u32 = 64;

/// One encoded map, kept while the cache (pointer, row stride, allocation) stays the same.
#[derive(Default)]
pub struct MapCache {
    last: Cell<Option<(Key, sys::CUtensorMap)>>,
}

/// (cache pointer, row stride, allocation base, allocation bytes): a pool freed and allocated again at
/// the same address with another size gets a new map.
type Key = (u64, i64, u64, usize);

impl MapCache {
    /// The map over the cache `a.ka` (rows of `a.ka_rs` elements, `cols` of them read) for 16-bit `elem`,
    /// with `attn_wgmma`'s 64-row boxes (a tile).
    pub fn get(&self, a: &AttnArgs, cols: usize, elem: usize) -> Result<sys::CUtensorMap> {
        self.get_box(a, cols, elem, BOX, "attn_wgmma")
    }

    /// `get` with boxes of `box_rows` rows (`attn_small`'s 32-key tiles) for `kernel`'s loads. One cache
    /// per box shape (the key does not hold it).
    pub fn get_box(
        &self,
        a: &AttnArgs,
        cols: usize,
        elem: usize,
        box_rows: u32,
        kernel: &str,
    ) -> Result<sys::CUtensorMap> {
        let (mut base, mut size) = (0u64, 0usize);
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, a.ka).result() }.map_err(
            drv_err("finding the cache's allocation (cuMemGetAddressRange)"),
        )?;
        let key = (a.ka, a.ka_rs, base, size);
        if let Some((k, m)) = self.last.get() {
            if k == key {
                return Ok(m);
            }
        }
        let row_bytes = row_bytes(a, elem)?;
        // Rows: up to the end of the cache's allocation, so a bad page index reads zeros, not other memory.
        let rows = (base + size as u64 - a.ka) / row_bytes;
        let m = encode_tiled(a.ka, &[cols as u64, rows], &[row_bytes], &[BOX, box_rows])?
            .ok_or_else(|| {
                Error::Environment(format!(
                    "{kernel}'s TMA key loads: the cache at {:#x} ({rows} rows of {row_bytes} bytes) is not addressable by TMA",
                    a.ka
                ))
            })?;
        self.last.set(Some((key, m)));
        Ok(m)
    }
}

/// The cache's row in bytes, when TMA can address it: 16-bit elements, global address and row stride
/// multiples of 16 bytes, the request's offset (ka_bs) whole rows (the kernel adds it in rows).
fn row_bytes(a: &AttnArgs, elem: usize) -> Result<u64> {
    if elem != 2 {
        return Err(Error::Environment(format!(
            "attn_wgmma's TMA key loads: {elem}-byte elements (16-bit only)"
        )));
    }
    let row_bytes = a.ka_rs as u64 * elem as u64;
    if !a.ka.is_multiple_of(16)
        || a.ka_rs <= 0
        || !row_bytes.is_multiple_of(16)
        || a.ka_bs % a.ka_rs != 0
    {
        return Err(Error::Environment(format!(
            "attn_wgmma's TMA key loads need a 16-byte aligned cache with 16-byte rows and whole-row request offsets (cache at {:#x}, row {} elements, request stride {} elements)",
            a.ka, a.ka_rs, a.ka_bs
        )));
    }
    Ok(row_bytes)
}

/// cuTensorMapEncodeTiled's own limits: a 16-byte aligned base, byte strides multiples of 16 below
/// 2^40, no empty dimension.
fn tma_addressable(ptr: u64, dims: &[u64], strides: &[u64]) -> bool {
    ptr.is_multiple_of(16)
        && !dims.contains(&0)
        && strides
            .iter()
            .all(|s| *s != 0 && s.is_multiple_of(16) && *s < 1 << 40)
}

/// One tiled tensor map over 16-bit elements (bf16 and fp16 alike: the copy moves 16-bit words):
/// `dims` (innermost first), byte `strides` of the outer dimensions, `boxes`, 128-byte swizzle; None where TMA cannot address it (a base or stride not a
/// multiple of 16 bytes, an empty dimension).
fn encode_tiled(
    ptr: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> Result<Option<sys::CUtensorMap>> {
    if !tma_addressable(ptr, dims, strides) {
        return Ok(None);
    }
    let elem_strides = [1u32; 3];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
    }
    .map_err(drv_err("encoding a tensor map (cuTensorMapEncodeTiled)"))?;
    Ok(Some(map))
}

/// The second parameter of kernels/sm90/prefill/attn_wgmma.cuh's `attn_wgmma` (`PwMaps`, same layout: four
/// 128-byte maps, then `on`; 64-byte aligned, 576 bytes): the maps of q, k_nope, the k_pe rows and v
/// for one launch's arguments, passed by value as a `__grid_constant__` parameter (as decode's map).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct PrefillMaps {
    maps: [[u64; 16]; 4],
    /// 0: no maps (the kernel loads by cp.async).
    on: i32,
}

impl PrefillMaps {
    /// The parameter of a launch that loads by cp.async.
    pub const OFF: PrefillMaps = PrefillMaps {
        maps: [[0; 16]; 4],
        on: 0,
    };

    /// The maps for `a` (one request, no per-request lengths) at head dims `p` + `r` / `dv`, a tile of
    /// `bm` query rows and `bn` keys, 16-bit elements; None where TMA cannot address an operand (the
    /// kernel then loads by cp.async).
    pub fn encode(
        a: &AttnArgs,
        p: usize,
        r: usize,
        dv: usize,
        bm: u32,
        bn: u32,
    ) -> Result<Option<PrefillMaps>> {
        const E: u64 = 2;
        let (h, nq, nk) = (a.n_heads as u64, a.n_q as u64, a.n_keys as u64);
        if a.seq_lens != 0
            || a.q_hs < 0
            || a.q_rs < 0
            || a.ka_hs < 0
            || a.ka_rs < 0
            || a.v_hs < 0
            || a.v_rs < 0
            || a.kb_rs < 0
        {
            return Ok(None);
        }
        let st = |x: i64| x as u64 * E;
        let ops = [
            encode_tiled(
                a.q,
                &[(p + r) as u64, h, nq],
                &[st(a.q_hs), st(a.q_rs)],
                &[64, 1, bm],
            )?,
            encode_tiled(
                a.ka,
                &[p as u64, h, nk],
                &[st(a.ka_hs), st(a.ka_rs)],
                &[64, 1, bn],
            )?,
            encode_tiled(a.kb, &[r as u64, nk], &[st(a.kb_rs)], &[64, bn])?,
            encode_tiled(
                a.v,
                &[dv as u64, h, nk],
                &[st(a.v_hs), st(a.v_rs)],
                &[64, 1, bn],
            )?,
        ];
        let [Some(q), Some(ka), Some(kb), Some(v)] = ops else {
            return Ok(None);
        };
        Ok(Some(PrefillMaps {
            maps: [q.opaque, ka.opaque, kb.opaque, v.opaque],
            on: 1,
        }))
    }

    /// Whether the kernel loads by TMA with this parameter.
    pub fn on(&self) -> bool {
        self.on != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tma_takes_only_aligned_16_bit_caches() {
        // DeepSeek / GLM-5 rows (576) and MiniCPM3's (288), bf16: 1152 and 576 bytes.
        for row in [576, 288] {
            let a = AttnArgs {
                ka: 0x7f00_0000_0000,
                ..AttnArgs::decode_layout(16, row - 64, 64)
            };
            assert_eq!(row_bytes(&a, 2).unwrap(), 2 * row as u64);
            assert!(row_bytes(&a, 4).is_err(), "f32 cache");
            let odd = AttnArgs { ka: a.ka + 8, ..a };
            assert!(row_bytes(&odd, 2).is_err(), "cache not 16-byte aligned");
            let part = AttnArgs {
                ka_bs: a.ka_rs / 2,
                ..a
            };
            assert!(
                row_bytes(&part, 2).is_err(),
                "request offset not whole rows"
            );
        }
        // Rows of 100 elements are 200 bytes: not a multiple of 16.
        let a = AttnArgs {
            ka: 0x7f00_0000_0000,
            ..AttnArgs::decode_layout(16, 36, 64)
        };
        assert!(row_bytes(&a, 2).is_err());
    }

    #[test]
    fn prefill_maps_have_the_kernel_parameters_layout() {
        // sm90/prefill/attn_wgmma.cuh `PwMaps`: four 64-byte aligned 128-byte TmaMaps, `on` at 512, 576 bytes.
        assert_eq!(std::mem::size_of::<PrefillMaps>(), 576);
        assert_eq!(std::mem::align_of::<PrefillMaps>(), 64);
        assert_eq!(std::mem::offset_of!(PrefillMaps, on), 512);
        assert!(!PrefillMaps::OFF.on());
    }

    #[test]
    fn prefill_maps_fall_back_where_tma_cannot_address() {
        let p = 0x7f00_0000_0000u64;
        // DeepSeek's k_nope at 128 heads: 256-byte heads, 32 KB rows; k_pe inside 1152-byte cache rows.
        assert!(tma_addressable(p, &[128, 128, 4096], &[256, 32768]));
        assert!(tma_addressable(p + 1024, &[64, 4096], &[1152]));
        assert!(
            !tma_addressable(p + 8, &[128, 128, 4096], &[256, 32768]),
            "base"
        );
        assert!(!tma_addressable(p, &[100, 4, 64], &[200, 800]), "stride");
        assert!(
            !tma_addressable(p, &[64, 0], &[128]),
            "no keys (an empty context pass)"
        );
    }
}
