//! `run --write-capture DIR`: the run's optimized path written as a capture (docs/captures.md), one
//! step file per layer and schedule step (each prefill chunk, each decode step), with the layer input
//! it was given as `x`. A capture whose every value is known — and, with `--inject`, wrong in a known
//! layer and stage — for testing `run --capture` and the tools that read captures.

use super::manifest::{self, Manifest};
use crate::backend::{Backend, Judging, LayerCtx};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::precision::Dtype;
use crate::schedule::Schedule;
use crate::trace::{LayerTrace, Stage, StageSet};
use ndarray::Array2;
use safetensors::tensor::{Dtype as St, TensorView};
use std::path::{Path, PathBuf};

/// Wraps the optimized path: each layer's first run (shadow mode's, or free mode's without shadow) is
/// written as it passes. Under `run --tp N` it wraps the path each rank runs on: a layer's first N
/// calls are ranks 0..N, each written as its own capture, `DIR/rank{r}` (its heads, its partial
/// attn_out), as N engine processes would write them.
pub struct WriteCapture<'a> {
    inner: &'a mut dyn Backend,
    dir: PathBuf,
    model: manifest::ModelId,
    dtype: Dtype,
    sched: Schedule,
    tp: usize,
    /// Per rank: the files written.
    files: Vec<Vec<manifest::LayerFile>>,
    /// Per layer: the calls seen.
    calls: std::collections::BTreeMap<usize, usize>,
    /// Heads per rank (from the first call of each rank).
    heads: Vec<Option<[usize; 2]>>,
}

impl<'a> WriteCapture<'a> {
    /// Check that `dir` can take a capture (absent, or an empty folder) and make it.
    pub fn new(
        inner: &'a mut dyn Backend,
        dir: &Path,
        file: &GgufFile,
        dtype: Dtype,
        sched: &Schedule,
        tp: usize,
    ) -> Result<WriteCapture<'a>> {
        let bad = |m: String| Error::Usage(format!("--write-capture {}: {m}", dir.display()));
        if let Ok(mut rd) = std::fs::read_dir(dir) {
            if rd.next().is_some() {
                return Err(bad("exists and is not empty".into()));
            }
        } else if dir.exists() {
            return Err(bad("exists and is not a folder".into()));
        }
        std::fs::create_dir_all(dir).map_err(|e| bad(format!("cannot create it: {e}")))?;
        Ok(WriteCapture {
            inner,
            dir: dir.to_path_buf(),
            model: Manifest::identity_of(file),
            dtype,
            sched: sched.clone(),
            tp,
            files: vec![Vec::new(); tp],
            calls: Default::default(),
            heads: vec![None; tp],
        })
    }

    /// The schedule's steps: `(positions, kind)` per prefill chunk and decode step, 0-based token
    /// indices.
    fn steps(&self) -> Vec<(std::ops::Range<usize>, manifest::StepKind)> {
        let s = &self.sched;
        let mut v = Vec::new();
        let mut p = 0;
        while p < s.prompt_len {
            let e = (p + s.chunk).min(s.prompt_len);
            v.push((p..e, manifest::StepKind::Prefill));
            p = e;
        }
        for d in 0..s.decode_steps {
            let a = s.prompt_len + d * s.q_len;
            v.push((a..a + s.q_len, manifest::StepKind::Decode));
        }
        v
    }

    /// The folder of rank `rank`'s capture.
    fn rank_dir(&self, rank: usize) -> PathBuf {
        match self.tp {
            1 => self.dir.clone(),
            _ => self.dir.join(format!("rank{rank}")),
        }
    }

    fn write_layer(
        &mut self,
        rank: usize,
        layer: usize,
        x: &Array2<f64>,
        trace: &LayerTrace,
        selection: Option<&crate::reference::sparse::Selection>,
    ) -> Result<()> {
        let io = |p: &Path, e: String| {
            Error::Environment(format!("--write-capture: writing {}: {e}", p.display()))
        };
        let dir = self.rank_dir(rank);
        let sub = dir.join(format!("layer{layer}"));
        std::fs::create_dir_all(&sub).map_err(|e| io(&sub, e.to_string()))?;
        let pl = self.sched.prompt_len;
        for (step, (toks, kind)) in self.steps().into_iter().enumerate() {
            let mut named: Vec<(String, Vec<usize>, Vec<u8>, St)> = Vec::new();
            let mut put = |name: &str, shape: &[usize], vals: &[f64]| {
                let mut s = vec![toks.len()];
                s.extend_from_slice(&shape[1..]);
                let bytes = vals
                    .iter()
                    .flat_map(|&v| (v as f32).to_le_bytes())
                    .collect();
                named.push((name.to_string(), s, bytes, St::F32));
            };
            let w = x.ncols();
            let xs = x.as_slice().expect("standard layout");
            put("x", &[0, w], &xs[toks.start * w..toks.end * w]);
            for t in &trace.stages {
                if matches!(t.stage, Stage::SplitOut | Stage::SplitLse) {
                    continue;
                }
                let decode_only = t.stage.axes()[0] == "decode_token";
                let rows = if decode_only {
                    if kind != manifest::StepKind::Decode {
                        continue;
                    }
                    toks.start - pl..toks.end - pl
                } else {
                    toks.clone()
                };
                let per: usize = t.shape[1..].iter().product();
                put(
                    t.stage.name(),
                    &t.shape,
                    &t.data[rows.start * per..rows.end * per],
                );
            }
            // DSA: the keys the path attended over, as positions, −1 past a query's own count.
            if let Some(sel) = selection {
                let k = sel.keys[toks.clone()]
                    .iter()
                    .map(Vec::len)
                    .max()
                    .unwrap_or(0)
                    .max(1);
                let pos0 = self.sched.pos_offset as i32;
                let mut bytes = Vec::with_capacity(toks.len() * k * 4);
                for keys in &sel.keys[toks.clone()] {
                    for j in 0..k {
                        let v = keys.get(j).map_or(-1, |&key| pos0 + key as i32);
                        bytes.extend_from_slice(&v.to_le_bytes());
                    }
                }
                named.push(("topk".into(), vec![toks.len(), k], bytes, St::I32));
            }
            let rel = format!("layer{layer}/step{step}.safetensors");
            let views = named
                .iter()
                .map(|(n, s, b, d)| {
                    TensorView::new(*d, s.clone(), b)
                        .map(|v| (n.clone(), v))
                        .map_err(|e| io(&dir.join(&rel), e.to_string()))
                })
                .collect::<Result<Vec<_>>>()?;
            let path = dir.join(&rel);
            safetensors::tensor::serialize_to_file(views, None, &path)
                .map_err(|e| io(&path, e.to_string()))?;
            let mut stages: Vec<String> = named.iter().map(|(n, _, _, _)| n.clone()).collect();
            stages.sort_by_key(|n| manifest::NAMES.iter().position(|m| m == n));
            self.files[rank].push(manifest::LayerFile {
                layer,
                step: step as u64,
                file: rel,
                stages,
            });
        }
        Ok(())
    }

    /// Write each capture's `manifest.json` (last: a folder with a manifest is a complete capture);
    /// the folders. `tokens`: the run's token ids when it had them.
    pub fn finish(self, tokens: Option<&[u32]>, detail: String) -> Result<Vec<PathBuf>> {
        let mut dirs = Vec::new();
        for rank in 0..self.tp {
            dirs.push(self.finish_rank(rank, tokens, &detail)?);
        }
        Ok(dirs)
    }

    fn finish_rank(&self, rank: usize, tokens: Option<&[u32]>, detail: &str) -> Result<PathBuf> {
        let t = self.sched.total_tokens();
        let pos0 = self.sched.pos_offset as u64;
        let positions: Vec<u64> = (0..t as u64).map(|i| pos0 + i).collect();
        let steps = self
            .steps()
            .into_iter()
            .enumerate()
            .map(|(i, (toks, kind))| manifest::Step {
                step: i as u64,
                kind,
                rows: toks.map(|p| Some([0, pos0 + p as u64])).collect(),
            })
            .collect();
        let m = Manifest {
            format: manifest::FORMAT.into(),
            version: manifest::VERSION,
            writer: Some(manifest::Writer {
                name: "mla-diff".into(),
                version: env!("CARGO_PKG_VERSION").into(),
            }),
            engine: manifest::Engine {
                name: "mla-diff".into(),
                version: Some(env!("CARGO_PKG_VERSION").into()),
                detail: Some(detail.to_string()),
            },
            model: self.model.clone(),
            dtype: self.dtype,
            stage_dtypes: Default::default(),
            conventions: Default::default(),
            tp: manifest::Tp {
                rank,
                world_size: self.tp,
                heads: if self.tp == 1 { None } else { self.heads[rank] },
            },
            requests: vec![manifest::Request {
                id: 0,
                // Random or .npy inputs have no token ids: zeros stand in (the comparison reads `x`).
                tokens: match tokens {
                    Some(ids) => ids.iter().map(|&i| i as u64).collect(),
                    None => vec![0; t],
                },
                positions,
                prefill: self.sched.prompt_len,
            }],
            steps,
            layers: self.files[rank].clone(),
            names: Default::default(),
        };
        let dir = self.rank_dir(rank);
        let path = dir.join(manifest::MANIFEST);
        std::fs::write(&path, m.to_json()).map_err(|e| {
            Error::Environment(format!("--write-capture: writing {}: {e}", path.display()))
        })?;
        Ok(dir)
    }
}

impl Backend for WriteCapture<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn device(&self) -> Option<String> {
        self.inner.device()
    }
    fn provides(&self) -> StageSet {
        self.inner.provides()
    }
    fn run_layer(&mut self, ctx: &LayerCtx, x: &Array2<f64>) -> Result<LayerTrace> {
        let trace = self.inner.run_layer(ctx, x)?;
        let calls = self.calls.entry(ctx.layer).or_insert(0);
        let rank = *calls;
        *calls += 1;
        if rank < self.tp {
            // A rank's config holds its heads only (`tp::slice::rank_config`); ranks are even slices.
            let per = ctx.cfg.n_head;
            self.heads[rank] = Some([per * rank, per * (rank + 1)]);
            self.write_layer(rank, ctx.layer, x, &trace, ctx.selection)?;
        }
        Ok(trace)
    }
    fn judging(&self) -> Judging {
        self.inner.judging()
    }
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &crate::model::IndexerConfig,
        iw: &crate::model::IndexerWeights,
        x: &Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        self.inner.indexer(ctx, ic, iw, x, keys)
    }
    fn kpool_indexer(
        &mut self,
        ctx: &LayerCtx,
        k: &crate::model::KpoolIndexer,
        kw: &crate::model::KpoolLayer,
        x: &Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        self.inner.kpool_indexer(ctx, k, kw, x, keys)
    }
    fn notices(&self) -> Vec<String> {
        self.inner.notices()
    }
    fn kernels(&self, cfg: &MlaConfig, sched: &Schedule) -> Vec<crate::kernel_use::KernelUse> {
        self.inner.kernels(cfg, sched)
    }
}
