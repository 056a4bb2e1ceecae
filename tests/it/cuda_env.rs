//! The CUDA commands on a machine without a GPU (CI): a clear one-line error and exit code 2, never a
//! panic. (On a GPU host these paths are exercised by `mla-diff gpu-validate` instead.)

use std::process::Command;

fn mla_diff(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mla-diff"))
        .args(args)
        .output()
        .expect("run mla-diff");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cuda_without_a_gpu_is_an_environment_error() {
    if mla_diff::backend::cuda::device::gpu_present() {
        eprintln!("a GPU is present: covered by gpu-validate");
        return;
    }
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/glm-5-q4_0.gguf");
    let v4 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/golden/deepseek-v4.gguf"
    );
    for args in [
        // DeepSeek-V4's CUDA path (backend::cuda::v4), clean and with a fault compiled into its kernels.
        vec!["run", v4, "--backend", "cuda"],
        vec![
            "run",
            v4,
            "--backend",
            "cuda",
            "--inject",
            "window_off_by_one@layer=0",
        ],
        vec!["run", fixture, "--backend", "cuda"],
        vec![
            "run",
            fixture,
            "--backend",
            "cuda",
            "--inject",
            "rope_neox@layer=0",
        ],
        vec![
            "selftest",
            "--backend",
            "cuda",
            "--fault",
            "split_drop_last",
        ],
        vec!["bench", "decode", "--backend", "cuda"],
        vec!["bench", "table", "--peers", ""],
        vec!["gpu-validate", "--quick"],
    ] {
        let (code, err) = mla_diff(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.trim().lines().count(),
            1,
            "{args:?}: one line expected: {err}"
        );
        assert!(err.contains("error:"), "{args:?}: {err}");
    }
}

#[test]
fn bench_table_usage_errors_come_before_the_gpu() {
    for (args, want) in [
        (vec!["bench", "table", "--only", "7"], "rows are 1..=6"),
        (vec!["bench", "table", "--only", "0"], "rows are 1..=6"),
        (vec!["bench", "table", "--dtypes", "f32"], "bf16 and fp16"),
        (vec!["bench", "table", "--backend", "cpu"], "--backend cuda"),
    ] {
        let (code, err) = mla_diff(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn bench_launches_must_be_at_least_one() {
    // A sample of no launches times nothing: refused before any GPU work, as a usage error.
    for cmd in ["decode", "prefill", "table"] {
        let (code, err) = mla_diff(&["bench", cmd, "--launches", "0"]);
        assert_eq!(code, 2, "bench {cmd}: {err}");
        assert!(err.contains("--launches"), "bench {cmd}: {err}");
    }
}

#[test]
fn edited_kernels_dir_must_hold_every_file() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = mla_diff(&[
        "kernels",
        "check",
        "--arch",
        "sm_90",
        "--kernels",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("common.cuh"), "{err}");
}
