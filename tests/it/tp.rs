//! `run --tp N`: the layer as N tensor-parallel ranks (heads sliced, partial o_proj all-reduced). A clean
//! fixture passes at TP 2 and 4, per rank and merged; a bug planted in one rank fails that rank only and
//! the verdict names it; the merged result equals the TP=1 run within the mirror's own noise; sizes that
//! do not divide the heads are refused.

use super::common;
use mla_diff::backend::cpu::CpuMirror;
use mla_diff::backend::Backend;
use mla_diff::compare::ToleranceTable;
use mla_diff::model::synthetic::Family;
use mla_diff::precision::Dtype;
use mla_diff::tp::{TpBackend, TpSpec};
use mla_diff::trace::Stage;
use serde_json::Value;
use std::path::Path;

fn run_json(model: &Path, dir: &Path, extra: &[&str]) -> (i32, Value) {
    let j = dir.join("tp.json");
    let mut a = vec!["run", model.to_str().unwrap(), "-q", "--mode", "shadow"];
    a.extend_from_slice(&super::shard::ARGS);
    a.extend_from_slice(extra);
    a.extend_from_slice(&["--json", j.to_str().unwrap()]);
    let o = common::run(&a);
    let code = o.status.code().unwrap();
    assert!(code <= 1, "{}", common::stderr(&o));
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    let errors = common::schema_errors(&common::report_validator(), &json);
    assert!(errors.is_empty(), "{errors:#?}");
    (code, json)
}

fn model(dir: &Path) -> std::path::PathBuf {
    // The tiny preset has 4 heads.
    common::make_fixture(dir, "tiny.gguf", &["--preset", "tiny"])
}

#[test]
fn tp_2_and_4_pass_per_rank_and_merged() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    for n in [2usize, 4] {
        let (code, json) = run_json(&m, dir.path(), &["--tp", &n.to_string()]);
        assert_eq!(code, 0, "TP {n}: {}", json["verdict"]["message"]);
        let tp = &json["tp"];
        assert_eq!(tp["size"], n);
        assert_eq!(tp["pass"], true);
        let ranks = tp["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), n);
        for (r, rk) in ranks.iter().enumerate() {
            let per = 4 / n;
            assert_eq!(rk["heads"], serde_json::json!([r * per, (r + 1) * per]));
            assert_eq!(rk["verdict"]["pass"], true);
            // Every layer, every check of the rank compared.
            assert_eq!(rk["layers"].as_array().unwrap().len(), 2);
        }
        // The merged layer: the whole model's heads.
        let q = &json["modes"][0]["layers"][0]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "q_pe")
            .unwrap()["shape"];
        assert_eq!(q[1], 4);
        // The merged attn_out is judged end to end, and every report says so.
        let notices = json["run"]["notices"].to_string();
        assert!(
            notices.contains("merged attn_out is judged end to end"),
            "{notices}"
        );
        let checks = json["modes"][0]["layers"][0]["checks"].as_array().unwrap();
        for c in checks {
            let name = c["check"].as_str().unwrap();
            assert_eq!(
                c.get("local").is_none(),
                name.starts_with("attn_out"),
                "{name}"
            );
        }
        assert!(json["environment"]["backend"]
            .as_str()
            .unwrap()
            .contains(&format!("tensor parallel {n}")));
    }
}

#[test]
fn a_bug_in_one_rank_is_attributed_to_that_rank() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let (xml, md) = (dir.path().join("tp.xml"), dir.path().join("tp.md"));
    let (code, json) = run_json(
        &m,
        dir.path(),
        &[
            "--tp",
            "2",
            "--inject",
            "rope_neox",
            "--inject-rank",
            "1",
            "--junit",
            xml.to_str().unwrap(),
            "--markdown",
            md.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 1);
    // JUnit: a case per rank, rank 1's failing; Markdown: a line per rank.
    let xml = std::fs::read_to_string(xml).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let case = |name: &str| {
        doc.descendants()
            .find(|n| n.has_tag_name("testcase") && n.attribute("name") == Some(name))
            .unwrap_or_else(|| panic!("no JUnit case {name}"))
    };
    assert!(!case("tp rank 0")
        .children()
        .any(|c| c.has_tag_name("failure")));
    assert!(case("tp rank 1")
        .children()
        .any(|c| c.has_tag_name("failure")));
    let md = std::fs::read_to_string(md).unwrap();
    assert!(
        md.contains("- tp rank 1 of 2 (heads 2..4): DIVERGENCE"),
        "{md}"
    );
    assert!(md.contains("- tp rank 0 of 2 (heads 0..2): PASS"), "{md}");
    let ranks = json["tp"]["ranks"].as_array().unwrap();
    assert_eq!(ranks[0]["verdict"]["pass"], true, "rank 0 is clean");
    assert_eq!(ranks[1]["verdict"]["pass"], false);
    assert_eq!(ranks[1]["verdict"]["first_check"], "q_pe");
    let msg = json["verdict"]["message"].as_str().unwrap();
    assert!(msg.contains("rank 1 (heads 2..4)"), "{msg}");
    // The merged q_pe fails in rank 1's heads only.
    let q = json["modes"][0]["layers"][0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "q_pe")
        .unwrap()
        .clone();
    assert_eq!(q["pass"], false);
    assert!(q["metrics"]["max_abs_at"]["head"].as_u64().unwrap() >= 2);
}

#[test]
fn tp_merged_equals_tp1_within_the_noise() {
    // A synthetic DeepSeek-V3-shaped layer (4 heads), TP 1 vs TP 4 (a head per rank) on the CPU mirror.
    let c = common::Case::new(Family::DeepseekV3, common::busy_schedule(), 7);
    let reference = c.reference();
    let tp1 = c.mirror(Dtype::Bf16);
    let mut mirror = CpuMirror::new(Dtype::Bf16);
    let spec = TpSpec {
        size: 4,
        fault_rank: None,
    };
    let tol = ToleranceTable::defaults();
    let mut tp = TpBackend::new(&mut mirror, spec, Dtype::Bf16, tol);
    let tp4 = tp.run_layer(&c.ctx(), &c.x).unwrap();
    assert!(tp.result(&c.cfg, &[c.w.layer]).pass);
    for s in Stage::ALL {
        let (a, b) = (tp4.get(s).unwrap(), tp1.get(s).unwrap());
        let r = reference.get(s).unwrap();
        let noise = common::stage_error(b, r).rel_l2;
        let diff = common::stage_error(a, b).rel_l2;
        if s == Stage::AttnOut {
            // The all-reduce sums 4 bf16 partials: a different rounding, of the size of the noise.
            assert!(
                diff > 0.0 && diff <= 2.0 * noise,
                "{s}: {diff} vs noise {noise}"
            );
        } else {
            // Per head, a rank computes what the whole layer does for that head.
            assert!(diff <= 0.5 * noise, "{s}: {diff} vs noise {noise}");
        }
    }
}

#[test]
fn tp_sizes_that_do_not_divide_the_heads_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let o = common::run(&["run", m.to_str().unwrap(), "--backend", "cpu", "--tp", "3"]);
    common::assert_clean_error(&o, "4 attention heads");
    let o = common::run(&[
        "run",
        m.to_str().unwrap(),
        "--backend",
        "cpu",
        "--tp",
        "2",
        "--inject",
        "rope_neox",
        "--inject-rank",
        "2",
    ]);
    common::assert_clean_error(&o, "--inject-rank 2");
}
