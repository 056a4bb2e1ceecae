//! The paged latent cache: a pool of `pool_pages · page_size` rows `[latent | k_pe]`, every row NaN until
//! written, addressed through the schedule's block table (vLLM's `concat_and_cache_mla` layout).

use crate::schedule::Schedule;
use ndarray::Array2;
use std::ops::Range;

#[derive(Debug, Clone)]
pub struct PagedCache {
    pub width: usize,
    pub page_size: usize,
    pub table: Vec<usize>,
    /// `[pool_pages · page_size, width]`, row-major.
    pub pool: Vec<f32>,
}

impl PagedCache {
    /// An all-NaN pool for the schedule: unwritten slots and spare pages poison any read of them.
    pub fn new(sched: &Schedule, width: usize) -> PagedCache {
        PagedCache {
            width,
            page_size: sched.page_size,
            table: sched.block_table(),
            pool: vec![f32::NAN; sched.pool_pages() * sched.page_size * width],
        }
    }

    /// Physical row of token `t`.
    pub fn slot(&self, t: usize) -> usize {
        self.table[t / self.page_size] * self.page_size + t % self.page_size
    }

    /// Write token `t`'s row `[latent | k_pe]`.
    pub fn write(&mut self, t: usize, latent: &[f32], k_pe: &[f32]) {
        let at = self.slot(t) * self.width;
        let row = &mut self.pool[at..at + self.width];
        row[..latent.len()].copy_from_slice(latent);
        row[latent.len()..].copy_from_slice(k_pe);
    }

    /// Token `t`'s row, read through the block table.
    pub fn row(&self, t: usize) -> &[f32] {
        let at = self.slot(t) * self.width;
        &self.pool[at..at + self.width]
    }

    /// Rows of tokens `r`, in token order.
    pub fn gather(&self, r: Range<usize>) -> Array2<f32> {
        let mut out = Array2::zeros((r.len(), self.width));
        for (i, t) in r.enumerate() {
            out.row_mut(i)
                .as_slice_mut()
                .expect("contiguous")
                .copy_from_slice(self.row(t));
        }
        out
    }
}
