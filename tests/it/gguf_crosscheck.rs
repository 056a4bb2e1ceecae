//! Independent cross-check with gguf-py (PyPI `gguf`, run by tests/it/gguf_crosscheck.py):
//! 1. gguf-py reads every shipped fixture: same metadata (keys, order, types, values), same tensor
//!    names/shapes/types, and its dequantized values equal ours bit for bit;
//! 2. we read a deepseek2 file gguf-py wrote: the config, every tensor bit for bit, and the kv_b
//!    decompression (the converter's split and k_b transpose) as W_UK/W_UV;
//! 3. a fixture split into shards by gguf-py's GGUFWriter reads, from any shard, as the unsplit file:
//!    same tensors bit for bit, same `inspect --load-layer` norms, same `run` numbers;
//! 4. random blocks (random scales, NaN and Inf included) of every type gguf-py dequantizes come out
//!    of our dequantizer bit for bit;
//! 5. attention weights in the low-bit types (IQ*, TQ*, MXFP4, NVFP4) load end to end
//!    (`inspect --load-layer`) with the L2 norms gguf-py computes.
//!
//! Needs the interpreter named by MLA_DIFF_PYTHON (with gguf==0.19.0 and numpy). Without it the test
//! fails under CI (env CI set) and is skipped, loudly, elsewhere.

use crate::common;
use approx::assert_abs_diff_eq;

use mla_diff::gguf::{
    dequantize_f32, dequantize_rows, Array, GgmlType, GgufFile, TensorType, Value,
};
use mla_diff::model::{LayerWeights, MlaConfig, QProj};
use ndarray::ArrayD;
use serde_json::Value as J;
use std::path::Path;

fn python() -> Option<String> {
    match std::env::var("MLA_DIFF_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ if std::env::var_os("CI").is_some() => {
            panic!("MLA_DIFF_PYTHON is not set, but CI is: the gguf-py cross-check must run in CI (see .ci/run)")
        }
        _ => {
            // Straight to the process's stderr: the harness captures eprintln! of passing tests.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED gguf_crosscheck: set MLA_DIFF_PYTHON to a python with gguf==0.19.0 and numpy \
                 (python3 -m venv .venv && .venv/bin/pip install gguf==0.19.0, then \
                 MLA_DIFF_PYTHON=$PWD/.venv/bin/python cargo test --release)"
            );
            None
        }
    }
}

fn npy(out: &Path, rel: &J) -> ArrayD<f32> {
    ndarray_npy::read_npy(out.join(rel.as_str().unwrap())).unwrap()
}

fn same_bits(ours: &[f32], theirs: &ArrayD<f32>, what: &str) {
    let theirs: Vec<f32> = theirs.iter().copied().collect();
    assert_eq!(ours.len(), theirs.len(), "{what}: element count");
    if let Some(i) = ours
        .iter()
        .zip(&theirs)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: element {i}: ours {} vs gguf-py {}",
            ours[i], theirs[i]
        );
    }
}

/// Like `same_bits`, except that NaN equals NaN whatever the payload (bits of a NaN scale times a
/// value are not something two implementations need to agree on); NaN against a number still fails.
fn same_bits_or_both_nan(ours: &[f32], theirs: &[f32], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: element count");
    if let Some(i) = ours
        .iter()
        .zip(theirs)
        .position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
    {
        panic!(
            "{what}: element {i}: ours {} ({:#010x}) vs gguf-py {} ({:#010x})",
            ours[i],
            ours[i].to_bits(),
            theirs[i],
            theirs[i].to_bits()
        );
    }
}

fn run_script(py: &str, args: &[&std::ffi::OsStr]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/gguf_crosscheck.py");
    let o = crate::common::python_command(py)
        .arg(&script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {py}: {e}"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Our metadata value against gguf-py's `field.contents()` (JSON) and its type id.
fn same_value(ours: &Value, ty: u64, theirs: &J, key: &str) {
    assert_eq!(ours.type_id() as u64, ty, "{key}: value type");
    match ours {
        Value::String(s) => assert_eq!(theirs.as_str(), Some(s.as_str()), "{key}"),
        Value::Bool(b) => assert_eq!(theirs.as_bool(), Some(*b), "{key}"),
        Value::F32(x) => assert_eq!(theirs.as_f64().map(|v| v as f32), Some(*x), "{key}"),
        Value::F64(x) => assert_eq!(theirs.as_f64(), Some(*x), "{key}"),
        Value::Array(items) => {
            let t = theirs
                .as_array()
                .unwrap_or_else(|| panic!("{key}: not an array"));
            assert_eq!(items.len(), t.len(), "{key}: array length");
            for (a, b) in items.iter().zip(t) {
                match &a {
                    Value::String(s) => assert_eq!(b.as_str(), Some(s.as_str()), "{key}"),
                    Value::F32(x) => assert_eq!(b.as_f64().map(|v| v as f32), Some(*x), "{key}"),
                    other => assert_eq!(other.as_f64(), b.as_f64(), "{key}"),
                }
            }
        }
        Value::I8(_) | Value::I16(_) | Value::I32(_) | Value::I64(_) => {
            assert_eq!(ours.to_json().as_i64(), theirs.as_i64(), "{key}")
        }
        other => assert_eq!(other.as_u64(), theirs.as_u64(), "{key}"),
    }
}

#[test]
fn gguf_py_agrees_bit_for_bit_both_ways() {
    let Some(py) = python() else { return };
    let out = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/gguf_crosscheck.py");
    let o = crate::common::python_command(&py)
        .arg(&script)
        .arg(common::fixtures_dir())
        .arg(out.path())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {py}: {e}"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = out.path();
    let m: J =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    eprintln!("gguf-py {}", m["gguf_version"]);

    // 1. gguf-py reads what we wrote.
    let fixtures = m["fixtures"].as_array().unwrap();
    assert_eq!(fixtures.len(), 5, "every shipped fixture was read");
    for fx in fixtures {
        let f = GgufFile::open(common::fixture(fx["file"].as_str().unwrap())).unwrap();
        let theirs = fx["metadata"].as_array().unwrap();
        let keys: Vec<&str> = theirs.iter().map(|e| e["key"].as_str().unwrap()).collect();
        let ours: Vec<&str> = f.metadata.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(ours, keys, "{}: metadata keys and order", f.path.display());
        for ((k, v), e) in f.metadata.iter().zip(theirs) {
            same_value(v, e["type"].as_u64().unwrap(), &e["value"], k);
        }
        let tensors = fx["tensors"].as_array().unwrap();
        assert_eq!(tensors.len(), f.tensors.len());
        for (t, e) in f.tensors.iter().zip(tensors) {
            assert_eq!(t.name, e["name"].as_str().unwrap());
            assert_eq!(t.ty.to_string(), e["type"].as_str().unwrap(), "{}", t.name);
            let shape: Vec<usize> = serde_json::from_value(e["shape"].clone()).unwrap();
            assert_eq!(t.shape(), shape, "{}", t.name);
            let v = npy(out, &e["npy"]);
            assert_eq!(v.shape(), shape.as_slice());
            same_bits(&dequantize_f32(&f, t).unwrap(), &v, &t.name);
        }
    }

    // 2. We read what gguf-py wrote.
    let w = &m["written"];
    let f = GgufFile::open(out.join(w["file"].as_str().unwrap())).unwrap();
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    let c = &w["config"];
    assert_eq!(cfg.arch.gguf_name(), c["arch"].as_str().unwrap());
    for (got, key) in [
        (cfg.n_layer, "n_layer"),
        (cfg.hidden, "hidden"),
        (cfg.n_head, "n_head"),
        (cfg.n_head_kv, "n_head_kv"),
        (cfg.kv_lora_rank, "kv_lora_rank"),
        (cfg.qk_nope, "qk_nope"),
        (cfg.qk_rope, "qk_rope"),
        (cfg.v_head_dim, "v_head_dim"),
    ] {
        assert_eq!(got as u64, c[key].as_u64().unwrap(), "{key}");
    }
    assert_eq!(cfg.q_lora_rank.map(|r| r as u64), c["q_lora_rank"].as_u64());
    assert!(cfg.mla_keys);
    let y = cfg.rope.yarn.as_ref().expect("yarn");
    assert_eq!(y.factor, c["yarn_factor"].as_f64().unwrap());
    assert_eq!(
        y.original_context,
        c["yarn_original_context"].as_u64().unwrap()
    );
    assert_abs_diff_eq!(
        y.mscale_all_dim,
        c["mscale_all_dim"].as_f64().unwrap(),
        epsilon = 1e-6
    );
    assert_eq!((y.beta_fast, y.beta_slow), (32.0, 1.0));
    // (0.1·0.707·ln 40 + 1)² / sqrt(32 + 16)
    assert_eq!(format!("{:.6}", cfg.softmax_scale), "0.229443");
    // Other value types.
    assert_eq!(
        f.get("crosscheck.strings"),
        Some(&Value::Array(Array::String(vec![
            "alpha".into(),
            "".into(),
            "γ".into()
        ])))
    );
    assert_eq!(f.get("crosscheck.u64"), Some(&Value::U64((1 << 63) + 5)));
    assert_eq!(f.get("crosscheck.i8"), Some(&Value::I8(-7)));
    assert_eq!(f.get("crosscheck.f64"), Some(&Value::F64(0.1)));

    let written = w["tensors"].as_array().unwrap();
    assert_eq!(written.len(), f.tensors.len());
    let mut types = std::collections::BTreeSet::new();
    for e in written {
        let name = e["name"].as_str().unwrap();
        let t = f.tensor(name).unwrap();
        assert_eq!(t.ty.to_string(), e["type"].as_str().unwrap(), "{name}");
        if let TensorType::Known(ty) = t.ty {
            types.insert(ty.name);
        }
        same_bits(&dequantize_f32(&f, t).unwrap(), &npy(out, &e["npy"]), name);
    }
    assert!(types.len() >= 6, "several tensor types: {types:?}");

    let lw = LayerWeights::load(&f, &cfg, 0).unwrap();
    let uk: Vec<f32> = lw.w_uk.iter().copied().collect();
    let uv: Vec<f32> = lw.w_uv.iter().copied().collect();
    same_bits(&uk, &npy(out, &w["w_uk"]), "W_UK from gguf-py's attn_k_b");
    same_bits(&uv, &npy(out, &w["w_uv"]), "W_UV from gguf-py's attn_v_b");
    assert!(matches!(lw.q, QProj::Lora { .. }));

    // 3. gguf-py's split model reads as the unsplit file, from any shard.
    let sp = &m["split"];
    let whole_path = common::fixture(sp["source"].as_str().unwrap());
    let whole = GgufFile::open(&whole_path).unwrap();
    let shards: Vec<_> = sp["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| out.join(p.as_str().unwrap()))
        .collect();
    assert!(shards.len() >= 3, "{shards:?}");
    let cli = |args: &[&str]| -> J {
        let o = common::run(args);
        assert!(o.status.success(), "{args:?}: {}", common::stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let report = |p: &Path| -> J {
        let json = out.join("report.json");
        let o = common::run(&[
            "run",
            p.to_str().unwrap(),
            "--backend",
            "cpu",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", common::stderr(&o));
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
    };
    let layer = |p: &Path, l: &str| -> J {
        let mut v = cli(&["inspect", p.to_str().unwrap(), "--load-layer", l, "--json"]);
        v.as_object_mut().unwrap().remove("file");
        v
    };
    let whole_run = report(&whole_path);
    for (i, s) in shards.iter().enumerate() {
        let f = GgufFile::open(s).unwrap();
        assert_eq!(f.shards.len(), shards.len(), "{}", s.display());
        assert_eq!(
            f.shards[0].n_tensors, 0,
            "gguf-py's small first shard holds metadata only"
        );
        assert_eq!(f.tensors.len() as u64, sp["tensors"].as_u64().unwrap());
        assert_eq!(
            f.file_size,
            f.shards.iter().map(|s| s.file_size).sum::<u64>()
        );
        for t in &whole.tensors {
            let u = f
                .tensor(&t.name)
                .unwrap_or_else(|| panic!("{} missing", t.name));
            assert_eq!((u.ne.clone(), u.ty), (t.ne.clone(), t.ty), "{}", t.name);
            assert_eq!(
                f.tensor_bytes(u).unwrap(),
                whole.tensor_bytes(t).unwrap(),
                "{}",
                t.name
            );
        }
        for key in [
            "general.name",
            "deepseek2.block_count",
            "deepseek2.rope.scaling.factor",
        ] {
            assert_eq!(f.get(key), whole.get(key), "{key}");
        }
        let j = cli(&["inspect", s.to_str().unwrap(), "--json"]);
        assert_eq!(j["shards"].as_array().unwrap().len(), shards.len());
        assert_eq!(j["shards"][i]["file"].as_str(), s.to_str());
        for l in ["0", "1"] {
            assert_eq!(
                layer(s, l),
                layer(&whole_path, l),
                "layer {l} via {}",
                s.display()
            );
        }
        let r = report(s);
        for k in ["config", "modes", "verdict"] {
            assert_eq!(r[k], whole_run[k], "run report {k} via {}", s.display());
        }
    }
}

/// The ggml types issue #11 names for attention weights of low-bit releases, plus NVFP4.
const LOW_BIT: [&str; 13] = [
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
];

#[test]
fn random_blocks_of_every_type_gguf_py_dequantizes_match_bit_for_bit() {
    let Some(py) = python() else { return };
    let out = tempfile::tempdir().unwrap();
    run_script(&py, &["blocks".as_ref(), out.path().as_os_str()]);
    let out = out.path();
    let m: J =
        serde_json::from_str(&std::fs::read_to_string(out.join("blocks.json")).unwrap()).unwrap();
    let f = GgufFile::open(out.join(m["file"].as_str().unwrap())).unwrap();
    let mut seen = Vec::new();
    let (mut nan, mut inf) = (0usize, 0usize);
    for e in m["tensors"].as_array().unwrap() {
        let (name, ty) = (e["name"].as_str().unwrap(), e["type"].as_str().unwrap());
        let t = f.tensor(name).unwrap();
        let TensorType::Known(g) = t.ty else {
            panic!("{name}: gguf-py's {ty} is not in our type table")
        };
        assert_eq!(g.name, ty, "{name}");
        assert!(g.dequantizable(), "gguf-py dequantizes {ty}; we must too");
        assert!(e["blocks"].as_u64().unwrap() >= 1000, "{ty}: enough blocks");
        let theirs: Vec<f32> = npy(out, &e["npy"]).iter().copied().collect();
        nan += theirs.iter().filter(|x| x.is_nan()).count();
        inf += theirs.iter().filter(|x| x.is_infinite()).count();
        same_bits_or_both_nan(&dequantize_f32(&f, t).unwrap(), &theirs, ty);
        // The row path (token embeddings) on a few rows, out of order.
        let width = t.ne[0] as usize;
        let rows = [t.ne[1] as usize - 1, 0, 17];
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|&r| theirs[r * width..(r + 1) * width].iter().copied())
            .collect();
        let got = dequantize_rows(&f, t, &rows).unwrap();
        same_bits_or_both_nan(&got, &want, &format!("{ty} rows {rows:?}"));
        seen.push(ty.to_string());
    }
    for ty in LOW_BIT {
        assert!(seen.iter().any(|s| s == ty), "{ty} was checked: {seen:?}");
    }
    // Random scales: the special values were exercised, not just finite ones.
    assert!(nan > 0 && inf > 0, "NaN {nan}, Inf {inf}");
}

#[test]
fn low_bit_attention_weights_load_with_gguf_py_norms() {
    let Some(py) = python() else { return };
    let d = tempfile::tempdir().unwrap();
    // ne[0]: q_a, kv_a_mqa and v_b 512, q_b 256, k_b 128 (so only 32/64-blocks), output 1024.
    let variants: [&[(&str, &str)]; 3] = [
        &[
            ("attn_q_a", "IQ2_XXS"),
            ("attn_q_b", "IQ2_XS"),
            ("attn_kv_a_mqa", "IQ2_S"),
            ("attn_k_b", "IQ4_NL"),
            ("attn_v_b", "IQ3_XXS"),
            ("attn_output", "IQ3_S"),
        ],
        &[
            ("attn_q_a", "IQ1_S"),
            ("attn_q_b", "IQ1_M"),
            ("attn_kv_a_mqa", "IQ4_XS"),
            ("attn_k_b", "NVFP4"),
            ("attn_v_b", "TQ1_0"),
            ("attn_output", "TQ2_0"),
        ],
        &[("attn_q_a", "MXFP4"), ("attn_k_b", "MXFP4")],
    ];
    let mut files = Vec::new();
    let mut covered = std::collections::BTreeSet::new();
    for (i, v) in variants.iter().enumerate() {
        let p = common::rewrite(
            &common::fixture("deepseek-v3-yarn-q4_k.gguf"),
            &d.path().join(format!("v{i}.gguf")),
            |_| {},
            |ts| {
                for (w, ty) in v.iter() {
                    let g = GgmlType::from_name(ty).unwrap();
                    let name = format!("blk.0.{w}.weight");
                    let t = ts.iter_mut().find(|t| t.name == name).unwrap();
                    t.type_id = g.id;
                    // Zeros here; the script fills in random blocks with finite values.
                    t.bytes = vec![0; g.bytes_for(t.ne.iter().product()).unwrap() as usize];
                    covered.insert(*ty);
                }
            },
        );
        files.push(p);
    }
    assert_eq!(
        covered.len(),
        LOW_BIT.len(),
        "every low-bit type: {covered:?}"
    );
    let norms_json = d.path().join("norms.json");
    let mut args = vec!["fill".as_ref(), norms_json.as_os_str()];
    args.extend(files.iter().map(|p| p.as_os_str()));
    run_script(&py, &args);
    let theirs: J = serde_json::from_str(&std::fs::read_to_string(&norms_json).unwrap()).unwrap();
    for (p, v) in files.iter().zip(variants) {
        let o = common::run(&[
            "inspect",
            p.to_str().unwrap(),
            "--load-layer",
            "0",
            "--json",
        ]);
        assert!(o.status.success(), "{}", common::stderr(&o));
        let ours: J = serde_json::from_slice(&o.stdout).unwrap();
        let theirs = &theirs[p.to_str().unwrap()];
        let rows = ours["tensors"].as_array().unwrap();
        for (w, _) in v.iter() {
            let name = format!("blk.0.{w}.weight");
            assert!(
                rows.iter().any(|r| r["tensor"] == name.as_str()),
                "{name} loaded"
            );
        }
        for r in rows {
            let name = r["tensor"].as_str().unwrap();
            let (a, b) = (r["l2"].as_f64().unwrap(), theirs[name].as_f64().unwrap());
            // Both sum the exact f64 squares of the same f32 values (bit-exact: the test above), in
            // different orders: the sums may differ by the rounding bound of an n-term sum, n·ε.
            let n: u64 = r["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .product();
            let bound = n as f64 * f64::EPSILON;
            assert!(
                b > 0.0 && ((a * a - b * b) / (b * b)).abs() <= bound,
                "{}: {name}: ours {a} vs gguf-py {b} (relative bound on the sums {bound:e})",
                p.display()
            );
        }
    }
}
