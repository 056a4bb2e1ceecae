//! Kimi-K2.5 and K3-class head counts (#37). Kimi-K2.5's text model is Kimi-K2's attention with YaRN ×64
//! to 256K instead of ×32 to 128K: `lint` and `inspect` name each of the two from its own file. At 96
//! heads (K3-class) `run` on the CPU mirror passes, and its coverage lists the production variants a
//! CUDA run at 96 heads and its TP slices would select.

use crate::common::*;
use serde_json::Value as J;

fn kimi(dir: &std::path::Path, preset: &str, heads: &str) -> std::path::PathBuf {
    make_fixture(
        dir,
        &format!("{preset}-{heads}.gguf"),
        &[
            "--preset", preset, "--layers", "1", "--hidden", "256", "--heads", heads, "--quant",
            "f32",
        ],
    )
}

/// The one lint finding of `severity` on `check`.
fn finding<'a>(j: &'a J, severity: &str, check: &str) -> &'a J {
    let f: Vec<&J> = j["findings"]
        .as_array()
        .unwrap_or_else(|| panic!("no findings in {j}"))
        .iter()
        .filter(|f| f["severity"] == severity && f["check"] == check)
        .collect();
    assert_eq!(f.len(), 1, "{severity} {check} in {j:#}");
    f[0]
}

#[test]
fn lint_and_inspect_name_kimi_k2_and_kimi_k2_5_apart() {
    let dir = tempfile::tempdir().unwrap();
    // (preset, model, YaRN factor): the softmax scale is mscale² / sqrt(192), mscale = 0.1 ln(factor) + 1.
    for (preset, model, factor) in [
        ("kimi-k2", "Kimi-K2 ", 32f64),
        ("kimi-k2.5", "Kimi-K2.5 ", 64.0),
    ] {
        let f = kimi(dir.path(), preset, "64");
        let o = run(&["lint", f.to_str().unwrap(), "--json", "-"]);
        assert!(o.status.success(), "{preset}: {}", stderr(&o));
        let j: J = serde_json::from_slice(&o.stdout).unwrap();
        let c = finding(&j, "note", "catalogue");
        assert!(
            c["found"].as_str().unwrap().starts_with(model),
            "{preset}: {c}"
        );
        assert_eq!(j["warnings"], 0, "{preset}: {j:#}");
        let m = 0.1 * factor.ln() + 1.0;
        let want = m * m / 192f64.sqrt();
        let s = finding(&j, "note", "softmax_scale")["found"]
            .as_str()
            .unwrap()
            .to_string();
        let got: f64 = s.split(' ').next().unwrap().parse().unwrap();
        assert!((got - want).abs() < 1e-6, "{preset}: {s} vs {want}");
        assert_eq!(inspect_json(&f)["catalogue"], preset, "{preset}");
        let text = String::from_utf8(run(&["inspect", f.to_str().unwrap()]).stdout).unwrap();
        assert!(
            text.contains(&format!("catalogue     {model}(preset {preset};")),
            "{text}"
        );
    }
}

#[test]
fn run_passes_at_96_heads_and_lists_the_variants_of_its_tp_slices() {
    let dir = tempfile::tempdir().unwrap();
    let f = kimi(dir.path(), "kimi-k2.5", "96");
    // A short schedule: every production variant is still reached (by the batches aimed at them).
    let (o, j) = cpu_run_json(&f, &["--prompt-len", "48", "--decode-steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(j["config"]["n_head"], 96);
    let v = j["coverage"]["variants"]["list"].as_array().unwrap();
    let ids: Vec<&str> = v.iter().map(|x| x["id"].as_str().unwrap()).collect();
    let missed: Vec<&str> = v
        .iter()
        .filter(|x| x["reached"] != true)
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert!(missed.is_empty(), "{missed:?}");
    // 96 rows take the 64-row Hopper kernels (a full row tile and a half one); the TP slice of 48
    // heads (H/2) falls below 64 rows, to attn_small and attn_mma (24 and 12 heads select the same).
    let when = |id: &str| {
        v.iter()
            .find(|x| x["id"] == id)
            .unwrap_or_else(|| panic!("{id} not in {ids:?}"))["when"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for id in [
        "decode/attn_wgmma/ld.global",
        "decode/attn_wgmma_pairs/tma",
        "decode/attn_wgmma_pairs/tma-multi-tile-page",
    ] {
        assert!(when(id).starts_with("heads 96,"), "{id}: {}", when(id));
    }
    for id in [
        "decode/attn_small/tma-ring-multi-tile-page",
        "decode/attn_mma/ld.global",
    ] {
        assert!(
            when(id).starts_with("heads 48 (TP slice H/2)"),
            "{id}: {}",
            when(id)
        );
    }
    assert!(ids.contains(&"prefill/attn_wgmma"), "{ids:?}");
}
