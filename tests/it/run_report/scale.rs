//! #15's levers leave every report as it was: the reference on its own thread, the stage-local view
//! over the host's cores, the file's pages released after each layer, the `MLA_DIFF_PROFILE` table.

use super::{opts, run_with, tiny4, BIN};
use mla_diff::backend::cpu::CpuMirror;
use mla_diff::gguf::GgufFile;
use mla_diff::precision::Dtype;
use std::process::Command;

/// The local view and the whole report are the same bytes on one thread as on several (12: two layers
/// judged at a time, `run`'s layers in flight).
#[test]
fn reports_do_not_depend_on_the_thread_count() {
    let path = tiny4();
    let json = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let r = run_with(&mut CpuMirror::new(Dtype::Bf16), &path, &opts(Dtype::Bf16));
            serde_json::to_string(&r).unwrap()
        })
    };
    let one = json(1);
    assert!(one.contains("\"local\""), "the local view is in the report");
    assert_eq!(one, json(3));
    assert_eq!(one, json(12));
}

/// The fp64 reference's per-head attention over rayon's threads: the same bits on one thread as on
/// several (it runs on its own thread in `run`, on the global pool, so the report test does not vary it).
#[test]
fn reference_does_not_depend_on_the_thread_count() {
    use mla_diff::backend::RunTables;
    use mla_diff::model::rope_factors::RopeFactors;
    use mla_diff::model::{LayerWeights, MlaConfig};
    use mla_diff::schedule::Schedule;
    let f = GgufFile::open(tiny4()).unwrap();
    let cfg = MlaConfig::from_gguf(&f).unwrap();
    let sched = Schedule::default();
    let factors = RopeFactors::load(&f, &cfg).unwrap();
    let tables = RunTables::new(&cfg, factors.as_ref(), &sched).unwrap();
    let w = LayerWeights::load(&f, &cfg, 1).unwrap();
    let x = mla_diff::input::random_hidden(cfg.hidden, sched.total_tokens(), 11);
    let bits = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let tr = pool.install(|| {
            mla_diff::reference::run_layer(&cfg, &w, &tables.rope, &x, &sched).unwrap()
        });
        tr.stages
            .iter()
            .map(|s| {
                (
                    s.stage,
                    s.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    let one = bits(1);
    assert!(one.len() >= 13, "every stage: {}", one.len());
    assert_eq!(one, bits(3));
}

/// Released pages read back the same bytes.
#[test]
fn released_pages_read_back_the_same() {
    let f = GgufFile::open(tiny4()).unwrap();
    let before: Vec<Vec<u8>> = f
        .tensors
        .iter()
        .map(|t| f.tensor_bytes(t).unwrap().to_vec())
        .collect();
    f.release(f.tensors.iter());
    for (t, b) in f.tensors.iter().zip(&before) {
        assert_eq!(f.tensor_bytes(t).unwrap(), b.as_slice(), "{}", t.name);
    }
}

/// `MLA_DIFF_PROFILE=1` prints the phase table on stderr and changes nothing else.
#[test]
fn profile_table_on_stderr_only() {
    let dir = std::env::temp_dir().join(format!("mla-diff-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fx = tiny4().display().to_string();
    let run = |profile: &str, json: &str| {
        let out = Command::new(BIN)
            .args(["run", &fx, "--json"])
            .arg(dir.join(json))
            .env("NO_COLOR", "1")
            .env("MLA_DIFF_PROFILE", profile)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0));
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (out_on, err_on) = run("1", "on.json");
    let (out_off, err_off) = run("0", "off.json");
    for phase in [
        "load + dequantize",
        "optimized path",
        "stage-local view",
        "reference (fp64)",
        "compare + reports",
        "wall (run loop)",
    ] {
        assert!(err_on.contains(phase), "{phase}: {err_on}");
    }
    assert!(!err_off.contains("profile"), "{err_off}");
    assert_eq!(out_on, out_off);
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap();
    assert_eq!(read("on.json"), read("off.json"));
    std::fs::remove_dir_all(&dir).ok();
}
