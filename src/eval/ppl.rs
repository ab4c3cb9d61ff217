//! `diffzoo eval ppl`: validation loss and perplexity of a run's model.

use super::{Common, Loaded, emit};
use anyhow::Result;
use diffzoo_datasets::Shards;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct PplArgs {
    #[command(flatten)]
    pub common: Common,
    /// A shard directory (default: the run's own data).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Evaluate at most this many micro-batches (default: the whole validation split).
    #[arg(long)]
    pub max_batches: Option<usize>,
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

pub fn measure(
    loaded: &Loaded,
    data: Option<&PathBuf>,
    batches: Option<usize>,
) -> Result<Perplexity> {
    let (windows, dir) = match data {
        Some(dir) => {
            let shards = Shards::open(dir)?;
            shards.check_tokenizer(loaded.tokenizer.hash())?;
            let windows = loaded.validation_windows_of(&shards)?;
            (windows, dir.clone())
        }
        None => (loaded.validation_windows()?, loaded.shards.dir.clone()),
    };
    let (loss, tokens, count) = loaded.validation_loss(&loaded.model, &windows, batches)?;
    Ok(Perplexity {
        weights: loaded.weights.to_string(),
        data: dir.display().to_string(),
        windows: count,
        tokens,
        loss,
        perplexity: loss.exp(),
    })
}

pub fn run(args: &PplArgs) -> Result<()> {
    let loaded = Loaded::open(&args.common.run, &args.common.device)?;
    let result = measure(&loaded, args.data.as_ref(), args.max_batches)?;
    emit(args.common.json, &result, |r| {
        println!(
            "{}: validation loss {:.4}, perplexity {:.2} over {} tokens ({} windows) of {}",
            r.weights, r.loss, r.perplexity, r.tokens, r.windows, r.data
        )
    })
}
