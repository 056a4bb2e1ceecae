//! Each convention error a reader could make (rope pairing, YaRN, kq scale, k_b transpose, ...) moves the
//! reference's output far beyond the goldens' tolerance.

use super::*;

/// A misreading to try: its name, the config and rope factors it reads, and its edit of the weights.
type Mutation = (
    &'static str,
    MlaConfig,
    Option<RopeFactors>,
    Box<dyn Fn(&mut LayerWeights)>,
);

/// Each convention error a reader could make moves the output far beyond the tolerance, so a pass above
/// means the conventions are right, not that the goldens are blind to them.
#[test]
fn goldens_detect_convention_errors() {
    let mut failures = Vec::new();
    for name in FAMILIES {
        let g = load(name);
        let theirs = g.theirs_unified();
        let none: &dyn Fn(&mut LayerWeights) = &|_| {};
        let mut cases: Vec<Mutation> = Vec::new();
        let mut cfg = g.cfg.clone();
        cfg.rope.pairing = match cfg.rope.pairing {
            RopePairing::Norm => RopePairing::Neox,
            RopePairing::Neox => RopePairing::Norm,
        };
        cases.push(("other rope pairing", cfg, g.factors.clone(), Box::new(none)));
        // FlashMLA's default: 1/sqrt(latent row) instead of 1/sqrt(qk head dim).
        let mut cfg = g.cfg.clone();
        cfg.softmax_scale = g.cfg.mscale * g.cfg.mscale / (g.cfg.cache_row() as f64).sqrt();
        cases.push((
            "scale 1/sqrt(Lkv+R)",
            cfg,
            g.factors.clone(),
            Box::new(none),
        ));
        if g.cfg.rope.yarn.is_some() {
            let mut cfg = g.cfg.clone();
            cfg.rope.yarn = None;
            cases.push(("rope without YaRN", cfg, g.factors.clone(), Box::new(none)));
            if g.cfg.mscale != 1.0 {
                let mut cfg = g.cfg.clone();
                cfg.softmax_scale = 1.0 / (g.cfg.qk_head_dim() as f64).sqrt();
                cases.push((
                    "softmax without mscale²",
                    cfg,
                    g.factors.clone(),
                    Box::new(none),
                ));
            }
            let betas = g.cfg.rope.yarn.as_ref().map(|y| (y.beta_fast, y.beta_slow));
            if betas != Some((32.0, 1.0)) {
                // A reader that ignores the file's YaRN betas (Kimi-K2: 1/1) and takes DeepSeek's 32/1.
                let mut cfg = g.cfg.clone();
                let y = cfg.rope.yarn.as_mut().unwrap();
                (y.beta_fast, y.beta_slow) = (32.0, 1.0);
                cases.push((
                    "YaRN betas 32/1 (defaults)",
                    cfg,
                    g.factors.clone(),
                    Box::new(none),
                ));
            }
            if g.cfg.rope.attn_factor != 1.0 {
                // This reader's state before the fix: cos/sin at 1 and llama.cpp's get_mscale(f, 1)² in the
                // softmax.
                let mut cfg = g.cfg.clone();
                let m =
                    mla_diff::model::Yarn::get_mscale(cfg.rope.yarn.as_ref().unwrap().factor, 1.0);
                cfg.rope.attn_factor = 1.0;
                cfg.softmax_scale = m * m / (g.cfg.qk_head_dim() as f64).sqrt();
                cases.push((
                    "cos/sin 1, softmax mscale²",
                    cfg,
                    g.factors.clone(),
                    Box::new(none),
                ));
                let mut cfg = g.cfg.clone();
                cfg.softmax_scale = m * m / (g.cfg.qk_head_dim() as f64).sqrt();
                cases.push(("llama.cpp kq_scale", cfg, g.factors.clone(), Box::new(none)));
            }
        }
        if g.cfg.rope.base != 10000.0 {
            let mut cfg = g.cfg.clone();
            cfg.rope.base = 10000.0;
            cases.push(("rope base 10000", cfg, g.factors.clone(), Box::new(none)));
        }
        if let Some(f) = &g.factors {
            let swapped = RopeFactors {
                short: f.long.clone(),
                long: f.short.clone(),
                ..f.clone()
            };
            cases.push((
                "long/short factors swapped",
                g.cfg.clone(),
                Some(swapped),
                Box::new(none),
            ));
            cases.push(("no rope factors", g.cfg.clone(), None, Box::new(none)));
        }
        let (h, p, lkv, dv) = (
            g.cfg.n_head,
            g.cfg.qk_nope,
            g.cfg.kv_lora_rank,
            g.cfg.v_head_dim,
        );
        match LayerWeights::load(&g.file, &g.cfg, 0).unwrap().kv_b_layout {
            mla_diff::model::KvBLayout::Split => {
                // A loader that forgets the converter's transpose of attn_k_b (same bytes, read as [H, P, Lkv]).
                cases.push((
                    "attn_k_b not transposed",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(move |w: &mut LayerWeights| {
                        let raw = w
                            .w_uk
                            .clone()
                            .permuted_axes([0, 2, 1])
                            .as_standard_layout()
                            .to_owned();
                        w.w_uk = raw.into_shape_with_order((h, p, lkv)).unwrap();
                    }),
                ));
            }
            mla_diff::model::KvBLayout::Unsplit if p == dv => {
                // kv_b heads read as [v | k_nope].
                cases.push((
                    "kv_b split [v | k_nope]",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(|w: &mut LayerWeights| std::mem::swap(&mut w.w_uk, &mut w.w_uv)),
                ));
            }
            mla_diff::model::KvBLayout::Unsplit => {
                // The same bytes (attn_kv_b rows, torch [H·(P+Dv), Lkv]) cut the wrong way: each head
                // as [v | k_nope], or the whole matrix as [k_nope of every head | v of every head].
                cases.push((
                    "kv_b heads [v | k_nope]",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(move |w: &mut LayerWeights| {
                        let kv_b = unsplit_rows(w);
                        let heads = kv_b.into_shape_with_order((h, p + dv, lkv)).unwrap();
                        w.w_uv = heads.slice(s![.., ..dv, ..]).to_owned();
                        w.w_uk = heads.slice(s![.., dv.., ..]).to_owned();
                    }),
                ));
                cases.push((
                    "kv_b [all k_nope | all v]",
                    g.cfg.clone(),
                    g.factors.clone(),
                    Box::new(move |w: &mut LayerWeights| {
                        let kv_b = unsplit_rows(w);
                        w.w_uk = kv_b
                            .slice(s![..h * p, ..])
                            .to_owned()
                            .into_shape_with_order((h, p, lkv))
                            .unwrap();
                        w.w_uv = kv_b
                            .slice(s![h * p.., ..])
                            .to_owned()
                            .into_shape_with_order((h, dv, lkv))
                            .unwrap();
                    }),
                ));
            }
        }
        // kv_a output rows read as [k_pe | latent].
        cases.push((
            "kv_a rows [k_pe | latent]",
            g.cfg.clone(),
            g.factors.clone(),
            Box::new(move |w: &mut LayerWeights| {
                let rolled = ndarray::concatenate(
                    Axis(0),
                    &[w.kv_a.slice(s![lkv.., ..]), w.kv_a.slice(s![..lkv, ..])],
                )
                .unwrap();
                w.kv_a = rolled;
            }),
        ));
        for (what, cfg, factors, edit) in &cases {
            let e = errors(&g.run_with(cfg, factors.as_ref(), edit.as_ref()), theirs);
            let min = e.iter().copied().fold(f64::INFINITY, f64::min);
            println!("{name:27} {what:28} rel-L2 [{}]", fmt(&e));
            if min.is_nan() || min <= DETECT {
                failures.push(format!("{name}: {what} gives only [{}]", fmt(&e)));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
