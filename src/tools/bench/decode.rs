//! `bench decode`: absorbed MQA decode over a paged latent cache, every tile × split count × schedule,
//! checked against the scalar kernel, then the peers on the same inputs.

use super::measure::{bits, time_us, Filler};
use super::session::{v3_dims, CaseResult, DecodeCase, Session};
use crate::backend::cuda::args::AttnArgs;
use crate::backend::cuda::attn::Attn;
use crate::backend::cuda::device::DevBuf;
use crate::backend::runner::tensors::ints;
use crate::error::Result;
use crate::tiles::{Dims, Tile};

/// Where the module has both decode schedules, each split count runs on both (`run` picks by keys
/// per split: attn::pairs_rule); where it has attn_small (few heads, TMA key ring), on it and on
/// attn_mma (`run` picks by keys per split: attn::small_rule). The label names the kernel.
#[derive(Clone, Copy, PartialEq)]
enum Sched {
    Plain,
    Pairs,
    OneTile,
    Small,
    Mma,
}

impl Sched {
    fn of(att: &Attn) -> &'static [Sched] {
        if att.has_pairs() {
            &[Sched::Pairs, Sched::OneTile]
        } else if att.has_small() {
            &[Sched::Small, Sched::Mma]
        } else {
            &[Sched::Plain]
        }
    }

    fn label(self) -> &'static str {
        match self {
            Sched::Plain => "",
            Sched::Pairs => " pairs",
            Sched::OneTile => " one-tile",
            Sched::Small => " attn_small (TMA ring)",
            Sched::Mma => " attn_mma",
        }
    }
}

/// One decode case's inputs on the device: the pool, each request's pages (a random permutation),
/// the queries, and the outputs every configuration writes.
struct Inputs {
    dc: DecodeCase,
    dims: Dims,
    pages: usize,
    pool: DevBuf,
    perm: Vec<i32>,
    table: DevBuf,
    /// The model's softmax scale 1/sqrt(P+R) (without YaRN's mscale: timing does not depend on it).
    scale: f64,
    q: DevBuf,
    o: DevBuf,
    lse: DevBuf,
    po: DevBuf,
    pl: DevBuf,
}

impl Inputs {
    fn new(dc: DecodeCase, filler: &Filler, splits_list: &[usize]) -> Result<Inputs> {
        let DecodeCase {
            bsz,
            h,
            s,
            page,
            dt,
        } = dc;
        let base = v3_dims(dt);
        let (lkv, r) = (base.lkv, base.r);
        let row = lkv + r;
        let pages = bsz * s / page;
        let pool = DevBuf::alloc(pages * page * row * 2)?;
        filler.fill(&pool, pages * page * row, 11, 1.0)?;
        // Each request owns s/page pages of a random permutation of the whole pool.
        let mut perm: Vec<i32> = (0..pages as i32).collect();
        {
            use rand::seq::SliceRandom;
            use rand::SeedableRng;
            perm.shuffle(&mut rand::rngs::StdRng::seed_from_u64(5));
        }
        let table = DevBuf::upload(&perm)?;
        let scale = 1.0 / ((base.p + base.r) as f64).sqrt();
        let dims = Dims { h, page, ..base };
        let q = DevBuf::alloc(bsz * h * row * 2)?;
        filler.fill(&q, bsz * h * row, 12 + h as u32, 1.0)?;
        let o = DevBuf::alloc(bsz * h * lkv * 2)?;
        let lse = DevBuf::alloc(bsz * h * 4)?;
        let max_splits = splits_list.iter().copied().max().unwrap_or(1);
        let po = DevBuf::alloc(bsz * h * max_splits * lkv * 4)?;
        let pl = DevBuf::alloc(bsz * h * max_splits * 4)?;
        Ok(Inputs {
            dc,
            dims,
            pages,
            pool,
            perm,
            table,
            scale,
            q,
            o,
            lse,
            po,
            pl,
        })
    }

    fn args(&self, splits: usize) -> AttnArgs {
        let d = &self.dims;
        AttnArgs {
            q: self.q.ptr,
            ka: self.pool.ptr,
            kb: self.pool.ptr,
            v: self.pool.ptr,
            table: self.table.ptr,
            out: self.o.ptr,
            lse: self.lse.ptr,
            part_out: self.po.ptr,
            part_lse: self.pl.ptr,
            n_keys: self.dc.s as i32,
            num_splits: splits as i32,
            scale_log2: (self.scale * std::f64::consts::LOG2_E) as f32,
            ..AttnArgs::decode_batch(d.h, d.lkv, d.r, self.dc.s / self.dc.page)
        }
    }

    /// Elements of the output: one latent row per request and head.
    fn out_len(&self) -> usize {
        self.dc.bsz * self.dc.h * self.dims.lkv
    }
}

/// The scalar kernel's output (what each configuration is checked against) and our fastest correct
/// configuration's (what the peers are checked against).
struct Outputs {
    want: Vec<u16>,
    best: Option<(f64, Vec<u16>)>,
}

impl Session {
    /// Absorbed MQA decode over a paged latent cache (block table: a random permutation of the pool):
    /// each tile × split count, checked against the scalar kernel (one split), then the peers on the
    /// same q, cache and block table read back from the device.
    pub fn decode(
        &mut self,
        dc: DecodeCase,
        tiles: &[Tile],
        splits_list: &[usize],
    ) -> Result<CaseResult> {
        let DecodeCase {
            bsz,
            h,
            s,
            page,
            dt,
        } = dc;
        let base = v3_dims(dt);
        let filler = self.filler(dt)?;
        let (lkv, r) = (base.lkv, base.r);
        let row = lkv + r;
        let mut c = CaseResult {
            kernel: "decode",
            shape: format!(
                "B={bsz} H={h} s_k={s} page={page} d={row}/{lkv} {}",
                dt.name()
            ),
            bytes: (bsz * s * row * 2 + bsz * h * row * 2 + bsz * h * lkv * 2) as f64,
            flops: 2.0 * (bsz * h * s) as f64 * (row + lkv) as f64,
            ours: Vec::new(),
            peers: Vec::new(),
            notes: Vec::new(),
        };
        let inp = Inputs::new(dc, &filler, splits_list)?;
        // Reference output for the self-check: the scalar kernel, one split.
        let scalar = Attn::load(&mut self.k, &self.gpu, "decode.cu", &inp.dims, &[], true)?;
        scalar.run(&inp.args(1), bsz as u32)?;
        self.gpu.sync("decode (scalar reference)")?;
        let mut outs = Outputs {
            want: inp.o.read(0, inp.out_len())?,
            best: None,
        };
        for &tile in tiles {
            let att = match Attn::load(
                &mut self.k,
                &self.gpu,
                "decode.cu",
                &inp.dims,
                &[tile],
                false,
            ) {
                Ok(a) if a.uses_mma() => a,
                Ok(_) => {
                    c.notes.push(format!(
                        "decode H={h}: tile {} not available here (shared memory, or wgmma off Hopper), skipped",
                        tile.label()
                    ));
                    continue;
                }
                Err(e) => {
                    c.notes
                        .push(format!("decode H={h}: tile {}: {e}", tile.label()));
                    continue;
                }
            };
            self.decode_tile(&mut c, &att, tile, splits_list, &inp, &mut outs)?;
        }
        if self.peers.iter().all(|(_, p)| !p.has("decode")) {
            return Ok(c);
        }
        self.decode_peers(&mut c, &inp, &outs)?;
        Ok(c)
    }

    /// One tile's module: each split count on each of its schedules, timed and checked.
    fn decode_tile(
        &self,
        c: &mut CaseResult,
        att: &Attn,
        tile: Tile,
        splits_list: &[usize],
        inp: &Inputs,
        outs: &mut Outputs,
    ) -> Result<()> {
        let (bsz, h, dt) = (inp.dc.bsz, inp.dc.h, inp.dc.dt);
        for &splits in splits_list {
            for &sched in Sched::of(att) {
                let a = inp.args(splits);
                let run = || -> Result<()> {
                    match sched {
                        Sched::Small => att.run_small(&a, bsz as u32)?,
                        _ => att.run_on(&a, bsz as u32, sched == Sched::Pairs)?,
                    }
                    if splits > 1 {
                        att.combine(&a, bsz * h)?;
                    }
                    Ok(())
                };
                inp.o.write(&vec![0xffffu16; inp.out_len()])?; // NaN poison: every output must be rewritten
                run()?;
                self.gpu.sync("decode (tensor cores)")?;
                let got: Vec<u16> = inp.o.read(0, inp.out_len())?;
                let t = Self::timed(
                    format!("{}{}; splits {splits}", tile.label(), sched.label()),
                    time_us(5, 50, self.launches, run)?,
                    &got,
                    &outs.want,
                    dt,
                );
                if t.correct && outs.best.as_ref().is_none_or(|b| t.median_us < b.0) {
                    outs.best = Some((t.median_us, got));
                }
                c.ours.push(t);
            }
        }
        Ok(())
    }

    /// The peers on the same inputs: our q split as [q_nope | q_pe], the pool, each request's pages.
    fn decode_peers(&mut self, c: &mut CaseResult, inp: &Inputs, outs: &Outputs) -> Result<()> {
        let DecodeCase {
            bsz,
            h,
            s,
            page,
            dt,
        } = inp.dc;
        let (lkv, r, dv, p) = (inp.dims.lkv, inp.dims.r, inp.dims.dv, inp.dims.p);
        let (row, pages) = (lkv + r, inp.pages);
        let host_q: Vec<u16> = inp.q.read(0, bsz * h * row)?;
        let host_pool: Vec<u16> = inp.pool.read(0, pages * page * row)?;
        let (mut qn, mut qp) = (Vec::new(), Vec::new());
        for x in host_q.chunks_exact(row) {
            qn.extend_from_slice(&x[..lkv]);
            qp.extend_from_slice(&x[lkv..]);
        }
        let inputs = [
            bits("q_nope", vec![bsz, 1, h, lkv], &qn, dt),
            bits("q_pe", vec![bsz, 1, h, r], &qp, dt),
            bits("kv_cache", vec![pages, page, row], &host_pool, dt),
            ints("block_table", vec![bsz, s / page], &inp.perm),
            ints("cache_seqlens", vec![bsz], &vec![s as i32; bsz]),
        ];
        drop(host_pool);
        // vLLM's TRITON_MLA uses 4 splits (TritonMLAImpl); FlashMLA plans its own.
        let meta = serde_json::json!({
            "dtype": dt.name(), "softmax_scale": inp.scale, "heads": h, "kv_lora_rank": lkv,
            "qk_nope": p, "qk_rope": r, "v_head_dim": dv, "page_size": page,
            "num_splits": 4, "q_len": 1, "causal": true,
            "bench": {"warmup": 5, "iters": 50, "launches": self.launches},
        });
        let ours = outs.best.as_ref().map(|b| &b.1[..]);
        self.time_peers(
            c,
            "decode",
            &inputs,
            &meta,
            "attn_latent",
            &[bsz, 1, h, lkv],
            &outs.want,
            ours,
            dt,
        );
        Ok(())
    }
}
