//! DIFF Transformer V1 attention: differential attention, exactly the paper (eq. 1–3) and the
//! official `multihead_flashdiff_1.py`.
//!
//! With the baseline's H and H_kv, DIFF uses H' = H/2 heads and H'_kv = H_kv/2 kv heads, head dim
//! d (the baseline's: `head_dim`, else d_model/H), n_rep = H'/H'_kv. Each head h owns two query half-heads
//! (2h, 2h+1) and each kv head g two key half-heads (2g, 2g+1) and one value of width 2d:
//!
//! ```text
//! [Q₁; Q₂] = RoPE(X·W_q),  [K₁; K₂] = RoPE(X·W_k),  V = X·W_v            (RoPE per d-dim half-head)
//! A₁ = softmax(Q₁K₁ᵀ/√d + mask),  A₂ = softmax(Q₂K₂ᵀ/√d + mask)          (eq. 1; GQA: head h reads kv h/n_rep)
//! λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init                          (eq. 2; one scalar per layer, f32)
//! λ_init = 0.8 − 0.6·exp(−0.3·depth)
//! head_h = (1 − λ_init)·subln((A₁ − λ·A₂)·V_h)                           (eq. 3; subln = RMSNorm over 2d)
//! out = Concat(head_0 … head_{H'−1})·W_o
//! ```
//!
//! During a warm-up of the negative map (`training.lambda_warmup`, for a model converted from a
//! pretrained Transformer) λ is scaled by `lambda_scale` = min(1, step/N): the maps subtract
//! `lambda_scale·λ·A₂` (1 outside a warm-up: the paper's model).
//!
//! The explicit path computes both maps with one batched matmul over the 2H' half-heads (no copy
//! of Q or K; the `[B, 2H', S, S]` maps are then viewed as pairs; on Flex in f32, beyond 128
//! query positions, in blocks of queries: [`super::blocks`]) and applies `A₁ − λ·A₂` to V
//! once; the fused and flash paths run one standard attention over the 2H' half-heads with V
//! (width 2d) read by both halves of its head, and subtract the outputs: `A₁V − λ·A₂V` (same
//! result by linearity; the gradients of the maps and of λ are in [`super::flash`]).

use super::{
    AttentionProbe, StepQkv, as_queries, blocks, causal_attention, causal_logits, causal_softmax,
    merge_heads, projection, qkv_projection, repeat_kv, step_qkv,
};
use crate::cache::LayerCache;
use crate::config::{AttentionImpl, ModelConfig, lambda_init};
use crate::fused::{self, rms_norm_scaled};
use crate::profile::{self, Class};
use crate::rows;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, RmsNorm, RmsNormConfig, RotaryEncoding};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, Tensor};

#[derive(Module, Debug)]
pub struct DiffAttention {
    /// d_model → 2H'·d, viewed as 2H' half-heads.
    pub q_proj: Linear,
    /// d_model → 2H'_kv·d, viewed as 2H'_kv half-heads.
    pub k_proj: Linear,
    /// d_model → H'_kv·2d.
    pub v_proj: Linear,
    /// d_model → d_model.
    pub o_proj: Linear,
    pub lambda_q1: Param<Tensor<1>>,
    pub lambda_k1: Param<Tensor<1>>,
    pub lambda_q2: Param<Tensor<1>>,
    pub lambda_k2: Param<Tensor<1>>,
    /// RMSNorm over each head's 2d outputs.
    pub subln: RmsNorm,
    pub lambda_init: f64,
    /// H'.
    pub heads: usize,
    /// H'_kv.
    pub kv_heads: usize,
    #[module(skip)]
    pub implementation: AttentionImpl,
    /// Quantise attention logits to this many bits (0: off; analysis only).
    pub logit_bits: u32,
    /// The warm-up's scale of λ (1: none).
    #[module(skip)]
    pub lambda_scale: f64,
}

impl DiffAttention {
    /// The attention of block `depth` (0-based), which sets λ_init.
    pub fn new(config: &ModelConfig, depth: usize, device: &Device) -> Self {
        let (d_model, d) = (config.d_model, config.head_dim());
        let (heads, kv_heads) = (config.heads / 2, config.kv_heads() / 2);
        let lambda = || {
            Initializer::Normal {
                mean: 0.0,
                std: 0.1,
            }
            .init([d], device)
        };
        Self {
            q_proj: qkv_projection(config, d_model, 2 * heads * d, device),
            k_proj: qkv_projection(config, d_model, 2 * kv_heads * d, device),
            v_proj: qkv_projection(config, d_model, kv_heads * 2 * d, device),
            o_proj: projection(config, heads * 2 * d, d_model, device),
            lambda_q1: lambda(),
            lambda_k1: lambda(),
            lambda_q2: lambda(),
            lambda_k2: lambda(),
            subln: RmsNormConfig::new(2 * d)
                .with_epsilon(config.norm_eps)
                .init(device),
            lambda_init: lambda_init(depth),
            heads,
            kv_heads,
            implementation: config.attention_impl,
            logit_bits: 0,
            lambda_scale: 1.0,
        }
    }

    /// λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, computed in f32; shape `[1]`.
    pub fn lambda(&self) -> Tensor<1> {
        let dot = |a: &Param<Tensor<1>>, b: &Param<Tensor<1>>| {
            (a.val().cast(DType::F32) * b.val().cast(DType::F32))
                .sum()
                .exp()
        };
        dot(&self.lambda_q1, &self.lambda_k1) - dot(&self.lambda_q2, &self.lambda_k2)
            + self.lambda_init
    }

    /// Q `[B, 2H', S, d]` (half-head `2h + c` is head h's Q_{c+1}), and K `[B, 2H', T, d]` lined
    /// up with it (GQA-repeated) and V `[B, H', T, 2d]` of the T positions so far: this step's S,
    /// after those in `cache`; with the step's padding mask.
    fn qkv(&self, x: Tensor<3>, rope: &RotaryEncoding, cache: Option<&mut LayerCache>) -> StepQkv {
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let heads = [2 * self.heads, 2 * self.kv_heads, self.kv_heads];
        let ([q, k, v], mask) = step_qkv(x, projections, heads, rope, cache);
        let [k, v] = as_queries(&q, [k, v]);
        let n_rep = self.heads / self.kv_heads;
        // Query half (h, c) meets key half (h / n_rep, c): fold each kv head's two halves into one
        // "head" of 2S rows, so that repeating heads keeps the pair together.
        let k = if n_rep == 1 {
            k
        } else {
            let [b, _, s, d] = k.dims();
            repeat_kv(k.reshape([b, self.kv_heads, 2 * s, d]), n_rep).reshape([
                b,
                2 * self.heads,
                s,
                d,
            ])
        };
        ([q, k, repeat_kv(v, n_rep)], mask)
    }

    /// `(1 − λ_init)·subln(heads)`, merged and projected.
    fn output(&self, heads: Tensor<4>) -> Tensor<3> {
        let heads = rms_norm_scaled(&self.subln, heads, 1.0 - self.lambda_init);
        rows::linear(&self.o_proj, merge_heads(heads))
    }

    /// `lambda_scale·λ` as a `[1, 1, 1]` tensor in `dtype`, the λ of every token and head
    /// ([`fused::pair_difference`]).
    fn lambda_as(&self, dtype: DType) -> Tensor<3> {
        self.lambda()
            .mul_scalar(self.lambda_scale)
            .cast(dtype)
            .reshape([1, 1, 1])
    }

    /// `x` `[B, S, d_model]` → `[B, S, d_model]`, after the positions in `cache` when there is one.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let dtype = x.dtype();
        let ([q, k, v], mask) = self.qkv(x, rope, cache);
        let lambda = self.lambda_as(dtype);
        // A decoding step (keys beyond its queries) takes the explicit path too: the others would
        // copy the cached V for both half-heads at every step.
        let explicit = self.implementation == AttentionImpl::Explicit
            || self.logit_bits > 0
            || k.dims()[2] > q.dims()[2];
        let heads = if explicit {
            let bits = self.logit_bits;
            match mask {
                // The profile's replays take tensors of one rank: λ as [1, 1, 1, 1] there.
                None => profile::op(
                    Class::Attention,
                    "diff explicit",
                    [q, k, v, lambda.unsqueeze()],
                    move |[q, k, v, lambda]| {
                        explicit_heads(q, k, v, lambda.reshape([1, 1, 1]), bits, None)
                    },
                ),
                Some(mask) => profile::time(Class::Attention, || {
                    explicit_heads(q, k, v, lambda, bits, Some(mask))
                }),
            }
        } else {
            // Half-heads 2h and 2h+1 both read head h's values.
            let o = causal_attention(q, k, repeat_kv(v, 2), self.implementation, 0, mask);
            fused::pair_difference(o, lambda)
        };
        self.output(heads)
    }

    pub fn forward_probe(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
    ) -> (Tensor<3>, AttentionProbe) {
        let dtype = x.dtype();
        let ([q, k, v], _) = self.qkv(x, rope, None);
        let logits = causal_logits(q, k, self.logit_bits, None);
        let probs = softmax(logits.clone(), 3);
        let effective = fused::pair_difference(probs.clone(), self.lambda_as(dtype));
        let out = self.output(effective.clone().matmul(v));
        let probe = AttentionProbe {
            logits,
            probs,
            effective,
            lambda: Some(self.lambda().reshape([1, 1, 1])),
        };
        (out, probe)
    }
}

/// `(A₁ − λ·A₂)·v` from the half-heads' explicit maps (`lambda` `[1, 1, 1]`), the
/// differential map in one pass ([`fused::differential_softmax`]) without quantisation or a mask,
/// in blocks of queries ([`blocks::differential`]) where the backend has them.
fn explicit_heads(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    lambda: Tensor<3>,
    bits: u32,
    mask: Option<Tensor<4, Bool>>,
) -> Tensor<4> {
    let map = match (bits, mask) {
        (0, None) => {
            if let Some(out) = blocks::differential(q.clone(), k.clone(), v.clone(), lambda.clone())
            {
                return out;
            }
            let [s, d] = [q.dims()[2], q.dims()[3]];
            let scores = q.matmul(k.swap_dims(2, 3));
            fused::differential_softmax(scores, s, 1.0 / (d as f64).sqrt(), lambda)
        }
        (bits, mask) => fused::pair_difference(causal_softmax(q, k, bits, mask), lambda),
    };
    map.matmul(v)
}
