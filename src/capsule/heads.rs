//! Cutting a layer down to query heads A..B, byte-exact: the quantized bytes of the kept heads are copied,
//! never requantized, so the smaller layer computes exactly what those heads compute in the model.
//!
//! Per tensor (ggml `ne` order, `ne[0]` contiguous): the query projection (`attn_q_b` or `attn_q`,
//! `{in, H·Dk}`) and the legacy `attn_kv_b` (`{Lkv, H·(P+Dv)}`) keep a run of whole rows; the split
//! `attn_k_b` (`{P, Lkv, H}`) and `attn_v_b` (`{Lkv, Dv, H}`) keep a run of their outermost axis; the
//! output projection `attn_output` (`{H·Dv, E}`) keeps columns A·Dv..B·Dv of every row, which is a byte
//! range of each row only when both ends fall on the type's block boundaries. Everything else (norms,
//! the shared kv_a projection, rope factors) is shared by all heads and stays as it is.

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, TensorInfo, TensorType};
use crate::model::MlaConfig;
use std::borrow::Cow;
use std::ops::Range;

/// Parse `--heads A..B` (half-open) for a model of `n_head` heads.
pub fn parse(spec: &str, n_head: usize) -> Result<Range<usize>> {
    let bad = |m: String| Error::Usage(format!("--heads {spec:?}: {m}"));
    let (a, b) = spec
        .split_once("..")
        .ok_or_else(|| bad("expected A..B (half-open, e.g. 0..8)".into()))?;
    let num = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| bad(format!("{s:?} is not a head number")))
    };
    let (a, b) = (num(a)?, num(b)?);
    if a >= b || b > n_head {
        return Err(bad(format!(
            "not a non-empty range of the model's {n_head} heads (0..{n_head})"
        )));
    }
    Ok(a..b)
}

/// How one attention tensor is cut to a head range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Shared by every head: kept whole.
    Whole,
    /// A run of the outermost axis, `per_head` entries of it per head.
    Outer { per_head: usize },
    /// Columns (`ne[0]`), `per_head` per head.
    Columns { per_head: usize },
}

fn cut_for(short_name: &str, cfg: &MlaConfig) -> Cut {
    match short_name {
        "attn_q_b" | "attn_q" => Cut::Outer {
            per_head: cfg.qk_head_dim(),
        },
        "attn_kv_b" => Cut::Outer {
            per_head: cfg.qk_nope + cfg.v_head_dim,
        },
        "attn_k_b" | "attn_v_b" => Cut::Outer { per_head: 1 },
        "attn_output" => Cut::Columns {
            per_head: cfg.v_head_dim,
        },
        _ => Cut::Whole,
    }
}

fn known(t: &TensorInfo) -> Result<GgmlType> {
    match t.ty {
        TensorType::Known(ty) => Ok(ty),
        TensorType::Unknown(id) => Err(Error::Unsupported(format!(
            "tensor {} has unknown ggml type {id}: its heads cannot be cut",
            t.name
        ))),
    }
}

/// Check, before anything is written, that `attn_output` (of type `ty`) can be cut to `heads` byte-exact;
/// the error names the nearest ranges that can.
pub fn check_columns(ty: GgmlType, cfg: &MlaConfig, heads: &Range<usize>) -> Result<()> {
    let (dv, bs, n) = (cfg.v_head_dim, ty.block, cfg.n_head);
    // A head boundary k falls on a block boundary when k·Dv is a multiple of the block size: k a
    // multiple of `step`. The last boundary (n) is the row's end, always whole blocks.
    let step = bs / gcd(bs, dv);
    let ok = |k: usize| k.is_multiple_of(step) || k == n;
    if ok(heads.start) && ok(heads.end) {
        return Ok(());
    }
    let down = |k: usize| k - k % step;
    let up = |k: usize| k.div_ceil(step).saturating_mul(step).min(n);
    let mut nearest = vec![format!(
        "{}..{} (covering)",
        down(heads.start),
        up(heads.end)
    )];
    let (a, b) = (
        up(heads.start),
        if heads.end == n { n } else { down(heads.end) },
    );
    if a < b {
        nearest.push(format!("{a}..{b} (inside)"));
    }
    Err(Error::Usage(format!(
        "--heads {}..{}: attn_output is {ty} (blocks of {bs} values) and a head has {dv} columns (v_head_dim), so its columns of heads {}..{} are not whole blocks; a byte-exact cut needs both ends at a multiple of {step} heads (or the end at {n}): nearest valid ranges {}",
        heads.start,
        heads.end,
        heads.start,
        heads.end,
        nearest.join(", ")
    )))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The shape (`ne`) and bytes of tensor `t` (short name `short_name`, e.g. `attn_q_b`) cut to `heads`.
/// `bytes` are the tensor's bytes in the file; a tensor shared by all heads comes back borrowed.
pub fn cut<'a>(
    short_name: &str,
    t: &TensorInfo,
    bytes: &'a [u8],
    cfg: &MlaConfig,
    heads: &Range<usize>,
) -> Result<(Vec<u64>, Cow<'a, [u8]>)> {
    let ty = known(t)?;
    let kept = heads.end - heads.start;
    let bad_shape = |what: String| {
        Error::Tensor(format!(
            "tensor {} has shape (ne) {:?}: {what}, so its heads cannot be cut",
            t.name, t.ne
        ))
    };
    match cut_for(short_name, cfg) {
        Cut::Whole => Ok((t.ne.clone(), Cow::Borrowed(bytes))),
        Cut::Outer { per_head } => {
            let outer = *t.ne.last().expect("a tensor has a dimension") as usize;
            if t.ne.len() < 2 || outer != cfg.n_head * per_head {
                return Err(bad_shape(format!(
                    "its outermost axis is not {} heads × {per_head}",
                    cfg.n_head
                )));
            }
            // Each outermost entry is whole rows of ne[0] (a multiple of the block size), so its bytes
            // are a fixed-size slice.
            let each = bytes.len() / outer;
            let mut ne = t.ne.clone();
            *ne.last_mut().expect("a tensor has a dimension") = (kept * per_head) as u64;
            let (lo, hi) = (heads.start * per_head * each, heads.end * per_head * each);
            Ok((ne, Cow::Borrowed(&bytes[lo..hi])))
        }
        Cut::Columns { per_head } => {
            if t.ne.len() != 2 || t.ne[0] as usize != cfg.n_head * per_head {
                return Err(bad_shape(format!(
                    "its rows are not {} heads × {per_head} columns",
                    cfg.n_head
                )));
            }
            check_columns(ty, cfg, heads)?;
            let (bs, ts) = (ty.block, ty.type_size);
            let row = t.ne[0] as usize / bs * ts;
            let (lo, hi) = (
                heads.start * per_head / bs * ts,
                heads.end * per_head / bs * ts,
            );
            let mut out = Vec::with_capacity(t.ne[1] as usize * (hi - lo));
            for r in bytes.chunks_exact(row) {
                out.extend_from_slice(&r[lo..hi]);
            }
            Ok((vec![(kept * per_head) as u64, t.ne[1]], Cow::Owned(out)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(n_head: usize, dv: usize) -> MlaConfig {
        let mut c = crate::model::synthetic::Family::DeepseekV3.test_config();
        c.n_head = n_head;
        c.v_head_dim = dv;
        c
    }

    #[test]
    fn head_ranges_parse() {
        assert_eq!(parse("0..8", 64).unwrap(), 0..8);
        assert_eq!(parse(" 3 .. 5", 8).unwrap(), 3..5);
        for bad in ["8", "5..5", "6..2", "0..65", "a..2"] {
            assert!(parse(bad, 64).is_err(), "{bad}");
        }
    }

    #[test]
    fn column_cuts_need_block_boundaries_and_name_the_nearest() {
        let q4k = GgmlType::from_name("Q4_K").unwrap();
        let q8 = GgmlType::from_name("Q8_0").unwrap();
        let f16 = GgmlType::from_name("F16").unwrap();
        // Dv 128 in blocks of 256: heads in pairs.
        let c = cfg(8, 128);
        assert!(check_columns(q4k, &c, &(2..6)).is_ok());
        assert!(check_columns(q4k, &c, &(2..8)).is_ok());
        let e = check_columns(q4k, &c, &(1..6)).unwrap_err().to_string();
        assert!(
            e.contains("0..6 (covering)") && e.contains("2..6 (inside)"),
            "{e}"
        );
        let e = check_columns(q4k, &c, &(1..2)).unwrap_err().to_string();
        assert!(
            e.contains("0..2 (covering)") && !e.contains("inside"),
            "{e}"
        );
        // An odd head count: the end may be the last head.
        let c = cfg(7, 128);
        assert!(check_columns(q4k, &c, &(4..7)).is_ok());
        let e = check_columns(q4k, &c, &(5..7)).unwrap_err().to_string();
        assert!(
            e.contains("4..7 (covering)") && e.contains("6..7 (inside)"),
            "{e}"
        );
        // Dv a multiple of the block, or plain floats: any range.
        assert!(check_columns(q8, &cfg(8, 128), &(3..5)).is_ok());
        assert!(check_columns(f16, &cfg(8, 100), &(3..5)).is_ok());
    }
}
