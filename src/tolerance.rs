//! One check's tolerance, a ground-floor value: the judge applies it (`compare`), the calibrated table
//! holds one per dtype and check (`compare::tolerance`), a trace's `@runner` stages carry theirs
//! (`trace::AtRunner`) and reports print it; so it imports nothing of ours.
//!
//! A check passes when (1) no non-finite value appears where the reference has a finite one (or vice
//! versa), (2) rel-L2 ≤ `rel_l2`, and (3) every element satisfies |o − r| ≤ `atol_rms`·rms(r) + `rtol`·|r|.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    pub rel_l2: f64,
    pub atol_rms: f64,
    pub rtol: f64,
}
