//! kernels/v4/ (DeepSeek-V4's compressors, CSA indexer and attention) without a GPU: compiled for the
//! host with their CUDA built-ins emulated (tests/data/v4_kernels_host.cpp: warps of 32 threads whose
//! shuffles go through a barrier, a CTA's threads together), run over forward passes that split
//! compression windows, past the window edge and the indexer's top-k, and checked against a naive fp64
//! restatement of the CPU mirror's math (a planted fault compiled in with -D makes it fail: checked by
//! hand for window_off_by_one, compressor_state_dropped and sink_dropped). Needs a C++20
//! compiler (`CXX`, else `c++`); skipped without one unless `CI` is set.

use std::path::Path;
use std::process::Command;

fn compiler() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let ok = Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok && std::env::var_os("CI").is_some() {
        panic!("{cxx}: no C++ compiler (CI is set)");
    }
    ok.then_some(cxx)
}

/// The kernels as the harness includes them: no includes, the dynamic shared arrays as pointers into
/// the harness's one shared block.
fn write_incs(dir: &Path) {
    let k = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/v4");
    for (file, inc) in [
        ("v4.cuh", "v4.inc"),
        ("attn.cu", "attn.inc"),
        ("compress.cu", "compress.inc"),
        ("indexer.cu", "indexer.inc"),
    ] {
        let mut s = std::fs::read_to_string(k.join(file)).unwrap();
        for (from, to) in [
            ("#include \"common.cuh\"", ""),
            ("#include \"v4/v4.cuh\"", ""),
            (
                "extern __shared__ float row[];",
                "float* row = (float*)g_smem;",
            ),
            (
                "extern __shared__ float sm[];",
                "float* sm = (float*)g_smem;",
            ),
            (
                "extern __shared__ unsigned long long rk[];",
                "unsigned long long* rk = (unsigned long long*)g_smem;",
            ),
        ] {
            s = s.replace(from, to);
        }
        assert!(
            !s.contains("extern __shared__"),
            "{file}: a dynamic shared array the harness lacks"
        );
        std::fs::write(dir.join(inc), s).unwrap();
    }
}

#[test]
fn v4_kernels_compute_the_mirrors_math_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("SKIPPED: no C++ compiler");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_incs(dir.path());
    let host = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/v4_kernels_host.cpp");
    let out = dir.path().join("v4_kernels");
    let o = Command::new(&cxx)
        .args([
            "-O0",
            "-std=c++20",
            "-ffp-contract=off",
            "-DV4_D=80",
            "-pthread",
        ])
        .arg(format!("-I{}", dir.path().display()))
        .arg(&host)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(&out).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    for what in [
        "compress ok",
        "indexer ok",
        "attn kind 0 ok",
        "attn kind 1 ok",
        "attn kind 2 ok",
    ] {
        assert!(text.contains(what), "{what}: {text}");
    }
}
