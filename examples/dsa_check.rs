//! One DSA layer through `run::dsa` (docs/dsa.md): the sparse fp64 reference against a backend over the
//! reference's selection (every stage check), the backend's indexer selection (tie-aware), and the
//! backend over its own selection. Exit 0 pass, 1 divergence, 2 error.
//!
//! cargo run --release --example dsa_check -- FILE.gguf LAYER PROMPT_LEN DECODE_STEPS [cpu|cuda] [bf16|f16|f32]

use mla_diff::backend::cpu::indexer::Plan;
use mla_diff::backend::open::{open, Choice, Options};
use mla_diff::backend::RunTables;
use mla_diff::compare::{self, ToleranceTable};
use mla_diff::faults::Active;
use mla_diff::gguf::GgufFile;
use mla_diff::model::{IndexerConfig, IndexerWeights, LayerWeights, MlaConfig, RopeFactors};
use mla_diff::precision::Dtype;
use mla_diff::schedule::Schedule;
use mla_diff::{Error, Result};

fn main() {
    std::process::exit(match run() {
        Ok(pass) => i32::from(!pass),
        Err(e) => {
            eprintln!("mla-diff: error: {e}");
            2
        }
    })
}

fn run() -> Result<bool> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        Error::Usage(
            "usage: dsa_check FILE LAYER PROMPT_LEN DECODE_STEPS [cpu|cuda] [bf16|f16|f32]".into(),
        )
    };
    let num =
        |i: usize| -> Result<usize> { a.get(i).and_then(|s| s.parse().ok()).ok_or_else(usage) };
    let file = GgufFile::open(a.first().ok_or_else(usage)?)?;
    let (layer, prompt, decode) = (num(1)?, num(2)?, num(3)?);
    let choice = match a.get(4).map(String::as_str) {
        None | Some("cpu") => Choice::Cpu,
        Some("cuda") => Choice::Cuda,
        _ => return Err(usage()),
    };
    let dtype = match a.get(5).map(String::as_str) {
        None | Some("bf16") => Dtype::Bf16,
        Some("f16") => Dtype::F16,
        Some("f32") => Dtype::F32,
        _ => return Err(usage()),
    };
    let cfg = MlaConfig::from_gguf(&file)?;
    let ic = IndexerConfig::from_gguf(&file, &cfg)?
        .ok_or_else(|| Error::Usage("not a DSA file with indexer keys".into()))?;
    let w = LayerWeights::load(&file, &cfg, layer)?;
    let iw = IndexerWeights::load(&file, &cfg, &ic, layer)?
        .ok_or_else(|| Error::Tensor(format!("layer {layer} has no indexer tensors")))?;
    let sched = Schedule {
        prompt_len: prompt,
        chunk: 512.min(prompt.max(1)),
        decode_steps: decode,
        page_size: 64,
        num_splits: 8,
        ..Schedule::default()
    };
    sched.validate()?;
    let factors = RopeFactors::load(&file, &cfg)?;
    let tables = RunTables::new(&cfg, factors.as_ref(), &sched)?;
    let x = mla_diff::input::random_hidden(cfg.hidden, sched.total_tokens(), 0);
    let (mut backend, info) = open(
        choice,
        &Options {
            dtype,
            kernels_dir: None,
            runner: None,
            runner_page_moved: None,
            kv_format: Default::default(),
        },
    )?;
    let ctx = tables.ctx(&cfg, &w, &sched, Active::NONE);
    let d = mla_diff::run::dsa::run_layer(
        &ctx,
        &ic,
        &iw,
        backend.as_mut(),
        &x,
        dtype,
        Plan::default(),
    )?;
    let cctx = compare::Ctx {
        layer,
        elementwise: true,
        sched: &sched,
        block_table: &tables.block_table,
        provided: backend.provides(),
    };
    let r = compare::compare_layer(
        &cctx,
        &d.reference,
        &d.optimized,
        dtype,
        &ToleranceTable::defaults(),
        None,
    )?;
    println!(
        "{} | {} tokens, top_k {}, {} sparse queries",
        info.description,
        sched.total_tokens(),
        ic.top_k,
        d.ref_selection.sparse_queries()
    );
    for c in &r.checks {
        println!(
            "  {:20} {} rel-L2 {:.3e}",
            c.check,
            if c.pass { "pass" } else { "FAIL" },
            c.metrics.rel_l2
        );
    }
    println!("  {}", d.selection.summary());
    println!(
        "  own selection: attn_out rel-L2 {:.3e} vs fp64 on it; selection effect {:.3e}",
        d.own_path_error, d.selection_effect
    );
    let pass = r.pass && d.selection.pass;
    println!("{}", if pass { "PASS" } else { "FAIL" });
    Ok(pass)
}
