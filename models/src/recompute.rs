//! Per-block activation recomputation (`training.recompute = "block"`): a training step whose
//! backward pass keeps each block's input and nothing else of its forward.
//!
//! Autodiff keeps every activation of the forward pass for the backward. Here the forward runs
//! outside autodiff and keeps only the block inputs; each block then runs again, under autodiff,
//! just before its own backward, and the chain rule is applied one block at a time:
//!
//! ```text
//! forward, no graph:   h₀ = Embed(tokens),  h_l = Block_l(h_{l−1}),  l = 1 … L   (h₀ … h_{L−1} kept)
//! head:                ℓ = loss(Head(h_L))           → ∂ℓ/∂θ_head,   g_L = ∂ℓ/∂h_L
//! block l = L … 1:     ⟨Block_l(h_{l−1}), g_l⟩       → ∂ℓ/∂θ_l,      g_{l−1} = ∂ℓ/∂h_{l−1}
//! embedding:           ⟨Embed(tokens), g₀⟩           → ∂ℓ/∂θ_embed
//! ```
//!
//! with ⟨a, b⟩ = Σ a ⊙ b and h_{l−1}, h_L leaves of their own graphs. ∂⟨f(x), g⟩/∂x = J_fᵀ·g is
//! exactly the vector–Jacobian product the whole-model backward would have formed at that block,
//! so the gradients are those of one backward pass (up to the order of floating-point sums). A
//! tied embedding gets its gradient in two shares (head and embedding) that the caller adds.
//!
//! Memory: the L block inputs `[B, S, d_model]`, one block's activations and the head's at a
//! time, instead of every block's. The cost is one more forward pass per step.
//!
//! Under mixed precision each partial pass reads its own compute copy of the weights it uses
//! ([`crate::precision`]): a graph, the cast of a master included, serves one backward pass.

use crate::model::Model;
use crate::precision::compute_copy;
use burn::module::Module;
use burn::tensor::{FloatDType, Gradients, Int, Tensor};

impl Model {
    /// One backward pass of `loss(self.forward(tokens))` with each block recomputed (see the
    /// module documentation). `self` must be on an autodiff device; `compute`: the dtype the
    /// passes compute in, from copies of `self`'s weights (`None`: their own). Each partial
    /// backward's gradients are handed to `each` as soon as they exist: the head's, then block
    /// L's … block 1's, then the embedding's; their sum over the calls is the full gradient.
    /// Returns the loss (its graph already consumed).
    pub fn backward_recomputed(
        &self,
        tokens: Tensor<2, Int>,
        compute: Option<FloatDType>,
        loss: impl FnOnce(Tensor<3>) -> Tensor<1>,
        mut each: impl FnMut(Gradients),
    ) -> Tensor<1> {
        let frozen = compute_copy(&self.valid(), compute);
        let mut inputs = Vec::with_capacity(self.blocks.len());
        let mut h = frozen.embed.forward(tokens.clone().inner());
        for block in &frozen.blocks {
            let next = block.forward(h.clone(), &frozen.rope);
            inputs.push(h);
            h = next;
        }
        drop(frozen);

        let last = self.leaf(h).require_grad();
        let value = loss(self.head_in(last.clone(), compute));
        let mut grads = value.backward();
        let mut grad = Self::input_grad(&last, &mut grads);
        drop(last);
        each(grads);

        for (block, input) in self.blocks.iter().zip(inputs).rev() {
            let input = self.leaf(input).require_grad();
            let output = compute_copy(block, compute).forward(input.clone(), &self.rope);
            let mut grads = (output * self.leaf(grad)).sum().backward();
            grad = Self::input_grad(&input, &mut grads);
            each(grads);
        }

        let embedded = compute_copy(&self.embed, compute).forward(tokens);
        each((embedded * self.leaf(grad)).sum().backward());
        value
    }

    /// `x` (computed outside autodiff) as a leaf on this model's autodiff context.
    fn leaf(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.autodiff();
        match self.embed.weight.val().gradient_checkpointing_strategy() {
            Some(strategy) => x.with_gradient_checkpointing_strategy(strategy),
            None => panic!("Model::backward_recomputed needs a model on an autodiff device"),
        }
    }

    fn input_grad(input: &Tensor<3>, grads: &mut Gradients) -> Tensor<3> {
        input
            .grad_remove(grads)
            .expect("a block input that requires its gradient gets one")
    }
}
