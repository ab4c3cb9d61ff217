//! `diffzoo eval ppl`: validation loss and perplexity of a run's model.

use crate::train::step::lm_loss;
use crate::{device, run};
use anyhow::{Result, bail};
use burn::data::dataloader::batcher::Batcher;
use diffzoo_datasets::{LmBatcher, Shards, Split, TokenWindows};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct PplArgs {
    /// Run directory.
    #[arg(long)]
    pub run: PathBuf,
    /// A shard directory (default: the run's own data).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Evaluate at most this many micro-batches (default: the whole validation split).
    #[arg(long)]
    pub max_batches: Option<usize>,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct Perplexity {
    pub weights: String,
    pub data: String,
    pub windows: u64,
    pub tokens: u64,
    pub loss: f64,
    pub perplexity: f64,
}

pub fn ppl(args: &PplArgs) -> Result<Perplexity> {
    let recipe = run::run_recipe(&args.run)?;
    let tokenizer = run::run_tokenizer(&args.run)?;
    let shards = match &args.data {
        Some(dir) => Shards::open(dir)?,
        None => run::open_data(&recipe)?.1,
    };
    shards.check_tokenizer(tokenizer.hash())?;
    let device = device::parse(&args.device)?;
    let (model, weights) = run::load_model(&args.run, &recipe, &device)?;
    let windows = TokenWindows::new(shards.tokens(Split::Validation)?, recipe.data.seq_len);
    if windows.is_empty() {
        bail!(
            "{}: the validation split is shorter than one window of {} tokens",
            shards.dir.display(),
            recipe.data.seq_len
        );
    }
    let micro = recipe.training.micro_batch as u64;
    let batches = windows.len().div_ceil(micro);
    let batches = args.max_batches.map_or(batches, |m| batches.min(m as u64));
    let (mut sum, mut tokens, mut count) = (0.0, 0u64, 0u64);
    for b in 0..batches {
        let items: Vec<Vec<u32>> = (b * micro..((b + 1) * micro).min(windows.len()))
            .map(|i| windows.window(i))
            .collect();
        count += items.len() as u64;
        let batch = LmBatcher.batch(items, &device);
        let [n, s] = batch.targets.dims();
        let loss = lm_loss(&model, &batch).into_scalar::<f64>();
        sum += loss * (n * s) as f64;
        tokens += (n * s) as u64;
    }
    let loss = sum / tokens as f64;
    let result = Perplexity {
        weights: weights.to_string(),
        data: shards.dir.display().to_string(),
        windows: count,
        tokens,
        loss,
        perplexity: loss.exp(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        println!(
            "{}: validation loss {:.4}, perplexity {:.2} over {} tokens ({} windows) of {}",
            result.weights,
            result.loss,
            result.perplexity,
            result.tokens,
            result.windows,
            result.data
        );
    }
    Ok(result)
}
