//! Statistics of the analysis path ([`Model::forward_probe`](crate::Model::forward_probe)):
//! the magnitudes the paper's Table 5 reports (top-k and median of |attention logits| and of
//! |hidden states|) and each layer's λ.

use crate::model::ModelProbe;
use burn::tensor::Tensor;

/// Order statistics of |x| over the finite entries of a tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct AbsStats {
    /// Finite entries counted (masked attention logits, −inf, are not).
    pub count: usize,
    /// The largest |x|, in decreasing order (at most k).
    pub top: Vec<f32>,
    pub median: f32,
}

impl AbsStats {
    pub fn of<const D: usize>(x: Tensor<D>, k: usize) -> Self {
        let values = x
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 data");
        Self::of_values(values, k)
    }

    pub fn of_values(values: Vec<f32>, k: usize) -> Self {
        let mut abs: Vec<f32> = values
            .into_iter()
            .filter(|v| v.is_finite())
            .map(f32::abs)
            .collect();
        let count = abs.len();
        if count == 0 {
            return Self {
                count,
                top: Vec::new(),
                median: f32::NAN,
            };
        }
        let mid = count / 2;
        let (_, median, _) = abs.select_nth_unstable_by(mid, f32::total_cmp);
        let median = *median;
        abs.sort_unstable_by(|a, b| b.total_cmp(a));
        abs.truncate(k);
        Self {
            count,
            top: abs,
            median,
        }
    }
}

/// One layer's statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStats {
    pub logits: AbsStats,
    pub hidden: AbsStats,
    /// DIFF V1: the layer's λ; DIFF V2: the mean of λ_{t,h} over tokens and heads.
    pub lambda_mean: Option<f32>,
}

impl ModelProbe {
    /// Per-layer statistics with the `k` largest magnitudes.
    pub fn stats(&self, k: usize) -> Vec<LayerStats> {
        self.layers
            .iter()
            .map(|layer| LayerStats {
                logits: AbsStats::of(layer.attention.logits.clone(), k),
                hidden: AbsStats::of(layer.hidden.clone(), k),
                lambda_mean: layer
                    .attention
                    .lambda
                    .as_ref()
                    .map(|l| l.clone().mean().into_scalar::<f32>()),
            })
            .collect()
    }
}
