//! # diffzoo-models
//!
//! The DIFF Transformer (Ye et al., "Differential Transformer", ICLR 2025), its V2 and a
//! parameter-matched baseline Transformer as backend-agnostic Burn modules.
//!
//! | paper | file |
//! |---|---|
//! | decoder, pre-norm blocks, RMSNorm, RoPE | [`model`] |
//! | SwiGLU | [`feed_forward`] |
//! | RMSNorm and RoPE in one pass each (Flex, inference) | [`fused`] |
//! | memory-efficient attention (FlashAttention-2, custom backward) | [`attention::flash`] |
//! | baseline attention | [`attention::TransformerAttention`] |
//! | DIFF V1, eq. 1–3, λ, λ_init, subln | [`attention::DiffAttention`] |
//! | DIFF V2 | [`attention::DiffV2Attention`] |
//! | parameter counts, FLOPs, KV cache size | [`budget`] |
//! | incremental decoding (KV cache) | [`cache`] |
//! | decoding's few-row products, split across threads | [`rows`] |
//! | training's products, written straight into their output (Flex) | [`product`] |
//! | the threads that stay awake between those products | [`team`] |
//! | per-block activation recomputation | [`recompute`] |
//! | a pretrained baseline converted to DIFF V1 or V2 | [`convert`] |
//! | mixed precision's bf16 compute copy of f32 masters | [`precision`] |
//! | analysis statistics (Table 5 magnitudes, λ) | [`analysis`] |
//! | where a pass's time goes, by class of operation | [`profile`] |
//!
//! ```text
//! ModelConfig::new(AttentionKind::Diff, d_model, layers, heads, vocab, max_seq_len).init(&device)
//!     -> Model::forward(tokens [B, S]) -> logits [B, S, vocab]
//! Model::cache() -> Model::forward_cached(prompt, &mut cache), then one token at a time
//! ```

/// The implementations of a backend extension `$ops` that keep its default methods (Burn's ops)
/// for the backends other than Flex that are compiled in, and (unless `no_autodiff`: the
/// extension has its own backward) for autodiff over any backend.
macro_rules! default_ops {
    ($ops:ident) => {
        default_ops!($ops, no_autodiff);
        impl<B, C> $ops for burn::backend::Autodiff<B, C>
        where
            B: burn::backend::Backend + $ops,
            C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy,
        {
        }
    };
    ($ops:ident, no_autodiff) => {
        // NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        impl $ops for burn::backend::NdArray {}
        #[cfg(feature = "tch")]
        #[allow(deprecated)]
        impl $ops for burn::backend::LibTorch {}
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        impl $ops for burn::backend::Cube {}
    };
}

pub mod analysis;
pub mod attention;
pub mod budget;
pub mod cache;
pub mod config;
pub mod convert;
pub mod cross_entropy;
#[cfg(feature = "flex")]
mod exp;
pub mod feed_forward;
pub mod fused;
pub mod model;
pub mod precision;
pub mod product;
pub mod profile;
pub mod recompute;
pub mod rows;
pub mod team;

pub use analysis::{AbsAccumulator, AbsStats, Allocation, LayerStats, allocation};
pub use attention::{Attention, AttentionProbe};
pub use budget::{FlopsPerToken, ParamCount};
pub use cache::{KvCache, LayerCache};
pub use config::{
    AttentionImpl, AttentionKind, DEFAULT_ATTENTION_BLOCK, ModelConfig, RopeScaling, lambda_init,
};
pub use model::{Block, LayerProbe, Model, ModelProbe, target_log_probs};
pub use precision::compute_copy;
