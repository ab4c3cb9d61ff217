//! DIFF Transformer V2 attention (official `multihead_flashdiffv2.py`, Jan 2026).
//!
//! With the baseline's H and H_kv and head dim d (`head_dim`, else d_model/H), V2 has 2H query heads and the
//! baseline's H_kv key/value heads; n_rep = 2H/H_kv (even, so query heads 2h and 2h+1 share a GQA
//! group and its values):
//!
//! ```text
//! Q = RoPE(X·W_q) [B, 2H, S, d],  K = RoPE(X·W_k), V = X·W_v [B, H_kv, S, d]
//! o_i = softmax(Q_i·K_{i/n_rep}ᵀ/√d + mask)·V_{i/n_rep}              (one standard attention, 2H heads)
//! λ_{t,h} = sigmoid(x_t·W_λ),  W_λ: d_model → H, no bias               (per token and head, from the block's attention input)
//! out_h = o_{2h} − λ_{t,h}·o_{2h+1}                                   (no subln, no λ_init)
//! out = Concat(out_0 … out_{H−1})·W_o,  W_o: H·d → d_model
//! ```
//!
//! During a warm-up of the negative map (`training.lambda_warmup`, for a model converted from a
//! pretrained Transformer) the subtracted output is scaled by `lambda_scale` = min(1, step/N):
//! `out_h = o_{2h} − lambda_scale·λ_{t,h}·o_{2h+1}` (1 outside a warm-up).
//!
//! V2 has d_model² + H·d_model more parameters per layer than the baseline (the extra H query
//! heads and W_λ).

use super::{
    AttentionProbe, StepQkv, causal_attention, causal_logits, merge_heads, projection,
    qkv_projection, repeat_kv, step_qkv,
};
use crate::cache::LayerCache;
use crate::config::{AttentionImpl, ModelConfig};
use crate::fused;
use crate::rows;
use burn::module::Module;
use burn::nn::{Linear, RotaryEncoding};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{DType, Device, Tensor};

#[derive(Module, Debug)]
pub struct DiffV2Attention {
    /// d_model → 2H·d.
    pub q_proj: Linear,
    /// d_model → H_kv·d.
    pub k_proj: Linear,
    /// d_model → H_kv·d.
    pub v_proj: Linear,
    /// H·d → d_model.
    pub o_proj: Linear,
    /// W_λ: d_model → H.
    pub lambda_proj: Linear,
    /// H (output heads; there are 2H query heads).
    pub heads: usize,
    /// H_kv.
    pub kv_heads: usize,
    #[module(skip)]
    pub implementation: AttentionImpl,
    /// Quantise attention logits to this many bits (0: off; analysis only).
    pub logit_bits: u32,
    /// The warm-up's scale of the subtracted output (1: none).
    #[module(skip)]
    pub lambda_scale: f64,
}

impl DiffV2Attention {
    pub fn new(config: &ModelConfig, device: &Device) -> Self {
        let (d_model, d) = (config.d_model, config.head_dim());
        let (heads, kv_heads) = (config.heads, config.kv_heads());
        Self {
            q_proj: qkv_projection(config, d_model, 2 * heads * d, device),
            k_proj: qkv_projection(config, d_model, kv_heads * d, device),
            v_proj: qkv_projection(config, d_model, kv_heads * d, device),
            o_proj: projection(config, heads * d, d_model, device),
            lambda_proj: projection(config, d_model, heads, device),
            heads,
            kv_heads,
            implementation: config.attention_impl,
            logit_bits: 0,
            lambda_scale: 1.0,
        }
    }

    /// λ_{t,h} = sigmoid(x_t·W_λ) in f32, `[B, S, H]`.
    pub fn lambda(&self, x: Tensor<3>) -> Tensor<3> {
        sigmoid(rows::linear(&self.lambda_proj, x).cast(DType::F32))
    }

    /// Q `[B, 2H, S, d]`, and K and V `[B, H_kv, T, d]` of the T positions so far: this step's
    /// S, after those in `cache`; with the step's padding mask.
    fn qkv(&self, x: Tensor<3>, rope: &RotaryEncoding, cache: Option<&mut LayerCache>) -> StepQkv {
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let heads = [2 * self.heads, self.kv_heads, self.kv_heads];
        step_qkv(x, projections, heads, rope, cache)
    }

    /// Pairs `[B, 2H, S, n]` into `x_{2h} − lambda_scale·λ_{t,h}·x_{2h+1}`, `[B, H, S, n]`
    /// ([`fused::pair_difference`], λ in the activations' dtype).
    fn differentiate(&self, x: Tensor<4>, lambda: Tensor<3>) -> Tensor<4> {
        let lambda = lambda.mul_scalar(self.lambda_scale).cast(x.dtype());
        fused::pair_difference(x, lambda)
    }

    /// `x` `[B, S, d_model]` → `[B, S, d_model]`, after the positions in `cache` when there is
    /// one (λ needs only this step's tokens).
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let lambda = self.lambda(x.clone());
        let ([q, k, v], mask) = self.qkv(x, rope, cache);
        let o = causal_attention(q, k, v, self.implementation, self.logit_bits, mask);
        rows::linear(&self.o_proj, merge_heads(self.differentiate(o, lambda)))
    }

    pub fn forward_probe(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
    ) -> (Tensor<3>, AttentionProbe) {
        let lambda = self.lambda(x.clone());
        let ([q, k, v], _) = self.qkv(x, rope, None);
        // One map per query head: the keys and values repeated for the GQA groups.
        let n_rep = 2 * self.heads / self.kv_heads;
        let (k, v) = (repeat_kv(k, n_rep), repeat_kv(v, n_rep));
        let logits = causal_logits(q, k, self.logit_bits, None);
        let probs = softmax(logits.clone(), 3);
        // Both heads of a pair read the same values, so the output is this map applied to them.
        let effective = self.differentiate(probs.clone(), lambda.clone());
        let o = probs.clone().matmul(v);
        let out = rows::linear(
            &self.o_proj,
            merge_heads(self.differentiate(o, lambda.clone())),
        );
        let probe = AttentionProbe {
            logits,
            probs,
            effective,
            lambda: Some(lambda),
        };
        (out, probe)
    }
}
