//! `diffzoo eval recall`: multi-query associative recall on evaluation keys (the task and
//! its prompt layout are in [`diffzoo_datasets::recall`]), by cell of (pairs, distractor tokens
//! between pairs, distance from the last pair to the queries).
//!
//! Each prompt is `--length` tokens (default: the run's sequence length), validation text as
//! filler, distractors and distance. Two measures per prompt:
//! - *accuracy*: the share of its queried values that are the argmax given everything before
//!   them (each query sees the earlier ones answered, as in training; chance is 1/64);
//! - *attention*: for the token that predicts a queried value, the attention mass on the
//!   queried pair's three tokens (`answer`) and on the rest of the context before the queries
//!   (`noise`), averaged over heads, layers and queries: `eval attention`'s measure, on DIFF's
//!   differential map `A₁ − λ·A₂`.
//!
//! A run directory of seeds (`RUN/seed-N`, from `sweep --seeds`) is measured seed by seed on the
//! same prompts; a cell then reports the mean over seeds with a 95% t interval over the seeds'
//! values. The prompts being shared, that interval holds the spread between trained models, not
//! the choice of prompts (more `--samples` shrink that). A single run's interval is over its
//! prompts. All seeds must be measured at the same stage (all final, or all at one step).
//! Prompts are a pure function of `--seed`. `--keys train` asks training keys instead: retrieval
//! that works there but not on evaluation keys has not generalised.

use super::attention::mean_allocation;
use super::{Common, Loaded, Values, emit, list, random_text, seeds_of};
use crate::stats::{self, Estimate};
use anyhow::{Context, Result, bail};
use diffzoo_datasets::recall::{
    KeySplit, Layout, MAX_PAIRS, RecallDocument, Vocabulary, document, draw, query_order,
};
use diffzoo_datasets::{Rng, TokenStream};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, clap::Args)]
pub struct RecallArgs {
    #[command(flatten)]
    pub common: Common,
    /// Key–value pairs in each prompt, all of them asked about.
    #[arg(long, default_value = "1,2,4", value_parser = list::<usize>)]
    pub pairs: Values<usize>,
    /// Tokens of text between consecutive pairs.
    #[arg(long, default_value = "0,2,4,8", value_parser = list::<usize>)]
    pub distractors: Values<usize>,
    /// Tokens of text between the last pair and the first query.
    #[arg(long, default_value = "0", value_parser = list::<usize>)]
    pub distances: Values<usize>,
    /// Prompt length in tokens (default: the run's sequence length).
    #[arg(long)]
    pub length: Option<usize>,
    /// Prompts per cell.
    #[arg(long, default_value_t = 50)]
    pub samples: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Which keys the prompts use: `eval` (never trained on) or `train` (the training keys, to
    /// tell retrieval that fails to generalise to new keys from no retrieval at all).
    #[arg(long, value_enum, default_value_t = Keys::Eval)]
    pub keys: Keys,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Keys {
    Eval,
    Train,
}

impl Keys {
    fn split(self) -> KeySplit {
        match self {
            Keys::Eval => KeySplit::Eval,
            Keys::Train => KeySplit::Train,
        }
    }
}

/// One cell's prompts: their accuracies and attention shares.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub pairs: usize,
    pub distractors: usize,
    pub distance: usize,
    pub accuracy: Estimate,
    pub answer_attention: Estimate,
    pub noise_attention: Estimate,
}

#[derive(Debug, Clone, Serialize)]
pub struct Recall {
    pub run: String,
    pub attention: String,
    /// The weights measured: one per seed.
    pub weights: Vec<String>,
    /// What the intervals are over: `"prompts"` (one run) or `"seeds"`.
    pub interval_over: &'static str,
    pub length: usize,
    pub samples: usize,
    pub seed: u64,
    pub keys: Keys,
    pub cells: Vec<Cell>,
}

pub fn run(args: &RecallArgs) -> Result<()> {
    let run_dir = &args.common.run;
    let seeds = seeds_of(run_dir)?;
    let dirs = if seeds.is_empty() {
        vec![run_dir.clone()]
    } else {
        seeds
    };
    let mut measured: Vec<Seed> = Vec::with_capacity(dirs.len());
    for dir in &dirs {
        let loaded = Loaded::open(dir, &args.common.device, args.common.dtype)?;
        let cells = measure(&loaded, args).with_context(|| format!("{}", dir.display()))?;
        measured.push(Seed {
            weights: loaded.weights.to_string(),
            attention: loaded.recipe.model.attention.to_string(),
            length: args.length.unwrap_or(loaded.recipe.data.seq_len),
            cells,
        });
    }
    let result = aggregate(run_dir, args, &measured)?;
    emit(args.common.json, &result, Recall::print)
}

/// One run's (or seed's) measurements.
struct Seed {
    weights: String,
    attention: String,
    length: usize,
    cells: Vec<Measured>,
}

/// A cell's per-prompt values.
struct Measured {
    pairs: usize,
    distractors: usize,
    distance: usize,
    accuracy: Vec<f64>,
    answer: Vec<f64>,
    noise: Vec<f64>,
}

/// Every cell of `args` on one run.
fn measure(loaded: &Loaded, args: &RecallArgs) -> Result<Vec<Measured>> {
    let length = args.length.unwrap_or(loaded.recipe.data.seq_len);
    // The last value is predicted, never read: the model sees `length − 1` tokens.
    if length > loaded.context() + 1 {
        bail!(
            "--length: {length} tokens exceed the model's context of {} tokens (+1 predicted)",
            loaded.context()
        );
    }
    if args.samples == 0 {
        bail!("--samples must be positive");
    }
    if let Some(p) = args.pairs.iter().find(|p| !(1..=MAX_PAIRS).contains(*p)) {
        bail!("--pairs: {p} is outside 1..={MAX_PAIRS}");
    }
    let vocab = Vocabulary::new(loaded.recipe.model.vocab_size)?;
    let cells = cells(args);
    for &(pairs, layout) in &cells {
        if layout.length(pairs).is_none_or(|n| n > length) {
            bail!(
                "--pairs {pairs} with --distractors {} and --distances {} take {}, more than a \
                 prompt of {length} (--length)",
                layout.distractors,
                layout.distance,
                layout
                    .length(pairs)
                    .map_or("more tokens than can be counted".into(), |n| format!(
                        "{n} tokens"
                    ))
            );
        }
    }
    let text = loaded.validation()?;
    let most_text = length - 6 * args.pairs.iter().min().copied().unwrap_or(1);
    if text.len() < most_text as u64 {
        bail!(
            "the validation split ({} tokens) is shorter than the {most_text} tokens of text a \
             prompt of {length} tokens (--length) needs",
            text.len()
        );
    }
    let mut out = Vec::with_capacity(cells.len());
    for (pairs, layout) in cells {
        let mut cell = Measured {
            pairs,
            distractors: layout.distractors,
            distance: layout.distance,
            accuracy: Vec::new(),
            answer: Vec::new(),
            noise: Vec::new(),
        };
        for index in 0..args.samples {
            let doc = prompt(&vocab, &text, (pairs, layout), length, args, index)?;
            let (accuracy, answer, noise) = score(loaded, &doc);
            cell.accuracy.push(accuracy);
            cell.answer.push(answer);
            cell.noise.push(noise);
        }
        out.push(cell);
    }
    Ok(out)
}

/// The cells, pairs outermost, in the order given.
fn cells(args: &RecallArgs) -> Vec<(usize, Layout)> {
    let mut cells = Vec::new();
    for &pairs in &args.pairs {
        for &distractors in &args.distractors {
            for &distance in &args.distances {
                cells.push((
                    pairs,
                    Layout {
                        distractors,
                        distance,
                    },
                ));
            }
        }
    }
    cells
}

/// Prompt `index` of a cell: keys of `--keys`, text from a random place of the validation split.
fn prompt(
    vocab: &Vocabulary,
    text: &TokenStream,
    (pairs, layout): (usize, Layout),
    length: usize,
    args: &RecallArgs,
    index: usize,
) -> Result<RecallDocument> {
    let cell = [pairs, layout.distractors, layout.distance, length]
        .iter()
        .fold(args.seed, |h, &v| {
            diffzoo_datasets::rng::splitmix(h ^ v as u64)
        });
    let mut rng = Rng::for_item(cell, index as u64);
    let drawn = draw(&mut rng, vocab, args.keys.split(), pairs)?;
    let order = query_order(&mut rng, pairs);
    let text = random_text(text, &mut rng, length - 6 * pairs)?;
    Ok(document(&drawn, &order, layout, &text, length)?)
}

/// One prompt's accuracy, and attention on the queried pairs and on the rest of the context.
fn score(loaded: &Loaded, doc: &RecallDocument) -> (f64, f64, f64) {
    let input = &doc.tokens[..doc.tokens.len() - 1];
    let probe = loaded
        .model
        .forward_probe(super::id_tensor(input, &loaded.device));
    let predicted: Vec<i64> = probe
        .logits
        .clone()
        .argmax(2)
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("argmax indices");
    let queries = doc.queries.len() as f64;
    let right = doc
        .queries
        .iter()
        .filter(|q| predicted[q.answer - 1] == q.value as i64)
        .count();
    let (mut answer, mut noise) = (0.0, 0.0);
    for q in &doc.queries {
        let a = mean_allocation(&probe, q.answer - 1, q.pair.clone(), 0..doc.context);
        answer += a.answer / queries;
        noise += a.noise / queries;
    }
    (right as f64 / queries, answer, noise)
}

/// Each cell's estimate: over one run's prompts, or over the seeds' means.
fn aggregate(run_dir: &Path, args: &RecallArgs, measured: &[Seed]) -> Result<Recall> {
    let first = &measured[0];
    let over = |pick: fn(&Measured) -> &Vec<f64>, i: usize| -> Estimate {
        if measured.len() == 1 {
            stats::estimate(pick(&first.cells[i]))
        } else {
            let means: Vec<f64> = measured
                .iter()
                .map(|s| stats::estimate(pick(&s.cells[i])).mean)
                .collect();
            stats::estimate(&means)
        }
    };
    if let Some(other) = measured
        .iter()
        .find(|s| (&s.attention, s.length) != (&first.attention, first.length))
    {
        bail!(
            "{}: its seeds differ in attention or sequence length ({}, {} tokens and {}, {} tokens)",
            run_dir.display(),
            first.attention,
            first.length,
            other.attention,
            other.length
        );
    }
    Ok(Recall {
        run: run_dir.display().to_string(),
        attention: first.attention.clone(),
        weights: measured.iter().map(|s| s.weights.clone()).collect(),
        interval_over: if measured.len() == 1 {
            "prompts"
        } else {
            "seeds"
        },
        length: first.length,
        samples: args.samples,
        seed: args.seed,
        keys: args.keys,
        cells: first
            .cells
            .iter()
            .enumerate()
            .map(|(i, c)| Cell {
                pairs: c.pairs,
                distractors: c.distractors,
                distance: c.distance,
                accuracy: over(|m| &m.accuracy, i),
                answer_attention: over(|m| &m.answer, i),
                noise_attention: over(|m| &m.noise, i),
            })
            .collect(),
    })
}

impl Recall {
    pub fn print(&self) {
        println!(
            "{} ({}): associative recall on {} keys, {}-token prompts, {} prompts per cell, seed {}",
            self.run,
            self.attention,
            match self.keys {
                Keys::Eval => "evaluation",
                Keys::Train => "training",
            },
            self.length,
            self.samples,
            self.seed
        );
        println!(
            "{} weights measured; 95% intervals over {}",
            self.weights.len(),
            self.interval_over
        );
        println!("pairs distractors distance | accuracy (95% interval)  | attention: pair  noise");
        for c in &self.cells {
            println!(
                "{:>5} {:>11} {:>8} | {:<24} | {:>15.3} {:>6.3}",
                c.pairs,
                c.distractors,
                c.distance,
                describe(&c.accuracy),
                c.answer_attention.mean,
                c.noise_attention.mean
            );
        }
    }
}

/// "0.512 (0.401–0.623)", or the mean alone without an interval.
fn describe(e: &Estimate) -> String {
    match e.ci95 {
        Some([lo, hi]) => format!("{:.3} ({lo:.3}–{hi:.3})", e.mean),
        None => format!("{:.3}", e.mean),
    }
}
