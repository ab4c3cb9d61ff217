//! `diffzoo eval needle`: multi-needle retrieval (the paper's Table 2 and Fig. 5, the LWM /
//! Gemini 1.5 protocol; the prompt format is in [`diffzoo_datasets::needle`]).
//!
//! For each cell (N needles, R queried, depth, length) and each of `samples` samples: a window
//! of held-out text is the haystack, N needles of evaluation-only cities go in (the R queried
//! together at the depth, the others at random), and for each queried city the prompt ends
//! with its question; the context is cut so that the longest question with its answer ends
//! exactly at `length` tokens (shorter questions end a few tokens earlier). The
//! answer counts when greedy decoding produces it exactly (the digits and the closing period).
//! Greedy decoding is scored in one forward pass: it produces the answer exactly when every
//! answer token is the argmax given the prompt and the answer tokens before it. A sample's score
//! is the share of its R answers found; a cell's accuracy the mean over samples. Everything is a
//! pure function of `--seed`, so two runs with the same tokenizer see the same prompts.

use super::seeds::{self, Measurement, Metric};
use super::{Common, Loaded, Values, emit, list, random_text};
use crate::plot::{self, Heatmap};
use anyhow::{Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use diffzoo_datasets::needle::{EVAL_CITIES, NeedleContext, answer_text, draw, place, query_text};
use diffzoo_datasets::{Rng, TokenStream};
use diffzoo_models::Model;
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct NeedleArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub grid: GridArgs,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// The cells to measure.
#[derive(Debug, Clone, clap::Args)]
pub struct GridArgs {
    /// Needles in the context (N).
    #[arg(long, default_value = "1,2,4,6", value_parser = list::<usize>)]
    pub needles: Values<usize>,
    /// Needles asked about (R); cells with R > N are skipped.
    #[arg(long, default_value = "1,2", value_parser = list::<usize>)]
    pub queries: Values<usize>,
    /// Depths of the queried needles, 0 (start) to 1 (just before the question).
    #[arg(long, default_value = "0,0.25,0.5,0.75,1", value_parser = list::<f64>)]
    pub depths: Values<f64>,
    /// Prompt lengths in tokens, answer included (default: the run's sequence length).
    #[arg(long, value_parser = list::<usize>)]
    pub lengths: Option<Values<usize>>,
    /// Samples per cell.
    #[arg(long, default_value_t = 50)]
    pub samples: usize,
    /// Digits of the magic numbers (default: the run's training mixture's, else 7 as in LWM).
    #[arg(long)]
    pub digits: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// A grid checked against a run.
#[derive(Debug, Clone, Serialize)]
pub struct Grid {
    pub needles: Vec<usize>,
    pub queries: Vec<usize>,
    pub depths: Vec<f64>,
    pub lengths: Vec<usize>,
    pub samples: usize,
    pub digits: usize,
    pub seed: u64,
}

/// Refuses a needle depth outside [0, 1] (0: the start of the context, 1: its end).
pub fn check_depths(depths: &[f64]) -> Result<()> {
    if let Some(d) = depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
        bail!("--depths: {d} is outside [0, 1]");
    }
    Ok(())
}

impl GridArgs {
    pub fn resolve(&self, loaded: &Loaded) -> Result<Grid> {
        let context = loaded.context();
        let lengths = self
            .lengths
            .clone()
            .unwrap_or_else(|| vec![loaded.recipe.data.seq_len]);
        if let Some(&l) = lengths.iter().find(|&&l| l > context) {
            bail!("--lengths: {l} tokens exceed the model's context of {context} tokens");
        }
        if let Some(&n) = self
            .needles
            .iter()
            .find(|&&n| n == 0 || n > EVAL_CITIES.len())
        {
            bail!(
                "--needles: {n} is outside 1..={} (one evaluation city each)",
                EVAL_CITIES.len()
            );
        }
        if self.queries.contains(&0) {
            bail!("--queries: at least one needle must be asked about");
        }
        check_depths(&self.depths)?;
        if self.samples == 0 {
            bail!("--samples must be positive");
        }
        let digits = self.digits.unwrap_or_else(|| loaded.needle_digits());
        if !(1..=18).contains(&digits) {
            bail!("--digits: {digits} is outside 1..=18");
        }
        Ok(Grid {
            needles: self.needles.clone(),
            queries: self.queries.clone(),
            depths: self.depths.clone(),
            lengths,
            samples: self.samples,
            digits,
            seed: self.seed,
        })
    }
}

/// One evaluation sample: the context and, per queried needle, its prompt and answer tokens.
pub struct Sample {
    pub context: NeedleContext,
    pub prompts: Vec<(Vec<u32>, Vec<u32>)>,
}

/// Builds sample `index` of a cell: `length` tokens per prompt, answer included.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    loaded: &Loaded,
    haystack: &TokenStream,
    needles: usize,
    queries: usize,
    depth: f64,
    length: usize,
    digits: usize,
    seed: u64,
    index: usize,
) -> Result<Sample> {
    let cell = format!("{needles}/{queries}/{depth}/{length}");
    let key = cell.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut rng = Rng::for_item(seed ^ key, index as u64);
    let drawn = draw(&mut rng, &EVAL_CITIES, needles, digits)?;
    let tok = &loaded.tokenizer;
    let asked: Vec<(Vec<u32>, Vec<u32>)> = drawn[..queries]
        .iter()
        .map(|n| {
            Ok((
                tok.encode(&query_text(&n.city))?,
                tok.encode(&answer_text(&n.number))?,
            ))
        })
        .collect::<Result<_>>()?;
    let longest = asked
        .iter()
        .map(|(q, a)| q.len() + a.len())
        .max()
        .unwrap_or(0);
    if longest >= length {
        bail!("a prompt of {length} tokens cannot hold a question and answer of {longest}");
    }
    let context_len = length - longest;
    let hay = random_text(haystack, &mut rng, context_len)?;
    let context = place(tok, &hay, drawn, queries, depth, context_len, &mut rng)
        .map_err(|e| anyhow::anyhow!("needle prompt of {length} tokens: {e}"))?;
    let prompts = asked
        .into_iter()
        .map(|(q, a)| {
            let mut prompt = context.tokens.clone();
            prompt.extend(q);
            (prompt, a)
        })
        .collect();
    Ok(Sample { context, prompts })
}

/// How greedy decoding after `prompt` does on `answer`: whether it produces it exactly, and the
/// number of answer tokens that are the argmax given the tokens before them.
pub fn answers(
    model: &Model,
    prompt: &[u32],
    answer: &[u32],
    device: &burn::tensor::Device,
) -> (bool, usize) {
    let ids: Vec<i64> = prompt
        .iter()
        .chain(&answer[..answer.len() - 1])
        .map(|&t| t as i64)
        .collect();
    let len = ids.len();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, len]), device);
    let picked = model
        .forward(input)
        .narrow(1, prompt.len() - 1, answer.len())
        .argmax(2)
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("argmax indices");
    let right = picked
        .iter()
        .zip(answer)
        .filter(|&(&p, &a)| p == a as i64)
        .count();
    (right == answer.len(), right)
}

#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub needles: usize,
    pub queries: usize,
    pub depth: f64,
    pub length: usize,
    /// Exact-match accuracy.
    pub accuracy: f64,
    /// Share of answer tokens predicted right given the ones before (a softer signal for
    /// small models; the paper reports exact match only).
    pub token_accuracy: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Retrieval {
    pub weights: String,
    pub attention: String,
    pub grid: Grid,
    pub cells: Vec<Cell>,
}

impl Retrieval {
    /// Mean exact-match accuracy of the cells that `keep` selects.
    pub fn mean(&self, keep: impl Fn(&Cell) -> bool) -> f64 {
        self.average(keep, |c| c.accuracy)
    }

    /// Mean answer-token accuracy of the cells that `keep` selects.
    pub fn token_mean(&self, keep: impl Fn(&Cell) -> bool) -> f64 {
        self.average(keep, |c| c.token_accuracy)
    }

    fn average(&self, keep: impl Fn(&Cell) -> bool, value: fn(&Cell) -> f64) -> f64 {
        let picked: Vec<f64> = self.cells.iter().filter(|c| keep(c)).map(value).collect();
        picked.iter().sum::<f64>() / picked.len().max(1) as f64
    }

    /// The (N, R) pairs measured.
    pub fn pairs(&self) -> Vec<(usize, usize)> {
        let mut pairs: Vec<(usize, usize)> =
            self.cells.iter().map(|c| (c.needles, c.queries)).collect();
        pairs.dedup();
        pairs
    }

    /// Accuracy by (N, R) row and depth column, averaged over lengths; or, with several
    /// lengths, by depth row and length column, averaged over (N, R) (the paper's Fig. 5).
    pub fn heatmap(&self, title: &str) -> Heatmap {
        let g = &self.grid;
        let depth_label = |d: &f64| format!("{:.0}%", d * 100.0);
        if g.lengths.len() > 1 {
            Heatmap {
                title: title.to_string(),
                x_label: "context length (tokens)".into(),
                y_label: "depth of the answer".into(),
                columns: g.lengths.iter().map(|l| l.to_string()).collect(),
                rows: g.depths.iter().map(depth_label).collect(),
                values: g
                    .depths
                    .iter()
                    .map(|&d| {
                        g.lengths
                            .iter()
                            .map(|&l| self.mean(|c| c.depth == d && c.length == l))
                            .collect()
                    })
                    .collect(),
            }
        } else {
            let pairs = self.pairs();
            Heatmap {
                title: title.to_string(),
                x_label: "depth of the answer".into(),
                y_label: "needles N, queried R".into(),
                columns: g.depths.iter().map(depth_label).collect(),
                rows: pairs.iter().map(|(n, r)| format!("N={n} R={r}")).collect(),
                values: pairs
                    .iter()
                    .map(|&(n, r)| {
                        g.depths
                            .iter()
                            .map(|&d| self.mean(|c| (c.needles, c.queries, c.depth) == (n, r, d)))
                            .collect()
                    })
                    .collect(),
            }
        }
    }

    pub fn print(&self) {
        let g = &self.grid;
        println!(
            "{}: multi-needle retrieval, {} samples per cell, {}-digit numbers, seed {}",
            self.weights, g.samples, g.digits, g.seed
        );
        for &length in &g.lengths {
            print!("length {length:>6} | ");
            for d in &g.depths {
                print!("{:>6.0}% ", d * 100.0);
            }
            println!("|   mean | tokens");
            for (n, r) in self.pairs() {
                print!("N={n:<2} R={r:<2}     | ");
                for &d in &g.depths {
                    let acc = self
                        .mean(|c| (c.needles, c.queries, c.depth, c.length) == (n, r, d, length));
                    print!("{acc:>7.2} ");
                }
                let row = |c: &Cell| (c.needles, c.queries, c.length) == (n, r, length);
                println!("| {:>6.2} | {:>6.2}", self.mean(row), self.token_mean(row));
            }
        }
    }
}

pub fn measure(loaded: &Loaded, grid: &Grid) -> Result<Retrieval> {
    measure_with(loaded, &loaded.model, grid)
}

/// Whether every sample of `needles` needles (each query count, depth and length of `grid`,
/// `samples` of each) fits the run's prompts: needles, haystack, question and answer.
pub fn fits(loaded: &Loaded, grid: &Grid, needles: usize, queries: &[usize]) -> Result<bool> {
    let haystack = loaded.validation()?;
    for &q in queries.iter().filter(|&&q| q <= needles) {
        for &length in &grid.lengths {
            for &depth in &grid.depths {
                for index in 0..grid.samples {
                    let s = sample(
                        loaded,
                        &haystack,
                        needles,
                        q,
                        depth,
                        length,
                        grid.digits,
                        grid.seed,
                        index,
                    );
                    if s.is_err() {
                        return Ok(false);
                    }
                }
            }
        }
    }
    Ok(true)
}

/// `grid` with the needle counts whose prompts do not fit the run's context left out (a model
/// of 128 positions holds fewer needles than one of 4,096); what was left out, to be said.
pub fn fit(loaded: &Loaded, grid: &Grid) -> Result<(Grid, Option<String>)> {
    let mut kept = Vec::new();
    for &n in &grid.needles {
        if fits(loaded, grid, n, &grid.queries)? {
            kept.push(n);
        }
    }
    let dropped: Vec<String> = grid
        .needles
        .iter()
        .filter(|n| !kept.contains(n))
        .map(usize::to_string)
        .collect();
    let note = (!dropped.is_empty()).then(|| {
        format!(
            "{} needles do not fit prompts of {:?} tokens (the context, question and answer): left out",
            dropped.join(", "),
            grid.lengths
        )
    });
    let queries = grid
        .queries
        .iter()
        .copied()
        .filter(|&q| kept.iter().any(|&n| q <= n))
        .collect();
    Ok((
        Grid {
            needles: kept,
            queries,
            ..grid.clone()
        },
        note,
    ))
}

/// Retrieval of `model` (the run's, or a modified copy of it).
pub fn measure_with(loaded: &Loaded, model: &Model, grid: &Grid) -> Result<Retrieval> {
    let haystack = loaded.validation()?;
    let mut cells = Vec::new();
    for &needles in &grid.needles {
        for &queries in grid.queries.iter().filter(|&&r| r <= needles) {
            for &length in &grid.lengths {
                for &depth in &grid.depths {
                    let (mut total, mut tokens) = (0.0, 0.0);
                    for index in 0..grid.samples {
                        let s = sample(
                            loaded,
                            &haystack,
                            needles,
                            queries,
                            depth,
                            length,
                            grid.digits,
                            grid.seed,
                            index,
                        )?;
                        for (prompt, answer) in &s.prompts {
                            let (exact, right) = answers(model, prompt, answer, &loaded.device);
                            total += exact as u8 as f64 / queries as f64;
                            tokens += right as f64 / (answer.len() * queries) as f64;
                        }
                    }
                    cells.push(Cell {
                        needles,
                        queries,
                        depth,
                        length,
                        accuracy: total / grid.samples as f64,
                        token_accuracy: tokens / grid.samples as f64,
                    });
                }
            }
        }
    }
    if cells.is_empty() {
        bail!("no cell to measure: every --queries value exceeds every --needles value");
    }
    Ok(Retrieval {
        weights: loaded.weights.to_string(),
        attention: loaded.recipe.model.attention.to_string(),
        grid: grid.clone(),
        cells,
    })
}

impl Measurement for Retrieval {
    fn metrics(&self) -> Vec<Metric> {
        self.cells
            .iter()
            .flat_map(|c| {
                let at = |m: Metric| {
                    m.at("length", c.length)
                        .at("needles", c.needles)
                        .at("queries", c.queries)
                        .at("depth", c.depth)
                };
                [
                    at(Metric::new("accuracy", c.accuracy)),
                    at(Metric::new("token_accuracy", c.token_accuracy)).unlisted(),
                ]
            })
            .collect()
    }
}

pub fn run(args: &NeedleArgs) -> Result<()> {
    let each = |dir: &Path| {
        let loaded = Loaded::open(dir, &args.common.device, args.common.dtype)?;
        measure(&loaded, &args.grid.resolve(&loaded)?)
    };
    if seeds::over_seeds(&args.common, "needle", args.plot.as_ref(), each)? {
        return Ok(());
    }
    let result = each(&args.common.run)?;
    if let Some(path) = &args.plot {
        let title = format!("Multi-needle retrieval accuracy ({})", result.attention);
        plot::write(path, &result.heatmap(&title).svg())?;
    }
    emit(args.common.json, &result, Retrieval::print)
}
