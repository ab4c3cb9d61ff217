//! RMSNorm, RoPE, SwiGLU's gate, attention's causal softmax, DIFF attention's differential map,
//! AdamW's update and the gradients' sum of squares as the decoder and trainer compute them, each
//! in one pass on Flex:
//!
//! ```text
//! RMSNorm(x) = x / √(mean(x²) + ε) · γ                      (per row, mean over d_model)
//! RoPE(x)[2i]   = x[2i]·cos(tθᵢ) − x[2i+1]·sin(tθᵢ)          (per head, position t)
//! RoPE(x)[2i+1] = x[2i+1]·cos(tθᵢ) + x[2i]·sin(tθᵢ)
//! SwiGLU(g, u) = silu(g)·u = g·σ(g)·u,   σ(g) = 1 / (1 + e^(−g))
//! CausalSoftmax(x)_ij = e^(c·x_ij) / Σ_{k ≤ i'} e^(c·x_ik) for j ≤ i', else 0
//!     (row i of the S query positions, i' = i + T − S among the T keys; c = 1/√d)
//! Differential(x₁, x₂; λ) = CausalSoftmax(x₁) − λ·CausalSoftmax(x₂)
//!     (x₁, x₂ the scores of half-heads 2h and 2h+1: DIFF's A₁ − λA₂)
//! PairDifference(x₁, x₂; λ) = x₁ − λ·x₂
//!     (rows of half-heads 2h and 2h+1 at one position: DIFF V2's o₂ₕ − λₜ,ₕ·o₂ₕ₊₁, λ per
//!     token and head; DIFF's maps or outputs with one λ)
//! ```
//!
//! with their gradients (d: the incoming gradient, r = 1/√(mean(x²) + ε) per row of D):
//!
//! ```text
//! RMSNorm:  ∂x = r·(d⊙γ − x·r²·⟨d⊙γ, x⟩/D),   ∂γ = Σ_rows d⊙x·r
//! RoPE:     ∂x = RoPE of d by (cos, −sin)        (the inverse rotation)
//! SwiGLU:   ∂g = d·u·σ(g)·(1 + g·(1 − σ(g))),   ∂u = d·g·σ(g)
//! CausalSoftmax:  ∂x = c·y⊙(d − ⟨d, y⟩)          (per row; y the output, 0 where masked)
//! Differential:   ∂x₁ = c·y₁⊙(d − ⟨d, y₁⟩),   ∂x₂ = −λ·c·y₂⊙(d − ⟨d, y₂⟩),   ∂λ = −Σ_rows ⟨d, y₂⟩
//!     (y₁, y₂ the two causal softmax maps, kept from the forward pass)
//! PairDifference: ∂x₁ = d,   ∂x₂ = −λ·d,   ∂λ = −⟨d, x₂⟩   (summed where λ is broadcast)
//! ```
//!
//! and AdamW as [`adamw`] states it, and `Σ xᵢ²` ([`sum_of_squares`], no autodiff). Burn's ops spend a dozen passes (and as many tensors) on each,
//! and autodiff as many again backward: with Flex in f32 a decoding step at a 135M model's shape
//! made about 50 such small ops per layer. Here each is one pass, taken by Flex for contiguous f32
//! tensors, under autodiff as one operation with the backward above; every other backend or dtype
//! takes Burn's ops. RoPE gives the same numbers (the same products and sums in the same order),
//! AdamW the same bits; RMSNorm's mean of squares is summed in another order than Flex's
//! `mean_dim` and SwiGLU's exponential is [`crate::exp`]'s: results agree to f32 rounding.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use crate::profile::{self, Class};
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata, backend_extension};
use burn::nn::{RmsNorm, RotaryEncoding};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, DType, Scalar, Shape, Slice, Tensor, TensorData};

/// `silu(gate) ⊙ up` (SwiGLU's gating), in one pass where Flex takes it.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    profile::time(Class::Activation, || {
        <burn::backend::Dispatch as FusedOps>::swiglu(
            gate.clone().into_dispatch(),
            up.clone().into_dispatch(),
        )
        .map(Tensor::from_dispatch)
        .unwrap_or_else(|| silu(gate) * up)
    })
}

/// `norm.forward(x)` for `x` `[.., d_model]`, in one pass where Flex takes it.
pub fn rms_norm<const D: usize>(norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
    profile::time(Class::Norm, || {
        fused_rms_norm(x.clone(), norm.gamma.val(), norm.epsilon).unwrap_or_else(|| norm.forward(x))
    })
}

/// `scale·norm.forward(x)`: where Flex takes the norm in one pass, `scale` joins its gain γ (a
/// product over the last axis only) instead of a second pass over `x`.
pub fn rms_norm_scaled<const D: usize>(norm: &RmsNorm, x: Tensor<D>, scale: f64) -> Tensor<D> {
    profile::time(Class::Norm, || {
        fused_rms_norm(x.clone(), norm.gamma.val().mul_scalar(scale), norm.epsilon)
            .unwrap_or_else(|| norm.forward(x).mul_scalar(scale))
    })
}

fn fused_rms_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    epsilon: f64,
) -> Option<Tensor<D>> {
    <burn::backend::Dispatch as FusedOps>::rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        epsilon,
    )
    .map(Tensor::from_dispatch)
}

/// `[B, S, heads·d]` at positions `start..start + S` → RoPE-rotated heads `[B, heads, S, d]`
/// (adjacent pairs, GPT-J layout, from the tables of Burn's `RotaryEncoding`), in one pass where
/// Flex takes it.
pub fn rotary(x: Tensor<3>, heads: usize, rope: &RotaryEncoding, start: usize) -> Tensor<4> {
    profile::time(Class::Rotary, || {
        let [b, s, width] = x.dims();
        let table = rope.freq_complex.clone().narrow(0, start, s);
        <burn::backend::Dispatch as FusedOps>::rotary(
            x.clone().into_dispatch(),
            table.into_dispatch(),
            heads,
        )
        .map(|y| {
            Tensor::<3>::from_dispatch(y)
                .reshape([b, s, heads, width / heads])
                .swap_dims(1, 2)
        })
        .unwrap_or_else(|| rotary_plain(x, heads, rope, start))
    })
}

/// [`rotary`] by Burn's ops: `x ⊙ cos + swap(x) ⊙ (∓sin)` with `swap` exchanging each pair, in
/// the projection's own `[B, S, heads, d]` layout (Burn's `RotaryEncoding::forward` does the same
/// through a small matmul on a rearranged copy, several times slower).
pub fn rotary_plain(x: Tensor<3>, heads: usize, rope: &RotaryEncoding, start: usize) -> Tensor<4> {
    let [b, s, width] = x.dims();
    let d = width / heads;
    let (device, dtype) = (x.device(), x.dtype());
    // [S, d, 2]: cos and sin of tθᵢ, each repeated for both members of pair i.
    let table = rope.freq_complex.clone().narrow(0, start, s);
    let cos = table.clone().narrow(2, 0, 1).reshape([1, s, 1, d]);
    let sign = Tensor::<1>::from_floats([-1.0, 1.0], &device).reshape([1, 1, 2]);
    let sin = (table.narrow(2, 1, 1).reshape([s, d / 2, 2]) * sign).reshape([1, s, 1, d]);
    let x = x.reshape([b, s, heads, d]);
    let swapped = x
        .clone()
        .reshape([b, s, heads, d / 2, 2])
        .flip([4])
        .reshape([b, s, heads, d]);
    (x * cos.cast(dtype) + swapped * sin.cast(dtype)).swap_dims(1, 2)
}

/// The causal attention map of `scores` `[.., R, T]` (`q·kᵀ` unscaled, [`CausalSoftmax`] of the
/// module's equations with `c = scale`): row r is query position `r mod positions` of the
/// `positions` last of the T keys' positions, so that the query heads of a GQA group may be
/// stacked along the rows. In one pass per row where Flex takes it.
///
/// [`CausalSoftmax`]: self
pub fn causal_softmax<const D: usize>(
    scores: Tensor<D>,
    positions: usize,
    scale: f64,
) -> Tensor<D> {
    check_positions(&scores.dims(), positions);
    <burn::backend::Dispatch as FusedOps>::causal_softmax(
        scores.clone().into_dispatch(),
        positions,
        scale,
    )
    .map(Tensor::from_dispatch)
    .unwrap_or_else(|| causal_softmax_plain(scores, positions, scale))
}

/// [`causal_softmax`] by Burn's operations: the scaled scores, `-inf` above each row's diagonal,
/// softmax.
pub fn causal_softmax_plain<const D: usize>(
    scores: Tensor<D>,
    positions: usize,
    scale: f64,
) -> Tensor<D> {
    let dims = scores.dims();
    check_positions(&dims, positions);
    let (rows, keys) = (dims[D - 2], dims[D - 1]);
    let future = Tensor::<2, Bool>::tril_mask(
        [positions, keys],
        (keys - positions) as i64,
        &scores.device(),
    )
    .repeat_dim(0, rows / positions)
    .unsqueeze::<D>();
    softmax(
        scores
            .mul_scalar(scale)
            .mask_fill(future, f32::NEG_INFINITY),
        D - 1,
    )
}

/// Panics, naming the numbers, unless the rows of a causal map `[.., R, T]` can cycle over the
/// `positions` last of its T keys' positions: 1 ≤ positions ≤ T, R a multiple of positions.
fn check_positions(dims: &[usize], positions: usize) {
    let (rows, keys) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    assert!(
        positions >= 1 && positions <= keys && rows % positions == 0,
        "causal softmax of scores {dims:?}: {positions} query positions must be 1 to the \
         {keys} keys and divide the {rows} rows"
    );
}

/// DIFF attention's differential map `A₁ − λ·A₂` ([`Differential`] of the module's equations)
/// from the scores `[B, 2H, R, T]` of half-head pairs (2h, 2h+1), as `[B, H, R, T]`; each map is
/// [`causal_softmax`]'s of its scores with `positions` and `scale`, `lambda` a `[1, 1, 1]`
/// tensor. In one pass per pair of rows where Flex takes it (the maps kept for the backward).
///
/// [`Differential`]: self
pub fn differential_softmax(
    scores: Tensor<4>,
    positions: usize,
    scale: f64,
    lambda: Tensor<3>,
) -> Tensor<4> {
    check_positions(&scores.dims(), positions);
    <burn::backend::Dispatch as FusedOps>::differential_softmax(
        scores.clone().into_dispatch(),
        positions,
        scale,
        lambda.clone().into_dispatch(),
    )
    .map(Tensor::from_dispatch)
    .unwrap_or_else(|| pair_difference(causal_softmax(scores, positions, scale), lambda))
}

/// [`differential_softmax`] by Burn's operations.
pub fn differential_softmax_plain(
    scores: Tensor<4>,
    positions: usize,
    scale: f64,
    lambda: Tensor<3>,
) -> Tensor<4> {
    pair_difference_plain(causal_softmax_plain(scores, positions, scale), lambda)
}

/// Half-head pairs `[B, 2H, S, n]` into `x_{2h} − λ_{b,s,h}·x_{2h+1}` ([`PairDifference`] of the
/// module's equations), `[B, H, S, n]`; `lambda` `[B, S, H]`, each dimension of it also 1
/// (broadcast: `[1, 1, 1]` for one λ). In one pass where Flex takes it.
///
/// [`PairDifference`]: self
pub fn pair_difference(pairs: Tensor<4>, lambda: Tensor<3>) -> Tensor<4> {
    <burn::backend::Dispatch as FusedOps>::pair_difference(
        pairs.clone().into_dispatch(),
        lambda.clone().into_dispatch(),
    )
    .map(Tensor::from_dispatch)
    .unwrap_or_else(|| pair_difference_plain(pairs, lambda))
}

/// [`pair_difference`] by Burn's operations.
pub fn pair_difference_plain(pairs: Tensor<4>, lambda: Tensor<3>) -> Tensor<4> {
    let [b, h2, s, n] = pairs.dims();
    let pairs = pairs.reshape([b, h2 / 2, 2, s, n]);
    let [first, second] = [0, 1].map(|c| pairs.clone().narrow(2, c, 1).squeeze_dim::<4>(2));
    // λ [B, S, H] → [B, H, S, 1].
    first - second * lambda.swap_dims(1, 2).unsqueeze_dim::<4>(3)
}

/// `Σ xᵢ²` of `x` in f32, as a tensor `[1]`: one pass on Flex for a contiguous f32 `x` (parts
/// over rayon's threads, each summed in sixteen lanes, the parts added in order: the same sum on
/// every run), elsewhere `x.cast(f32).powf_scalar(2).sum()` (a tensor of squares, then its sum).
/// For the global norm of the gradients, which reads every one.
pub fn sum_of_squares(x: Tensor<1>) -> Tensor<1> {
    <burn::backend::Dispatch as FusedOps>::sum_of_squares(x.clone().into_dispatch())
        .map(Tensor::from_dispatch)
        .unwrap_or_else(|| x.cast(DType::F32).powf_scalar(2.0).sum())
}

/// AdamW's numbers for one step t of one parameter: β₁, β₂, ε, the bias corrections
/// c₁ = 1 − β₁ᵗ and c₂ = 1 − β₂ᵗ, the decay factor `keep` = 1 − lr·λ (1 without weight decay) and
/// the learning rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub correction_1: f32,
    pub correction_2: f32,
    pub keep: f32,
    pub lr: f32,
}

/// AdamW's update of a parameter p with gradient g and moments m, v (Loshchilov & Hutter, 2019),
/// in the order of Burn 0.22.1's `AdamW` operations, so that each number is rounded as there:
///
/// ```text
/// m' = m·β₁ + g·(1 − β₁),   v' = v·β₂ + (g·g)·(1 − β₂)
/// p' = p·keep − ((m'/c₁) / (√(v'/c₂) + ε))·lr
/// ```
///
/// On Flex, for f32 tensors with contiguous layouts, one pass (in place where the tensors are
/// not shared) instead of fifteen; Burn's operations elsewhere. `(p', m', v')`.
pub fn adamw(
    param: Tensor<1>,
    grad: Tensor<1>,
    moment_1: Tensor<1>,
    moment_2: Tensor<1>,
    step: AdamWStep,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let (p, m, v) = <burn::backend::Dispatch as FusedOps>::adamw(
        param.into_dispatch(),
        grad.into_dispatch(),
        moment_1.into_dispatch(),
        moment_2.into_dispatch(),
        step,
    );
    (
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    )
}

/// [`adamw`] by Burn's operations.
fn adamw_plain<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moment_1: FloatTensor<B>,
    moment_2: FloatTensor<B>,
    step: AdamWStep,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let s = |x: f32| Scalar::from(x);
    let m = B::float_add(
        B::float_mul_scalar(moment_1, s(step.beta_1)),
        B::float_mul_scalar(grad.clone(), s(1.0 - step.beta_1)),
    );
    let v = B::float_add(
        B::float_mul_scalar(moment_2, s(step.beta_2)),
        B::float_mul_scalar(B::float_mul(grad.clone(), grad), s(1.0 - step.beta_2)),
    );
    let m_hat = B::float_div_scalar(m.clone(), s(step.correction_1));
    let v_hat = B::float_div_scalar(v.clone(), s(step.correction_2));
    let delta = B::float_div(
        m_hat,
        B::float_add_scalar(B::float_sqrt(v_hat), s(step.epsilon)),
    );
    let decayed = match step.keep == 1.0 {
        true => param,
        false => B::float_mul_scalar(param, s(step.keep)),
    };
    let p = B::float_sub(decayed, B::float_mul_scalar(delta, s(step.lr)));
    (p, m, v)
}

/// The operations: `None` (Burn's ops) everywhere but on Flex.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait FusedOps: Backend {
    /// RMSNorm of `x` `[.., d]` with `gamma` `[d]`; `None`: not taken.
    fn rms_norm(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _epsilon: f64,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// RMSNorm's gradients `(∂x, ∂γ)` from its input, γ, ε and its output's gradient (called
    /// only where [`FusedOps::rms_norm`] was taken).
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm_backward_plain::<Self>(x, gamma, grad, epsilon)
    }

    /// `silu(gate) ⊙ up` for tensors of one shape; `None`: not taken.
    fn swiglu(_gate: FloatTensor<Self>, _up: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        None
    }

    /// SwiGLU's gradients `(∂gate, ∂up)` from its inputs and the gradient of `silu(gate) ⊙ up`
    /// (see [`crate::exp`]'s `swiglu_backward` for the formulas).
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        swiglu_backward_plain::<Self>(gate, up, grad)
    }

    /// One AdamW step of a parameter that has moments (every step after its first), operation
    /// for operation as Burn's `AdamW`: see [`adamw`]. `(p', m', v')`.
    fn adamw(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        adamw_plain::<Self>(param, grad, moment_1, moment_2, step)
    }

    /// [`sum_of_squares`] of `x`; `None`: not taken.
    fn sum_of_squares(_x: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        None
    }

    /// [`causal_softmax`] of `scores` `[.., R, T]`; `None`: not taken.
    fn causal_softmax(
        _scores: FloatTensor<Self>,
        _positions: usize,
        _scale: f64,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// The gradient of [`FusedOps::causal_softmax`]'s scores from its output `y` and the
    /// output's `grad`: `scale·y⊙(grad − ⟨grad, y⟩)` per row (called only where it was taken).
    fn causal_softmax_backward(
        y: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        causal_softmax_backward_plain::<Self>(y, grad, scale)
    }

    /// [`differential_softmax`] of `scores` `[B, 2H, R, T]` with `lambda` `[1, 1, 1]`;
    /// `None`: not taken.
    fn differential_softmax(
        _scores: FloatTensor<Self>,
        _positions: usize,
        _scale: f64,
        _lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// [`FusedOps::differential_softmax`] with the two causal softmax maps `[B, 2H, R, T]` it
    /// subtracted, for the backward (autodiff's forward calls it); `None`: not taken.
    fn differential_softmax_with_maps(
        _scores: FloatTensor<Self>,
        _positions: usize,
        _scale: f64,
        _lambda: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        None
    }

    /// The gradients `(∂scores, ∂λ)` of [`FusedOps::differential_softmax`] from its two maps
    /// `y` `[B, 2H, R, T]`, λ and the output's `grad` `[B, H, R, T]` (the module's equations;
    /// called only where it was taken).
    fn differential_softmax_backward(
        y: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        differential_softmax_backward_plain::<Self>(y, lambda, grad, scale)
    }

    /// [`pair_difference`] of `pairs` `[B, 2H, S, n]` with `lambda` `[B, S, H]` (or 1 in any of
    /// its dimensions); `None`: not taken.
    fn pair_difference(
        _pairs: FloatTensor<Self>,
        _lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// The gradients `(∂pairs, ∂λ)` of [`FusedOps::pair_difference`] from its inputs and the
    /// output's `grad` `[B, H, S, n]` (the module's equations; called only where it was taken).
    fn pair_difference_backward(
        pairs: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        pair_difference_backward_plain::<Self>(pairs, lambda, grad)
    }

    /// RoPE of `x` `[B, S, heads·d]` by `table` `[S, d, 2]` (cos, sin), as `[B, S, heads·d]`;
    /// `None`: not taken.
    fn rotary(
        _x: FloatTensor<Self>,
        _table: FloatTensor<Self>,
        _heads: usize,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// The gradient of [`FusedOps::rotary`]'s input from its output's `grad` `[B, S, heads·d]`:
    /// the inverse rotation (called only where the rotation was taken).
    fn rotary_backward(
        grad: FloatTensor<Self>,
        table: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        rotary_backward_plain::<Self>(grad, table, heads)
    }
}

#[cfg(feature = "flex")]
impl FusedOps for burn::backend::Flex {
    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> Option<FloatTensor<Self>> {
        flex::rms_norm(&x, &gamma, epsilon)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::rms_norm_backward(&x, &gamma, &grad, epsilon)
            .unwrap_or_else(|| rms_norm_backward_plain::<Self>(x, gamma, grad, epsilon))
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        flex::swiglu(&gate, &up)
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::swiglu_backward(&gate, &up, &grad)
            .unwrap_or_else(|| swiglu_backward_plain::<Self>(gate, up, grad))
    }

    fn rotary(
        x: FloatTensor<Self>,
        table: FloatTensor<Self>,
        heads: usize,
    ) -> Option<FloatTensor<Self>> {
        flex::rotary(&x, &table, heads, 1.0)
    }

    fn causal_softmax(
        scores: FloatTensor<Self>,
        positions: usize,
        scale: f64,
    ) -> Option<FloatTensor<Self>> {
        flex::causal_softmax(&scores, positions, scale as f32)
    }

    fn causal_softmax_backward(
        y: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        flex::causal_softmax_backward(&y, &grad, scale as f32)
            .unwrap_or_else(|| causal_softmax_backward_plain::<Self>(y, grad, scale))
    }

    fn differential_softmax(
        scores: FloatTensor<Self>,
        positions: usize,
        scale: f64,
        lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        flex::differential_softmax(&scores, positions, scale as f32, &lambda).map(|(map, _)| map)
    }

    fn differential_softmax_with_maps(
        scores: FloatTensor<Self>,
        positions: usize,
        scale: f64,
        lambda: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        flex::differential_softmax(&scores, positions, scale as f32, &lambda)
    }

    fn pair_difference(
        pairs: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        flex::pair_difference(&pairs, &lambda)
    }

    fn pair_difference_backward(
        pairs: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::pair_difference_backward(&pairs, &lambda, &grad)
            .unwrap_or_else(|| pair_difference_backward_plain::<Self>(pairs, lambda, grad))
    }

    fn differential_softmax_backward(
        y: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::differential_softmax_backward(&y, &lambda, &grad, scale as f32)
            .unwrap_or_else(|| differential_softmax_backward_plain::<Self>(y, lambda, grad, scale))
    }

    fn rotary_backward(
        grad: FloatTensor<Self>,
        table: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        flex::rotary(&grad, &table, heads, -1.0)
            .unwrap_or_else(|| rotary_backward_plain::<Self>(grad, table, heads))
    }

    fn adamw(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        match flex::adamw_takes(&[&param, &grad, &moment_1, &moment_2]) {
            true => flex::adamw(param, &grad, moment_1, moment_2, step),
            false => adamw_plain::<Self>(param, grad, moment_1, moment_2, step),
        }
    }

    fn sum_of_squares(x: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        flex::sum_of_squares(&x)
    }
}
default_ops!(FusedOps, no_autodiff);

/// Under autodiff RMSNorm, RoPE and SwiGLU's gate are each one operation with its own backward
/// where the backend computes them in one pass (Flex): RMSNorm keeps x and γ (r is recomputed
/// backward), RoPE only its table, SwiGLU `gate` and `up`. AdamW runs outside autodiff.
impl<B: Backend + FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> Option<FloatTensor<Self>> {
        let guards = [x.node(), gamma.node()];
        let [x, gamma] = [x, gamma].map(|t| t.into_primitive());
        let out = B::rms_norm(x.clone(), gamma.clone(), epsilon)?;
        let backward = RmsNormBackward { epsilon };
        Some(
            match backward.prepare::<C>(guards).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish((x, gamma), out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }

    fn rotary(
        x: FloatTensor<Self>,
        table: FloatTensor<Self>,
        heads: usize,
    ) -> Option<FloatTensor<Self>> {
        // Only x is differentiated: the table is Burn's constant `freq_complex`.
        let guard = [x.node()];
        let (x, table) = (x.into_primitive(), table.into_primitive());
        let out = B::rotary(x, table.clone(), heads)?;
        let backward = RotaryBackward { heads };
        Some(
            match backward.prepare::<C>(guard).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish(table, out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        let guards = [gate.node(), up.node()];
        let [gate, up] = [gate, up].map(|t| t.into_primitive());
        let out = B::swiglu(gate.clone(), up.clone())?;
        Some(
            match SwigluBackward
                .prepare::<C>(guards)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish((gate, up), out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }

    fn causal_softmax(
        scores: FloatTensor<Self>,
        positions: usize,
        scale: f64,
    ) -> Option<FloatTensor<Self>> {
        let guard = [scores.node()];
        let out = B::causal_softmax(scores.into_primitive(), positions, scale)?;
        let backward = CausalSoftmaxBackward { scale };
        Some(
            match backward.prepare::<C>(guard).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish(out.clone(), out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }
    fn differential_softmax(
        scores: FloatTensor<Self>,
        positions: usize,
        scale: f64,
        lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let guards = [scores.node(), lambda.node()];
        let lambda = lambda.into_primitive();
        let (map, maps) = B::differential_softmax_with_maps(
            scores.into_primitive(),
            positions,
            scale,
            lambda.clone(),
        )?;
        let backward = DifferentialSoftmaxBackward { scale };
        Some(
            match backward.prepare::<C>(guards).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish((maps, lambda), map),
                OpsKind::UnTracked(prep) => prep.finish(map),
            },
        )
    }

    fn pair_difference(
        pairs: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let guards = [pairs.node(), lambda.node()];
        let [pairs, lambda] = [pairs, lambda].map(|t| t.into_primitive());
        let out = B::pair_difference(pairs.clone(), lambda.clone())?;
        Some(
            match PairDifferenceBackward
                .prepare::<C>(guards)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish((pairs, lambda), out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }
}

/// Registers each gradient of an operation's backward with its parent (`ops.parents`' ids), where
/// the parent is tracked.
pub(crate) fn register<B: Backend, const N: usize>(
    grads: &mut Gradients,
    parents: [Option<NodeId>; N],
    gradients: [FloatTensor<B>; N],
) {
    for (parent, grad) in parents.into_iter().zip(gradients) {
        if let Some(id) = parent {
            grads.register::<B>(id, grad);
        }
    }
}

#[derive(Debug)]
struct RmsNormBackward {
    epsilon: f64,
}

impl<B: Backend + FusedOps> Backward<B, 2> for RmsNormBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (d_x, d_gamma) = profile::time(Class::Norm, || {
            B::rms_norm_backward(x, gamma, grad, self.epsilon)
        });
        register::<B, 2>(
            grads,
            ops.parents.map(|p| p.map(|node| node.id)),
            [d_x, d_gamma],
        );
    }
}

#[derive(Debug)]
struct RotaryBackward {
    heads: usize,
}

impl<B: Backend + FusedOps> Backward<B, 1> for RotaryBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let d_x = profile::time(Class::Rotary, || {
            B::rotary_backward(grad, ops.state, self.heads)
        });
        register::<B, 1>(grads, ops.parents.map(|p| p.map(|node| node.id)), [d_x]);
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: Backend + FusedOps> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (gate, up) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (d_gate, d_up) =
            profile::time(Class::Activation, || B::swiglu_backward(gate, up, grad));
        register::<B, 2>(
            grads,
            ops.parents.map(|p| p.map(|node| node.id)),
            [d_gate, d_up],
        );
    }
}

#[derive(Debug)]
struct CausalSoftmaxBackward {
    scale: f64,
}

impl<B: Backend + FusedOps> Backward<B, 1> for CausalSoftmaxBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let d_x = B::causal_softmax_backward(ops.state, grad, self.scale);
        register::<B, 1>(grads, ops.parents.map(|p| p.map(|node| node.id)), [d_x]);
    }
}

#[derive(Debug)]
struct DifferentialSoftmaxBackward {
    scale: f64,
}

impl<B: Backend + FusedOps> Backward<B, 2> for DifferentialSoftmaxBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (maps, lambda) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (d_scores, d_lambda) = B::differential_softmax_backward(maps, lambda, grad, self.scale);
        register::<B, 2>(
            grads,
            ops.parents.map(|p| p.map(|node| node.id)),
            [d_scores, d_lambda],
        );
    }
}

/// [`FusedOps::differential_softmax_backward`] by Burn's operations: the pair difference's
/// backward gives the maps' gradients and ∂λ, the causal softmax's backward the scores'.
fn differential_softmax_backward_plain<B: Backend>(
    y: FloatTensor<B>,
    lambda: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (d_maps, d_lambda) = pair_difference_backward_plain::<B>(y.clone(), lambda, grad);
    (
        causal_softmax_backward_plain::<B>(y, d_maps, scale),
        d_lambda,
    )
}

#[derive(Debug)]
struct PairDifferenceBackward;

impl<B: Backend + FusedOps> Backward<B, 2> for PairDifferenceBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (pairs, lambda) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (d_pairs, d_lambda) = B::pair_difference_backward(pairs, lambda, grad);
        register::<B, 2>(
            grads,
            ops.parents.map(|p| p.map(|node| node.id)),
            [d_pairs, d_lambda],
        );
    }
}

/// [`FusedOps::pair_difference_backward`] by Burn's operations: `d` and `−λ·d` for the pairs,
/// `−⟨d, x₂⟩` for λ, summed over the dimensions λ is broadcast along.
fn pair_difference_backward_plain<B: Backend>(
    pairs: FloatTensor<B>,
    lambda: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = pairs.shape();
    let [b, h2, s, n] = shape.dims();
    let lambda_shape = lambda.shape();
    let [lb, ls, lh] = lambda_shape.dims();
    let (device, dtype) = (pairs.device(), pairs.dtype());
    let pairs = B::float_reshape(pairs, Shape::new([b, h2 / 2, 2, s, n]));
    let grad = B::float_reshape(grad, Shape::new([b, h2 / 2, 1, s, n]));
    // λ [B, S, H] → [B, H, 1, S, 1]; per half of a pair its factor, 1 and −λ.
    let lambda = B::float_reshape(
        B::float_swap_dims(lambda, 1, 2),
        Shape::new([lb, lh, 1, ls, 1]),
    );
    let factors = B::float_cat(
        vec![
            B::float_ones(Shape::new([lb, lh, 1, ls, 1]), &device, dtype.into()),
            B::float_neg(lambda),
        ],
        2,
    );
    let d_pairs = B::float_reshape(B::float_mul(grad.clone(), factors), shape);
    let slices = [0..b, 0..h2 / 2, 1..2, 0..s, 0..n].map(Slice::from);
    let second = B::float_slice(pairs, &slices);
    let inner = B::float_sum_dim(B::float_mul(grad, second), 4);
    let inner = B::float_swap_dims(B::float_reshape(inner, Shape::new([b, h2 / 2, s])), 1, 2);
    // Summed over λ's broadcast dimensions: [B, S, H] → λ's shape.
    let summed = [(0, lb), (1, ls), (2, lh)]
        .into_iter()
        .fold(inner, |t, (dim, size)| match size {
            1 => B::float_sum_dim(t, dim),
            _ => t,
        });
    (d_pairs, B::float_neg(summed))
}

/// [`FusedOps::causal_softmax_backward`] by Burn's operations.
fn causal_softmax_backward_plain<B: Backend>(
    y: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let last = y.shape().num_dims() - 1;
    let dot = B::float_sum_dim(B::float_mul(grad.clone(), y.clone()), last);
    B::float_mul_scalar(
        B::float_mul(y, B::float_sub(grad, dot)),
        Scalar::from(scale as f32),
    )
}

/// [`FusedOps::rms_norm_backward`] by Burn's operations, over the rows `[N, D]` of `x`.
fn rms_norm_backward_plain<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    grad: FloatTensor<B>,
    epsilon: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let d = gamma.shape()[0];
    let rows = || Shape::new([shape.num_elements() / d, d]);
    let (x, grad) = (B::float_reshape(x, rows()), B::float_reshape(grad, rows()));
    let mean_square = B::float_mean_dim(B::float_mul(x.clone(), x.clone()), 1);
    let r = B::float_recip(B::float_sqrt(B::float_add_scalar(
        mean_square,
        Scalar::from(epsilon as f32),
    )));
    let x_r = B::float_mul(x, r.clone());
    let d_gamma = B::float_sum_dim(B::float_mul(grad.clone(), x_r.clone()), 0);
    let d_gamma = B::float_reshape(d_gamma, Shape::new([d]));
    let d_g = B::float_mul(grad, B::float_reshape(gamma, Shape::new([1, d])));
    // ⟨d⊙γ, x⟩·r/D, so that r·(x·r)·that is the second term.
    let projection = B::float_mean_dim(B::float_mul(d_g.clone(), x_r.clone()), 1);
    let d_x = B::float_mul(B::float_sub(d_g, B::float_mul(x_r, projection)), r);
    (B::float_reshape(d_x, shape), d_gamma)
}

/// [`FusedOps::rotary_backward`] by Burn's operations: [`rotary_plain`]'s rotation with sin
/// negated, `d ⊙ cos + swap(d) ⊙ (±sin)`.
fn rotary_backward_plain<B: Backend>(
    grad: FloatTensor<B>,
    table: FloatTensor<B>,
    heads: usize,
) -> FloatTensor<B> {
    let shape = grad.shape();
    let [b, s, width] = shape.dims();
    let d = width / heads;
    let (device, dtype) = (grad.device(), grad.dtype());
    let table = B::float_cast(table, dtype.into());
    let table = B::float_reshape(table, Shape::new([s, d, 2]));
    let column = |i: usize| {
        let slices = [Slice::from(0..s), Slice::from(0..d), Slice::from(i..i + 1)];
        B::float_reshape(
            B::float_slice(table.clone(), &slices),
            Shape::new([1, s, 1, d]),
        )
    };
    let sign = TensorData::new(vec![1.0f32, -1.0], [1, 1, 2]).convert_dtype(dtype);
    let sin = B::float_mul(
        B::float_reshape(column(1), Shape::new([s, d / 2, 2])),
        B::float_from_data(sign, &device),
    );
    let grad = B::float_reshape(grad, Shape::new([b, s, heads, d]));
    let swapped = B::float_flip(
        B::float_reshape(grad.clone(), Shape::new([b, s, heads, d / 2, 2])),
        &[4],
    );
    let d_x = B::float_add(
        B::float_mul(grad, column(0)),
        B::float_mul(
            B::float_reshape(swapped, Shape::new([b, s, heads, d])),
            B::float_reshape(sin, Shape::new([1, s, 1, d])),
        ),
    );
    B::float_reshape(d_x, shape)
}

/// [`FusedOps::swiglu_backward`] by Burn's operations.
fn swiglu_backward_plain<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let one = || Scalar::from(1.0f32);
    let sigma = B::float_recip(B::float_add_scalar(
        B::float_exp(B::float_neg(gate.clone())),
        one(),
    ));
    let slope = B::float_add_scalar(
        B::float_mul(
            gate.clone(),
            B::float_add_scalar(B::float_neg(sigma.clone()), one()),
        ),
        one(),
    );
    let d_gate = B::float_mul(
        B::float_mul(B::float_mul(grad.clone(), up), sigma.clone()),
        slope,
    );
    let d_up = B::float_mul(B::float_mul(grad, gate), sigma);
    (d_gate, d_up)
}

#[cfg(feature = "flex")]
pub(crate) mod flex {
    use super::AdamWStep;
    use crate::exp;
    use crate::rows::flex::dot;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Flex, TensorMetadata};
    use burn::tensor::{DType, TensorData};
    use rayon::prelude::*;

    /// A contiguous f32 tensor's elements (`None` for another dtype or layout).
    pub(crate) fn elements(t: &FloatTensor<Flex>) -> Option<&[f32]> {
        let layout = t.layout();
        let len = t.shape().num_elements();
        (t.dtype() == DType::F32 && layout.is_contiguous())
            .then(|| &t.storage::<f32>()[layout.start_offset()..][..len])
    }

    /// `t`'s strides as `usize` (`None` if one is negative).
    pub(crate) fn unsigned_strides(t: &FloatTensor<Flex>) -> Option<Vec<usize>> {
        t.layout()
            .strides()
            .iter()
            .map(|&s| usize::try_from(s).ok())
            .collect()
    }

    /// The rows of an f32 tensor `[B, H, S, n]` whose last dimension is contiguous, read in place
    /// through its strides (`None` for another dtype, rank or a negative stride): attention's
    /// heads as autodiff hands back their gradient, a transposed view of `[B, S, H, n]`.
    struct HeadRows<'a> {
        data: &'a [f32],
        start: usize,
        /// The strides of B, H and S.
        strides: [usize; 3],
        heads: usize,
        n: usize,
    }

    impl<'a> HeadRows<'a> {
        fn new(t: &'a FloatTensor<Flex>) -> Option<Self> {
            let (shape, layout) = (t.shape(), t.layout());
            let &[_, heads, _, n] = &shape[..] else {
                return None;
            };
            let strides = unsigned_strides(t)?;
            (t.dtype() == DType::F32 && (strides[3] == 1 || n == 1)).then(|| Self {
                data: t.storage::<f32>(),
                start: layout.start_offset(),
                strides: [strides[0], strides[1], strides[2]],
                heads,
                n,
            })
        }

        /// Row t of head `pair % H` of sequence `pair / H`.
        fn row(&self, pair: usize, t: usize) -> &'a [f32] {
            let [sb, sh, st] = self.strides;
            let at = self.start + pair / self.heads * sb + pair % self.heads * sh + t * st;
            &self.data[at..][..self.n]
        }
    }

    /// `values` in `like`'s shape, on its device.
    fn like(values: Vec<f32>, like: &FloatTensor<Flex>) -> FloatTensor<Flex> {
        Flex::float_from_data(TensorData::new(values, like.shape()), &like.device())
    }

    pub(super) fn rms_norm(
        x: &FloatTensor<Flex>,
        gamma: &FloatTensor<Flex>,
        epsilon: f64,
    ) -> Option<FloatTensor<Flex>> {
        let (xs, gamma) = (elements(x)?, elements(gamma)?);
        let d = gamma.len();
        if d == 0 || x.shape().last() != Some(&d) {
            return None;
        }
        let mut y = vec![0.0f32; xs.len()];
        for (row, out) in xs.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            let rms = ((dot(row, row) / d as f32) + epsilon as f32).sqrt();
            for ((out, x), g) in out.iter_mut().zip(row).zip(gamma) {
                *out = x / rms * g;
            }
        }
        Some(like(y, x))
    }

    /// RMSNorm's `(∂x, ∂γ)` (the module's equations), rows in parts over rayon's threads; each
    /// part's ∂γ summed, then the parts in order (the same sum on every run).
    pub(super) fn rms_norm_backward(
        x: &FloatTensor<Flex>,
        gamma: &FloatTensor<Flex>,
        grad: &FloatTensor<Flex>,
        epsilon: f64,
    ) -> Option<(FloatTensor<Flex>, FloatTensor<Flex>)> {
        let (xs, gamma_s, ds) = (elements(x)?, elements(gamma)?, elements(grad)?);
        let d = gamma_s.len();
        if d == 0 || x.shape().last() != Some(&d) || x.shape() != grad.shape() {
            return None;
        }
        const ROWS: usize = 32;
        let mut d_x = vec![0.0f32; xs.len()];
        let parts: Vec<Vec<f32>> = d_x
            .par_chunks_mut(ROWS * d)
            .zip(xs.par_chunks(ROWS * d).zip(ds.par_chunks(ROWS * d)))
            .map(|(d_x, (xs, ds))| {
                let mut d_gamma = vec![0.0f32; d];
                let rows = d_x.chunks_exact_mut(d).zip(xs.chunks_exact(d));
                for ((d_x, x), dy) in rows.zip(ds.chunks_exact(d)) {
                    let r = 1.0 / ((dot(x, x) / d as f32) + epsilon as f32).sqrt();
                    let terms = dy.iter().zip(x).zip(gamma_s);
                    for ((out, sum), ((dy, x), g)) in d_x.iter_mut().zip(&mut d_gamma).zip(terms) {
                        *out = dy * g;
                        *sum += dy * x * r;
                    }
                    let c = r * r * dot(d_x, x) / d as f32;
                    for (out, x) in d_x.iter_mut().zip(x) {
                        *out = r * (*out - x * c);
                    }
                }
                d_gamma
            })
            .collect();
        let mut d_gamma = vec![0.0f32; d];
        for part in parts {
            for (sum, g) in d_gamma.iter_mut().zip(part) {
                *sum += g;
            }
        }
        Some((like(d_x, x), like(d_gamma, gamma)))
    }

    pub(super) fn swiglu(
        gate: &FloatTensor<Flex>,
        up: &FloatTensor<Flex>,
    ) -> Option<FloatTensor<Flex>> {
        let (g, u) = (elements(gate)?, elements(up)?);
        if gate.shape() != up.shape() {
            return None;
        }
        let mut y = vec![0.0f32; g.len()];
        // Parts of about 64K elements on rayon's threads (a prefill's gate is millions).
        const PART: usize = 1 << 16;
        y.par_chunks_mut(PART)
            .zip(g.par_chunks(PART).zip(u.par_chunks(PART)))
            .for_each(|(y, (g, u))| exp::swiglu(g, u, y));
        Some(like(y, gate))
    }

    /// Whether [`adamw`] takes these tensors: f32, contiguous, of one length.
    pub(super) fn adamw_takes(tensors: &[&FloatTensor<Flex>]) -> bool {
        let len = tensors[0].shape().num_elements();
        tensors
            .iter()
            .all(|t| elements(t).is_some_and(|e| e.len() == len))
    }

    /// `t` to rewrite in place: itself when it alone owns a storage of exactly its elements,
    /// else a copy of its elements (never the whole of a shared or larger buffer).
    fn owned(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
        let len = t.shape().num_elements();
        let whole = t.layout().start_offset() == 0 && t.storage::<f32>().len() == len;
        match t.is_unique() && whole {
            true => t,
            false => like(elements(&t).expect("checked by adamw_takes").to_vec(), &t),
        }
    }

    /// [`super::sum_of_squares`] of a contiguous f32 `x` (`None` otherwise).
    pub(super) fn sum_of_squares(x: &FloatTensor<Flex>) -> Option<FloatTensor<Flex>> {
        const PART: usize = 1 << 16;
        let xs = elements(x)?;
        let parts: Vec<f32> = xs.par_chunks(PART).map(|p| dot(p, p)).collect();
        // From +0 (std's f32 sum starts at −0, which an empty x would give).
        let sum = parts.iter().fold(0.0f32, |sum, part| sum + part);
        Some(Flex::float_from_data(
            TensorData::new(vec![sum], [1]),
            &x.device(),
        ))
    }

    /// [`super::adamw`] in one pass over rayon's threads, for tensors [`adamw_takes`] takes.
    pub(super) fn adamw(
        param: FloatTensor<Flex>,
        grad: &FloatTensor<Flex>,
        moment_1: FloatTensor<Flex>,
        moment_2: FloatTensor<Flex>,
        step: AdamWStep,
    ) -> (FloatTensor<Flex>, FloatTensor<Flex>, FloatTensor<Flex>) {
        const PART: usize = 1 << 15;
        let AdamWStep {
            beta_1,
            beta_2,
            epsilon,
            correction_1,
            correction_2,
            keep,
            lr,
        } = step;
        let (factor_1, factor_2) = (1.0 - beta_1, 1.0 - beta_2);
        let g = elements(grad).expect("checked by adamw_takes");
        let len = g.len();
        let [mut p, mut m, mut v] = [param, moment_1, moment_2].map(owned);
        let (ps, ms, vs) = (
            &mut p.storage_mut::<f32>()[..len],
            &mut m.storage_mut::<f32>()[..len],
            &mut v.storage_mut::<f32>()[..len],
        );
        ps.par_chunks_mut(PART)
            .zip(ms.par_chunks_mut(PART))
            .zip(vs.par_chunks_mut(PART))
            .zip(g.par_chunks(PART))
            .for_each(|(((p, m), v), g)| {
                for i in 0..p.len() {
                    let g = g[i];
                    m[i] = m[i] * beta_1 + g * factor_1;
                    v[i] = v[i] * beta_2 + g * g * factor_2;
                    let delta = m[i] / correction_1 / ((v[i] / correction_2).sqrt() + epsilon);
                    p[i] = p[i] * keep - delta * lr;
                }
            });
        (p, m, v)
    }

    /// `(T, T − positions)` of a `[.., R, T]` causal map whose rows cycle over the `positions`
    /// last of T positions (`None` where the shape does not fit).
    fn causal_rows(t: &FloatTensor<Flex>, positions: usize) -> Option<(usize, usize)> {
        let shape = t.shape();
        let (&keys, rest) = shape.split_last()?;
        let rows = *rest.last()?;
        (keys > 0 && positions > 0 && positions <= keys && rows % positions == 0)
            .then_some((keys, keys - positions))
    }

    /// Rows of a causal map handed to rayon's threads in groups of this many.
    const SOFTMAX_ROWS: usize = 16;

    /// [`super::causal_softmax`]: per row, the scaled scores up to its last visible key, their
    /// maximum, e^(x − max) sixteen at a time, divided by their sum; zeros after.
    pub(super) fn causal_softmax(
        scores: &FloatTensor<Flex>,
        positions: usize,
        scale: f32,
    ) -> Option<FloatTensor<Flex>> {
        let xs = elements(scores)?;
        let (keys, past) = causal_rows(scores, positions)?;
        if scale <= 0.0 {
            return None;
        }
        let mut y = vec![0.0f32; xs.len()];
        y.par_chunks_mut(keys)
            .zip(xs.par_chunks(keys))
            .enumerate()
            .with_min_len(SOFTMAX_ROWS)
            .for_each(|(row, (y, x))| softmax_row(&mut y[..row % positions + past + 1], x, scale));
        Some(like(y, scores))
    }

    /// One causal row: `y` (the visible entries) = softmax(scale·x) over them.
    fn softmax_row(y: &mut [f32], x: &[f32], scale: f32) {
        for (y, x) in y.iter_mut().zip(x) {
            *y = x * scale;
        }
        let inverse = 1.0 / exp::exp_shifted(y, exp::max_of(y));
        for y in y {
            *y *= inverse;
        }
    }

    /// One row of a causal softmax's backward: `out = factor·y⊙(d − ⟨d, y⟩)`; returns ⟨d, y⟩.
    fn softmax_row_backward(out: &mut [f32], y: &[f32], d: &[f32], factor: f32) -> f32 {
        let inner = dot(d, y);
        for ((out, y), d) in out.iter_mut().zip(y).zip(d) {
            *out = factor * y * (d - inner);
        }
        inner
    }

    /// `[B, H, R, T]`, the differential map's shape, of half-head pairs' `[B, 2H, R, T]` with
    /// R, T > 0 (`None` for another shape).
    fn pairs_map(pairs: &FloatTensor<Flex>) -> Option<[usize; 4]> {
        let shape = pairs.shape();
        let &[b, h2, rows, keys] = &shape[..] else {
            return None;
        };
        (h2 % 2 == 0 && rows > 0 && keys > 0).then_some([b, h2 / 2, rows, keys])
    }

    /// [`super::differential_softmax`] and the two maps: per pair of rows (A₁'s and A₂'s of a
    /// query), both causal softmaxes as [`causal_softmax`]'s, then `A₁ − λ·A₂` over the visible
    /// entries. Pairs and their rows over rayon's threads.
    pub(super) fn differential_softmax(
        scores: &FloatTensor<Flex>,
        positions: usize,
        scale: f32,
        lambda: &FloatTensor<Flex>,
    ) -> Option<(FloatTensor<Flex>, FloatTensor<Flex>)> {
        let (xs, &[lambda]) = (elements(scores)?, elements(lambda)?) else {
            return None;
        };
        let (keys, past) = causal_rows(scores, positions)?;
        let half = pairs_map(scores)?;
        if scale <= 0.0 {
            return None;
        }
        let map = half[2] * keys;
        let (mut y, mut out) = (vec![0.0f32; xs.len()], vec![0.0f32; xs.len() / 2]);
        y.par_chunks_mut(2 * map)
            .zip(out.par_chunks_mut(map))
            .zip(xs.par_chunks(2 * map))
            .for_each(|((y, out), xs)| {
                let (y_1, y_2) = y.split_at_mut(map);
                let (x_1, x_2) = xs.split_at(map);
                out.par_chunks_mut(keys)
                    .zip(y_1.par_chunks_mut(keys).zip(y_2.par_chunks_mut(keys)))
                    .zip(x_1.par_chunks(keys).zip(x_2.par_chunks(keys)))
                    .enumerate()
                    .with_min_len(SOFTMAX_ROWS)
                    .for_each(|(row, ((out, (y_1, y_2)), (x_1, x_2)))| {
                        let visible = row % positions + past + 1;
                        let (y_1, y_2) = (&mut y_1[..visible], &mut y_2[..visible]);
                        softmax_row(y_1, x_1, scale);
                        softmax_row(y_2, x_2, scale);
                        for ((out, a_1), a_2) in out.iter_mut().zip(&*y_1).zip(&*y_2) {
                            *out = a_1 - lambda * a_2;
                        }
                    });
            });
        let out = Flex::float_from_data(TensorData::new(out, half), &scores.device());
        Some((out, like(y, scores)))
    }

    /// [`super::FusedOps::differential_softmax_backward`] in one pass per pair of rows, each
    /// row's ⟨d, y₂⟩ kept and summed in order for ∂λ (the same sum on every run).
    pub(super) fn differential_softmax_backward(
        y: &FloatTensor<Flex>,
        lambda: &FloatTensor<Flex>,
        grad: &FloatTensor<Flex>,
        scale: f32,
    ) -> Option<(FloatTensor<Flex>, FloatTensor<Flex>)> {
        let (ys, ds, &[lambda_value]) = (elements(y)?, elements(grad)?, elements(lambda)?) else {
            return None;
        };
        let half = pairs_map(y)?;
        if grad.shape()[..] != half {
            return None;
        }
        let [_, _, rows, keys] = half;
        let map = rows * keys;
        let mut d_x = vec![0.0f32; ys.len()];
        let mut inner_2 = vec![0.0f32; ds.len() / keys];
        d_x.par_chunks_mut(2 * map)
            .zip(inner_2.par_chunks_mut(rows))
            .zip(ys.par_chunks(2 * map).zip(ds.par_chunks(map)))
            .for_each(|((d_x, inner_2), (ys, ds))| {
                let (d_x_1, d_x_2) = d_x.split_at_mut(map);
                let (y_1, y_2) = ys.split_at(map);
                inner_2
                    .par_iter_mut()
                    .zip(d_x_1.par_chunks_mut(keys).zip(d_x_2.par_chunks_mut(keys)))
                    .zip(y_1.par_chunks(keys).zip(y_2.par_chunks(keys)))
                    .zip(ds.par_chunks(keys))
                    .with_min_len(SOFTMAX_ROWS)
                    .for_each(|(((inner_2, (d_x_1, d_x_2)), (y_1, y_2)), d)| {
                        softmax_row_backward(d_x_1, y_1, d, scale);
                        *inner_2 = softmax_row_backward(d_x_2, y_2, d, -lambda_value * scale);
                    });
            });
        let d_lambda = -inner_2.iter().sum::<f32>();
        Some((like(d_x, y), like(vec![d_lambda], lambda)))
    }

    /// [`super::FusedOps::causal_softmax_backward`] in one pass per row (the masked entries of y
    /// are zeros, and so are their gradients).
    pub(super) fn causal_softmax_backward(
        y: &FloatTensor<Flex>,
        grad: &FloatTensor<Flex>,
        scale: f32,
    ) -> Option<FloatTensor<Flex>> {
        let (ys, ds) = (elements(y)?, elements(grad)?);
        if y.shape() != grad.shape() {
            return None;
        }
        let keys = *y.shape().last()?;
        if keys == 0 {
            return None;
        }
        let mut d_x = vec![0.0f32; ys.len()];
        d_x.par_chunks_mut(keys)
            .zip(ys.par_chunks(keys).zip(ds.par_chunks(keys)))
            .with_min_len(SOFTMAX_ROWS)
            .for_each(|(d_x, (y, d))| {
                softmax_row_backward(d_x, y, d, scale);
            });
        Some(like(d_x, y))
    }

    /// Where λ `[B, S, H]` (each dimension also 1: broadcast) is read for pair `b·H + h` at
    /// position t: `at(pair, t)`.
    fn lambda_at(
        lambda: &FloatTensor<Flex>,
        [b, s, h]: [usize; 3],
    ) -> Option<impl Fn(usize, usize) -> usize + Sync> {
        let &[lb, ls, lh] = &lambda.shape()[..] else {
            return None;
        };
        let fits = |size, full| size == 1 || size == full;
        let along = |size: usize, stride| if size == 1 { 0 } else { stride };
        let [sb, ss, sh] = [along(lb, ls * lh), along(ls, lh), along(lh, 1)];
        (fits(lb, b) && fits(ls, s) && fits(lh, h))
            .then_some(move |pair: usize, t: usize| pair / h * sb + t * ss + pair % h * sh)
    }

    /// Pairs handed to rayon's threads together: at least 16K elements of output a task.
    fn pairs_per_task(map: usize) -> usize {
        (1 << 14) / map + 1
    }

    /// [`super::pair_difference`] over rayon's threads, a pair (b, h) per task.
    pub(super) fn pair_difference(
        pairs: &FloatTensor<Flex>,
        lambda: &FloatTensor<Flex>,
    ) -> Option<FloatTensor<Flex>> {
        let (xs, ls) = (elements(pairs)?, elements(lambda)?);
        let [b, h, s, n] = pairs_map(pairs)?;
        let at = lambda_at(lambda, [b, s, h])?;
        let map = s * n;
        let mut out = vec![0.0f32; xs.len() / 2];
        out.par_chunks_mut(map)
            .zip(xs.par_chunks(2 * map))
            .enumerate()
            .with_min_len(pairs_per_task(map))
            .for_each(|(pair, (out, xs))| {
                let (x_1, x_2) = xs.split_at(map);
                let rows = out
                    .chunks_exact_mut(n)
                    .zip(x_1.chunks_exact(n).zip(x_2.chunks_exact(n)));
                for (t, (out, (x_1, x_2))) in rows.enumerate() {
                    let lambda = ls[at(pair, t)];
                    for ((out, a), c) in out.iter_mut().zip(x_1).zip(x_2) {
                        *out = a - lambda * c;
                    }
                }
            });
        Some(Flex::float_from_data(
            TensorData::new(out, [b, h, s, n]),
            &pairs.device(),
        ))
    }

    /// [`super::FusedOps::pair_difference_backward`]: ∂pairs in one pass over rayon's threads,
    /// each row's ⟨d, x₂⟩ kept, then added into ∂λ in order (the same sums on every run). The
    /// gradient is read in place through its strides ([`HeadRows`]): DIFF V2's, from merging the
    /// heads, is a transposed view, which Burn's operations would first copy.
    pub(super) fn pair_difference_backward(
        pairs: &FloatTensor<Flex>,
        lambda: &FloatTensor<Flex>,
        grad: &FloatTensor<Flex>,
    ) -> Option<(FloatTensor<Flex>, FloatTensor<Flex>)> {
        let (xs, ls, ds) = (elements(pairs)?, elements(lambda)?, HeadRows::new(grad)?);
        let half @ [b, h, s, n] = pairs_map(pairs)?;
        if grad.shape()[..] != half {
            return None;
        }
        let at = lambda_at(lambda, [b, s, h])?;
        let map = s * n;
        let mut d_x = vec![0.0f32; xs.len()];
        let mut inner = vec![0.0f32; b * h * s];
        d_x.par_chunks_mut(2 * map)
            .zip(inner.par_chunks_mut(s))
            .zip(xs.par_chunks(2 * map))
            .enumerate()
            .with_min_len(pairs_per_task(map))
            .for_each(|(pair, ((d_x, inner), xs))| {
                let (d_x_1, d_x_2) = d_x.split_at_mut(map);
                let x_2 = &xs[map..];
                let rows = d_x_1.chunks_exact_mut(n).zip(d_x_2.chunks_exact_mut(n));
                for (t, ((d_x_1, d_x_2), (x_2, inner))) in rows
                    .zip(x_2.chunks_exact(n).zip(inner.iter_mut()))
                    .enumerate()
                {
                    let (d, lambda) = (ds.row(pair, t), ls[at(pair, t)]);
                    d_x_1.copy_from_slice(d);
                    for (out, d) in d_x_2.iter_mut().zip(d) {
                        *out = -lambda * d;
                    }
                    *inner = dot(d, x_2);
                }
            });
        let mut d_lambda = vec![0.0f32; ls.len()];
        for (row, inner) in inner.iter().enumerate() {
            let (pair, t) = (row / s, row % s);
            d_lambda[at(pair, t)] -= inner;
        }
        Some((like(d_x, pairs), like(d_lambda, lambda)))
    }

    pub(super) fn swiglu_backward(
        gate: &FloatTensor<Flex>,
        up: &FloatTensor<Flex>,
        grad: &FloatTensor<Flex>,
    ) -> Option<(FloatTensor<Flex>, FloatTensor<Flex>)> {
        let (g, u, d) = (elements(gate)?, elements(up)?, elements(grad)?);
        if gate.shape() != up.shape() || gate.shape() != grad.shape() {
            return None;
        }
        let (mut d_gate, mut d_up) = (vec![0.0f32; g.len()], vec![0.0f32; g.len()]);
        const PART: usize = 1 << 15;
        d_gate
            .par_chunks_mut(PART)
            .zip(d_up.par_chunks_mut(PART))
            .zip(
                g.par_chunks(PART)
                    .zip(u.par_chunks(PART))
                    .zip(d.par_chunks(PART)),
            )
            .for_each(|((dg, du), ((g, u), d))| exp::swiglu_backward(g, u, d, dg, du));
        Some((like(d_gate, gate), like(d_up, gate)))
    }

    /// RoPE of `x` by the table's (cos, sin·`sign`): `sign` 1 rotates, −1 rotates back (the
    /// backward). Rows in parts over rayon's threads.
    pub(super) fn rotary(
        x: &FloatTensor<Flex>,
        table: &FloatTensor<Flex>,
        heads: usize,
        sign: f32,
    ) -> Option<FloatTensor<Flex>> {
        let xs = elements(x)?;
        let table = elements(table)?;
        let [_, s, width] = x.shape().dims();
        let d = table.len().checked_div(2 * s)?;
        if d == 0 || d % 2 != 0 || width != heads * d || table.len() != s * d * 2 {
            return None;
        }
        let mut y = vec![0.0f32; xs.len()];
        y.par_chunks_mut(width)
            .zip(xs.par_chunks(width))
            .enumerate()
            .with_min_len(16)
            .for_each(|(p, (out, row))| {
                // Position p % s; its [d, 2] table of (cos, sin), pairs repeated.
                let angles = &table[(p % s) * d * 2..][..d * 2];
                for (head, out) in row.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                    for i in (0..d).step_by(2) {
                        let (x0, x1) = (head[i], head[i + 1]);
                        let (cos0, sin0) = (angles[2 * i], sign * angles[2 * i + 1]);
                        let (cos1, sin1) = (angles[2 * i + 2], sign * angles[2 * i + 3]);
                        out[i] = x0 * cos0 + x1 * -sin0;
                        out[i + 1] = x1 * cos1 + x0 * sin1;
                    }
                }
            });
        Some(like(y, x))
    }
}
