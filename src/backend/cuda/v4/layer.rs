//! One V4 layer on the device: its kernels (`Fns`), weights, activations, caches and compressors
//! (`Layer::new`), the launches of a forward pass (`Layer::pass`) and of the layer's end
//! (`Layer::finish`), and the trace read back (`Layer::trace`).

use super::plan::Groups;
use crate::backend::cpu::v4::Rope32;
use crate::backend::cuda::blas::Blas;
use crate::backend::cuda::device::{drv_err, elem_bytes, encode, encode_f32, DevBuf};
use crate::backend::cuda::kernels::Kernels;
use crate::backend::cuda::launch::{RmsNorm, Rope};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::model::v4::{CompressorWeights, LayerKind, V4Config, V4Rope, V4Weights};
use crate::precision::Dtype;
use cudarc::driver::sys::CUfunction;
use ndarray::ArrayView2;
use std::ops::Range;

mod launches;
mod trace;

/// Query heads (warps) per CTA of `v4_attn` (its V4_ROWS), entries per CTA of `v4_index_scores`.
const ATTN_ROWS: usize = 4;
const IX_KEYS: usize = 8;

/// The kernels of a layer: kernels/norm_rope.cu at the rope's width, kernels/v4/ at the head width with
/// the layer's V4 faults compiled in.
pub struct Fns {
    rmsnorm: CUfunction,
    rope: CUfunction,
    attn: CUfunction,
    compress: CUfunction,
    scores: CUfunction,
    topk: CUfunction,
}

impl Fns {
    /// The modules a layer of `c` loads in `dt` with `faults`: (unit, defines).
    pub fn modules(
        c: &V4Config,
        dt: Dtype,
        faults: Active,
    ) -> [(&'static str, Vec<(String, String)>); 4] {
        let d = |k: &str, v: usize| (k.to_string(), v.to_string());
        let code = match dt {
            Dtype::Bf16 => 0,
            Dtype::F16 => 1,
            Dtype::F32 => 2,
        };
        let nr = vec![
            d("MLA_DTYPE", code),
            d("MLA_R", c.rope_dim),
            d("MLA_ROPE_NEOX", 0),
        ];
        let mut v4 = vec![d("MLA_DTYPE", code), d("V4_D", c.head_dim)];
        for f in crate::faults::Fault::ALL
            .iter()
            .filter(|f| f.is_v4() && faults.on(**f))
        {
            v4.push(d(f.info().define, 1));
        }
        [
            ("norm_rope.cu", nr),
            ("v4/attn.cu", v4.clone()),
            ("v4/compress.cu", v4.clone()),
            ("v4/indexer.cu", v4),
        ]
    }

    pub fn load(k: &mut Kernels, c: &V4Config, dt: Dtype, faults: Active) -> Result<Fns> {
        let [nr, attn, comp, ix] = Fns::modules(c, dt, faults);
        let (nr, attn) = (k.module(nr.0, nr.1)?, k.module(attn.0, attn.1)?);
        let (comp, ix) = (k.module(comp.0, comp.1)?, k.module(ix.0, ix.1)?);
        Ok(Fns {
            rmsnorm: nr.func("rmsnorm")?,
            rope: nr.func("rope")?,
            attn: attn.func("v4_attn")?,
            compress: comp.func("v4_compress")?,
            scores: ix.func("v4_index_scores")?,
            topk: ix.func("v4_index_topk")?,
        })
    }
}

/// A matrix or vector of weights in the dtype.
fn up(dt: Dtype, v: impl Iterator<Item = f64>) -> Result<DevBuf> {
    let v: Vec<f32> = v.map(|x| x as f32).collect();
    DevBuf::upload(&encode_f32(dt, &v))
}

/// A NaN-poisoned `[rows, cols]` buffer of the dtype: a read of a row not yet written shows.
fn poisoned(dt: Dtype, rows: usize, cols: usize) -> Result<DevBuf> {
    let b = DevBuf::alloc(rows.max(1) * cols.max(1) * elem_bytes(dt))?;
    b.fill_nan(dt)?;
    Ok(b)
}

/// A rope's f32 cos and `sign`·sin tables on the device.
fn tables(r: &Rope32, sign: f32) -> Result<(DevBuf, DevBuf)> {
    let (cos, sin) = r.tables();
    let s: Vec<f32> = sin.iter().map(|&v| sign * v).collect();
    Ok((
        DevBuf::upload(cos.as_slice().expect("standard layout"))?,
        DevBuf::upload(&s)?,
    ))
}

/// A compressor on the device: its weights, its state (every fed token's kv and gate projections) and
/// its entries.
struct Comp {
    w_kv: DevBuf,
    w_gate: DevBuf,
    ape: DevBuf,
    norm: DevBuf,
    kv: DevBuf,
    gate: DevBuf,
    entries: DevBuf,
    /// Entry width, state row width (`coff · d`), entries closed by the last token.
    d: usize,
    width: usize,
    n_entries: usize,
    csa: bool,
    groups: Groups,
}

impl Comp {
    fn new(
        dt: Dtype,
        w: &CompressorWeights,
        kind: LayerKind,
        d: usize,
        t_len: usize,
        faults: Active,
    ) -> Result<Comp> {
        let groups = Groups::new(kind.ratio(), faults);
        let width = kind.coff() * d;
        let n_entries = groups.closed_by(t_len);
        Ok(Comp {
            w_kv: up(dt, w.kv.iter().copied())?,
            w_gate: up(dt, w.gate.iter().copied())?,
            ape: up(dt, w.ape.iter().copied())?,
            norm: up(dt, w.norm.iter().copied())?,
            kv: poisoned(dt, t_len, width)?,
            gate: poisoned(dt, t_len, width)?,
            entries: poisoned(dt, n_entries, d)?,
            d,
            width,
            n_entries,
            csa: kind == LayerKind::Csa,
            groups,
        })
    }
}

/// The CSA indexer: its compressor, weights, queries, head weights, scores and selection.
struct Ix {
    comp: Comp,
    w_q: DevBuf,
    w_proj: DevBuf,
    q: DevBuf,
    wts: DevBuf,
    scores: DevBuf,
    topk: DevBuf,
    hi: usize,
    di: usize,
    /// The selection rows' width: `min(top_k, entries)`.
    k: usize,
}

/// One layer's device state.
pub struct Layer<'a> {
    blas: &'a Blas,
    f: Fns,
    c: &'a V4Config,
    dt: Dtype,
    kind: LayerKind,
    t_len: usize,
    w_attn_norm: DevBuf,
    w_q_a: DevBuf,
    w_q_a_norm: DevBuf,
    w_q_b: DevBuf,
    w_kv: DevBuf,
    w_kv_norm: DevBuf,
    ones: DevBuf,
    sinks: DevBuf,
    w_o_a: DevBuf,
    w_o_b: DevBuf,
    x: DevBuf,
    attn_in: DevBuf,
    qa: DevBuf,
    q_a: DevBuf,
    q: DevBuf,
    /// The window cache: every token's row (K = V), written by its pass.
    rows: DevBuf,
    heads: DevBuf,
    lse: DevBuf,
    derot: DevBuf,
    mid: DevBuf,
    out: DevBuf,
    /// The layer's rope (cos, sin, −sin) and the compress rope (cos, sin).
    rope: (DevBuf, DevBuf, DevBuf),
    crope: (DevBuf, DevBuf),
    comp: Option<Comp>,
    ix: Option<Ix>,
}

impl<'a> Layer<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        blas: &'a Blas,
        f: Fns,
        c: &'a V4Config,
        w: &V4Weights,
        layer: usize,
        x: ArrayView2<f64>,
        dt: Dtype,
        faults: Active,
    ) -> Result<Layer<'a>> {
        let (kind, t_len) = (c.kind(layer), x.nrows());
        let (e, h, d) = (c.hidden, c.n_head, c.head_dim);
        let g = (c.o_groups, c.o_lora_rank);
        let rope = Rope32::new(c, c.rope_of(kind), t_len);
        let (cos, sin) = tables(&rope, 1.0)?;
        let (_, nsin) = tables(&rope, -1.0)?;
        let crope = tables(&Rope32::new(c, V4Rope::Compress, t_len), 1.0)?;
        let comp = match &w.compressor {
            Some(cw) => Some(Comp::new(dt, cw, kind, d, t_len, faults)?),
            None => None,
        };
        let ix = match (&w.indexer, kind) {
            (Some((cw, q_b, proj)), LayerKind::Csa) => {
                let (hi, di) = (c.indexer.n_head, c.indexer.head_dim);
                let comp = Comp::new(dt, cw, kind, di, t_len, faults)?;
                let n = comp.n_entries;
                let k = c.indexer.top_k.min(n);
                Some(Ix {
                    comp,
                    w_q: up(dt, q_b.iter().copied())?,
                    w_proj: up(dt, proj.iter().copied())?,
                    q: poisoned(dt, t_len, hi * di)?,
                    wts: poisoned(dt, t_len, hi)?,
                    scores: poisoned(Dtype::F32, t_len, n)?,
                    topk: DevBuf::zeros(t_len.max(1) * k.max(1) * 4)?,
                    hi,
                    di,
                    k,
                })
            }
            _ => None,
        };
        Ok(Layer {
            blas,
            f,
            c,
            dt,
            kind,
            t_len,
            w_attn_norm: up(dt, w.attn_norm.iter().copied())?,
            w_q_a: up(dt, w.q_a.iter().copied())?,
            w_q_a_norm: up(dt, w.q_a_norm.iter().copied())?,
            w_q_b: up(dt, w.q_b.iter().copied())?,
            w_kv: up(dt, w.kv.iter().copied())?,
            w_kv_norm: up(dt, w.kv_norm.iter().copied())?,
            ones: up(dt, std::iter::repeat_n(1.0, d))?,
            sinks: DevBuf::upload(&w.sinks.iter().map(|&v| v as f32).collect::<Vec<_>>())?,
            w_o_a: up(dt, w.o_a.iter().copied())?,
            w_o_b: up(dt, w.o_b.iter().copied())?,
            x: DevBuf::upload(&encode(dt, x.iter().copied()))?,
            attn_in: poisoned(dt, t_len, e)?,
            qa: poisoned(dt, t_len, c.q_lora_rank)?,
            q_a: poisoned(dt, t_len, c.q_lora_rank)?,
            q: poisoned(dt, t_len, h * d)?,
            rows: poisoned(dt, t_len, d)?,
            heads: poisoned(dt, t_len, h * d)?,
            lse: poisoned(Dtype::F32, t_len, h)?,
            derot: poisoned(dt, t_len, h * d)?,
            mid: poisoned(dt, t_len, g.0 * g.1)?,
            out: poisoned(dt, t_len, e)?,
            rope: (cos, sin, nsin),
            crope,
            comp,
            ix,
        })
    }

    /// Address of row `row` of a buffer of rows `width` elements wide, in the dtype.
    fn at(&self, b: &DevBuf, row: usize, width: usize) -> u64 {
        b.at(row * width, elem_bytes(self.dt))
    }

    /// `y[n, out] = x[n, k] · Wᵀ`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        n: usize,
        out: usize,
        k: usize,
        x: u64,
        ldx: usize,
        w: &DevBuf,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        self.blas.linear(self.dt, n, out, k, x, ldx, w.ptr, y, ldy)
    }

    fn norm(&self, rows: usize, cols: usize, x: u64, w: &DevBuf, y: u64) -> Result<()> {
        RmsNorm {
            rows,
            cols,
            x_stride: cols,
            y_stride: cols,
            eps: self.c.rms_eps as f32,
        }
        .launch(self.f.rmsnorm, x, w.ptr, y)
    }

    /// Rope on the trailing R of each of `heads` heads of width `width` of the rows of `pass`.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        pass: &Range<usize>,
        x: &DevBuf,
        heads: usize,
        width: usize,
        cos: &DevBuf,
        sin: &DevBuf,
    ) -> Result<()> {
        Rope {
            rows: pass.len(),
            first_token: pass.start,
            row_stride: heads * width,
            head_stride: width,
            heads,
            offset: width - self.c.rope_dim,
        }
        .launch(
            self.f.rope,
            self.at(x, pass.start, heads * width),
            cos.ptr,
            sin.ptr,
        )
    }

    /// One forward pass over the tokens `p`: the row-wise stages, the entries it closes, each query's
    /// selection and attention.
    pub fn pass(&self, p: &Range<usize>) -> Result<()> {
        self.front(p)?;
        for cm in self.comp.iter().chain(self.ix.iter().map(|i| &i.comp)) {
            self.compress(cm, p)?;
        }
        if let Some(ix) = &self.ix {
            self.select(ix, p)?;
        }
        self.attend(p)
    }

    fn front(&self, p: &Range<usize>) -> Result<()> {
        let c = self.c;
        let (n, a, e, ql) = (p.len(), p.start, c.hidden, c.q_lora_rank);
        let (h, d) = (c.n_head, c.head_dim);
        let attn_in = self.at(&self.attn_in, a, e);
        self.norm(n, e, self.at(&self.x, a, e), &self.w_attn_norm, attn_in)?;
        self.gemm(
            n,
            ql,
            e,
            attn_in,
            e,
            &self.w_q_a,
            self.at(&self.qa, a, ql),
            ql,
        )?;
        let q_a = self.at(&self.q_a, a, ql);
        self.norm(n, ql, self.at(&self.qa, a, ql), &self.w_q_a_norm, q_a)?;
        let q = self.at(&self.q, a, h * d);
        self.gemm(n, h * d, ql, q_a, ql, &self.w_q_b, q, h * d)?;
        self.norm(n * h, d, q, &self.ones, q)?;
        self.rope(p, &self.q, h, d, &self.rope.0, &self.rope.1)?;
        let rows = self.at(&self.rows, a, d);
        self.gemm(n, d, e, attn_in, e, &self.w_kv, rows, d)?;
        self.norm(n, d, rows, &self.w_kv_norm, rows)?;
        self.rope(p, &self.rows, 1, d, &self.rope.0, &self.rope.1)?;
        for cm in self.comp.iter().chain(self.ix.iter().map(|i| &i.comp)) {
            let wd = cm.width;
            self.gemm(n, wd, e, attn_in, e, &cm.w_kv, self.at(&cm.kv, a, wd), wd)?;
            self.gemm(
                n,
                wd,
                e,
                attn_in,
                e,
                &cm.w_gate,
                self.at(&cm.gate, a, wd),
                wd,
            )?;
        }
        if let Some(ix) = &self.ix {
            let w = ix.hi * ix.di;
            self.gemm(n, w, ql, q_a, ql, &ix.w_q, self.at(&ix.q, a, w), w)?;
            self.rope(p, &ix.q, ix.hi, ix.di, &self.crope.0, &self.crope.1)?;
            let wts = self.at(&ix.wts, a, ix.hi);
            self.gemm(n, ix.hi, e, attn_in, e, &ix.w_proj, wts, ix.hi)?;
        }
        Ok(())
    }

    /// After the last pass: the de-rotation (rope with −sin) and the grouped output projection.
    pub fn finish(&self) -> Result<()> {
        let c = self.c;
        let (t, h, d) = (self.t_len, c.n_head, c.head_dim);
        let (g, r) = (c.o_groups, c.o_lora_rank);
        let bytes = t * h * d * elem_bytes(self.dt);
        unsafe { cudarc::driver::result::memcpy_dtod_sync(self.derot.ptr, self.heads.ptr, bytes) }
            .map_err(drv_err("copying attn_heads for the de-rotation"))?;
        self.rope(&(0..t), &self.derot, h, d, &self.rope.0, &self.rope.2)?;
        let per = h / g * d;
        for gi in 0..g {
            let x = self.derot.at(gi * per, elem_bytes(self.dt));
            let w = self.w_o_a.at(gi * r * per, elem_bytes(self.dt));
            let y = self.mid.at(gi * r, elem_bytes(self.dt));
            self.blas
                .linear(self.dt, t, r, per, x, h * d, w, y, g * r)?;
        }
        self.gemm(
            t,
            c.hidden,
            g * r,
            self.mid.ptr,
            g * r,
            &self.w_o_b,
            self.out.ptr,
            c.hidden,
        )
    }
}

/// Error out, one line, where a dim cannot be run by these kernels.
pub fn check_dims(c: &V4Config) -> Result<()> {
    let bad = if !c.rope_dim.is_multiple_of(2)
        || c.rope_dim > c.head_dim
        || c.rope_dim > c.indexer.head_dim
    {
        Some("the rope must be an even width within the head and the indexer head")
    } else if !c.n_head.is_multiple_of(c.o_groups.max(1)) {
        Some("the heads must split evenly into the output groups")
    } else {
        None
    };
    match bad {
        Some(why) => Err(Error::Usage(format!("DeepSeek-V4 on CUDA: {why}"))),
        None => Ok(()),
    }
}
