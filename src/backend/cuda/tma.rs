//! The tensor map `attn_wgmma` loads key tiles through when its module exports `attn_wgmma_tma`
//! (kernels/attention_sm90.cuh, kernels/tma.cuh): a 2-D view of the paged latent cache — columns × every
//! row of the pool's allocation — with 64 × 64 boxes and the 128-byte swizzle wgmma reads.

use super::attn::AttnArgs;
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
    /// The map over the cache `a.ka` (rows of `a.ka_rs` elements, `cols` of them read) for 16-bit `elem`.
    pub fn get(&self, a: &AttnArgs, cols: usize, elem: usize) -> Result<sys::CUtensorMap> {
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
        let m = encode(a, cols, elem, base + size as u64)?;
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

fn encode(a: &AttnArgs, cols: usize, elem: usize, end: u64) -> Result<sys::CUtensorMap> {
    let row_bytes = row_bytes(a, elem)?;
    // Rows: up to the end of the cache's allocation, so a bad page index reads zeros, not other memory.
    let rows = (end - a.ka) / row_bytes;
    // The copy moves bytes: bf16 and fp16 are both 16-bit words to it (UINT16 below).
    let dims = [cols as u64, rows];
    let strides = [row_bytes];
    let boxes = [BOX, BOX];
    let elem_strides = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            2,
            a.ka as *mut std::ffi::c_void,
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
    .map_err(drv_err(
        "encoding the cache's tensor map (cuTensorMapEncodeTiled)",
    ))?;
    Ok(map)
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
}
