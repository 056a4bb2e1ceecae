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
mod step_file;
pub mod write;

pub use backend::CaptureBackend;
pub use manifest::{Manifest, ModelId};

use crate::error::{Error, Result};
use crate::model::MlaConfig;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage, StageSet, StageTensor};
use ndarray::Array2;
use std::collections::BTreeMap;
use step_file::{Dims, Rows};
// The index decoding the FlashInfer dump reader shares (`flashinfer::dump`).
use std::path::{Path, PathBuf};
use step_file::ints;

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
        let req = self.request(id)?;
        let heads = self.heads(cfg)?;
        let sched = self.schedule(req)?;
        let dims = Dims::new(cfg, heads.len());
        let mut c = Captured {
            request: req.id,
            sched,
            inputs: BTreeMap::new(),
            traces: BTreeMap::new(),
            provided: StageSet::NONE,
            uncompared: Vec::new(),
            topk: BTreeMap::new(),
            origin: self.origin(req),
            heads,
        };
        // The first layer's stages, which every other layer must have too.
        let mut first: Option<(usize, StageSet)> = None;
        for &l in layers {
            let set = self.read_layer(cfg, req, &dims, l, &mut c)?;
            match first {
                None => first = Some((l, set)),
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
        }
        c.provided = first.map_or(StageSet::NONE, |p| p.1);
        Ok(c)
    }

    /// The heads this capture's rank computed: all of them without TP, else `tp.heads`.
    fn heads(&self, cfg: &MlaConfig) -> Result<std::ops::Range<usize>> {
        let m = &self.manifest;
        match m.tp.heads {
            None if m.tp.world_size == 1 => Ok(0..cfg.n_head),
            None => Err(self.bad(format!(
                "tp.world_size {} without tp.heads: say which heads rank {} computed",
                m.tp.world_size, m.tp.rank
            ))),
            Some([a, b]) if b <= cfg.n_head => Ok(a..b),
            Some([_, b]) => Err(self.bad(format!(
                "tp.heads ends at {b} but the model has {} heads",
                cfg.n_head
            ))),
        }
    }

    /// Per token of request `req`: the step that computed it and its position.
    fn origin(&self, req: &manifest::Request) -> Vec<(u64, u64)> {
        let (t, pos0) = (req.tokens.len(), req.positions[0]);
        let mut origin = vec![(0, 0); t];
        for s in &self.manifest.steps {
            for [rid, pos] in s.rows.iter().flatten() {
                if *rid == req.id && *pos >= pos0 && ((*pos - pos0) as usize) < t {
                    origin[(*pos - pos0) as usize] = (s.step, *pos);
                }
            }
        }
        origin
    }

    /// Layer `l` of request `req` from its step files into `c`: its input `x`, its trace, its `topk`
    /// selection. Returns the stages it has.
    fn read_layer(
        &self,
        cfg: &MlaConfig,
        req: &manifest::Request,
        dims: &Dims,
        l: usize,
        c: &mut Captured,
    ) -> Result<StageSet> {
        let m = &self.manifest;
        let have = self.layers();
        if !have.contains(&l) {
            return Err(self.bad(format!(
                "no files for layer {l} (captured layers: {}); choose them with --layers",
                crate::report::layer_list(&have)
            )));
        }
        let mut rows = Rows::new();
        for f in m.layers.iter().filter(|f| f.layer == l) {
            let step = m.steps.iter().find(|s| s.step == f.step).expect("checked");
            self.read_file(f, step, req, dims, &mut rows)?;
        }
        let mut trace = LayerTrace::new(l);
        trace.storage = m.storage();
        let mut set = StageSet::NONE;
        for (name, per_tok) in rows {
            if name == "topk" {
                c.topk.insert(l, self.selection_of(l, req, &per_tok)?);
                continue;
            }
            let Some((shape, data)) = self.tokens_of(l, req, dims, &name, &per_tok)? else {
                continue;
            };
            if name == "x" {
                let t = req.tokens.len();
                c.inputs.insert(
                    l,
                    Array2::from_shape_vec((t, cfg.hidden), data).expect("[T, hidden]"),
                );
                continue;
            }
            let stage = stage_of(&name).expect("a stage name");
            set = set.with(stage);
            trace.push(StageTensor::new(stage, shape, data));
        }
        if !c.inputs.contains_key(&l) {
            return Err(self.bad(format!(
                "layer {l} has no x (the layer input before attn_norm): the fp64 reference starts from it"
            )));
        }
        c.traces.insert(l, trace);
        Ok(set)
    }

    /// Name `name`'s rows over the tokens it has (the decode tokens for `q_absorbed` and
    /// `attn_latent`, else all), with its shape: every one of them needs a row. `None`: no such token.
    fn tokens_of(
        &self,
        l: usize,
        req: &manifest::Request,
        dims: &Dims,
        name: &str,
        per_tok: &[Option<Vec<f64>>],
    ) -> Result<Option<(Vec<usize>, Vec<f64>)>> {
        let (t, pos0) = (req.tokens.len(), req.positions[0]);
        let decode_only = matches!(name, "q_absorbed" | "attn_latent");
        let range = if decode_only { req.prefill..t } else { 0..t };
        if range.is_empty() {
            return Ok(None);
        }
        let width = dims.width(name);
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
        shape.extend(dims.row_shape(name));
        Ok(Some((shape, data)))
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
}
