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
    /// The baseline's query heads H; the head dim ([`ModelConfig::head_dim`]) is the same for
    /// every variant.
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
    /// Per-head width d; `None` means `d_model / heads`. Checkpoints such as Qwen3 or Gemma give
    /// heads of another width than the residual stream divided by the heads.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Biases on the query, key and value projections (Qwen2); none on the output projection.
    #[config(default = false)]
    pub qkv_bias: bool,
    /// RoPE's frequency scaling (Llama 3.1's long-context rule, or linear interpolation);
    /// `None`: RoPE as tabulated from θ.
    #[config(default = "None")]
    pub rope_scaling: Option<RopeScaling>,
}

/// How RoPE's inverse frequencies θᵢ = θ^(−2i/d) are rescaled for contexts beyond the one a
/// model was pretrained on (transformers' `modeling_rope_utils.py`, same names).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(
    crate = "burn::serde",
    tag = "type",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum RopeScaling {
    /// Position interpolation: every θᵢ divided by `factor` (`rope_type = "linear"`).
    Linear { factor: f64 },
    /// Llama 3.1's rule (`rope_type = "llama3"`), with wavelengths λᵢ = 2π/θᵢ and the pretraining
    /// context L = `original_max_seq_len`:
    ///
    /// ```text
    /// λᵢ < L/high_freq_factor:   θᵢ                        (high frequencies kept)
    /// λᵢ > L/low_freq_factor:    θᵢ/factor                 (low frequencies interpolated)
    /// otherwise:                 (1 − s)·θᵢ/factor + s·θᵢ,  s = (L/λᵢ − low_freq_factor)
    ///                                                          / (high_freq_factor − low_freq_factor)
    /// ```
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_seq_len: usize,
    },
}

impl RopeScaling {
    /// The rescaled inverse frequencies.
    pub fn apply(&self, inv_freq: &[f64]) -> Vec<f64> {
        match *self {
            Self::Linear { factor } => inv_freq.iter().map(|f| f / factor).collect(),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_seq_len,
            } => {
                let old = original_max_seq_len as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                inv_freq
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Checks the parameters; errors name the field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("`rope_scaling.{name}` = {v} must be positive"))
            }
        };
        match *self {
            Self::Linear { factor } => positive("factor", factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_seq_len,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if low_freq_factor >= high_freq_factor {
                    return Err(format!(
                        "`rope_scaling.low_freq_factor` = {low_freq_factor} must be below `rope_scaling.high_freq_factor` = {high_freq_factor}"
                    ));
                }
                if original_max_seq_len == 0 {
                    return Err("`rope_scaling.original_max_seq_len` must be positive".into());
                }
                Ok(())
            }
        }
    }
}

impl ModelConfig {
    /// Per-head dimension d (`head_dim`, else d_model / H), the same for all variants.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.heads)
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
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.heads) {
            return Err(format!(
                "`heads` = {} does not divide `d_model` = {} (or give `head_dim`)",
                self.heads, self.d_model
            ));
        }
        if self.head_dim == Some(0) {
            return Err("`head_dim` must be positive".into());
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
                "the head dimension (`head_dim`, else `d_model` / `heads`) = {} must be even for RoPE",
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
        if let Some(scaling) = &self.rope_scaling {
            scaling.validate()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_frequencies_divides_low_ones_and_blends_between() {
        // L = 8192, factor 8, low 1, high 4: wavelengths below 2048 are kept, above 8192 divided
        // by 8, and in between blended by s = (L/λ − 1)/3.
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_seq_len: 8192,
        };
        let tau = 2.0 * std::f64::consts::PI;
        let (high, low, mid) = (tau / 1000.0, tau / 10_000.0, tau / 4096.0);
        let got = scaling.apply(&[high, low, mid]);
        assert_eq!(got[0], high);
        assert!((got[1] - low / 8.0).abs() < 1e-15);
        // λ = 4096: s = (2 − 1)/3 = 1/3.
        let want = (2.0 / 3.0) * mid / 8.0 + (1.0 / 3.0) * mid;
        assert!((got[2] - want).abs() < 1e-15, "{} vs {want}", got[2]);
        let linear = RopeScaling::Linear { factor: 4.0 }.apply(&[1.0, 0.5]);
        assert_eq!(linear, vec![0.25, 0.125]);
    }

    #[test]
    fn bad_scaling_parameters_are_refused_by_name() {
        let llama3 = |low, high, old| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_seq_len: old,
        };
        for (scaling, named) in [
            (RopeScaling::Linear { factor: 0.0 }, "factor"),
            (llama3(4.0, 1.0, 8192), "low_freq_factor"),
            (llama3(1.0, 4.0, 0), "original_max_seq_len"),
            (llama3(1.0, f64::NAN, 8192), "high_freq_factor"),
        ] {
            let err = ModelConfig::new(AttentionKind::Transformer, 32, 1, 4, 10, 8)
                .with_rope_scaling(Some(scaling))
                .validate()
                .unwrap_err();
            assert!(err.contains(named), "{err}");
        }
    }
}
