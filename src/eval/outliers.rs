//! `diffzoo eval outliers`: activation outliers (the paper's Table 5) — the largest and the
//! median magnitudes of the attention logits (`QKᵀ/√d`, causal entries of every softmax map) and
//! of the hidden states (every block's output) over a budget of held-out tokens. DIFF's claim:
//! lower top values, so fewer outliers to survive low-bit quantization.

use super::seeds::{self, Measurement, Metric};
use super::{Common, Loaded, emit};
use anyhow::Result;
use burn::data::dataloader::batcher::Batcher;
use diffzoo_datasets::LmBatcher;
use diffzoo_models::AbsAccumulator;
use serde::Serialize;
use std::path::Path;

/// The ranks Table 5 reports.
pub const RANKS: [usize; 5] = [1, 2, 3, 10, 100];

#[derive(Debug, Clone, clap::Args)]
pub struct OutlierArgs {
    #[command(flatten)]
    pub common: Common,
    /// Held-out tokens to look at (whole windows of the run's sequence length).
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Magnitudes {
    /// `(rank, value)` for each of [`RANKS`] that exists.
    pub top: Vec<(usize, f32)>,
    pub median: f32,
    pub count: usize,
}

impl Magnitudes {
    fn of(acc: &AbsAccumulator) -> Self {
        let stats = acc.finish();
        Self {
            top: RANKS
                .iter()
                .filter_map(|&r| stats.top.get(r - 1).map(|&v| (r, v)))
                .collect(),
            median: stats.median,
            count: stats.count,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Outliers {
    pub weights: String,
    pub attention: String,
    pub tokens: usize,
    pub attention_logits: Magnitudes,
    pub hidden_states: Magnitudes,
    /// The largest |attention logit| of each layer.
    pub layer_top_logit: Vec<f32>,
    /// The largest |hidden state| of each layer's output.
    pub layer_top_hidden: Vec<f32>,
}

impl Outliers {
    pub fn print(&self) {
        println!(
            "{}: magnitudes over {} held-out tokens",
            self.weights, self.tokens
        );
        let header: Vec<String> = RANKS.iter().map(|r| format!("top-{r}")).collect();
        println!(
            "  {:<18} {} {:>9}",
            "",
            header.iter().map(|h| format!("{h:>9}")).collect::<String>(),
            "median"
        );
        for (name, m) in [
            ("attention logits", &self.attention_logits),
            ("hidden states", &self.hidden_states),
        ] {
            let values: String = m.top.iter().map(|(_, v)| format!("{v:>9.3}")).collect();
            println!("  {name:<18} {values} {:>9.4}", m.median);
        }
        let layers: Vec<String> = self
            .layer_top_logit
            .iter()
            .map(|v| format!("{v:.2}"))
            .collect();
        println!("  top |logit| by layer: {}", layers.join(" "));
    }
}

pub fn measure(loaded: &Loaded, budget: usize) -> Result<Outliers> {
    let windows = loaded.validation_windows()?;
    let seq = windows.seq_len();
    let count = budget.div_ceil(seq).clamp(1, windows.len() as usize) as u64;
    let k = *RANKS.last().unwrap();
    let (mut logits, mut hidden) = (AbsAccumulator::new(k), AbsAccumulator::new(k));
    let layers = loaded.recipe.model.layers;
    let mut layer_logit = vec![AbsAccumulator::new(1); layers];
    let mut layer_hidden = vec![AbsAccumulator::new(1); layers];
    // One window at a time: the probe holds every layer's S×S maps.
    for i in 0..count {
        let batch = LmBatcher.batch(vec![windows.window(i)], &loaded.device);
        let probe = loaded.model.forward_probe(batch.inputs);
        for (l, layer) in probe.layers.into_iter().enumerate() {
            let values = |t: burn::tensor::Tensor<4>| {
                t.into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|e| anyhow::anyhow!("{e:?}"))
            };
            let l_values = values(layer.attention.logits)?;
            logits.add_values(&l_values);
            layer_logit[l].add_values(&l_values);
            let h_values = values(layer.hidden.unsqueeze())?;
            hidden.add_values(&h_values);
            layer_hidden[l].add_values(&h_values);
        }
    }
    let top1 = |accs: &[AbsAccumulator]| {
        accs.iter()
            .map(|a| a.finish().top.first().copied().unwrap_or(f32::NAN))
            .collect()
    };
    Ok(Outliers {
        weights: loaded.weights.to_string(),
        attention: loaded.recipe.model.attention.to_string(),
        tokens: count as usize * seq,
        attention_logits: Magnitudes::of(&logits),
        hidden_states: Magnitudes::of(&hidden),
        layer_top_logit: top1(&layer_logit),
        layer_top_hidden: top1(&layer_hidden),
    })
}

impl Measurement for Outliers {
    fn metrics(&self) -> Vec<Metric> {
        let mut metrics = Vec::new();
        for (name, median, m) in [
            (
                "attention_logits",
                "attention_logits_median",
                &self.attention_logits,
            ),
            ("hidden_states", "hidden_states_median", &self.hidden_states),
        ] {
            for &(rank, value) in &m.top {
                metrics.push(Metric::new(name, f64::from(value)).at("top", rank));
            }
            metrics.push(Metric::new(median, f64::from(m.median)));
        }
        for (name, layers) in [
            ("layer_top_logit", &self.layer_top_logit),
            ("layer_top_hidden", &self.layer_top_hidden),
        ] {
            for (layer, &value) in layers.iter().enumerate() {
                metrics.push(Metric::new(name, f64::from(value)).at("layer", layer));
            }
        }
        metrics
    }
}

pub fn run(args: &OutlierArgs) -> Result<()> {
    let each = |dir: &Path| {
        measure(
            &Loaded::open(dir, &args.common.device, args.common.dtype)?,
            args.tokens,
        )
    };
    if seeds::over_seeds(&args.common, "outliers", None, each)? {
        return Ok(());
    }
    emit(args.common.json, &each(&args.common.run)?, Outliers::print)
}
