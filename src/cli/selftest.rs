//! `mla-diff selftest`: every fault of the catalogue planted and looked for.

use mla_diff::backend::{Choice, Factory, Kind};
use mla_diff::error::{Error, EXIT_DIVERGENCE, EXIT_PASS};
use mla_diff::faults::Fault;
use mla_diff::run::v4::engine::V4Backend;
use mla_diff::selftest;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = Kind::Cpu)]
    backend: Kind,
    /// Read the kernel sources from this directory instead of the embedded copy (CUDA backend): the
    /// catalogue planted into edited kernels, with no rebuild.
    #[arg(long)]
    kernels: Option<PathBuf>,
    /// Write the selftest's fixtures into this directory and keep them (default: a temporary one).
    #[arg(long)]
    fixtures: Option<PathBuf>,
    /// Only these faults (repeatable; default: the whole catalogue).
    #[arg(long = "fault", value_name = "NAME")]
    only: Vec<String>,
    /// Seed of the random layer inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the catalogue (name, define, expected stage, needs, the bug it models, CUDA site) and exit.
    #[arg(long)]
    list: bool,
    /// Measure instead: the smallest error each check catches (Gaussian noise, a constant bias, one
    /// row), in units of that check's clean error, on layer 1 of every selftest fixture (bf16, the
    /// default schedule). A measurement: exits 0.
    #[arg(long)]
    sensitivity: bool,
}

impl Args {
    fn options(&self) -> Result<selftest::Options, Error> {
        let only = self
            .only
            .iter()
            .map(|n| {
                Fault::from_name(n).ok_or_else(|| {
                    Error::Usage(format!(
                        "--fault {n:?}: unknown fault; the catalogue: {}",
                        mla_diff::faults::catalogue_names()
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // DeepSeek-V4's faults run on V4's own path: its CUDA kernels with `--backend cuda`, else the
        // V4 CPU mirror (as `run` on a V4 file).
        let v4 = match self.backend {
            Kind::Cuda => V4Backend::Cuda {
                kernels_dir: self.kernels.clone(),
            },
            _ => V4Backend::Cpu,
        };
        Ok(selftest::Options {
            fixtures: self.fixtures.clone(),
            only,
            seed: self.seed,
            v4: Some(v4),
        })
    }
}

pub fn exec(a: Args) -> Result<i32, Error> {
    if a.list {
        print!("{}", mla_diff::faults::list_text());
        return Ok(EXIT_PASS);
    }
    if a.sensitivity {
        return sensitivity(&a);
    }
    let opts = a.options()?;
    println!("mla-diff selftest: backend {}, every fault injected into layer {} of a {}-layer fixture (glm5-next's: its first MLA layer 3, or its shared layer {}; DeepSeek-V4's: the layer kind it needs), shadow mode", a.backend.name(), selftest::TARGET, selftest::LAYERS, selftest::GLM5_NEXT.shared);
    // One GPU context and kernel cache for all cases (opened by the first case).
    let mut backends = Factory::new();
    let factory: &mut selftest::BackendFactory = &mut |dtype, kv_format, _faults| {
        let o = mla_diff::backend::Options {
            dtype,
            kernels_dir: a.kernels.clone(),
            runner: None,
            runner_page_moved: None,
            kv_format,
        };
        backends.open(Choice::from(a.backend), &o)
    };
    let summary = selftest::run(&opts, factory, &mut |o| println!("{}", o.line()))?;
    println!("\n{}", summary.matrix());
    let controls = summary.controls_matrix();
    if controls.lines().count() > 2 {
        println!("Controls: each fault on a run lacking one of its needs must stay undetected.\n\n{controls}");
    }
    for l in &summary.left_out {
        println!("left out: {l}");
    }
    let (n_ok, n) = (
        summary.outcomes.iter().filter(|o| o.ok).count(),
        summary.outcomes.len(),
    );
    println!(
        "{n_ok}/{n} runs OK on {}: {} in {:.2} s",
        summary.backend,
        if summary.pass() { "PASS" } else { "FAIL" },
        summary.seconds
    );
    Ok(if summary.pass() {
        EXIT_PASS
    } else {
        EXIT_DIVERGENCE
    })
}

fn sensitivity(a: &Args) -> Result<i32, Error> {
    use mla_diff::selftest::sensitivity;
    let dir = match &a.fixtures {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("mla-diff-sensitivity-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    let dtype = mla_diff::precision::Dtype::Bf16;
    let (mut backend, info) = Factory::new().open(
        Choice::from(a.backend),
        &mla_diff::backend::Options {
            dtype,
            kernels_dir: a.kernels.clone(),
            runner: None,
            runner_page_moved: None,
            kv_format: Default::default(),
        },
    )?;
    let sched = mla_diff::schedule::Schedule::default();
    let tols = mla_diff::compare::ToleranceTable::defaults();
    println!(
        "mla-diff selftest --sensitivity: {}, layer {} of each selftest fixture, prompt {} in chunks of {}, {} decode steps, page {}, {} splits; smallest error caught, in units of the check's clean rms error (goal: <= 2)",
        info.description,
        selftest::TARGET,
        sched.prompt_len,
        sched.chunk,
        sched.decode_steps,
        sched.page_size,
        sched.num_splits
    );
    let (mut all, mut within) = (0, 0);
    for f in selftest::FIXTURES {
        let p = dir.join(f.model.file_name());
        f.model.write(&p)?;
        let file = mla_diff::gguf::GgufFile::open(&p)?;
        let rows = sensitivity::measure(
            &file,
            selftest::TARGET,
            backend.as_mut(),
            dtype,
            &sched,
            &tols,
            a.seed,
        )?;
        for r in &rows {
            for t in r.thresholds {
                all += 1;
                within += t.is_some_and(|k| k > 0.0 && k <= 2.0) as usize;
            }
        }
        print!("{}", sensitivity::table(f.name, &rows));
    }
    if a.fixtures.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!("{within} of {all} thresholds within 2x the noise");
    Ok(EXIT_PASS)
}
