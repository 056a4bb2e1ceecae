//! The peers table's unit tests: floor verdicts and the six shapes.

use super::*;

fn sp(us: f64, pct_copy: f64, correct: bool) -> Speed {
    Speed {
        timed: Timed {
            config: "x".into(),
            median_us: us,
            min_us: us,
            rel_l2_vs_scalar: 1e-3,
            non_finite: 0,
            rel_l2_vs_ours: None,
            correct,
        },
        tflops: 0.0,
        gbps: 0.0,
        pct_copy_bw: pct_copy,
        pct_matmul: 0.0,
    }
}

fn peer(name: &str, version: &str, us: f64, ours_us: f64, correct: bool) -> PeerSpeed {
    PeerSpeed {
        peer: name.into(),
        name: name.into(),
        version: version.into(),
        speed: sp(us, 0.0, correct),
        ours_speed_ratio: Some(us / ours_us),
    }
}

const FM: Floor = Floor::PeerSpeed {
    peer: "flashmla",
    backend: None,
    min: 0.9,
};

#[test]
fn peer_floor_is_the_time_ratio() {
    let ours = sp(100.0, 0.0, true);
    let v = verdict(
        FM,
        Some(&ours),
        &[peer("flashmla", "1.0", 95.0, 100.0, true)],
    );
    assert_eq!((v.met, v.measured), (Some(true), Some(0.95)));
    let v = verdict(
        FM,
        Some(&ours),
        &[peer("flashmla", "1.0", 85.0, 100.0, true)],
    );
    assert_eq!(v.met, Some(false));
    assert!(
        v.verdict.starts_with("missed: ours at 0.850x"),
        "{}",
        v.verdict
    );
    // Just under the floor: the text must not round up onto it.
    let v = verdict(
        FM,
        Some(&ours),
        &[peer("flashmla", "1.0", 89.6, 100.0, true)],
    );
    assert_eq!(v.met, Some(false));
    assert!(
        v.verdict.starts_with("missed: ours at 0.896x"),
        "{}",
        v.verdict
    );
}

#[test]
fn a_floor_without_its_peer_is_not_measured_never_met() {
    let ours = sp(100.0, 0.0, true);
    assert_eq!(verdict(FM, Some(&ours), &[]).met, None);
    // A peer whose output is wrong does not count, however fast.
    let v = verdict(
        FM,
        Some(&ours),
        &[peer("flashmla", "1.0", 1000.0, 100.0, false)],
    );
    assert_eq!(v.met, None);
    // The prefill floor is against cuDNN: torch on its flash kernel does not measure it.
    let cudnn = Floor::PeerSpeed {
        peer: "torch",
        backend: Some("cudnn"),
        min: 0.8,
    };
    let flash = peer(
        "torch",
        "torch 2.11, SDPA backend flash on H200",
        1000.0,
        100.0,
        true,
    );
    assert_eq!(verdict(cudnn, Some(&ours), &[flash]).met, None);
    let c = peer(
        "torch",
        "torch 2.11, SDPA backend cudnn on H200",
        1000.0,
        100.0,
        true,
    );
    assert_eq!(verdict(cudnn, Some(&ours), &[c]).met, Some(true));
    // No correct configuration of ours: nothing is measured.
    assert_eq!(
        verdict(FM, None, &[peer("flashmla", "", 1.0, 1.0, true)]).met,
        None
    );
}

#[test]
fn copy_floor_reads_the_fraction_of_copy_bandwidth() {
    let f = Floor::CopyBw(0.85);
    assert_eq!(verdict(f, Some(&sp(1.0, 85.0, true)), &[]).met, Some(true));
    let v = verdict(f, Some(&sp(1.0, 67.8, true)), &[]);
    assert_eq!(v.met, Some(false));
    assert_eq!(v.verdict, "missed: 67.8% of copy bandwidth");
    // NaN never passes.
    assert_eq!(
        verdict(f, Some(&sp(1.0, f64::NAN, true)), &[]).met,
        Some(false)
    );
}

#[test]
fn the_table_has_the_issues_six_shapes() {
    let decode: Vec<_> = CASES
        .iter()
        .filter_map(|(s, _)| match s {
            Shape::Decode { bsz, h, s } => Some((*bsz, *h, *s)),
            _ => None,
        })
        .collect();
    assert_eq!(
        decode,
        [
            (64, 128, 4096),
            (64, 16, 4096),
            (128, 64, 4096),
            (16, 128, 32768)
        ]
    );
    assert_eq!(
        CASES
            .iter()
            .filter(|(s, _)| matches!(s, Shape::Prefill(_)))
            .count(),
        2
    );
}
