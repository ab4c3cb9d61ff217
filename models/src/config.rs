//! The model configuration: one struct describes a matched pair (or trio) of models.
//!
//! `heads` and `kv_heads` are always **the baseline Transformer's** counts. DIFF V1 derives its
//! H/2 differential heads from them and DIFF V2 its 2H query heads, so that one recipe describes
//! models that differ only in attention.

use burn::config::Config;
use burn::nn::Initializer;
use burn::serde::{Deserialize, Serialize};
use core::fmt;
use core::str::FromStr;

/// Which attention the decoder blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(crate = "burn::serde", rename_all = "kebab-case")]
pub enum AttentionKind {
    /// Standard causal softmax attention with GQA (the baseline).
    Transformer,
    /// DIFF Transformer V1 (Ye et al., ICLR 2025, eq. 1–3).
    Diff,
    /// DIFF Transformer V2 (official code, Jan 2026).
    DiffV2,
}

impl AttentionKind {
    /// All variants, in the order reports list them.
    pub const ALL: [AttentionKind; 3] = [Self::Transformer, Self::Diff, Self::DiffV2];

    /// The name used in recipes and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transformer => "transformer",
            Self::Diff => "diff",
            Self::DiffV2 => "diff-v2",
        }
    }
}

impl fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AttentionKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| {
                format!("unknown attention `{s}`: expected one of transformer, diff, diff-v2")
            })
    }
}

/// How attention is computed. All give the same outputs (to rounding); they differ in speed and
/// memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(crate = "burn::serde", rename_all = "kebab-case")]
pub enum AttentionImpl {
    /// Matmul and softmax: the S×S maps are materialised, and autodiff keeps them for the
    /// backward pass (memory grows with S²).
    Explicit,
    /// `burn::tensor::module::attention` (a fused kernel where the backend has one). Under
    /// autodiff Burn 0.22.1 decomposes it into the explicit path, so it only helps inference.
    Fused,
    /// FlashAttention-2's blocks with their own backward ([`crate::attention::flash`]): memory
    /// grows with S, in training too. `block` positions per query and key block.
    Flash { block: usize },
}

/// Positions per query and key block of [`AttentionImpl::Flash`] unless a recipe says otherwise.
pub const DEFAULT_ATTENTION_BLOCK: usize = 128;

/// Decoder-only language model configuration.
#[derive(Config, Debug, PartialEq)]
pub struct ModelConfig {
    /// Attention variant of every block.
    pub attention: AttentionKind,
    /// Residual stream width.
    pub d_model: usize,
    /// Number of decoder blocks.
    pub layers: usize,
    /// The baseline's query heads H; head dim is `d_model / heads` for every variant.
    pub heads: usize,
    /// Vocabulary size of the embedding and the LM head.
    pub vocab_size: usize,
    /// Longest sequence RoPE is tabulated for.
    pub max_seq_len: usize,
    /// The baseline's key/value heads H_kv (GQA); `None` means `heads` (MHA).
    #[config(default = "None")]
    pub kv_heads: Option<usize>,
    /// RoPE base θ.
    #[config(default = 10000.0)]
    pub rope_theta: f32,
    /// SwiGLU hidden size; `None` means `floor(8·d_model/3)`.
    #[config(default = "None")]
    pub ffn_dim: Option<usize>,
    /// Share the token embedding with the LM head.
    #[config(default = false)]
    pub tie_embeddings: bool,
    /// RMSNorm epsilon (blocks, final norm and DIFF's subln).
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Standard deviation of the token embedding's N(0, σ²) initialisation.
    #[config(default = 0.02)]
    pub embedding_std: f64,
    /// `None`: every linear layer uses PyTorch's `nn.Linear` default, U(±1/√fan_in), as the
    /// official DIFF code does. `Some(σ)`: N(0, σ²) for every linear layer (GPT-2 style).
    #[config(default = "None")]
    pub linear_std: Option<f64>,
    /// How attention is computed (same outputs, different speed and memory).
    #[config(default = "AttentionImpl::Explicit")]
    pub attention_impl: AttentionImpl,
}

impl ModelConfig {
    /// Per-head dimension d = d_model / H, the same for all variants.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// The baseline's key/value head count H_kv.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// SwiGLU hidden size.
    pub fn ffn_hidden(&self) -> usize {
        self.ffn_dim
            .unwrap_or_else(|| Self::default_ffn_hidden(self.d_model))
    }

    /// The SwiGLU hidden size when `ffn_dim` is not given: `floor(8·d_model/3)`.
    pub fn default_ffn_hidden(d_model: usize) -> usize {
        8 * d_model / 3
    }

    /// The initializer of every linear layer.
    pub fn linear_initializer(&self) -> Initializer {
        match self.linear_std {
            None => Initializer::KaimingUniform {
                gain: 1.0 / 3f64.sqrt(),
                fan_out_only: false,
            },
            Some(std) => Initializer::Normal { mean: 0.0, std },
        }
    }

    /// Checks that the shapes are consistent. Errors name the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("d_model", self.d_model),
            ("layers", self.layers),
            ("heads", self.heads),
            ("vocab_size", self.vocab_size),
            ("max_seq_len", self.max_seq_len),
            ("kv_heads", self.kv_heads()),
            ("ffn_dim", self.ffn_hidden()),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("`{name}` must be positive"));
        }
        if !self.d_model.is_multiple_of(self.heads) {
            return Err(format!(
                "`heads` = {} does not divide `d_model` = {}",
                self.heads, self.d_model
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "`kv_heads` = {} does not divide `heads` = {}",
                self.kv_heads(),
                self.heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "the head dimension `d_model` / `heads` = {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if self.attention == AttentionKind::Diff
            && !(self.heads.is_multiple_of(2) && self.kv_heads().is_multiple_of(2))
        {
            return Err(format!(
                "`attention = \"diff\"` needs even `heads` and `kv_heads` (it uses half of each), got {} and {}",
                self.heads,
                self.kv_heads()
            ));
        }
        if self.attention_impl == (AttentionImpl::Flash { block: 0 }) {
            return Err("the attention block size must be positive".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!(
                "`rope_theta` must be positive, got {}",
                self.rope_theta
            ));
        }
        let stds = [
            ("embedding_std", Some(self.embedding_std)),
            ("linear_std", self.linear_std),
        ];
        if let Some((name, Some(std))) = stds
            .into_iter()
            .find(|(_, std)| std.is_some_and(|s| !(s.is_finite() && s > 0.0)))
        {
            return Err(format!("`{name}` must be positive and finite, got {std}"));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(format!(
                "`norm_eps` must be positive, got {}",
                self.norm_eps
            ));
        }
        Ok(())
    }
}

/// λ_init = 0.8 − 0.6·exp(−0.3·depth), depth the 0-based layer index (paper §2.1).
pub fn lambda_init(depth: usize) -> f64 {
    0.8 - 0.6 * (-0.3 * depth as f64).exp()
}
