//! `diffzoo eval attention`: how the model's attention is allocated when it must retrieve (the
//! paper's Table 3). On needle prompts with one queried needle at each depth, the attention
//! row of the prompt's last token (the one that predicts the answer) is split into the mass on
//! the answer needle's tokens and the mass on the rest of the context ("noise": haystack and
//! distractors; the question itself counts as neither), averaged over heads, layers and
//! samples. For DIFF the map is the differential one, `A₁ − λ·A₂` (V2: `A_{2h} − λ_{t,h}·A_{2h+1}`).

use super::needle::sample;
use super::seeds::{self, Measurement, Metric};
use super::{Common, Loaded, Values, emit, list};
use anyhow::{Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use diffzoo_models::{Allocation, ModelProbe, allocation};
use serde::Serialize;
use std::ops::Range;
use std::path::Path;

#[derive(Debug, Clone, clap::Args)]
pub struct AttentionArgs {
    #[command(flatten)]
    pub common: Common,
    /// Needles in each prompt (one of them asked about).
    #[arg(long, default_value_t = 4)]
    pub needles: usize,
    #[arg(long, default_value = "0,0.25,0.5,0.75,1", value_parser = list::<f64>)]
    pub depths: Values<f64>,
    /// Prompt length in tokens (default: the run's sequence length).
    #[arg(long)]
    pub length: Option<usize>,
    #[arg(long, default_value_t = 20)]
    pub samples: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DepthAllocation {
    pub depth: f64,
    pub answer: f64,
    pub noise: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AttentionAllocation {
    pub weights: String,
    pub attention: String,
    pub needles: usize,
    pub length: usize,
    pub samples: usize,
    pub depths: Vec<DepthAllocation>,
}

impl AttentionAllocation {
    pub fn mean(&self) -> (f64, f64) {
        let n = self.depths.len() as f64;
        (
            self.depths.iter().map(|d| d.answer).sum::<f64>() / n,
            self.depths.iter().map(|d| d.noise).sum::<f64>() / n,
        )
    }

    pub fn print(&self) {
        println!(
            "{}: attention of the answer-predicting token ({} needles, {} tokens, {} samples per depth)",
            self.weights, self.needles, self.length, self.samples
        );
        println!("  depth | answer | noise");
        for d in &self.depths {
            println!(
                "  {:>4.0}% | {:>6.3} | {:>5.3}",
                d.depth * 100.0,
                d.answer,
                d.noise
            );
        }
        let (answer, noise) = self.mean();
        println!("   mean | {answer:>6.3} | {noise:>5.3}");
        if self.attention != "transformer" {
            println!(
                "  (DIFF's maps are A₁ − λ·A₂: each row sums to 1 − λ, and a share is negative where the subtracted map outweighs the first, by construction)"
            );
        }
    }
}

pub fn measure(
    loaded: &Loaded,
    needles: usize,
    depths: &[f64],
    length: Option<usize>,
    samples: usize,
    seed: u64,
) -> Result<AttentionAllocation> {
    let length = length.unwrap_or(loaded.recipe.data.seq_len);
    if length > loaded.context() {
        bail!(
            "--length: {length} tokens exceed the model's context of {} tokens",
            loaded.context()
        );
    }
    if samples == 0 || needles == 0 {
        bail!("--samples and --needles must be positive");
    }
    super::needle::check_depths(depths)?;
    let digits = loaded.needle_digits();
    let haystack = loaded.validation()?;
    let mut rows = Vec::new();
    for &depth in depths {
        let (mut answer, mut noise) = (0.0, 0.0);
        for index in 0..samples {
            let s = sample(
                loaded, &haystack, needles, 1, depth, length, digits, seed, index,
            )?;
            let (prompt, _) = &s.prompts[0];
            let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
            let input = Tensor::<2, Int>::from_data(
                TensorData::new(ids, [1, prompt.len()]),
                &loaded.device,
            );
            let probe = loaded.model.forward_probe(input);
            let span = s.context.answers[0].span.clone();
            let a = mean_allocation(&probe, prompt.len() - 1, span, 0..s.context.tokens.len());
            answer += a.answer;
            noise += a.noise;
        }
        rows.push(DepthAllocation {
            depth,
            answer: answer / samples as f64,
            noise: noise / samples as f64,
        });
    }
    Ok(AttentionAllocation {
        weights: loaded.weights.to_string(),
        attention: loaded.recipe.model.attention.to_string(),
        needles,
        length,
        samples,
        depths: rows,
    })
}

/// The attention of position `row` on `answer` and on the rest of `context`, averaged over the
/// probe's layers (and, within each, its heads).
pub fn mean_allocation(
    probe: &ModelProbe,
    row: usize,
    answer: Range<usize>,
    context: Range<usize>,
) -> Allocation {
    let layers = probe.layers.len() as f64;
    let (mut on_answer, mut noise) = (0.0, 0.0);
    for layer in &probe.layers {
        let a = allocation(
            layer.attention.effective.clone(),
            row,
            answer.clone(),
            context.clone(),
        );
        on_answer += a.answer / layers;
        noise += a.noise / layers;
    }
    Allocation {
        answer: on_answer,
        noise,
    }
}

impl Measurement for AttentionAllocation {
    fn metrics(&self) -> Vec<Metric> {
        let (answer, noise) = self.mean();
        self.depths
            .iter()
            .flat_map(|d| {
                [
                    Metric::new("answer", d.answer).at("depth", d.depth),
                    Metric::new("noise", d.noise).at("depth", d.depth),
                ]
            })
            .chain([
                Metric::new("answer", answer).at("depth", "mean"),
                Metric::new("noise", noise).at("depth", "mean"),
            ])
            .collect()
    }
}

pub fn run(args: &AttentionArgs) -> Result<()> {
    let each = |dir: &Path| {
        let loaded = Loaded::open(dir, &args.common.device, args.common.dtype)?;
        measure(
            &loaded,
            args.needles,
            &args.depths,
            args.length,
            args.samples,
            args.seed,
        )
    };
    if seeds::over_seeds(&args.common, "attention", None, each)? {
        return Ok(());
    }
    emit(
        args.common.json,
        &each(&args.common.run)?,
        AttentionAllocation::print,
    )
}
