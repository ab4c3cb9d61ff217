//! Mixed precision's compute copy: the weights a forward pass reads, cast from their f32 masters.
//!
//! ```text
//! θ̃ = bf16(θ)                 every float parameter, inside the autodiff graph
//! ℓ = loss(f(x; θ̃))           the forward and backward passes in bf16 (RMSNorm statistics,
//!                             λ's exponentials, the flash path's softmax and the loss in f32,
//!                             as the layers cast them; the explicit path's softmax in bf16)
//! ∂ℓ/∂θ = f32(∂ℓ/∂θ̃)          the cast's backward: each master gets an f32 gradient
//! ```
//!
//! The cast is an operation of the graph, so the masters stay the leaves the optimizer steps,
//! in f32, with f32 moments — the policy of PyTorch FSDP2's `MixedPrecisionPolicy(param_dtype =
//! bf16)` and Megatron-LM's `--bf16`. Burn consumes a graph in its backward pass, so a copy
//! serves one backward pass: a step makes one per micro-batch, and per-block recomputation one
//! per part ([`crate::recompute`]).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{FloatDType, Tensor};

/// `module` with every float parameter cast to `dtype` (its ids kept), or itself when `dtype`
/// is `None` (full precision).
pub fn compute_copy<M: Module>(module: &M, dtype: Option<FloatDType>) -> M {
    match dtype {
        Some(dtype) => module.clone().map(&mut CastParams(dtype)),
        None => module.clone(),
    }
}

struct CastParams(FloatDType);

impl ModuleMapper for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|tensor| tensor.cast(dtype))
    }
}

/// `module` with every weight matrix (the 2-D parameters: projections, embeddings, an untied
/// head) stored in `dtype`, the rest (norms, λ, biases) as they are: inference weights. The
/// layers still compute in their activations' dtype, reading the matrices widened
/// ([`crate::rows`]); in bf16 a decoding step reads half the bytes.
pub fn weight_matrices_in<M: Module>(module: M, dtype: FloatDType) -> M {
    module.map(&mut CastMatrices(dtype))
}

struct CastMatrices(FloatDType);

impl ModuleMapper for CastMatrices {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        match D {
            2 => param.map(|tensor| tensor.cast(dtype)),
            _ => param,
        }
    }
}
