//! The stage-local view's hottest loops four f64 lanes wide with AVX2, where the CPU has it: every
//! sum in the same order as the scalar code's, lane for lane (no fused multiply-add, no reordering),
//! so the view is the same to the bit with or without it (`same_bits_as_scalar` below).

#![cfg(target_arch = "x86_64")]

use super::{attend_in, Attn, Gram, Path, Score, Terms};
use std::arch::x86_64::*;

/// Whether this CPU has AVX2 (detected once, then a load).
#[inline(always)]
pub(super) fn avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// [`super::attend`] compiled for AVX2 (the compiler widens what it can; the column loop below by hand).
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn attend(
    scores: &[Score],
    v: &[&[f64]],
    vv: Option<&[&[f64]]>,
    dim: usize,
    path: Path,
    gram: Option<Gram>,
) -> Attn {
    attend_in(scores, v, vv, dim, path, gram)
}

#[inline(always)]
fn lanes(v: __m256d) -> [f64; 4] {
    let mut o = [0.0f64; 4];
    // SAFETY: `o` holds four f64.
    unsafe { _mm256_storeu_pd(o.as_mut_ptr(), v) };
    o
}

/// `((v₀ + v₁) + (v₂ + v₃))`, as the scalar code reduces its four lanes.
#[inline(always)]
fn tree(v: __m256d) -> f64 {
    let l = lanes(v);
    (l[0] + l[1]) + (l[2] + l[3])
}

/// `f64::max(a, b)` (maxnum: the other where one is NaN).
#[inline(always)]
unsafe fn maxnum(a: __m256d, b: __m256d) -> __m256d {
    // MAXPD returns its second operand where either is NaN: `a` where `b` is NaN; then `b` where `a` is.
    let m = _mm256_max_pd(b, a);
    _mm256_blendv_pd(m, b, _mm256_cmp_pd::<_CMP_UNORD_Q>(a, a))
}

/// [`super::key_cols`] over the whole groups of four columns: returns how many columns it did.
///
/// # Safety
/// The CPU must have AVX2; `out`, `a`, `sq`, `tot` at least as long as `vj`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn key_cols(
    vj: &[f64],
    out: &[f64],
    a: &mut [f64],
    sq: &mut [f64],
    tot: &mut [f64],
    f: [f64; 3],
    key4: &mut [f64; 4],
) -> usize {
    let n4 = vj.len() / 4 * 4;
    assert!(out.len() >= n4 && a.len() >= n4 && sq.len() >= n4 && tot.len() >= n4);
    let (round, ppv, pj) = (
        _mm256_set1_pd(f[0]),
        _mm256_set1_pd(f[1]),
        _mm256_set1_pd(f[2]),
    );
    let mut key = _mm256_loadu_pd(key4.as_ptr());
    let (pv, po, pa, ps, pt) = (
        vj.as_ptr(),
        out.as_ptr(),
        a.as_mut_ptr(),
        sq.as_mut_ptr(),
        tot.as_mut_ptr(),
    );
    let mut i = 0;
    while i < n4 {
        let x = _mm256_loadu_pd(pv.add(i));
        let o = _mm256_loadu_pd(po.add(i));
        let d = _mm256_sub_pd(x, o);
        let dev = _mm256_mul_pd(d, d);
        let m = maxnum(_mm256_mul_pd(x, x), dev);
        let c = _mm256_add_pd(_mm256_mul_pd(round, m), _mm256_mul_pd(ppv, dev));
        _mm256_storeu_pd(pa.add(i), _mm256_add_pd(_mm256_loadu_pd(pa.add(i)), c));
        let px = _mm256_mul_pd(pj, x);
        _mm256_storeu_pd(
            ps.add(i),
            _mm256_add_pd(_mm256_loadu_pd(ps.add(i)), _mm256_mul_pd(px, px)),
        );
        _mm256_storeu_pd(pt.add(i), _mm256_add_pd(_mm256_loadu_pd(pt.add(i)), px));
        key = _mm256_add_pd(key, c);
        i += 4;
    }
    _mm256_storeu_pd(key4.as_mut_ptr(), key);
    n4
}

/// One part of a score (`x·y`, 16-wide k-steps): its running terms are `t` (a, sq, steps, steps2)
/// and, where `w` is given, Σ x²·w in four lanes.
#[inline(always)]
unsafe fn part16(x: &[f64], y: &[f64], w: Option<&[f64]>, t: &mut [f64; 4], p4: &mut __m256d) {
    let (px, py) = (x.as_ptr(), y.as_ptr());
    let mut i = 0;
    while i < x.len() {
        let (mut s, mut q) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for sub in 0..4 {
            let at = i + 4 * sub;
            let xv = _mm256_loadu_pd(px.add(at));
            let p = _mm256_mul_pd(xv, _mm256_loadu_pd(py.add(at)));
            let pp = _mm256_mul_pd(p, p);
            s = _mm256_add_pd(s, p);
            q = _mm256_add_pd(q, pp);
            if let Some(w) = w {
                let wv = _mm256_loadu_pd(w.as_ptr().add(at));
                *p4 = _mm256_add_pd(*p4, _mm256_mul_pd(_mm256_mul_pd(xv, xv), wv));
            }
        }
        t[0] += tree(s);
        t[1] += tree(q);
        t[2] += t[0];
        t[3] += t[0] * t[0];
        i += 16;
    }
}

/// [`super::dot_var`]'s terms in one pass over the elements, for parts whose lengths are multiples of
/// 16 (no k-step straddles the two parts, no lane has a remainder).
///
/// # Safety
/// The CPU must have AVX2; `x.len()` and `xr.len()` multiples of 16, `y` as long as `x`, `w` at least,
/// `yr` as long as `xr`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn dot_terms(x: &[f64], y: &[f64], w: &[f64], xr: &[f64], yr: &[f64]) -> Terms {
    assert!(
        x.len().is_multiple_of(16)
            && xr.len().is_multiple_of(16)
            && y.len() == x.len()
            && w.len() >= x.len()
            && yr.len() == xr.len()
    );
    let mut t = [0.0f64; 4];
    let mut p4 = _mm256_setzero_pd();
    part16(x, y, Some(w), &mut t, &mut p4);
    let mut unused = _mm256_setzero_pd();
    part16(xr, yr, None, &mut t, &mut unused);
    Terms {
        a: t[0],
        sq: t[1],
        steps: t[2],
        steps2: t[3],
        prop: tree(p4),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{key_cols_scalar, terms_scalar};
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The AVX2 loops give the scalar loops' bits, on ordinary values, ties, zeros, infinities and NaN.
    #[test]
    fn same_bits_as_scalar() {
        if !avx2() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let special = [
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1e-300,
            1e300,
        ];
        let val = |rng: &mut rand::rngs::StdRng| match rng.random_range(0..20) {
            0 => special[rng.random_range(0..special.len())],
            _ => rng.random_range(-3.0..3.0) * 10f64.powi(rng.random_range(-8..8)),
        };
        // NaN as one value: its sign and payload are not specified by Rust (LLVM may commute an add's
        // operands), so only where a NaN appears is the contract.
        let one = |x: f64| if x.is_nan() { u64::MAX } else { x.to_bits() };
        let bits = |v: &[f64]| v.iter().map(|&x| one(x)).collect::<Vec<_>>();
        for case in 0..400 {
            let clean = case % 2 == 0;
            let pick = |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<f64> {
                (0..n)
                    .map(|_| match clean {
                        true => rng.random_range(-3.0..3.0),
                        false => val(rng),
                    })
                    .collect()
            };
            let dim = 4 * rng.random_range(1..40) + rng.random_range(0..4);
            let (vj, out) = (pick(&mut rng, dim), pick(&mut rng, dim));
            let f = [
                rng.random_range(0.0..1e-3),
                rng.random_range(0.0..1e-3),
                rng.random_range(0.0..1.0),
            ];
            let init = pick(&mut rng, 3 * dim);
            let (mut a1, mut s1, mut t1) = (
                init[..dim].to_vec(),
                init[dim..2 * dim].to_vec(),
                init[2 * dim..].to_vec(),
            );
            let (mut a2, mut s2, mut t2) = (a1.clone(), s1.clone(), t1.clone());
            let k1 = key_cols_scalar(&vj, &out, &mut a1, &mut s1, &mut t1, f);
            let k2 = super::super::key_cols(&vj, &out, &mut a2, &mut s2, &mut t2, f);
            assert_eq!(bits(&k1), bits(&k2), "key, case {case}");
            assert_eq!(bits(&a1), bits(&a2), "a, case {case}");
            assert_eq!(bits(&s1), bits(&s2), "sq, case {case}");
            assert_eq!(bits(&t1), bits(&t2), "tot, case {case}");

            let (n, nr) = (16 * rng.random_range(0..40), 16 * rng.random_range(0..6));
            let (x, y, w) = (pick(&mut rng, n), pick(&mut rng, n), pick(&mut rng, n));
            let (xr, yr) = (pick(&mut rng, nr), pick(&mut rng, nr));
            let want = terms_scalar(&x, &y, &w, &xr, &yr);
            // SAFETY: AVX2 checked above; lengths as required.
            let got = unsafe { dot_terms(&x, &y, &w, &xr, &yr) };
            let tb = |t: &Terms| [t.a, t.sq, t.steps, t.steps2, t.prop].map(one);
            assert_eq!(tb(&want), tb(&got), "terms, case {case}");
        }
    }
}
