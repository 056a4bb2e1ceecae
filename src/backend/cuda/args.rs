//! The argument struct the attention kernels take (kernels/attention.cuh `AttnArgs`), below the modules
//! that launch it (`attn.rs`) and encode tensor maps from it (`tma.rs`).

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
    /// `decode_layout` for a batch of requests of one query each (`batch` in `Attn::run`): entry `b`'s
    /// query at `b·H·(Lkv+R)`, its output at `b·H·Lkv`, its block-table row at `b·table_bs`.
    pub fn decode_batch(h: usize, lkv: usize, r: usize, table_bs: usize) -> AttnArgs {
        AttnArgs {
            q_bs: (h * (lkv + r)) as i64,
            out_bs: (h * lkv) as i64,
            table_bs: table_bs as i64,
            n_q: 1,
            causal: 1,
            ..AttnArgs::decode_layout(h, lkv, r)
        }
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
}
