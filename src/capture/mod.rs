//! Captures: the tensors a serving engine computed on a real request, per layer and forward step
//! (docs/captures.md). `manifest.rs` is the manifest; this module reads a capture's step files into
//! one request's layer traces in the canonical layout (`crate::trace`), `backend.rs` hands them to
//! `run::run` as the optimized path (`mla-diff run FILE --capture DIR`), and `write.rs` writes the
//! optimized path of a run as a capture (`run --write-capture DIR`).
//!
//! Alignment: a step file's rows are the step's batch rows (`steps[].rows`: request and position, or
//! padding); a request's trace takes, for each of its positions, the row that holds it, wherever it
//! sits in whichever step. Padding rows and other requests' rows are never read.

pub mod backend;
pub mod flashinfer;
pub mod manifest;
pub mod write;

pub use backend::CaptureBackend;
pub use manifest::{Manifest, ModelId};

use crate::error::{Error, Result};
use crate::model::MlaConfig;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage, StageSet, StageTensor};
use manifest::{LseBase, RopeOrder, StepKind};
use ndarray::Array2;
use safetensors::tensor::Dtype as St;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// An opened capture: its folder and checked manifest.
#[derive(Debug, Clone)]
pub struct Capture {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

/// One request of a capture, read: each captured layer's input and stage trace, in position order.
#[derive(Debug, Clone)]
pub struct Captured {
    pub request: u64,
    /// The schedule the engine ran it on, as far as the comparison needs: prompt (prefill) tokens,
    /// the largest prefill chunk, one decode token per step, the first position.
    pub sched: Schedule,
    /// `x` per layer: `[T, hidden]`.
    pub inputs: BTreeMap<usize, Array2<f64>>,
    pub traces: BTreeMap<usize, LayerTrace>,
    /// The stages every layer has (`x` aside).
    pub provided: StageSet,
    /// Names captured but not compared (none now: `topk` is the DSA selection, checked by the run).
    pub uncompared: Vec<String>,
    /// DSA: per layer, each token's selected keys (0-based token indices of the request), from `topk`.
    pub topk: BTreeMap<usize, Vec<Vec<u32>>>,
    /// Per token of the request: the step that computed it and its position.
    pub origin: Vec<(u64, u64)>,
    /// The engine's head count in this capture (its TP slice) and the slice.
    pub heads: std::ops::Range<usize>,
}

fn stage_of(name: &str) -> Option<Stage> {
    Stage::from_name(name).filter(|s| {
        !matches!(
            s,
            // Internal to a split-KV kernel: not in the capture vocabulary.
            Stage::SplitOut | Stage::SplitLse
        )
    })
}

impl Capture {
    pub fn open(dir: &Path) -> Result<Capture> {
        Ok(Capture {
            dir: dir.to_path_buf(),
            manifest: Manifest::read(dir)?,
        })
    }

    fn bad(&self, m: impl std::fmt::Display) -> Error {
        Error::Usage(format!("capture {}: {m}", self.dir.display()))
    }

    /// The request a run compares: `id`, or the only one.
    pub fn request(&self, id: Option<u64>) -> Result<&manifest::Request> {
        let reqs = &self.manifest.requests;
        match id {
            Some(id) => reqs.iter().find(|r| r.id == id).ok_or_else(|| {
                self.bad(format!(
                    "no request {id} (requests: {})",
                    reqs.iter()
                        .map(|r| r.id.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }),
            None if reqs.len() == 1 => Ok(&reqs[0]),
            None => Err(self.bad(format!(
                "{} requests in one capture: choose one with --capture-request (ids {})",
                reqs.len(),
                reqs.iter()
                    .map(|r| r.id.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// The layers the capture has files for.
    pub fn layers(&self) -> Vec<usize> {
        let mut l: Vec<usize> = self.manifest.layers.iter().map(|f| f.layer).collect();
        l.sort_unstable();
        l.dedup();
        l
    }

    /// Request `id`'s layer inputs and traces for `layers`, in the canonical layout of `cfg`.
    pub fn read(&self, cfg: &MlaConfig, id: Option<u64>, layers: &[usize]) -> Result<Captured> {
        let m = &self.manifest;
        let req = self.request(id)?;
        let heads = match m.tp.heads {
            None if m.tp.world_size == 1 => 0..cfg.n_head,
            None => {
                return Err(self.bad(format!(
                    "tp.world_size {} without tp.heads: say which heads rank {} computed",
                    m.tp.world_size, m.tp.rank
                )))
            }
            Some([a, b]) if b <= cfg.n_head => a..b,
            Some([_, b]) => {
                return Err(self.bad(format!(
                    "tp.heads ends at {b} but the model has {} heads",
                    cfg.n_head
                )))
            }
        };
        let t = req.tokens.len();
        let pos0 = req.positions[0];
        let sched = self.schedule(req)?;
        let dims = Dims::new(cfg, heads.len());
        let have = self.layers();
        let mut inputs = BTreeMap::new();
        let mut traces = BTreeMap::new();
        let mut provided: Option<(usize, StageSet)> = None;
        let uncompared = Vec::new();
        let mut topk = BTreeMap::new();
        let mut origin = vec![(0, 0); t];
        for s in &m.steps {
            for [rid, pos] in s.rows.iter().flatten() {
                if *rid == req.id && *pos >= pos0 && ((*pos - pos0) as usize) < t {
                    origin[(*pos - pos0) as usize] = (s.step, *pos);
                }
            }
        }
        for &l in layers {
            if !have.contains(&l) {
                return Err(self.bad(format!(
                    "no files for layer {l} (captured layers: {}); choose them with --layers",
                    crate::report::layer_list(&have)
                )));
            }
            // name → per-token rows of the request
            let mut rows: BTreeMap<String, Vec<Option<Vec<f64>>>> = BTreeMap::new();
            for f in m.layers.iter().filter(|f| f.layer == l) {
                let step = m.steps.iter().find(|s| s.step == f.step).expect("checked");
                self.read_file(f, step, req, &dims, &mut rows)?;
            }
            let mut trace = LayerTrace::new(l);
            trace.storage = m.storage();
            let mut set = StageSet::NONE;
            for (name, per_tok) in rows {
                if name == "topk" {
                    topk.insert(l, self.selection_of(l, req, &per_tok)?);
                    continue;
                }
                let decode_only = matches!(name.as_str(), "q_absorbed" | "attn_latent");
                let range = if decode_only { req.prefill..t } else { 0..t };
                if range.is_empty() {
                    continue;
                }
                let width = dims.width(&name);
                let mut data = Vec::with_capacity(range.len() * width);
                for i in range.clone() {
                    match &per_tok[i] {
                        Some(v) => data.extend_from_slice(v),
                        None => {
                            return Err(self.bad(format!(
                                "layer {l}: {name} has no row for request {} position {} (every {} token of the request needs one)",
                                req.id,
                                pos0 + i as u64,
                                if decode_only { "decode" } else { "" }
                            ).replace("every  token", "every token")))
                        }
                    }
                }
                let mut shape = vec![range.len()];
                shape.extend(dims.row_shape(&name));
                if name == "x" {
                    inputs.insert(
                        l,
                        Array2::from_shape_vec((t, cfg.hidden), data).expect("[T, hidden]"),
                    );
                    continue;
                }
                let stage = stage_of(&name).expect("a stage name");
                set = set.with(stage);
                trace.push(StageTensor::new(stage, shape, data));
            }
            if !inputs.contains_key(&l) {
                return Err(self.bad(format!(
                    "layer {l} has no x (the layer input before attn_norm): the fp64 reference starts from it"
                )));
            }
            match provided {
                None => provided = Some((l, set)),
                Some((l0, s0)) if s0 != set => {
                    let names = |s: StageSet| {
                        Stage::ALL
                            .iter()
                            .filter(|&&st| s.contains(st))
                            .map(|st| st.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    return Err(self.bad(format!(
                        "layer {l} has the stages [{}] but layer {l0} has [{}]: capture the same stages in every layer, or choose layers with --layers",
                        names(set),
                        names(s0)
                    )));
                }
                _ => {}
            }
            traces.insert(l, trace);
        }
        Ok(Captured {
            request: req.id,
            sched,
            inputs,
            traces,
            provided: provided.map_or(StageSet::NONE, |p| p.1),
            uncompared,
            topk,
            origin,
            heads,
        })
    }

    /// A layer's captured `topk` rows (key positions, −1 for none) as each token's selected keys:
    /// every token needs a row, and a key must be a position of the request at or before the query's.
    fn selection_of(
        &self,
        l: usize,
        req: &manifest::Request,
        rows: &[Option<Vec<f64>>],
    ) -> Result<Vec<Vec<u32>>> {
        let pos0 = req.positions[0];
        rows.iter()
            .enumerate()
            .map(|(i, r)| {
                let pos = pos0 + i as u64;
                let r = r.as_ref().ok_or_else(|| {
                    self.bad(format!(
                        "layer {l}: topk has no row for request {} position {pos} (every token of the request needs one)",
                        req.id
                    ))
                })?;
                r.iter()
                    .filter(|&&k| k >= 0.0)
                    .map(|&k| {
                        let k = k as u64;
                        if k < pos0 || k > pos {
                            return Err(self.bad(format!(
                                "layer {l}: topk of request {} position {pos} selects position {k}, outside the request's {pos0}..={pos}",
                                req.id
                            )));
                        }
                        Ok((k - pos0) as u32)
                    })
                    .collect()
            })
            .collect()
    }

    /// The schedule of request `req` as the engine ran it.
    pub fn schedule(&self, req: &manifest::Request) -> Result<Schedule> {
        let m = &self.manifest;
        let prefill_pos = req.positions[0] + req.prefill as u64;
        // The largest number of the request's prompt tokens one step processed: the engine's chunk.
        let chunk = m
            .steps
            .iter()
            .map(|s| {
                s.rows
                    .iter()
                    .flatten()
                    .filter(|r| r[0] == req.id && r[1] < prefill_pos)
                    .count()
            })
            .max()
            .unwrap_or(0);
        let t = req.tokens.len();
        let sched = Schedule {
            prompt_len: req.prefill,
            chunk: chunk.max(1),
            decode_steps: t - req.prefill,
            q_len: 1,
            pos_offset: usize::try_from(req.positions[0])
                .map_err(|_| self.bad("positions out of range"))?,
            ..Schedule::default()
        };
        sched.validate().map_err(|e| self.bad(e))?;
        Ok(sched)
    }

    /// One step file: every tensor checked against the vocabulary, its dtype and its shape, and the
    /// rows of request `req` put at their positions in `out`.
    fn read_file(
        &self,
        f: &manifest::LayerFile,
        step: &manifest::Step,
        req: &manifest::Request,
        dims: &Dims,
        out: &mut BTreeMap<String, Vec<Option<Vec<f64>>>>,
    ) -> Result<()> {
        let conv = self.manifest.conventions;
        let path = self.dir.join(&f.file);
        let bad = |m: String| self.bad(format!("{}: {m}", f.file));
        let bytes = std::fs::read(&path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let mut names: Vec<String> = st
            .names()
            .into_iter()
            .filter(|n| !n.ends_with(".rows"))
            .map(String::from)
            .collect();
        names.sort();
        for n in st.names() {
            let base = n.strip_suffix(".rows").unwrap_or(n);
            if !manifest::NAMES.contains(&base) {
                return Err(bad(format!(
                    "unknown tensor {n:?} (stages: {})",
                    manifest::NAMES.join(", ")
                )));
            }
        }
        let mut listed = f.stages.clone();
        listed.sort();
        if listed != names {
            return Err(bad(format!(
                "holds [{}] but the manifest lists [{}]",
                names.join(", "),
                f.stages.join(", ")
            )));
        }
        let n_rows = step.rows.len();
        let t = req.tokens.len();
        let pos0 = req.positions[0];
        let slot_cache = match (
            names.contains(&"kv_cache".into()),
            names.contains(&"slot_mapping".into()),
        ) {
            (true, true) => {
                let c = st.tensor("kv_cache").expect("listed");
                let w = dims.width("cache_rows");
                if c.shape().len() != 2 || c.shape()[1] != w {
                    return Err(bad(format!(
                        "kv_cache has shape {:?}, expected [slots, {w}]",
                        c.shape()
                    )));
                }
                let mut vals = floats(&c).map_err(|e| bad(format!("kv_cache: {e}")))?;
                if conv.rope_order == RopeOrder::Halves {
                    for row in vals.chunks_exact_mut(w) {
                        to_file_order(&mut row[w - dims.rope..], dims.rope, dims.pairing);
                    }
                }
                Some((vals, c.shape()[0]))
            }
            (false, false) => None,
            _ => return Err(bad("kv_cache and slot_mapping come together".into())),
        };
        for name in &names {
            if name == "kv_cache" {
                continue;
            }
            let v = st.tensor(name).expect("listed");
            let which: Vec<usize> = match st.tensor(&format!("{name}.rows")) {
                Ok(r) => {
                    let idx = ints(&r).map_err(|e| bad(format!("{name}.rows: {e}")))?;
                    if r.shape().len() != 1 {
                        return Err(bad(format!(
                            "{name}.rows must be 1-D, has shape {:?}",
                            r.shape()
                        )));
                    }
                    idx.into_iter()
                        .map(|i| {
                            usize::try_from(i)
                                .ok()
                                .filter(|&i| i < n_rows)
                                .ok_or_else(|| {
                                    bad(format!(
                                        "{name}.rows holds {i}, outside the step's {n_rows} rows"
                                    ))
                                })
                        })
                        .collect::<Result<_>>()?
                }
                Err(_) => (0..n_rows).collect(),
            };
            let shape = v.shape();
            let (out_name, width, values): (&str, usize, Vec<f64>) = if name == "slot_mapping" {
                let (cache, slots) = slot_cache.as_ref().expect("checked together");
                if shape != [which.len()] {
                    return Err(bad(format!(
                        "slot_mapping has shape {shape:?}, expected [{}]",
                        which.len()
                    )));
                }
                let w = dims.width("cache_rows");
                let idx = ints(&v).map_err(|e| bad(format!("slot_mapping: {e}")))?;
                let mut vals = Vec::with_capacity(idx.len() * w);
                for (k, &s) in idx.iter().enumerate() {
                    match usize::try_from(s).ok().filter(|&s| s < *slots) {
                        Some(s) => vals.extend_from_slice(&cache[s * w..(s + 1) * w]),
                        // Padding: never read (a request's row with no slot is caught below).
                        None if step.rows[which[k]].is_none() => {
                            vals.extend(std::iter::repeat_n(f64::NAN, w))
                        }
                        None => {
                            return Err(bad(format!(
                                "slot_mapping row {} holds slot {s}, outside the cache's {slots}",
                                which[k]
                            )))
                        }
                    }
                }
                ("cache_rows", w, vals)
            } else if name == "topk" {
                if shape.len() != 2 || shape[0] != which.len() {
                    return Err(bad(format!(
                        "topk has shape {shape:?}, expected [{}, k]",
                        which.len()
                    )));
                }
                let idx = ints(&v).map_err(|e| bad(format!("topk: {e}")))?;
                (
                    "topk",
                    shape[1],
                    idx.into_iter().map(|i| i as f64).collect(),
                )
            } else {
                let row = dims.row_shape(name);
                let w: usize = row.iter().product();
                let flat_ok = row.len() == 2 && shape.len() == 2 && shape[1] == w;
                if shape.first() != Some(&which.len()) || !(shape[1..] == row[..] || flat_ok) {
                    let mut want = vec![which.len()];
                    want.extend(&row);
                    return Err(bad(format!(
                        "{name} has shape {shape:?}, expected {want:?}{}",
                        if row.len() == 2 {
                            format!(" or [{}, {w}]", which.len())
                        } else {
                            String::new()
                        }
                    )));
                }
                let mut vals = floats(&v).map_err(|e| bad(format!("{name}: {e}")))?;
                if matches!(name.as_str(), "q_pe" | "k_pe") && conv.rope_order == RopeOrder::Halves
                {
                    to_file_order(&mut vals, dims.rope, dims.pairing);
                }
                // A cache row's k_pe is the same roped key, in the same order as `k_pe`.
                if name == "cache_rows" && conv.rope_order == RopeOrder::Halves {
                    for row in vals.chunks_exact_mut(w) {
                        to_file_order(&mut row[w - dims.rope..], dims.rope, dims.pairing);
                    }
                }
                if name == "lse" && conv.lse_base == LseBase::Two {
                    vals.iter_mut().for_each(|v| *v *= std::f64::consts::LN_2);
                }
                (name.as_str(), w, vals)
            };
            let slot = out
                .entry(out_name.to_string())
                .or_insert_with(|| vec![None; t]);
            for (k, &r) in which.iter().enumerate() {
                let Some([rid, pos]) = step.rows[r] else {
                    continue;
                };
                if rid != req.id {
                    continue;
                }
                let i = (pos - pos0) as usize;
                if slot[i].is_some() {
                    return Err(bad(format!(
                        "{out_name} of request {rid} position {pos} is captured twice (also in another step)"
                    )));
                }
                slot[i] = Some(values[k * width..(k + 1) * width].to_vec());
            }
        }
        let _ = StepKind::Mixed;
        Ok(())
    }
}

/// The per-row shapes of the capture's tensors for a model (and a TP slice of `heads` heads).
struct Dims {
    hidden: usize,
    heads: usize,
    nope: usize,
    rope: usize,
    lkv: usize,
    v: usize,
    pairing: crate::model::RopePairing,
}

impl Dims {
    fn new(cfg: &MlaConfig, heads: usize) -> Dims {
        Dims {
            hidden: cfg.hidden,
            heads,
            nope: cfg.qk_nope,
            rope: cfg.qk_rope,
            lkv: cfg.kv_lora_rank,
            v: cfg.v_head_dim,
            pairing: cfg.rope.pairing,
        }
    }
    fn row_shape(&self, name: &str) -> Vec<usize> {
        let h = self.heads;
        match name {
            "x" | "attn_in" | "attn_out" => vec![self.hidden],
            "q_nope" => vec![h, self.nope],
            "q_pe" => vec![h, self.rope],
            "kv_latent" => vec![self.lkv],
            "k_pe" => vec![self.rope],
            "cache_rows" => vec![self.lkv + self.rope],
            "q_absorbed" | "attn_latent" => vec![h, self.lkv],
            "lse" => vec![h],
            "attn_heads" => vec![h, self.v],
            other => unreachable!("no row shape for {other}"),
        }
    }
    fn width(&self, name: &str) -> usize {
        if name == "topk" {
            return 0;
        }
        self.row_shape(name).iter().product()
    }
}

/// `[even…, odd…]` rope dims (per row of `r`) back to the file's pairing: for NORM pairs `(2i, 2i+1)`
/// the halves interleave; NEOX's pairs `(i, i+R/2)` already are halves.
fn to_file_order(v: &mut [f64], r: usize, pairing: crate::model::RopePairing) {
    if pairing == crate::model::RopePairing::Neox || r < 2 {
        return;
    }
    let mut tmp = vec![0.0; r];
    for row in v.chunks_exact_mut(r) {
        for i in 0..r / 2 {
            tmp[2 * i] = row[i];
            tmp[2 * i + 1] = row[r / 2 + i];
        }
        row.copy_from_slice(&tmp);
    }
}

/// A float tensor's values, widened exactly.
fn floats(t: &safetensors::tensor::TensorView) -> std::result::Result<Vec<f64>, String> {
    let d = t.data();
    Ok(match t.dtype() {
        St::BF16 => d
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        St::F16 => d
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        St::F32 => d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64)
            .collect(),
        St::F64 => d
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        other => return Err(format!("dtype {other:?}; values are BF16, F16, F32 or F64")),
    })
}

/// An index tensor's values.
fn ints(t: &safetensors::tensor::TensorView) -> std::result::Result<Vec<i64>, String> {
    let d = t.data();
    Ok(match t.dtype() {
        St::I32 => d
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
            .collect(),
        St::I64 => d
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        other => return Err(format!("dtype {other:?}; indices are I32 or I64")),
    })
}
