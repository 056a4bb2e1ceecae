//! `runners/selfcheck.py --kv-cache-dtype FMT` over every format mla-diff writes (issue #38): the bytes
//! selfcheck writes (its own encoder, independent of the runner SDK's reader) are `Codec::encode`'s,
//! byte for byte, and decode through `Codec::decode` to the values selfcheck judges over; numpy_mla
//! passes with each format on the case whose row it fits, and the planted misreaders of the formats no
//! shipped fixture fits (`fp8_ds_mla_nope`, `fp8_v41`, `fp4_v41`) are caught at every op that reads the
//! cache. (`fp8_ds_mla` with selfcheck: runners_sparse.rs.)
//!
//! Needs MLA_DIFF_PYTHON with numpy (skips without it, fails under CI).

use crate::common::{cache_rows, python, runner};
use mla_diff::kv_format::{tensor_scale, Codec, KvFormat};
use serde_json::Value as J;
use std::path::Path;

fn runners_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("runners")
}

fn read_f64(path: &str) -> Vec<f64> {
    std::fs::read(path)
        .unwrap()
        .chunks(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// selfcheck's `quantize_cache` on rows laid out as a paged cache `[pages, 4, width]` with unwritten
/// slots (NaN rows), for each format and dims it takes (the V4.1 formats on 448 + 64 and on a NoPE
/// 512 + 0 row): its bytes are `Codec::encode`'s of the same rows, byte for byte (unwritten: 0xff);
/// `Codec::decode` of its bytes gives the values it judges over, bit for bit (unwritten: NaN); `fp8`'s
/// `meta.cache.scale` is the codec's `tensor_scale` of the written rows; `bytes_per_token` the codec's.
/// One Python process for all cases.
#[test]
fn selfcheck_writes_each_format_as_the_codec_byte_for_byte() {
    let Some(py) = python("selfcheck's cache encoder", "numpy") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (n, unwritten) = (60, [7usize, 31, 32]);
    let formats = [
        (KvFormat::Fp8, 512, 64),
        (KvFormat::Fp8, 256, 32),
        (KvFormat::Fp8DsMla, 512, 64),
        (KvFormat::Fp8DsMlaNope, 512, 0),
        (KvFormat::Fp8V41, 448, 64),
        (KvFormat::Fp4V41, 448, 64),
        (KvFormat::Fp8V41, 512, 0),
        (KvFormat::Fp4V41, 512, 0),
    ];
    let mut cases = Vec::new();
    let mut all_rows = Vec::new();
    for (i, &(f, lkv, r)) in formats.iter().enumerate() {
        let x = cache_rows(n, lkv + r, 0x2545_f491_4f6c_dd1d ^ i as u64);
        let file = dir.path().join(format!("c{i}"));
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&file, bytes).unwrap();
        cases.push(serde_json::json!({
            "file": file, "format": f.name(), "lkv": lkv, "r": r, "unwritten": unwritten,
        }));
        all_rows.push(x);
    }
    let manifest = dir.path().join("cases.json");
    std::fs::write(&manifest, serde_json::to_string(&cases).unwrap()).unwrap();
    let script = format!(
        "import sys, json, numpy as np\nsys.path.insert(0, {d:?})\nimport selfcheck\nfor c in json.load(open({m:?})):\n    w = c['lkv'] + c['r']\n    x = np.fromfile(c['file'], '<f4').astype(np.float64).reshape(-1, w)\n    x[c['unwritten']] = np.nan\n    codes, vals, meta = selfcheck.quantize_cache(x.reshape(-1, 4, w), c['format'], c['lkv'], c['r'])\n    assert codes.dtype == np.uint8 and codes.shape[:2] == (x.shape[0] // 4, 4), codes.shape\n    codes.tofile(c['file'] + '.bytes')\n    vals.astype('<f8').tofile(c['file'] + '.vals')\n    json.dump(meta, open(c['file'] + '.meta', 'w'))\n",
        d = runners_dir().to_str().unwrap(),
        m = manifest.to_str().unwrap()
    );
    let o = crate::common::python_command(&py)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for ((&(f, lkv, r), c), x) in formats.iter().zip(&cases).zip(&all_rows) {
        let file = c["file"].as_str().unwrap();
        let what = format!("{f} ({lkv} + {r})");
        let w = lkv + r;
        let written = |t: &usize| !unwritten.contains(t);
        let live = (0..n).filter(written).flat_map(|t| &x[t * w..(t + 1) * w]);
        let codec = Codec::new(f, lkv, r).with_tensor_scale(tensor_scale(live));
        let meta: J =
            serde_json::from_str(&std::fs::read_to_string(format!("{file}.meta")).unwrap())
                .unwrap();
        assert_eq!(meta["format"], f.name(), "{what}");
        assert_eq!(meta["bytes_per_token"], codec.bytes(), "{what}");
        if f == KvFormat::Fp8 {
            let s = meta["scale"].as_f64().unwrap();
            assert_eq!(s as f32 as f64, s, "{what}: the scale is a float32");
            assert_eq!((s as f32).to_bits(), codec.tensor_scale.to_bits(), "{what}");
        }
        let (nb, got) = (
            codec.bytes(),
            std::fs::read(format!("{file}.bytes")).unwrap(),
        );
        let vals = read_f64(&format!("{file}.vals"));
        assert_eq!((got.len(), vals.len()), (n * nb, n * w), "{what}");
        let (mut want, mut dec) = (vec![0u8; nb], vec![0f32; w]);
        for t in 0..n {
            let (b, v) = (&got[t * nb..(t + 1) * nb], &vals[t * w..(t + 1) * w]);
            if !written(&t) {
                assert!(b.iter().all(|&b| b == 0xff), "{what}: slot {t} written");
                assert!(v.iter().all(|v| v.is_nan()), "{what}: slot {t} not NaN");
                continue;
            }
            codec.encode(&x[t * w..(t + 1) * w], &mut want);
            if let Some(i) = (0..nb).find(|&i| b[i] != want[i]) {
                panic!(
                    "{what}: row {t} byte {i}: selfcheck {:#04x}, codec {:#04x}",
                    b[i], want[i]
                );
            }
            codec.decode(b, &mut dec);
            for (i, (&d, &v)) in dec.iter().zip(v).enumerate() {
                assert!(
                    v as f32 as f64 == v && d.to_bits() == (v as f32).to_bits(),
                    "{what}: row {t} [{i}]: selfcheck judges over {v}, the codec reads {d}"
                );
            }
        }
    }
}

/// `selfcheck.py --json` of one or more runners (relative to runners/): one entry per runner.
fn selfcheck(py: &str, fmt: &str, case: &str, rels: &[&str]) -> Vec<J> {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let mut cmd = crate::common::python_command(py);
    cmd.arg(runners_dir().join("selfcheck.py"));
    for rel in rels {
        cmd.args(["--runner", &runner(py, rel)]);
    }
    let o = cmd
        .args(["--dtypes", "bf16", "--cases", case, "--kv-cache-dtype", fmt])
        .args(["--ops", "decode,sparse_prefill,sparse_decode"])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let Ok(text) = std::fs::read_to_string(&json) else {
        panic!(
            "{fmt}: no JSON: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    serde_json::from_str::<Vec<J>>(&text).unwrap()
}

/// Each output of each request a runner was sent: (op, output, passed).
fn outputs(entry: &J) -> Vec<(String, String, bool)> {
    let mut v = Vec::new();
    for r in entry["results"].as_array().unwrap() {
        assert_eq!(r["status"], "checked", "{}: {r}", entry["runner"]);
        for (name, o) in r["outputs"].as_object().unwrap() {
            v.push((
                r["op"].as_str().unwrap().into(),
                name.clone(),
                o["ok"] == true,
            ));
        }
    }
    v
}

/// The formats no shipped fixture fits, each on the selfcheck case of its row: numpy_mla passes every
/// op that reads the cache (decode's 4 outputs, each sparse op's 2), and each planted misreader of the
/// format (runners/bugs/: ds_mla's tile 0 scale on every column, V4.1 fp8 read with ds_mla's 128-column
/// tiles, V4.1 fp4 with fp8's 32-column groups or its nibbles swapped) fails every output of every one
/// of those ops. A case whose row the format does not fit is refused with one line naming the dims
/// and the case that has them. bf16 only: ~2 s of CPU per format.
#[test]
fn selfcheck_sends_every_format_and_catches_its_misreaders() {
    let Some(py) = python("selfcheck with a quantized cache", "numpy") else {
        return;
    };
    for (fmt, case, bugs) in [
        (
            "fp8_ds_mla_nope",
            "glm5-next",
            &["bugs/sparse/ds_mla_one_scale.py"][..],
        ),
        ("fp8_v41", "v4-dims", &["bugs/cache/v41_fp8_tile128.py"][..]),
        (
            "fp4_v41",
            "v4-dims",
            &[
                "bugs/cache/v41_fp4_group32.py",
                "bugs/cache/v41_fp4_nibbles_swapped.py",
            ][..],
        ),
    ] {
        let rels = [&["numpy_mla.py"][..], bugs].concat();
        let got = selfcheck(&py, fmt, case, &rels);
        assert_eq!(got.len(), rels.len(), "{fmt}");
        for (entry, rel) in got.iter().zip(&rels) {
            let outs = outputs(entry);
            assert_eq!(outs.len(), 8, "{fmt} {rel}: {outs:?}");
            let clean = *rel == "numpy_mla.py";
            let want = if clean { "PASS" } else { "FAIL" };
            assert_eq!(entry["verdict"], want, "{fmt} {rel}: {outs:?}");
            for (op, name, ok) in outs {
                assert_eq!(ok, clean, "{fmt} {rel}: {op}.{name}");
            }
        }
    }
    let got = selfcheck(&py, "fp8_ds_mla_nope", "v4-dims", &["numpy_mla.py"]);
    let res = got[0]["results"].as_array().unwrap();
    assert_eq!(res.len(), 3, "{res:?}");
    for r in res {
        assert_eq!(r["status"], "unsupported", "{r}");
        assert_eq!(
            r["reason"],
            "cache format fp8_ds_mla_nope needs kv_lora_rank 512 + qk_rope 0 (a NoPE row, as glm5-next: case glm5-next), not 448 + 64"
        );
    }
}
