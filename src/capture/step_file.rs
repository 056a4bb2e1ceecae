//! One step file of a capture: every tensor checked against the vocabulary, its dtype and its shape,
//! and the rows of one request put at their positions (`Capture::read` gathers them per layer).

use super::manifest::{self, LseBase, RopeOrder};
use super::Capture;
use crate::error::{Error, Result};
use crate::model::MlaConfig;
use safetensors::tensor::{Dtype as St, TensorView};
use safetensors::SafeTensors;
use std::collections::BTreeMap;

/// Per captured name, the request's rows by token (`None` until a step file holds one).
pub(super) type Rows = BTreeMap<String, Vec<Option<Vec<f64>>>>;

impl Capture {
    /// One step file: every tensor checked against the vocabulary, its dtype and its shape, and the
    /// rows of request `req` put at their positions in `out`.
    pub(super) fn read_file(
        &self,
        f: &manifest::LayerFile,
        step: &manifest::Step,
        req: &manifest::Request,
        dims: &Dims,
        out: &mut Rows,
    ) -> Result<()> {
        let bad = |m: String| self.bad(format!("{}: {m}", f.file));
        let bytes = std::fs::read(self.dir.join(&f.file))
            .map_err(|e| bad(format!("cannot read it: {e}")))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let sf = StepFile {
            cap: self,
            f,
            step,
            dims,
            st,
        };
        let names = sf.names()?;
        let slot_cache = sf.slot_cache(&names)?;
        for name in &names {
            if name == "kv_cache" {
                continue;
            }
            let v = sf.st.tensor(name).expect("listed");
            let which = sf.rows_of(name)?;
            let (out_name, width, values) = match name.as_str() {
                "slot_mapping" => {
                    let cache = slot_cache.as_ref().expect("checked together");
                    (
                        "cache_rows",
                        dims.width("cache_rows"),
                        sf.slot_mapping(&v, &which, cache)?,
                    )
                }
                "topk" => sf.topk(&v, &which)?,
                _ => (name.as_str(), dims.width(name), sf.stage(name, &v, &which)?),
            };
            sf.place(req, out, out_name, &which, &values[..], width)?;
        }
        Ok(())
    }
}

/// A step file being read: its tensors and what they are checked against.
struct StepFile<'a> {
    cap: &'a Capture,
    f: &'a manifest::LayerFile,
    step: &'a manifest::Step,
    dims: &'a Dims,
    st: SafeTensors<'a>,
}

impl StepFile<'_> {
    fn bad(&self, m: String) -> Error {
        self.cap.bad(format!("{}: {m}", self.f.file))
    }

    /// The file's tensor names (index tensors `NAME.rows` aside), sorted: each of the vocabulary, and
    /// the same as the manifest lists.
    fn names(&self) -> Result<Vec<String>> {
        let st = &self.st;
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
                return Err(self.bad(format!(
                    "unknown tensor {n:?} (stages: {})",
                    manifest::NAMES.join(", ")
                )));
            }
        }
        let mut listed = self.f.stages.clone();
        listed.sort();
        if listed != names {
            return Err(self.bad(format!(
                "holds [{}] but the manifest lists [{}]",
                names.join(", "),
                self.f.stages.join(", ")
            )));
        }
        Ok(names)
    }

    /// The step's `kv_cache` `[slots, Lkv + R]` (rope parts in the file's order) and its slot count,
    /// when the file has one; it comes with `slot_mapping`, which names each row's slot.
    fn slot_cache(&self, names: &[String]) -> Result<Option<(Vec<f64>, usize)>> {
        let dims = self.dims;
        match (
            names.contains(&"kv_cache".into()),
            names.contains(&"slot_mapping".into()),
        ) {
            (true, true) => {
                let c = self.st.tensor("kv_cache").expect("listed");
                let w = dims.width("cache_rows");
                if c.shape().len() != 2 || c.shape()[1] != w {
                    return Err(self.bad(format!(
                        "kv_cache has shape {:?}, expected [slots, {w}]",
                        c.shape()
                    )));
                }
                let mut vals = floats(&c).map_err(|e| self.bad(format!("kv_cache: {e}")))?;
                if self.cap.manifest.conventions.rope_order == RopeOrder::Halves {
                    for row in vals.chunks_exact_mut(w) {
                        to_file_order(&mut row[w - dims.rope..], dims.rope, dims.pairing);
                    }
                }
                Ok(Some((vals, c.shape()[0])))
            }
            (false, false) => Ok(None),
            _ => Err(self.bad("kv_cache and slot_mapping come together".into())),
        }
    }

    /// The step rows tensor `name`'s rows are (`NAME.rows`), or every row of the step.
    fn rows_of(&self, name: &str) -> Result<Vec<usize>> {
        let n_rows = self.step.rows.len();
        let Ok(r) = self.st.tensor(&format!("{name}.rows")) else {
            return Ok((0..n_rows).collect());
        };
        let idx = ints(&r).map_err(|e| self.bad(format!("{name}.rows: {e}")))?;
        if r.shape().len() != 1 {
            return Err(self.bad(format!(
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
                        self.bad(format!(
                            "{name}.rows holds {i}, outside the step's {n_rows} rows"
                        ))
                    })
            })
            .collect()
    }

    /// `slot_mapping`'s rows as cache rows: each row's slot of `kv_cache` (a padding row with no slot
    /// is NaN, never read).
    fn slot_mapping(
        &self,
        v: &TensorView,
        which: &[usize],
        (cache, slots): &(Vec<f64>, usize),
    ) -> Result<Vec<f64>> {
        let shape = v.shape();
        if shape != [which.len()] {
            return Err(self.bad(format!(
                "slot_mapping has shape {shape:?}, expected [{}]",
                which.len()
            )));
        }
        let w = self.dims.width("cache_rows");
        let idx = ints(v).map_err(|e| self.bad(format!("slot_mapping: {e}")))?;
        let mut vals = Vec::with_capacity(idx.len() * w);
        for (k, &s) in idx.iter().enumerate() {
            match usize::try_from(s).ok().filter(|&s| s < *slots) {
                Some(s) => vals.extend_from_slice(&cache[s * w..(s + 1) * w]),
                // Padding: never read (a request's row with no slot is caught below).
                None if self.step.rows[which[k]].is_none() => {
                    vals.extend(std::iter::repeat_n(f64::NAN, w))
                }
                None => {
                    return Err(self.bad(format!(
                        "slot_mapping row {} holds slot {s}, outside the cache's {slots}",
                        which[k]
                    )))
                }
            }
        }
        Ok(vals)
    }

    /// `topk`'s rows `[rows, k]`: each row's selected key positions (−1 for none), as floats.
    fn topk(&self, v: &TensorView, which: &[usize]) -> Result<(&'static str, usize, Vec<f64>)> {
        let shape = v.shape();
        if shape.len() != 2 || shape[0] != which.len() {
            return Err(self.bad(format!(
                "topk has shape {shape:?}, expected [{}, k]",
                which.len()
            )));
        }
        let idx = ints(v).map_err(|e| self.bad(format!("topk: {e}")))?;
        Ok((
            "topk",
            shape[1],
            idx.into_iter().map(|i| i as f64).collect(),
        ))
    }

    /// A stage tensor's rows `[rows, …row shape]` (or flat `[rows, width]`), in the canonical layout:
    /// rope parts in the file's pairing, the LSE in natural log.
    fn stage(&self, name: &str, v: &TensorView, which: &[usize]) -> Result<Vec<f64>> {
        let (conv, dims, shape) = (self.cap.manifest.conventions, self.dims, v.shape());
        let row = dims.row_shape(name);
        let w: usize = row.iter().product();
        let flat_ok = row.len() == 2 && shape.len() == 2 && shape[1] == w;
        if shape.first() != Some(&which.len()) || !(shape[1..] == row[..] || flat_ok) {
            let mut want = vec![which.len()];
            want.extend(&row);
            return Err(self.bad(format!(
                "{name} has shape {shape:?}, expected {want:?}{}",
                if row.len() == 2 {
                    format!(" or [{}, {w}]", which.len())
                } else {
                    String::new()
                }
            )));
        }
        let mut vals = floats(v).map_err(|e| self.bad(format!("{name}: {e}")))?;
        if matches!(name, "q_pe" | "k_pe") && conv.rope_order == RopeOrder::Halves {
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
        Ok(vals)
    }

    /// The rows `which` of `values` (`width` each) that are request `req`'s, at their tokens in
    /// `out[name]`: another request's rows and padding are skipped, a token held twice is an error.
    fn place(
        &self,
        req: &manifest::Request,
        out: &mut Rows,
        name: &str,
        which: &[usize],
        values: &[f64],
        width: usize,
    ) -> Result<()> {
        let (t, pos0) = (req.tokens.len(), req.positions[0]);
        let slot = out.entry(name.to_string()).or_insert_with(|| vec![None; t]);
        for (k, &r) in which.iter().enumerate() {
            let Some([rid, pos]) = self.step.rows[r] else {
                continue;
            };
            if rid != req.id {
                continue;
            }
            let i = (pos - pos0) as usize;
            if slot[i].is_some() {
                return Err(self.bad(format!(
                    "{name} of request {rid} position {pos} is captured twice (also in another step)"
                )));
            }
            slot[i] = Some(values[k * width..(k + 1) * width].to_vec());
        }
        Ok(())
    }
}

/// The per-row shapes of the capture's tensors for a model (and a TP slice of `heads` heads).
pub(super) struct Dims {
    hidden: usize,
    heads: usize,
    nope: usize,
    rope: usize,
    lkv: usize,
    v: usize,
    pairing: crate::model::RopePairing,
}

impl Dims {
    pub(super) fn new(cfg: &MlaConfig, heads: usize) -> Dims {
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
    pub(super) fn row_shape(&self, name: &str) -> Vec<usize> {
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
    pub(super) fn width(&self, name: &str) -> usize {
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
pub(super) fn floats(t: &TensorView) -> std::result::Result<Vec<f64>, String> {
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
pub(super) fn ints(t: &TensorView) -> std::result::Result<Vec<i64>, String> {
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
