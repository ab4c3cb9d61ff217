//! Parameter counts, training FLOPs and KV-cache size, computed from the configuration alone
//! (no tensors), so that planners can size models that would not fit in memory.

use crate::config::{AttentionKind, ModelConfig};

/// Parameter counts in the conventions papers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCount {
    /// Every trainable parameter (the token embedding and, when untied, the LM head included).
    pub total: u64,
    /// Total minus the token embedding and the LM head (Kaplan et al.'s N).
    pub non_embedding: u64,
    /// The DIFF paper's convention: non-embedding plus one vocab × d_model table.
    pub paper: u64,
    /// Per-block attention parameters (projections and their biases, λ vectors, subln).
    pub attention_per_layer: u64,
}

/// Matmul FLOPs per token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlopsPerToken {
    /// Forward pass: 2 per weight of every linear layer (LM head included) plus the attention
    /// score and value products over the whole context (PaLM's convention: no causal halving).
    pub forward: f64,
    /// Forward and backward: 3 × forward, i.e. 6·N plus the attention term.
    pub training: f64,
}

/// Widths (summed over heads) that attention spends per token.
struct AttentionWidths {
    /// Summed width of all query maps: the QKᵀ work is 2·S·qk per token.
    qk: u64,
    /// Summed width of the values the maps are applied to: the AV work is 2·S·av per token.
    av: u64,
    /// Cached key and value width per token.
    kv: u64,
}

impl ModelConfig {
    fn attention_widths(&self) -> AttentionWidths {
        let (h, h_kv, d) = (
            self.heads as u64,
            self.kv_heads() as u64,
            self.head_dim() as u64,
        );
        match self.attention {
            // H heads of width d.
            AttentionKind::Transformer => AttentionWidths {
                qk: h * d,
                av: h * d,
                kv: 2 * h_kv * d,
            },
            // 2H' = H half-head maps of width d, combined into H' maps over values of width 2d.
            AttentionKind::Diff => AttentionWidths {
                qk: h * d,
                av: (h / 2) * 2 * d,
                kv: 2 * h_kv * d,
            },
            // 2H query heads of width d, each applied to its values.
            AttentionKind::DiffV2 => AttentionWidths {
                qk: 2 * h * d,
                av: 2 * h * d,
                kv: 2 * h_kv * d,
            },
        }
    }

    /// Parameters of one block's attention.
    fn attention_params(&self) -> u64 {
        let (dm, h, h_kv, d) = (
            self.d_model as u64,
            self.heads as u64,
            self.kv_heads() as u64,
            self.head_dim() as u64,
        );
        let baseline = dm * h * d + 2 * dm * h_kv * d + h * d * dm;
        let params = match self.attention {
            AttentionKind::Transformer => baseline,
            // Same projections; four λ vectors of size d and subln's weight of size 2d.
            AttentionKind::Diff => baseline + 6 * d,
            // Another H query heads and W_λ.
            AttentionKind::DiffV2 => baseline + dm * h * d + dm * h,
        };
        params + self.qkv_bias_params()
    }

    /// One bias per query, key and value output (`qkv_bias`), else none.
    fn qkv_bias_params(&self) -> u64 {
        if !self.qkv_bias {
            return 0;
        }
        let (h, h_kv, d) = (
            self.heads as u64,
            self.kv_heads() as u64,
            self.head_dim() as u64,
        );
        let query_heads = match self.attention {
            AttentionKind::DiffV2 => 2 * h,
            _ => h,
        };
        (query_heads + 2 * h_kv) * d
    }

    /// Parameter counts of this configuration.
    pub fn param_count(&self) -> ParamCount {
        let (dm, vocab, ffn) = (
            self.d_model as u64,
            self.vocab_size as u64,
            self.ffn_hidden() as u64,
        );
        let attention = self.attention_params();
        let per_layer = 2 * dm + attention + 3 * dm * ffn;
        let non_embedding = self.layers as u64 * per_layer + dm;
        let tables = if self.tie_embeddings { 1 } else { 2 };
        ParamCount {
            total: non_embedding + tables * vocab * dm,
            non_embedding,
            paper: non_embedding + vocab * dm,
            attention_per_layer: attention,
        }
    }

    /// Matmul FLOPs per token at context length `seq_len`.
    pub fn flops_per_token(&self, seq_len: usize) -> FlopsPerToken {
        let (dm, ffn) = (self.d_model as f64, self.ffn_hidden() as f64);
        let widths = self.attention_widths();
        // λ vectors, subln and biases are not matmul weights; W_λ is.
        let attention_weights = match self.attention {
            AttentionKind::Diff => self.attention_params() - 6 * self.head_dim() as u64,
            _ => self.attention_params(),
        } - self.qkv_bias_params();
        let attention_weights = attention_weights as f64;
        let linear_per_layer = attention_weights + 3.0 * dm * ffn;
        let linear = self.layers as f64 * linear_per_layer + dm * self.vocab_size as f64;
        let attention = self.layers as f64 * 2.0 * seq_len as f64 * (widths.qk + widths.av) as f64;
        let forward = 2.0 * linear + attention;
        FlopsPerToken {
            forward,
            training: 3.0 * forward,
        }
    }

    /// Bytes of KV cache per token for elements of `bytes_per_element` bytes.
    pub fn kv_cache_bytes_per_token(&self, bytes_per_element: usize) -> u64 {
        self.layers as u64 * self.attention_widths().kv * bytes_per_element as u64
    }
}
