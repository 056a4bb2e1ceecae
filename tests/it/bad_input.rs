//! Bad input through the binary: each must give exit code 2 and exactly one clear stderr line, never a
//! panic. Header problems surface on `inspect`; missing/wrong/unsupported tensors only when weights are
//! loaded (`inspect --load-layer`), since nothing else reads tensor data.

use crate::common;

use common::{assert_clean_error, make_fixture, read_parts, rewrite, run, write_gguf, Tensor};
use mla_diff::gguf::{Array, GgmlType, GgufFile, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

fn block_count_file(d: &Path, n: u64) -> PathBuf {
    rewrite(
        &valid(d),
        &d.join(format!("bc{n}.gguf")),
        |m| {
            let e = m
                .iter_mut()
                .find(|(k, _)| k == "deepseek2.block_count")
                .unwrap();
            e.1 = Value::U64(n);
        },
        |_| {},
    )
}

/// A header's layer count is bounded by the tensors the file holds before anything loops over layers
/// (2^64-2 hung `inspect`, 1e7 took 46 s and 14 GB, `run` panicked with capacity overflow).
#[test]
fn absurd_block_count_is_rejected_fast() {
    let d = tempfile::tempdir().unwrap();
    for n in [u64::MAX - 1, 10_000_000, 960_000_000, 20] {
        let p = block_count_file(d.path(), n);
        let path = p.to_str().unwrap();
        for args in [
            vec!["inspect", path],
            vec!["inspect", path, "--json"],
            vec!["inspect", path, "--load-layer", "0"],
            vec!["run", path, "--backend", "cpu"],
        ] {
            let t = Instant::now();
            let o = run(&args);
            assert_clean_error(&o, &format!("block_count {n} is impossible"));
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{args:?} took {:?}",
                t.elapsed()
            );
        }
    }
}

/// Run the binary and return its exit code and peak resident memory in bytes (its own, via wait4).
// The child is reaped by wait4 (which also gives its rusage), not by Child::wait.
#[allow(clippy::zombie_processes)]
fn peak_rss(args: &[&str]) -> (Option<i32>, u64) {
    let child = common::bin()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: plain syscall on our own child; the Child is not waited on elsewhere.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(pid, child.id() as i32);
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    (code, ru.ru_maxrss as u64 * 1024)
}

/// A u8 metadata array of 64 Mi elements (a 64 MiB file) took 2.2 GB (32 bytes an element).
#[test]
fn large_u8_array_is_held_compactly() {
    let d = tempfile::tempdir().unwrap();
    let p = rewrite(
        &valid(d.path()),
        &d.path().join("arr.gguf"),
        |m| m.push(("big".into(), Value::Array(Array::U8(vec![7; 64 << 20])))),
        |_| {},
    );
    let (code, rss) = peak_rss(&["inspect", p.to_str().unwrap(), "--json"]);
    assert_eq!(code, Some(0));
    eprintln!(
        "inspect --json of a 64 Mi-element u8 array: peak RSS {} MB",
        rss >> 20
    );
    // The file's pages (64 MiB, mapped) plus the array (64 MiB) plus the program.
    assert!(rss < 200 << 20, "peak RSS {} MB", rss >> 20);
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(
        f.get("big").map(|v| v.display_short()).as_deref(),
        Some("[67108864 items]")
    );
}

/// An array whose length times its element size exceeds the file is corrupt, before any allocation.
#[test]
fn array_length_beyond_the_file() {
    let d = tempfile::tempdir().unwrap();
    let src = rewrite(
        &valid(d.path()),
        &d.path().join("a.gguf"),
        |m| m.push(("arr.u64".into(), Value::Array(Array::U64(vec![1, 2])))),
        |_| {},
    );
    let p = patch(&src, &d.path().join("t.gguf"), |b| {
        // key "arr.u64", type 9, element type 10, length 2 → a length of a quarter of the file size
        let at = b.windows(7).position(|w| w == b"arr.u64").unwrap() + 7 + 8;
        let len = b.len() as u64 / 4;
        b[at..at + 8].copy_from_slice(&len.to_le_bytes());
    });
    assert_clean_error(&inspect(&p), "array length");
}

/// `inspect` of a FIFO blocked in open() forever; a directory is no model either.
#[test]
fn non_regular_files_are_rejected_without_blocking() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for p in [&fifo, &d.path().to_path_buf()] {
        let mut child = common::bin()
            .args(["inspect", p.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(10) {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("inspect {} hangs", p.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_clean_error(&child.wait_with_output().unwrap(), "not a regular file");
    }
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

// ---- split models, written by our writer as llama.cpp's gguf-split lays them out ----

/// Write `groups` as the shards `PREFIX-0000i-of-0000n.gguf`: the model's metadata in the first, the
/// split keys in each (`split.tensors.count` = `total`).
fn write_shards(
    dir: &Path,
    prefix: &str,
    meta: &[(String, Value)],
    groups: &[Vec<Tensor>],
    total: i32,
) -> Vec<PathBuf> {
    let n = groups.len();
    groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let mut m = if i == 0 { meta.to_vec() } else { vec![] };
            m.push(("split.no".into(), Value::U16(i as u16)));
            m.push(("split.count".into(), Value::U16(n as u16)));
            m.push(("split.tensors.count".into(), Value::I32(total)));
            write_gguf(
                &dir.join(format!("{prefix}-{:05}-of-{n:05}.gguf", i + 1)),
                m,
                g,
            )
        })
        .collect()
}

/// `src` split into `n` shards of consecutive tensors.
fn split(src: &Path, dir: &Path, prefix: &str, n: usize) -> Vec<PathBuf> {
    let (meta, tensors) = read_parts(src);
    let per = tensors.len().div_ceil(n);
    let groups: Vec<Vec<Tensor>> = tensors.chunks(per).map(|c| c.to_vec()).collect();
    assert_eq!(groups.len(), n);
    write_shards(dir, prefix, &meta, &groups, tensors.len() as i32)
}

#[test]
fn split_model_reads_from_any_shard_like_the_unsplit_file() {
    let d = tempfile::tempdir().unwrap();
    let src = valid(d.path());
    let shards = split(&src, d.path(), "m", 3);
    let whole = common::inspect_json(&src);
    for s in &shards {
        let j = common::inspect_json(s);
        for k in ["config", "layers", "tensor_count", "attention_bytes"] {
            assert_eq!(j[k], whole[k], "{k} via {}", s.display());
        }
        let files: Vec<&str> = j["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["file"].as_str().unwrap())
            .collect();
        let want: Vec<&str> = shards.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(files, want);
        let text = String::from_utf8(inspect(s).stdout).unwrap();
        assert!(text.contains("split         3 shards:"), "{text}");
        for layer in ["0", "1"] {
            assert_eq!(layer_json(s, layer), layer_json(&src, layer));
        }
    }
}

#[test]
fn missing_shard() {
    let d = tempfile::tempdir().unwrap();
    let shards = split(&valid(d.path()), d.path(), "m", 3);
    std::fs::remove_file(&shards[1]).unwrap();
    for s in [&shards[0], &shards[2]] {
        assert_clean_error(&inspect(s), "shard 2 of 3 of this split model is missing");
    }
}

#[test]
fn shard_of_another_split_set() {
    let d = tempfile::tempdir().unwrap();
    let src = valid(d.path());
    let shards = split(&src, d.path(), "m", 3);
    let other_dir = d.path().join("other");
    std::fs::create_dir(&other_dir).unwrap();
    // The same model less one tensor: its shards say another total.
    let smaller = rewrite(
        &src,
        &d.path().join("smaller.gguf"),
        |_| {},
        |ts| ts.retain(|t| t.name != "token_embd.weight"),
    );
    let other = split(&smaller, &other_dir, "m", 3);
    std::fs::copy(&other[2], &shards[2]).unwrap();
    assert_clean_error(&inspect(&shards[0]), "not shard 3 of the same split model");
}

#[test]
fn tensor_in_two_shards() {
    let d = tempfile::tempdir().unwrap();
    let (meta, tensors) = read_parts(&valid(d.path()));
    let mut groups: Vec<Vec<Tensor>> = tensors.chunks(10).map(|c| c.to_vec()).collect();
    groups[1].push(tensors[0].clone());
    let shards = write_shards(d.path(), "m", &meta, &groups, tensors.len() as i32 + 1);
    let name = &tensors[0].name;
    assert_clean_error(
        &inspect(&shards[0]),
        &format!("tensor \"{name}\" is in shard 1 and again in shard 2"),
    );
}

#[test]
fn shard_renamed_or_total_wrong() {
    let d = tempfile::tempdir().unwrap();
    let shards = split(&valid(d.path()), d.path(), "m", 2);
    let renamed = d.path().join("model.gguf");
    std::fs::copy(&shards[0], &renamed).unwrap();
    assert_clean_error(
        &inspect(&renamed),
        "the file name is not PREFIX-NNNNN-of-NNNNN.gguf",
    );
    let (meta, tensors) = read_parts(&valid(d.path()));
    let groups: Vec<Vec<Tensor>> = tensors.chunks(10).map(|c| c.to_vec()).collect();
    let dir = d.path().join("t");
    std::fs::create_dir(&dir).unwrap();
    let shards = write_shards(&dir, "m", &meta, &groups, 99);
    assert_clean_error(
        &inspect(&shards[1]),
        "shards hold 19 tensors, but split.tensors.count says 99",
    );
}
