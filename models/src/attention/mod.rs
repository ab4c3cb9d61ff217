//! Attention variants and what they share.
//!
//! Each variant lives in its own file whose doc comment states its equations. They share the
//! head layout helpers, the causal softmax and the probe type below. All tensors inside
//! attention are `[batch, heads, seq, dim]`.

pub mod blocks;
mod decode;
mod diff;
mod diff_v2;
pub mod flash;
mod transformer;

pub use diff::DiffAttention;
pub use diff_v2::DiffV2Attention;
pub use transformer::TransformerAttention;

use crate::cache::LayerCache;
use crate::config::{AttentionImpl, AttentionKind, ModelConfig};
use crate::profile::{self, Class};
use crate::{fused, rows};
use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig, RotaryEncoding};
use burn::tensor::activation::softmax;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Tensor};

/// The attention of one decoder block. (Variants differ in size; there is one per block, so
/// boxing would buy nothing.)
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Attention {
    Transformer(TransformerAttention),
    Diff(DiffAttention),
    DiffV2(DiffV2Attention),
}

/// What an attention layer computed, for analysis (off the training hot path).
#[derive(Debug, Clone)]
pub struct AttentionProbe {
    /// Pre-softmax logits `QKᵀ/√d` of every softmax map, `[B, maps, S, S]`; entries above the
    /// diagonal are `-inf` (masked). DIFF V1: map `2h` is head h's A₁, map `2h+1` its A₂.
    /// DIFF V2: maps are the 2H query heads.
    pub logits: Tensor<4>,
    /// The softmax maps, `[B, maps, S, S]`.
    pub probs: Tensor<4>,
    /// The map each output head applies to its values, `[B, heads, S, S]`: the softmax map for
    /// the baseline, `A₁ − λ·A₂` for DIFF V1, `A_{2h} − λ_{t,h}·A_{2h+1}` for DIFF V2.
    pub effective: Tensor<4>,
    /// λ: `[1, 1, 1]` for DIFF V1 (one scalar per layer), `[B, S, H]` for DIFF V2, `None` for
    /// the baseline. Always f32, before a warm-up's `lambda_scale` (which `effective` includes).
    pub lambda: Option<Tensor<3>>,
}

impl Attention {
    /// Builds the attention of block `depth` (0-based) for the configured variant.
    pub fn new(config: &ModelConfig, depth: usize, device: &Device) -> Self {
        match config.attention {
            AttentionKind::Transformer => {
                Self::Transformer(TransformerAttention::new(config, device))
            }
            AttentionKind::Diff => Self::Diff(DiffAttention::new(config, depth, device)),
            AttentionKind::DiffV2 => Self::DiffV2(DiffV2Attention::new(config, device)),
        }
    }

    /// `x`: `[B, S, d_model]` (already normalised) → `[B, S, d_model]`.
    pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
        self.run(x, rope, None)
    }

    /// [`Attention::forward`] for the next positions of a sequence whose earlier keys and values
    /// are in `cache` (RoPE at the absolute positions); appends this step's to it.
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: &mut LayerCache,
    ) -> Tensor<3> {
        self.run(x, rope, Some(cache))
    }

    pub(crate) fn run(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        match self {
            Self::Transformer(a) => a.forward(x, rope, cache),
            Self::Diff(a) => a.forward(x, rope, cache),
            Self::DiffV2(a) => a.forward(x, rope, cache),
        }
    }

    /// Whether a decoding step on Flex reads the KV cache in place (the decoding kernel: the
    /// baseline and DIFF V2 at full-precision logits), so that a cache narrower than the
    /// activations pays ([`crate::cache`]); DIFF V1's maps take Burn's products, which widen it
    /// first, as every other backend does.
    pub fn reads_cache_in_place(&self) -> bool {
        match self {
            Self::Transformer(a) => a.logit_bits == 0,
            Self::Diff(_) => false,
            Self::DiffV2(a) => a.logit_bits == 0,
        }
    }

    /// Like [`Attention::forward`], also returning the attention maps.
    pub fn forward_probe(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
    ) -> (Tensor<3>, AttentionProbe) {
        match self {
            Self::Transformer(a) => a.forward_probe(x, rope),
            Self::Diff(a) => a.forward_probe(x, rope),
            Self::DiffV2(a) => a.forward_probe(x, rope),
        }
    }

    /// Quantises this layer's attention logits to `bits` bits from now on (0: full precision);
    /// the explicit attention path is used while quantising.
    pub fn set_logit_bits(&mut self, bits: u32) {
        match self {
            Self::Transformer(a) => a.logit_bits = bits,
            Self::Diff(a) => a.logit_bits = bits,
            Self::DiffV2(a) => a.logit_bits = bits,
        }
    }

    /// How this layer's attention is computed.
    pub fn implementation(&self) -> AttentionImpl {
        match self {
            Self::Transformer(a) => a.implementation,
            Self::Diff(a) => a.implementation,
            Self::DiffV2(a) => a.implementation,
        }
    }

    /// Computes this layer's attention by `implementation` from now on.
    pub fn set_implementation(&mut self, implementation: AttentionImpl) {
        match self {
            Self::Transformer(a) => a.implementation = implementation,
            Self::Diff(a) => a.implementation = implementation,
            Self::DiffV2(a) => a.implementation = implementation,
        }
    }

    /// Scales this layer's λ by `scale` from now on: the warm-up of a converted model's
    /// negative map ([`DiffAttention`], [`DiffV2Attention`]); the baseline has none to scale.
    pub fn set_lambda_scale(&mut self, scale: f64) {
        match self {
            Self::Transformer(_) => {}
            Self::Diff(a) => a.lambda_scale = scale,
            Self::DiffV2(a) => a.lambda_scale = scale,
        }
    }

    /// DIFF V1's current λ of this layer (input-independent); `None` for other variants.
    pub fn lambda(&self) -> Option<f32> {
        match self {
            Self::Diff(a) => Some(a.lambda().into_scalar::<f32>()),
            _ => None,
        }
    }
}

/// A bias-free linear projection with the configured initialisation.
pub(crate) fn projection(
    config: &ModelConfig,
    d_in: usize,
    d_out: usize,
    device: &Device,
) -> Linear {
    LinearConfig::new(d_in, d_out)
        .with_bias(false)
        .with_initializer(config.linear_initializer())
        .init(device)
}

/// A query, key or value projection: [`projection`], with a bias initialised to zeros when
/// the configuration has `qkv_bias`.
pub(crate) fn qkv_projection(
    config: &ModelConfig,
    d_in: usize,
    d_out: usize,
    device: &Device,
) -> Linear {
    let mut linear = projection(config, d_in, d_out, device);
    if config.qkv_bias {
        linear.bias = Some(Initializer::Zeros.init([d_out], device));
    }
    linear
}

/// `[B, S, heads·dim]` → `[B, heads, S, dim]`.
pub(crate) fn split_heads(x: Tensor<3>, heads: usize) -> Tensor<4> {
    let [b, s, width] = x.dims();
    x.reshape([b, s, heads, width / heads]).swap_dims(1, 2)
}

/// `[B, heads, S, dim]` → `[B, S, heads·dim]`.
pub(crate) fn merge_heads(x: Tensor<4>) -> Tensor<3> {
    let [b, h, s, dim] = x.dims();
    x.swap_dims(1, 2).reshape([b, s, h * dim])
}

/// Q, K and V heads and, with a KV cache, the step's padding mask (see [`step_qkv`]).
pub(crate) type StepQkv = ([Tensor<4>; 3], Option<Tensor<4, Bool>>);

/// This step's Q, K and V as heads of `x` `[B, S, d_model]`: Q and K RoPE-rotated at their
/// absolute positions (after those in `cache`), V split. With a cache, K and V cover every
/// position so far and come with the step's padding mask ([`LayerCache::append`]).
pub(crate) fn step_qkv(
    x: Tensor<3>,
    [q_proj, k_proj, v_proj]: [&Linear; 3],
    [q_heads, k_heads, v_heads]: [usize; 3],
    rope: &RotaryEncoding,
    cache: Option<&mut LayerCache>,
) -> StepQkv {
    let start = cache.as_ref().map_or(0, |c| c.len());
    let q = fused::rotary(rows::linear(q_proj, x.clone()), q_heads, rope, start);
    let k = fused::rotary(rows::linear(k_proj, x.clone()), k_heads, rope, start);
    let v = split_heads(rows::linear(v_proj, x), v_heads);
    match cache {
        Some(cache) => {
            let ([k, v], mask) = cache.append(k, v);
            ([q, k, v], mask)
        }
        None => ([q, k, v], None),
    }
}

/// Keys and values in the queries' dtype: widened from a cache kept narrower
/// ([`crate::cache`]), as they are otherwise.
pub(crate) fn as_queries(q: &Tensor<4>, kv: [Tensor<4>; 2]) -> [Tensor<4>; 2] {
    let dtype = q.dtype();
    kv.map(|t| t.cast(dtype))
}

/// GQA: `[B, H_kv, S, dim]` → `[B, H_kv·n_rep, S, dim]`, query head `i` reading kv head
/// `i / n_rep` (the official code's `repeat_kv`).
pub(crate) fn repeat_kv(x: Tensor<4>, n_rep: usize) -> Tensor<4> {
    if n_rep == 1 {
        return x;
    }
    let [b, h_kv, s, dim] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, h_kv, n_rep, s, dim])
        .reshape([b, h_kv * n_rep, s, dim])
}

/// Scaled causal logits `q·kᵀ/√d` with `-inf` where a key comes after its query; `q`:
/// `[.., S, d]`, `k`: `[.., T, d]` with T ≥ S: the queries are the last S of the T positions
/// (T > S when earlier keys come from a KV cache). With `bits > 0` the logits are quantised
/// first (see [`quantize_absmax`]).
/// `mask` (true: masked) replaces the causal mask when given (a KV cache with left padding).
pub(crate) fn causal_logits<const D: usize>(
    q: Tensor<D>,
    k: Tensor<D>,
    bits: u32,
    mask: Option<Tensor<D, Bool>>,
) -> Tensor<D> {
    let [s, d] = [q.dims()[D - 2], q.dims()[D - 1]];
    let t = k.dims()[D - 2];
    let logits = q
        .matmul(k.swap_dims(D - 2, D - 1))
        .mul_scalar(1.0 / (d as f64).sqrt());
    let future = mask.unwrap_or_else(|| {
        let past = (t - s) as i64;
        Tensor::<2, Bool>::tril_mask([s, t], past, &logits.device()).unsqueeze::<D>()
    });
    let logits = if bits > 0 {
        quantize_absmax(logits, future.clone(), bits)
    } else {
        logits
    };
    logits.mask_fill(future, f32::NEG_INFINITY)
}

/// Dynamic absmax post-training quantisation of attention logits (the paper's Fig. 8): each
/// map's logits are rounded to a symmetric grid of `2^(bits−1) − 1` steps each side of zero,
/// scaled by the largest |logit| of the map's causal (unmasked) entries.
pub fn quantize_absmax<const D: usize>(
    logits: Tensor<D>,
    future: Tensor<D, Bool>,
    bits: u32,
) -> Tensor<D> {
    assert!(
        (2..=24).contains(&bits),
        "attention logits quantised to {bits} bits: 2 to 24 are possible"
    );
    let steps = ((1u32 << (bits - 1)) - 1) as f64;
    let scale = logits
        .clone()
        .mask_fill(future, 0.0)
        .abs()
        .max_dim(D - 1)
        .max_dim(D - 2)
        .div_scalar(steps)
        .clamp_min(f32::MIN_POSITIVE);
    logits.div(scale.clone()).round().mul(scale)
}

/// Causal softmax map `softmax(q·kᵀ/√d)` (logits quantised to `bits` when `bits > 0`; `mask`
/// as in [`causal_logits`]).
pub(crate) fn causal_softmax<const D: usize>(
    q: Tensor<D>,
    k: Tensor<D>,
    bits: u32,
    mask: Option<Tensor<D, Bool>>,
) -> Tensor<D> {
    match (bits, mask) {
        (0, None) => {
            let s = q.dims()[D - 2];
            one_pass_causal_softmax(q, k, s)
        }
        (bits, mask) => softmax(causal_logits(q, k, bits, mask), D - 1),
    }
}

/// [`causal_softmax`] without quantisation or a given mask, by [`fused::causal_softmax`]: the
/// rows of `q` cycle over the last `positions` of k's positions (GQA groups stacked along them).
fn one_pass_causal_softmax<const D: usize>(
    q: Tensor<D>,
    k: Tensor<D>,
    positions: usize,
) -> Tensor<D> {
    let d = q.dims()[D - 1];
    let scores = q.matmul(k.swap_dims(D - 2, D - 1));
    fused::causal_softmax(scores, positions, 1.0 / (d as f64).sqrt())
}

/// `softmax(q·kᵀ/√d + causal mask)·v` by the configured implementation; quantised logits
/// (`bits > 0`), queries after cached keys (decoding) and a given `mask` (padding, see
/// [`causal_logits`]) take the explicit path. `q`: `[B, H, S, d]`, `k`: `[B, H_kv, T, d]`, `v`:
/// `[B, H_kv, T, d_v]` with H = n_rep·H_kv (GQA: query head i reads kv head i / n_rep), the
/// queries being the last S of the T positions. The explicit path reads the shared keys and
/// values in place ([`grouped_causal_attention`]); the others repeat them first.
pub(crate) fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    implementation: AttentionImpl,
    bits: u32,
    mask: Option<Tensor<4, Bool>>,
) -> Tensor<4> {
    match mask {
        None => profile::op(
            Class::Attention,
            "attention",
            [q, k, v],
            move |[q, k, v]| attend(q, k, v, implementation, bits, None),
        ),
        Some(mask) => profile::time(Class::Attention, || {
            attend(q, k, v, implementation, bits, Some(mask))
        }),
    }
}

/// [`causal_attention`], unprofiled.
fn attend(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    implementation: AttentionImpl,
    bits: u32,
    mask: Option<Tensor<4, Bool>>,
) -> Tensor<4> {
    let n_rep = q.dims()[1] / k.dims()[1];
    let cached = k.dims()[2] > q.dims()[2];
    if bits == 0 && (cached || mask.is_some()) {
        return grouped_causal_attention(q, k, v, mask);
    }
    let [k, v] = as_queries(&q, [k, v]);
    match implementation {
        // Per-map quantisation scales need each head's map on its own.
        _ if bits > 0 => {
            causal_softmax(q, repeat_kv(k, n_rep), bits, mask).matmul(repeat_kv(v, n_rep))
        }
        AttentionImpl::Explicit => grouped_causal_attention(q, k, v, None),
        AttentionImpl::Fused => {
            // Burn's attention op; its default scale is 1/√d.
            let options = AttentionModuleOptions {
                is_causal: true,
                ..Default::default()
            };
            attention(
                q,
                repeat_kv(k, n_rep),
                repeat_kv(v, n_rep),
                None,
                None,
                options,
            )
        }
        AttentionImpl::Flash { block } => {
            flash::flash_causal_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), block)
        }
    }
}

/// Causal attention for GQA without repeating K and V: the n_rep query heads of each kv head
/// are stacked along the query axis, `[B, H_kv, n_rep·S, d]`, so that one matmul per kv head
/// reads its keys and values once (the same numbers as repeating them, a copy of K and V fewer
/// per layer and decoding step). `mask` (`[B, 1, S, T]`, true: masked) replaces the causal one.
/// Without one, more positions than a block take [`blocks::causal`] where the backend has it.
fn grouped_causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
) -> Tensor<4> {
    let [b, h, s, d] = q.dims();
    let [_, h_kv, t, _] = k.dims();
    if s <= rows::FEW_ROWS
        && let Some(out) = decode::attention(&q, &k, &v, mask.as_ref())
    {
        return out;
    }
    let [k, v] = as_queries(&q, [k, v]);
    if mask.is_none()
        && let Some(out) = blocks::causal(q.clone(), k.clone(), v.clone())
    {
        return out;
    }
    let d_v = v.dims()[3];
    let n_rep = h / h_kv;
    if n_rep == 1 {
        return causal_softmax(q, k, 0, mask).matmul(v);
    }
    // Row r·S + i of a group is query head r's position i.
    let grouped = q.reshape([b, h_kv, n_rep * s, d]);
    let probs = match mask {
        None => one_pass_causal_softmax(grouped, k, s),
        Some(future) => {
            // The mask of position i, n_rep times.
            let [mb, mh, _, _] = future.dims();
            assert_eq!(mh, 1, "a mask shared by the heads");
            let future = future
                .unsqueeze_dim::<5>(1)
                .expand([mb, n_rep, 1, s, t])
                .reshape([mb, 1, n_rep * s, t]);
            causal_softmax(grouped, k, 0, Some(future))
        }
    };
    probs.matmul(v).reshape([b, h, s, d_v])
}
