//! The production decode/prefill variants the selection rules of this module can pick for a model's dims
//! on a device, over the serving matrix (issue #35): the one source of truth coverage (and the default
//! schedule's segments) enumerate from. A variant is a kernel plus how it loads its keys: the decode
//! kernels' choice is `decode_tiles` (by q_len x heads), then, on sm_90a, the TMA page rule
//! (`attn_wgmma` takes key tiles by TMA when the page is a multiple of its 64-key tile, several tiles
//! per page past 64), `pairs_rule` (`attn_wgmma_pairs`, at 576/512 with TMA) and, for fewer than 64
//! rows, `small_rule` (`attn_small`, pages a multiple of 32); on a DSA file, `sparse_attn` past top_k.

use super::choice::{self as plan, Caps};
use super::{decode_tiles, pairs_rule, small_rule, Dims};
use crate::faults::{Active, Fault, Need};
use crate::kernel_use::Phase;
use crate::precision::Dtype;

/// The serving matrix the variants are enumerated over.
pub const PAGES: [usize; 3] = [16, 64, 128];
/// Split counts of a decode launch.
pub const SPLITS: [usize; 4] = [1, 2, 4, 8];
/// Queries per decode step: one, and multi-token prediction (2).
pub const Q_LENS: [usize; 2] = [1, 2];
/// Head slices a tensor-parallel rank sees: H, H/2, H/4, H/8.
pub const TP: [usize; 4] = [1, 2, 4, 8];
/// Context lengths of a launch: a short one (a few hundred keys) and a long one.
pub const KEYS: [usize; 2] = [256, 4096];

/// One production variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variant {
    pub phase: Phase,
    /// Stable id, e.g. `decode/attn_wgmma_pairs/tma-multi-tile-page`.
    pub id: String,
    /// The kernel's name in kernels/.
    pub kernel: &'static str,
    /// When the rules select it (a launch that does, first in the matrix's order).
    pub when: String,
    /// That launch (decode variants; `None` for prefill and the sparse path).
    pub launch: Option<Launch>,
}

/// One decode launch, as the rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub heads: usize,
    pub q_len: usize,
    pub page: usize,
    pub splits: usize,
    pub n_keys: usize,
}

/// The decode variant the rules select for `launch` on `caps`, for a model of `d`'s dims (`d.h` and
/// `d.page` are replaced by the launch's): (kernel, key loads).
pub fn decode_variant(d: &Dims, caps: &Caps, l: &Launch) -> (&'static str, &'static str) {
    let d = Dims {
        h: l.heads,
        page: l.page,
        ..*d
    };
    let rows = l.q_len * l.heads;
    let t = plan::select(&d, &decode_tiles(rows), true, caps, false);
    let sm90a = caps.arch() == "sm_90a";
    let (keys, splits) = (l.n_keys as i32, l.splits as i32);
    match t {
        None => ("attn_scalar", "ld.global"),
        Some(t) if t.wgmma => {
            let tma = l.page.is_multiple_of(64);
            let pairs = tma && d.lkv + d.r == 576 && d.lkv == 512 && pairs_rule(keys, splits);
            let loads = match (tma, l.page > 64) {
                (false, _) => "ld.global",
                (true, false) => "tma",
                (true, true) => "tma-multi-tile-page",
            };
            (
                if pairs {
                    "attn_wgmma_pairs"
                } else {
                    "attn_wgmma"
                },
                loads,
            )
        }
        Some(t) => {
            let small = sm90a
                && d.dtype != Dtype::F32
                && t.wm == 1
                && t.bn == 32
                && (d.lkv + d.r).is_multiple_of(8)
                && d.lkv.is_multiple_of(64)
                && l.page.is_multiple_of(32)
                && small_rule(keys, splits);
            match (small, l.page > 32) {
                (true, false) => ("attn_small", "tma-ring"),
                (true, true) => ("attn_small", "tma-ring-multi-tile-page"),
                (false, _) => ("attn_mma", "ld.global"),
            }
        }
    }
}

/// The id of a decode variant.
pub fn decode_id(kernel: &str, loads: &str) -> String {
    format!("decode/{kernel}/{loads}")
}

/// The ids of the decode variants `launches` select on `caps` for dims `d` (16-bit storage).
pub fn reached(d: &Dims, caps: &Caps, launches: &[Launch]) -> Vec<String> {
    let d = Dims {
        dtype: Dtype::Bf16,
        ..*d
    };
    launches
        .iter()
        .map(|l| {
            let (k, loads) = decode_variant(&d, caps, l);
            decode_id(k, loads)
        })
        .collect()
}

/// Whether kernel-variant fault `f` (`Fault::is_variant`) is in the kernel the rules pick: `kernel`
/// and `loads` of `decode_variant`. (Every other fault is in every kernel: true.)
pub fn fault_in(f: Fault, kernel: &str, loads: &str) -> bool {
    match f {
        // attn_wgmma_pairs's hand-over of the running max (sm90/decode/attn_wgmma_pairs.cuh).
        Fault::PairsHandoverStale => kernel == "attn_wgmma_pairs",
        // attn_small's ring of key stages (sm90/decode/attn_small.cuh).
        Fault::SmallRingWrap => kernel == "attn_small",
        // The TMA box of attn_wgmma's key tiles (`wg_tma_k`, which attn_wgmma_pairs shares) on pages of
        // several 64-key tiles; attn_small's 32-key boxes address their rows themselves.
        Fault::TmaPageTile => kernel.starts_with("attn_wgmma") && loads == "tma-multi-tile-page",
        _ => true,
    }
}

/// The layer's faults `fx` as decode launch `l` runs them on sm_90a for a model of dims `d` in its
/// dtype (the CPU mirror's model of the CUDA kernels): a kernel-variant fault only where the rules pick
/// its kernel for that launch, every other fault as it is.
pub fn faults_at(fx: Active, d: &Dims, l: &Launch) -> Active {
    if !VARIANT_FAULTS.iter().any(|&f| fx.on(f)) {
        return fx;
    }
    let (kernel, loads) = decode_variant(d, &super::choice::HOPPER, l);
    VARIANT_FAULTS
        .into_iter()
        .filter(|&f| !fault_in(f, kernel, loads))
        .fold(fx, |a, f| a.without(f))
}

/// The faults of one dense decode kernel each (`fault_in`).
pub const VARIANT_FAULTS: [Fault; 3] = [
    Fault::PairsHandoverStale,
    Fault::SmallRingWrap,
    Fault::TmaPageTile,
];

/// The layer's faults `fx` as the DSA sparse kernel (`sparse_attn`) runs them: none of the dense
/// kernels' variant faults.
pub fn sparse_faults(fx: Active) -> Active {
    VARIANT_FAULTS.into_iter().fold(fx, |a, f| a.without(f))
}

/// `n.met(cfg, s)`, with the needs of the kernel-variant faults answered by the rules: decode steps on
/// a model whose production decode variants (bf16, sm_90a) include the kernel (a plain run reaches each
/// of them, by its own launches or a batch aimed at it: `backend::serving::aims`).
pub fn need_met(
    n: Need,
    cfg: &crate::model::MlaConfig,
    s: &crate::schedule::Schedule,
) -> Option<bool> {
    let f = match n {
        Need::PairsKernel => Fault::PairsHandoverStale,
        Need::SmallKernel => Fault::SmallRingWrap,
        Need::MultiTilePage => Fault::TmaPageTile,
        _ => return n.met(cfg, s),
    };
    let d = Dims::of_model(cfg, Dtype::Bf16);
    let has = variants(&d, &super::choice::HOPPER, None)
        .iter()
        .filter_map(|v| v.id.rsplit_once('/').map(|(_, loads)| (v.kernel, loads)))
        .any(|(kernel, loads)| fault_in(f, kernel, loads));
    Some(s.decode_steps > 0 && has)
}

/// The DSA variant's id.
pub const SPARSE_ID: &str = "decode/sparse_attn/past-top-k";

/// Every production variant the rules can select for dims `d` (16-bit storage: production runs bf16) on
/// `caps` over the serving matrix, sorted by id; `dsa_top_k`: a DSA file's indexer top_k.
pub fn variants(d: &Dims, caps: &Caps, dsa_top_k: Option<usize>) -> Vec<Variant> {
    let d = Dims {
        dtype: Dtype::Bf16,
        ..*d
    };
    let mut out: Vec<Variant> = Vec::new();
    let pre = plan::select(&d, &super::prefill_tiles(), false, caps, false);
    let kernel = match plan::family(pre) {
        crate::kernel_use::Family::Wgmma => "attn_wgmma",
        crate::kernel_use::Family::Mma => "attn_mma",
        _ => "attn_scalar",
    };
    out.push(Variant {
        phase: Phase::Prefill,
        id: format!("prefill/{kernel}"),
        kernel,
        when: format!("every prompt ({})", plan::label(pre)),
        launch: None,
    });
    for tp in TP {
        if d.h < tp || !d.h.is_multiple_of(tp) {
            continue;
        }
        for q_len in Q_LENS {
            for page in PAGES {
                for splits in SPLITS {
                    for n_keys in KEYS {
                        let l = Launch {
                            heads: d.h / tp,
                            q_len,
                            page,
                            splits,
                            n_keys,
                        };
                        let (kernel, loads) = decode_variant(&d, caps, &l);
                        let id = decode_id(kernel, loads);
                        if out.iter().any(|v| v.id == id) {
                            continue;
                        }
                        out.push(Variant {
                            phase: Phase::Decode,
                            id,
                            kernel,
                            when: format!(
                                "heads {}{}, q_len {q_len}, page {page}, {splits} split(s), {n_keys} keys",
                                l.heads,
                                if tp > 1 { format!(" (TP slice H/{tp})") } else { String::new() }
                            ),
                            launch: Some(l),
                        });
                    }
                }
            }
        }
    }
    if let Some(k) = dsa_top_k {
        out.push(Variant {
            phase: Phase::Decode,
            id: SPARSE_ID.into(),
            kernel: "sparse_attn",
            when: format!("a query that sees more than top_k = {k} keys"),
            launch: None,
        });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiles::choice::{AMPERE, HOPPER};

    /// DeepSeek-V3 / GLM-5 sized: 576/512, 128 heads.
    fn deepseek(h: usize) -> Dims {
        Dims {
            dtype: Dtype::Bf16,
            lkv: 512,
            r: 64,
            p: 128,
            dv: 128,
            h,
            page: 16,
            neox: false,
            debug: true,
            faults: Active::NONE,
        }
    }

    fn ids(v: &[Variant]) -> Vec<&str> {
        v.iter().map(|v| v.id.as_str()).collect()
    }

    #[test]
    fn the_serving_matrix_reaches_every_hopper_decode_kernel() {
        let v = variants(&deepseek(128), &HOPPER, Some(2048));
        assert_eq!(
            ids(&v),
            [
                "decode/attn_mma/ld.global",
                "decode/attn_small/tma-ring-multi-tile-page",
                "decode/attn_wgmma/ld.global",
                "decode/attn_wgmma/tma",
                "decode/attn_wgmma/tma-multi-tile-page",
                "decode/attn_wgmma_pairs/tma",
                "decode/attn_wgmma_pairs/tma-multi-tile-page",
                "decode/sparse_attn/past-top-k",
                "prefill/attn_wgmma",
            ]
        );
        // attn_small comes from a TP head slice (128 / 4 = 32 heads: 32 rows < 64).
        let small = v.iter().find(|v| v.kernel == "attn_small").unwrap();
        assert!(small.when.contains("(TP slice H/"), "{}", small.when);
        // No sparse variant on a dense file; Ampere has none of the sm_90a kernels.
        assert!(!ids(&variants(&deepseek(128), &HOPPER, None)).contains(&SPARSE_ID));
        assert_eq!(
            ids(&variants(&deepseek(128), &AMPERE, None)),
            ["decode/attn_mma/ld.global", "prefill/attn_mma"]
        );
    }

    #[test]
    fn the_rules_pick_by_page_splits_and_heads() {
        let d = deepseek(128);
        let l = |heads, page, splits, n_keys| Launch {
            heads,
            q_len: 1,
            page,
            splits,
            n_keys,
        };
        let pick = |l: Launch| decode_variant(&d, &HOPPER, &l);
        // Page 16: no TMA. Page 64, at most 2 splits: pairs. More short splits: attn_wgmma by TMA.
        assert_eq!(pick(l(128, 16, 2, 256)), ("attn_wgmma", "ld.global"));
        assert_eq!(pick(l(128, 64, 2, 256)), ("attn_wgmma_pairs", "tma"));
        assert_eq!(pick(l(128, 64, 4, 256)), ("attn_wgmma", "tma"));
        assert_eq!(pick(l(128, 64, 4, 4096)), ("attn_wgmma_pairs", "tma"));
        assert_eq!(
            pick(l(128, 128, 1, 256)),
            ("attn_wgmma_pairs", "tma-multi-tile-page")
        );
        // 16 heads: attn_small on pages of 32-key multiples, unless many short splits.
        assert_eq!(
            pick(l(16, 64, 2, 256)),
            ("attn_small", "tma-ring-multi-tile-page")
        );
        assert_eq!(pick(l(16, 32, 2, 256)), ("attn_small", "tma-ring"));
        assert_eq!(pick(l(16, 64, 8, 256)), ("attn_mma", "ld.global"));
        assert_eq!(pick(l(16, 16, 1, 256)), ("attn_mma", "ld.global"));
    }

    #[test]
    fn a_variant_fault_runs_only_where_the_rules_pick_its_kernel() {
        let all = Active::NONE
            .with(Fault::PairsHandoverStale)
            .with(Fault::SmallRingWrap)
            .with(Fault::TmaPageTile)
            .with(Fault::SplitDropLast);
        let at = |d: &Dims, heads, page, splits| {
            let l = Launch {
                heads,
                q_len: 1,
                page,
                splits,
                n_keys: 256,
            };
            let fx = faults_at(all, d, &l);
            VARIANT_FAULTS
                .into_iter()
                .filter(|&f| fx.on(f))
                .map(|f| f.name())
                .collect::<Vec<_>>()
        };
        let d = deepseek(128);
        // Page 16: no TMA, no kernel of theirs; the other faults stay.
        assert!(at(&d, 128, 16, 1).is_empty());
        assert!(faults_at(
            all,
            &d,
            &Launch {
                heads: 128,
                q_len: 1,
                page: 16,
                splits: 1,
                n_keys: 256
            }
        )
        .on(Fault::SplitDropLast));
        assert_eq!(at(&d, 128, 64, 1), ["pairs_handover_stale"]);
        assert_eq!(
            at(&d, 128, 128, 1),
            ["pairs_handover_stale", "tma_page_tile"]
        );
        assert_eq!(at(&d, 128, 128, 8), ["tma_page_tile"]);
        assert_eq!(at(&d, 16, 64, 2), ["small_ring_wrap"]);
        // f32: the scalar kernel, none of them.
        let f32 = Dims {
            dtype: Dtype::F32,
            ..d
        };
        assert!(at(&f32, 128, 128, 1).is_empty() && at(&f32, 16, 64, 2).is_empty());
        // The sparse kernel has none of them.
        assert_eq!(sparse_faults(all), Active::NONE.with(Fault::SplitDropLast));
    }
}
