//! The probe requests: a `Prober` sends tiny synthetic requests through the runner protocol at the
//! model's dims, and an `Answer` holds what came back.

use super::{unit, A};
use crate::backend::runner::keep_io;
use crate::backend::runner::protocol::{self, Describe, Outcome, Process};
use crate::backend::runner::tensors::{floats, ints, Named, Outputs};
use crate::error::Result;
use crate::lint::Findings;
use crate::model::MlaConfig;
use crate::precision::Dtype;

/// One probe request's answer: the value output and the LSE per head, as returned.
pub(super) struct Answer {
    pub(super) out: Vec<f64>,
    pub(super) out_dtype: &'static str,
    pub(super) lse: Vec<f64>,
    pub(super) lse_dtype: &'static str,
    /// The other outputs (the split partials).
    pub(super) rest: Outputs,
}

impl Answer {
    pub(super) fn u_lse(&self) -> f64 {
        unit(self.lse_dtype)
    }
    pub(super) fn u_out(&self) -> f64 {
        unit(self.out_dtype)
    }
    pub(super) fn mean_lse(&self) -> f64 {
        self.lse.iter().sum::<f64>() / self.lse.len() as f64
    }
    /// The largest |out − want| relative to max(|want|), NaN if anything is not finite.
    pub(super) fn out_err(&self, want: &[f64]) -> f64 {
        let scale = want
            .iter()
            .fold(0.0f64, |m, w| m.max(w.abs()))
            .max(f64::MIN_POSITIVE);
        let mut e = 0.0f64;
        for (o, w) in self.out.iter().zip(want) {
            if !o.is_finite() {
                return f64::NAN;
            }
            e = e.max((o - w).abs() / scale);
        }
        e
    }
}

/// The decode inputs of one probe: per-head query (the same for every head), token rows and where
/// each logical page lives.
pub(super) struct DecodeCase {
    pub(super) q_nope: Vec<f32>,
    pub(super) q_pe: Vec<f32>,
    pub(super) rows: Vec<Vec<f32>>,
    /// Logical page → physical page.
    pub(super) table: Vec<usize>,
    /// Pages in the pool; those no table entry names are NaN.
    pub(super) pool: usize,
}

pub(super) struct Prober<'a> {
    pub(super) proc: Process,
    pub(super) desc: &'a Describe,
    pub(super) cfg: &'a MlaConfig,
    pub(super) dt: Dtype,
    pub(super) page: usize,
    /// What the cache holds outside the probe's tokens: NaN, or 0 to tell a NaN the kernel read from
    /// one it made (`judge_non_finite`).
    pub(super) fill: f32,
    /// The quantized cache format probe 8 sends (`cache.rs`), where asked and listed by the runner.
    pub(super) kv: Option<crate::kv_format::KvFormat>,
}

impl Prober<'_> {
    pub(super) fn meta(&self, extra: serde_json::Value) -> serde_json::Value {
        let c = self.cfg;
        let mut m = serde_json::json!({
            "dtype": self.dt.name(),
            "softmax_scale": c.softmax_scale,
            "heads": c.n_head,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_nope": c.qk_nope,
            "qk_rope": c.qk_rope,
            "v_head_dim": c.v_head_dim,
            "page_size": self.page,
            "num_splits": 1,
            "q_len": 1,
            "causal": true,
        });
        if let (Some(m), serde_json::Value::Object(e)) = (m.as_object_mut(), extra) {
            m.extend(e);
        }
        m
    }

    /// Send one request and read `out_name` (`out_shape`) and `lse` (one query: `[.., H]` or `[.., H, 1]`
    /// per the layout, the same order); `None` when the runner declined (a warning is recorded).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn call(
        &mut self,
        op: &str,
        inputs: &[Named],
        extra: serde_json::Value,
        out_name: &str,
        out_shape: &[usize],
        lse_shape: Vec<usize>,
        findings: &mut Findings,
    ) -> Result<Option<Answer>> {
        let meta = self.meta(extra);
        let ex = self.proc.request(op, 0, inputs, &meta)?;
        let (input, output) = (ex.input, ex.output);
        if let Outcome::Unsupported(reason) = ex.outcome? {
            findings.warning(
                &format!("runner.{op}.probe"),
                format!("declined: {reason}"),
                "an answer",
                "the probe is a request at the model's own dims; a run would be refused the same way",
            );
            return Ok(None);
        }
        let mut o = Outputs::read(&output, &self.desc.name)?;
        if !keep_io() {
            let _ = std::fs::remove_file(&input);
            let _ = std::fs::remove_file(&output);
        }
        let v = o.take(out_name, out_shape, op)?;
        let shape = match self.desc.conventions.lse_layout {
            protocol::LseLayout::TokenHead => lse_shape,
            protocol::LseLayout::HeadToken => {
                let mut s = lse_shape;
                let n = s.len();
                s.swap(n - 2, n - 1);
                s
            }
        };
        let l = o.take("lse", &shape, op)?;
        Ok(Some(Answer {
            out: v.data,
            out_dtype: v.dtype,
            lse: l.data,
            lse_dtype: l.dtype,
            rest: o,
        }))
    }

    /// A decode request of one query over `case`'s tokens.
    pub(super) fn decode(
        &mut self,
        case: &DecodeCase,
        out: &mut Findings,
    ) -> Result<Option<Answer>> {
        self.decode_step(case, 1, 1, out)
    }

    /// A decode request of `s_q` queries (each `case`'s query; causal within the step) over `case`'s
    /// tokens, with `splits` split partials asked for.
    pub(super) fn decode_step(
        &mut self,
        case: &DecodeCase,
        s_q: usize,
        splits: usize,
        out: &mut Findings,
    ) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, lkv, r, page) = (c.n_head, c.kv_lora_rank, c.qk_rope, self.page);
        let row = lkv + r;
        let dt = self.dt;
        let round = |v: &[f32]| v.iter().map(|&x| dt.round(x)).collect::<Vec<f32>>();
        let q_nope: Vec<f32> = round(&case.q_nope).repeat(h * s_q);
        let q_pe: Vec<f32> = round(&case.q_pe).repeat(h * s_q);
        let mut pool = vec![self.fill; case.pool * page * row];
        for (t, vals) in case.rows.iter().enumerate() {
            let slot = case.table[t / page] * page + t % page;
            pool[slot * row..(slot + 1) * row].copy_from_slice(&round(vals));
        }
        // One more table slot than the sequence needs, pointing at a NaN page (as `run` sends them).
        let spare = (0..case.pool)
            .find(|p| !case.table.contains(p))
            .expect("the pool keeps a NaN page");
        let mut table: Vec<i32> = case.table.iter().map(|&p| p as i32).collect();
        table.push(spare as i32);
        let inputs = [
            floats("q_nope", vec![1, s_q, h, lkv], &q_nope, dt),
            floats("q_pe", vec![1, s_q, h, r], &q_pe, dt),
            floats("kv_cache", vec![case.pool, page, row], &pool, dt),
            ints("block_table", vec![1, table.len()], &table),
            ints("cache_seqlens", vec![1], &[case.rows.len() as i32]),
        ];
        self.call(
            "decode",
            &inputs,
            serde_json::json!({ "q_len": s_q, "num_splits": splits }),
            "attn_latent",
            &[1, s_q, h, lkv],
            vec![1, s_q, h],
            out,
        )
    }

    /// A prefill request of one query over `keys` equal keys (all entries `A`).
    pub(super) fn prefill(&mut self, keys: usize, out: &mut Findings) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, dqk, dv) = (c.n_head, c.qk_head_dim(), c.v_head_dim);
        let dt = self.dt;
        let inputs = [
            floats("q", vec![1, h, dqk], &vec![A; h * dqk], dt),
            floats("k", vec![keys, h, dqk], &vec![A; keys * h * dqk], dt),
            floats("v", vec![keys, h, dv], &vec![A; keys * h * dv], dt),
        ];
        self.call(
            "prefill",
            &inputs,
            serde_json::json!({ "context_len": keys - 1 }),
            "attn_heads",
            &[1, h, dv],
            vec![1, h],
            out,
        )
    }

    /// Two queries of a fresh chunk (context 0) over two equal keys whose values are A and 2A: causal,
    /// query 0 sees key 0 only.
    pub(super) fn prefill_causal(&mut self, out: &mut Findings) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, dqk, dv) = (c.n_head, c.qk_head_dim(), c.v_head_dim);
        let dt = self.dt;
        let mut v = vec![A; h * dv];
        v.extend(vec![2.0 * A; h * dv]);
        let inputs = [
            floats("q", vec![2, h, dqk], &vec![A; 2 * h * dqk], dt),
            floats("k", vec![2, h, dqk], &vec![A; 2 * h * dqk], dt),
            floats("v", vec![2, h, dv], &v, dt),
        ];
        self.call(
            "prefill",
            &inputs,
            serde_json::json!({ "context_len": 0 }),
            "attn_heads",
            &[2, h, dv],
            vec![2, h],
            out,
        )
    }

    /// A DSA request (`sparse_prefill` or `sparse_decode`) of one query whose index row names the
    /// first `keys` cache slots (all entries `A`), padded with −1 to 4 entries; every other slot NaN.
    pub(super) fn sparse(
        &mut self,
        op: &str,
        keys: usize,
        out: &mut Findings,
    ) -> Result<Option<Answer>> {
        let c = self.cfg;
        let (h, lkv, row, page) = (c.n_head, c.kv_lora_rank, c.cache_row(), self.page);
        let dt = self.dt;
        let slots = 2 * page.max(keys);
        let mut kv = vec![self.fill; slots * row];
        kv[..keys * row].fill(A);
        let topk = keys.max(4);
        let idx: Vec<i32> = (0..topk)
            .map(|k| if k < keys { k as i32 } else { -1 })
            .collect();
        let q = vec![A; h * row];
        let (inputs, lse_shape, out_shape) = match op {
            "sparse_prefill" => (
                [
                    floats("q", vec![1, h, row], &q, dt),
                    floats("kv", vec![slots, 1, row], &kv, dt),
                    ints("indices", vec![1, 1, topk], &idx),
                ],
                vec![1, h],
                vec![1, h, lkv],
            ),
            _ => (
                [
                    floats("q", vec![1, 1, h, row], &q, dt),
                    floats("kv_cache", vec![slots / page, page, row], &kv, dt),
                    ints("indices", vec![1, 1, topk], &idx),
                ],
                vec![1, 1, h],
                vec![1, 1, h, lkv],
            ),
        };
        let extra = serde_json::json!({ "context_len": keys - 1, "top_k": topk, "d_v": lkv });
        self.call(
            op,
            &inputs,
            extra,
            "attn_latent",
            &out_shape,
            lse_shape,
            out,
        )
    }

    /// `n` tokens of equal rows, all `A`, on the first physical pages in order (one NaN page after).
    pub(super) fn uniform(&self, n: usize) -> DecodeCase {
        let c = self.cfg;
        let pages = n.div_ceil(self.page);
        DecodeCase {
            q_nope: vec![A; c.kv_lora_rank],
            q_pe: vec![A; c.qk_rope],
            rows: vec![vec![A; c.cache_row()]; n],
            table: (0..pages).collect(),
            pool: pages + 1,
        }
    }
}
