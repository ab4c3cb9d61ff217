//! Memory-efficient causal attention: FlashAttention-2's algorithm (Dao, 2023) written with Burn's
//! backend operations and registered as a custom operation with its own backward, so that
//! training keeps O(S) memory per head instead of the S×S maps autodiff would store.
//!
//! For one head, with `q`, `k`: `[S, d]`, `v`: `[S, d_v]`, scale c = 1/√d and the causal mask
//! M (0 on and below the diagonal, −∞ above):
//!
//! ```text
//! S = c·q·kᵀ + M,   P = softmax_rows(S),   O = P·v,   L_t = log Σ_s exp(S_ts)    (row log-sum-exp)
//! ```
//!
//! **Forward.** Rows are cut into query blocks and keys into key blocks of `block` positions.
//! For query block i, key blocks j = 0 … i are visited in order (blocks above the diagonal are
//! skipped: they are fully masked), keeping per row a running maximum m, a running sum ℓ and an
//! unnormalised output A (the online softmax):
//!
//! ```text
//! S_ij = c·q_i·k_jᵀ (+ M on the diagonal block),   m' = max(m, rowmax S_ij)
//! ℓ' = e^(m−m')·ℓ + rowsum e^(S_ij−m'),   A' = e^(m−m')·A + e^(S_ij−m')·v_j
//! O_i = A/ℓ,   L_i = m + log ℓ
//! ```
//!
//! Only O and L (S values per row) are kept for the backward pass.
//!
//! **Backward.** Given dO, with D_t = Σ_e dO_te·O_te (= Σ_s P_ts·dP_ts), each block's
//! probabilities are recomputed from L, never read from memory:
//!
//! ```text
//! P_ij = exp(S_ij − L_i)
//! dv_j += P_ijᵀ·dO_i,   dP_ij = dO_i·v_jᵀ,   dS_ij = P_ij ⊙ (dP_ij − D_i)
//! dq_i += c·dS_ij·k_j,   dk_j += c·dS_ijᵀ·q_i
//! ```
//!
//! which are the softmax and matmul gradients of the explicit path (dS = P ⊙ (dP − rowsum(P ⊙ dP))),
//! summed block by block. Peak extra memory is a few `[B, H, block, block]` tiles.
//!
//! **The variants.** Every variant is a linear combination of such attentions, so the custom op
//! is one standard attention and autodiff does the rest exactly:
//! - baseline: `O = attn(q, k, v)`;
//! - DIFF V1: `Y = attn(q₁, k₁, v) − λ·attn(q₂, k₂, v)` (one call over the 2H' half-heads, V read
//!   by both halves), so `dO₁ = dY`, `dO₂ = −λ·dY` and `dλ = −Σ ⟨attn(q₂, k₂, v), dY⟩`, from which
//!   the λ vectors get `∂λ/∂λ_q1 = e^(λ_q1·λ_k1)·λ_k1`, `∂λ/∂λ_k1 = e^(λ_q1·λ_k1)·λ_q1`,
//!   `∂λ/∂λ_q2 = −e^(λ_q2·λ_k2)·λ_k2`, `∂λ/∂λ_k2 = −e^(λ_q2·λ_k2)·λ_q2`;
//! - DIFF V2: `Y_h = o_{2h} − λ_{t,h}·o_{2h+1}` with `o = attn(q, k, v)` over 2H heads, so
//!   `do_{2h} = dY_h`, `do_{2h+1} = −λ_{t,h}·dY_h`, `dλ_{t,h} = −⟨o_{2h+1,t}, dY_{h,t}⟩` and
//!   `dW_λ = Σ_t x_tᵀ·(dλ_t ⊙ λ_t ⊙ (1 − λ_t))`.
//!
//! **On Flex** the elementwise work of each block (m', e^(S−m'), ℓ', e^(m−m') in the forward,
//! e^(S−L) in the backward) is one pass per row with vectorised exponentials ([`FlashAttentionOps`]'
//! `flash_softmax_block` and `flash_probabilities`); other backends take Burn's operations.
//!
//! GQA: keys and values arrive repeated to the query heads (a copy of O(S) size). Half-precision
//! inputs are computed in f32 (m, ℓ, A, L and the gradient sums would otherwise round once per
//! block) and the results cast back; L stays f32.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use crate::profile::{self, Class};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Slice, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorData};
use core::ops::Range;

/// Causal `softmax(q·kᵀ/√d)·v` in O(S) memory under autodiff. `q`, `k`: `[B, H, S, d]`,
/// `v`: `[B, H, S, d_v]`, S ≥ 1; `block` ≥ 1 positions per query and key block.
pub fn flash_causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, block: usize) -> Tensor<4> {
    assert!(block > 0, "attention block size must be positive");
    assert!(q.dims()[2] > 0, "attention over an empty sequence");
    Tensor::from_dispatch(<Dispatch as FlashAttentionOps>::flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        block,
    ))
}

/// The custom operation. Concrete backends use the default bodies (Burn backend operations);
/// autodiff registers [`FlashBackward`] instead of differentiating through them.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait FlashAttentionOps: Backend {
    /// The attention output `[B, H, S, d_v]`.
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        block: usize,
    ) -> FloatTensor<Self> {
        Self::flash_attention_forward(q, k, v, block).0
    }

    /// The output and the row log-sum-exp L `[B, H, S, 1]` (f32).
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        block: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        forward::<Self>(q, k, v, block)
    }

    /// (dq, dk, dv) from the forward's inputs, output, L and dO.
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        block: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        backward::<Self>(q, k, v, out, lse, grad, block)
    }

    /// One key block of the forward's online softmax: from the block's scaled, masked logits S
    /// `[B, H, r, c]` and the running maximum m and sum ℓ `[B, H, r, 1]` of the blocks before
    /// (−∞ and 0 before the first), `(e^(S−m'), m', ℓ', e^(m−m'))`.
    fn flash_softmax_block(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        softmax_block::<Self>(logits, max, sum)
    }

    /// The backward's probabilities of a block, `e^(S−L)`, from its scaled, masked logits S
    /// `[B, H, r, c]` and its rows' log-sum-exp L `[B, H, r, 1]`.
    fn flash_probabilities(logits: FloatTensor<Self>, lse: FloatTensor<Self>) -> FloatTensor<Self> {
        exp_sub::<Self>(logits, lse)
    }
}

#[cfg(feature = "flex")]
impl FlashAttentionOps for burn::backend::Flex {
    fn flash_softmax_block(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        match flex::takes(&logits, &[&max, &sum]) {
            true => flex::softmax_block(logits, &max, &sum),
            false => softmax_block::<Self>(logits, max, sum),
        }
    }

    fn flash_probabilities(logits: FloatTensor<Self>, lse: FloatTensor<Self>) -> FloatTensor<Self> {
        match flex::takes(&logits, &[&lse]) {
            true => flex::probabilities(logits, &lse),
            false => exp_sub::<Self>(logits, lse),
        }
    }
}
default_ops!(FlashAttentionOps, no_autodiff);

impl<B: Backend + FlashAttentionOps, C: CheckpointStrategy> FlashAttentionOps for Autodiff<B, C> {
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        block: usize,
    ) -> FloatTensor<Self> {
        let guards = [q.node(), k.node(), v.node()];
        let [q, k, v] = [q, k, v].map(|t| t.into_primitive());
        let (out, lse) = B::flash_attention_forward(q.clone(), k.clone(), v.clone(), block);
        match FlashBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = FlashState {
                    q,
                    k,
                    v,
                    out: out.clone(),
                    lse,
                    block,
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// What the backward pass keeps: inputs, output and L — O(S) per head.
#[derive(Debug, Clone)]
struct FlashState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    block: usize,
}

#[derive(Debug)]
struct FlashBackward;

impl<B: Backend + FlashAttentionOps> Backward<B, 3> for FlashBackward {
    type State = FlashState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let FlashState {
            q,
            k,
            v,
            out,
            lse,
            block,
        } = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (dq, dk, dv) = profile::time(Class::Attention, || {
            B::flash_attention_backward(q, k, v, out, lse, grad, block)
        });
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        crate::fused::register::<B, 3>(grads, parents, [dq, dk, dv]);
    }
}

/// Positions `0..len` cut into ranges of `block` (also [`super::blocks`]' query blocks).
pub(super) fn blocks(len: usize, block: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len)
        .step_by(block)
        .map(move |start| start..(start + block).min(len))
}

/// `x[.., range, ..]` along dimension `dim`.
pub(super) fn narrow<B: Backend>(
    x: &FloatTensor<B>,
    dim: usize,
    range: Range<usize>,
) -> FloatTensor<B> {
    B::float_slice(x.clone(), &slices(&x.shape(), dim, range))
}

/// The slices of all of `shape` but `range` along `dim`.
pub(super) fn slices(shape: &Shape, dim: usize, range: Range<usize>) -> Vec<Slice> {
    (0..shape.num_dims())
        .map(|i| match i == dim {
            true => Slice::from(range.clone()),
            false => Slice::from(0..shape[i]),
        })
        .collect()
}

/// `[1, 1, n, n]` f32: 0 on and below the diagonal, −∞ above (a diagonal block's causal mask; its
/// top-left corner is the mask of a shorter last block).
fn causal_bias<B: Backend>(n: usize, device: &B::Device) -> FloatTensor<B> {
    let values = (0..n * n)
        .map(|i| {
            if i % n > i / n {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect::<Vec<_>>();
    B::float_from_data(TensorData::new(values, [1, 1, n, n]), device)
}

/// What every block of one call shares: q·c (c = 1/√d), kᵀ `[B, H, d, S]` and the diagonal mask,
/// all f32.
struct Blocks<B: Backend> {
    q: FloatTensor<B>,
    kt: FloatTensor<B>,
    bias: FloatTensor<B>,
    seq: usize,
    block: usize,
}

impl<B: Backend> Blocks<B> {
    fn new(q: FloatTensor<B>, k: FloatTensor<B>, block: usize) -> Self {
        let shape = q.shape();
        let (seq, d) = (shape[2], shape[3]);
        let q = B::float_mul_scalar(f32_of::<B>(q), (1.0 / (d as f64).sqrt()).into());
        let bias = causal_bias::<B>(block.min(seq), &q.device());
        let kt = B::float_swap_dims(f32_of::<B>(k), 2, 3);
        Self {
            q,
            kt,
            bias,
            seq,
            block,
        }
    }

    /// Query blocks.
    fn rows(&self) -> impl Iterator<Item = Range<usize>> + use<B> {
        blocks(self.seq, self.block)
    }

    /// The key blocks at or below the diagonal of query block `rows`.
    fn cols(&self, rows: &Range<usize>) -> impl Iterator<Item = Range<usize>> + use<B> {
        let end = rows.end;
        blocks(self.seq, self.block).take_while(move |cols| cols.start < end)
    }

    /// Scaled logits of query block `rows` (`qi`) against key block `cols`, masked on the
    /// diagonal.
    fn logits(
        &self,
        qi: &FloatTensor<B>,
        rows: &Range<usize>,
        cols: &Range<usize>,
    ) -> FloatTensor<B> {
        let logits = B::float_matmul(qi.clone(), narrow::<B>(&self.kt, 3, cols.clone()));
        if rows != cols {
            return logits;
        }
        let n = rows.len();
        let bias = if n == self.bias.shape()[3] {
            self.bias.clone()
        } else {
            narrow::<B>(&narrow::<B>(&self.bias, 2, 0..n), 3, 0..n)
        };
        B::float_add(logits, bias)
    }
}

/// `x` in f32 (itself when it already is).
fn f32_of<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    cast_to::<B>(x, DType::F32)
}

/// `x` cast to `dtype` (itself when it already is).
fn cast_to<B: Backend>(x: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    if x.dtype() == dtype {
        x
    } else {
        B::float_cast(x, FloatDType::from(dtype))
    }
}

fn forward<B: FlashAttentionOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    block: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let blocks = Blocks::<B>::new(q, k, block);
    let v = f32_of::<B>(v);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for rows in blocks.rows() {
        let qi = narrow::<B>(&blocks.q, 2, rows.clone());
        // (m, ℓ) after the key blocks seen so far, and A once one has been; block 0 holds key 0,
        // so m is finite after it.
        let mut shape = qi.shape();
        shape[3] = 1;
        let device = qi.device();
        let mut max = B::float_full(
            shape.clone(),
            f32::NEG_INFINITY.into(),
            &device,
            FloatDType::F32,
        );
        let mut sum = B::float_zeros(shape, &device, FloatDType::F32);
        let mut acc: Option<FloatTensor<B>> = None;
        for cols in blocks.cols(&rows) {
            let logits = blocks.logits(&qi, &rows, &cols);
            let (p, max_new, sum_new, decay) = B::flash_softmax_block(logits, max, sum);
            let pv = B::float_matmul(p, narrow::<B>(&v, 2, cols));
            acc = Some(match acc {
                None => pv,
                Some(acc) => B::float_add(B::float_mul(acc, decay), pv),
            });
            (max, sum) = (max_new, sum_new);
        }
        let acc = acc.expect("every query block sees key block 0");
        outs.push(B::float_div(acc, sum.clone()));
        lses.push(B::float_add(max, B::float_log(sum)));
    }
    let out = cast_to::<B>(B::float_cat(outs, 2), dtype);
    (out, B::float_cat(lses, 2))
}

/// [`FlashAttentionOps::flash_softmax_block`] by Burn's operations.
fn softmax_block<B: Backend>(
    logits: FloatTensor<B>,
    max: FloatTensor<B>,
    sum: FloatTensor<B>,
) -> (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
) {
    let block_max = B::float_max_dim(logits.clone(), 3);
    let max_new = B::float_max_dim(B::float_cat(vec![max.clone(), block_max], 3), 3);
    let decay = exp_sub::<B>(max, max_new.clone());
    let p = exp_sub::<B>(logits, max_new.clone());
    let sum = B::float_add(
        B::float_mul(sum, decay.clone()),
        B::float_sum_dim(p.clone(), 3),
    );
    (p, max_new, sum, decay)
}

/// `e^(x − shift)`, `shift` broadcast along the last dimension, by Burn's operations.
fn exp_sub<B: Backend>(x: FloatTensor<B>, shift: FloatTensor<B>) -> FloatTensor<B> {
    B::float_exp(B::float_sub(x, shift))
}

fn backward<B: FlashAttentionOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    block: usize,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let scale = 1.0 / (q.shape()[3] as f64).sqrt();
    let k = f32_of::<B>(k);
    let blocks = Blocks::<B>::new(q, k.clone(), block);
    let vt = B::float_swap_dims(f32_of::<B>(v), 2, 3);
    let grad = f32_of::<B>(grad);
    // D_t = Σ_e dO_te·O_te, [B, H, S, 1].
    let delta = B::float_sum_dim(B::float_mul(grad.clone(), f32_of::<B>(out)), 3);
    let n_blocks = blocks.seq.div_ceil(block);
    let mut dk: Vec<Option<FloatTensor<B>>> = vec![None; n_blocks];
    let mut dv: Vec<Option<FloatTensor<B>>> = vec![None; n_blocks];
    let mut dq = Vec::with_capacity(n_blocks);
    let accumulate = |slot: &mut Option<FloatTensor<B>>, term: FloatTensor<B>| {
        *slot = Some(match slot.take() {
            None => term,
            Some(sum) => B::float_add(sum, term),
        });
    };
    for rows in blocks.rows() {
        let qi = narrow::<B>(&blocks.q, 2, rows.clone());
        let grad_i = narrow::<B>(&grad, 2, rows.clone());
        let lse_i = narrow::<B>(&lse, 2, rows.clone());
        let delta_i = narrow::<B>(&delta, 2, rows.clone());
        let mut dq_i: Option<FloatTensor<B>> = None;
        for (j, cols) in blocks.cols(&rows).enumerate() {
            let logits = blocks.logits(&qi, &rows, &cols);
            let p = B::flash_probabilities(logits, lse_i.clone());
            let pt = B::float_swap_dims(p.clone(), 2, 3);
            accumulate(&mut dv[j], B::float_matmul(pt, grad_i.clone()));
            let dp = B::float_matmul(grad_i.clone(), narrow::<B>(&vt, 3, cols.clone()));
            let ds = B::float_mul(p, B::float_sub(dp, delta_i.clone()));
            let kj = narrow::<B>(&k, 2, cols);
            accumulate(&mut dq_i, B::float_matmul(ds.clone(), kj));
            // q is already scaled by c, which is dk's factor.
            let dst = B::float_swap_dims(ds, 2, 3);
            accumulate(&mut dk[j], B::float_matmul(dst, qi.clone()));
        }
        let dq_i = dq_i.expect("every query block sees key block 0");
        dq.push(B::float_mul_scalar(dq_i, scale.into()));
    }
    let collect = |parts: Vec<Option<FloatTensor<B>>>| {
        let parts = parts
            .into_iter()
            .map(|part| part.expect("every key block is seen by its own query block"))
            .collect();
        cast_to::<B>(B::float_cat(parts, 2), dtype)
    };
    let dq = cast_to::<B>(B::float_cat(dq, 2), dtype);
    (dq, collect(dk), collect(dv))
}

/// The online softmax's elementwise work on Flex, one pass per row (contiguous f32 only: the
/// callers fall back to Burn's operations otherwise): Burn's ops take seven passes over each
/// logits block, glibc's scalar `expf` among them; here each row is read once, its exponentials
/// taken sixteen at a time ([`crate::exp`]) in place, and the rows split between rayon's threads.
#[cfg(feature = "flex")]
mod flex {
    use crate::exp::{exp_shifted, max_of};
    use crate::fused::flex::unsigned_strides;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Flex, TensorMetadata};
    use burn::tensor::{DType, TensorData};
    use rayon::prelude::*;
    use std::borrow::Cow;

    type T = FloatTensor<Flex>;

    /// Rows per part handed to a thread: about 64K logits.
    fn rows_per_part(width: usize) -> usize {
        (1 << 16) / width.max(1) + 1
    }

    /// The values of `t` `[.., r, 1]`, one per row of `logits` `[.., r, c]` (the same leading
    /// dimensions), in row order: its elements when contiguous, else read through its strides (a
    /// block's rows of L, say); `None` for another dtype, shape or a negative stride.
    fn per_row<'a>(t: &'a T, logits: &T) -> Option<Cow<'a, [f32]>> {
        let strides = per_row_strides(t, logits)?;
        let (shape, layout, data) = (t.shape(), t.layout(), t.storage::<f32>());
        let (n, len) = (shape.num_dims(), shape.num_elements());
        if layout.is_contiguous() {
            return Some(Cow::Borrowed(&data[layout.start_offset()..][..len]));
        }
        let values = (0..len)
            .map(|row| {
                let (mut rest, mut at) = (row, layout.start_offset());
                for d in (0..n).rev() {
                    at += rest % shape[d] * strides[d];
                    rest /= shape[d];
                }
                data[at]
            })
            .collect();
        Some(Cow::Owned(values))
    }

    /// `t`'s strides if it is f32, `[.., r, 1]` with the leading dimensions of `logits`
    /// `[.., r, c]`, and no stride is negative.
    fn per_row_strides(t: &T, logits: &T) -> Option<Vec<usize>> {
        let (shape, rows_shape) = (t.shape(), logits.shape());
        let n = shape.num_dims();
        if t.dtype() != DType::F32
            || n != rows_shape.num_dims()
            || shape[n - 1] != 1
            || shape[..n - 1] != rows_shape[..n - 1]
        {
            return None;
        }
        unsigned_strides(t)
    }

    /// Whether `logits` can be rewritten in place (f32, contiguous from offset 0, rows not
    /// empty) and each of `per_row` gives one value per row ([`per_row`]).
    pub(super) fn takes(logits: &T, per_row_tensors: &[&T]) -> bool {
        let (shape, layout) = (logits.shape(), logits.layout());
        logits.dtype() == DType::F32
            && layout.is_contiguous()
            && layout.start_offset() == 0
            && shape[shape.num_dims() - 1] > 0
            && per_row_tensors
                .iter()
                .all(|t| per_row_strides(t, logits).is_some())
    }

    /// `f(row index, row)` for every row of `logits`' storage (unique, made so if shared), on
    /// rayon's threads, and what it gave for each row; `logits` is returned rewritten.
    fn for_rows<R: Copy + Default + Send>(
        mut logits: T,
        f: impl Fn(usize, &mut [f32]) -> R + Sync,
    ) -> (T, Vec<R>) {
        let shape = logits.shape();
        let width = shape[shape.num_dims() - 1];
        let len = shape.num_elements();
        let per_part = rows_per_part(width);
        let mut results = vec![R::default(); len / width];
        logits.storage_mut::<f32>()[..len]
            .par_chunks_mut(per_part * width)
            .zip(results.par_chunks_mut(per_part))
            .enumerate()
            .for_each(|(part, (rows, results))| {
                for (i, (row, result)) in rows.chunks_exact_mut(width).zip(results).enumerate() {
                    *result = f(part * per_part + i, row);
                }
            });
        (logits, results)
    }

    /// `[.., r, 1]` values like `like`'s.
    fn column(values: Vec<f32>, like: &T) -> T {
        Flex::float_from_data(TensorData::new(values, like.shape()), &like.device())
    }

    /// [`super::FlashAttentionOps::flash_softmax_block`] for tensors [`takes`] takes.
    pub(super) fn softmax_block(logits: T, max: &T, sum: &T) -> (T, T, T, T) {
        let (old_max, old_sum) = (
            per_row(max, &logits).expect("checked by takes"),
            per_row(sum, &logits).expect("checked by takes"),
        );
        let (p, results) = for_rows(logits, |r, row| {
            let m = old_max[r].max(max_of(row));
            let row_sum = exp_shifted(row, m);
            let decay = (old_max[r] - m).exp();
            [m, old_sum[r] * decay + row_sum, decay]
        });
        let column_of = |i: usize| column(results.iter().map(|r| r[i]).collect(), max);
        (p, column_of(0), column_of(1), column_of(2))
    }

    /// [`super::FlashAttentionOps::flash_probabilities`] for tensors [`takes`] takes.
    pub(super) fn probabilities(logits: T, lse: &T) -> T {
        let shift = per_row(lse, &logits).expect("checked by takes");
        for_rows(logits, |r, row| {
            exp_shifted(row, shift[r]);
        })
        .0
    }
}
