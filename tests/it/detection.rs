//! The checks have teeth: the bug classes that silently corrupt MLA (rope pairing mix-ups, a softmax
//! scale without YaRN's mscale²) push the mirror-vs-reference error far beyond the bf16 bounds.

use crate::common;
use common::*;
use mla_diff::model::synthetic::Family;
use mla_diff::model::RopePairing;
use mla_diff::precision::Dtype;
use mla_diff::trace::Stage;

#[test]
fn wrong_rope_pairing_is_detected() {
    for fam in [Family::DeepseekV3, Family::Minicpm3] {
        let good = Case::new(fam, busy_schedule(), 31);
        let mut cfg = good.cfg.clone();
        cfg.rope.pairing = match cfg.rope.pairing {
            RopePairing::Norm => RopePairing::Neox,
            RopePairing::Neox => RopePairing::Norm,
        };
        let bad = Case::with_config(fam, cfg, busy_schedule(), 31);
        let (r, m) = (bad.reference(), good.mirror(Dtype::Bf16));
        let lora = good.cfg.q_lora_rank.is_some();
        for s in [Stage::QPe, Stage::KPe, Stage::Lse, Stage::AttnOut] {
            let e = stage_error(m.get(s).unwrap(), r.get(s).unwrap()).rel_l2;
            let tol = tolerance(s, lora, Dtype::Bf16);
            assert!(
                e > 3.0 * tol,
                "{} {s}: pairing bug gives only {e:e} (bound {tol:e})",
                fam.name()
            );
        }
    }
}

#[test]
fn softmax_scale_without_mscale_is_detected() {
    for fam in [Family::DeepseekV3, Family::DeepseekV2Lite] {
        let good = Case::new(fam, busy_schedule(), 32);
        let mut cfg = good.cfg.clone();
        assert!(cfg.mscale > 1.2);
        cfg.softmax_scale = 1.0 / (cfg.qk_head_dim() as f64).sqrt();
        let bad = Case::with_config(fam, cfg, busy_schedule(), 32);
        let (r, m) = (bad.reference(), good.mirror(Dtype::Bf16));
        let lora = good.cfg.q_lora_rank.is_some();
        // Stages before the softmax are untouched; everything after it is off.
        let e = stage_error(m.get(Stage::QPe).unwrap(), r.get(Stage::QPe).unwrap()).rel_l2;
        assert!(e <= tolerance(Stage::QPe, lora, Dtype::Bf16));
        for s in [
            Stage::Lse,
            Stage::SplitLse,
            Stage::AttnLatent,
            Stage::AttnHeads,
            Stage::AttnOut,
        ] {
            let e = stage_error(m.get(s).unwrap(), r.get(s).unwrap()).rel_l2;
            let tol = tolerance(s, lora, Dtype::Bf16);
            assert!(
                e > 3.0 * tol,
                "{} {s}: missing mscale² gives only {e:e} (bound {tol:e})",
                fam.name()
            );
        }
    }
}

/// The absorbed query `W_UKᵀ·q_nope` of a layer with large W_UK overflows fp16 (llama.cpp #13137):
/// the mirror keeps that behaviour (inf), bf16 does not overflow and stays within its bound.
#[test]
fn fp16_overflow_of_the_absorbed_query_is_kept() {
    let mut c = Case::new(Family::DeepseekV2Lite, small_schedule(), 33);
    c.w.w_uk.mapv_inplace(|v| v * 5e4);
    let r = c.reference();
    let q_ref = r.get(Stage::QAbsorbed).unwrap();
    assert!(q_ref.data.iter().all(|v| v.is_finite()));
    assert!(q_ref.data.iter().any(|v| v.abs() > 65504.0));
    let h = c.mirror(Dtype::F16);
    assert!(h
        .get(Stage::QAbsorbed)
        .unwrap()
        .data
        .iter()
        .any(|v| v.is_infinite()));
    assert!(all_finite(&h).is_err());
    let b = c.mirror(Dtype::Bf16);
    let e = stage_error(b.get(Stage::QAbsorbed).unwrap(), q_ref).rel_l2;
    assert!(
        e <= tolerance(Stage::QAbsorbed, false, Dtype::Bf16),
        "{e:e}"
    );
}

/// The local view's noise model of the f32 LSEs matches what the mirror's f32 arithmetic does (its
/// measured rel-L2 over the predicted): split_lse was 0.6 and lse[decode] 0.8 while the model
/// counted a rounding at its worst place for every f32 operation of a score — on bf16 operands most of
/// them are exact — which put the whole-stage thresholds at 2.4–3.6× the noise (docs/selftest.md).
#[test]
fn lse_noise_model_matches_the_mirror() {
    let serving = [
        "--layers",
        "1",
        "--mode",
        "shadow",
        "--prompt-len",
        "48",
        "--chunk",
        "32",
        "--decode-steps",
        "16",
        "--page-size",
        "16",
        "--num-splits",
        "4",
    ];
    let (o, j) = crate::common::cpu_run_json(
        &crate::common::fixture("deepseek-v3-yarn-q4_k.gguf"),
        &serving,
    );
    assert_eq!(o.status.code(), Some(0), "{}", crate::common::stderr(&o));
    let checks = j["modes"][0]["layers"][0]["checks"].as_array().unwrap();
    for name in ["split_lse", "lse[decode]"] {
        let c = checks.iter().find(|c| c["check"] == name).expect(name);
        let l = &c["local"];
        let r = l["rel_l2"].as_f64().unwrap() / l["predicted_rel_l2"].as_f64().unwrap();
        assert!(
            (0.75..1.35).contains(&r),
            "{name}: measured/predicted {r:.2}"
        );
    }
}
