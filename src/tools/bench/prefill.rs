//! `bench prefill`: causal prefill flash attention in the decompressed (MHA) form, every tile checked
//! against the scalar kernel, then the peers on the same inputs.

use super::measure::{bits, time_us};
use super::session::{v3_dims, CaseResult, Session};
use crate::backend::cuda::args::AttnArgs;
use crate::backend::cuda::attn::{Attn, PrefillLaunch};
use crate::backend::cuda::device::DevBuf;
use crate::error::Result;
use crate::model::catalogue::Entry;
use crate::precision::Dtype;
use crate::tiles::{Dims, Tile};

/// One prefill case's inputs on the device, the launch arguments, and the outputs.
struct Inputs {
    t: usize,
    dims: Dims,
    q: DevBuf,
    kn: DevBuf,
    kpe: DevBuf,
    v: DevBuf,
    o: DevBuf,
    /// Written by every launch, read by none: kept alive for them.
    _lse: DevBuf,
    a: AttnArgs,
    /// The scalar kernel's output (what each tile is checked against).
    want: Vec<u16>,
    /// Our fastest correct tile's output (what the peers are checked against).
    best: Option<(f64, Vec<u16>)>,
}

impl Inputs {
    fn out_len(&self) -> usize {
        self.t * self.dims.h * self.dims.dv
    }
}

impl Session {
    /// Causal prefill flash attention over T tokens in the decompressed (MHA) form at `m`'s head dims.
    pub fn prefill(
        &mut self,
        m: &Entry,
        t: usize,
        dt: Dtype,
        tiles: &[Tile],
    ) -> Result<CaseResult> {
        let (h, p, r, dv) = (m.heads, m.qk_nope, m.qk_rope, m.v_head);
        let dqk = p + r;
        let filler = self.filler(dt)?;
        let dims = Dims {
            h,
            p,
            r,
            dv,
            lkv: m.kv_lora,
            page: 64,
            ..v3_dims(dt)
        };
        let mut c = CaseResult {
            kernel: "prefill",
            shape: format!("T={t} H={h} qk {dqk} / v {dv} causal {}", dt.name()),
            bytes: ((t * h * (dqk + p + dv + dv)) * 2 + t * r * 2) as f64,
            flops: (h * t * t) as f64 * (dqk + dv) as f64,
            ours: Vec::new(),
            peers: Vec::new(),
            notes: Vec::new(),
        };
        let q = DevBuf::alloc(t * h * dqk * 2)?;
        let kn = DevBuf::alloc(t * h * p * 2)?;
        let kpe = DevBuf::alloc(t * r * 2)?;
        let v = DevBuf::alloc(t * h * dv * 2)?;
        let o = DevBuf::alloc(t * h * dv * 2)?;
        let lse = DevBuf::alloc(t * h * 4)?;
        filler.fill(&q, t * h * dqk, 21, 1.0)?;
        filler.fill(&kn, t * h * p, 22, 1.0)?;
        filler.fill(&kpe, t * r, 23, 1.0)?;
        filler.fill(&v, t * h * dv, 24, 1.0)?;
        let a = AttnArgs {
            q: q.ptr,
            ka: kn.ptr,
            kb: kpe.ptr,
            v: v.ptr,
            out: o.ptr,
            lse: lse.ptr,
            n_keys: t as i32,
            n_q: t as i32,
            causal: 1,
            scale_log2: (1.0 / (dqk as f64).sqrt() * std::f64::consts::LOG2_E) as f32,
            ..AttnArgs::prefill_layout(h, p, r, dv, r)
        };
        let scalar = Attn::load(&mut self.k, &self.gpu, "prefill.cu", &dims, &[], true)?;
        scalar.run(&a, 1)?;
        self.gpu.sync("prefill (scalar reference)")?;
        let want: Vec<u16> = o.read(0, t * h * dv)?;
        let mut inp = Inputs {
            t,
            dims,
            q,
            kn,
            kpe,
            v,
            o,
            _lse: lse,
            a,
            want,
            best: None,
        };
        for &tile in tiles {
            let att = match Attn::load(
                &mut self.k,
                &self.gpu,
                "prefill.cu",
                &inp.dims,
                &[tile],
                false,
            ) {
                Ok(a) if a.uses_mma() => a,
                Ok(_) => continue,
                Err(e) => {
                    c.notes
                        .push(format!("prefill H={h}: tile {}: {e}", tile.label()));
                    continue;
                }
            };
            self.prefill_tile(&mut c, &att, tile, &mut inp)?;
        }
        if self.peers.iter().all(|(_, p)| !p.has("prefill")) {
            return Ok(c);
        }
        self.prefill_peers(&mut c, m, dt, &inp)?;
        Ok(c)
    }

    /// One tile, timed and checked. The Hopper kernel takes its operands' tensor maps as a parameter
    /// (TMA loads where they encode, cp.async otherwise): launched through PrefillLaunch, not Attn::run.
    fn prefill_tile(
        &mut self,
        c: &mut CaseResult,
        att: &Attn,
        tile: Tile,
        inp: &mut Inputs,
    ) -> Result<()> {
        let (h, dt) = (inp.dims.h, inp.dims.dtype);
        let wg = PrefillLaunch::find(&mut self.k, att, &inp.dims)?;
        let a = &inp.a;
        let maps = match &wg {
            Some(l) => l.maps(a)?,
            None => crate::backend::cuda::tma::PrefillMaps::OFF,
        };
        if maps.on() {
            c.notes
                .push(format!("prefill H={h}: tile {}: TMA loads", tile.label()));
        }
        let go = || match &wg {
            Some(l) => l.run_with(a, &maps),
            None => att.run(a, 1),
        };
        inp.o.write(&vec![0xffffu16; inp.out_len()])?;
        go()?;
        self.gpu.sync("prefill (tensor cores)")?;
        let got: Vec<u16> = inp.o.read(0, inp.out_len())?;
        let tm = Self::timed(
            tile.label(),
            time_us(3, 20, self.launches, go)?,
            &got,
            &inp.want,
            dt,
        );
        if tm.correct && inp.best.as_ref().is_none_or(|b| tm.median_us < b.0) {
            inp.best = Some((tm.median_us, got));
        }
        c.ours.push(tm);
        Ok(())
    }

    /// The peers' inputs (decompressed MHA form): q, k = [k_nope | k_pe broadcast], v.
    fn prefill_peers(
        &mut self,
        c: &mut CaseResult,
        m: &Entry,
        dt: Dtype,
        inp: &Inputs,
    ) -> Result<()> {
        let t = inp.t;
        let (h, p, r, dv) = (inp.dims.h, inp.dims.p, inp.dims.r, inp.dims.dv);
        let dqk = p + r;
        let (hq, hkn, hkpe, hv): (Vec<u16>, Vec<u16>, Vec<u16>, Vec<u16>) = (
            inp.q.read(0, t * h * dqk)?,
            inp.kn.read(0, t * h * p)?,
            inp.kpe.read(0, t * r)?,
            inp.v.read(0, t * h * dv)?,
        );
        let mut hk = Vec::with_capacity(t * h * dqk);
        for j in 0..t {
            for hh in 0..h {
                hk.extend_from_slice(&hkn[(j * h + hh) * p..(j * h + hh + 1) * p]);
                hk.extend_from_slice(&hkpe[j * r..(j + 1) * r]);
            }
        }
        let inputs = [
            bits("q", vec![t, h, dqk], &hq, dt),
            bits("k", vec![t, h, dqk], &hk, dt),
            bits("v", vec![t, h, dv], &hv, dt),
        ];
        let meta = serde_json::json!({
            "dtype": dt.name(), "softmax_scale": 1.0 / (dqk as f64).sqrt(), "heads": h,
            "kv_lora_rank": m.kv_lora, "qk_nope": p, "qk_rope": r, "v_head_dim": dv,
            "page_size": 64, "num_splits": 1, "q_len": 1, "causal": true, "context_len": 0,
            "bench": {"warmup": 3, "iters": 20, "launches": self.launches},
        });
        let ours = inp.best.as_ref().map(|b| &b.1[..]);
        self.time_peers(
            c,
            "prefill",
            &inputs,
            &meta,
            "attn_heads",
            &[t, h, dv],
            &inp.want,
            ours,
            dt,
        );
        Ok(())
    }
}
