//! The exponentials of a softmax row, eight or sixteen at a time: for a row ℓ and its shift m
//! (the row's maximum, or the log-sum-exp),
//!
//! ```text
//! p_j = e^(ℓ_j − m),   returning Σ_j p_j
//! ```
//!
//! glibc's `expf` is scalar: with Flex, attention's softmax spent a tenth of a long prompt's
//! prefill in it. e^x is computed as 2ⁿ·e^r with n = round(x·log₂e) and r = x − n·ln 2 (ln 2 in
//! two parts, so that r is exact to f32 rounding), |r| ≤ ln 2 / 2, e^r by Cephes' degree-7
//! polynomial for `expf` (relative error within a few f32 ulps of glibc's). x is clamped to
//! [−104, 89] first: e^x is 0 below (−∞, a masked logit, included) and +∞ above in f32; NaN stays
//! NaN. With AVX-512, sixteen lanes, 2ⁿ applied by `vscalefps` (which overflows to +∞ and
//! underflows to 0 as e^x does). With AVX2 and FMA (a CPU without AVX-512), eight lanes, 2ⁿ as
//! 2^⌊n/2⌋·2^(n−⌊n/2⌋), two powers built in the exponent field, each a normal f32 for every n the
//! clamp leaves (−150 to 128): the first product is exact, the second rounds once, as
//! `vscalefps` does, into a denormal, 0 or +∞; a row's last `len % 8` elements take the plain
//! loop. Elsewhere the plain loop over `f32::exp`.

#[cfg(target_arch = "x86_64")]
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 = LN2_HI + LN2_LO, LN2_HI with few enough bits that n·LN2_HI is exact.
#[cfg(target_arch = "x86_64")]
const LN2_HI: f32 = 0.693_359_4;
#[cfg(target_arch = "x86_64")]
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes expf: e^r ≈ 1 + r + r²·P(r), P's coefficients from the highest power.
#[cfg(target_arch = "x86_64")]
const P: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `row[j] = e^(row[j] − shift)` in place; their sum (in another order than a plain loop's).
pub(crate) fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked above).
        return unsafe { exp_shifted_avx512(row, shift) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { avx2::exp_shifted(row, shift) };
    }
    plain::exp_shifted(row, shift)
}

/// Σ_j e^(row[j] − shift), `row` left as it is.
pub(crate) fn sum_exp_shifted(row: &[f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked above).
        return unsafe { sum_exp_shifted_avx512(row, shift) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { avx2::sum_exp_shifted(row, shift) };
    }
    plain::sum_exp_shifted(row, shift)
}

/// The mask of a sixteen-lane step with `remaining` elements left: all lanes, or the first
/// `remaining`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn first_lanes(remaining: usize) -> core::arch::x86_64::__mmask16 {
    match remaining {
        n if n >= 16 => !0,
        n => (1 << n) - 1,
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_exp_shifted_avx512(row: &[f32], shift: f32) -> f32 {
    use core::arch::x86_64::*;
    let shift = _mm512_set1_ps(shift);
    let mut sum = _mm512_setzero_ps();
    for start in (0..row.len()).step_by(16) {
        let lanes = first_lanes(row.len() - start);
        // SAFETY: the masked load touches the lanes start..start + n < row.len() only.
        let x = unsafe { _mm512_maskz_loadu_ps(lanes, row.as_ptr().add(start)) };
        let p = exp16(_mm512_sub_ps(x, shift));
        sum = _mm512_mask_add_ps(sum, lanes, sum, p);
    }
    _mm512_reduce_add_ps(sum)
}

/// `out[j] = silu(gate[j])·up[j]` with silu(g) = g / (1 + e^(−g)) (SwiGLU's gate), for slices of
/// one length.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked above).
        return unsafe { swiglu_avx512(gate, up, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { avx2::swiglu(gate, up, out) };
    }
    plain::swiglu(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn swiglu_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    use core::arch::x86_64::*;
    let len = out.len().min(gate.len()).min(up.len());
    let one = _mm512_set1_ps(1.0);
    for start in (0..len).step_by(16) {
        let lanes = first_lanes(len - start);
        // SAFETY: the masked loads and store touch the lanes start..start + n < len of each.
        unsafe {
            let g = _mm512_maskz_loadu_ps(lanes, gate.as_ptr().add(start));
            let u = _mm512_maskz_loadu_ps(lanes, up.as_ptr().add(start));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            let silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(start), lanes, _mm512_mul_ps(silu, u));
        }
    }
}

/// SwiGLU's gradients: for y = silu(g)·u and the incoming gradient d, with σ = 1 / (1 + e^(−g)),
/// `d_gate = d·u·σ·(1 + g·(1 − σ))` and `d_up = d·g·σ`, for slices of one length.
pub(crate) fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    grad: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked above).
        return unsafe { swiglu_backward_avx512(gate, up, grad, d_gate, d_up) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { avx2::swiglu_backward(gate, up, grad, d_gate, d_up) };
    }
    plain::swiglu_backward(gate, up, grad, d_gate, d_up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn swiglu_backward_avx512(
    gate: &[f32],
    up: &[f32],
    grad: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
) {
    use core::arch::x86_64::*;
    let len = [gate.len(), up.len(), grad.len(), d_up.len()]
        .into_iter()
        .fold(d_gate.len(), usize::min);
    let one = _mm512_set1_ps(1.0);
    for start in (0..len).step_by(16) {
        let lanes = first_lanes(len - start);
        // SAFETY: the masked loads and stores touch the lanes start..start + n < len of each
        // slice (len is the shortest's length).
        unsafe {
            let g = _mm512_maskz_loadu_ps(lanes, gate.as_ptr().add(start));
            let u = _mm512_maskz_loadu_ps(lanes, up.as_ptr().add(start));
            let d = _mm512_maskz_loadu_ps(lanes, grad.as_ptr().add(start));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            let sigma = _mm512_div_ps(one, _mm512_add_ps(one, e));
            let slope = _mm512_fmadd_ps(g, _mm512_sub_ps(one, sigma), one);
            let dg = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(d, u), sigma), slope);
            let du = _mm512_mul_ps(_mm512_mul_ps(d, g), sigma);
            _mm512_mask_storeu_ps(d_gate.as_mut_ptr().add(start), lanes, dg);
            _mm512_mask_storeu_ps(d_up.as_mut_ptr().add(start), lanes, du);
        }
    }
}

/// The largest of `row`'s values (−∞ for none).
pub(crate) fn max_of(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked above).
        return unsafe { max_of_avx512(row) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { avx2::max_of(row) };
    }
    plain::max_of(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn max_of_avx512(row: &[f32]) -> f32 {
    use core::arch::x86_64::*;
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        // SAFETY: `chunk` holds sixteen f32.
        // vmaxps returns its second operand where either is NaN: NaN is skipped, as by f32::max.
        max = _mm512_max_ps(unsafe { _mm512_loadu_ps(chunk.as_ptr()) }, max);
    }
    tail.iter()
        .fold(_mm512_reduce_max_ps(max), |m, &x| m.max(x))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_shifted_avx512(row: &mut [f32], shift: f32) -> f32 {
    use core::arch::x86_64::*;
    let shift = _mm512_set1_ps(shift);
    let mut sum = _mm512_setzero_ps();
    let mut chunks = row.chunks_exact_mut(16);
    for chunk in &mut chunks {
        // SAFETY: `chunk` holds sixteen f32.
        unsafe {
            let x = _mm512_sub_ps(_mm512_loadu_ps(chunk.as_ptr()), shift);
            let p = exp16(x);
            _mm512_storeu_ps(chunk.as_mut_ptr(), p);
            sum = _mm512_add_ps(sum, p);
        }
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        // The first `tail.len()` lanes; the others read as −∞ and are left out of the sum.
        let lanes = first_lanes(tail.len());
        // SAFETY: the masked load and store touch only the `tail.len()` lanes of `tail`.
        unsafe {
            let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), lanes, tail.as_ptr());
            let p = exp16(_mm512_sub_ps(x, shift));
            _mm512_mask_storeu_ps(tail.as_mut_ptr(), lanes, p);
            sum = _mm512_mask_add_ps(sum, lanes, sum, p);
        }
    }
    _mm512_reduce_add_ps(sum)
}

/// e^x in sixteen lanes (see the module's doc).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp16(x: core::arch::x86_64::__m512) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    // max/min return their second operand when either is NaN: x's NaN survives both.
    let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
    let x = _mm512_min_ps(_mm512_set1_ps(89.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(P[0]);
    for &c in &P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e_r = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    _mm512_scalef_ps(e_r, n)
}

/// Whether the CPU has AVX2 and FMA (checked where it has no AVX-512F).
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// The plain loops over `f32::exp`: for CPUs without AVX2, and the last `len % 8` elements of
/// AVX2's rows.
mod plain {
    pub(super) fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
        let mut sum = 0.0;
        for p in row {
            *p = (*p - shift).exp();
            sum += *p;
        }
        sum
    }

    pub(super) fn sum_exp_shifted(row: &[f32], shift: f32) -> f32 {
        row.iter().map(|x| (x - shift).exp()).sum()
    }

    pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }

    pub(super) fn swiglu_backward(
        gate: &[f32],
        up: &[f32],
        grad: &[f32],
        d_gate: &mut [f32],
        d_up: &mut [f32],
    ) {
        let len = super::shortest(&[gate, up, grad, d_gate, d_up]);
        for i in 0..len {
            let (g, u, d) = (gate[i], up[i], grad[i]);
            let sigma = 1.0 / (1.0 + (-g).exp());
            d_gate[i] = d * u * sigma * (1.0 + g * (1.0 - sigma));
            d_up[i] = d * g * sigma;
        }
    }

    pub(super) fn max_of(row: &[f32]) -> f32 {
        row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }
}

/// The length of the shortest of `slices`.
fn shortest(slices: &[&[f32]]) -> usize {
    slices.iter().map(|s| s.len()).min().unwrap_or(0)
}

/// Eight lanes with AVX2 and FMA (see the module's doc); each function as its namesake above,
/// the last `len % 8` elements through [`plain`].
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{LN2_HI, LN2_LO, LOG2_E, P, plain};
    use core::arch::x86_64::*;

    /// The sum of a vector's lanes.
    #[target_feature(enable = "avx2,fma")]
    fn lanes_sum(v: __m256) -> f32 {
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        lanes.iter().sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
        let shift_lanes = _mm256_set1_ps(shift);
        let mut sum = _mm256_setzero_ps();
        let mut chunks = row.chunks_exact_mut(8);
        for chunk in &mut chunks {
            // SAFETY: `chunk` holds eight f32.
            unsafe {
                let p = exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift_lanes));
                _mm256_storeu_ps(chunk.as_mut_ptr(), p);
                sum = _mm256_add_ps(sum, p);
            }
        }
        lanes_sum(sum) + plain::exp_shifted(chunks.into_remainder(), shift)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn sum_exp_shifted(row: &[f32], shift: f32) -> f32 {
        let shift_lanes = _mm256_set1_ps(shift);
        let mut sum = _mm256_setzero_ps();
        let chunks = row.chunks_exact(8);
        let tail = chunks.remainder();
        for chunk in chunks {
            // SAFETY: `chunk` holds eight f32.
            let x = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
            sum = _mm256_add_ps(sum, exp8(_mm256_sub_ps(x, shift_lanes)));
        }
        lanes_sum(sum) + plain::sum_exp_shifted(tail, shift)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let len = super::shortest(&[gate, up, out]);
        let full = len / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for start in (0..full).step_by(8) {
            // SAFETY: the loads and the store touch start..start + 8 <= len of each slice (len
            // is the shortest's length).
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(start));
                let u = _mm256_loadu_ps(up.as_ptr().add(start));
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(start), _mm256_mul_ps(silu, u));
            }
        }
        plain::swiglu(&gate[full..len], &up[full..len], &mut out[full..len]);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn swiglu_backward(
        gate: &[f32],
        up: &[f32],
        grad: &[f32],
        d_gate: &mut [f32],
        d_up: &mut [f32],
    ) {
        let len = super::shortest(&[gate, up, grad, d_gate, d_up]);
        let full = len / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for start in (0..full).step_by(8) {
            // SAFETY: the loads and stores touch start..start + 8 <= len of each slice (len is
            // the shortest's length).
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(start));
                let u = _mm256_loadu_ps(up.as_ptr().add(start));
                let d = _mm256_loadu_ps(grad.as_ptr().add(start));
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                let sigma = _mm256_div_ps(one, _mm256_add_ps(one, e));
                let slope = _mm256_fmadd_ps(g, _mm256_sub_ps(one, sigma), one);
                let dg = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d, u), sigma), slope);
                let du = _mm256_mul_ps(_mm256_mul_ps(d, g), sigma);
                _mm256_storeu_ps(d_gate.as_mut_ptr().add(start), dg);
                _mm256_storeu_ps(d_up.as_mut_ptr().add(start), du);
            }
        }
        plain::swiglu_backward(
            &gate[full..len],
            &up[full..len],
            &grad[full..len],
            &mut d_gate[full..len],
            &mut d_up[full..len],
        );
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn max_of(row: &[f32]) -> f32 {
        let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
        let chunks = row.chunks_exact(8);
        let tail = chunks.remainder();
        for chunk in chunks {
            // SAFETY: `chunk` holds eight f32.
            // vmaxps returns its second operand where either is NaN: NaN is skipped, as by f32::max.
            max = _mm256_max_ps(unsafe { _mm256_loadu_ps(chunk.as_ptr()) }, max);
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), max) };
        lanes
            .iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }

    /// e^x in eight lanes (see the module's doc).
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        // max/min return their second operand when either is NaN: x's NaN survives both.
        let x = _mm256_max_ps(_mm256_set1_ps(-104.0), x);
        let x = _mm256_min_ps(_mm256_set1_ps(89.0), x);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut poly = _mm256_set1_ps(P[0]);
        for &c in &P[1..] {
            poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
        }
        let e_r = _mm256_add_ps(
            _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        // 2ⁿ = 2^⌊n/2⌋·2^(n−⌊n/2⌋), each power's exponent field k + 127 (k in −75..=64).
        let n = _mm256_cvtps_epi32(n);
        let half = _mm256_srai_epi32::<1>(n);
        let power = |k: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                k,
                _mm256_set1_epi32(127),
            )))
        };
        _mm256_mul_ps(
            _mm256_mul_ps(e_r, power(half)),
            power(_mm256_sub_epi32(n, half)),
        )
    }
}

#[cfg(test)]
mod tests {
    type SwigluBackward = fn(&[f32], &[f32], &[f32], &mut [f32], &mut [f32]);

    /// One implementation of the module's functions.
    struct Implementation {
        name: &'static str,
        exp_shifted: fn(&mut [f32], f32) -> f32,
        sum_exp_shifted: fn(&[f32], f32) -> f32,
        swiglu: fn(&[f32], &[f32], &mut [f32]),
        swiglu_backward: SwigluBackward,
        max_of: fn(&[f32]) -> f32,
    }

    /// Every implementation this CPU runs: the dispatching functions (AVX-512 where the CPU has
    /// it), AVX2's on their own where it has AVX2 and FMA, and the plain loops.
    fn implementations() -> Vec<Implementation> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut all = vec![
            Implementation {
                name: "dispatched",
                exp_shifted: super::exp_shifted,
                sum_exp_shifted: super::sum_exp_shifted,
                swiglu: super::swiglu,
                swiglu_backward: super::swiglu_backward,
                max_of: super::max_of,
            },
            Implementation {
                name: "plain",
                exp_shifted: super::plain::exp_shifted,
                sum_exp_shifted: super::plain::sum_exp_shifted,
                swiglu: super::plain::swiglu,
                swiglu_backward: super::plain::swiglu_backward,
                max_of: super::plain::max_of,
            },
        ];
        #[cfg(target_arch = "x86_64")]
        if super::avx2_fma() {
            use super::avx2;
            // SAFETY (each): the CPU has AVX2 and FMA (checked above).
            all.push(Implementation {
                name: "avx2",
                exp_shifted: |row, shift| unsafe { avx2::exp_shifted(row, shift) },
                sum_exp_shifted: |row, shift| unsafe { avx2::sum_exp_shifted(row, shift) },
                swiglu: |gate, up, out| unsafe { avx2::swiglu(gate, up, out) },
                swiglu_backward: |gate, up, grad, d_gate, d_up| unsafe {
                    avx2::swiglu_backward(gate, up, grad, d_gate, d_up)
                },
                max_of: |row| unsafe { avx2::max_of(row) },
            });
        }
        all
    }

    /// Relative distance, 0 for equal values (infinities and zeros included), 1 for NaN
    /// against a number.
    fn distance(a: f32, b: f32) -> f32 {
        if a == b || a.is_nan() && b.is_nan() {
            0.0
        } else if a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite() {
            1.0
        } else {
            (a - b).abs() / a.abs().max(b.abs()).max(f32::MIN_POSITIVE)
        }
    }

    #[test]
    fn matches_f32_exp_over_its_range_and_at_the_edges() {
        // The special values and the edges first (the vector lanes take them in rows of 8 or
        // more), then every 1/64 from −110 to 95 (both clamps crossed, the overflow and
        // underflow to denormals, lengths that leave tails of every size).
        let mut xs = vec![
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            88.72,
            88.73,
            -87.3,
            -103.9,
            0.346_573_6,
            -0.346_573_6,
        ];
        xs.extend((-110 * 64..=95 * 64).map(|i| i as f32 / 64.0));
        for imp in implementations() {
            let name = imp.name;
            for len in [xs.len(), 1, 7, 8, 9, 15, 16, 17, 33] {
                let row = &xs[..len];
                for shift in [
                    0.0f32,
                    3.5,
                    -20.0,
                    f32::NEG_INFINITY,
                    f32::INFINITY,
                    f32::NAN,
                ] {
                    let mut got = row.to_vec();
                    let sum = (imp.exp_shifted)(&mut got, shift);
                    let read_only = (imp.sum_exp_shifted)(row, shift);
                    assert!(
                        read_only == sum || read_only.is_nan() && sum.is_nan(),
                        "{name}: sum_exp_shifted {read_only}, exp_shifted {sum}"
                    );
                    let mut expected_sum = 0.0f64;
                    for (x, got) in row.iter().zip(&got) {
                        let expected = (x - shift).exp();
                        expected_sum += expected as f64;
                        // Denormal results keep fewer bits; their absolute error is below 1e-44.
                        let close = distance(*got, expected) <= 4e-7
                            || expected.abs() < f32::MIN_POSITIVE && (got - expected).abs() < 1e-44;
                        assert!(
                            close,
                            "{name}: e^({x} − {shift}): {got}, f32::exp {expected}"
                        );
                    }
                    // Where the CPU has AVX-512F, AVX2's lanes give its bits: 2ⁿ rounds once in
                    // both.
                    #[cfg(target_arch = "x86_64")]
                    if name == "avx2" && std::arch::is_x86_feature_detected!("avx512f") {
                        let mut wide = row.to_vec();
                        super::exp_shifted(&mut wide, shift);
                        let lanes = len / 8 * 8;
                        for ((x, a), b) in row.iter().zip(&got[..lanes]).zip(&wide) {
                            let same = a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan();
                            assert!(same, "e^({x} − {shift}): AVX2 {a}, AVX-512 {b}");
                        }
                    }
                    let sum_close = distance(sum, expected_sum as f32) <= 1e-5
                        || sum.is_nan() && expected_sum.is_nan();
                    assert!(
                        sum_close,
                        "{name}: sum {sum}, expected {expected_sum} (len {len})"
                    );
                }
            }
        }
    }

    #[test]
    fn swiglu_its_gradients_and_max_match_plain_loops() {
        for imp in implementations() {
            let name = imp.name;
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 100] {
                let gate: Vec<f32> = (0..len).map(|i| (i as f32 - 50.0) * 0.37).collect();
                let up: Vec<f32> = (0..len).map(|i| 1.5 - i as f32 * 0.11).collect();
                let grad: Vec<f32> = (0..len).map(|i| 0.25 - i as f32 * 0.03).collect();
                let mut out = vec![f32::NAN; len];
                (imp.swiglu)(&gate, &up, &mut out);
                let (mut d_gate, mut d_up) = (vec![f32::NAN; len], vec![f32::NAN; len]);
                (imp.swiglu_backward)(&gate, &up, &grad, &mut d_gate, &mut d_up);
                for i in 0..len {
                    let (g, u, d) = (gate[i], up[i], grad[i]);
                    let sigma = 1.0 / (1.0 + (-g).exp());
                    let expected = [
                        g * sigma * u,
                        d * u * sigma * (1.0 + g * (1.0 - sigma)),
                        d * g * sigma,
                    ];
                    for (got, expected, what) in [
                        (out[i], expected[0], "silu(g)·u"),
                        (d_gate[i], expected[1], "∂gate"),
                        (d_up[i], expected[2], "∂up"),
                    ] {
                        // Near a zero of ∂gate its terms cancel: absolute error there.
                        let close = distance(got, expected) <= 1e-6
                            || (got - expected).abs() <= 1e-6 * d.abs().max(u.abs());
                        assert!(close, "{name}: {what} at g = {g}: {got}, {expected}");
                    }
                }
                let expected = gate.iter().fold(f32::NEG_INFINITY, |m, &g| m.max(g));
                assert_eq!((imp.max_of)(&gate), expected, "{name}: max of {len}");
            }
            // Sixteen and more, so that the vector lanes take them.
            let (gate, up) = (
                [-200.0, 200.0, f32::NAN].repeat(6),
                [2.0, 2.0, 1.0].repeat(6),
            );
            let mut out = vec![0.0; gate.len()];
            (imp.swiglu)(&gate, &up, &mut out);
            for three in out.chunks_exact(3) {
                assert_eq!(three[..2], [0.0, 400.0], "{name}");
                assert!(three[2].is_nan(), "{name}");
            }
            let with_nan = [
                1.0,
                f32::NAN,
                3.0,
                -2.0,
                0.5,
                9.0,
                f32::NAN,
                4.0,
                2.0,
                f32::NAN,
            ];
            let with_nan = with_nan.repeat(2);
            assert_eq!((imp.max_of)(&with_nan), 9.0, "{name}: NaN is skipped");
        }
    }
}
