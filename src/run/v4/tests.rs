//! The V4 run: no false alarm on clean runs, each V4 fault caught at its stage, the coverage counts.

use super::*;
use crate::faults::{Fault, Injection};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The mirror's kernel in the coverage section.
const MIRROR: (crate::kernel_use::Family, &str) = (crate::kernel_use::Family::Mirror, "cpu-mirror");

fn golden() -> GgufFile {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden/deepseek-v4.gguf");
    GgufFile::open(&p).unwrap()
}

/// `fixture --preset deepseek-v4 --layers 3 --hidden 256 --heads 8` (V4-Flash's head dims, window,
/// groups; one layer of each kind), written once per test process.
fn fixture() -> GgufFile {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let d = DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let o = crate::fixture::v4::V4Options {
            layers: Some(3),
            hidden: Some(256),
            heads: Some(8),
            quant: crate::gguf::GgmlType::from_name("bf16").unwrap(),
            seed: 0,
        };
        crate::fixture::v4::write(&o, &d.path().join("v4.gguf")).unwrap();
        d
    });
    GgufFile::open(d.path().join("v4.gguf")).unwrap()
}

/// The fixture's runs: a prompt of 136 in chunks of 64 (past its window and HCA's first window, which
/// spans two passes), 4 decode steps: the default schedule's classes but HCA's decode ones, in half
/// its tokens.
fn short(mut o: V4Options) -> V4Options {
    (o.sched.prompt_len, o.sched.decode_steps) = (136, 4);
    o
}

fn opts(f: &GgufFile, layers: &[usize], dtype: Dtype, seed: u64, faults: &[&str]) -> V4Options {
    let c = V4Config::from_gguf(f).unwrap();
    V4Options {
        layers: layers.to_vec(),
        seed,
        sched: default_schedule(&c),
        dtype,
        faults: FaultSet(
            faults
                .iter()
                .map(|s| Injection::parse(s).unwrap())
                .collect(),
        ),
        backend: engine::V4Backend::Cpu,
    }
}

/// Seeds 1–4 (the table was measured on 0 and 5–7), bf16 and f32, every layer kind of the golden:
/// no check reaches half its tolerance but attn_in, whose elementwise bound is the dtype's rtol.
#[test]
fn clean_runs_on_the_golden_pass() {
    let f = golden();
    for dt in [Dtype::Bf16, Dtype::F32] {
        for seed in 1..=4 {
            let r = run(&f, &opts(&f, &[0, 1, 2], dt, seed, &[])).unwrap();
            assert!(r.pass(), "{} seed {seed}: {}", dt.name(), r.verdict.message);
            for l in &r.modes[0].layers {
                for c in l.checks.iter().filter(|c| c.check != "attn_in") {
                    assert!(
                        c.ratio() < 0.5,
                        "{} seed {seed} layer {} {}: {}",
                        dt.name(),
                        l.layer,
                        c.check,
                        c.ratio()
                    );
                }
            }
        }
    }
}

/// The fixture's CSA and HCA layers, clean, bf16 and f32 (its window layer is the golden's kind).
#[test]
fn clean_runs_on_the_fixture_pass() {
    let f = fixture();
    for (dt, seed) in [(Dtype::Bf16, 1), (Dtype::F32, 2)] {
        let r = run(&f, &short(opts(&f, &[1, 2], dt, seed, &[]))).unwrap();
        assert!(r.pass(), "{}: {}", dt.name(), r.verdict.message);
    }
}

/// Each V4 fault, planted in one layer of the fixture, fails that layer first at the catalogue's
/// stage (every earlier check passing), and no other layer run. The window edge moves one key in 129 of
/// a query's: within bf16's noise at the fixture's window of 128 (1.1× its tolerance, measured), so
/// f32 pins it; the others are caught in bf16.
#[test]
fn each_v4_fault_is_caught_at_its_stage() {
    let f = fixture();
    for (fault, layers, layer, dt) in [
        (Fault::WindowOffByOne, &[1][..], 1, Dtype::F32),
        (Fault::CompressGroupOffByOne, &[2], 2, Dtype::Bf16),
        (Fault::CompressorStateDropped, &[1], 1, Dtype::Bf16),
        (Fault::SinkDropped, &[1, 2], 2, Dtype::Bf16),
    ] {
        let inj = format!("{}@layer={layer}", fault.name());
        let r = run(&f, &short(opts(&f, layers, dt, 1, &[&inj]))).unwrap();
        let v = &r.modes[0].verdict;
        assert_eq!(v.first_layer, Some(layer), "{inj}: {}", v.message);
        assert_eq!(
            v.first_check.as_deref(),
            Some(fault.info().expected),
            "{inj}"
        );
        let failing: Vec<usize> = r.modes[0]
            .layers
            .iter()
            .filter(|l| !l.pass)
            .map(|l| l.layer)
            .collect();
        assert_eq!(failing, [layer], "{inj}");
    }
}

/// `compressor_state_dropped` (llama.cpp #26509's class) is right on a one-pass prompt and wrong once
/// a compression window spans forward passes.
#[test]
fn a_dropped_compressor_state_shows_only_across_forward_passes() {
    let f = golden();
    let mut o = opts(&f, &[1, 2], Dtype::Bf16, 1, &["compressor_state_dropped"]);
    (o.sched.prompt_len, o.sched.chunk, o.sched.decode_steps) = (140, 140, 0);
    assert!(run(&f, &o).unwrap().pass());
    o.sched.decode_steps = 6;
    let r = run(&f, &o).unwrap();
    assert_eq!(r.verdict.first_check.as_deref(), Some("compressed"));
}

/// The coverage of the default schedule reaches every V4 class in prefill and decode (HCA's second
/// window closes in decode); a prompt of one pass carries no state and says so.
#[test]
fn coverage_names_what_the_schedule_exercised() {
    let f = golden();
    let c = V4Config::from_gguf(&f).unwrap();
    let cov = coverage::coverage(&c, &[0, 1, 2], &default_schedule(&c), MIRROR);
    assert!(cov.warnings.is_empty(), "{:?}", cov.warnings);
    assert_eq!(cov.classes.len(), 2 * 6);
    assert!(
        cov.classes.iter().all(|k| k.count.unwrap() > 0),
        "{:?}",
        cov.classes
    );
    let one = Schedule {
        prompt_len: 100,
        chunk: 100,
        decode_steps: 0,
        ..default_schedule(&c)
    };
    let cov = coverage::coverage(&c, &[0, 1], &one, MIRROR);
    let w = cov.warnings.join("\n");
    for what in ["no decode step", "the carried state", "no HCA"] {
        assert!(w.contains(what), "{what}: {w}");
    }
}

/// MLA's faults are refused on a V4 file, a V4 fault on an MLA run; a position offset too.
#[test]
fn foreign_faults_and_offsets_are_refused() {
    let f = golden();
    let e = run(&f, &opts(&f, &[0], Dtype::Bf16, 1, &["rope_neox"])).unwrap_err();
    assert!(e.to_string().contains("an MLA fault"), "{e}");
    let v4 = FaultSet(vec![Injection::parse("sink_dropped").unwrap()]);
    assert!(v4
        .refuse_v4()
        .unwrap_err()
        .to_string()
        .contains("DeepSeek-V4 fault"));
    let mut o = opts(&f, &[0], Dtype::Bf16, 1, &[]);
    o.sched.pos_offset = 3;
    assert!(run(&f, &o).is_err());
}
