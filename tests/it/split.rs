//! The default schedule split over a run's layers (issue #39, `run --covering-layers`, docs/scale.md):
//! the kernel-aware covering schedule on the first layers, the classic one on the rest, in two passes.
//! Each layer's results are what an unsplit run of its own schedule gives it, byte for byte; the
//! coverage is the covering schedule's; the report says which layers ran which schedule.

use super::common;
use serde_json::{json, Value};
use std::path::Path;

/// `run FILE --backend cpu --json - ARGS`: the exit code and the report.
fn report(file: &Path, args: &[&str]) -> (i32, Value) {
    let (o, j) = common::cpu_run_json(file, args);
    (o.status.code().unwrap(), j)
}

/// The results of layer `l` in mode `m` (its checks and verdict, as JSON).
fn layer(r: &Value, m: usize, l: u64) -> Value {
    r["modes"][m]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["layer"] == l)
        .unwrap_or_else(|| panic!("no layer {l} in mode {m}"))
        .clone()
}

#[test]
fn split_layers_are_their_schedules_runs() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::make_fixture(
        dir.path(),
        "tiny3.gguf",
        &["--preset", "tiny", "--layers", "3", "--seed", "2"],
    );
    let base = dir.path().join("base.json");
    let b = base.to_str().unwrap();
    let (code, split) = report(&m, &["--write-baseline", b]);
    assert_eq!(code, 0, "{split}");
    // The covering layers' results and the coverage: an unsplit run of those layers (two layers are
    // not split) on the same default schedule.
    let (_, covering) = report(&m, &["--layers", "0,1"]);
    assert!(covering["run"].get("split").is_none());
    assert_eq!(split["run"]["schedule"], covering["run"]["schedule"]);
    assert_eq!(split["coverage"], covering["coverage"]);
    // The rest's: a run of every layer on the classic schedule (the streams recomputed over layers 0
    // and 1 at its tokens, reference and optimized).
    let (_, classic) = report(&m, &["--prompt-len", "48"]);
    let rest = &split["run"]["split"];
    assert_eq!(rest["rest"], classic["run"]["schedule"]);
    assert_eq!(rest["covering_layers"], json!([0, 1]));
    assert_eq!(rest["rest_layers"], json!([2]));
    assert_eq!(split["run"]["layers"], json!([0, 1, 2]));
    for mode in 0..2 {
        for l in 0..2 {
            assert_eq!(
                layer(&split, mode, l),
                layer(&covering, mode, l),
                "{mode} {l}"
            );
        }
        assert_eq!(
            layer(&split, mode, 2),
            layer(&classic, mode, 2),
            "mode {mode}"
        );
    }
    let v = common::report_validator();
    assert_eq!(common::schema_errors(&v, &split), Vec::<String>::new());
    // `all`: today's unsplit run; a baseline of the split run is another problem for it (refused
    // before the run), and its own for the split run.
    let o = common::run(&[
        "run",
        m.to_str().unwrap(),
        "--backend",
        "cpu",
        "--covering-layers",
        "all",
        "--baseline",
        b,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
    assert!(
        common::stderr(&o).contains("schedule"),
        "{}",
        common::stderr(&o)
    );
    let (code, gated) = report(&m, &["-q", "--baseline", b]);
    assert_eq!(code, 0, "{}", gated["baseline"]);
}
