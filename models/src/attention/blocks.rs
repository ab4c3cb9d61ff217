//! Explicit causal attention in blocks of queries: the training step's and a prompt's maps
//! without their upper blocks.
//!
//! The explicit path computes the scores of every query with all T keys, its causal map, and
//! `O = map·v`; above the diagonal the map is zero, so about half of those products'
//! multiply-adds, forward and backward, only add zeros. Here the S queries (the last S of the T
//! positions) are cut into blocks of [`BLOCK`], which skip a quarter of them at 256 positions
//! (three eighths at 512); block i, queries `r_i` whose last sees the keys `< e_i`, computes
//!
//! ```text
//! S_i = q_{r_i}·k_{<e_i}ᵀ,   A_i = map(S_i),   O_{r_i} = A_i·v_{<e_i}
//! ```
//!
//! with `map` the causal softmax ([`crate::fused::causal_softmax`]: the baseline and DIFF V2, the
//! query heads of a GQA group stacked along the rows) or DIFF's `A₁ − λA₂`
//! ([`crate::fused::differential_softmax`]), and keeps the A_i (and DIFF's two maps) for
//!
//! ```text
//! dA_i = dO_{r_i}·v_{<e_i}ᵀ,   dS_i (and ∂λ_i) = map's backward of dA_i
//! dq_{r_i} = dS_i·k_{<e_i},   dk_{<e_i} += dS_iᵀ·q_{r_i},   dv_{<e_i} += A_iᵀ·dO_{r_i},   ∂λ = Σ_i ∂λ_i
//! ```
//!
//! the explicit path's numbers (its products only skip terms that are zero; the key and value
//! gradients' sums are added in another order, so they agree to f32 rounding), and its memory
//! less the maps' upper blocks. Flex takes it for f32, under autodiff as one operation with this
//! backward (Burn's autodiff of the same blocks pads each block's gradient of q, k and v to the
//! whole tensor and adds them up, which cost what the blocks save); every other backend, and
//! S ≤ [`BLOCK`], takes the explicit path.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use super::flash::{blocks, narrow, slices};
use crate::fused::{FusedOps, register};
use crate::product::{ProductOps, matmul};
use crate::profile::{self, Class};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, TensorMetadata, backend_extension};
#[cfg(feature = "flex")]
use burn::tensor::DType;
use burn::tensor::{Shape, Tensor};
use core::ops::Range;

/// Query positions per block.
pub const BLOCK: usize = 128;

/// Causal `softmax(q·kᵀ/√d)·v` in blocks of queries: `q` `[B, H, S, d]`, `k` `[B, H_kv, T, d]`,
/// `v` `[B, H_kv, T, d_v]`, H a multiple of H_kv (GQA: query head h reads kv head h / n_rep), the
/// queries the last S of the T positions. `None` where the explicit path runs instead (see the
/// module's doc).
pub fn causal(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Option<Tensor<4>> {
    if q.dims()[2] <= BLOCK {
        return None;
    }
    let [q, k, v] = [q, k, v].map(Tensor::into_dispatch);
    <Dispatch as CausalBlockOps>::causal_blocks(q, k, v).map(Tensor::from_dispatch)
}

/// DIFF's `(A₁ − λ·A₂)·v` in blocks of queries: `q` `[B, 2H, S, d]` and `k` `[B, 2H, T, d]` the
/// half-heads (2h, 2h+1), `v` `[B, H, T, d_v]`, `lambda` `[1, 1, 1]`. `None` as for [`causal`].
pub fn differential(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    lambda: Tensor<3>,
) -> Option<Tensor<4>> {
    if q.dims()[2] <= BLOCK {
        return None;
    }
    let [q, k, v] = [q, k, v].map(Tensor::into_dispatch);
    let lambda = lambda.into_dispatch();
    <Dispatch as CausalBlockOps>::differential_blocks(q, k, v, lambda).map(Tensor::from_dispatch)
}

/// The operation: `None` (the explicit path) everywhere but on Flex.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait CausalBlockOps: Backend {
    /// The causal softmax's attention output; `None`: not taken.
    fn causal_blocks(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// DIFF's attention output; `None`: not taken.
    fn differential_blocks(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// [`CausalBlockOps::causal_blocks`] with the map of each block, which its backward reads
    /// (autodiff's forward calls it); `None`: not taken.
    fn causal_blocks_with_maps(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, Vec<FloatTensor<Self>>)> {
        None
    }

    /// [`CausalBlockOps::differential_blocks`] with each block's map and its two causal
    /// softmax maps, in turn (autodiff's forward calls it); `None`: not taken.
    fn differential_blocks_with_maps(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _lambda: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, Vec<FloatTensor<Self>>)> {
        None
    }
}

#[cfg(feature = "flex")]
impl CausalBlockOps for burn::backend::Flex {
    fn causal_blocks(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        forward::<Self>(q, k, v, None, false).map(|(out, _)| out)
    }

    fn differential_blocks(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        forward::<Self>(q, k, v, Some(lambda), false).map(|(out, _)| out)
    }

    fn causal_blocks_with_maps(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, Vec<FloatTensor<Self>>)> {
        forward::<Self>(q, k, v, None, true)
    }

    fn differential_blocks_with_maps(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, Vec<FloatTensor<Self>>)> {
        forward::<Self>(q, k, v, Some(lambda), true)
    }
}
default_ops!(CausalBlockOps, no_autodiff);

impl<B, C> CausalBlockOps for Autodiff<B, C>
where
    B: Backend + CausalBlockOps + FusedOps + ProductOps,
    C: CheckpointStrategy,
{
    fn causal_blocks(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let guards = [&q, &k, &v].map(|t| t.node());
        let [q, k, v] = [q, k, v].map(|t| t.into_primitive());
        let (out, maps) = B::causal_blocks_with_maps(q.clone(), k.clone(), v.clone())?;
        Some(tracked::<B, C, 3>(guards, (q, k, v, None, maps), out))
    }

    fn differential_blocks(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        lambda: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let guards = [&q, &k, &v, &lambda].map(|t| t.node());
        let [q, k, v, lambda] = [q, k, v, lambda].map(|t| t.into_primitive());
        let (out, maps) =
            B::differential_blocks_with_maps(q.clone(), k.clone(), v.clone(), lambda.clone())?;
        Some(tracked::<B, C, 4>(
            guards,
            (q, k, v, Some(lambda), maps),
            out,
        ))
    }
}

/// `out` under autodiff, with [`BlocksBackward`] and `state` recorded where one of the `N`
/// inputs of `guards` is tracked.
fn tracked<B: Backend + FusedOps + ProductOps, C: CheckpointStrategy, const N: usize>(
    guards: [NodeGuard; N],
    state: State<B>,
    out: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match BlocksBackward
        .prepare::<C>(guards)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// q, k, v, λ (DIFF) and the maps the forward kept.
type State<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Vec<FloatTensor<B>>,
);

/// The backward of the module's equations, with 3 parents (q, k, v) or 4 (and λ).
#[derive(Debug)]
struct BlocksBackward;

impl<B: Backend + FusedOps + ProductOps, const N: usize> Backward<B, N> for BlocksBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (q, k, v, lambda, maps) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (dq, dk, dv, d_lambda) = profile::time(Class::Attention, || {
            backward::<B>(q, k, v, lambda, maps, grad)
        });
        // One gradient per parent: q, k, v, and λ for DIFF.
        let mut gradients = [dq, dk, dv].into_iter().chain(d_lambda);
        let gradients = core::array::from_fn(|_| gradients.next().expect("a gradient per parent"));
        register::<B, N>(grads, ops.parents.map(|p| p.map(|n| n.id)), gradients);
    }
}

/// The blocks' shapes: `q` `[B, H, S, d]` and `k` `[B, G, T, d]`; with λ (DIFF) each query
/// half-head has its own key half-head, without it H = n_rep·G.
struct Blocks {
    b: usize,
    heads: usize,
    groups: usize,
    s: usize,
    t: usize,
    scale: f64,
}

impl Blocks {
    /// The blocks of `q` `[B, H, S, d]` over `k` `[B, G, T, d]`.
    fn of<B: Backend>(q: &FloatTensor<B>, k: &FloatTensor<B>) -> Self {
        let [b, heads, s, d] = q.shape().dims();
        let [_, groups, t, _] = k.shape().dims();
        Self {
            b,
            heads,
            groups,
            s,
            t,
            scale: 1.0 / (d as f64).sqrt(),
        }
    }

    /// Each block's queries and the keys it sees, `..e_i`.
    fn each(&self) -> impl Iterator<Item = (Range<usize>, usize)> + use<> {
        let past = self.t - self.s;
        blocks(self.s, BLOCK).map(move |rows| (rows.clone(), past + rows.end))
    }

    /// Rows `rows` of `x` `[B, H, S, n]` as the map's rows, `[B, G, n_rep·|rows|, n]` (query
    /// head r of a group's rows after those of heads 0 … r−1).
    fn rows<B: Backend>(&self, x: &FloatTensor<B>, rows: &Range<usize>) -> FloatTensor<B> {
        let n = x.shape()[3];
        let block = narrow::<B>(x, 2, rows.clone());
        let shape = [
            self.b,
            self.groups,
            self.heads / self.groups * rows.len(),
            n,
        ];
        B::float_reshape(block, Shape::new(shape))
    }

    /// [`Blocks::rows`]' inverse: `[B, G, n_rep·rows, n]` → `[B, H, rows, n]`.
    fn unstack<B: Backend>(&self, x: FloatTensor<B>, rows: usize) -> FloatTensor<B> {
        let n = x.shape()[3];
        B::float_reshape(x, Shape::new([self.b, self.heads, rows, n]))
    }
}

/// The output and, if `keep` (for the backward), the maps (per block A_i, then DIFF's two maps);
/// `None` for inputs other than f32 (Flex's one-pass maps take no other dtype) and where a map is
/// not taken.
#[cfg(feature = "flex")]
fn forward<B: FusedOps + ProductOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    lambda: Option<FloatTensor<B>>,
    keep: bool,
) -> Option<(FloatTensor<B>, Vec<FloatTensor<B>>)> {
    if [&q, &k, &v].iter().any(|t| t.dtype() != DType::F32) {
        return None;
    }
    let blocks = Blocks::of::<B>(&q, &k);
    let mut outs = Vec::new();
    let mut maps = Vec::new();
    for (rows, end) in blocks.each() {
        let keys = B::float_swap_dims(narrow::<B>(&k, 2, 0..end), 2, 3);
        let values = narrow::<B>(&v, 2, 0..end);
        let n = rows.len();
        let out = match &lambda {
            None => {
                let scores = matmul::<B>(blocks.rows::<B>(&q, &rows), keys);
                let map = B::causal_softmax(scores, n, blocks.scale)?;
                let out = matmul::<B>(map.clone(), values);
                if keep {
                    maps.push(map);
                }
                blocks.unstack::<B>(out, n)
            }
            Some(lambda) => {
                let scores = matmul::<B>(narrow::<B>(&q, 2, rows), keys);
                let (map, pair) =
                    B::differential_softmax_with_maps(scores, n, blocks.scale, lambda.clone())?;
                let out = matmul::<B>(map.clone(), values);
                if keep {
                    maps.extend([map, pair]);
                }
                out
            }
        };
        outs.push(out);
    }
    Some((B::float_cat(outs, 2), maps))
}

/// `(dq, dk, dv, ∂λ)` from the forward's inputs, its maps and the output's `grad`.
fn backward<B: FusedOps + ProductOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    lambda: Option<FloatTensor<B>>,
    maps: Vec<FloatTensor<B>>,
    grad: FloatTensor<B>,
) -> (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
) {
    let blocks = Blocks::of::<B>(&q, &k);
    let diff = lambda.is_some();
    let mut maps = maps.into_iter();
    let (mut dq, mut dk, mut dv, mut d_lambda) = (Vec::new(), None, None, None);
    for (rows, end) in blocks.each() {
        let n = rows.len();
        let keys = narrow::<B>(&k, 2, 0..end);
        let values = narrow::<B>(&v, 2, 0..end);
        let map = maps.next().expect("a map per block");
        let (queries, grad) = match diff {
            false => (blocks.rows::<B>(&q, &rows), blocks.rows::<B>(&grad, &rows)),
            true => (
                narrow::<B>(&q, 2, rows.clone()),
                narrow::<B>(&grad, 2, rows),
            ),
        };
        let d_map = matmul::<B>(grad.clone(), B::float_swap_dims(values, 2, 3));
        add_prefix::<B>(
            &mut dv,
            matmul::<B>(B::float_swap_dims(map.clone(), 2, 3), grad),
        );
        let d_scores = match &lambda {
            None => B::causal_softmax_backward(map, d_map, blocks.scale),
            Some(lambda) => {
                let pair = maps.next().expect("DIFF's two maps per block");
                let (d_scores, d_lambda_i) =
                    B::differential_softmax_backward(pair, lambda.clone(), d_map, blocks.scale);
                d_lambda = Some(match d_lambda.take() {
                    None => d_lambda_i,
                    Some(sum) => B::float_add(sum, d_lambda_i),
                });
                d_scores
            }
        };
        let d_queries = matmul::<B>(d_scores.clone(), keys);
        dq.push(match diff {
            false => blocks.unstack::<B>(d_queries, n),
            true => d_queries,
        });
        add_prefix::<B>(
            &mut dk,
            matmul::<B>(B::float_swap_dims(d_scores, 2, 3), queries),
        );
    }
    let whole = |x: Option<FloatTensor<B>>| x.expect("at least one block");
    (B::float_cat(dq, 2), whole(dk), whole(dv), d_lambda)
}

/// `sum ← term + sum` where the blocks' gradients of keys or values grow along the positions:
/// `term` `[B, G, e, n]` covers the sum's positions `..e'` (e' ≤ e), which are added to its first.
fn add_prefix<B: Backend>(sum: &mut Option<FloatTensor<B>>, term: FloatTensor<B>) {
    *sum = Some(match sum.take() {
        None => term,
        Some(sum) => {
            let prefix = sum.shape()[2];
            let head = B::float_add(narrow::<B>(&term, 2, 0..prefix), sum);
            B::float_slice_assign(term, &slices(&head.shape(), 2, 0..prefix), head)
        }
    });
}
