//! SwiGLU feed-forward, shared by every variant: `FFN(x) = W₂(silu(W_g·x) ⊙ W₁·x)`.

use crate::attention::projection;
use crate::config::ModelConfig;
use crate::fused;
use crate::rows;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor};

#[derive(Module, Debug)]
pub struct SwiGlu {
    /// W_g: d_model → ffn (gate).
    pub w_g: Linear,
    /// W₁: d_model → ffn.
    pub w1: Linear,
    /// W₂: ffn → d_model.
    pub w2: Linear,
}

impl SwiGlu {
    pub fn new(config: &ModelConfig, device: &Device) -> Self {
        let (d_model, hidden) = (config.d_model, config.ffn_hidden());
        Self {
            w_g: projection(config, d_model, hidden, device),
            w1: projection(config, d_model, hidden, device),
            w2: projection(config, hidden, d_model, device),
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let gate = rows::linear(&self.w_g, x.clone());
        rows::linear(&self.w2, fused::swiglu(gate, rows::linear(&self.w1, x)))
    }
}
