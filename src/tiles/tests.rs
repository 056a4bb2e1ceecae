//! The host model's tests: the split rules, the shared-memory figures against the kernels', and the
//! choice against what the H200 launched.

use super::choice::*;
use super::*;
use crate::faults::Active;
use crate::kernel_use::{Family, Phase};

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

fn dims_page64(dtype: Dtype, lkv: usize, r: usize, p: usize, dv: usize, h: usize) -> Dims {
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
    let d = dims_page64(Dtype::Bf16, 512, 64, 128, 128, 128);
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
        "../../tests/data/h200-gpu-validate-2026-12-01.json"
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
        let mut x = dims_page64(
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
    let m = dims_page64(Dtype::Bf16, 256, 32, 64, 64, 40);
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
        &dims_page64(Dtype::F32, 512, 64, 128, 128, 8),
        true,
        64,
        "sm_90a",
        232_448,
    );
    assert_eq!(f.kernel, "attn_scalar");
    assert!(f.passed_over[0].contains("f32"), "{:?}", f.passed_over);
    let o = plan(
        &dims_page64(Dtype::Bf16, 20, 6, 10, 12, 3),
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
        (dims_page64(Dtype::Bf16, 512, 64, 128, 128, 128), 132_096),
        (dims_page64(Dtype::F16, 512, 64, 192, 256, 64), 197_632),
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
        &dims_page64(Dtype::Bf16, 512, 64, 128, 512, 8),
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
    let k = dims_page64(Dtype::Bf16, 384, 64, 128, 128, 128);
    let p = plan(&k, true, 128, "sm_90a", 232_448);
    assert_eq!(p.kernel, "attn_mma");
    assert!(
        p.passed_over[0].contains("kv_lora_rank 384"),
        "{:?}",
        p.passed_over
    );
    // On a 99 KB device the 8-warp decode tiles do not fit.
    let small = plan(
        &dims_page64(Dtype::Bf16, 512, 64, 128, 128, 128),
        true,
        128,
        "sm_120",
        101_376,
    );
    assert!(small.smem <= 101_376, "{small:?}");
    assert!(small.passed_over.len() > 1, "{small:?}");
}

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
    assert!(mma_smem(&Widths::of(&d, true), &decode_tiles(64)[1]) > AMPERE.smem_optin);
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
    // in sm90/decode/attn_wgmma.cuh's header and in `kernels check`'s table).
    let d = dims(Dtype::Bf16, 512, 64, 128, 128, 16);
    let t = decode_tiles(64)[0];
    assert_eq!(wgmma_smem(&Widths::of(&d, true), &t), 231_424);
    assert!(wgmma_smem(&Widths::of(&d, true), &t) <= HOPPER.smem_optin);
    // Prefill (PW_SMEM): 1 KB + Q 128 x 192 + two stages of 64 K (192) and V (128) rows; at 128 keys
    // 209 KB (fits), at GLM-5's 256 / 256 with 128 keys 328 KB (does not: the 64-key tile runs).
    let pre = prefill_tiles()[0];
    assert!(pre.wgmma && pre.wm == 8 && pre.bn == 64);
    assert_eq!(wgmma_smem(&Widths::of(&d, false), &pre), 132_096);
    let bn128 = Tile::wgmma(Tile::new(8, 1, 128, 2, 1));
    assert_eq!(wgmma_smem(&Widths::of(&d, false), &bn128), 214_016);
    let glm = dims(Dtype::Bf16, 512, 64, 192, 256, 64);
    assert_eq!(wgmma_smem(&Widths::of(&glm, false), &pre), 197_632);
    assert!(wgmma_smem(&Widths::of(&glm, false), &bn128) > HOPPER.smem_optin);
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
        wgmma_smem(
            &Widths::of(&dims(Dtype::Bf16, 256, 32, 64, 64, 4), true),
            &t
        ),
        133_120
    );
}
