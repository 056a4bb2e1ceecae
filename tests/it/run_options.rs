//! Run options through the binary (issue #11 items 5, 6, 7, 15): counts near 2^64, unbounded pages and
//! splits, layer ranges, quadratic memory, Fortran-order captures, free mode with per-layer captures,
//! and DSA models beyond the indexer's top_k.

use crate::common;

use common::{assert_clean_error, bin, fixture, run, stderr};
use mla_diff::gguf::write::GgufWriter;
use mla_diff::gguf::{GgufFile, TensorType, Value};
use std::path::{Path, PathBuf};

const MAX: &str = "18446744073709551615";

fn run_on(file: &str, extra: &[&str]) -> std::process::Output {
    let f = fixture(file);
    let mut args = vec!["run", f.to_str().unwrap(), "--backend", "cpu"];
    args.extend(extra);
    run(&args)
}

#[test]
fn counts_near_2_64_are_usage_errors() {
    let f = "deepseek-v2-lite-bf16.gguf";
    // decode_steps × q_len wraps to 0 in release builds without checked arithmetic.
    let o = run_on(
        f,
        &["--decode-steps", "9223372036854775808", "--q-len", "2"],
    );
    assert_clean_error(&o, "more than 1048576 tokens");
    let o = run_on(f, &["--prompt-len", MAX, "--decode-steps", "1"]);
    assert_clean_error(&o, "more than 1048576 tokens");
    let o = run_on(f, &["--page-size", "4611686018427387904"]);
    assert_clean_error(&o, "--page-size 4611686018427387904 is above the limit");
    let o = run_on(f, &["--num-splits", "1099511627776"]);
    assert_clean_error(&o, "--num-splits 1099511627776 is above the limit");
    let o = run_on(f, &["--pos-offset", MAX]);
    assert_clean_error(&o, "--pos-offset");
}

#[test]
fn kernel_sources_on_the_cpu_mirror_are_a_usage_error() {
    // The mirror compiles no kernels: `--kernels` there would be ignored and the edited kernels untested.
    let o = run_on("deepseek-v2-lite-bf16.gguf", &["--kernels", "kernels"]);
    assert_clean_error(&o, "--kernels kernels: the CPU mirror compiles no kernels");
    let o = run(&["selftest", "--kernels", "kernels", "--fault", "rope_neox"]);
    assert_clean_error(&o, "the CPU mirror compiles no kernels");
}

#[test]
fn layer_ranges_are_checked_before_expanding() {
    let f = "deepseek-v2-lite-bf16.gguf";
    for spec in [
        format!("0..{MAX}"),
        format!("0..={MAX}"),
        format!("1,0..={MAX}"),
    ] {
        let o = run_on(f, &["--layers", &spec]);
        assert_clean_error(&o, "does not exist: the model has 1 layers");
    }
    let p = fixture(f);
    let o = run(&[
        "run",
        p.to_str().unwrap(),
        "--backend",
        "cpu",
        "--dump-dir",
        "/nonexistent",
        "--dump-layers",
        &format!("0..{MAX}"),
    ]);
    assert_clean_error(&o, "does not exist");
}

#[test]
fn memory_is_estimated_before_allocating() {
    let f = "deepseek-v2-lite-bf16.gguf";
    // 100k decode tokens: the reference's T×T scores alone are 80 GB per head.
    let o = run_on(f, &["--decode-steps", "100000"]);
    assert_clean_error(&o, "GiB of memory (100048 tokens");
    // The limit comes from the environment when set: the default run needs a few MB.
    let with_limit = |limit: &str| {
        bin()
            .args(["run", fixture(f).to_str().unwrap(), "--backend", "cpu"])
            .env(mla_diff::schedule::MEMORY_ENV, limit)
            .output()
            .unwrap()
    };
    assert_clean_error(
        &with_limit("1000000"),
        "more than the 0.00 GiB available (MLA_DIFF_MAX_MEMORY)",
    );
    assert_clean_error(&with_limit("lots"), "is not a byte count");
    let o = with_limit("200000000");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn peak_estimate_grows_quadratically_and_covers_the_pool() {
    use mla_diff::model::synthetic::Family;
    use mla_diff::schedule::Schedule;
    let cfg = Family::DeepseekV3.test_config();
    let s = |decode_steps, page_size| Schedule {
        decode_steps,
        page_size,
        ..Schedule::default()
    };
    let f = |n| s(n, 16).peak_bytes(&cfg);
    // Superlinear in the token count (a linear estimate has equal differences), and at least the
    // reference's T×T f64 scores.
    let (a, b, c) = (f(1024), f(2048), f(3072));
    assert!(c - b > b - a, "{a} {b} {c}");
    let t = s(3072, 16).total_tokens() as u128;
    assert!(c >= 8 * t * t, "{c}");
    // One page of 2^20 rows of f32 cache rows is counted even for a short run.
    let big = s(16, 1 << 20).peak_bytes(&cfg);
    assert!(big >= (4u128 << 20) * cfg.cache_row() as u128 * 4, "{big}");
}

/// A `.npy` with `x` (`[rows, cols]` row-major values) written in Fortran order, f32 little-endian.
fn fortran_npy(path: &Path, x: &ndarray::Array2<f64>) {
    let (r, c) = x.dim();
    let mut h = format!("{{'descr': '<f4', 'fortran_order': True, 'shape': ({r}, {c}), }}");
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend((h.len() as u16).to_le_bytes());
    b.extend(h.as_bytes());
    for v in x.t().iter() {
        b.extend((*v as f32).to_le_bytes());
    }
    std::fs::write(path, b).unwrap();
}

fn report(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(o)))
}

#[test]
fn fortran_order_captures_run_like_c_order() {
    let d = tempfile::tempdir().unwrap();
    let x = mla_diff::input::random_hidden(256, 64, 3).mapv(|v| v as f32 as f64);
    let (c, f) = (d.path().join("c.npy"), d.path().join("f.npy"));
    ndarray_npy::write_npy(&c, &x.mapv(|v| v as f32)).unwrap();
    fortran_npy(&f, &x);
    let go = |p: &PathBuf| {
        run_on(
            "deepseek-v2-lite-bf16.gguf",
            &[
                "--prompt-len",
                "48",
                "--hidden",
                p.to_str().unwrap(),
                "--json",
                "-",
            ],
        )
    };
    let (oc, of) = (go(&c), go(&f));
    assert_eq!(of.status.code(), Some(0), "{}", stderr(&of));
    let (mut rc, mut rf) = (report(&oc), report(&of));
    rc["run"]["input"] = serde_json::Value::Null;
    rf["run"]["input"] = serde_json::Value::Null;
    assert_eq!(rc, rf);
}

#[test]
fn free_mode_refuses_per_layer_captures() {
    let d = tempfile::tempdir().unwrap();
    let f = "deepseek-v3-yarn-q4_k.gguf"; // 2 layers, hidden 512
    let t = 64;
    let x = ndarray::Array3::from_shape_fn((2, t, 512), |(l, i, j)| {
        ((l * 7 + i * 13 + j * 31) % 97) as f32 / 20.0 - 2.4
    });
    let p = d.path().join("per_layer.npy");
    ndarray_npy::write_npy(&p, &x).unwrap();
    let junit = d.path().join("j.xml");
    let o = run_on(
        f,
        &[
            "--prompt-len",
            "48",
            "--hidden",
            p.to_str().unwrap(),
            "--json",
            "-",
            "--junit",
            junit.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("shadow mode only"), "{}", stderr(&o));
    let r = report(&o);
    assert_eq!(r["run"]["modes"], serde_json::json!(["shadow"]));
    // Exit code and JUnit agree: no failing test case on a passing run.
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(!xml.contains("<failure"), "{xml}");
    for mode in ["free", "both"] {
        let o = run_on(
            f,
            &[
                "--prompt-len",
                "48",
                "--hidden",
                p.to_str().unwrap(),
                "--mode",
                mode,
            ],
        );
        assert_clean_error(&o, "free-running mode cannot use per-layer captures");
    }
    // A shared [T, hidden] capture keeps the default (both modes).
    let shared = d.path().join("shared.npy");
    ndarray_npy::write_npy(&shared, &x.index_axis(ndarray::Axis(0), 0).to_owned()).unwrap();
    let o = run_on(
        f,
        &[
            "--prompt-len",
            "48",
            "--hidden",
            shared.to_str().unwrap(),
            "--json",
            "-",
        ],
    );
    assert_eq!(
        report(&o)["run"]["modes"],
        serde_json::json!(["shadow", "free"])
    );
}

/// The GLM-5 fixture with its indexer top_k set to `top_k` (None: the key removed) and without its
/// indexer tensors (a file with them runs the sparse model past top_k: tests/it/dsa_run.rs).
fn glm5_with_top_k(dir: &Path, top_k: Option<u32>) -> PathBuf {
    let src = GgufFile::open(fixture("glm-5-q4_0.gguf")).unwrap();
    let key = "glm-dsa.attention.indexer.top_k";
    let mut w = GgufWriter::new();
    for (k, v) in &src.metadata {
        match (k.as_str() == key, top_k) {
            (true, Some(n)) => w.add(k.clone(), Value::U32(n)).unwrap(),
            (true, None) => {}
            (false, _) => w.add(k.clone(), v.clone()).unwrap(),
        }
    }
    let kept: Vec<_> = src
        .tensors
        .iter()
        .filter(|t| !t.name.contains(".indexer."))
        .collect();
    for t in &kept {
        let id = match t.ty {
            TensorType::Known(g) => g.id,
            TensorType::Unknown(id) => id,
        };
        let n = src.tensor_bytes(t).unwrap().len() as u64;
        w.add_tensor_raw(&t.name, &t.ne, id, n).unwrap();
    }
    let p = dir.join(format!("glm5-{top_k:?}.gguf"));
    let mut sink = w.start(std::fs::File::create(&p).unwrap()).unwrap();
    for t in &kept {
        sink.write(src.tensor_bytes(t).unwrap()).unwrap();
    }
    sink.finish().unwrap();
    p
}

#[test]
fn dsa_beyond_top_k_is_refused_or_noticed() {
    // The converter writes the key, and so does the fixture.
    let f = GgufFile::open(fixture("glm-5-q4_0.gguf")).unwrap();
    let k = f
        .get("glm-dsa.attention.indexer.top_k")
        .and_then(|v| v.as_u64());
    assert_eq!(k, Some(2048));
    let d = tempfile::tempdir().unwrap();
    let p = glm5_with_top_k(d.path(), Some(2048));
    let o = run(&[
        "run",
        p.to_str().unwrap(),
        "--backend",
        "cpu",
        "--prompt-len",
        "2100",
        "--decode-steps",
        "0",
    ]);
    assert_clean_error(&o, "--allow-dense-beyond-topk");

    let p = glm5_with_top_k(d.path(), Some(40));
    let args = |extra: &[&str]| {
        let mut a = vec![
            "run",
            p.to_str().unwrap(),
            "--backend",
            "cpu",
            "--prompt-len",
            "24",
        ];
        a.extend(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    // 24 + 16 decode tokens = 40 keys: within top_k, no notice.
    let o = bin().args(args(&["--json", "-"])).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(report(&o)["run"].get("notices").is_none());
    // 41 keys: refused without the flag.
    let o = bin()
        .args(args(&["--decode-steps", "17"]))
        .output()
        .unwrap();
    assert_clean_error(
        &o,
        "queries see up to 41 keys but the model's lightning indexer keeps 40",
    );
    // With it: every format says so.
    let (j, m, x) = (
        d.path().join("r.json"),
        d.path().join("r.md"),
        d.path().join("r.xml"),
    );
    let o = bin()
        .args(args(&[
            "--decode-steps",
            "17",
            "--allow-dense-beyond-topk",
            "--json",
            j.to_str().unwrap(),
            "--markdown",
            m.to_str().unwrap(),
            "--junit",
            x.to_str().unwrap(),
        ]))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("NOTICE: dense attention beyond the DSA top-k"),
        "{table}"
    );
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    let n = r["run"]["notices"][0].as_str().unwrap();
    assert!(n.contains("41 keys") && n.contains("keeps 40"), "{n}");
    let errs = common::schema_errors(&common::report_validator(), &r);
    assert!(errs.is_empty(), "{errs:?}");
    let md = std::fs::read_to_string(&m).unwrap();
    assert!(
        md.contains("**Notice:** dense attention beyond the DSA top-k"),
        "{md}"
    );
    let xml = std::fs::read_to_string(&x).unwrap();
    assert!(
        xml.contains(
            r#"<property name="mla-diff.notice" value="dense attention beyond the DSA top-k"#
        ),
        "{xml}"
    );

    // A DSA file without the key: top_k unknown, refused the same way.
    let p = glm5_with_top_k(d.path(), None);
    let o = run(&["run", p.to_str().unwrap(), "--backend", "cpu"]);
    assert_clean_error(&o, "indexer top_k is unknown");
}

/// `mla-diff run` is a library operation: a `Request` built in Rust (no clap) runs as the command line
/// does, its defaults `run FILE`'s, its reports byte for byte the same.
#[test]
fn a_request_built_in_rust_runs_like_the_command_line() {
    use mla_diff::run::command::{exec, Request};
    let d = tempfile::tempdir().unwrap();
    let (lib, cli) = (d.path().join("lib.json"), d.path().join("cli.json"));
    let f = fixture("minicpm3-f32.gguf");
    let mut req = Request::new(f.clone());
    req.backend.choice = mla_diff::backend::Choice::Cpu;
    req.schedule.prompt_len = Some(20);
    req.schedule.decode_steps = Some(3);
    req.report.formats.json = Some(lib.clone());
    req.report.formats.quiet = true;
    assert_eq!(exec(req.clone()).unwrap(), 0);
    let o = bin()
        .args([
            "run",
            f.to_str().unwrap(),
            "--backend",
            "cpu",
            "--prompt-len",
            "20",
        ])
        .args(["--decode-steps", "3", "-q", "--json", cli.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(std::fs::read(&lib).unwrap(), std::fs::read(&cli).unwrap());
    // A refusal is the command line's too: an error, not a panic or an exit.
    req.layers = "5".into();
    let e = exec(req).unwrap_err();
    assert!(e.to_string().contains("layer 5 does not exist"), "{e}");
}
