//! A V4 layer's stages read back from the device, in the CPU mirror's layout (`V4Layer`).

use super::Layer;
use crate::backend::cuda::device::{decode, elem_bytes, DevBuf};
use crate::error::Result;
use crate::model::v4::LayerKind;
use crate::reference::v4::V4Layer;
use ndarray::{Array2, Array3};

/// The CSA indexer's scores and selection (`None` on other layers).
type Selection = (Option<Array2<f64>>, Option<Array2<i64>>);

impl Layer<'_> {
    /// `[rows, cols]` of a buffer of the dtype as f64.
    fn get(&self, b: &DevBuf, rows: usize, cols: usize) -> Result<Array2<f64>> {
        let v = decode(
            self.dt,
            &b.read::<u8>(0, rows * cols * elem_bytes(self.dt))?,
        );
        Ok(Array2::from_shape_vec((rows, cols), v).expect("shape"))
    }

    /// `[token, head, dim]` of a buffer of the dtype as f64.
    fn get3(&self, b: &DevBuf) -> Result<Array3<f64>> {
        let (t, h, d) = (self.t_len, self.c.n_head, self.c.head_dim);
        Ok(self
            .get(b, t, h * d)?
            .into_shape_with_order((t, h, d))
            .expect("shape"))
    }

    /// The CSA indexer's scores `[token, entry]` and selection `[token, k]` at the reference's entry
    /// count and top-k width (the mirror's layout: −inf past a query's entries, −1 past its selection).
    fn selection(&self) -> Result<Selection> {
        let Some(ix) = &self.ix else {
            return Ok((None, None));
        };
        let t = self.t_len;
        let n_ref = match self.kind {
            LayerKind::Window => 0,
            k => t / k.ratio(),
        };
        let nc = ix.comp.n_entries;
        let sc: Vec<f32> = ix.scores.read(0, t * nc)?;
        let s = Array2::from_shape_fn((t, n_ref), |(i, e)| match e < nc {
            true => sc[i * nc + e] as f64,
            false => f64::NEG_INFINITY,
        });
        let kr = self.c.indexer.top_k.min(n_ref);
        let tk: Vec<i32> = ix.topk.read(0, t * ix.k)?;
        let k = Array2::from_shape_fn((t, kr), |(i, j)| match j < ix.k {
            true => tk[i * ix.k + j] as i64,
            false => -1,
        });
        Ok((Some(s), Some(k)))
    }

    /// The layer's stages read back, in the mirror's layout.
    pub fn trace(&self) -> Result<V4Layer> {
        let c = self.c;
        let t = self.t_len;
        let (index_scores, topk_indices) = self.selection()?;
        let lse: Vec<f32> = self.lse.read(0, t * c.n_head)?;
        Ok(V4Layer {
            attn_in: self.get(&self.attn_in, t, c.hidden)?,
            q_a: self.get(&self.q_a, t, c.q_lora_rank)?,
            q: self.get3(&self.q)?,
            cache_rows: self.get(&self.rows, t, c.head_dim)?,
            compressed: match &self.comp {
                Some(cm) => Some(self.get(&cm.entries, cm.n_entries, cm.d)?),
                None => None,
            },
            index_scores,
            topk_indices,
            attn_heads: self.get3(&self.heads)?,
            lse: Array2::from_shape_vec((t, c.n_head), lse.into_iter().map(f64::from).collect())
                .expect("shape"),
            attn_derot: self.get3(&self.derot)?,
            attn_out: self.get(&self.out, t, c.hidden)?,
        })
    }
}
