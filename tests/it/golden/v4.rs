//! The `deepseek-v4` golden (fixtures/golden/deepseek_v4.py): DeepSeek-V4 attention recorded by
//! transformers over two forward passes on one cache, converted by llama.cpp's own converter.

use ndarray::{Array2, Array3};
use ndarray_npy::read_npy;
use serde_json::Value as J;
use sha2::{Digest, Sha256};

use super::dir;

pub(super) fn manifest() -> J {
    serde_json::from_str(&std::fs::read_to_string(dir().join("deepseek-v4.json")).unwrap()).unwrap()
}

/// The files are the ones the manifest recorded (sha256), with the shapes its passes say: a golden
/// regenerated in part, or truncated in a checkout, fails here rather than as a numeric mismatch.
#[test]
fn v4_golden_files_are_the_manifests() {
    let m = manifest();
    for (name, sum) in m["files"].as_object().unwrap() {
        let bytes = std::fs::read(dir().join(name)).unwrap();
        let got = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(got, sum.as_str().unwrap(), "{name}");
    }
    let passes: Vec<usize> = m["passes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let t: usize = passes.iter().sum();
    assert_eq!(passes.len(), 2, "a prompt and a continuation");
    assert_eq!(m["tokens"].as_u64().unwrap() as usize, t);
    let hidden = m["original_config"]["hidden_size"].as_u64().unwrap() as usize;
    let layers = m["original_config"]["num_hidden_layers"].as_u64().unwrap() as usize;
    for f in ["attn_in", "attn_out"] {
        let a: Array3<f64> = read_npy(dir().join(format!("deepseek-v4.{f}.npy"))).unwrap();
        assert_eq!(a.dim(), (layers, t, hidden), "{f}");
        assert!(a.iter().all(|v| v.is_finite()), "{f}");
    }
    let topk: Array2<i32> = read_npy(dir().join("deepseek-v4.topk.npy")).unwrap();
    let k = m["original_config"]["index_topk"].as_u64().unwrap() as usize;
    assert_eq!(topk.dim(), (t, k));
    // Causality as transformers' indexer states it: entry w is valid for position p iff w < (p+1)/4.
    for (p, row) in topk.outer_iter().enumerate() {
        for &w in row {
            assert!(
                w == -1 || (w as usize) < (p + 1) / 4,
                "position {p} picked {w}"
            );
        }
    }
}

fn rel_l2(a: ndarray::ArrayView2<f64>, b: ndarray::ArrayView2<f64>) -> f64 {
    let num: f64 = a.iter().zip(b.iter()).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// The rows where two top-k selections differ only by entries whose indexer scores tie exactly with
/// the selection's boundary (ReLU zeros: every indexer head's dot product negative); panics on any
/// other difference. Returns how many rows differed.
fn selections_agree_up_to_ties(
    l: usize,
    ours: &Array2<i64>,
    scores: &Array2<f64>,
    theirs: &Array2<i32>,
) -> usize {
    let mut tied_rows = 0;
    for r in 0..ours.nrows() {
        let set = |v: Vec<i64>| -> std::collections::BTreeSet<i64> {
            v.into_iter().filter(|&i| i >= 0).collect()
        };
        let a = set(ours.row(r).to_vec());
        let b = set(theirs.row(r).iter().map(|&i| i as i64).collect());
        if a == b {
            continue;
        }
        tied_rows += 1;
        let boundary = a
            .iter()
            .map(|&i| scores[[r, i as usize]])
            .fold(f64::INFINITY, f64::min);
        for &i in a.symmetric_difference(&b) {
            let s = scores[[r, i as usize]];
            assert!(
                (s - boundary).abs() <= 1e-12 * boundary.abs().max(1.0),
                "layer {l} position {r}: entry {i} (score {s}) differs from the boundary {boundary}: ours {a:?}, transformers {b:?}"
            );
        }
    }
    tied_rows
}

/// The fp64 reference of V4 attention on the converter's file, from transformers' layer inputs, gives
/// transformers' outputs on both forward passes (rows 0..198 and 198..260: the second continues the
/// compressors' state). On the CSA layer its top-k equals transformers' but for entries tied exactly
/// at the boundary (implementation-defined), and the attention is compared on transformers' selection.
#[test]
fn v4_reference_matches_transformers_on_both_passes() {
    use mla_diff::gguf::GgufFile;
    use mla_diff::model::v4::{V4Config, V4Weights};
    use mla_diff::reference::v4::run_layer_selecting;
    let m = manifest();
    let file = GgufFile::open(dir().join("deepseek-v4.gguf")).unwrap();
    let cfg = V4Config::from_gguf(&file).unwrap();
    let x: Array3<f64> = read_npy(dir().join("deepseek-v4.attn_in.npy")).unwrap();
    let theirs: Array3<f64> = read_npy(dir().join("deepseek-v4.attn_out.npy")).unwrap();
    let topk: Array2<i32> = read_npy(dir().join("deepseek-v4.topk.npy")).unwrap();
    let hf_sel = topk.mapv(i64::from);
    let p1 = m["passes"][0].as_u64().unwrap() as usize;
    let t = x.dim().1;
    let mut failed = Vec::new();
    for l in 0..cfg.n_layer {
        let w = V4Weights::load(&file, &cfg, l).unwrap();
        let xl = x.index_axis(ndarray::Axis(0), l);
        let mut ours = run_layer_selecting(&cfg, &w, l, xl, None);
        if let Some(sel) = &ours.topk_indices {
            let tied =
                selections_agree_up_to_ties(l, sel, ours.index_scores.as_ref().unwrap(), &topk);
            println!("deepseek-v4 layer {l}: top-k equal to transformers' on {} of {t} rows, the rest differ in exact ties only", t - tied);
            ours = run_layer_selecting(&cfg, &w, l, xl, Some(&hf_sel));
        }
        let th = theirs.index_axis(ndarray::Axis(0), l);
        let e: Vec<f64> = [(0, p1), (p1, t)]
            .iter()
            .map(|&(a, b)| {
                rel_l2(
                    ours.attn_out.slice(ndarray::s![a..b, ..]),
                    th.slice(ndarray::s![a..b, ..]),
                )
            })
            .collect();
        println!(
            "deepseek-v4 layer {l} ({:?}): rel-L2 pass 1 {:.3e}, pass 2 {:.3e}",
            cfg.kind(l),
            e[0],
            e[1]
        );
        if e.iter().any(|&v| v.is_nan() || v >= 1e-6) {
            failed.push(l);
        }
    }
    assert!(failed.is_empty(), "layers {failed:?} beyond 1e-6");
}

/// rel-L2 against transformers per layer and pass, of the reference with `cfg` and weights edited by
/// `edit` (the CSA layer on transformers' selection).
fn v4_errors(
    cfg: &mla_diff::model::v4::V4Config,
    edit: &dyn Fn(&mut mla_diff::model::v4::V4Weights),
) -> Vec<[f64; 2]> {
    use mla_diff::gguf::GgufFile;
    use mla_diff::model::v4::V4Weights;
    let file = GgufFile::open(dir().join("deepseek-v4.gguf")).unwrap();
    let x: Array3<f64> = read_npy(dir().join("deepseek-v4.attn_in.npy")).unwrap();
    let theirs: Array3<f64> = read_npy(dir().join("deepseek-v4.attn_out.npy")).unwrap();
    let topk: Array2<i32> = read_npy(dir().join("deepseek-v4.topk.npy")).unwrap();
    let sel = topk.mapv(i64::from);
    let p1 = manifest()["passes"][0].as_u64().unwrap() as usize;
    let t = x.dim().1;
    (0..cfg.n_layer)
        .map(|l| {
            let mut w = V4Weights::load(&file, cfg, l).unwrap();
            edit(&mut w);
            let xl = x.index_axis(ndarray::Axis(0), l);
            let o = mla_diff::reference::v4::run_layer_selecting(cfg, &w, l, xl, Some(&sel));
            let th = theirs.index_axis(ndarray::Axis(0), l);
            let e = |a: usize, b: usize| {
                rel_l2(
                    o.attn_out.slice(ndarray::s![a..b, ..]),
                    th.slice(ndarray::s![a..b, ..]),
                )
            };
            [e(0, p1), e(p1, t)]
        })
        .collect()
}

/// A change to a layer's weights before the reference runs.
type Edit<'a> = &'a dyn Fn(&mut mla_diff::model::v4::V4Weights);

/// Each misreading of V4's conventions moves some layer's output by far more than the tolerance (the
/// golden sees it): the window one row short, the sink left out, the two ropes' bases swapped, the
/// compress rope without its YaRN.
#[test]
fn v4_golden_sees_each_misreading() {
    use mla_diff::gguf::GgufFile;
    use mla_diff::model::v4::V4Config;
    let file = GgufFile::open(dir().join("deepseek-v4.gguf")).unwrap();
    let cfg = V4Config::from_gguf(&file).unwrap();
    let mut short = cfg.clone();
    short.sliding_window -= 1;
    let mut swapped = cfg.clone();
    std::mem::swap(&mut swapped.rope_base, &mut swapped.compress_rope_base);
    let mut no_yarn = cfg.clone();
    no_yarn.yarn = None;
    let none = |_: &mut mla_diff::model::v4::V4Weights| {};
    let no_sink = |w: &mut mla_diff::model::v4::V4Weights| w.sinks.fill(f64::NEG_INFINITY);
    let cases: [(&str, &V4Config, Edit); 4] = [
        ("window one row short", &short, &none),
        ("sink left out", &cfg, &no_sink),
        ("main/compress rope bases swapped", &swapped, &none),
        ("compress rope without YaRN", &no_yarn, &none),
    ];
    for (what, c, edit) in cases {
        let e = v4_errors(c, edit);
        let worst = e.iter().flatten().copied().fold(0.0, f64::max);
        println!("deepseek-v4 misreading {what:?}: worst rel-L2 {worst:.3e} {e:?}");
        assert!(worst > 1e-4, "{what}: {e:?}");
    }
}
