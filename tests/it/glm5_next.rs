//! glm5-next (GLM-5's NoPE successor, #37): the hybrid file's layout, NoPE MLA (rope dims 0), the k-pool
//! indexer keys; `inspect`, `lint` and `run` on a `fixture --preset glm5-next`.

use crate::common::*;

fn fixture(dir: &std::path::Path) -> std::path::PathBuf {
    // 8 layers of the default layout: MLA on 3 and 7, linear attention elsewhere.
    make_fixture(
        dir,
        "g5n.gguf",
        &[
            "--preset",
            "glm5-next",
            "--layers",
            "8",
            "--hidden",
            "256",
            "--heads",
            "2",
            "--quant",
            "f32",
        ],
    )
}

#[test]
fn inspect_reads_the_layout_nope_and_kpool_keys() {
    let dir = tempfile::tempdir().unwrap();
    let j = inspect_json(&fixture(dir.path()));
    assert_eq!(j["config"]["arch"], "glm5-next");
    assert_eq!(j["config"]["qk_rope"], 0);
    assert_eq!(j["config"]["qk_nope"], 256);
    assert_eq!(j["config"]["n_head_kv"], 1);
    assert_eq!(
        j["cache_row"], 512,
        "no rope part: the row is the latent, not 576"
    );
    assert_eq!(j["hybrid_layout"]["mla_layers"], serde_json::json!([3, 7]));
    assert_eq!(
        j["hybrid_layout"]["linear_layers"],
        serde_json::json!([0, 1, 2, 4, 5, 6])
    );
    assert_eq!(j["indexer_kpool"]["kpool"], 16);
    assert_eq!(j["indexer_kpool"]["select_tail"], true);
    let text =
        String::from_utf8(run(&["inspect", fixture(dir.path()).to_str().unwrap()]).stdout).unwrap();
    assert!(
        text.contains("layers 0-2,4-6 are linear attention"),
        "{text}"
    );
}

#[test]
fn lint_is_clean_and_names_the_skipped_layers() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(dir.path());
    let o = run(&["lint", f.to_str().unwrap(), "--json", "-"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let s = j.to_string();
    assert!(o.status.success(), "{s}");
    assert!(!s.contains("\"error\""), "{s}");
    assert!(s.contains("glm5-next.attention.head_count_kv"), "{s}");
    assert!(s.contains("glm5-next.attention.indexer.kpool"), "{s}");
    assert!(s.contains("not MLA: skipped"), "{s}");
}

#[test]
fn run_checks_the_mla_layers_and_skips_the_linear_ones() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(dir.path());
    let (o, j) = cpu_run_json(&f, &["--dtype", "f32"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(j["run"]["layers"], serde_json::json!([3, 7]));
    let notices = j["run"]["notices"].to_string();
    assert!(
        notices.contains("layers 0-2,4-6 are linear attention"),
        "{notices}"
    );
    // Only linear layers asked for: an error naming the MLA layers.
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--backend",
        "cpu",
        "--layers",
        "0,1,2",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("MLA layers 3,7"), "{}", stderr(&o));
}
