//! Matrix products into a fresh output: the linear layers' and the head's `x·W` (through
//! [`crate::rows::matmul`]), and the products of attention in blocks of queries
//! ([`crate::attention::blocks`]). For `a` `[.., m, k]` and `b` `[.., k, n]` with the same batch
//! dimensions,
//!
//! ```text
//! c = a·b,   c_ij = Σ_l a_il·b_lj   (per batch index)
//! ∂a = ∂c·bᵀ,   ∂b = aᵀ·∂c
//! ```
//!
//! Flex's own product (Burn 0.22.1) allocates each output as zeroed bytes and then copies them
//! into an allocation of its tensors' alignment before gemm overwrites them: two passes over
//! every output that add nothing (~5% of a training step at d 256, 4 layers, in `perf`). Here, on
//! Flex and in f32, gemm writes straight into a new buffer that nothing else touches, with the
//! same kernels, blocking and threads as Flex's product, so the numbers are Flex's own, bit for
//! bit: a product of 192³ multiply-adds or more runs on all of rayon's threads unless it is one of
//! 4 or more, which with 128³ or more in all are spread over the threads one product each, as
//! are 2 or 3 smaller ones with 128³ or more in all; the rest run on one thread.
//! Under autodiff this is one operation with the backward above, whose two products are taken the
//! same way (timed as `matmul` by [`crate::profile`]). Other backends, dtypes and batch shapes keep
//! the backend's product and Burn's autodiff of it.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use crate::fused::register;
use crate::profile::{self, Class};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::Tensor;

/// `a·b` for `a` `[.., m, k]` and `b` `[.., k, n]`: as [`Tensor::matmul`] (whose batch
/// broadcasting takes the backend's product), the output fresh where the backend takes it (see
/// the module's doc).
pub fn product<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    <Dispatch as ProductOps>::product(a.clone().into_dispatch(), b.clone().into_dispatch())
        .map(Tensor::from_dispatch)
        .unwrap_or_else(|| a.matmul(b))
}

/// [`ProductOps::product`] where the backend takes it, else its own product.
pub(crate) fn matmul<B: ProductOps>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
    B::product(a.clone(), b.clone()).unwrap_or_else(|| B::float_matmul(a, b))
}

/// The operation: `None` (the backend's product) everywhere but on Flex.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait ProductOps: Backend {
    /// `a·b` into a fresh output; `None`: not taken.
    fn product(_a: FloatTensor<Self>, _b: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        None
    }

    /// Whether `t`'s matrices are stored column after column (a transposed view, such as a tied
    /// head's `Eᵀ`), where the backend tells.
    fn column_major(_t: &FloatTensor<Self>) -> bool {
        false
    }
}

#[cfg(feature = "flex")]
impl ProductOps for burn::backend::Flex {
    fn product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        flex::product(&a, &b)
    }

    fn column_major(t: &FloatTensor<Self>) -> bool {
        flex::column_major(t)
    }
}
default_ops!(ProductOps, no_autodiff);

impl<B: ProductOps, C: CheckpointStrategy> ProductOps for Autodiff<B, C> {
    fn product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        let guards = [a.node(), b.node()];
        let [a, b] = [a, b].map(|t| t.into_primitive());
        let out = B::product(a.clone(), b.clone())?;
        let backward = ProductBackward {
            columns: [&a, &b].map(B::column_major),
        };
        Some(
            match backward.prepare::<C>(guards).compute_bound().stateful() {
                // Each operand only for the other's gradient.
                OpsKind::Tracked(prep) => {
                    prep.finish((b_tracked.then_some(a), a_tracked.then_some(b)), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }
}

/// The module's backward: `∂a = ∂c·bᵀ`, `∂b = aᵀ·∂c`, each where its operand is tracked, in its
/// operand's layout: for an operand stored column after column, the transpose of `b·∂cᵀ` or
/// `∂cᵀ·a` (so that a tied head's gradient adds to the embedding's row by row, not across a
/// transposed view of vocab × d).
#[derive(Debug)]
struct ProductBackward {
    /// Whether a and b are stored column after column.
    columns: [bool; 2],
}

impl<B: ProductOps> Backward<B, 2> for ProductBackward {
    /// `a` where `b` is tracked, `b` where `a` is.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (a, b) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [a_parent, b_parent] = ops.parents.map(|p| p.map(|n| n.id));
        let rank = grad.shape().num_dims();
        let t = |x: FloatTensor<B>| B::float_swap_dims(x, rank - 2, rank - 1);
        let [a_columns, b_columns] = self.columns;
        // The state holds b exactly where a is tracked, and a where b is.
        let (d_a, d_b) = profile::time(Class::Matmul, || {
            let d_a = b.map(|b| match a_columns {
                false => matmul::<B>(grad.clone(), t(b)),
                true => t(matmul::<B>(b, t(grad.clone()))),
            });
            let d_b = a.map(|a| match b_columns {
                false => matmul::<B>(t(a), grad),
                true => t(matmul::<B>(t(grad), a)),
            });
            (d_a, d_b)
        });
        for (parent, gradient) in [(a_parent, d_a), (b_parent, d_b)] {
            if let (Some(id), Some(gradient)) = (parent, gradient) {
                register::<B, 1>(grads, [Some(id)], [gradient]);
            }
        }
    }
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::Flex;
    use burn::backend::TensorMetadata;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::tensor::{DType, TensorData};
    use core::mem::MaybeUninit;
    use rayon::prelude::*;

    /// Multiply-adds from which one product runs on rayon's threads (Flex's threshold).
    const ONE_PRODUCT_IN_PARALLEL: usize = 192 * 192 * 192;
    /// Multiply-adds in all from which a batch's products are spread over rayon's threads, each
    /// on one (Flex's threshold).
    const BATCH_IN_PARALLEL: usize = 128 * 128 * 128;

    /// One operand: its storage, each batch index's first element, and its rows' and columns'
    /// strides, in elements.
    struct Operand<'a> {
        data: &'a [f32],
        starts: Vec<isize>,
        row_stride: isize,
        col_stride: isize,
    }

    impl<'a> Operand<'a> {
        fn of(t: &'a FloatTensor<Flex>) -> Self {
            let layout = t.layout();
            let strides = layout.strides();
            let dims = t.shape();
            let rank = dims.len();
            let (batch_dims, batch_strides) = (&dims[..rank - 2], &strides[..rank - 2]);
            // Batch index i's offset: its digits in the batch dimensions times their strides.
            let batch: usize = batch_dims.iter().product();
            let starts = (0..batch)
                .map(|mut i| {
                    let mut offset = layout.start_offset() as isize;
                    for (&dim, &stride) in batch_dims.iter().zip(batch_strides).rev() {
                        offset += (i % dim) as isize * stride;
                        i /= dim;
                    }
                    offset
                })
                .collect();
            Self {
                data: t.storage::<f32>(),
                starts,
                row_stride: strides[rank - 2],
                col_stride: strides[rank - 1],
            }
        }

        fn at(&self, batch: usize) -> *const f32 {
            // SAFETY: the layout's offsets lie inside its storage.
            unsafe { self.data.as_ptr().offset(self.starts[batch]) }
        }
    }

    /// Whether `t`'s matrices are stored column after column: rows next to each other, columns
    /// apart.
    pub(super) fn column_major(t: &FloatTensor<Flex>) -> bool {
        let strides = t.layout().strides();
        let rank = strides.len();
        rank >= 2 && strides[rank - 2] == 1 && strides[rank - 1] != 1
    }

    /// `a·b` for f32 `a` `[.., m, k]` and `b` `[.., k, n]` of the same batch dimensions (any
    /// strides), into a new contiguous `[.., m, n]`; `None` for other dtypes or shapes.
    pub(super) fn product(
        a: &FloatTensor<Flex>,
        b: &FloatTensor<Flex>,
    ) -> Option<FloatTensor<Flex>> {
        let (a_shape, b_shape) = (a.shape(), b.shape());
        let rank = a_shape.num_dims();
        if a.dtype() != DType::F32
            || b.dtype() != DType::F32
            || rank < 2
            || b_shape.num_dims() != rank
            || a_shape[..rank - 2] != b_shape[..rank - 2]
            || a_shape[rank - 1] != b_shape[rank - 2]
        {
            return None;
        }
        let (m, k, n) = (a_shape[rank - 2], a_shape[rank - 1], b_shape[rank - 1]);
        let (lhs, rhs) = (Operand::of(a), Operand::of(b));
        let batch = lhs.starts.len();
        let overflow = || panic!("product: {a_shape:?}·{b_shape:?} has more outputs than memory");
        let each = m.checked_mul(n).unwrap_or_else(overflow);
        let len = batch.checked_mul(each).unwrap_or_else(overflow);
        let mut out: Vec<f32> = Vec::with_capacity(len);
        if m.min(n) <= 1 {
            // gemm's vector kernels (m or n 1) take the output as a slice of floats: zeros,
            // written and left in the buffer.
            out.resize(len, 0.0);
            out.clear();
        }
        let one = |dst: &mut [MaybeUninit<f32>], i: usize, parallelism| {
            // SAFETY: `dst` holds the m·n outputs of batch index i, written row after row;
            // without `read_dst` gemm writes each of them and reads none (for k = 0 it writes
            // zeros; not so Apple's AMX kernels, which this crate does not turn on), and its
            // vector kernels find zeros; the operands' pointers and strides are their layouts'.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    dst.as_mut_ptr().cast::<f32>(),
                    1,
                    n as isize,
                    false,
                    lhs.at(i),
                    lhs.col_stride,
                    lhs.row_stride,
                    rhs.at(i),
                    rhs.col_stride,
                    rhs.row_stride,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    parallelism,
                )
            }
        };
        let spare = &mut out.spare_capacity_mut()[..len];
        let (work, all) = (each.saturating_mul(k), len.saturating_mul(k));
        let one_in_parallel =
            work >= ONE_PRODUCT_IN_PARALLEL && !(batch >= 4 && all >= BATCH_IN_PARALLEL);
        // `max(1)`: no outputs at all (m or n 0) are no chunks.
        if !one_in_parallel && batch > 1 && all >= BATCH_IN_PARALLEL {
            let products = spare.par_chunks_mut(each.max(1)).enumerate();
            products.for_each(|(i, dst)| one(dst, i, gemm::Parallelism::None));
        } else {
            let parallelism = match one_in_parallel {
                true => gemm::Parallelism::Rayon(0),
                false => gemm::Parallelism::None,
            };
            for (i, dst) in spare.chunks_mut(each.max(1)).enumerate() {
                one(dst, i, parallelism);
            }
        }
        // SAFETY: every one of the batch·m·n outputs was written above.
        unsafe { out.set_len(len) };
        let mut shape = a_shape.clone();
        shape[rank - 1] = n;
        Some(Flex::float_from_data(
            TensorData::new(out, shape),
            &a.device(),
        ))
    }
}
