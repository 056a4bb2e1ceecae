//! Split models: llama.cpp's `gguf-split` and gguf-py write a large model as `PREFIX-00001-of-0000N.gguf`
//! ... `PREFIX-0000N-of-0000N.gguf`, every shard carrying `split.no` (0-based), `split.count` and
//! `split.tensors.count` (the total), and the model's metadata in the first shard only
//! (llama.cpp `llama_split_path`, `LLM_KV_SPLIT_*`). Given any shard, find and check all of them.

use super::reader::{parse_file, Parsed};
use crate::error::{quote, Error, Result};
use std::path::{Path, PathBuf};

const NO: &str = "split.no";
const COUNT: &str = "split.count";
const TENSORS: &str = "split.tensors.count";

/// `PREFIX-NNNNN-of-MMMMM.gguf` → (PREFIX, NNNNN, MMMMM).
fn split_name(file_name: &str) -> Option<(&str, u64, u64)> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let num = |s: &str| {
        (s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    Some((prefix, num(no)?, num(count)?))
}

/// A split key as an integer, if present.
fn key(p: &Parsed, k: &str) -> Result<Option<u64>> {
    match p.get(k) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            Error::format(
                p.shard.path.display(),
                format!("{k} is {}, not a non-negative integer", v.display_short()),
            )
        }),
    }
}

/// The shards of the model `given` belongs to, in split order (just `given` when it is not split).
pub(super) fn gather(path: &Path, given: Parsed) -> Result<Vec<Parsed>> {
    let count = match key(&given, COUNT)? {
        None | Some(0) | Some(1) => return Ok(vec![given]),
        Some(n) => n,
    };
    let bad = |p: &Path, msg: String| Error::format(p.display(), msg);
    let no = key(&given, NO)?
        .ok_or_else(|| bad(path, format!("{COUNT} is {count} but {NO} is missing")))?;
    if no >= count {
        return Err(bad(path, format!("{NO} {no} is not below {COUNT} {count}")));
    }
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let Some((prefix, name_no, name_count)) = split_name(file_name) else {
        return Err(bad(
            path,
            format!(
                "shard {} of a model split in {count}, but the file name is not PREFIX-NNNNN-of-NNNNN.gguf, so the other shards cannot be found",
                no + 1
            ),
        ));
    };
    if (name_no, name_count) != (no + 1, count) {
        return Err(bad(
            path,
            format!(
                "the file name says shard {name_no} of {name_count}, but the file says shard {} of {count}",
                no + 1
            ),
        ));
    }
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let shard_path =
        |i: u64| -> PathBuf { dir.join(format!("{prefix}-{:05}-of-{count:05}.gguf", i + 1)) };
    let total = key(&given, TENSORS)?;
    let arch = |p: &Parsed| p.get("general.architecture").cloned();
    let mut given = Some(given);
    let mut parts: Vec<Parsed> = Vec::with_capacity(count as usize);
    for i in 0..count {
        let p = if i == no {
            given.take().expect("taken once")
        } else {
            let sp = shard_path(i);
            if !sp.exists() {
                return Err(bad(
                    path,
                    format!(
                        "shard {} of {count} of this split model is missing: no file {}",
                        i + 1,
                        quote(&sp.display().to_string())
                    ),
                ));
            }
            parse_file(&sp)?
        };
        let sp = p.shard.path.clone();
        let (p_no, p_count, p_total) = (key(&p, NO)?, key(&p, COUNT)?, key(&p, TENSORS)?);
        if (p_no, p_count) != (Some(i), Some(count)) || p_total != total {
            return Err(bad(
                &sp,
                format!(
                    "not shard {} of the same split model as {}: {NO} {}, {COUNT} {}, {TENSORS} {} (expected {i}, {count}, {})",
                    i + 1,
                    quote(&path.display().to_string()),
                    opt(p_no),
                    opt(p_count),
                    opt(p_total),
                    opt(total),
                ),
            ));
        }
        if let (Some(a), Some(first)) = (arch(&p), parts.first().and_then(arch)) {
            if a != first {
                return Err(bad(
                    &sp,
                    format!(
                        "architecture {} differs from the first shard's {}: a shard of another model",
                        a.display_short(),
                        first.display_short()
                    ),
                ));
            }
        }
        parts.push(p);
    }
    let held: usize = parts.iter().map(|p| p.tensors.len()).sum();
    if let Some(t) = total {
        if held as u64 != t {
            return Err(bad(
                path,
                format!("the {count} shards hold {held} tensors, but {TENSORS} says {t}"),
            ));
        }
    }
    Ok(parts)
}

fn opt(v: Option<u64>) -> String {
    v.map_or("missing".into(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::split_name;

    #[test]
    fn shard_file_names() {
        assert_eq!(
            split_name("GLM-5-Q4_K_M-00002-of-00010.gguf"),
            Some(("GLM-5-Q4_K_M", 2, 10))
        );
        assert_eq!(split_name("a-1-of-2.gguf"), None);
        assert_eq!(split_name("model.gguf"), None);
        assert_eq!(split_name("x-00001-of-00002.bin"), None);
    }
}
