//! Which attention kernel the CUDA backend launches for a model's dims, worked out on the host without a
//! GPU or NVRTC (for `mla-diff lint --backend cuda`).
//!
//! `Attn::load` (attn.rs) walks a tile list (`decode_tiles` / `prefill_tiles`), compiles each and takes the
//! first whose shared memory fits the device, else the scalar kernel. The conditions it meets at run time
//! are the preprocessor guards of kernels/attention.cuh and attention_sm90.cuh and the shared-memory sizes
//! they export (`attn_mma_config`, `attn_wgmma_config`); this module restates them. `mla-diff kernels
//! check` compares `mma_smem` / `wgmma_smem` with the sizes the compiled PTX holds for every job it
//! compiles and fails if they ever disagree, so the restatement cannot drift silently.

use super::kernels::{Dims, Tile};
use super::{decode_tiles, prefill_tiles};
use crate::precision::Dtype;

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
/// does. Decode: attention_sm90.cuh's guard (sm_90a, absorbed decode, 16-bit storage, a latent of 512
/// or 256, a key row that is a multiple of 8, and a fallback tile of 64 rows); prefill:
/// prefill_sm90.cuh's (sm_90a, 16-bit storage, values at most 256 wide, a fallback tile of 64 or 128
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

/// Shared memory of `attn_wgmma` (bytes). Decode, `WG_SMEM` of attention_sm90.cuh: alignment slack, Q
/// and two key stages of 64-column blocks, the P tile, the row-max/row-sum exchange. Prefill, `PW_SMEM`
/// of prefill_sm90.cuh: alignment slack, Q of 16·wm rows, two stages of `bn` K and V rows.
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
    let w = if decode {
        Widths::decode(dims)
    } else {
        Widths::prefill(dims)
    };
    let tiles = if decode {
        decode_tiles(q_rows)
    } else {
        prefill_tiles()
    };
    let mut passed = Vec::new();
    if let Some(why) = mma_blocker(dims.dtype, &w) {
        passed.push(format!("tensor-core kernels: {why}"));
    } else {
        for t in &tiles {
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
            page: 64,
            neox: false,
            debug: true,
            faults: Active::NONE,
        }
    }

    /// The shared-memory sizes worked out by hand from the defines at DeepSeek dims (kernels check
    /// compares them with the compiled PTX on every target it builds).
    #[test]
    fn shared_memory_at_deepseek_dims() {
        let d = dims(Dtype::Bf16, 512, 64, 128, 128, 128);
        let w = Widths::decode(&d);
        // 9 blocks of 8 KB for Q, two K stages and… : 1024 + 3·73728 + 8192 + 1024.
        assert_eq!(wgmma_smem(&w, &decode_tiles(128)[0]), 231_424);
        // Q 64·576·2 + 2 stages of K 64·576·2 + P 64·72·2 + (2+1)·64·4.
        assert_eq!(mma_smem(&w, &Tile::new(4, 2, 64, 2, 2)), 231_168);
        let p = plan(&d, true, 128, "sm_90a", 232_448);
        assert_eq!(
            (p.kernel, p.smem, p.rows, p.keys),
            ("attn_wgmma", 231_424, 64, 64)
        );
        let p = plan(&d, true, 128, "sm_90", 232_448);
        assert_eq!((p.kernel, p.smem), ("attn_mma", 231_168));
        assert!(
            p.passed_over[0].contains("sm_90a only"),
            "{:?}",
            p.passed_over
        );
    }

    /// What the H200 launched in the last recorded gpu-validate (18 case runs: DeepSeek-V3, GLM-5 and
    /// MiniCPM3 dims, 8 to 128 heads, q_len 1 and 2, bf16 and fp16; prefill on wgmma) is what the plan
    /// says.
    #[test]
    fn the_plan_is_what_the_h200_launched() {
        let runs: serde_json::Value = serde_json::from_str(include_str!(
            "../../../tests/data/h200-gpu-validate-2026-12-01.json"
        ))
        .unwrap();
        let runs = runs.as_array().unwrap();
        assert_eq!(runs.len(), 18);
        let field = |s: &str, k: &str| -> usize {
            let v = s
                .split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap_or_else(|| panic!("{k} in {s}"));
            v.parse().unwrap()
        };
        let (mut wgmma, mut prefill_wgmma) = (0, 0);
        for r in runs {
            let (d, sched) = (r["dims"].as_str().unwrap(), r["schedule"].as_str().unwrap());
            let dtype = match r["dtype"].as_str().unwrap() {
                "bf16" => Dtype::Bf16,
                "fp16" => Dtype::F16,
                other => panic!("{other}"),
            };
            let mut x = dims(
                dtype,
                field(d, "Lkv="),
                field(d, "R="),
                field(d, "P="),
                field(d, "Dv="),
                field(d, "H="),
            );
            x.page = field(sched, "page=");
            let rows = field(sched, "q_len=") * x.h;
            let launched = r["kernels"].as_str().unwrap();
            // The H200: sm_90a, 227 KB of opt-in shared memory per block.
            assert_eq!(
                paths(&x, rows, "sm_90a", 232_448),
                launched,
                "{} {}",
                r["case"],
                r["dtype"]
            );
            wgmma += launched.contains("decode: mma (wgmma") as usize;
            prefill_wgmma += launched.contains("prefill: mma (wgmma") as usize;
        }
        assert!(
            wgmma > 0 && wgmma < runs.len(),
            "both decode kernels are covered"
        );
        assert_eq!(prefill_wgmma, runs.len(), "every prefill ran on wgmma");
    }

    #[test]
    fn what_passes_the_fast_kernels_over() {
        // MiniCPM3: latent 256 takes the wgmma kernel on Hopper (key row 288, padded to 320).
        let m = dims(Dtype::Bf16, 256, 32, 64, 64, 40);
        assert_eq!(
            plan(&m, true, 40 * 2, "sm_90a", 232_448).kernel,
            "attn_wgmma"
        );
        // Fewer than 64 rows per request: the small-row tiles, no wgmma.
        let p = plan(&m, true, 40, "sm_90a", 232_448);
        assert_eq!(p.kernel, "attn_mma");
        assert_eq!(p.rows, 16);
        // f32 storage and odd widths: the scalar kernel, with the reason.
        let f = plan(
            &dims(Dtype::F32, 512, 64, 128, 128, 8),
            true,
            64,
            "sm_90a",
            232_448,
        );
        assert_eq!(f.kernel, "attn_scalar");
        assert!(f.passed_over[0].contains("f32"), "{:?}", f.passed_over);
        let o = plan(
            &dims(Dtype::Bf16, 20, 6, 10, 12, 3),
            false,
            3,
            "sm_90a",
            232_448,
        );
        assert_eq!(o.kernel, "attn_scalar");
        assert!(
            o.passed_over[0].contains("not a multiple of 8"),
            "{:?}",
            o.passed_over
        );
        // Prefill on Hopper: wgmma at 128 rows x 64 keys for all three dim sets (the kernels' own
        // PW_SMEM, as `kernels check` printed it), mma on sm_90; values wider than 256: mma.
        for (d, smem) in [
            (dims(Dtype::Bf16, 512, 64, 128, 128, 128), 132_096),
            (dims(Dtype::F16, 512, 64, 192, 256, 64), 197_632),
            (m, 82_944),
        ] {
            let p = plan(&d, false, 0, "sm_90a", 232_448);
            assert_eq!(
                (p.kernel, p.smem, p.rows, p.keys),
                ("attn_wgmma", smem, 128, 64)
            );
            let p = plan(&d, false, 0, "sm_90", 232_448);
            assert_eq!(p.kernel, "attn_mma");
            assert!(
                p.passed_over[0].contains("sm_90a only"),
                "{:?}",
                p.passed_over
            );
        }
        let wide = plan(
            &dims(Dtype::Bf16, 512, 64, 128, 512, 8),
            false,
            0,
            "sm_90a",
            232_448,
        );
        assert_eq!(wide.kernel, "attn_mma");
        assert!(
            wide.passed_over[0].contains("value width 512"),
            "{:?}",
            wide.passed_over
        );
        // A latent of 384 is no wgmma shape.
        let k = dims(Dtype::Bf16, 384, 64, 128, 128, 128);
        let p = plan(&k, true, 128, "sm_90a", 232_448);
        assert_eq!(p.kernel, "attn_mma");
        assert!(
            p.passed_over[0].contains("kv_lora_rank 384"),
            "{:?}",
            p.passed_over
        );
        // On a 99 KB device the 8-warp decode tiles do not fit.
        let small = plan(
            &dims(Dtype::Bf16, 512, 64, 128, 128, 128),
            true,
            128,
            "sm_120",
            101_376,
        );
        assert!(small.smem <= 101_376, "{small:?}");
        assert!(small.passed_over.len() > 1, "{small:?}");
    }
}
