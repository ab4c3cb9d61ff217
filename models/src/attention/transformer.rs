//! Baseline Transformer attention (causal, GQA, RoPE).
//!
//! With H query heads, H_kv key/value heads, head dim d = d_model/H and n_rep = H/H_kv:
//!
//! ```text
//! Q = RoPE(X·W_q),  K = RoPE(X·W_k),  V = X·W_v          Q: [B, H, S, d], K, V: [B, H_kv, S, d]
//! head_i = softmax(Q_i·K_{i/n_rep}ᵀ/√d + causal mask)·V_{i/n_rep}
//! out = Concat(head_0 … head_{H−1})·W_o
//! ```

use super::{
    AttentionProbe, causal_attention, causal_logits, merge_heads, projection, repeat_kv,
    rotary_heads, split_heads, start, with_cached,
};
use crate::cache::LayerCache;
use crate::config::{AttentionImpl, ModelConfig};
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
            q_proj: projection(config, d_model, heads * d, device),
            k_proj: projection(config, d_model, kv_heads * d, device),
            v_proj: projection(config, d_model, kv_heads * d, device),
            o_proj: projection(config, heads * d, d_model, device),
            heads,
            kv_heads,
            implementation: config.attention_impl,
            logit_bits: 0,
        }
    }

    /// Q `[B, H, S, d]`, and K (repeated to H heads) and V (repeated) `[B, H, T, d]` of the T
    /// positions so far: this step's S, after those in `cache`.
    fn qkv(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: Option<&mut LayerCache>,
    ) -> [Tensor<4>; 3] {
        let (n_rep, start) = (self.heads / self.kv_heads, start(&cache));
        let q = rotary_heads(self.q_proj.forward(x.clone()), self.heads, rope, start);
        let k = rotary_heads(self.k_proj.forward(x.clone()), self.kv_heads, rope, start);
        let v = split_heads(self.v_proj.forward(x), self.kv_heads);
        let [k, v] = with_cached(k, v, cache);
        [q, repeat_kv(k, n_rep), repeat_kv(v, n_rep)]
    }

    /// `x` `[B, S, d_model]` → `[B, S, d_model]`, after the positions in `cache` when there is one.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        mut cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let s = x.dims()[1];
        let [q, k, v] = self.qkv(x, rope, cache.as_deref_mut());
        let mask = cache.and_then(|c| c.step_mask(s));
        let heads = causal_attention(q, k, v, self.implementation, self.logit_bits, mask);
        self.o_proj.forward(merge_heads(heads))
    }

    pub fn forward_probe(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
    ) -> (Tensor<3>, AttentionProbe) {
        let [q, k, v] = self.qkv(x, rope, None);
        let logits = causal_logits(q, k, self.logit_bits, None);
        let probs = softmax(logits.clone(), 3);
        let out = self.o_proj.forward(merge_heads(probs.clone().matmul(v)));
        let probe = AttentionProbe {
            logits,
            effective: probs.clone(),
            probs,
            lambda: None,
        };
        (out, probe)
    }
}
