//! The decoder-only language model, shared by every variant:
//!
//! ```text
//! h₀ = Embed(tokens)
//! h = x + Attn(RMSNorm(x));  x' = h + SwiGLU(RMSNorm(h))      (each of the L blocks)
//! logits = RMSNorm(h_L)·W_head                                 (W_head = Embedᵀ when tied)
//! ```
//!
//! No dropout and no biases (but on q, k and v with `qkv_bias`, as Qwen2 has); RoPE (adjacent
//! pairs, GPT-J layout, frequencies rescaled by `rope_scaling`) on every query and key head.

use crate::attention::{Attention, AttentionProbe, projection};
use crate::cache::{KvCache, LayerCache, assert_room};
use crate::config::{AttentionImpl, ModelConfig};
use crate::feed_forward::SwiGlu;
use crate::fused::rms_norm;
use crate::precision::{compute_copy, weight_matrices_in};
use crate::profile::{self, Class};
use crate::rows;
use burn::module::Module;
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, Linear, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::{DType, Device, FloatDType, Int, Tensor};

/// One pre-norm decoder block.
#[derive(Module, Debug)]
pub struct Block {
    pub attn_norm: RmsNorm,
    pub attn: Attention,
    pub ffn_norm: RmsNorm,
    pub ffn: SwiGlu,
}

impl Block {
    fn new(config: &ModelConfig, depth: usize, device: &Device) -> Self {
        let norm = || {
            RmsNormConfig::new(config.d_model)
                .with_epsilon(config.norm_eps)
                .init(device)
        };
        Self {
            attn_norm: norm(),
            attn: Attention::new(config, depth, device),
            ffn_norm: norm(),
            ffn: SwiGlu::new(config, device),
        }
    }

    pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
        self.run(x, rope, None)
    }

    /// [`Block::forward`] for the next positions after those in `cache`.
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: &mut LayerCache,
    ) -> Tensor<3> {
        self.run(x, rope, Some(cache))
    }

    fn run(
        &self,
        x: Tensor<3>,
        rope: &RotaryEncoding,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let h = x.clone() + self.attn.run(rms_norm(&self.attn_norm, x), rope, cache);
        h.clone() + self.ffn.forward(rms_norm(&self.ffn_norm, h))
    }

    fn forward_probe(&self, x: Tensor<3>, rope: &RotaryEncoding) -> (Tensor<3>, AttentionProbe) {
        let (a, probe) = self
            .attn
            .forward_probe(rms_norm(&self.attn_norm, x.clone()), rope);
        let h = x + a;
        (
            h.clone() + self.ffn.forward(rms_norm(&self.ffn_norm, h)),
            probe,
        )
    }
}

/// The language model.
#[derive(Module, Debug)]
pub struct Model {
    pub embed: Embedding,
    pub blocks: Vec<Block>,
    pub norm: RmsNorm,
    /// `None` when the embedding is tied to the head.
    pub lm_head: Option<Linear>,
    pub rope: RotaryEncoding,
}

/// What the analysis path records of one block.
#[derive(Debug, Clone)]
pub struct LayerProbe {
    pub attention: AttentionProbe,
    /// The block's output hidden state, `[B, S, d_model]`.
    pub hidden: Tensor<3>,
}

/// Logits and per-layer probes of one forward pass.
#[derive(Debug, Clone)]
pub struct ModelProbe {
    pub logits: Tensor<3>,
    pub layers: Vec<LayerProbe>,
}

impl ModelConfig {
    /// Builds the model. Panics on an invalid configuration; call [`ModelConfig::validate`]
    /// first to get the reason as an error.
    pub fn init(&self, device: &Device) -> Model {
        if let Err(reason) = self.validate() {
            panic!("invalid model configuration: {reason}");
        }
        let embed = EmbeddingConfig::new(self.vocab_size, self.d_model)
            .with_initializer(Initializer::Normal {
                mean: 0.0,
                std: self.embedding_std,
            })
            .init(device);
        Model {
            embed,
            blocks: (0..self.layers)
                .map(|depth| Block::new(self, depth, device))
                .collect(),
            norm: RmsNormConfig::new(self.d_model)
                .with_epsilon(self.norm_eps)
                .init(device),
            lm_head: (!self.tie_embeddings)
                .then(|| projection(self, self.d_model, self.vocab_size, device)),
            rope: self.rope(device),
        }
    }

    /// RoPE's cos/sin tables for every position, from θ and [`ModelConfig::rope_scaling`].
    fn rope(&self, device: &Device) -> RotaryEncoding {
        let config = RotaryEncodingConfig::new(self.max_seq_len, self.head_dim())
            .with_theta(self.rope_theta);
        let Some(scaling) = self.rope_scaling else {
            return config.init(device);
        };
        config.init_with_frequency_scaling(
            |inv_freq| {
                let device = inv_freq.device();
                let values: Vec<f64> = inv_freq
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .expect("RoPE frequencies as f32")
                    .into_iter()
                    .map(f64::from)
                    .collect();
                let scaled: Vec<f32> = scaling
                    .apply(&values)
                    .into_iter()
                    .map(|f| f as f32)
                    .collect();
                Tensor::from_floats(scaled.as_slice(), &device)
            },
            device,
        )
    }
}

impl Model {
    /// `tokens`: `[B, S]` → logits `[B, S, vocab]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let h = self.blocks.iter().fold(self.embedded(tokens), |h, block| {
            block.forward(h, &self.rope)
        });
        self.head(h)
    }

    /// An empty KV cache for incremental decoding of up to `max_seq_len` positions.
    pub fn cache(&self) -> KvCache {
        KvCache::new(self.blocks.len(), self.rope.freq_complex.dims()[0])
    }

    /// Whether every layer's decoding step reads its KV cache in place
    /// ([`Attention::reads_cache_in_place`]), so that a cache kept narrower pays
    /// ([`KvCache::in_dtype`]).
    pub fn reads_cache_in_place(&self) -> bool {
        self.blocks.iter().all(|b| b.attn.reads_cache_in_place())
    }

    /// The logits of the next positions `tokens` `[B, S]` of sequences whose earlier positions
    /// are in `cache` (empty: a prompt's prefill), which then holds these too. Equal to the
    /// matching rows of [`Model::forward`] over the whole sequences (not with quantised logits,
    /// [`Model::with_logit_bits`], whose scale is per map: a step sees only its own rows).
    ///
    /// # Panics
    /// If the sequences would outgrow `cache.capacity()` (`max_seq_len`); callers check first.
    pub fn forward_cached(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        self.head(self.hidden_cached(tokens, cache))
    }

    /// [`Model::forward_cached`]'s logits at the last position only, `[B, 1, vocab]`: what a
    /// prefill needs to pick or score the next token, without the head's product over every
    /// other position of the prompt (a fifth of a 135M model's prefill).
    pub fn forward_cached_last(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        let h = self.hidden_cached(tokens, cache);
        let s = h.dims()[1];
        self.head(h.narrow(1, s - 1, 1))
    }

    /// The last block's output for `tokens` after `cache`, which then holds them too.
    fn hidden_cached(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        assert_room(cache.len(), tokens.dims()[1], cache.capacity());
        self.blocks
            .iter()
            .zip(&mut cache.layers)
            .fold(self.embedded(tokens), |h, (block, layer)| {
                block.forward_cached(h, &self.rope, layer)
            })
    }

    /// The forward pass with every layer's attention maps, λ and hidden state recorded.
    pub fn forward_probe(&self, tokens: Tensor<2, Int>) -> ModelProbe {
        let mut h = self.embedded(tokens);
        let mut layers = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let (next, attention) = block.forward_probe(h, &self.rope);
            layers.push(LayerProbe {
                attention,
                hidden: next.clone(),
            });
            h = next;
        }
        ModelProbe {
            logits: self.head(h),
            layers,
        }
    }

    /// The model with every layer's attention logits quantised to `bits` bits (0: none), the
    /// paper's Fig. 8 analysis.
    pub fn with_logit_bits(mut self, bits: u32) -> Self {
        for block in &mut self.blocks {
            block.attn.set_logit_bits(bits);
        }
        self
    }

    /// The same weights with every layer's attention computed by `implementation` (a loaded
    /// checkpoint keeps no implementation: this picks one for the run at hand).
    pub fn with_attention_impl(mut self, implementation: AttentionImpl) -> Self {
        for block in &mut self.blocks {
            block.attn.set_implementation(implementation);
        }
        self
    }

    /// The same weights with every layer's λ scaled by `scale` (DIFF V1's λ, V2's λ_{t,h}; 1:
    /// the paper's model): the state of a warm-up of the negative map at one step.
    pub fn with_lambda_scale(mut self, scale: f64) -> Self {
        for block in &mut self.blocks {
            block.attn.set_lambda_scale(scale);
        }
        self
    }

    /// DIFF V1's λ of every layer (input-independent); empty for the other variants.
    pub fn lambdas(&self) -> Vec<f32> {
        self.blocks.iter().filter_map(|b| b.attn.lambda()).collect()
    }

    /// The same model with its weight matrices stored in `dtype` (inference weights, e.g. bf16:
    /// [`weight_matrices_in`]), computing in the dtype it computed in before.
    pub fn with_weight_dtype(self, dtype: FloatDType) -> Self {
        weight_matrices_in(self, dtype)
    }

    /// The dtype the model computes in: its final norm's (weight matrices may be stored in
    /// another, [`Model::with_weight_dtype`]).
    pub fn dtype(&self) -> DType {
        self.norm.gamma.val().dtype()
    }

    /// `Embed(tokens)` in the dtype the model computes in ([`Model::dtype`]): an embedding stored
    /// in another is widened here.
    fn embedded(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let dtype = self.dtype();
        profile::time(Class::Embedding, || self.embed.forward(tokens).cast(dtype))
    }

    fn head(&self, h: Tensor<3>) -> Tensor<3> {
        self.head_in(h, None)
    }

    /// The final norm and the head, computing in `compute` from copies of their weights
    /// ([`crate::precision`]; `None`: their own).
    pub(crate) fn head_in(&self, h: Tensor<3>, compute: Option<FloatDType>) -> Tensor<3> {
        let h = rms_norm(&compute_copy(&self.norm, compute), h);
        match &self.lm_head {
            Some(head) => rows::linear(&compute_copy(head, compute), h),
            None => {
                // Rows times the embedding's transpose as one 2-D product: Flex reads the
                // transposed view in place, where a 3-D view of it is first copied (vocab × d).
                let [b, s, d] = h.dims();
                let weight = compute_copy(&self.embed, compute).weight.val();
                let vocab = weight.dims()[0];
                rows::matmul(h.reshape([b * s, d]), weight.transpose()).reshape([b, s, vocab])
            }
        }
    }
}

/// `log p(targets[b][t])` under `logits` `[B, S, vocab]` (the log-softmax in f32): `[B, S]`.
pub fn target_log_probs(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<2> {
    let [b, s, _] = logits.dims();
    burn::tensor::activation::log_softmax(logits.cast(burn::tensor::DType::F32), 2)
        .gather(2, targets.unsqueeze_dim::<3>(2))
        .reshape([b, s])
}
