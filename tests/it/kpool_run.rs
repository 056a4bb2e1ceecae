//! glm5-next's k-pool indexer on the optimized path (#37): the CPU mirror's k-pool indexer checked
//! against the reference's on pools, tie-aware (`compare::selection::kpool`), clean runs passing and
//! each planted k-pool bug caught at the selection check.

use crate::common::*;
use mla_diff::backend::cpu::kpool as mirror;
use mla_diff::compare::selection::{ScoreNoise, MARGIN_SIGMAS};
use mla_diff::gguf::GgufFile;
use mla_diff::model::{KpoolIndexer, KpoolLayer, LayerWeights, MlaConfig};
use mla_diff::precision::{Dtype, KeyPrecision};
use mla_diff::reference::kpool::{self, Reading};
use mla_diff::rope::RopeTables;
use ndarray::Array2;
use std::path::{Path, PathBuf};

/// glm5-next with `layers` layers (MLA on 3, 7, 11, …), small dims (GLM-5's indexer: 32 heads of 128,
/// kpool 16), top_k 32 (two pools) so the default schedule goes past it; `shared`: MLA layers made
/// "shared" (`indexer.types` false, no indexer tensors), written by the library's fixture writer.
pub fn g5n(dir: &Path, layers: usize, shared: &[usize]) -> PathBuf {
    let mut s = crate::kpool::small_spec(layers);
    s.indexer = s.indexer.map(|(h, d, _)| (h, d, 32));
    s.indexer_types = Some((0..layers).map(|l| !shared.contains(&l)).collect());
    let path = dir.join(format!("g5n{layers}-top32-{shared:?}.gguf"));
    mla_diff::fixture::write(&s, &path).unwrap();
    path
}

/// The `dsa` section's layers: (layer, shared_from, pass, differing pools, layout mismatches).
fn layers(j: &serde_json::Value) -> Vec<(u64, Option<u64>, bool, u64, u64)> {
    j["dsa"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let s = &l["selection"];
            (
                l["layer"].as_u64().unwrap(),
                l["shared_from"].as_u64(),
                l["pass"].as_bool().unwrap(),
                s["differing"].as_u64().unwrap(),
                s["pools"]["layout_mismatch"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Clean: the mirror's own k-pool indexer (bf16, fp16, f32) within the pool-score noise on the fixture,
/// and on the golden file (top_k 16, kpool 4, layer 2 shared) its selections pass as pools and the
/// shared layer reuses layer 1's.
#[test]
fn the_mirrors_kpool_indexer_passes_clean_runs() {
    let dir = tempfile::tempdir().unwrap();
    let p = g5n(dir.path(), 4, &[]);
    for dt in ["bf16", "fp16", "f32"] {
        let (o, j) = cpu_run_json(&p, &["--dtype", dt, "--seed", "1"]);
        assert!(o.status.success(), "{dt}: {}", stderr(&o));
        assert!(
            j["dsa"]["indexer"]
                .as_str()
                .unwrap()
                .starts_with("cpu's own, k-pool"),
            "{}",
            j["dsa"]
        );
        let l = layers(&j);
        assert!(
            l.len() == 1 && l[0].0 == 3 && l[0].2 && l[0].4 == 0,
            "{dt}: {l:?}"
        );
    }
    let (o, j) = cpu_run_json(
        &fixture("golden").join("glm5-next.gguf"),
        &["--dtype", "bf16"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // The whole report is valid: its `config` (arch glm5-next, qk_rope 0) and the `dsa` section with its `pools`.
    let errors = schema_errors(&report_validator(), &j);
    assert!(errors.is_empty(), "{errors:?}");
    let l = layers(&j);
    assert_eq!(
        l.iter().map(|l| (l.0, l.1, l.2)).collect::<Vec<_>>(),
        [(1, None, true), (2, Some(1), true), (3, None, true)],
        "{}",
        j["dsa"]
    );
    // Near-ties between pools flip in bf16, all within the margin.
    assert!(l[0].3 > 0, "{l:?}");
}

/// A short schedule past top_k 32: 96 prompt tokens (6 pools of 16) in chunks of 32 and one decode
/// step, shadow mode only.
const SHORT: &[&str] = &[
    "--prompt-len",
    "96",
    "--chunk",
    "32",
    "--decode-steps",
    "1",
    "--q-len",
    "1",
    "--mode",
    "shadow",
];

/// Each k-pool fault, planted with `run --inject`, fails the selection check of its layer (the DSA
/// section, exit 1) with every stage check clean; the shared-layer faults on a fixture whose layer 11
/// shares from layer 7 with layer 3 before it.
#[test]
fn kpool_faults_are_caught_at_the_selection() {
    let dir = tempfile::tempdir().unwrap();
    let plain = g5n(dir.path(), 4, &[]);
    let shared = g5n(dir.path(), 12, &[11]);
    let cases: [(&str, &PathBuf, &[&str], u64); 6] = [
        ("kpool_no_ape", &plain, &[], 3),
        ("kpool_softmax_channels", &plain, &[], 3),
        ("kpool_no_tail", &plain, &[], 3),
        (
            "kpool_from_position_zero",
            &plain,
            &["--pos-offset", "5"],
            3,
        ),
        ("kpool_shared_own_indexer", &shared, &[], 11),
        ("kpool_shared_wrong_layer", &shared, &[], 11),
    ];
    for (fault, file, extra, layer) in cases {
        let mut a = vec!["--dtype", "bf16", "--inject", fault];
        a.extend(SHORT);
        a.extend(extra);
        let (o, j) = cpu_run_json(file, &a);
        assert_eq!(o.status.code(), Some(1), "{fault}: {}", stderr(&o));
        let d = &j["dsa"];
        assert_eq!(d["first_layer"], layer, "{fault}: {d}");
        let l = d["layers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["layer"] == layer)
            .unwrap();
        assert_eq!(l["selection"]["pass"], false, "{fault}: {l}");
        assert!(l["own_path_first_failing"].is_null(), "{fault}: {l}");
        // The kernels' checks over the reference's selection are clean: only the selection fails.
        assert_eq!(
            j["verdict"]["first_check"],
            serde_json::Value::Null,
            "{fault}: {}",
            j["verdict"]
        );
    }
    // The same shared fixture passes clean: layer 11 reuses layer 7's own selection.
    let (o, j) = cpu_run_json(&shared, &[&["--dtype", "bf16"], SHORT].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let l = layers(&j);
    assert_eq!(
        l.iter().map(|l| (l.0, l.1, l.2)).collect::<Vec<_>>(),
        [(3, None, true), (7, None, true), (11, Some(7), true)]
    );
}

/// The mirror's pool scores against fp64, in σ of the noise model (`ScoreNoise::kpool`), over every
/// visible complete pool of every query: rms and worst. On the golden's layers 1 and 3 (8 indexer
/// heads of 32, kpool 4) at 160 tokens; the selection check's margin is 6 σ of a difference.
fn pool_error_in_sigmas(layer: usize, dt: Dtype, keys: KeyPrecision) -> (f64, f64) {
    let file = GgufFile::open(fixture("golden").join("glm5-next.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let k = KpoolIndexer::from_gguf(&file, &cfg).unwrap().unwrap();
    let kw = KpoolLayer::load(&file, &cfg, &k, layer).unwrap().unwrap();
    let w = LayerWeights::load(&file, &cfg, layer).unwrap();
    let t = 160;
    let rope = RopeTables::for_run(&cfg, None, 0, t).unwrap();
    let mut s = 0x9e3779b97f4a7c15u64 + layer as u64;
    let x = Array2::from_shape_fn((t, cfg.hidden), |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 3.4 - 1.7
    });
    let attn_in = mla_diff::reference::front::attn_in(&cfg, &w, x.view());
    let o = kpool::run(&cfg, &k, &kw, &w, attn_in.view(), Reading::default());
    let noise = ScoreNoise::kpool(&o, dt, keys);
    let plan = mirror::KpoolPlan {
        keys,
        ..Default::default()
    };
    let m = mirror::run(&cfg, &k, &kw, &w, &rope, &x, dt, plan).unwrap();
    let (mut sq, mut n, mut worst) = (0.0, 0.0, 0f64);
    for q in 0..t {
        for p in (0..o.pool_start.len()).filter(|&p| o.pool_start[p] + k.kp.kpool <= q + 1) {
            let err = m.pool_scores[[q, p]] as f64 - o.pool_scores[[q, p]];
            let sigma = noise.sigma(q, p, None);
            if sigma == 0.0 && err == 0.0 {
                continue;
            }
            sq += (err / sigma).powi(2);
            n += 1.0;
            worst = worst.max((err / sigma).abs());
        }
    }
    ((sq / n).sqrt(), worst)
}

#[test]
fn mirror_pool_score_error_is_within_its_predicted_noise() {
    for (dt, keys) in [
        (Dtype::Bf16, KeyPrecision::Storage),
        (Dtype::F16, KeyPrecision::Storage),
        (Dtype::F32, KeyPrecision::Storage),
        (Dtype::Bf16, KeyPrecision::Fp8),
    ] {
        for layer in [1, 3] {
            let (rms, worst) = pool_error_in_sigmas(layer, dt, keys);
            println!(
                "glm5-next golden layer {layer}, {} {keys:?}: pool score error rms {rms:.3} σ, worst {worst:.2} σ",
                dt.name()
            );
            assert!(rms < 1.0 && worst < MARGIN_SIGMAS, "{dt:?} {layer}");
        }
    }
}
