//! `diffzoo eval quant`: robustness to low-bit attention (the paper's Fig. 8). Every attention
//! logit map is quantised after training, dynamically (scale = the map's largest |logit|, a
//! symmetric grid of `2^(b−1) − 1` steps each side of zero; see
//! [`diffzoo_models::attention::quantize_absmax`]), and the validation loss (and, with
//! `--needle`, retrieval accuracy) is measured at each bit width against full precision.

use super::needle::{GridArgs, measure_with};
use super::seeds::{self, Measurement, Metric};
use super::{Common, Loaded, Values, emit, list};
use crate::plot::{Chart, Series};
use anyhow::{Result, bail};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct QuantArgs {
    #[command(flatten)]
    pub common: Common,
    /// Bit widths of the attention logits.
    #[arg(long, default_value = "16,8,6,4", value_parser = list::<u32>)]
    pub bits: Values<u32>,
    /// Validation micro-batches per measurement.
    #[arg(long, default_value_t = 16)]
    pub max_batches: usize,
    /// Also measure multi-needle retrieval at each width (the grid options below).
    #[arg(long)]
    pub needle: bool,
    #[command(flatten)]
    pub grid: GridArgs,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Width {
    /// `None`: full precision.
    pub bits: Option<u32>,
    pub loss: f64,
    /// Change from full precision.
    pub delta: f64,
    /// Mean retrieval accuracy over the grid, when measured.
    pub needle: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Quantization {
    pub weights: String,
    pub attention: String,
    pub tokens: u64,
    pub widths: Vec<Width>,
}

impl Quantization {
    pub fn print(&self) {
        println!(
            "{}: attention logits quantised (dynamic absmax), validation loss over {} tokens",
            self.weights, self.tokens
        );
        for w in &self.widths {
            let name = w.bits.map_or("full".to_string(), |b| format!("{b} bits"));
            let needle = w
                .needle
                .map_or(String::new(), |a| format!(" | needle {a:.3}"));
            println!(
                "  {name:>8} | loss {:.4} | Δ {:+.4}{needle}",
                w.loss, w.delta
            );
        }
    }
}

pub fn measure(
    loaded: &Loaded,
    bits: &[u32],
    batches: usize,
    needle: Option<&GridArgs>,
) -> Result<Quantization> {
    if let Some(b) = bits.iter().find(|b| !(2..=24).contains(*b)) {
        bail!("--bits: {b} is outside 2..=24");
    }
    let windows = loaded.validation_windows()?;
    let grid = needle.map(|g| g.resolve(loaded)).transpose()?;
    let mut widths = Vec::new();
    let mut tokens = 0;
    let mut base = None;
    for b in std::iter::once(0).chain(bits.iter().copied()) {
        let model = loaded.model.clone().with_logit_bits(b);
        let (loss, t, _) = loaded.validation_loss(&model, &windows, Some(batches))?;
        tokens = t;
        let base_loss = *base.get_or_insert(loss);
        let accuracy = match &grid {
            Some(g) => Some(measure_with(loaded, &model, g)?.mean(|_| true)),
            None => None,
        };
        widths.push(Width {
            bits: (b > 0).then_some(b),
            loss,
            delta: loss - base_loss,
            needle: accuracy,
        });
    }
    Ok(Quantization {
        weights: loaded.weights.to_string(),
        attention: loaded.recipe.model.attention.to_string(),
        tokens,
        widths,
    })
}

/// Loss change by bit width, one line per run.
pub fn chart(results: &[(&str, &Quantization)]) -> Chart {
    let mut chart = Chart::new(
        "Validation loss change with quantised attention logits",
        "bits",
        "Δ validation loss",
        false,
    );
    for (i, (name, q)) in results.iter().enumerate() {
        let points: Vec<(f64, f64)> = q
            .widths
            .iter()
            .filter_map(|w| w.bits.map(|b| (b as f64, w.delta)))
            .collect();
        let color = crate::plot::color(&q.attention, i);
        chart.series.push(Series {
            color,
            ..Series::line(name, i, points.clone())
        });
        chart.series.push(Series {
            legend: false,
            color,
            ..Series::points(name, i, points)
        });
    }
    chart
}

impl Measurement for Quantization {
    fn metrics(&self) -> Vec<Metric> {
        let mut metrics = Vec::new();
        for w in &self.widths {
            let bits = w.bits.map_or(Value::from("full"), Value::from);
            metrics.push(Metric::new("loss", w.loss).at("bits", bits.clone()));
            metrics.push(Metric::new("delta", w.delta).at("bits", bits.clone()));
            if let Some(needle) = w.needle {
                metrics.push(Metric::new("needle", needle).at("bits", bits));
            }
        }
        metrics
    }
}

pub fn run(args: &QuantArgs) -> Result<()> {
    let each = |dir: &Path| {
        measure(
            &Loaded::open(dir, &args.common.device, args.common.dtype)?,
            &args.bits,
            args.max_batches,
            args.needle.then_some(&args.grid),
        )
    };
    if seeds::over_seeds(&args.common, "quant", args.plot.as_ref(), each)? {
        return Ok(());
    }
    let result = each(&args.common.run)?;
    if let Some(path) = &args.plot {
        crate::plot::write(path, &chart(&[(&result.attention, &result)]).svg())?;
    }
    emit(args.common.json, &result, Quantization::print)
}
