//! `run --shard i/n` and `mla-diff merge`: shards run as separate processes and merged give, byte for
//! byte, the JSON, JUnit and Markdown one whole run writes — passing and with a planted bug, in both
//! modes; and merge refuses what is not one run's complete set of shards.

use super::common;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A 5-layer tiny model (fast, and enough layers for uneven shards).
pub fn five_layers(dir: &Path) -> PathBuf {
    common::make_fixture(dir, "five.gguf", &["--preset", "tiny", "--layers", "5"])
}

/// The run options the tests share: a small schedule with prefill chunks and decode splits.
pub const ARGS: [&str; 10] = [
    "--backend",
    "cpu",
    "--prompt-len",
    "20",
    "--chunk",
    "8",
    "--decode-steps",
    "3",
    "--num-splits",
    "2",
];

fn run(model: &Path, extra: &[&str]) -> Output {
    let mut a = vec!["run", model.to_str().unwrap(), "-q"];
    a.extend_from_slice(&ARGS);
    a.extend_from_slice(extra);
    common::run(&a)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// One whole run and `n` shard processes (run at once) with `extra` options, then merge: every format
/// byte-identical, the exit codes the same. The whole run's exit code.
fn whole_equals_merged(dir: &Path, model: &Path, n: usize, extra: &[&str]) -> i32 {
    let p = |s: &str| dir.join(s).to_str().unwrap().to_string();
    let (wj, wx, wm) = (p("whole.json"), p("whole.xml"), p("whole.md"));
    let mut a = extra.to_vec();
    a.extend_from_slice(&["--json", &wj, "--junit", &wx, "--markdown", &wm]);
    let whole = run(model, &a);
    let code = whole.status.code().unwrap();
    assert!(code <= 1, "{}", common::stderr(&whole));

    let children: Vec<_> = (0..n)
        .map(|i| {
            let mut c = common::bin();
            c.args(["run", model.to_str().unwrap(), "-q"])
                .args(ARGS)
                .args(extra)
                .args([
                    "--shard",
                    &format!("{i}/{n}"),
                    "--json",
                    &p(&format!("s{i}.json")),
                ]);
            c.stdout(std::process::Stdio::null()).spawn().unwrap()
        })
        .collect();
    // Each shard's exit code is its own layers' verdict: the run fails when one of them does.
    let codes: Vec<i32> = children
        .into_iter()
        .map(|mut c| c.wait().unwrap().code().unwrap())
        .collect();
    assert_eq!(codes.iter().copied().max(), Some(code), "shards {codes:?}");
    // In reverse order: merge sorts by shard index.
    let mut m = vec!["merge".to_string()];
    m.extend((0..n).rev().map(|i| p(&format!("s{i}.json"))));
    let (mj, mx, mm) = (p("merged.json"), p("merged.xml"), p("merged.md"));
    m.extend(["-o", &mj, "--junit", &mx, "--markdown", &mm].map(String::from));
    let merged = common::bin().args(&m).output().unwrap();
    assert_eq!(
        merged.status.code(),
        Some(code),
        "{}",
        common::stderr(&merged)
    );
    for (w, g) in [(&wj, &mj), (&wx, &mx), (&wm, &mm)] {
        assert!(
            read(Path::new(w)) == read(Path::new(g)),
            "{w} and {g} differ"
        );
    }
    let json: serde_json::Value = serde_json::from_str(&read(Path::new(&mj))).unwrap();
    assert!(common::schema_errors(&common::report_validator(), &json).is_empty());
    let shard0: serde_json::Value = serde_json::from_str(&read(Path::new(&p("s0.json")))).unwrap();
    assert!(common::schema_errors(&common::report_validator(), &shard0).is_empty());
    code
}

#[test]
fn shards_merged_are_the_whole_run_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    // Both modes: free mode's shards recompute both streams before their slice.
    assert_eq!(whole_equals_merged(dir.path(), &model, 3, &[]), 0);
    // A planted bug in layer 3 (the third shard of 3: layers 3..5): the merged verdict fails there.
    let code = whole_equals_merged(
        dir.path(),
        &model,
        3,
        &["--mode", "shadow", "--inject", "rope_neox@layer=3"],
    );
    assert_eq!(code, 1);
    let json: serde_json::Value =
        serde_json::from_str(&read(&dir.path().join("merged.json"))).unwrap();
    assert_eq!(json["verdict"]["first_layer"], 3);
    assert_eq!(json["run"]["layers"], serde_json::json!([0, 1, 2, 3, 4]));
    assert!(json["run"].get("shard").is_none());
}

#[test]
fn shards_with_repeat_a_layer_list_or_tp_merge_too() {
    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    let extra = ["--layers", "1,2,4", "--repeat", "2", "--mode", "free"];
    assert_eq!(whole_equals_merged(dir.path(), &model, 2, &extra), 0);
    // Tensor-parallel ranks in both modes: the shard's free-mode prefix runs through the ranks too.
    let extra = ["--layers", "0..3", "--tp", "2"];
    assert_eq!(whole_equals_merged(dir.path(), &model, 2, &extra), 0);
}

#[test]
fn merge_refuses_what_is_not_one_complete_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    let p = |s: &str| dir.path().join(s).to_str().unwrap().to_string();
    let shard = |i: usize, n: usize, name: &str, extra: &[&str]| {
        let mut a = vec!["--mode", "shadow", "--layers", "0..3"];
        let spec = format!("{i}/{n}");
        let out = p(name);
        a.extend_from_slice(extra);
        a.extend_from_slice(&["--shard", &spec, "--json", &out]);
        let o = run(&model, &a);
        assert_eq!(o.status.code(), Some(0), "{}", common::stderr(&o));
        out
    };
    let s0 = shard(0, 2, "s0.json", &[]);
    let s1 = shard(1, 2, "s1.json", &[]);
    let f32 = shard(1, 2, "f32.json", &["--dtype", "f32"]);
    let of3 = shard(1, 3, "of3.json", &[]);
    let whole = p("whole.json");
    let o = run(
        &model,
        &["--mode", "shadow", "--layers", "0..3", "--json", &whole],
    );
    assert_eq!(o.status.code(), Some(0));
    let merge = |args: &[&str]| {
        let mut a = vec!["merge"];
        a.extend_from_slice(args);
        let out = p("m.json");
        a.extend_from_slice(&["-o", &out]);
        common::run(&a)
    };
    common::assert_clean_error(&merge(&[&s0]), "missing shards: 1/2");
    common::assert_clean_error(&merge(&[&s0, &s1, &s1]), "overlapping shards");
    common::assert_clean_error(&merge(&[&s0, &f32]), "different problems");
    common::assert_clean_error(&merge(&[&s0, &f32]), "run.dtype");
    common::assert_clean_error(&merge(&[&s0, &of3]), "shards of different runs");
    common::assert_clean_error(&merge(&[&s0, &whole]), "not a shard's report");
    common::assert_clean_error(&merge(&[&s0, &p("nope.json")]), "nope.json");
    // The good pair still merges.
    assert_eq!(merge(&[&s1, &s0]).status.code(), Some(0));
    // Bad --shard values are usage errors before anything runs.
    common::assert_clean_error(&run(&model, &["--shard", "3/3"]), "--shard");
    common::assert_clean_error(&run(&model, &["--shard", "0/6"]), "only 5 layers");
}

/// `run --gpus`: the workers and the join as the CLI drives them (`gpus::fan_out` with this program and
/// the run's own arguments), here on the CPU mirror. What a GPU-less machine cannot try is the
/// `CUDA_VISIBLE_DEVICES` pinning (checked on the GPU: docs/scale.md). The joined report is the whole
/// run's byte for byte, a failing layer included; a worker's error is the run's.
#[test]
fn gpu_workers_join_into_the_whole_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    let wj = dir.path().join("whole.json");
    let extra = ["--mode", "both", "--inject", "rope_neox@layer=3"];
    let mut a = extra.to_vec();
    a.extend(["--json", wj.to_str().unwrap()]);
    assert_eq!(run(&model, &a).status.code(), Some(1));
    let mut args: Vec<std::ffi::OsString> = vec!["run".into(), model.clone().into(), "-q".into()];
    args.extend(ARGS.iter().chain(&extra).map(Into::into));
    let exe = Path::new(env!("CARGO_BIN_EXE_mla-diff"));
    let devices = ["0", "0", "0"].map(String::from);
    let joined = mla_diff::gpus::fan_out(exe, &args, &devices, 5, false).unwrap();
    assert!(joined.to_json() == read(&wj), "joined report differs");
    assert_eq!(joined.verdict.first_layer, Some(3));
    // More workers than layers: one per layer.
    let two = ["--layers".into(), "1,3".into()];
    let six = ["0"; 6].map(String::from);
    let r = mla_diff::gpus::fan_out(exe, &[args.clone(), two.to_vec()].concat(), &six, 2, false);
    assert_eq!(r.unwrap().run.layers, vec![1, 3]);
    // A worker's usage error ends the run with an error, not a partial report.
    let bad = [args, vec!["--chunk".into(), "0".into()]].concat();
    let e = mla_diff::gpus::fan_out(exe, &bad, &devices, 5, false).unwrap_err();
    assert!(e.to_string().contains("GPU worker"), "{e}");
}

#[test]
fn gpus_is_refused_where_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    let m = model.to_str().unwrap();
    let o = common::run(&["run", m, "--backend", "cpu", "--gpus", "2"]);
    common::assert_clean_error(&o, "needs --backend cuda");
    let o = common::run(&["run", m, "--gpus", "2", "--shard", "0/2"]);
    assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
    // No GPU here: an environment error; a GPU machine has fewer than 99 (a usage error). Exit 2 both.
    let o = common::run(&["run", m, "--gpus", "99"]);
    assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
    assert!(common::stderr(&o).contains("mla-diff: error:"));
}
