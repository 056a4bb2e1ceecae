//! Split models, written by our writer as llama.cpp's gguf-split lays them out: read like the unsplit file; missing, foreign, overlapping or renamed shards are clean errors.

use super::*;
use common::{read_parts, write_gguf};

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
