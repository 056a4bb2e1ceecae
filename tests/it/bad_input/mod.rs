//! Bad input through the binary: each must give exit code 2 and exactly one clear stderr line, never a
//! panic. Header problems surface on `inspect`; missing/wrong/unsupported tensors only when weights are
//! loaded (`inspect --load-layer`), since nothing else reads tensor data. Split models: shards.rs; sizes and file kinds: sizes.rs.

mod shards;
mod sizes;

use crate::common;

use common::{assert_clean_error, make_fixture, rewrite, run, Tensor};
use mla_diff::gguf::{GgmlType, GgufFile, Value};
use std::path::{Path, PathBuf};

/// A valid tiny MLA file (hidden 256, so a 256-block type fits attn_q_a's rows).
fn valid(dir: &Path) -> PathBuf {
    make_fixture(dir, "valid.gguf", &["--preset", "tiny", "--quant", "q8_0"])
}

fn tensor<'a>(ts: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    ts.iter_mut().find(|t| t.name == name).unwrap()
}

fn patch(src: &Path, dst: &Path, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut b = std::fs::read(src).unwrap();
    f(&mut b);
    std::fs::write(dst, b).unwrap();
    dst.to_path_buf()
}

fn inspect(p: &Path) -> std::process::Output {
    run(&["inspect", p.to_str().unwrap()])
}

fn load_layer(p: &Path, layer: &str) -> std::process::Output {
    run(&["inspect", p.to_str().unwrap(), "--load-layer", layer])
}

#[test]
fn truncated_tensor_data() {
    let d = tempfile::tempdir().unwrap();
    let p = patch(&valid(d.path()), &d.path().join("t.gguf"), |b| {
        b.truncate(b.len() * 3 / 5)
    });
    assert_clean_error(&inspect(&p), "truncated");
}

#[test]
fn truncated_header() {
    let d = tempfile::tempdir().unwrap();
    let p = patch(&valid(d.path()), &d.path().join("t.gguf"), |b| {
        b.truncate(100)
    });
    assert_clean_error(&inspect(&p), "truncated");
}

#[test]
fn bad_magic() {
    let d = tempfile::tempdir().unwrap();
    let p = patch(&valid(d.path()), &d.path().join("t.gguf"), |b| {
        b[..4].copy_from_slice(b"GGML")
    });
    assert_clean_error(&inspect(&p), "magic");
}

#[test]
fn unsupported_version() {
    let d = tempfile::tempdir().unwrap();
    let p = patch(&valid(d.path()), &d.path().join("t.gguf"), |b| {
        b[4..8].copy_from_slice(&4u32.to_le_bytes())
    });
    assert_clean_error(&inspect(&p), "unsupported GGUF version 4");
}

#[test]
fn absurd_tensor_count() {
    let d = tempfile::tempdir().unwrap();
    let p = patch(&valid(d.path()), &d.path().join("t.gguf"), |b| {
        b[8..16].copy_from_slice(&(u64::MAX / 3).to_le_bytes())
    });
    assert_clean_error(&inspect(&p), "tensor count");
}

#[test]
fn absurd_metadata_count() {
    let d = tempfile::tempdir().unwrap();
    let p = patch(&valid(d.path()), &d.path().join("t.gguf"), |b| {
        b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes())
    });
    assert_clean_error(&inspect(&p), "metadata count");
}

#[test]
fn absurd_dims() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| {
            ts.push(Tensor {
                name: "huge.weight".into(),
                ne: vec![1 << 40, 1 << 40, 1 << 40],
                type_id: 0,
                bytes: vec![0; 32],
            })
        },
    );
    assert_clean_error(&inspect(&p), "absurd dimensions");
}

#[test]
fn missing_tensor() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| ts.retain(|t| t.name != "blk.1.attn_kv_a_mqa.weight"),
    );
    // The header is fine; the gap only matters once layer 1 is loaded.
    assert!(inspect(&p).status.success());
    assert!(load_layer(&p, "0").status.success());
    assert_clean_error(
        &load_layer(&p, "1"),
        "blk.1.attn_kv_a_mqa.weight is missing",
    );
}

#[test]
fn wrong_shape() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| {
            // {E, Lkv+R} = {256, 80} becomes {256, 64}: Q8_0 rows of 256 are 272 bytes.
            let t = tensor(ts, "blk.0.attn_kv_a_mqa.weight");
            t.ne = vec![256, 64];
            t.bytes = vec![0; 64 * 272];
        },
    );
    assert_clean_error(
        &load_layer(&p, "0"),
        "blk.0.attn_kv_a_mqa.weight has shape (ne) {256, 64}, expected {256, 80}",
    );
}

#[test]
fn non_mla_architecture() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |m| m[0].1 = Value::String("llama".into()),
        |_| {},
    );
    assert_clean_error(
        &inspect(&p),
        "\"llama\" does not use Multi-head Latent Attention",
    );
}

#[test]
fn unsupported_quant_type_in_attention_tensor() {
    let d = tempfile::tempdir().unwrap();
    // Q1_0: sized in the type table, but neither gguf-py 0.19 nor we dequantize it.
    let iq = GgmlType::from_name("Q1_0").unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| {
            let t = tensor(ts, "blk.0.attn_q_a.weight");
            t.type_id = iq.id;
            t.bytes = vec![0; iq.bytes_for(t.ne.iter().product()).unwrap() as usize];
        },
    );
    assert!(inspect(&p).status.success(), "the header alone is readable");
    assert_clean_error(
        &load_layer(&p, "0"),
        "tensor \"blk.0.attn_q_a.weight\" has type Q1_0",
    );
    // Another layer does not need that tensor.
    assert!(load_layer(&p, "1").status.success());
}

#[test]
fn unknown_type_id_in_attention_tensor() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| tensor(ts, "blk.1.attn_output.weight").type_id = 99,
    );
    assert!(inspect(&p).status.success());
    assert_clean_error(&load_layer(&p, "1"), "unknown ggml type 99");
}

#[test]
fn unsupported_type_outside_attention_is_never_read() {
    let d = tempfile::tempdir().unwrap();
    // Q1_0: sized in the type table, but neither gguf-py 0.19 nor we dequantize it.
    let iq = GgmlType::from_name("Q1_0").unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| {
            let t = tensor(ts, "token_embd.weight");
            t.type_id = iq.id;
            t.bytes = vec![0; iq.bytes_for(t.ne.iter().product()).unwrap() as usize];
        },
    );
    let o = load_layer(&p, "0");
    assert!(o.status.success(), "{}", common::stderr(&o));
}

#[test]
fn layer_out_of_range() {
    let d = tempfile::tempdir().unwrap();
    assert_clean_error(&load_layer(&valid(d.path()), "2"), "layer 2 does not exist");
}

#[test]
fn not_a_file() {
    let d = tempfile::tempdir().unwrap();
    assert_clean_error(&inspect(&d.path().join("nope.gguf")), "cannot open");
}

// ---- issue #11: alignment, header counts, non-regular files, names in errors, split models ----

/// `inspect --load-layer L --json` without the file name, to compare two files holding the same model.
fn layer_json(p: &Path, layer: &str) -> serde_json::Value {
    let o = run(&[
        "inspect",
        p.to_str().unwrap(),
        "--load-layer",
        layer,
        "--json",
    ]);
    assert!(
        o.status.success(),
        "{}: {}",
        p.display(),
        common::stderr(&o)
    );
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v.as_object_mut().unwrap().remove("file");
    v
}

/// `general.alignment` 1 puts the data section, and so every tensor, at an odd address: block data
/// must be copied to an aligned buffer for candle (it panicked), f32 data read bytewise.
#[test]
fn alignment_one_with_odd_data_offsets_reads_like_the_aligned_file() {
    let d = tempfile::tempdir().unwrap();
    let src = valid(d.path());
    let odd = (0..2)
        .map(|pad| {
            rewrite(
                &src,
                &d.path().join(format!("a1-{pad}.gguf")),
                |m| {
                    m.insert(1, ("general.alignment".into(), Value::U32(1)));
                    m.push(("pad".into(), Value::String("x".repeat(pad))));
                },
                |_| {},
            )
        })
        .find(|p| GgufFile::open(p).unwrap().data_offset % 2 == 1)
        .expect("one of two paddings gives an odd data offset");
    let f = GgufFile::open(&odd).unwrap();
    let q8 = f.tensor("blk.0.attn_q_a.weight").unwrap();
    assert_eq!(q8.ty.to_string(), "Q8_0");
    assert_eq!(
        (f.data_offset + q8.offset) % 2,
        1,
        "Q8_0 data at an odd offset"
    );
    for layer in ["0", "1"] {
        assert_eq!(layer_json(&odd, layer), layer_json(&src, layer));
    }
    let o = run(&["run", odd.to_str().unwrap(), "--backend", "cpu"]);
    assert_eq!(o.status.code(), Some(0), "{}", common::stderr(&o));
}

/// Names from the file are escaped and cut: a name with newlines and 1 MB of junk gives one short line.
#[test]
fn names_in_errors_are_escaped_and_cut() {
    let d = tempfile::tempdir().unwrap();
    let junk: String = "bad\nname\r\u{2028}\u{0}".repeat(4) + &"\u{1b}[31m\n".repeat(1 << 17);
    let check = |o: std::process::Output, needle: &str| {
        assert_clean_error(&o, needle);
        let err = common::stderr(&o);
        assert!(err.len() < 400, "{} bytes: {}", err.len(), &err[..400]);
        assert!(err.contains("bad\\nname\\r\\u{2028}\\0"), "{err}");
    };
    // A tensor name in a header error.
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("t.gguf"),
        |_| {},
        |ts| {
            ts.push(Tensor {
                name: junk.clone(),
                ne: vec![1 << 40, 1 << 40, 1 << 40],
                type_id: 0,
                bytes: vec![0; 32],
            })
        },
    );
    check(inspect(&p), "absurd dimensions");
    // A metadata key: a value type no GGUF has.
    let src = rewrite(
        &valid(d.path()),
        &d.path().join("k.gguf"),
        |m| m.push((junk.clone(), Value::U32(5))),
        |_| {},
    );
    let p = patch(&src, &d.path().join("k2.gguf"), |b| {
        let key = junk.as_bytes();
        let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    });
    check(inspect(&p), "unknown value type 99");
    // The same key in a file cut right after it: the truncation message names the key, escaped.
    let p = patch(&src, &d.path().join("k3.gguf"), |b| {
        let key = junk.as_bytes();
        let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        b.truncate(at + 2);
    });
    check(inspect(&p), "truncated: needs 4 bytes");
    // A string value: the architecture.
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("a.gguf"),
        |m| m[0].1 = Value::String(junk.clone()),
        |_| {},
    );
    check(inspect(&p), "does not use Multi-head Latent Attention");
}

/// `sweep`: lengths below the decode tokens, empty ranges, bad split counts, a layer out of range.
#[test]
fn bad_sweep_input_is_one_line_and_exit_2() {
    let fx = common::fixture("deepseek-v3-yarn-q4_k.gguf")
        .display()
        .to_string();
    let cases: [(&[&str], &str); 6] = [
        (
            &["--lengths", "1..=5", "--decode-steps", "16"],
            "lengths start at 16",
        ),
        (&["--lengths", "9..3"], "is empty"),
        (&["--splits", "0"], "not a split count"),
        (&["--splits", "2,2"], "distinct"),
        (
            &["--splits", "1,2", "--decode-steps", "0"],
            "no decode steps",
        ),
        (&["--layers", "7"], "does not exist"),
    ];
    for (args, needle) in cases {
        let mut all = vec!["sweep", fx.as_str(), "--backend", "cpu"];
        all.extend_from_slice(args);
        let o = run(&all);
        assert_clean_error(&o, needle);
        assert!(
            common::stderr(&o).contains(needle),
            "{args:?}: {}",
            common::stderr(&o)
        );
    }
}
