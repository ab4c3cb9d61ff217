//! Statistics of the analysis path ([`Model::forward_probe`](crate::Model::forward_probe)):
//! the magnitudes the paper's Table 5 reports (top-k and median of |attention logits| and of
//! |hidden states|) and each layer's λ, and how attention is allocated between an answer span
//! and the rest of the context (Table 3).

use crate::model::ModelProbe;
use burn::tensor::Tensor;
use std::ops::Range;

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

/// Order statistics of |x| accumulated over many tensors in bounded memory: the exact `k`
/// largest, and the median read from a histogram of 1000 log-spaced bins per decade over
/// [1e-12, 1e12) (relative error below 0.12%; smaller magnitudes count as zero).
#[derive(Debug, Clone)]
pub struct AbsAccumulator {
    k: usize,
    /// Candidates for the k largest (unsorted between compactions).
    top: Vec<f32>,
    /// The k-th largest value at the last compaction: nothing at or below it can enter.
    floor: f32,
    bins: Vec<u64>,
    zeros: u64,
    count: u64,
}

const BINS_PER_DECADE: f64 = 1000.0;
const LOWEST_DECADE: f64 = -12.0;
const DECADES: usize = 24;

impl AbsAccumulator {
    pub fn new(k: usize) -> Self {
        Self {
            k,
            top: Vec::new(),
            floor: -1.0,
            bins: vec![0; DECADES * BINS_PER_DECADE as usize],
            zeros: 0,
            count: 0,
        }
    }

    /// Adds the finite entries of `x`.
    pub fn add<const D: usize>(&mut self, x: Tensor<D>) {
        let values = x
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 data");
        self.add_values(&values);
    }

    pub fn add_values(&mut self, values: &[f32]) {
        let last = self.bins.len() - 1;
        for v in values.iter().filter(|v| v.is_finite()).map(|v| v.abs()) {
            self.count += 1;
            let bin = ((v as f64).log10() - LOWEST_DECADE) * BINS_PER_DECADE;
            if bin < 0.0 {
                self.zeros += 1;
            } else {
                self.bins[(bin as usize).min(last)] += 1;
            }
            if v > self.floor {
                self.top.push(v);
                if self.top.len() >= 4 * self.k.max(1) {
                    self.compact();
                }
            }
        }
        self.compact();
    }

    fn compact(&mut self) {
        self.top.sort_unstable_by(|a, b| b.total_cmp(a));
        self.top.truncate(self.k);
        if self.k > 0 && self.top.len() == self.k {
            self.floor = self.top[self.k - 1];
        }
    }

    pub fn finish(&self) -> AbsStats {
        let mid = self.count / 2;
        let median = if self.count == 0 {
            f32::NAN
        } else if mid < self.zeros {
            0.0
        } else {
            let mut seen = self.zeros;
            let bin = self
                .bins
                .iter()
                .position(|&n| {
                    seen += n;
                    seen > mid
                })
                .unwrap_or(self.bins.len() - 1);
            10f64.powf((bin as f64 + 0.5) / BINS_PER_DECADE + LOWEST_DECADE) as f32
        };
        AbsStats {
            count: self.count as usize,
            top: self.top.clone(),
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

/// Attention mass of one query row, averaged over the heads of a map: on the answer span and on
/// the rest of the context ("noise").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allocation {
    pub answer: f64,
    pub noise: f64,
}

/// The allocation of query position `row` in `maps` (`[1, heads, S, S]`, e.g. a probe's
/// `effective` map: `A₁ − λA₂` for DIFF), with `answer` the answer's key positions and
/// `context` the key positions that count as context (the answer span inside it; positions
/// outside, such as the question itself, count as neither).
pub fn allocation(
    maps: Tensor<4>,
    row: usize,
    answer: Range<usize>,
    context: Range<usize>,
) -> Allocation {
    let [b, heads, _, s] = maps.dims();
    assert_eq!(b, 1, "allocation reads one sequence");
    assert!(
        answer.start >= context.start && answer.end <= context.end && context.end <= s,
        "answer span {answer:?} must lie in the context {context:?} of {s} positions"
    );
    let values = maps
        .narrow(2, row, 1)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data");
    let (mut on_answer, mut on_context) = (0.0, 0.0);
    for head in values.chunks_exact(s) {
        on_answer += head[answer.clone()].iter().map(|&v| v as f64).sum::<f64>();
        on_context += head[context.clone()].iter().map(|&v| v as f64).sum::<f64>();
    }
    Allocation {
        answer: on_answer / heads as f64,
        noise: (on_context - on_answer) / heads as f64,
    }
}
