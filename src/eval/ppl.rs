//! `diffzoo eval ppl`: validation loss and perplexity of a run's model, or with `--tokens` the
//! NLL of every token of given token-id sequences (how parity with another framework is checked
//! without any tokenizer).

use super::{Common, Loaded, emit, f64_values, id_tensor, seeds_of, target_log_probs};
use crate::{run, stats};
use anyhow::{Context, Result, anyhow, bail};
use diffzoo_datasets::Shards;
use diffzoo_models::Model;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct PplArgs {
    #[command(flatten)]
    pub common: Common,
    /// A shard directory (default: the run's own data).
    #[arg(long, conflicts_with = "tokens")]
    pub data: Option<PathBuf>,
    /// Evaluate at most this many micro-batches (default: the whole validation split).
    #[arg(long, conflicts_with = "tokens")]
    pub max_batches: Option<usize>,
    /// Score these token ids instead: a JSON file `{"input_ids": [[...], ...]}` of sequences of
    /// 2 to max_seq_len ids each. Prints each sequence's mean NLL; with --json every token's.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
pub struct Perplexity {
    pub weights: String,
    pub data: String,
    pub windows: u64,
    pub tokens: u64,
    pub loss: f64,
    /// The 95% interval of the loss over the windows scored (their spread; see [`stats`]).
    pub loss_ci95: Option<[f64; 2]>,
    pub perplexity: f64,
    /// Each window's mean loss, in window order (for paired comparisons; not printed).
    #[serde(skip)]
    pub per_window: Vec<f64>,
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
        None => (
            loaded.validation_windows_of(&loaded.shards)?,
            loaded.shards.dir.clone(),
        ),
    };
    let (loss, tokens, per_window) = loaded.validation_loss(&loaded.model, &windows, batches)?;
    Ok(Perplexity {
        weights: loaded.weights.to_string(),
        data: dir.display().to_string(),
        windows: per_window.len() as u64,
        tokens,
        loss,
        loss_ci95: stats::estimate(&per_window).ci95,
        perplexity: loss.exp(),
        per_window,
    })
}

pub fn run(args: &PplArgs) -> Result<()> {
    if let Some(tokens) = &args.tokens {
        return score_tokens(&args.common, tokens);
    }
    let seeds = seeds_of(&args.common.run)?;
    if !seeds.is_empty() {
        return over_seeds(args, &seeds);
    }
    let loaded = Loaded::open(&args.common.run, &args.common.device, args.common.dtype)?;
    let result = measure(&loaded, args.data.as_ref(), args.max_batches)?;
    let scope = match (args.max_batches, &args.data) {
        (Some(n), _) => format!("at most {n} batches of the validation split"),
        (None, Some(_)) => "the whole validation split".to_string(),
        (None, None) => format!(
            "the whole validation split; training's log scores at most its first {} batches",
            loaded.recipe.checkpoint.eval_batches
        ),
    };
    emit(args.common.json, &result, |r| {
        let interval = r.loss_ci95.map_or(String::new(), |[lo, hi]| {
            format!(" (95% interval {lo:.4} to {hi:.4} over windows)")
        });
        println!(
            "{}: validation loss {:.4}{interval}, perplexity {:.2} over {} tokens ({} windows: {scope}) of {}",
            r.weights, r.loss, r.perplexity, r.tokens, r.windows, r.data
        )
    })
}

/// A run over seeds: each seed's loss, and their mean with its interval over the seeds.
#[derive(Debug, Serialize)]
pub struct SeedPerplexity {
    pub run: String,
    pub seeds: Vec<Perplexity>,
    /// Mean, standard deviation and 95% t interval of the seeds' losses.
    pub loss: stats::Estimate,
}

fn over_seeds(args: &PplArgs, seeds: &[PathBuf]) -> Result<()> {
    let mut measured = Vec::with_capacity(seeds.len());
    for seed in seeds {
        let loaded = Loaded::open(seed, &args.common.device, args.common.dtype)?;
        measured.push(measure(&loaded, args.data.as_ref(), args.max_batches)?);
    }
    let losses: Vec<f64> = measured.iter().map(|p| p.loss).collect();
    let result = SeedPerplexity {
        run: args.common.run.display().to_string(),
        loss: stats::estimate(&losses),
        seeds: measured,
    };
    emit(args.common.json, &result, |r| {
        for p in &r.seeds {
            println!(
                "{}: validation loss {:.4} over {} tokens",
                p.weights, p.loss, p.tokens
            );
        }
        let e = &r.loss;
        let spread = e.spread(4, "seeds");
        println!(
            "{}: mean validation loss over {} seeds {:.4}{spread}",
            r.run, e.n, e.mean
        );
    })
}

/// The `--tokens` file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    input_ids: Vec<Vec<u32>>,
}

/// Per-token NLL of given sequences.
#[derive(Debug, Serialize)]
pub struct TokenNll {
    pub weights: String,
    /// `nll[b][t]` = −log p(token t+1 | tokens ≤ t) of sequence b.
    pub nll: Vec<Vec<f64>>,
    /// The mean over every scored token.
    pub mean_nll: f64,
}

fn score_tokens(common: &Common, path: &Path) -> Result<()> {
    let recipe = run::run_recipe(&common.run)?;
    let config = recipe.model_config();
    let sequences = read_tokens(path, config.vocab_size, config.max_seq_len)?;
    let (model, weights, device, _) =
        run::load_model_on(&common.run, &recipe, &common.device, common.dtype)?;
    let nll: Vec<Vec<f64>> = sequences
        .iter()
        .map(|ids| sequence_nll(&model, ids, &device))
        .collect();
    let count: usize = nll.iter().map(Vec::len).sum();
    let result = TokenNll {
        weights: weights.to_string(),
        mean_nll: nll.iter().flatten().sum::<f64>() / count as f64,
        nll,
    };
    emit(common.json, &result, |r| {
        for (b, seq) in r.nll.iter().enumerate() {
            let mean = seq.iter().sum::<f64>() / seq.len() as f64;
            println!("sequence {b}: mean NLL {mean:.6} over {} tokens", seq.len());
        }
        println!(
            "{}: mean NLL {:.6} over {count} tokens of {} sequences",
            r.weights,
            r.mean_nll,
            r.nll.len()
        );
    })
}

/// Reads and checks a `--tokens` file; errors name the file and the offending sequence.
fn read_tokens(path: &Path, vocab: usize, context: usize) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: TokenFile = serde_path_to_error::deserialize(
        &mut serde_json::Deserializer::from_str(&text),
    )
    .map_err(|e| {
        anyhow!(
            "{}: {e} (expected {{\"input_ids\": [[ids], ...]}})",
            path.display()
        )
    })?;
    if file.input_ids.is_empty() {
        bail!("{}: `input_ids` holds no sequence", path.display());
    }
    for (b, ids) in file.input_ids.iter().enumerate() {
        if ids.len() < 2 || ids.len() > context {
            bail!(
                "{}: sequence {b} has {} ids: 2 to the model's max_seq_len = {context} can be scored",
                path.display(),
                ids.len()
            );
        }
        if let Some((t, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= vocab)
        {
            bail!(
                "{}: sequence {b}, position {t}: id {id} is outside the vocabulary of {vocab}",
                path.display()
            );
        }
    }
    Ok(file.input_ids)
}

/// −log p(ids[t+1] | ids[≤t]) for every t: the forward pass in the device's dtype, the
/// log-softmax in f32.
fn sequence_nll(model: &Model, ids: &[u32], device: &burn::tensor::Device) -> Vec<f64> {
    let logits = model
        .forward(id_tensor(ids, device))
        .narrow(1, 0, ids.len() - 1);
    f64_values(target_log_probs(logits, id_tensor(&ids[1..], device)).neg())
}
