//! Which layers run alone (issue #39: the default run's peak resident set).
//!
//! A layer's paths and its judge hold three stage traces (the reference's, shadow and free mode's),
//! the stage-local view's products and state, and, while the paths run, the layer's weights twice (as
//! read, and rounded to the run's dtype). At the kernel-aware covering schedule on GLM-5's dims that is
//! ~1.3 GB of weights and ~0.4 GB per trace; run the usual way — the reference beside the optimized
//! path, the view's products beside free mode's pass, and a layer's judge beside the next layer's paths
//! (`layers.rs`) — those overlap into 5.4 GB. A layer whose buffers ([`Schedule::peak_bytes`]) are
//! above [`ALONE_ABOVE`] therefore runs alone: the reference, then shadow mode's pass, then free
//! mode's, which is compared with the reference at once and let go, then the view's products; the
//! weights are let go, and the judge (the view and shadow mode's comparison) runs before the next
//! layer is read. Every value is computed by the same code from the same inputs either way, and the
//! backend is called in the same order (shadow, then free): the reports are the same byte for byte.
//! Only the overlap is given up, on the few covering layers of a default run; the classic layers of
//! the rest (tens of MB each) keep it. A lone dense layer on the CPU mirror or CUDA also holds its
//! weights once: rounded in place to the run's dtype after its reference ([`reference_first`]),
//! instead of the file's values beside a rounded copy.

use super::layers::RefTraces;
use super::RunOptions;
use crate::error::Result;
use crate::model::{LayerWeights, MlaConfig};
use crate::rope::RopeTables;
use crate::schedule::Schedule;
use ndarray::Array2;
use std::time::Duration;

/// The buffers of one layer ([`Schedule::peak_bytes`]) above which it runs alone: GLM-5's covering
/// schedule needs 2.3 GB, its classic one 0.25 GB.
pub(super) const ALONE_ABOVE: u128 = 1 << 30;

/// Whether a layer of `cfg` on `sched` runs alone.
pub(super) fn alone(cfg: &MlaConfig, sched: &Schedule) -> bool {
    #[cfg(test)]
    if let Some(a) = tests::FORCED.with(|f| f.get()) {
        return a;
    }
    sched.peak_bytes(cfg) > ALONE_ABOVE
}

/// A lone dense layer's fp64 reference, made first, and then its weights rounded in place to the
/// run's dtype (`LayerWeights::round_in_place`): the optimized path, its repeats and the view's
/// products read them as their stored copy, so one copy of the layer is alive beside the path's
/// buffers instead of two (0.63 GB at GLM-5's dims in bf16). For a layer that runs alone, has no DSA
/// selection (whose check reads the file's values after the path), on a path that reads only the
/// stored weights (`Backend::reads_stored_weights_only`); elsewhere the reference runs in
/// `layers::paths`. The reference is the same computation from the same values either way, and every
/// stored value the same rounding of the same value, so the reports are the same byte for byte.
pub(super) fn reference_first(
    w: &mut LayerWeights,
    (cfg, rope, opts): (&MlaConfig, &RopeTables, &RunOptions),
    input: (&Array2<f64>, Option<&Array2<f64>>),
) -> (Result<RefTraces>, Duration) {
    let made = super::layers::reference(cfg, w, (rope, &opts.sched, None), input);
    w.round_in_place(opts.dtype);
    made
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuMirror;
    use crate::compare::ToleranceTable;
    use crate::gguf::GgufFile;
    use crate::precision::Dtype;
    use crate::run::{InputSpec, Modes, RunOptions};
    use std::cell::Cell;

    thread_local! {
        /// A test's choice in place of the size rule, for runs on its own thread.
        pub(super) static FORCED: Cell<Option<bool>> = const { Cell::new(None) };
    }

    /// GLM-5's covering layers run alone, its classic ones (and the test fixtures' layers) do not.
    #[test]
    fn the_covering_schedule_on_glm5_runs_alone() {
        let glm5 = crate::model::catalogue::Preset::Glm5.test_config();
        assert!(alone(&glm5, &crate::coverage::covering::covering(&glm5)));
        assert!(!alone(&glm5, &Schedule::default()));
        let tiny = crate::model::catalogue::Preset::Tiny.test_config();
        assert!(!alone(&tiny, &crate::coverage::covering::covering(&tiny)));
    }

    /// A run whose layers run alone reports what the overlapped run reports, byte for byte (both
    /// modes, two layers, a failing layer included: free mode's result made before the judge).
    #[test]
    fn alone_reports_what_overlapped_reports() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/deepseek-v3-yarn-q4_k.gguf");
        let file = GgufFile::open(&path).unwrap();
        let cfg = MlaConfig::from_gguf(&file).unwrap();
        let run = |forced: bool| {
            let (tolerances, tolerance_source) =
                ToleranceTable::with_overrides(Dtype::Bf16, None, &[]).unwrap();
            // Layer 0 passes, layer 1 fails.
            let faults =
                crate::faults::FaultSet(vec![
                    crate::faults::Injection::parse("kv_b_swap@layer=1").unwrap()
                ]);
            let opts = RunOptions {
                layers: Some((0..cfg.n_layer).collect()),
                input: InputSpec::Random { seed: 3 },
                sched: Schedule {
                    prompt_len: 12,
                    chunk: 8,
                    decode_steps: 2,
                    q_len: 2,
                    num_splits: 2,
                    page_size: 4,
                    ..Schedule::default()
                },
                dtype: Dtype::Bf16,
                modes: Modes {
                    shadow: true,
                    free: true,
                },
                tolerances,
                tolerance_source,
                dump: None,
                faults,
                progress: false,
                repeat: 1,
                indexer_keys: Default::default(),
                split: None,
            };
            FORCED.with(|f| f.set(Some(forced)));
            let mut mirror = CpuMirror::new(Dtype::Bf16);
            let info = crate::backend::BackendInfo::of(crate::backend::Kind::Cpu, &mirror);
            let rep = crate::run::run(&file, &mut mirror, &info, &opts).unwrap();
            FORCED.with(|f| f.set(None));
            serde_json::to_string(&rep).unwrap()
        };
        let (apart, together) = (run(true), run(false));
        assert!(apart == together, "the reports differ");
        assert!(apart.contains("\"free\"") && apart.contains("\"pass\":false"));
    }
}
