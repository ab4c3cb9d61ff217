//! `diffzoo eval lambda`: how each layer's λ moved during training, read from every checkpoint
//! the run kept and its final model. DIFF V1's λ is one number per layer; DIFF V2's λ_{t,h} depends
//! on the token, so its mean and standard deviation over the heads and tokens of the first
//! validation window are reported. The baseline has no λ.

use super::seeds::{self, Measurement, Metric};
use super::{Common, Loaded, emit};
use crate::layout;
use crate::plot::{Chart, Series};
use crate::run;
use crate::train::checkpoint;
use anyhow::{Result, bail};
use burn::data::dataloader::batcher::Batcher;
use diffzoo_datasets::LmBatcher;
use diffzoo_models::{AttentionKind, Model};
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct LambdaArgs {
    #[command(flatten)]
    pub common: Common,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LambdaAt {
    pub step: usize,
    pub weights: String,
    /// λ per layer (V2: the mean over heads and tokens).
    pub mean: Vec<f32>,
    /// V2: the standard deviation over heads and tokens; V1: zeros.
    pub std: Vec<f32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Lambdas {
    pub attention: String,
    pub checkpoints: Vec<LambdaAt>,
}

impl Lambdas {
    /// Each layer's λ at checkpoint `c` as text (V2: mean ± std).
    pub fn layers(&self, c: &LambdaAt) -> Vec<String> {
        c.mean
            .iter()
            .zip(&c.std)
            .map(|(m, s)| {
                if self.attention == "diff-v2" {
                    format!("{m:.3} ± {s:.3}")
                } else {
                    format!("{m:.3}")
                }
            })
            .collect()
    }

    pub fn print(&self) {
        println!("λ per layer ({}):", self.attention);
        for c in &self.checkpoints {
            println!("  step {:>7}: {}", c.step, self.layers(c).join("  "));
        }
    }

    /// λ of every layer against the training step.
    pub fn chart(&self, title: &str) -> Chart {
        let mut chart = Chart::new(title, "training step", "λ", false);
        let layers = self.checkpoints.first().map_or(0, |c| c.mean.len());
        for l in 0..layers {
            let points: Vec<(f64, f64)> = self
                .checkpoints
                .iter()
                .map(|c| (c.step as f64, c.mean[l] as f64))
                .collect();
            let name = format!("layer {l}");
            chart.series.push(Series::line(&name, l, points.clone()));
            chart.series.push(Series {
                legend: false,
                ..Series::points(&name, l, points)
            });
        }
        chart
    }
}

/// `(mean, std)` of λ per layer of `model`.
fn layer_lambdas(loaded: &Loaded, model: &Model, window: &[u32]) -> (Vec<f32>, Vec<f32>) {
    if loaded.recipe.model.attention == AttentionKind::Diff {
        let l = model.lambdas();
        let zeros = vec![0.0; l.len()];
        return (l, zeros);
    }
    let batch = LmBatcher.batch(vec![window.to_vec()], &loaded.device);
    model
        .forward_probe(batch.inputs)
        .layers
        .into_iter()
        .filter_map(|layer| layer.attention.lambda)
        .map(|l| {
            let mean = l.clone().mean().into_scalar::<f32>();
            let var = (l - mean).powi_scalar(2).mean().into_scalar::<f32>();
            (mean, var.sqrt())
        })
        .unzip()
}

pub fn measure(loaded: &Loaded, run_dir: &Path) -> Result<Lambdas> {
    if loaded.recipe.model.attention == AttentionKind::Transformer {
        bail!("{}: the baseline Transformer has no λ", run_dir.display());
    }
    let window = loaded.validation_windows()?.window(0);
    let config = loaded.recipe.model_config();
    let mut checkpoints = Vec::new();
    for checkpoint in layout::verified_checkpoints(run_dir) {
        let file = run_dir
            .join(layout::CHECKPOINTS)
            .join(checkpoint::part_name("model", checkpoint.number));
        // At the checkpoint's own warm-up scale, so that V2's λ is read from the activations
        // that step computed; λ itself is reported before that scale.
        let (model, _) = run::load_weights(&file, &config, &loaded.device)?;
        let model = model.with_lambda_scale(loaded.recipe.training.lambda_scale(checkpoint.step));
        let (mean, std) = layer_lambdas(loaded, &model, &window);
        checkpoints.push(LambdaAt {
            step: checkpoint.step,
            weights: format!("checkpoint {}", checkpoint.number),
            mean,
            std,
        });
    }
    // The final model equals the last checkpoint when that one was taken at the last step.
    let last = checkpoints.last().map(|c| c.step);
    if matches!(loaded.weights, layout::Weights::Final(_))
        && last != Some(loaded.recipe.total_steps())
    {
        let (mean, std) = layer_lambdas(loaded, &loaded.model, &window);
        checkpoints.push(LambdaAt {
            step: loaded.recipe.total_steps(),
            weights: "final model".into(),
            mean,
            std,
        });
    }
    Ok(Lambdas {
        attention: loaded.recipe.model.attention.to_string(),
        checkpoints,
    })
}

/// The trained λ (and, for V2, its spread over heads and tokens) per layer, at the last step:
/// the checkpoints before it differ between seeds stopped and resumed at different steps (each
/// seed's whole trajectory is in its own result).
impl Measurement for Lambdas {
    fn metrics(&self) -> Vec<Metric> {
        let Some(c) = self.checkpoints.last() else {
            return Vec::new();
        };
        let mut metrics = Vec::new();
        for (layer, (&mean, &std)) in c.mean.iter().zip(&c.std).enumerate() {
            let at = |m: Metric| m.at("step", c.step).at("layer", layer);
            metrics.push(at(Metric::new("lambda", f64::from(mean))));
            if self.attention != AttentionKind::Diff.as_str() {
                metrics.push(at(Metric::new("lambda_std", f64::from(std))));
            }
        }
        metrics
    }
}

pub fn run(args: &LambdaArgs) -> Result<()> {
    let each = |dir: &Path| {
        measure(
            &Loaded::open(dir, &args.common.device, args.common.dtype)?,
            dir,
        )
    };
    if seeds::over_seeds(&args.common, "lambda", args.plot.as_ref(), each)? {
        return Ok(());
    }
    let result = each(&args.common.run)?;
    if let Some(path) = &args.plot {
        let title = format!("λ by layer during training ({})", result.attention);
        crate::plot::write(path, &result.chart(&title).svg())?;
    }
    emit(args.common.json, &result, Lambdas::print)
}
