//! kernels/cache_write.cu's quantized-cache writer and reader (`cache_write_format`, issue #38) against
//! `kv_format::Codec`, without a GPU: the kernel source compiled for the host with its CUDA built-ins
//! shimmed (tests/data/cache_write_host.cpp), fed rows at every scale the formats meet (e4m3 normals
//! and subnormals, the 1e-4 scale floor, zeros, outliers, midpoints between e4m3 values), and each
//! planted cache fault compiled in as its `MLA_FAULT_*` define, over one launch of two requests' rows. Every byte and every value read back
//! must be the codec's, bit for bit. Needs a C++ compiler (`CXX`, else `c++`); skipped without one
//! unless `CI` is set.

use crate::common::{cache_rows, compiler};
use mla_diff::faults::{Active, Fault};
use mla_diff::kv_format::{Codec, KvFormat};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Compile the kernel for `(lkv, r)`, format `code`, with `fault`'s define; the binary's path.
fn build(cxx: &str, dir: &Path, lkv: usize, r: usize, code: u32, fault: Option<Fault>) -> PathBuf {
    let name = format!("cw-{code}-{}", fault.map_or("clean", |f| f.info().name));
    let out = dir.join(&name);
    let mut c = Command::new(cxx);
    c.args(["-O1", "-ffp-contract=off", "-std=c++17"])
        .arg(format!("-DMLA_LKV={lkv}"))
        .arg(format!("-DMLA_R={r}"))
        .arg("-DMLA_PAGE=16")
        .arg(format!("-DMLA_KV_FORMAT={code}"))
        .arg(format!("-I{}", dir.display()));
    if let Some(f) = fault {
        c.arg(format!("-D{}=1", f.info().define));
    }
    let host = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cache_write_host.cpp");
    let o = c
        .arg(host)
        .arg("-o")
        .arg(&out)
        .output()
        .expect("running the compiler");
    assert!(
        o.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// `row` at ±m·ts·(1 ± 2⁻²¹) for the midpoints m between consecutive e4m3 values up to 400 (the
/// subnormals' included; under 448, so nothing saturates): x / ts lands 2⁻²¹ (≈ 8 f32 ulp) to one side
/// of a rounding boundary, each midpoint from both sides and both signs over the row.
fn near_midpoints(row: &mut [f32], ts: f32) {
    let v: Vec<f32> = (0u8..0x7f)
        .map(mla_diff::kv_format::e4m3_value)
        .filter(|&y| y <= 400.0)
        .collect();
    let mids: Vec<f32> = v.windows(2).map(|p| (p[0] + p[1]) / 2.0).collect();
    for (i, c) in row.iter_mut().enumerate() {
        let side = match (i / mids.len()) % 2 {
            0 => 1.0 + 2f32.powi(-21),
            _ => 1.0 - 2f32.powi(-21),
        };
        let sign = if (i / (2 * mids.len())).is_multiple_of(2) {
            1.0
        } else {
            -1.0
        };
        *c = sign * mids[i % mids.len()] * ts * side;
    }
}

#[test]
fn cache_write_format_is_the_codec_bit_for_bit() {
    let Some(cxx) = compiler() else {
        eprintln!("skipped: no C++ compiler");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/cache_write.cu"),
    )
    .unwrap();
    let inc: String = src
        .lines()
        .filter(|l| !l.starts_with("#include \"common.cuh\""))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(dir.path().join("cw.inc"), inc).unwrap();
    use Fault::*;
    use KvFormat::*;
    let mut cases = Vec::new();
    for (f, lkv, r, code) in [
        (Fp8, 512, 64, 1),
        (Fp8, 256, 32, 1),
        (Fp8DsMla, 512, 64, 2),
        (Fp8DsMlaNope, 512, 0, 3),
        (Fp8V41, 448, 64, 4),
        (Fp4V41, 448, 64, 5),
    ] {
        cases.push((f, lkv, r, code, None));
        for fault in [
            KvScaleTwice,
            KvScaleInverted,
            KvRopeQuantized,
            KvScaleWrongGroup,
            KvSaturate240,
            KvScaleUnwritten,
        ] {
            if mla_diff::kv_format::fault_fits(fault, f) {
                cases.push((f, lkv, r, code, Some(fault)));
            }
        }
    }
    // One launch of n rows, the first `first` of them its first request's (`kv_scale_unwritten`: the
    // later rows keep their unwritten scale bytes).
    let (n, first) = (96, 48);
    for (f, lkv, r, code, fault) in cases {
        let bin = build(&cxx, dir.path(), lkv, r, code, fault);
        let w = lkv + r;
        let mut x = cache_rows(n, w, 0x9e37_79b9_7f4a_7c15);
        // `fp8`: the layer's scale, calibrated on all its rows as the host does; ignored by the others.
        let ts = match f {
            Fp8 => mla_diff::kv_format::tensor_scale(&x),
            _ => 1.0,
        };
        // `fp8`: the last row's latent columns just off the midpoints between e4m3 values at `ts`,
        // where a writer whose scale is off by more than a few f32 ulp (ts·1.0001) rounds the other
        // way; the random rows alone let such a writer through.
        if f == Fp8 {
            near_midpoints(&mut x[(n - 1) * w..(n - 1) * w + lkv], ts);
        }
        let input: String = x.iter().map(|v| format!("{:08x} ", v.to_bits())).collect();
        let mut child = Command::new(&bin)
            .arg(n.to_string())
            .arg(first.to_string())
            .arg(format!("{:08x}", ts.to_bits()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let what = format!("{f} {}", fault.map_or("clean", |f| f.info().name));
        assert_eq!(lines.len(), 2 * n, "{what}");
        let fx = fault.map_or(Active::NONE, |ff| Active::NONE.with(ff));
        let c = Codec::new(f, lkv, r).with_tensor_scale(ts).with_faults(fx);
        for t in 0..n {
            let row = &x[t * w..(t + 1) * w];
            let mut b = vec![0xffu8; c.bytes()];
            c.encode_in_launch(row, &mut b, t < first);
            let mut d = vec![0f32; w];
            c.decode(&b, &mut d);
            let hex: String = b.iter().map(|v| format!("{v:02x}")).collect();
            assert_eq!(hex, lines[2 * t], "{what}: row {t}'s bytes");
            let got: Vec<u32> = lines[2 * t + 1]
                .split_whitespace()
                .map(|s| u32::from_str_radix(s, 16).unwrap())
                .collect();
            for (i, (&a, &g)) in d.iter().zip(&got).enumerate() {
                let g = f32::from_bits(g);
                assert!(
                    a.to_bits() == g.to_bits() || (a.is_nan() && g.is_nan()),
                    "{what}: row {t} column {i}: codec {a}, kernel {g}"
                );
            }
        }
    }
}
