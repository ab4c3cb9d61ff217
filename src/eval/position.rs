//! `diffzoo eval nll-position`: the paper's Fig. 4 — the cumulative average negative
//! log-likelihood of held-out tokens by position in the context, `C(t) = (1/t)·Σ_{i≤t} NLL(i)`,
//! each `NLL(i)` averaged over validation windows of the run's context length. A model that uses
//! long context well keeps lowering `C(t)` as `t` grows.

use super::seeds::{self, Measurement, Metric};
use super::{Common, Loaded, emit, token_nll};
use crate::plot::{self, Chart, Series};
use anyhow::Result;
use burn::data::dataloader::batcher::Batcher;
use diffzoo_datasets::LmBatcher;
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct PositionArgs {
    #[command(flatten)]
    pub common: Common,
    /// Validation windows averaged (default: all of them).
    #[arg(long)]
    pub windows: Option<u64>,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NllByPosition {
    pub weights: String,
    pub attention: String,
    pub windows: u64,
    /// Mean NLL at each position (0-based) of the context.
    pub nll: Vec<f64>,
    /// The cumulative average up to and including each position.
    pub cumulative: Vec<f64>,
}

/// `C(t) = mean(nll[..=t])`.
pub fn cumulative(nll: &[f64]) -> Vec<f64> {
    let mut sum = 0.0;
    nll.iter()
        .enumerate()
        .map(|(i, v)| {
            sum += v;
            sum / (i + 1) as f64
        })
        .collect()
}

pub fn measure(loaded: &Loaded, limit: Option<u64>) -> Result<NllByPosition> {
    let windows = loaded.validation_windows()?;
    let count = limit.map_or(windows.len(), |l| l.clamp(1, windows.len()));
    let micro = loaded.recipe.training.micro_batch as u64;
    let seq = windows.seq_len();
    let mut sum = vec![0.0f64; seq];
    let mut first = 0;
    while first < count {
        let items: Vec<Vec<u32>> = (first..(first + micro).min(count))
            .map(|i| windows.window(i))
            .collect();
        first += items.len() as u64;
        let batch = LmBatcher.batch(items, &loaded.device);
        let nll = token_nll(&loaded.model, batch.inputs, batch.targets)
            .sum_dim(0)
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        for (s, v) in sum.iter_mut().zip(nll) {
            *s += v as f64;
        }
    }
    let nll: Vec<f64> = sum.iter().map(|s| s / count as f64).collect();
    Ok(NllByPosition {
        weights: loaded.weights.to_string(),
        attention: loaded.recipe.model.attention.to_string(),
        windows: count,
        cumulative: cumulative(&nll),
        nll,
    })
}

/// The cumulative curves of one or more runs over a log position axis.
pub fn chart(results: &[(&str, &NllByPosition)]) -> Chart {
    let mut chart = Chart::new(
        "Cumulative average NLL by position (held-out text)",
        "position in context",
        "cumulative average NLL",
        true,
    );
    for (i, (name, r)) in results.iter().enumerate() {
        let points = r
            .cumulative
            .iter()
            .enumerate()
            .map(|(t, &c)| ((t + 1) as f64, c))
            .collect();
        chart.series.push(Series {
            color: plot::color(&r.attention, i),
            ..Series::line(name, i, points)
        });
    }
    chart
}

/// Positions 1, 2, 4, … and the last one.
pub fn report_positions(len: usize) -> Vec<usize> {
    let mut at: Vec<usize> = std::iter::successors(Some(1usize), |p| Some(p * 2))
        .take_while(|&p| p < len)
        .collect();
    at.push(len);
    at
}

/// The NLL and its cumulative average at each position (counted from 1); the text lists the
/// cumulative average at [`report_positions`].
impl Measurement for NllByPosition {
    fn metrics(&self) -> Vec<Metric> {
        let listed = report_positions(self.cumulative.len());
        let mut metrics: Vec<Metric> = (1..=self.nll.len())
            .map(|t| {
                Metric::new("nll", self.nll[t - 1])
                    .at("position", t)
                    .unlisted()
            })
            .collect();
        metrics.extend((1..=self.cumulative.len()).map(|t| {
            let m = Metric::new("cumulative", self.cumulative[t - 1]).at("position", t);
            if listed.contains(&t) { m } else { m.unlisted() }
        }));
        metrics
    }
}

pub fn run(args: &PositionArgs) -> Result<()> {
    let each = |dir: &Path| {
        measure(
            &Loaded::open(dir, &args.common.device, args.common.dtype)?,
            args.windows,
        )
    };
    if seeds::over_seeds(&args.common, "nll-position", args.plot.as_ref(), each)? {
        return Ok(());
    }
    let result = each(&args.common.run)?;
    if let Some(path) = &args.plot {
        plot::write(path, &chart(&[(&result.attention, &result)]).svg())?;
    }
    emit(args.common.json, &result, |r| {
        println!(
            "{}: cumulative average NLL by position over {} validation windows",
            r.weights, r.windows
        );
        for t in report_positions(r.cumulative.len()) {
            println!("  position {t:>6}: {:.4}", r.cumulative[t - 1]);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cumulative_average_and_reported_positions() {
        assert_eq!(cumulative(&[4.0, 2.0, 0.0, 2.0]), vec![4.0, 3.0, 2.0, 2.0]);
        assert_eq!(report_positions(100), vec![1, 2, 4, 8, 16, 32, 64, 100]);
        assert_eq!(report_positions(64), vec![1, 2, 4, 8, 16, 32, 64]);
    }
}
