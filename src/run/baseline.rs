//! The baseline identity of a run before it runs (`report::baseline::Identity::planned`): here, not in
//! `report/`, because it reads the driver's options, and the report does not import the driver.

use super::RunOptions;
use crate::gguf::GgufFile;
use crate::model::MlaConfig;
use crate::report::baseline::Identity;
use std::collections::BTreeMap;

impl Identity {
    /// The identity of the run `opts` describes on `file`, before it runs: what [`Identity::of`] will
    /// read from its report, so a mismatched baseline is refused before a long run.
    pub fn planned(
        file: &GgufFile,
        cfg: &MlaConfig,
        opts: &RunOptions,
    ) -> crate::error::Result<Identity> {
        let mut tolerances = BTreeMap::new();
        let rest = opts.split.as_ref().map(|s| &s.rest);
        for sched in std::iter::once(&opts.sched).chain(rest) {
            for c in crate::compare::checks_for(sched) {
                tolerances.insert(c.name(), opts.tolerances.get(opts.dtype, &c)?);
            }
        }
        Ok(Identity {
            file: file
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            size: file.file_size,
            architecture: cfg.arch.gguf_name().into(),
            dtype: opts.dtype.name().into(),
            schedule: crate::report::baseline::schedule_identity(&opts.sched, opts.split.as_ref()),
            input: super::input_json(&opts.input),
            layers: opts
                .layers
                .clone()
                .unwrap_or_else(|| (0..cfg.n_layer).collect()),
            tolerances,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a run plans is what its report says it ran: a run is its own baseline (a schedule, layer
    /// choice and tolerance override other than the defaults, to see each carried through).
    #[test]
    fn planned_is_what_the_report_holds() {
        use crate::backend::cpu::CpuMirror;
        use crate::compare::ToleranceTable;
        use crate::precision::Dtype;
        use crate::run::InputSpec;
        use crate::schedule::Schedule;
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/deepseek-v3-legacy-kv-b-q8_0.gguf");
        let file = GgufFile::open(&path).unwrap();
        let cfg = MlaConfig::from_gguf(&file).unwrap();
        let (tolerances, tolerance_source) =
            ToleranceTable::with_overrides(Dtype::F16, None, &["out=rel_l2:0.5".into()]).unwrap();
        let opts = RunOptions {
            layers: Some(vec![0]),
            input: InputSpec::Random { seed: 5 },
            sched: Schedule {
                prompt_len: 20,
                chunk: 8,
                decode_steps: 3,
                q_len: 2,
                num_splits: 2,
                ..Schedule::default()
            },
            dtype: Dtype::F16,
            tolerances,
            tolerance_source,
            ..RunOptions::default()
        };
        let planned = Identity::planned(&file, &cfg, &opts).unwrap();
        assert_eq!(planned.tolerances["attn_out[decode]"].rel_l2, 0.5);
        let mut mirror = CpuMirror::new(Dtype::F16);
        let info = crate::backend::BackendInfo::of(crate::backend::Kind::Cpu, &mirror);
        let report = crate::run::run(&file, &mut mirror, &info, &opts).unwrap();
        assert_eq!(planned, Identity::of(&report));
        assert!(planned.differences(&Identity::of(&report)).is_empty());
    }
}
