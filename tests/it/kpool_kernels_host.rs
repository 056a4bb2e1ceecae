//! kernels/kpool.cu (glm5-next's k-pool indexer) without a GPU: compiled for the host with CUDA emulated
//! (tests/data/kernels_host.h), fed what `backend::cuda::kpool::inputs` prepares from the glm5-next golden
//! and launched with its `Geometry`, through the same steps as `cuda::kpool::run` (pool, the host's fp8
//! step, scores and top-k). Checked: the pooled keys against fp64 pooling of the same inputs (within the
//! dtype's rounding), the selection against `reference::kpool::select` on the kernel's own scores
//! (exactly), the scores and the selection against the CPU mirror's (`backend::cpu::kpool::run`). Each
//! k-pool fault must fail that check (the kernel ones compiled in: the harness holds a copy of the kernel
//! per fault, `#define`d before it; `kpool_from_position_zero` is the host's grid origin) and pass the
//! same check against the mirror with the fault planted. Needs a C++20 compiler (`CXX`, else `c++`).

use super::common::{compiler, fixture};
use super::v4_kernels_host::host_inc;
use mla_diff::backend::cpu::kpool::{self as mirror, KpoolPlan, MirrorKpool};
use mla_diff::backend::cuda::kpool::{self as gpu, Inputs};
use mla_diff::faults::{Active, Fault};
use mla_diff::gguf::GgufFile;
use mla_diff::model::{KpoolIndexer, KpoolLayer, KpoolWeights, LayerWeights, MlaConfig};
use mla_diff::precision::{Dtype, KeyPrecision};
use mla_diff::reference::kpool::{pool_keys, select, Reading};
use mla_diff::reference::sparse::Selection;
use mla_diff::rope::RopeTables;
use ndarray::Array2;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Tokens per case: 10 pools of 4, the golden's top_k 16 (4 pools) passed from query 19 on.
const T: usize = 42;

/// A full layer of the glm5-next golden (8 indexer heads of 32, kpool 4) on a random input.
struct Layer {
    cfg: MlaConfig,
    k: KpoolIndexer,
    kw: KpoolLayer,
    w: LayerWeights,
    rope: RopeTables,
    x: Array2<f64>,
}

fn golden(layer: usize, pos_offset: usize) -> Layer {
    let file = GgufFile::open(fixture("golden").join("glm5-next.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let k = KpoolIndexer::from_gguf(&file, &cfg).unwrap().unwrap();
    let kw = KpoolLayer::load(&file, &cfg, &k, layer).unwrap().unwrap();
    let w = LayerWeights::load(&file, &cfg, layer).unwrap();
    let rope = RopeTables::for_run(&cfg, None, pos_offset, T).unwrap();
    let mut s = 0x9e3779b97f4a7c15u64 + layer as u64;
    let x = Array2::from_shape_fn((T, cfg.hidden), |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 3.4 - 1.7
    });
    Layer {
        cfg,
        k,
        kw,
        w,
        rope,
        x,
    }
}

impl Layer {
    fn plan(&self, fault: Option<Fault>, keys: KeyPrecision, pos_offset: usize) -> KpoolPlan {
        let fx = fault.map_or(Active::NONE, |f| Active::NONE.with(f));
        mirror::plan_for(fx, keys, pos_offset)
    }
    fn inputs(&self, dt: Dtype, plan: KpoolPlan) -> Inputs {
        let (c, k, kw, w) = (&self.cfg, &self.k, &self.kw, &self.w);
        gpu::inputs(c, k, kw, w, &self.rope, &self.x, dt, plan).unwrap()
    }
    fn mirror(&self, dt: Dtype, plan: KpoolPlan) -> MirrorKpool {
        let (c, k, kw, w) = (&self.cfg, &self.k, &self.kw, &self.w);
        mirror::run(c, k, kw, w, &self.rope, &self.x, dt, plan).unwrap()
    }
}

/// The harness binary for `dt`: kernels/kpool.cu at the golden's dims, once clean and once per kernel
/// fault (its variants), compiled in a child process.
fn build(cxx: &str, dir: &Path, dt: Dtype) -> std::process::Child {
    let code = match dt {
        Dtype::Bf16 => 0,
        Dtype::F16 => 1,
        Dtype::F32 => 2,
    };
    let host = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    Command::new(cxx)
        .args(["-O1", "-std=c++20", "-ffp-contract=off", "-pthread"])
        .args(["-DKP_H=8", "-DKP_D=32", "-DKP_N=4"])
        .arg(format!("-DMLA_DTYPE={code}"))
        .arg(format!("-I{}", dir.display()))
        .arg(format!("-I{}", host.display()))
        .arg(host.join("kpool_kernels_host.cpp"))
        .arg("-o")
        .arg(dir.join(format!("kpool-{}", dt.name())))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn f32s(a: impl IntoIterator<Item = f32>) -> Vec<u8> {
    a.into_iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Run `stage` of the harness's `variant` on `inp` (and the pooled keys `pooled`); its output bytes.
fn harness(bin: &Path, variant: &str, stage: &str, inp: &Inputs, pooled: &Array2<f32>) -> Vec<u8> {
    let g = inp.geometry();
    let h = [
        T as u32,
        inp.n_pools as u32,
        inp.origin as u32,
        inp.budget as u32,
        inp.tail as u32,
        g.width as u32,
        g.pool.0 .0,
        g.pool.1,
        g.scores.0 .0,
        g.scores.0 .1,
        g.scores.1,
        g.topk.0 .0,
        g.topk.1,
        0,
        0,
        0,
    ];
    let mut bytes: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend(f32s(inp.q.iter().copied()));
    for a in [&inp.k, &inp.g, &inp.ape, &inp.weights, pooled] {
        bytes.extend(f32s(a.iter().copied()));
    }
    let dir = bin.parent().unwrap();
    let (i, o) = (
        dir.join(format!("{variant}.in")),
        dir.join(format!("{variant}.out")),
    );
    std::fs::write(&i, bytes).unwrap();
    let r = Command::new(bin)
        .args([variant, stage])
        .args([&i, &o])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    std::fs::read(&o).unwrap()
}

/// What the kernels computed.
struct Out {
    pooled: Array2<f32>,
    scores: Array2<f32>,
    selection: Selection,
}

/// `cuda::kpool::run`'s steps through the harness: pool, (fp8: the host's step), scores and top-k.
fn kernels(bin: &Path, variant: &str, inp: &Inputs) -> Out {
    let di = inp.k.ncols();
    let none = Array2::zeros((inp.n_pools, di));
    let b = harness(bin, variant, "pool", inp, &none);
    let f: Vec<f32> = b
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let pooled = Array2::from_shape_vec((inp.n_pools, di), f).unwrap();
    let (mut q, mut keys) = (inp.q.clone(), pooled.clone());
    if inp.keys == KeyPrecision::Fp8 {
        gpu::fp8_scaled(&mut q, &mut keys);
    }
    let scored = Inputs { q, ..inp.clone() };
    let b = harness(bin, variant, "select", &scored, &keys);
    let n = T * inp.n_pools;
    let s: Vec<f32> = b[..4 * n]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let rows: Vec<i32> = b[4 * n..]
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Out {
        pooled,
        scores: Array2::from_shape_vec((T, inp.n_pools), s).unwrap(),
        selection: gpu::selection(&rows, inp.geometry().width, inp.top_k).unwrap(),
    }
}

/// The kernels' result against the model read as `r` and the mirror's `m` on the same inputs: Ok with the
/// pooled keys' worst error (in units of the dtype's rounding of the key's scale `Σ p·|k|`) and the
/// scores' (relative to the row's largest), Err naming the first check that fails.
fn check(
    l: &Layer,
    inp: &Inputs,
    o: &Out,
    m: &MirrorKpool,
    r: Reading,
    dt: Dtype,
) -> Result<(f64, f64), String> {
    let start: Vec<usize> = (0..inp.n_pools)
        .map(|p| inp.origin + p * inp.kpool)
        .collect();
    let pw = KpoolWeights {
        gate: Array2::zeros((0, 0)),
        ape: inp.ape.clone(),
    };
    let (k64, g64) = (inp.k.mapv(f64::from), inp.g.mapv(f64::from));
    let want = pool_keys(&k64, &g64, &pw, &start, r);
    let scale = pool_keys(&k64.mapv(f64::abs), &g64, &pw, &start, r);
    // The dtype's rounding (≤ 1 unit), and the f32 softmax and sum over kpool slots (≤ kpool + 4 ulp).
    let unit = dt.round_unit();
    let bound = 1.0 + (inp.kpool + 4) as f64 * 2f64.powi(-24) / unit;
    let mut pooled = 0f64;
    for ((&got, &w), &s) in o.pooled.iter().zip(want.iter()).zip(scale.iter()) {
        pooled = pooled.max((got as f64 - w).abs() / (unit * s.max(1e-30)));
    }
    if pooled > bound {
        return Err(format!(
            "pooled keys off fp64 pooling by {pooled:.1} units of rounding (bound {bound:.1})"
        ));
    }
    let (_, sel) = select(&o.scores.mapv(f64::from), &start, &l.k, r);
    if sel != o.selection {
        let q = (0..T)
            .find(|&t| sel.keys[t] != o.selection.keys[t])
            .unwrap();
        return Err(format!(
            "query {q}: the kernel selected {:?}, its own scores select {:?}",
            o.selection.keys[q], sel.keys[q]
        ));
    }
    let (differ, worst) = gpu::against_mirror(m, &o.selection, &o.scores, inp);
    if worst > 1e-5 || differ > 0 {
        return Err(format!(
            "against the mirror: selections differ in {differ} keys, scores by {worst:.1e} of the row"
        ));
    }
    Ok((pooled, worst))
}

#[test]
fn kpool_kernels_compute_the_mirrors_indexer_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("SKIPPED: no C++ compiler");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    host_inc(dir.path(), "kernels/kpool.cu", "kpool.inc");
    let builds: Vec<(Dtype, std::process::Child)> = [Dtype::Bf16, Dtype::F32]
        .into_iter()
        .map(|dt| (dt, build(&cxx, dir.path(), dt)))
        .collect();
    let l = golden(1, 0);
    let bins: Vec<(Dtype, PathBuf)> = builds
        .into_iter()
        .map(|(dt, c)| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            (dt, dir.path().join(format!("kpool-{}", dt.name())))
        })
        .collect();
    // Clean: bf16 and f32 storage, bf16 with fp8 keys.
    for (dt, bin) in &bins {
        let fp8 = [KeyPrecision::Storage, KeyPrecision::Fp8];
        for keys in fp8.into_iter().take(if *dt == Dtype::Bf16 { 2 } else { 1 }) {
            let plan = l.plan(None, keys, 0);
            let inp = l.inputs(*dt, plan);
            let o = kernels(bin, "clean", &inp);
            let (pooled, scores) = check(&l, &inp, &o, &l.mirror(*dt, plan), plan.reading, *dt)
                .unwrap_or_else(|e| panic!("{} {keys:?}: {e}", dt.name()));
            println!(
                "kpool.cu on the host, {} {keys:?}, {T} tokens: pooled keys within {pooled:.2} units of rounding of fp64, scores within {scores:.1e} of the mirror's, selections equal",
                dt.name()
            );
        }
    }
    negative_cases(&l, &bins[0].1);
}

/// Each k-pool fault of the kernels and the host (bf16): the clean check fails, the check against the
/// mirror with the fault planted passes.
fn negative_cases(l: &Layer, bin: &Path) {
    let dt = Dtype::Bf16;
    let clean = l.plan(None, KeyPrecision::Storage, 0);
    let clean_m = l.mirror(dt, clean);
    for (variant, fault, pos) in [
        ("no_ape", Fault::KpoolNoApe, 0),
        ("softmax_channels", Fault::KpoolSoftmaxChannels, 0),
        ("no_tail", Fault::KpoolNoTail, 0),
        ("clean", Fault::KpoolFromPositionZero, 5),
    ] {
        let plan = l.plan(Some(fault), KeyPrecision::Storage, pos);
        let inp = l.inputs(dt, plan);
        let o = kernels(bin, variant, &inp);
        let caught = check(l, &inp, &o, &clean_m, clean.reading, dt)
            .expect_err(&format!("{fault:?} passed the clean check"));
        check(l, &inp, &o, &l.mirror(dt, plan), plan.reading, dt)
            .unwrap_or_else(|e| panic!("{fault:?} against the mirror with it planted: {e}"));
        println!("{fault:?}: caught ({caught}); equal to the mirror's with it planted");
    }
}
