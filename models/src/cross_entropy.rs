//! The mean cross-entropy of a language model's logits against its targets, with its own
//! backward on Flex. For N rows of logits z_n over V classes and targets t_n:
//!
//! ```text
//! L_n = log Σ_j e^(z_nj)   (the row's log-sum-exp, from its maximum m_n: m_n + log Σ_j e^(z_nj − m_n))
//! loss = (1/N) Σ_n (L_n − z_n,t_n)
//! ∂loss/∂z_nj = (e^(z_nj − L_n) − [j = t_n]) / N     (times the loss's incoming gradient g)
//! ```
//!
//! Burn's `CrossEntropyLoss` takes a log-softmax over the whole `[N, V]` logits, a gather and a
//! mean, and autodiff differentiates each: a dozen passes over logits that at a 135M model's
//! vocabulary are 100 MB per 512 tokens, two of them through glibc's scalar `expf`. On Flex (f32,
//! contiguous logits) the forward is two reading passes per row (its maximum, then its sum of
//! exponentials, sixteen lanes at a time: [`crate::exp`]) and the backward writes each row of the
//! gradient once (then exponentiates and scales it while it is in cache), L kept between them (N
//! floats). Elsewhere [`cross_entropy`] is Burn's loss.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use crate::profile::{self, Class};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, TensorMetadata, backend_extension};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};

/// The mean cross-entropy of `logits` `[N, V]` (f32) against `targets` `[N]`, `[1]`.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    profile::time(Class::Loss, || {
        <Dispatch as CrossEntropyOps>::cross_entropy(
            logits.clone().into_dispatch(),
            targets.clone().into_dispatch(),
        )
        .map(Tensor::from_dispatch)
        .unwrap_or_else(|| {
            CrossEntropyLossConfig::new()
                .init(&logits.device())
                .forward(logits, targets)
        })
    })
}

/// The loss where a backend computes it directly (Flex, and autodiff over Flex); `None`: Burn's.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait CrossEntropyOps: Backend {
    /// The mean loss `[1]`, or `None` where Burn's loss is taken.
    fn cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        Self::cross_entropy_forward(logits, targets).map(|(loss, _)| loss)
    }

    /// The mean loss `[1]` and each row's log-sum-exp L `[N]`, or `None`.
    fn cross_entropy_forward(
        _logits: FloatTensor<Self>,
        _targets: IntTensor<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        None
    }

    /// ∂loss/∂logits from the forward's logits, L and targets and the loss's gradient `[1]`
    /// (called only where the forward was taken).
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        backward_plain::<Self>(logits, lse, targets, grad)
    }
}

#[cfg(feature = "flex")]
impl CrossEntropyOps for burn::backend::Flex {
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        flex::forward(&logits, &targets)
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        flex::backward(&logits, &lse, &targets, &grad)
            .unwrap_or_else(|| backward_plain::<Self>(logits, lse, targets, grad))
    }
}
default_ops!(CrossEntropyOps, no_autodiff);

impl<B: Backend + CrossEntropyOps, C: CheckpointStrategy> CrossEntropyOps for Autodiff<B, C> {
    fn cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let guard = [logits.node()];
        let logits = logits.into_primitive();
        let (loss, lse) = B::cross_entropy_forward(logits.clone(), targets.clone())?;
        Some(
            match CrossEntropyBackward
                .prepare::<C>(guard)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(
                    CrossEntropyState {
                        logits,
                        lse,
                        targets,
                    },
                    loss,
                ),
                OpsKind::UnTracked(prep) => prep.finish(loss),
            },
        )
    }
}

/// What the backward keeps: the logits (which autodiff would keep too), L and the targets.
#[derive(Debug, Clone)]
struct CrossEntropyState<B: Backend> {
    logits: FloatTensor<B>,
    lse: FloatTensor<B>,
    targets: IntTensor<B>,
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: Backend + CrossEntropyOps> Backward<B, 1> for CrossEntropyBackward {
    type State = CrossEntropyState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let CrossEntropyState {
            logits,
            lse,
            targets,
        } = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(node) = parent {
            let d_logits = profile::time(Class::Loss, || {
                B::cross_entropy_backward(logits, lse, targets, grad)
            });
            grads.register::<B>(node.id, d_logits);
        }
    }
}

/// [`CrossEntropyOps::cross_entropy_backward`] by Burn's operations:
/// `(e^(z − L)·g/N)` with `g/N` taken off at each row's target.
fn backward_plain<B: Backend>(
    logits: FloatTensor<B>,
    lse: FloatTensor<B>,
    targets: IntTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let n = logits.shape()[0];
    let scale = B::float_div_scalar(B::float_reshape(grad, [1, 1].into()), (n as f32).into());
    let lse = B::float_reshape(lse, [n, 1].into());
    let p = B::float_mul(B::float_exp(B::float_sub(logits, lse)), scale.clone());
    let at_targets = B::float_neg(B::float_expand(scale, [n, 1].into()));
    let targets = B::int_reshape(targets, [n, 1].into());
    B::float_scatter(
        1,
        p,
        targets,
        at_targets,
        burn::tensor::IndexingUpdateOp::Add,
    )
}

#[cfg(feature = "flex")]
mod flex {
    use crate::exp::{exp_shifted, max_of, sum_exp_shifted};
    use crate::fused::flex::elements;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn::backend::{Flex, TensorMetadata};
    use burn::tensor::{DType, TensorData};
    use rayon::prelude::*;

    type T = FloatTensor<Flex>;

    /// Logits `[N, V]` as rows (f32, contiguous, V > 0), with the targets as indices, each
    /// checked to be a class (`None` otherwise: Burn's loss says what is wrong).
    fn rows<'a>(
        logits: &'a T,
        targets: &IntTensor<Flex>,
    ) -> Option<(&'a [f32], usize, Vec<usize>)> {
        let shape = logits.shape();
        let layout = logits.layout();
        if shape.num_dims() != 2 || logits.dtype() != DType::F32 || !layout.is_contiguous() {
            return None;
        }
        let [n, v] = [shape[0], shape[1]];
        let t_layout = targets.layout();
        if v == 0 || targets.shape().num_elements() != n || !t_layout.is_contiguous() {
            return None;
        }
        let start = t_layout.start_offset();
        let indices: Vec<i64> = match targets.dtype() {
            DType::I64 => targets.storage::<i64>()[start..][..n].to_vec(),
            DType::I32 => targets.storage::<i32>()[start..][..n]
                .iter()
                .map(|&t| t as i64)
                .collect(),
            _ => return None,
        };
        let classes = indices
            .into_iter()
            .map(|t| usize::try_from(t).ok().filter(|&t| t < v))
            .collect::<Option<Vec<_>>>()?;
        let data = &logits.storage::<f32>()[layout.start_offset()..][..n * v];
        Some((data, v, classes))
    }

    pub(super) fn forward(logits: &T, targets: &IntTensor<Flex>) -> Option<(T, T)> {
        let (data, v, classes) = rows(logits, targets)?;
        let n = classes.len();
        let lse: Vec<f32> = data
            .par_chunks(v)
            .map(|row| {
                let max = max_of(row);
                max + sum_exp_shifted(row, max).ln()
            })
            .collect();
        let total: f64 = (0..n)
            .map(|i| (lse[i] - data[i * v + classes[i]]) as f64)
            .sum();
        let device = logits.device();
        let loss = Flex::float_from_data(
            TensorData::new(vec![(total / n as f64) as f32], [1]),
            &device,
        );
        let lse = Flex::float_from_data(TensorData::new(lse, [n]), &device);
        Some((loss, lse))
    }

    pub(super) fn backward(logits: &T, lse: &T, targets: &IntTensor<Flex>, grad: &T) -> Option<T> {
        let (data, v, classes) = rows(logits, targets)?;
        let n = classes.len();
        let (lse, grad) = (elements(lse)?, elements(grad)?);
        if lse.len() != n || grad.len() != 1 {
            return None;
        }
        let scale = grad[0] / n as f32;
        let mut out = vec![0.0f32; n * v];
        out.par_chunks_mut(v)
            .zip(data.par_chunks(v))
            .enumerate()
            .for_each(|(i, (out, row))| {
                out.copy_from_slice(row);
                exp_shifted(out, lse[i]);
                out[classes[i]] -= 1.0;
                for x in out.iter_mut() {
                    *x *= scale;
                }
            });
        Some(Flex::float_from_data(
            TensorData::new(out, [n, v]),
            &logits.device(),
        ))
    }
}
