//! A FlashInfer API-logging dump folder, read: its call folders in call order, each call's metadata
//! (the last record of its `metadata.jsonl`) and its tensors by argument name.

use crate::error::{Error, Result};
use safetensors::tensor::Dtype as St;
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// One call folder `<time>_pid<pid>_<function>_call<NNNN>/`.
#[derive(Debug, Clone)]
pub struct CallDir {
    pub path: PathBuf,
    /// The folder's name.
    pub name: String,
    pub function: String,
    /// `call_sequence`: the function's own call count in its process.
    pub seq: u64,
    pub pid: u64,
    /// `self_id`: the wrapper object's `id()` for a method call.
    pub self_id: Option<u64>,
    /// The last record of `metadata.jsonl` (the completed one when the call returned).
    pub meta: Value,
    /// A call captured in a CUDA graph: which replay's snapshot (`graph_flushes/flush_<n>/`) this is.
    pub flush: Option<u64>,
}

/// Where the call order came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Order {
    /// The order of first appearance in `session.jsonl` (appended at each call, in call order).
    Session,
    /// The folders' timestamps (milliseconds), then process and call number: a plan and a run in the
    /// same millisecond keep the plan first.
    Timestamps,
}

/// The call folders of a dump, in call order.
#[derive(Debug, Clone)]
pub struct Dump {
    pub dir: PathBuf,
    pub calls: Vec<CallDir>,
    pub order: Order,
}

fn bad(m: impl std::fmt::Display) -> Error {
    Error::Usage(m.to_string())
}

/// `<time>_pid<pid>_<function>_call<NNNN>`: (pid, function, call number).
fn parse_name(name: &str) -> Option<(u64, String, u64)> {
    let p = name.find("_pid")?;
    let rest = &name[p + 4..];
    let u = rest.find('_')?;
    let pid = rest[..u].parse().ok()?;
    let rest = &rest[u + 1..];
    let c = rest.rfind("_call")?;
    let seq = rest[c + 5..].parse().ok()?;
    Some((pid, rest[..c].to_string(), seq))
}

/// A `dump_dir` of session.jsonl as a call's `name`: the folder's name, or
/// `<folder>/graph_flushes/flush_<n>` for a replay snapshot.
fn session_key(d: &str) -> String {
    let parts: Vec<&str> = d.split(['/', '\\']).filter(|p| !p.is_empty()).collect();
    match parts.len() {
        n if n >= 3 && parts[n - 2] == "graph_flushes" => parts[n - 3..].join("/"),
        n if n >= 1 => parts[n - 1].to_string(),
        _ => d.to_string(),
    }
}

/// The replay snapshots of a call captured in a CUDA graph (`graph_flushes/flush_<n>/`), in order.
fn flushes(call: &CallDir) -> Result<Vec<CallDir>> {
    let dir = call.path.join("graph_flushes");
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut v = Vec::new();
    for ent in rd.flatten() {
        let name = ent.file_name().to_string_lossy().to_string();
        let Some(n) = name
            .strip_prefix("flush_")
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let mj = ent.path().join("metadata.jsonl");
        let meta = match mj.is_file() {
            true => last_record(&mj)?,
            false => call.meta.clone(),
        };
        v.push(CallDir {
            path: ent.path(),
            name: format!("{}/graph_flushes/{name}", call.name),
            meta,
            flush: Some(n),
            ..call.clone()
        });
    }
    v.sort_by_key(|c| c.flush);
    Ok(v)
}

/// The last non-empty line of a JSONL file, parsed.
fn last_record(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .ok_or_else(|| bad(format!("{}: empty", path.display())))?;
    serde_json::from_str(line).map_err(|e| bad(format!("{}: not JSON lines: {e}", path.display())))
}

impl Dump {
    /// Find the call folders of `dir` and their order. A folder with no call folder in it is not a dump.
    pub fn open(dir: &Path) -> Result<Dump> {
        if !dir.is_dir() {
            return Err(bad(format!("{}: not a directory", dir.display())));
        }
        let rd = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("cannot read {}", dir.display()), e))?;
        let mut calls = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| Error::io(format!("cannot read {}", dir.display()), e))?;
            let name = ent.file_name().to_string_lossy().to_string();
            let path = ent.path();
            let Some((pid, function, seq)) = parse_name(&name) else {
                continue;
            };
            if !path.is_dir() {
                continue;
            }
            let mj = path.join("metadata.jsonl");
            if !mj.is_file() {
                return Err(bad(format!(
                    "{}: a call folder with no metadata.jsonl (the dump was cut short or copied in part)",
                    path.display()
                )));
            }
            let meta = last_record(&mj)?;
            let function = meta
                .get("function_name")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or(function);
            let call = CallDir {
                self_id: meta.get("self_id").and_then(Value::as_u64),
                pid: meta
                    .get("process_id")
                    .and_then(Value::as_u64)
                    .unwrap_or(pid),
                seq: meta
                    .get("call_sequence")
                    .and_then(Value::as_u64)
                    .unwrap_or(seq),
                path,
                name,
                function,
                meta,
                flush: None,
            };
            // A call captured in a CUDA graph is written at each replay's flush, one snapshot folder
            // each; the call folder's own files are a copy of the latest, not a call of their own.
            match flushes(&call)? {
                f if f.is_empty() => calls.push(call),
                f => calls.extend(f),
            }
        }
        if calls.is_empty() {
            return Err(bad(format!(
                "{} is not a FlashInfer API-logging dump: no <time>_pid<pid>_<function>_call<NNNN> folder with a metadata.jsonl in it (FLASHINFER_LOGLEVEL=10 FLASHINFER_DUMP_SAFETENSORS=1 FLASHINFER_DUMP_DIR={} write one)",
                dir.display(),
                dir.display()
            )));
        }
        // session.jsonl: one record per call when it starts (and more as it completes), in call order.
        let session = dir.join("session.jsonl");
        let mut rank: HashMap<String, usize> = HashMap::new();
        if let Ok(text) = std::fs::read_to_string(&session) {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                let Some(d) = v.get("dump_dir").and_then(Value::as_str) else {
                    continue;
                };
                let base = session_key(d);
                let n = rank.len();
                rank.entry(base).or_insert(n);
            }
        }
        let order = if !rank.is_empty() && calls.iter().all(|c| rank.contains_key(&c.name)) {
            Order::Session
        } else {
            Order::Timestamps
        };
        // A plan sorts before a run stamped in the same millisecond.
        let after_plan = |c: &CallDir| !c.function.ends_with(".plan");
        match order {
            Order::Session => calls.sort_by_key(|c| rank[&c.name]),
            Order::Timestamps => calls.sort_by(|a, b| {
                let ts = |c: &CallDir| c.name[..c.name.find("_pid").unwrap_or(0)].to_string();
                (ts(a), a.pid, after_plan(a), a.seq, &a.name).cmp(&(
                    ts(b),
                    b.pid,
                    after_plan(b),
                    b.seq,
                    &b.name,
                ))
            }),
        }
        Ok(Dump {
            dir: dir.to_path_buf(),
            calls,
            order,
        })
    }

    /// How many calls of each function the dump holds.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for c in &self.calls {
            *m.entry(c.function.clone()).or_insert(0) += 1;
        }
        m
    }
}

/// A tensor of a call, decoded to f64, with its dtype's name.
#[derive(Debug, Clone)]
pub struct Floats {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
    pub dtype: &'static str,
}

/// A call's arguments by name: its tensors (`inputs.safetensors`), its other arguments
/// (`input_metadata`), and the parameter names of its signature, so that `arg_<i>` and
/// `kwarg_<name>` both answer to the name.
pub struct CallArgs<'a> {
    pub call: &'a CallDir,
    params: Vec<String>,
    inputs: Option<memmap2::Mmap>,
    outputs: Option<memmap2::Mmap>,
}

/// The parameter names of a Python signature as `inspect.signature` prints it:
/// `(self, q: torch.Tensor, k: Optional[Tuple[int, int]] = None, *, x: int = 0) -> torch.Tensor`.
pub fn signature_params(sig: &str) -> Vec<String> {
    let s = sig.trim();
    let Some(body) = s.strip_prefix('(') else {
        return Vec::new();
    };
    let (mut depth, mut quote, mut end) = (0i32, None::<char>, body.len());
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, ch) in body.char_indices() {
        if let Some(q) = quote {
            if ch == q {
                quote = None;
            }
            continue;
        }
        match ch {
            '\'' | '"' => quote = Some(ch),
            '(' | '[' | '{' => depth += 1,
            ']' | '}' => depth -= 1,
            ')' if depth == 0 => {
                end = i;
                break;
            }
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..end]);
    parts
        .into_iter()
        .map(|p| {
            let p = p.trim().trim_start_matches('*');
            let cut = p.find([':', '=']).unwrap_or(p.len());
            p[..cut].trim().to_string()
        })
        .filter(|p| !p.is_empty() && p != "/")
        .collect()
}

/// A call's tensor file, mapped (a dump's cache pool can be gigabytes; only the pages a call's table
/// reaches are read); `None` when the call has none.
fn read_opt(path: &Path) -> Result<Option<memmap2::Mmap>> {
    if !path.is_file() {
        return Ok(None);
    }
    let f = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    // SAFETY: a read-only mapping of a finished dump file; one changed underneath us while mapped
    // (the engine still writing the dump) is outside the contract, as for the GGUF reader.
    let m = unsafe { memmap2::Mmap::map(&f) }
        .map_err(|e| Error::io(format!("cannot map {}", path.display()), e))?;
    Ok(Some(m))
}

fn st<'b>(bytes: &'b [u8], what: &Path) -> Result<SafeTensors<'b>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| bad(format!("{}: not a safetensors file: {e}", what.display())))
}

/// One element of a float tensor's bytes, widened exactly; `None` for a dtype that is not a float of
/// 16 bits or more.
fn float_at(dtype: St, d: &[u8], i: usize) -> Option<f64> {
    Some(match dtype {
        St::BF16 => half::bf16::from_le_bytes([d[2 * i], d[2 * i + 1]]).to_f64(),
        St::F16 => half::f16::from_le_bytes([d[2 * i], d[2 * i + 1]]).to_f64(),
        St::F32 => f32::from_le_bytes(d[4 * i..4 * i + 4].try_into().ok()?) as f64,
        St::F64 => f64::from_le_bytes(d[8 * i..8 * i + 8].try_into().ok()?),
        _ => return None,
    })
}

fn dtype_name(dtype: St) -> &'static str {
    match dtype {
        St::BF16 => "bf16",
        St::F16 => "fp16",
        St::F32 => "f32",
        St::F64 => "f64",
        _ => "other",
    }
}

impl<'a> CallArgs<'a> {
    /// Read a call's tensor files; `fallback`: the parameter names when the metadata has no
    /// `function_signature`.
    pub fn read(call: &'a CallDir, fallback: &[&str]) -> Result<CallArgs<'a>> {
        if call.meta.get("tensor_format").and_then(Value::as_str) == Some("torch") {
            return Err(bad(format!(
                "{}: dumped as torch .pt files, not safetensors (set FLASHINFER_DUMP_SAFETENSORS=1 as well as FLASHINFER_LOGLEVEL=10)",
                call.name
            )));
        }
        let params = match call.meta.get("function_signature").and_then(Value::as_str) {
            Some(s) if s.starts_with('(') => signature_params(s),
            _ => fallback.iter().map(|s| s.to_string()).collect(),
        };
        Ok(CallArgs {
            call,
            params,
            inputs: read_opt(&call.path.join("inputs.safetensors"))?,
            outputs: read_opt(&call.path.join("outputs.safetensors"))?,
        })
    }

    /// The keys argument `name` may have been dumped under: `kwarg_<name>`, then `arg_<i>`.
    fn keys(&self, name: &str) -> Vec<String> {
        let mut k = vec![format!("kwarg_{name}")];
        if let Some(i) = self.params.iter().position(|p| p == name) {
            k.push(format!("arg_{i}"));
        }
        k
    }

    /// The non-tensor argument `name` (`None`: not given, so its default).
    pub fn value(&self, name: &str) -> Option<&Value> {
        let m = self.call.meta.get("input_metadata")?;
        self.keys(name).iter().find_map(|k| m.get(k))
    }

    /// The non-tensor argument `name` as a number (a float, an int, a bool as 0/1).
    pub fn number(&self, name: &str) -> Option<f64> {
        match self.value(name)? {
            Value::Bool(b) => Some(*b as u8 as f64),
            v => v.as_f64(),
        }
    }

    pub fn flag(&self, name: &str, default: bool) -> bool {
        match self.value(name) {
            Some(Value::Bool(b)) => *b,
            Some(v) => v.as_f64().map(|x| x != 0.0).unwrap_or(default),
            None => default,
        }
    }

    /// Whether the argument `name` was given (as a tensor or a non-`None` value).
    pub fn given(&self, name: &str) -> bool {
        self.value(name).is_some_and(|v| !v.is_null()) || self.has_tensor(name)
    }

    fn input_st(&self) -> Result<Option<SafeTensors<'_>>> {
        let p = self.call.path.join("inputs.safetensors");
        self.inputs.as_deref().map(|b| st(b, &p)).transpose()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        let Ok(Some(s)) = self.input_st() else {
            return false;
        };
        let names = s.names();
        self.keys(name)
            .iter()
            .any(|k| names.iter().any(|n| *n == k))
    }

    /// The dtype and shape of tensor argument `name`, if it was dumped.
    pub fn meta_of(&self, name: &str) -> Result<Option<(St, Vec<usize>)>> {
        let Some(s) = self.input_st()? else {
            return Ok(None);
        };
        Ok(self
            .keys(name)
            .iter()
            .find_map(|k| s.tensor(k).ok())
            .map(|t| (t.dtype(), t.shape().to_vec())))
    }

    fn missing(&self, name: &str) -> Error {
        bad(format!(
            "{}: {} has no tensor '{name}' in inputs.safetensors (looked for {})",
            self.call.name,
            self.call.function,
            self.keys(name).join(", ")
        ))
    }

    /// Tensor argument `name` from inputs.safetensors, under any of its keys.
    fn tensor(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        let s = self.input_st()?.ok_or_else(|| self.missing(name))?;
        self.keys(name)
            .iter()
            .find_map(|k| s.tensor(k).ok())
            .ok_or_else(|| self.missing(name))
    }

    /// Tensor argument `name`, decoded to f64 (bf16, fp16, f32, f64).
    pub fn floats(&self, name: &str) -> Result<Floats> {
        let t = self.tensor(name)?;
        self.decode(&t, name)
    }

    fn decode(&self, t: &safetensors::tensor::TensorView, name: &str) -> Result<Floats> {
        let n: usize = t.shape().iter().product();
        let d = t.data();
        let data = (0..n)
            .map(|i| float_at(t.dtype(), d, i))
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| {
                bad(format!(
                    "{}: '{name}' has dtype {:?}; values are read from BF16, F16, F32 or F64",
                    self.call.name,
                    t.dtype()
                ))
            })?;
        Ok(Floats {
            shape: t.shape().to_vec(),
            data,
            dtype: dtype_name(t.dtype()),
        })
    }

    /// Integer tensor argument `name` (I32 or I64).
    pub fn ints(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>)> {
        let t = self.tensor(name)?;
        let v = crate::capture::ints(&t)
            .map_err(|e| bad(format!("{}: '{name}' has {e}", self.call.name)))?;
        Ok((t.shape().to_vec(), v))
    }

    /// Rows of a paged cache tensor `name`, `[pages, page, width]` (or `[pages, 1, page, width]`), for
    /// the given pages only: `[pages.len() · page, width]` in f64, with the tensor's dtype.
    pub fn cache_pages(
        &self,
        name: &str,
        pages: &[usize],
    ) -> Result<(Vec<f64>, usize, usize, &'static str)> {
        let t = self.tensor(name)?;
        let sh = t.shape();
        let (n_pages, page, width) = match sh {
            [p, g, w] => (*p, *g, *w),
            [p, 1, g, w] => (*p, *g, *w),
            _ => {
                return Err(bad(format!(
                    "{}: '{name}' has shape {sh:?}; a paged cache is [pages, page_size, width] or [pages, 1, page_size, width]",
                    self.call.name
                )))
            }
        };
        if float_at(t.dtype(), &[0u8; 8], 0).is_none() {
            return Err(bad(format!(
                "{}: '{name}' has dtype {:?}; values are read from BF16, F16, F32 or F64",
                self.call.name,
                t.dtype()
            )));
        }
        let d = t.data();
        let mut out = Vec::with_capacity(pages.len() * page * width);
        for &p in pages {
            if p >= n_pages {
                return Err(bad(format!(
                    "{}: page {p} is outside '{name}', which has {n_pages} pages",
                    self.call.name
                )));
            }
            let base = p * page * width;
            out.extend(
                (base..base + page * width).map(|i| float_at(t.dtype(), d, i).unwrap_or(f64::NAN)),
            );
        }
        Ok((out, page, width, dtype_name(t.dtype())))
    }

    /// The call's returned tensors: `result` (one tensor) or `result_<i>` (a tuple).
    pub fn result(&self, i: Option<usize>) -> Result<Option<Floats>> {
        let p = self.call.path.join("outputs.safetensors");
        let Some(b) = self.outputs.as_deref() else {
            return Ok(None);
        };
        let s = st(b, &p)?;
        let key = match i {
            None => "result".to_string(),
            Some(i) => format!("result_{i}"),
        };
        match s.tensor(&key) {
            Ok(t) => self.decode(&t, &key).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// `execution_status` of the call's last metadata record.
    pub fn status(&self) -> &str {
        self.call
            .meta
            .get("execution_status")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_signatures() {
        assert_eq!(
            parse_name("20261204_151200_123_pid77_BatchMLAPagedAttentionWrapper.run_call0003"),
            Some((77, "BatchMLAPagedAttentionWrapper.run".into(), 3))
        );
        assert_eq!(parse_name("session.jsonl"), None);
        assert_eq!(
            session_key("/srv/fi/20261204_x_pid1_f_call0001"),
            "20261204_x_pid1_f_call0001"
        );
        assert_eq!(
            session_key("fi/20261204_x_pid1_f_call0001/graph_flushes/flush_0002"),
            "20261204_x_pid1_f_call0001/graph_flushes/flush_0002"
        );
        let p = signature_params(
            "(self, q_nope: torch.Tensor, out: Optional[torch.Tensor] = None, w: Tuple[int, int] = (1, 2), s: str = 'a,b)', *, ckv_scale: Optional[float] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]",
        );
        assert_eq!(p, ["self", "q_nope", "out", "w", "s", "ckv_scale"]);
    }
}
