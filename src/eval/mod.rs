//! `diffzoo eval <task>`: the paper's analyses of a run's model, each on any backend, each with
//! `--json` and most with `--plot FILE.svg`.
//!
//! | task           | what it measures                                            | paper       |
//! |----------------|-------------------------------------------------------------|-------------|
//! | `ppl`          | validation loss and perplexity                              |             |
//! | `choice`       | zero-shot multiple-choice accuracy (LM Eval Harness scoring) | Table 1    |
//! | `nll-position` | cumulative average NLL by token position                    | Fig. 4      |
//! | `needle`       | multi-needle retrieval accuracy per (N, R, depth, length)   | Table 2, Fig. 5 |
//! | `attention`    | attention on the answer span versus the rest of the context | Table 3     |
//! | `recall`       | associative recall accuracy and attention, by distractors    |             |
//! | `outliers`     | top-k and median of |attention logits| and |hidden states|   | Table 5     |
//! | `quant`        | loss (and retrieval) with attention logits at 16/8/6/4 bits | Fig. 8      |
//! | `lambda`       | λ of every layer across the run's checkpoints               |             |
//! | `icl`          | many-shot in-context classification, by demonstrations and orders | Fig. 6, 7 |
//! | `hallucination`| share of outputs a judge finds supported by their source    | Table 4     |
//!
//! A run over seeds (`RUN/seed-N`) is measured seed by seed: `ppl` and `recall` pool their own
//! way, every other task through [`seeds`] (each number's mean and interval over the seeds).

pub mod attention;
pub mod choice;
pub mod compare;
pub mod hallucination;
pub mod icl;
pub mod lambda;
pub mod needle;
pub mod outliers;
pub mod position;
pub mod ppl;
pub mod quant;
pub mod recall;
pub mod seeds;

use crate::run::WeightDtype;
use crate::{layout, recipe::Recipe, run};
use anyhow::{Context, Result, anyhow, bail};
use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, Int, Tensor, TensorData};
use diffzoo_datasets::{LmBatcher, Rng, Shards, Split, TextTokenizer, TokenStream, TokenWindows};
use diffzoo_models::Model;
pub use diffzoo_models::target_log_probs;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What every task takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// Run directory (its final model, else its newest complete checkpoint).
    #[arg(long)]
    pub run: PathBuf,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The dtype the weight matrices are kept in while computing in f32 (default: bf16 for a run
    /// whose weights are stored in bf16, on the CPU backend; else f32).
    #[arg(long, value_enum)]
    pub dtype: Option<WeightDtype>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A run's model with what evaluating it needs.
pub struct Loaded {
    pub recipe: Recipe,
    pub tokenizer: TextTokenizer,
    pub shards: Shards,
    pub model: Model,
    pub weights: layout::Weights,
    pub device: Device,
}

impl Loaded {
    /// The run's model on `device`, its weight matrices in `dtype` (None: [`WeightDtype::resolve`]'s
    /// default).
    pub fn open(run_dir: &Path, device: &str, dtype: Option<WeightDtype>) -> Result<Self> {
        let recipe = run::run_recipe(run_dir)?;
        let tokenizer = run::run_tokenizer(run_dir)?;
        let shards = run::open_data(&recipe)?.1;
        shards.check_tokenizer(tokenizer.hash())?;
        let (model, weights, device, _) = run::load_model_on(run_dir, &recipe, device, dtype)?;
        Ok(Self {
            recipe,
            tokenizer,
            shards,
            model,
            weights,
            device,
        })
    }

    /// The held-out token stream.
    pub fn validation(&self) -> Result<TokenStream> {
        Ok(self.shards.tokens(Split::Validation)?)
    }

    /// The model's context length.
    pub fn context(&self) -> usize {
        self.recipe.model_config().max_seq_len
    }

    /// Digits of the needles' magic numbers: as the run trained with, else the default.
    pub fn needle_digits(&self) -> usize {
        self.recipe
            .data
            .needles
            .as_ref()
            .map_or_else(crate::recipe::default_digits, |n| n.digits)
    }

    /// Validation windows of plain text of the run's sequence length, refusing a split shorter
    /// than one: what the analyses read (by position, hidden state, attention map), which a
    /// window of one padded conversation does not give.
    pub fn validation_windows(&self) -> Result<TokenWindows> {
        let windows = self.validation_windows_of(&self.shards)?;
        if windows.is_conversations() {
            bail!(
                "{}: conversation shards (one padded conversation per window, the loss on the assistant's tokens): this analysis reads windows of plain text; `eval ppl` scores conversations, or give a run trained on text",
                self.shards.dir.display()
            );
        }
        Ok(windows)
    }

    /// Validation windows (plain, or one conversation each for conversation shards, as
    /// training reads them) over `shards` (of this run's tokenizer).
    pub fn validation_windows_of(&self, shards: &Shards) -> Result<TokenWindows> {
        let windows = crate::run::windows(shards, Split::Validation, self.recipe.data.seq_len)?;
        if windows.is_empty() {
            bail!(
                "{}: the validation split is shorter than one window of {} tokens",
                shards.dir.display(),
                self.recipe.data.seq_len
            );
        }
        Ok(windows)
    }

    /// Validation loss of `model` over the first `batches` micro-batches (all when `None`):
    /// `(mean loss, tokens, each window's mean loss)` — the windows for intervals and paired
    /// comparisons (the forward pass in the device's dtype, the log-softmax in f32). A window of a
    /// conversation counts its scored targets only, as training does: `tokens` counts those.
    pub fn validation_loss(
        &self,
        model: &Model,
        windows: &TokenWindows,
        batches: Option<usize>,
    ) -> Result<(f64, u64, Vec<f64>)> {
        if batches == Some(0) {
            bail!("--max-batches must be positive");
        }
        let micro = self.recipe.training.micro_batch as u64;
        let all = windows.len().div_ceil(micro);
        let batches = batches.map_or(all, |m| all.min(m as u64));
        let (mut per_window, mut tokens) = (Vec::new(), 0u64);
        for b in 0..batches {
            let items: Vec<Vec<u32>> = (b * micro..((b + 1) * micro).min(windows.len()))
                .map(|i| windows.window(i))
                .collect();
            let batch = LmBatcher.batch(items, &self.device);
            let [n, s] = batch.targets.dims();
            let nll = token_nll(model, batch.inputs, batch.targets);
            if windows.is_conversations() {
                let rows = b * micro..((b + 1) * micro).min(windows.len());
                let flags: Vec<Vec<bool>> = rows
                    .map(|i| windows.scored(i).expect("conversation windows are flagged"))
                    .collect();
                let nll = f64_values(nll);
                for (row, flags) in nll.chunks(s).zip(&flags) {
                    let scored: Vec<f64> = row
                        .iter()
                        .zip(flags)
                        .filter(|(_, f)| **f)
                        .map(|(x, _)| *x)
                        .collect();
                    tokens += scored.len() as u64;
                    per_window.push(scored.iter().sum::<f64>() / scored.len() as f64);
                }
            } else {
                per_window.extend(f64_values(nll.mean_dim(1).reshape([n])));
                tokens += (n * s) as u64;
            }
        }
        // The mean over windows: over tokens too for plain windows, all of one length; each
        // conversation weighs the same, as in the training loss.
        let loss = per_window.iter().sum::<f64>() / per_window.len() as f64;
        Ok((loss, tokens, per_window))
    }
}

/// Per-token negative log-likelihoods `[B, S]` (f32) of `targets` under `model`.
pub fn token_nll(model: &Model, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<2> {
    target_log_probs(model.forward(inputs), targets).neg()
}

/// A float tensor's values, read as f32, as f64.
pub fn f64_values<const D: usize>(tensor: Tensor<D>) -> Vec<f64> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The seeds of a run over seeds (`RUN/seed-N`), refused unless all are at one stage (all
/// final, or all at one checkpoint step): a sweep still running would mix them. Empty for a
/// plain run.
pub fn seeds_of(run: &Path) -> Result<Vec<PathBuf>> {
    let seeds = layout::run_seeds(run);
    let mut stages = Vec::with_capacity(seeds.len());
    for seed in &seeds {
        stages.push(layout::find_weights(seed)?.stage());
    }
    if let Some(i) = stages.iter().position(|s| *s != stages[0]) {
        bail!(
            "{}: its seeds are at different stages ({} of {}, {} of {}): measure them once all \
             have finished",
            run.display(),
            stages[0],
            seeds[0].display(),
            stages[i],
            seeds[i].display()
        );
    }
    Ok(seeds)
}

/// `len` tokens from a random place of `text` (a held-out split), refusing a split too short.
pub fn random_text(text: &TokenStream, rng: &mut Rng, len: usize) -> Result<Vec<u32>> {
    if text.len() < len as u64 {
        bail!(
            "the validation split ({} tokens) is shorter than the {len} tokens of text a prompt needs",
            text.len()
        );
    }
    let start = rng.below(text.len() - len as u64 + 1);
    Ok(text.read(start, len))
}

/// Token ids as one sequence, `[1, S]`.
pub fn id_tensor(ids: &[u32], device: &Device) -> Tensor<2, Int> {
    let values: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(values, [1, ids.len()]), device)
}

/// Prints `result` as JSON, or runs `text`.
pub fn emit<T: Serialize>(json: bool, result: &T, text: impl FnOnce(&T)) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(result)?);
    } else {
        text(result);
    }
    Ok(())
}

/// The JSON lines of `file` (blank lines skipped; the first `limit`, which is not 0), each read
/// by `parse` with its place `FILE:LINE`; a malformed line is refused naming that place, a file
/// of none (`items` says of what) naming the file.
pub fn read_jsonl<T>(
    file: &Path,
    limit: Option<usize>,
    items: &str,
    parse: impl Fn(&serde_json::Value, &str) -> Result<T>,
) -> Result<Vec<T>> {
    if limit == Some(0) {
        bail!("--limit 0: expected at least one of the {items}");
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let at = format!("{}:{}", file.display(), n + 1);
        let value = serde_json::from_str(line).map_err(|e| anyhow!("{at}: {e}"))?;
        out.push(parse(&value, &at).map_err(|e| anyhow!("{at}: {e}"))?);
    }
    if out.is_empty() {
        bail!("{}: no {items}", file.display());
    }
    Ok(out)
}

/// A comma-separated list argument (an alias, so that clap parses it as one value).
pub type Values<T> = Vec<T>;

/// Parses a comma-separated list such as `1,2,4` or `0,0.25,0.5`.
pub fn list<T: std::str::FromStr>(text: &str) -> std::result::Result<Vec<T>, String> {
    text.split(',')
        .map(|v| {
            v.trim()
                .parse()
                .map_err(|_| format!("`{v}` in `{text}` is not a valid value"))
        })
        .collect()
}
