//! `conventions.qk_acc` (docs/runners.md "The kernels' own reads"): the accumulator of a decode
//! kernel's fp8 QKᵀ MMA, `"e8mN"`, parsed strictly (a typo must not read as some other accumulator),
//! and what the runner backend makes of it: the fraction bits the stage-local view's scores are
//! truncated to (`Judging::decode_qk_acc`, `compare::local::qk_acc`).

use super::RunnerBackend;
use serde::{Deserialize, Serialize};

/// `conventions.qk_acc`: the fraction bits of the fp8 QKᵀ MMA's accumulator, written `"e8mN"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkAcc(pub u32);

impl QkAcc {
    /// f32's fraction bits: the widest accumulator the convention names (wider is no convention).
    pub const MAX_BITS: u32 = 23;

    /// `"e8mN"`, N in 1..=23, or why not (one line).
    pub fn parse(s: &str) -> std::result::Result<QkAcc, String> {
        let n = s
            .strip_prefix("e8m")
            .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<u32>().ok())
            .filter(|n| (1..=Self::MAX_BITS).contains(n));
        n.map(QkAcc).ok_or_else(|| {
            format!(
                "conventions.qk_acc {s:?} is not an accumulator mla-diff knows: write \"e8mN\", 8 exponent and N fraction bits, N from 1 to {} (FlashMLA's fp8 QKᵀ: \"e8m13\")",
                Self::MAX_BITS
            )
        })
    }
}

impl Serialize for QkAcc {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&format!("e8m{}", self.0))
    }
}

impl<'de> Deserialize<'de> for QkAcc {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<QkAcc, D::Error> {
        let s = String::deserialize(d)?;
        QkAcc::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A description naming `qk_acc` without `q_fp8` is refused: the accumulator named is the fp8 QKᵀ
/// MMA's, which only a kernel reading q in e4m3 has.
pub(super) fn needs_q_fp8(d: &super::protocol::Describe) -> crate::error::Result<()> {
    match (d.conventions.qk_acc, d.conventions.q_fp8) {
        (Some(a), None) => Err(crate::error::Error::Usage(format!(
            "runner {}: conventions.qk_acc \"e8m{}\" names the fp8 QKᵀ MMA's accumulator, but the runner does not read q in fp8 (no conventions.q_fp8)",
            d.name, a.0
        ))),
        _ => Ok(()),
    }
}

impl RunnerBackend {
    /// The fraction bits of the decode's QKᵀ accumulator: declared, with q read in e4m3 (the fp8 MMA
    /// exists only then: `q_fp8` for the run's cache).
    pub(super) fn qk_acc_bits(&self) -> Option<u32> {
        self.desc
            .conventions
            .qk_acc
            .filter(|_| self.q_fp8())
            .map(|a| a.0)
    }
}

#[cfg(test)]
mod tests {
    use super::QkAcc;

    /// Only `e8m1` … `e8m23` parse; anything else is refused with the form to write.
    #[test]
    fn qk_acc_parses_strictly() {
        assert_eq!(QkAcc::parse("e8m13"), Ok(QkAcc(13)));
        assert_eq!(QkAcc::parse("e8m1"), Ok(QkAcc(1)));
        assert_eq!(QkAcc::parse("e8m23"), Ok(QkAcc(23)));
        for bad in [
            "", "e8m", "e8m0", "e8m24", "e8m+13", "e8m13 ", "E8M13", "e5m10", "13", "e8m-1",
        ] {
            let e = QkAcc::parse(bad).expect_err(bad);
            assert!(e.contains("e8mN") && !e.contains('\n'), "{bad}: {e}");
        }
        let j: Result<QkAcc, _> = serde_json::from_str("13");
        assert!(j.is_err());
        assert_eq!(serde_json::to_string(&QkAcc(13)).unwrap(), "\"e8m13\"");
        assert_eq!(
            serde_json::from_str::<QkAcc>("\"e8m13\"").unwrap(),
            QkAcc(13)
        );
    }
}
