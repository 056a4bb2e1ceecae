//! The glm5-next golden (#37): transformers' `Glm5NextTextModel` (KDA layer 0, NoPE MLA layers 1..3,
//! layer 2 "shared"), index_topk 16 with kpool 4 over 40 + 12 tokens in two forward passes on one cache,
//! converted by llama.cpp's own converter (fixtures/golden/glm5_next.py). The fp64 k-pool indexer must
//! select transformers' keys and the sparse reference give its attention output within 1e-6, per MLA
//! layer and pass; each misreading of the k-pool must move that output by far more.

use crate::common::fixture;
use mla_diff::compare::metrics::rel_l2;
use mla_diff::gguf::GgufFile;
use mla_diff::input::{load_npy, LayerInputs};
use mla_diff::model::{KpoolIndexer, KpoolLayer, LayerWeights, MlaConfig};
use mla_diff::reference::kpool::{self, Reading};
use mla_diff::reference::sparse::Selection;
use mla_diff::rope::RopeTables;
use mla_diff::schedule::Schedule;
use mla_diff::trace::Stage;
use ndarray::{Array2, Array3, Axis};

const TOL: f64 = 1e-6;
const DETECT: f64 = 100.0 * TOL;
/// The two forward passes' rows (prompt, continuation).
const PASSES: [std::ops::Range<usize>; 2] = [0..40, 40..52];
const T: usize = 52;

struct Golden {
    file: GgufFile,
    cfg: MlaConfig,
    k: KpoolIndexer,
    /// The MLA layers, in file order (the .npy rows).
    mla: Vec<usize>,
    x: Array3<f64>,
    out: Array3<f64>,
    /// transformers' top-k of each full layer, `[full layers][T][top_k + kpool - 1]` (-1 = none).
    topk: Vec<Vec<Vec<u32>>>,
}

fn per_layer(name: &str, hidden: usize) -> Array3<f64> {
    match load_npy(&fixture("golden").join(name), hidden, T).unwrap() {
        LayerInputs::PerLayer(a) => a,
        _ => panic!("{name}: [layers, T, hidden]"),
    }
}

fn load() -> Golden {
    let file = GgufFile::open(fixture("golden").join("glm5-next.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let k = KpoolIndexer::from_gguf(&file, &cfg).unwrap().unwrap();
    let mla = mla_diff::model::HybridLayout::from_gguf(&file)
        .unwrap()
        .unwrap()
        .mla_layers;
    let x = per_layer("glm5-next.attn_in.npy", cfg.hidden);
    let out = per_layer("glm5-next.attn_out.npy", cfg.hidden);
    let topk = crate::dsa_golden::load_topk(&fixture("golden").join("glm5-next.topk.npy"));
    Golden {
        file,
        cfg,
        k,
        mla,
        x,
        out,
        topk,
    }
}

/// How a layer's selection is made.
#[derive(Clone, Copy)]
enum Sel {
    /// The model: a full layer runs its indexer, a shared one reuses the previous full layer's.
    Model(Reading),
    /// A shared layer recomputes the selection on its own input with the previous full layer's indexer.
    SharedRunsItsOwn,
    Dense,
}

impl Golden {
    fn row(&self, l: usize) -> usize {
        self.mla.iter().position(|&m| m == l).unwrap()
    }
    fn attn_in(&self, l: usize) -> (LayerWeights, Array2<f64>) {
        let w = LayerWeights::load(&self.file, &self.cfg, l).unwrap();
        let x = self.x.index_axis(Axis(0), self.row(l)).to_owned();
        let a = mla_diff::reference::front::attn_in(&self.cfg, &w, x.view());
        (w, a)
    }
    /// The k-pool indexer of full layer `full` on layer `on`'s input.
    fn index(&self, full: usize, on: usize, r: Reading) -> kpool::KpoolOut {
        let kw = KpoolLayer::load(&self.file, &self.cfg, &self.k, full)
            .unwrap()
            .unwrap();
        let (w, _) = self.attn_in(full);
        let (_, a) = self.attn_in(on);
        kpool::run(&self.cfg, &self.k, &kw, &w, a.view(), r)
    }
    fn selection(&self, l: usize, how: Sel) -> Selection {
        let src = if self.k.is_full(l) {
            l
        } else {
            self.k.source_of(l, &self.mla).unwrap()
        };
        match how {
            Sel::Dense => Selection::dense(self.k.ic.top_k, T),
            Sel::Model(r) => self.index(src, src, r).selection,
            Sel::SharedRunsItsOwn => self.index(src, l, Reading::default()).selection,
        }
    }
    fn output(&self, l: usize, sel: &Selection) -> Array2<f64> {
        let sched = Schedule {
            prompt_len: T,
            chunk: T,
            decode_steps: 0,
            ..Schedule::default()
        };
        let rope = RopeTables::for_run(&self.cfg, None, 0, T).unwrap();
        let w = LayerWeights::load(&self.file, &self.cfg, l).unwrap();
        let x = self.x.index_axis(Axis(0), self.row(l)).to_owned();
        let tr = mla_diff::reference::run_layer_sel(&self.cfg, &w, &rope, &x, &sched, Some(sel))
            .unwrap();
        let o = tr.get(Stage::AttnOut).unwrap();
        Array2::from_shape_vec((T, self.cfg.hidden), o.data.clone()).unwrap()
    }
    /// rel-L2 against transformers per pass.
    fn errors(&self, l: usize, o: &Array2<f64>) -> [f64; 2] {
        let theirs = self.out.index_axis(Axis(0), self.row(l));
        PASSES.map(|p| {
            let a: Vec<f64> = theirs
                .slice(ndarray::s![p.clone(), ..])
                .iter()
                .copied()
                .collect();
            let b: Vec<f64> = o
                .slice(ndarray::s![p.clone(), ..])
                .iter()
                .copied()
                .collect();
            if b.iter().any(|v| !v.is_finite()) {
                f64::INFINITY
            } else {
                rel_l2(&a, &b)
            }
        })
    }
    /// transformers' selection of query `q` on layer `l` (a shared layer: its source's).
    fn theirs(&self, l: usize, q: usize) -> Vec<u32> {
        let src = if self.k.is_full(l) {
            l
        } else {
            self.k.source_of(l, &self.mla).unwrap()
        };
        let i = self
            .mla
            .iter()
            .filter(|&&m| self.k.is_full(m))
            .position(|&m| m == src)
            .unwrap();
        let mut v: Vec<u32> = self.topk[i][q]
            .iter()
            .copied()
            .filter(|&j| (j as usize) < T)
            .collect();
        v.sort_unstable();
        v
    }
}

/// Where the two selections of query `q` differ, only by whole pools whose fp64 scores equal the
/// boundary (the last chosen pool's) score: exact ties (ReLU zeros: every head's logit negative), which
/// `torch.topk` breaks its own way and the reference to the lower pool. `None`: equal.
fn tie_only(o: &kpool::KpoolOut, ours: &[u32], theirs: &[u32], q: usize) -> Option<bool> {
    if ours == theirs {
        return None;
    }
    let kpool = 4;
    let pool_of = |j: u32| {
        o.pool_start
            .iter()
            .position(|&s| s as u32 == j - j % kpool as u32)
    };
    let boundary = o.pools[q]
        .iter()
        .map(|&p| o.pool_scores[[q, p as usize]])
        .fold(f64::INFINITY, f64::min);
    let scale = (0..o.pool_start.len())
        .map(|p| o.pool_scores[[q, p]].abs())
        .fold(0.0, f64::max);
    let differ = ours
        .iter()
        .filter(|j| !theirs.contains(j))
        .chain(theirs.iter().filter(|j| !ours.contains(j)));
    Some(differ.copied().all(|j| {
        pool_of(j).is_some_and(|p| (o.pool_scores[[q, p]] - boundary).abs() <= 1e-9 * scale)
    }))
}

#[test]
fn kpool_reference_matches_transformers() {
    let g = load();
    assert_eq!(g.mla, vec![1, 2, 3]);
    assert_eq!(
        (g.k.ic.top_k, g.k.kp.kpool, g.k.kp.select_tail),
        (16, 4, true)
    );
    assert_eq!((g.k.is_full(2), g.k.source_of(2, &g.mla)), (false, Some(1)));
    let mut failures = Vec::new();
    for &l in &g.mla {
        let src = if g.k.is_full(l) {
            l
        } else {
            g.k.source_of(l, &g.mla).unwrap()
        };
        let o = g.index(src, src, Reading::default());
        let (mut equal, mut ties) = (0, 0);
        for q in 0..T {
            match tie_only(&o, &o.selection.keys[q], &g.theirs(l, q), q) {
                None => equal += 1,
                Some(true) => ties += 1,
                Some(false) => failures.push(format!(
                    "layer {l} query {q}: {:?} vs transformers {:?}",
                    o.selection.keys[q],
                    g.theirs(l, q)
                )),
            }
        }
        // Attention over transformers' selection (ties broken its way), and over ours.
        let theirs = Selection::new(g.k.ic.top_k, (0..T).map(|q| g.theirs(l, q)).collect());
        let e = g.errors(l, &g.output(l, &theirs));
        let own = g.errors(l, &g.output(l, &o.selection));
        println!(
            "glm5-next layer {l} ({}): rel-L2 pass 1 {:.2e}, pass 2 {:.2e} (over the reference's own selection {:.2e}, {:.2e}); selections equal on {equal} of {T} queries, the other {ties} differ by exactly tied pools only; sparse queries {}",
            if g.k.is_full(l) { "full" } else { "shared" },
            e[0], e[1], own[0], own[1], o.selection.sparse_queries()
        );
        if e.iter().any(|&v| v > TOL) {
            failures.push(format!("layer {l}: rel-L2 {} > {TOL:.0e}", fmt(e.iter())));
        }
        if ties > 8 {
            failures.push(format!(
                "layer {l}: {ties} queries with ties: the golden no longer pins the selection"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn kpool_misreadings_move_the_output() {
    let g = load();
    let d = Reading::default();
    let cases: [(&str, Sel); 6] = [
        ("dense attention (no k-pool)", Sel::Dense),
        ("APE dropped", Sel::Model(Reading { no_ape: true, ..d })),
        (
            "pool softmax over channels",
            Sel::Model(Reading {
                softmax_over_channels: true,
                ..d
            }),
        ),
        (
            "tail not appended",
            Sel::Model(Reading { no_tail: true, ..d }),
        ),
        (
            "pools from slot 0 of a 2-left-padded batch",
            Sel::Model(Reading {
                pools_from_slot_zero: 2,
                ..d
            }),
        ),
        ("shared layer runs its own indexer", Sel::SharedRunsItsOwn),
    ];
    let mut failures = Vec::new();
    for (what, how) in cases {
        let layers: Vec<usize> = match how {
            Sel::SharedRunsItsOwn => vec![2],
            _ => g.mla.clone(),
        };
        let e: Vec<[f64; 2]> = layers
            .iter()
            .map(|&l| g.errors(l, &g.output(l, &g.selection(l, how))))
            .collect();
        println!(
            "glm5-next {what}: layers {layers:?} {}",
            fmt(e.iter().flatten())
        );
        if e.iter().flatten().all(|&v| v <= DETECT) {
            failures.push(format!(
                "{what}: {} not above {DETECT:.0e}",
                fmt(e.iter().flatten())
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn fmt<'a>(e: impl Iterator<Item = &'a f64>) -> String {
    e.map(|v| format!("{v:.2e}")).collect::<Vec<_>>().join(", ")
}

/// The converter's k-pool tensors: F32 (its `tensor_force_quant`), gate ne {E, Di} and APE ne {Di, kpool}
/// (torch [Di, E] and [kpool, Di], untransposed) on the full layers, none on the shared one — what
/// `model::kpool` reads and `fixture --preset glm5-next` writes.
#[test]
fn the_converter_writes_the_kpool_tensors_as_read() {
    let g = load();
    for (l, present) in [(1, true), (2, false), (3, true)] {
        let names = mla_diff::model::kpool::tensor_names(l);
        let ts: Vec<_> = names.iter().map(|n| g.file.tensor(n)).collect();
        assert_eq!(ts.iter().all(|t| t.is_some()), present, "layer {l}");
        if present {
            let (gate, ape) = (ts[0].unwrap(), ts[1].unwrap());
            assert_eq!(
                (gate.ne.clone(), ape.ne.clone()),
                (vec![128, 32], vec![32, 4])
            );
            assert!(
                format!("{:?}", gate.ty).contains("F32") && format!("{:?}", ape.ty).contains("F32")
            );
        }
    }
}
