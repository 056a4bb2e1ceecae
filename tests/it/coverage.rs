//! Coverage (issue #14): the default schedule crosses every boundary class of every kernel a shipped
//! fixture may run on (the CPU mirror's, and the CUDA kernels the host predicts for Hopper and Ampere,
//! computed without a GPU); a schedule that misses a class says so in every report format; the two
//! coverage-probe faults are caught by a plain default run and were not by the pre-#14 default.

use crate::common;

use common::{fixture, report_validator, run, schema_errors, stderr};
use mla_diff::coverage::compute;
use mla_diff::coverage::covering::{covering, cuda_kernels, targets};
use mla_diff::gguf::GgufFile;
use mla_diff::kernel_use::{Family, KernelUse, Phase};
use mla_diff::model::MlaConfig;
use mla_diff::precision::Dtype;
use mla_diff::schedule::Schedule;
use mla_diff::tiles::choice::{AMPERE, HOPPER};

const FIXTURES: [&str; 5] = [
    "deepseek-v3-yarn-q4_k.gguf",
    "glm-5-q4_0.gguf",
    "deepseek-v3-legacy-kv-b-q8_0.gguf",
    "deepseek-v2-lite-bf16.gguf",
    "minicpm3-f32.gguf",
];

fn config(name: &str) -> MlaConfig {
    MlaConfig::from_gguf(&GgufFile::open(fixture(name)).unwrap()).unwrap()
}

/// The pre-#14 default `run` schedule (48 prompt tokens in chunks of 32, 16 decode steps, 4 splits).
fn pre14() -> Schedule {
    Schedule::default()
}

/// The CUDA kernels of `cfg` on a device for schedule `s` (decode rows: q_len x heads).
fn cuda(cfg: &MlaConfig, dtype: Dtype, hopper: bool, s: &Schedule) -> Vec<KernelUse> {
    let caps = if hopper { HOPPER } else { AMPERE };
    cuda_kernels(cfg, dtype, &caps, s.q_len * cfg.n_head)
}

#[test]
fn default_schedule_crosses_every_class_of_every_kernel() {
    for f in FIXTURES {
        let cfg = config(f);
        let s = covering(&cfg);
        s.validate().unwrap();
        // Every target kernel, as the schedule's own rows select it.
        let mut sets = vec![("cpu mirror", mla_diff::backend::cpu::mirror_kernels())];
        for (name, dt, hopper) in [
            ("hopper bf16", Dtype::Bf16, true),
            ("hopper fp16", Dtype::F16, true),
            ("hopper f32", Dtype::F32, true),
            ("ampere bf16", Dtype::Bf16, false),
        ] {
            sets.push((name, cuda(&cfg, dt, hopper, &s)));
        }
        for (name, k) in &sets {
            let c = compute(k, &cfg, &s, &[]);
            assert!(c.warnings.is_empty(), "{f} {name}: {:?}", c.warnings);
            assert!(
                c.classes.iter().all(|x| x.count.is_some_and(|n| n > 0)),
                "{f} {name}: {:?}",
                c.classes
            );
            // Every class the kernel has was counted, both phases.
            for phase in [Phase::Prefill, Phase::Decode] {
                let g = k.iter().find(|u| u.phase == phase).unwrap().geometry;
                let want = mla_diff::coverage::Class::of(phase, g.as_ref()).len();
                let got = c.classes.iter().filter(|x| x.phase == phase).count();
                assert_eq!(got, want, "{f} {name} {phase:?}");
            }
        }
        // On Hopper the default decode runs the warpgroup kernel for every fixture (8 heads, 4 heads, 64
        // heads alike: q_len x heads > 64), and so does prefill; on an A100 mma tiles whose shared
        // memory fits.
        let h = cuda(&cfg, Dtype::Bf16, true, &s);
        assert_eq!(h[1].family, Family::Wgmma, "{f}");
        assert_eq!(h[0].family, Family::Wgmma, "{f}");
        let a = cuda(&cfg, Dtype::Bf16, false, &s);
        assert_eq!(a[0].family, Family::Mma, "{f}");
        assert_eq!(a[1].family, Family::Mma, "{f}");
        assert!(a[1].geometry.unwrap().key_slices >= 2, "{f}");
        // The targets the schedule was computed for are these kernels (plus the 64-row ones).
        assert!(targets(&cfg).len() >= 6);
    }
}

#[test]
fn pre14_default_missed_the_tile_classes_and_the_hopper_kernel() {
    let cfg = config("deepseek-v3-yarn-q4_k.gguf");
    let s = pre14();
    // The CPU mirror: no split holds a second tile, none a tail after a full one, no split is empty.
    let c = compute(&mla_diff::backend::cpu::mirror_kernels(), &cfg, &s, &[]);
    let missed = |c: &mla_diff::coverage::Coverage, phase: Phase| -> Vec<String> {
        c.classes
            .iter()
            .filter(|x| x.phase == phase && x.count == Some(0))
            .map(|x| x.class.clone())
            .collect()
    };
    assert_eq!(
        missed(&c, Phase::Decode),
        ["two_full_tiles", "tail_tile", "empty_split"]
    );
    // Hopper: 8 heads x 1 query = 8 rows, so the 16-row mma tile runs instead of the warpgroup kernel,
    // which the coverage section names as the production kernel that did not run.
    let d = mla_diff::coverage::covering::cuda_dims(&cfg, Dtype::Bf16);
    let (_, dec) = mla_diff::tiles::choice::layer_tiles(&d, 8, &HOPPER, false);
    let prod = mla_diff::tiles::choice::production(&d, Phase::Decode, dec, 8, &HOPPER, false);
    let k = vec![
        cuda(&cfg, Dtype::Bf16, true, &s)[0].clone(),
        mla_diff::tiles::choice::kernel_use(Phase::Decode, dec, prod),
    ];
    let c = compute(&k, &cfg, &s, &[]);
    assert_eq!(k[1].family, Family::Mma);
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("production decode kernel") && w.contains("wgmma")),
        "{:?}",
        c.warnings
    );
    // The 16-row tile's 32-key tiles in 4 key groups of 8: splits of at most 16 keys reach neither a
    // second tile, nor the last key group, nor the second pipeline stage; 8 rows fit one 16-row tile.
    assert_eq!(
        missed(&c, Phase::Decode),
        [
            "two_full_tiles",
            "tail_tile",
            "key_slices",
            "pipeline_wrap",
            "row_tiles",
            "empty_split"
        ]
    );
    // The same fixture with 4 queries per step (MTP): 32 rows, still not the Hopper kernel.
    let (_, mtp4) = mla_diff::tiles::choice::layer_tiles(&d, 32, &HOPPER, false);
    assert!(!mtp4.unwrap().wgmma);
}

#[test]
fn an_external_kernel_has_unknown_tile_classes() {
    let cfg = config("deepseek-v2-lite-bf16.gguf");
    let s = covering(&cfg);
    let k: Vec<KernelUse> = [Phase::Prefill, Phase::Decode]
        .into_iter()
        .map(|phase| KernelUse {
            phase,
            family: Family::External,
            label: "runner x".into(),
            geometry: None,
            production: None,
        })
        .collect();
    let c = compute(&k, &cfg, &s, &[]);
    let unknown: Vec<&str> = c
        .classes
        .iter()
        .filter(|x| x.count.is_none())
        .map(|x| x.class.as_str())
        .collect();
    assert!(unknown.contains(&"two_full_tiles") && unknown.contains(&"page_in_tile"));
    // The schedule's own classes are still counted.
    for cl in [
        "empty_split",
        "split_merge",
        "chunk_boundary",
        "context_merge",
    ] {
        assert!(
            c.classes
                .iter()
                .any(|x| x.class == cl && x.count.is_some_and(|n| n > 0)),
            "{cl}"
        );
    }
    assert_eq!(
        c.warnings
            .iter()
            .filter(|w| w.contains("unknown tile geometry"))
            .count(),
        2
    );
}

/// `run` with `args` on the DeepSeek-V3 fixture, writing every report format; returns them.
fn reports(
    dir: &std::path::Path,
    args: &[&str],
) -> (i32, String, serde_json::Value, String, String) {
    let fx = fixture("deepseek-v3-yarn-q4_k.gguf");
    let (json, junit, md) = (dir.join("r.json"), dir.join("r.xml"), dir.join("r.md"));
    let mut a = vec![
        "run",
        fx.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--color",
        "never",
        "--json",
        json.to_str().unwrap(),
        "--junit",
        junit.to_str().unwrap(),
        "--markdown",
        md.to_str().unwrap(),
    ];
    a.extend_from_slice(args);
    let o = run(&a);
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(
        schema_errors(&report_validator(), &j).is_empty(),
        "{:?}",
        schema_errors(&report_validator(), &j)
    );
    (
        o.status.code().unwrap_or(-1),
        table,
        j,
        std::fs::read_to_string(&junit).unwrap(),
        std::fs::read_to_string(&md).unwrap(),
    )
}

#[test]
fn a_schedule_that_misses_a_class_warns_in_every_format() {
    let dir = tempfile::tempdir().unwrap();
    // The pre-#14 default, given explicitly: it passes, but says what it did not exercise.
    let (code, table, j, junit, md) = reports(
        dir.path(),
        &[
            "--prompt-len",
            "48",
            "--chunk",
            "32",
            "--decode-steps",
            "16",
            "--num-splits",
            "4",
        ],
    );
    assert_eq!(code, 0);
    let cov = &j["coverage"];
    let warnings: Vec<&str> = cov["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    let missed = "not exercised: a key range of 2 or more full tiles";
    assert!(warnings.iter().any(|w| w.contains(missed)), "{warnings:?}");
    assert_eq!(cov["kernels"][1]["family"], "mirror");
    assert!(table.contains("coverage: prefill mirror"), "{table}");
    // Prefill's chunks of 32 keys miss it; decode's steps do too, but the serving batch our decode
    // also runs (`backend::cpu::serving`: 2,113 keys) reaches it.
    assert!(table.contains("WARNING: coverage: prefill"), "{table}");
    assert!(!table.contains("WARNING: coverage: decode"), "{table}");
    assert!(table.contains(missed), "{table}");
    assert!(junit.contains("mla-diff.coverage.warning"), "{junit}");
    assert!(junit.contains("name=\"mla-diff.coverage.prefill.two_full_tiles\" value=\"0\""));
    assert!(junit.contains(missed));
    assert!(
        md.contains("#### Coverage") && md.contains("**Coverage:**"),
        "{md}"
    );
    assert!(md.contains(missed));
    // JSON, JUnit and Markdown carry the same warnings.
    for w in &warnings {
        let escaped = w
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        assert!(junit.contains(&escaped), "junit lacks {w}");
        assert!(
            md.contains(w.trim_start_matches("coverage: ")),
            "markdown lacks {w}"
        );
    }
}

#[test]
fn the_default_run_exercises_everything_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (code, table, j, junit, md) = reports(dir.path(), &[]);
    assert_eq!(code, 0, "{table}");
    let cov = &j["coverage"];
    // Every class of the kernels that ran is crossed, every production variant reached: no warning.
    let warnings: Vec<&str> = cov["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    let classes = cov["classes"].as_array().unwrap();
    assert!(classes.iter().all(|c| c["count"].as_u64().unwrap() > 0));
    assert!(!table.contains("WARNING: coverage:"), "{table}");
    // The variants: listed with whether each was reached, every one reached (8 heads: attn_small needs a
    // page of 32-key multiples, the default's is 16: a batch aimed at it runs at page 64, issue #35).
    let v = &cov["variants"];
    assert_eq!(v["device"], "sm_90a (H200) assumed");
    let list = v["list"].as_array().unwrap();
    assert!(list.iter().all(|x| x["reached"] == true), "{v}");
    let aimed: Vec<&str> = list
        .iter()
        .filter(|x| x["aimed"] == true)
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(aimed, ["decode/attn_small/tma-ring-multi-tile-page"]);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(
        table.contains("decode/attn_small/tma-ring-multi-tile-page yes (aimed batch)"),
        "{table}"
    );
    assert!(md.contains("yes (aimed batch)"), "{md}");
    assert!(j["runner_checks"]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["check"] == "variant_batch"));
    assert!(junit.contains("mla-diff.coverage.kernel.decode"));
    assert!(md.contains("#### Coverage"));
    // The schedule is the kernel-aware one.
    let cfg = config("deepseek-v3-yarn-q4_k.gguf");
    let s: Schedule = serde_json::from_value(j["run"]["schedule"].clone()).unwrap();
    assert_eq!(s, covering(&cfg));
    // A run without decode reaches no decode variant: one warning each, in every format.
    let (code, table, j, junit, md) = reports(dir.path(), &["--decode-steps", "0"]);
    assert_eq!(code, 0, "{table}");
    let cov = &j["coverage"];
    let missed: Vec<&str> = cov["variants"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| !x["reached"].as_bool().unwrap())
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        missed,
        [
            "decode/attn_mma/ld.global",
            "decode/attn_small/tma-ring-multi-tile-page"
        ]
    );
    let warnings: Vec<&str> = cov["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    for id in &missed {
        assert!(warnings.iter().any(|w| w.contains(id)), "{warnings:?}");
        assert!(table.contains(&format!("{id} NO")), "{table}");
        assert!(md.contains(&format!("{id} NO")), "{md}");
        assert!(junit.contains(id), "{junit}");
    }
}

/// Exit code and first failing check of `run FIXTURE --inject FAULT` (shadow mode) with `extra` options.
fn inject(f: &str, fault: &str, extra: &[&str]) -> (i32, Option<String>) {
    let fx = fixture(f);
    let mut a = vec![
        "run",
        fx.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "-q",
        "--json",
        "-",
        "--inject",
        fault,
    ];
    a.extend_from_slice(extra);
    let o = run(&a);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{f} {fault}: {e}: {}", stderr(&o)));
    (
        o.status.code().unwrap_or(-1),
        j["verdict"]["first_check"].as_str().map(String::from),
    )
}

#[test]
fn coverage_probe_faults_fail_the_default_run_at_split_out_and_older_schedules_in_batches() {
    let pre14_flags = [
        "--prompt-len",
        "48",
        "--chunk",
        "32",
        "--decode-steps",
        "16",
        "--num-splits",
        "4",
    ];
    for f in FIXTURES {
        for fault in ["wg2_keys_dropped", "split_tail_dropped"] {
            let (code, first) = inject(f, fault, &[]);
            assert_eq!(
                (code, first.as_deref()),
                (1, Some("split_out")),
                "{f} {fault}: default run"
            );
            // The pre-#14 default: every split within one tile's first half, so no stage check sees the
            // fault. The run's batches do (exit 1 with every stage passing): they run the layer's
            // kernels with its faults, as the CUDA batches do, over requests of 256 keys in one split
            // (batches aimed at the variants the schedule misses) and a page + 1 (a partial tile after
            // a full one).
            let (code, first) = inject(f, fault, &pre14_flags);
            assert_eq!(first, None, "{f} {fault}: pre-#14 default");
            assert_eq!(code, 1, "{f} {fault}: pre-#14 default, the batches");
        }
    }
}

#[test]
fn a_dsa_run_within_top_k_aims_a_batch_at_the_sparse_kernel() {
    // The DSA golden (top_k 8) on 8 tokens: the run stays dense, and a batch aimed at the sparse kernel
    // (a fixed selection of half of each decode query's keys, through the shuffled block table) reaches
    // `decode/sparse_attn/past-top-k`; a sparse reader that skips the block table fails there.
    let fx = fixture("golden/glm-5-dsa.gguf");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "run",
            fx.to_str().unwrap(),
            "--backend",
            "cpu",
            "--mode",
            "shadow",
            "-q",
            "--json",
            "-",
            "--prompt-len",
            "4",
            "--chunk",
            "4",
            "--decode-steps",
            "4",
            "--page-size",
            "2",
        ];
        a.extend_from_slice(extra);
        let o = run(&a);
        let j: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
        (o.status.code(), j)
    };
    let (code, j) = args(&[]);
    assert_eq!(code, Some(0), "{}", j["verdict"]);
    let sparse = j["coverage"]["variants"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["id"] == "decode/sparse_attn/past-top-k")
        .cloned()
        .unwrap();
    assert_eq!(
        (&sparse["reached"], &sparse["aimed"]),
        (&true.into(), &true.into())
    );
    let aimed = |j: &serde_json::Value| -> Vec<serde_json::Value> {
        j["runner_checks"]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| {
                c["detail"]
                    .as_str()
                    .unwrap()
                    .contains("aimed at decode/sparse_attn/past-top-k")
            })
            .cloned()
            .collect()
    };
    let ok = aimed(&j);
    let layers = j["run"]["layers"].as_array().unwrap().len();
    assert_eq!(ok.len(), 2 * layers, "attn_latent and lse of each layer");
    assert!(ok
        .iter()
        .all(|c| c["status"] == "pass" && c["check"] == "variant_batch"));
    let (code, bad) = args(&["--inject", "sparse_index_page_base"]);
    assert_eq!(code, Some(1), "{}", bad["verdict"]);
    assert!(
        aimed(&bad).iter().any(|c| c["status"] == "fail"),
        "{}",
        bad["runner_checks"]
    );
}

/// `run FIXTURE --inject FAULT` (shadow mode) with `extra`: the exit code, the verdict's first stage
/// check, the failing batch checks (`check what: detail`) and stderr.
fn inject_batches(
    f: &str,
    fault: &str,
    extra: &[&str],
) -> (i32, Option<String>, Vec<String>, String) {
    let fx = fixture(f);
    let mut a = vec![
        "run",
        fx.to_str().unwrap(),
        "--backend",
        "cpu",
        "--mode",
        "shadow",
        "--json",
        "-",
        "--inject",
        fault,
    ];
    a.extend_from_slice(extra);
    let o = run(&a);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{f} {fault}: {e}: {}", stderr(&o)));
    let failed = j["runner_checks"]["checks"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter(|c| c["status"] == "fail")
                .map(|c| format!("{} {}: {}", c["check"], c["what"], c["detail"]))
                .collect()
        })
        .unwrap_or_default();
    (
        o.status.code().unwrap_or(-1),
        j["verdict"]["first_check"].as_str().map(String::from),
        failed,
        stderr(&o),
    )
}

#[test]
fn kernel_variant_faults_fail_a_plain_run_where_their_kernel_runs() {
    // #35 item 4: the catalogue's kernel-variant faults (the bench/probes patches as `--inject`). A plain
    // run at page 16 reaches their kernels only through batches aimed at the variants it misses: each
    // fails there (every stage check passing) where the rules pick its kernel, and nowhere else.
    let glm = ["--layers", "0"];
    for (fault, aimed) in [
        ("pairs_handover_stale", "aimed at decode/attn_wgmma_pairs/"),
        ("tma_page_tile", "tma-multi-tile-page"),
        ("small_ring_wrap", "aimed at decode/attn_small/"),
    ] {
        let (code, first, failed, err) = inject_batches("glm-5-q4_0.gguf", fault, &glm);
        assert_eq!((code, first), (1, None), "glm-5 {fault}: {err}");
        assert!(!failed.is_empty(), "glm-5 {fault}");
        assert!(
            failed
                .iter()
                .all(|c| c.starts_with("\"variant_batch\"") && c.contains(aimed)),
            "glm-5 {fault}: {failed:#?}"
        );
    }
    // 8 heads: 8 or 16 decode rows, below the Hopper kernels' 64 — said, and nothing fails; attn_small
    // runs, and fails, but not in f32 (no attn_small there).
    let v3 = "deepseek-v3-yarn-q4_k.gguf";
    for fault in ["pairs_handover_stale", "tma_page_tile"] {
        let (code, _, failed, err) = inject_batches(v3, fault, &[]);
        assert_eq!((code, failed.len()), (0, 0), "{v3} {fault}");
        assert!(
            err.contains(&format!("injected fault {fault} (needs ")),
            "{err}"
        );
    }
    let (code, _, failed, _) = inject_batches(v3, "small_ring_wrap", &[]);
    assert!(
        code == 1
            && failed
                .iter()
                .all(|c| c.contains("aimed at decode/attn_small/"))
    );
    let (code, _, failed, _) = inject_batches(v3, "small_ring_wrap", &["--dtype", "f32"]);
    assert_eq!((code, failed.len()), (0, 0), "{v3} small_ring_wrap f32");
}
