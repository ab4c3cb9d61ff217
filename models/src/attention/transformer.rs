//! Baseline Transformer attention (causal, GQA, RoPE).
//!
//! With H query heads, H_kv key/value heads, head dim d (`head_dim`, else d_model/H) and
//! n_rep = H/H_kv:
//!
//! ```text
//! Q = RoPE(X·W_q),  K = RoPE(X·W_k),  V = X·W_v          Q: [B, H, S, d], K, V: [B, H_kv, S, d]
//! head_i = softmax(Q_i·K_{i/n_rep}ᵀ/√d + causal mask)·V_{i/n_rep}
//! out = Concat(head_0 … head_{H−1})·W_o
//! ```
//!
//! With `qkv_bias` (Qwen2) the three input projections add a bias: `X·W_q + b_q`, and so on.

use super::{
    AttentionProbe, StepQkv, causal_attention, causal_logits, merge_heads, projection,
    qkv_projection, repeat_kv, step_qkv,
};
use crate::cache::LayerCache;
use crate::config::{AttentionImpl, ModelConfig};
use crate::rows;
use burn::module::Module;
use burn::nn::{Linear, RotaryEncoding};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Tensor};

#[derive(Module, Debug)]
pub struct TransformerAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// H.
    pub heads: usize,
    /// H_kv.
    pub kv_heads: usize,
    #[module(skip)]
    pub implementation: AttentionImpl,
    /// Quantise attention logits to this many bits (0: off; analysis only).
    pub logit_bits: u32,
}

impl TransformerAttention {
    pub fn new(config: &ModelConfig, device: &Device) -> Self {
        let (d_model, d) = (config.d_model, config.head_dim());
        let (heads, kv_heads) = (config.heads, config.kv_heads());
        Self {
            q_proj: qkv_projection(config, d_model, heads * d, device),
            k_proj: qkv_projection(config, d_model, kv_heads * d, device),
            v_proj: qkv_projection(config, d_model, kv_heads * d, device),
            o_proj: projection(config, heads * d, d_model, device),
            heads,
            kv_heads,
            implementation: config.attention_impl,
            logit_bits: 0,
        }
    }

    /// Q `[B, H, S, d]`, and K and V `[B, H_kv, T, d]` of the T positions so far: this step's S,
    /// after those in `cache`; with the step's padding mask.
    fn qkv(&self, x: Tensor<3>, rope: &RotaryEncoding, cache: Option<&mut LayerCache>) -> StepQkv {
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let heads = [self.heads, self.kv_heads, self.kv_heads];
        step_qkv(x, projections, heads, rope, cache)
    }

    /// `x` `[B, S, d_model]` → `[B, S, d_model]`, after the positions in `cache` when there is one.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let ([q, k, v], mask) = self.qkv(x, rope, cache);
        let heads = causal_attention(q, k, v, self.implementation, self.logit_bits, mask);
        rows::linear(&self.o_proj, merge_heads(heads))
    }

    pub fn forward_probe(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
    ) -> (Tensor<3>, AttentionProbe) {
        let ([q, k, v], _) = self.qkv(x, rope, None);
        // One map per query head: the keys and values repeated for the GQA groups.
        let n_rep = self.heads / self.kv_heads;
        let logits = causal_logits(q, repeat_kv(k, n_rep), self.logit_bits, None);
        let probs = softmax(logits.clone(), 3);
        let out = rows::linear(
            &self.o_proj,
            merge_heads(probs.clone().matmul(repeat_kv(v, n_rep))),
        );
        let probe = AttentionProbe {
            logits,
            effective: probs.clone(),
            probs,
            lambda: None,
        };
        (out, probe)
    }
}
