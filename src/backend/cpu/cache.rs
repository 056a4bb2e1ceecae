//! The paged latent cache: a pool of `pool_pages · page_size` rows `[latent | k_pe]`, every row NaN until
//! written, addressed through the schedule's block table (vLLM's `concat_and_cache_mla` layout). A read
//! beyond the block table sees a NaN row too (a kernel would read memory the sequence does not own).
//!
//! With a quantized format (`run --kv-cache-dtype`, `crate::kv_format`), each written row is stored as the
//! format's bytes (`bytes`, `Codec::bytes()` per slot), and `pool` holds the row as a reader decodes
//! those bytes (decoded once, when written: the bytes do not change afterwards, so every read sees the
//! same values a kernel dequantizing at read time would). A serving batch's cache (`for_batch`) goes
//! through the same format: each row the writer was given, encoded by the same codec (its faults) in one
//! write launch over the batch's requests, and read back from those bytes.

use crate::backend::serving::Batch;
use crate::faults::{Active, Fault};
use crate::kv_format::Codec;
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
    /// What a read beyond the block table returns.
    poison: Vec<f32>,
    /// Planted bugs of the cache writer.
    faults: Active,
    /// The cache's byte format, where it is not the run's dtype; `bytes` holds its rows.
    codec: Option<Codec>,
    pub bytes: Vec<u8>,
    /// With a codec: each slot's row as the writer gave it to the codec (before its rounding), `None`
    /// until written; what a serving batch's write launch encodes again (`for_batch`).
    given: Vec<Option<Vec<f32>>>,
}

impl PagedCache {
    /// An all-NaN pool for the schedule: unwritten slots and spare pages poison any read of them.
    pub fn new(sched: &Schedule, width: usize) -> PagedCache {
        PagedCache {
            width,
            page_size: sched.page_size,
            table: sched.block_table(),
            pool: vec![f32::NAN; sched.pool_pages() * sched.page_size * width],
            poison: vec![f32::NAN; width],
            faults: Active::NONE,
            codec: None,
            bytes: Vec::new(),
            given: Vec::new(),
        }
    }

    /// A pool of `pool.len() / width` rows read through `table` (a serving batch's request: its own
    /// pages of a pool shared with the batch's other requests).
    pub fn from_pool(
        width: usize,
        page_size: usize,
        table: Vec<usize>,
        pool: Vec<f32>,
    ) -> PagedCache {
        PagedCache {
            width,
            page_size,
            table,
            pool,
            poison: vec![f32::NAN; width],
            faults: Active::NONE,
            codec: None,
            bytes: Vec::new(),
            given: Vec::new(),
        }
    }

    /// The cache stored in `codec`'s byte format (its width the cache's).
    pub fn with_codec(mut self, codec: Codec) -> PagedCache {
        assert_eq!(codec.width(), self.width, "the codec's row is the cache's");
        let slots = self.pool.len() / self.width;
        self.bytes = vec![0u8; slots * codec.bytes()];
        self.given = vec![None; slots];
        self.codec = Some(codec);
        self
    }

    pub fn with_faults(mut self, fx: Active) -> PagedCache {
        self.faults = fx;
        self
    }

    /// Physical row of token `t`.
    pub fn slot(&self, t: usize) -> usize {
        self.table[t / self.page_size] * self.page_size + t % self.page_size
    }

    /// Write token `t`'s row `[latent | k_pe]`.
    pub fn write(&mut self, t: usize, latent: &[f32], k_pe: &[f32]) {
        let page = self.page_size;
        let slot = match self.faults.on(Fault::PageOffByOne) && t > 0 {
            // Fault: the page from (t − 1) / page: a page's first row lands on the previous page.
            true => self.table[(t - 1) / page] * page + t % page,
            false => self.slot(t),
        };
        let at = slot * self.width;
        let row = &mut self.pool[at..at + self.width];
        match self.faults.on(Fault::CachePeFirst) {
            // Fault: the row written [k_pe | latent]; readers still expect [latent | k_pe].
            true => {
                row[..k_pe.len()].copy_from_slice(k_pe);
                row[k_pe.len()..k_pe.len() + latent.len()].copy_from_slice(latent);
            }
            // A row wider than latent and k_pe (fault `nope_pad_as_rope`): the pad is left unwritten.
            false => {
                row[..latent.len()].copy_from_slice(latent);
                row[latent.len()..latent.len() + k_pe.len()].copy_from_slice(k_pe);
            }
        }
        // A quantized format: the row's bytes stored, the row read back from them.
        if let Some(c) = &self.codec {
            let n = c.bytes();
            let bytes = &mut self.bytes[slot * n..(slot + 1) * n];
            self.given[slot] = Some(row.to_vec());
            c.encode(row, bytes);
            c.decode(bytes, row);
        }
    }

    /// The cache a serving batch's decode reads (`backend::serving::Batch`; its block tables set per
    /// request by the caller): request `q`'s key `j` is this cache's token `j mod t`, in the request's
    /// own pages (`Batch::pool`), every other slot NaN. With a quantized format the batch's rows are
    /// written by one launch over its requests, request 0 first: each row this cache's writer was given
    /// for that token, encoded by the same codec (`Codec::encode_in_launch`, the layer's faults) into a
    /// byte pool whose unwritten bytes are 0xff, and read back from those bytes. Without a fault the
    /// rows are this cache's, bit for bit (the codec is deterministic).
    pub fn for_batch(&self, batch: &Batch, t: usize) -> PagedCache {
        let w = self.width;
        let Some(c) = self.codec else {
            let bw = batch.width;
            let rows: Vec<f32> = self.rows(0..t, bw).iter().copied().collect();
            let pool = batch.pool(&rows, f32::NAN);
            // A row wider than the model's (fault `nope_pad_as_rope`): each slot's pad unwritten.
            let pool = match w > bw {
                true => pool
                    .chunks(bw)
                    .flat_map(|r| {
                        r.iter()
                            .copied()
                            .chain(std::iter::repeat_n(f32::NAN, w - bw))
                    })
                    .collect(),
                false => pool,
            };
            return PagedCache::from_pool(w, batch.page, Vec::new(), pool);
        };
        let (n, page) = (c.bytes(), batch.page);
        let slots = batch.n_pages * page;
        let mut out = PagedCache::from_pool(w, page, Vec::new(), vec![f32::NAN; slots * w]);
        out.bytes = vec![0xff; slots * n];
        for (i, (q, tab)) in batch.reqs.iter().zip(&batch.tables).enumerate() {
            for j in 0..q.seq_len {
                let tok = j % t;
                let given = (tok / self.page_size < self.table.len())
                    .then(|| self.given[self.slot(tok)].as_deref())
                    .flatten();
                // A token this cache never wrote stays unwritten in the batch's pool too (NaN).
                let Some(row) = given else { continue };
                let at = tab[j / page] * page + j % page;
                let bytes = &mut out.bytes[at * n..(at + 1) * n];
                c.encode_in_launch(row, bytes, i == 0);
                c.decode(bytes, &mut out.pool[at * w..(at + 1) * w]);
            }
        }
        out
    }

    /// Token `t`'s row, read through the block table (NaN beyond it).
    pub fn row(&self, t: usize) -> &[f32] {
        if t / self.page_size >= self.table.len() {
            return &self.poison;
        }
        let at = self.slot(t) * self.width;
        &self.pool[at..at + self.width]
    }

    /// Rows of tokens `r`, in token order.
    pub fn gather(&self, r: Range<usize>) -> Array2<f32> {
        self.gather_with(r, |t| self.row(t))
    }

    /// The first `width` columns of the rows of tokens `r` (the model's row `[latent | k_pe]`, without a
    /// pad the cache's row may have: fault `nope_pad_as_rope`).
    pub fn rows(&self, r: Range<usize>, width: usize) -> Array2<f32> {
        let rows = self.gather(r);
        match width < self.width {
            true => rows.slice_move(ndarray::s![.., ..width]),
            false => rows,
        }
    }

    /// Pool row `slot`, no block table (NaN beyond the pool): what a reader that takes a token's
    /// position for its cache slot gets (fault `sparse_index_page_base`).
    pub fn raw_row(&self, slot: usize) -> &[f32] {
        match self.pool.get(slot * self.width..(slot + 1) * self.width) {
            Some(r) => r,
            None => &self.poison,
        }
    }

    /// Pool rows `r` read as `raw_row` does.
    pub fn gather_raw(&self, r: Range<usize>) -> Array2<f32> {
        self.gather_with(r, |t| self.raw_row(t))
    }

    fn gather_with<'a>(&'a self, r: Range<usize>, row: impl Fn(usize) -> &'a [f32]) -> Array2<f32> {
        let mut out = Array2::zeros((r.len(), self.width));
        for (i, t) in r.enumerate() {
            out.row_mut(i)
                .as_slice_mut()
                .expect("contiguous")
                .copy_from_slice(row(t));
        }
        out
    }
}
