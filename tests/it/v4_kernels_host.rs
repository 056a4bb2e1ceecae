//! kernels/v4/ (DeepSeek-V4's compressors, CSA indexer and attention) without a GPU: compiled for the
//! host with their CUDA built-ins emulated (tests/data/kernels_host.h: warps of 32 threads whose
//! shuffles go through a barrier, a CTA's threads together), run over forward passes that split
//! compression windows, past the window edge and the indexer's top-k, and checked against a naive fp64
//! restatement of the CPU mirror's math (tests/data/v4_kernels_host.cpp). Each V4 kernel fault compiled
//! in with -D must make that check fail at the stage it breaks (`FAULTS`). Needs a C++20 compiler
//! (`CXX`, else `c++`); skipped without one unless `CI` is set.

use crate::common::compiler;
use std::path::Path;
use std::process::Command;

/// `kernels/{src}` as a harness includes it, written to `dir/{inc}`: no includes, no C linkage (a harness
/// may hold several copies, one per planted fault), the dynamic shared arrays as pointers into the
/// harness's one shared block (tests/data/kernels_host.h).
pub fn host_inc(dir: &Path, src: &str, inc: &str) {
    let mut s = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(src)).unwrap();
    for (from, to) in [
        ("#include \"common.cuh\"", ""),
        ("#include \"v4/v4.cuh\"", ""),
        ("extern \"C\" ", ""),
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
        (
            "extern __shared__ unsigned long long keys[];",
            "unsigned long long* keys = (unsigned long long*)g_smem;",
        ),
    ] {
        s = s.replace(from, to);
    }
    assert!(
        !s.contains("extern __shared__"),
        "{src}: a dynamic shared array the harness lacks"
    );
    std::fs::write(dir.join(inc), s).unwrap();
}

/// The V4 harness compiled with `defines` (in a child process, so that variants compile together).
fn build(cxx: &str, dir: &Path, name: &str, defines: &[&str]) -> std::process::Child {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    Command::new(cxx)
        .args([
            "-O0",
            "-std=c++20",
            "-ffp-contract=off",
            "-DV4_D=80",
            "-pthread",
        ])
        .args(defines)
        .arg(format!("-I{}", dir.display()))
        .arg(format!("-I{}", data.display()))
        .arg(data.join("v4_kernels_host.cpp"))
        .arg("-o")
        .arg(dir.join(name))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Each V4 kernel fault and the check of the harness it must fail (its first MISMATCH line).
const FAULTS: [(&str, &str); 4] = [
    ("MLA_FAULT_WINDOW_OFF_BY_ONE", "MISMATCH attn"),
    ("MLA_FAULT_COMPRESS_GROUP_OFF_BY_ONE", "MISMATCH compress"),
    ("MLA_FAULT_COMPRESSOR_STATE_DROPPED", "MISMATCH compress"),
    ("MLA_FAULT_SINK_DROPPED", "MISMATCH attn"),
];

#[test]
fn v4_kernels_compute_the_mirrors_math_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("SKIPPED: no C++ compiler");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (file, inc) in [
        ("v4.cuh", "v4.inc"),
        ("attn.cu", "attn.inc"),
        ("compress.cu", "compress.inc"),
        ("indexer.cu", "indexer.inc"),
    ] {
        host_inc(dir.path(), &format!("kernels/v4/{file}"), inc);
    }
    let mut builds = vec![("clean".to_string(), build(&cxx, dir.path(), "clean", &[]))];
    for (define, _) in FAULTS {
        let d = format!("-D{define}=1");
        builds.push((define.to_string(), build(&cxx, dir.path(), define, &[&d])));
    }
    for (name, c) in builds {
        let o = c.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let o = Command::new(dir.path().join("clean")).output().unwrap();
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
    // Each fault compiled in fails the check of the stage it breaks.
    for (define, want) in FAULTS {
        let o = Command::new(dir.path().join(define)).output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            !o.status.success() && text.contains(want),
            "{define}=1: the harness should fail with {want}: {text}"
        );
        println!("{define}=1: {}", text.lines().last().unwrap_or(""));
    }
}
