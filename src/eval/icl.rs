//! `diffzoo eval icl`: many-shot in-context classification (the paper's §3.5, Fig. 6) and its
//! robustness to the order of the demonstrations (Fig. 7).
//!
//! `--data` holds demonstrations and `--test` the items to classify, one `{"text", "label"}` per
//! line; the label set is every label of either file. For k demonstrations (`--shots 1,2,4,…`,
//! or `auto`: 1, 2, 4, … while the prompt fits the model's context) the prompt of a test item is
//!
//! ```text
//! render(d₁) … render(d_k) prefix(item)      render = the --template with {text} and {label}
//!                                            filled; prefix = the template up to {label}
//! ```
//!
//! and the prediction is the label of highest log-likelihood `Σ log p(label token | prompt, …)`
//! among all labels (constrained to the label set, scored as `eval choice` scores a choice:
//! whitespace ending the prefix moves to the label). The k demonstrations are the first k of one
//! seeded permutation of the file (nested as k grows). Each demonstration and each item prefix
//! is tokenized on its own and the ids concatenated, so that the demonstrations are computed
//! once per prompt through the KV cache; each test item continues after them and each label
//! after the item, each truncated away again: a prompt costs one prefill, not one per label.
//!
//! With `--orders K` each k is measured under K orders of its demonstrations: seeded random
//! permutations (`--arrangement random`), or arranged alternately by class (`alternate`: the
//! labels in a seeded order, one demonstration of each in turn, each label's own in a seeded
//! order); reported as the mean, best and worst accuracy and their spread. Accuracy comes with
//! its 95% interval over the test items (Wilson's, a share) or, over K orders, a t interval over
//! the orders.

use super::choice::continue_scores;
use super::seeds::{self, Measurement, Metric};
use super::{Common, emit, id_tensor};
use crate::run;
use crate::stats::{self, Estimate};
use anyhow::{Result, anyhow, bail};
use burn::tensor::Device;
use diffzoo_datasets::{Rng, TextTokenizer};
use diffzoo_models::Model;
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct IclArgs {
    #[command(flatten)]
    pub common: Common,
    /// Demonstrations, one {"text": …, "label": …} per line.
    #[arg(long)]
    pub data: PathBuf,
    /// Items to classify, in the same shape.
    #[arg(long)]
    pub test: PathBuf,
    /// Numbers of demonstrations, comma-separated, or `auto` (1, 2, 4, … while the prompt fits
    /// the model's context).
    #[arg(long, default_value = "auto")]
    pub shots: String,
    /// Orders of the demonstrations measured at each number of them.
    #[arg(long, default_value_t = 1)]
    pub orders: usize,
    /// `random` (seeded permutations) or `alternate` (by class, in turn).
    #[arg(long, default_value = "random")]
    pub arrangement: String,
    /// A demonstration's text: `{text}` and then `{label}`, each once.
    #[arg(long, default_value = diffzoo_datasets::icl::TEMPLATE)]
    pub template: String,
    /// Seed of the demonstrations drawn and of their orders.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Classify at most this many test items.
    #[arg(long)]
    pub limit: Option<usize>,
}

/// A labelled line.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub text: String,
    pub label: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrangement {
    Random,
    Alternate,
}

/// Accuracy at one number of demonstrations.
#[derive(Debug, Serialize)]
pub struct ShotScore {
    pub shots: usize,
    /// The longest prompt, demonstrations and item prefix, in tokens.
    pub prompt_tokens: usize,
    /// Mean accuracy over the orders.
    pub accuracy: f64,
    /// With one order: over the test items; with several: over the orders.
    pub ci95: Option<[f64; 2]>,
    /// Each order's accuracy.
    pub orders: Vec<f64>,
    pub best: f64,
    pub worst: f64,
    /// best − worst.
    pub spread: f64,
}

#[derive(Debug, Serialize)]
pub struct IclResult {
    pub weights: String,
    pub labels: Vec<String>,
    /// 1 / the number of labels.
    pub chance: f64,
    pub test_items: usize,
    pub arrangement: Arrangement,
    pub seed: u64,
    pub scores: Vec<ShotScore>,
}

impl Measurement for IclResult {
    fn metrics(&self) -> Vec<Metric> {
        self.scores
            .iter()
            .flat_map(|s| {
                let mut m = vec![Metric::new("accuracy", s.accuracy).at("shots", s.shots)];
                if s.orders.len() > 1 {
                    m.push(Metric::new("spread", s.spread).at("shots", s.shots));
                    m.push(Metric::new("best", s.best).at("shots", s.shots).unlisted());
                    m.push(
                        Metric::new("worst", s.worst)
                            .at("shots", s.shots)
                            .unlisted(),
                    );
                }
                m
            })
            .collect()
    }
}

pub fn run(args: &IclArgs) -> Result<()> {
    let arrangement = match args.arrangement.as_str() {
        "random" => Arrangement::Random,
        "alternate" => Arrangement::Alternate,
        other => bail!("--arrangement {other}: expected random or alternate"),
    };
    if args.orders == 0 {
        bail!("--orders 0: measure at least one order");
    }
    let (prefix_template, _) = split_template(&args.template)?;
    let demos = read_examples(&args.data, None)?;
    let tests = read_examples(&args.test, args.limit)?;
    let labels = label_set(&demos, &tests)?;
    let common = &args.common;
    let setup = Setup {
        args,
        arrangement,
        prefix_template,
        demos: &demos,
        tests: &tests,
        labels: &labels,
    };
    let each = |dir: &Path| setup.measure(dir);
    if seeds::over_seeds(common, "icl", None, each)? {
        return Ok(());
    }
    emit(common.json, &each(&common.run)?, |r| {
        let orders = r.scores.first().map_or(0, |s| s.orders.len());
        println!(
            "{}: {} labels (chance {:.3}), {} test items, {orders} {} order(s) of the demonstrations (seed {})",
            r.weights,
            r.labels.len(),
            r.chance,
            r.test_items,
            match r.arrangement {
                Arrangement::Random => "random",
                Arrangement::Alternate => "alternating by label",
            },
            r.seed
        );
        println!("shots  tokens  accuracy  95% interval          best    worst  spread");
        for s in &r.scores {
            let interval = s
                .ci95
                .map_or("—".to_string(), |[lo, hi]| format!("{lo:.4} to {hi:.4}"));
            println!(
                "{:>5}  {:>6}  {:>8.4}  {interval:<20}  {:.4}  {:.4}  {:.4}",
                s.shots, s.prompt_tokens, s.accuracy, s.best, s.worst, s.spread
            );
        }
    })
}

/// The template's text before `{label}` (with `{text}` in it), and after; refused unless each
/// placeholder is there once, `{text}` first.
pub fn split_template(template: &str) -> Result<(&str, &str)> {
    let count = |p: &str| template.matches(p).count();
    if count("{text}") != 1 || count("{label}") != 1 {
        bail!("--template {template:?} must hold `{{text}}` and then `{{label}}`, each once");
    }
    let (before, after) = template.split_once("{label}").expect("counted");
    if !before.contains("{text}") {
        bail!("--template {template:?}: `{{text}}` must come before `{{label}}`");
    }
    Ok((before, after))
}

/// The lines of `file` (the first `limit`); a malformed one named by file and line.
pub fn read_examples(file: &Path, limit: Option<usize>) -> Result<Vec<Example>> {
    super::read_jsonl(file, limit, "examples", |line, _| parse_example(line))
}

fn parse_example(value: &Value) -> Result<Example> {
    let field = |key: &str| -> Result<String> {
        match value.get(key) {
            Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
            Some(Value::String(_)) => bail!("`{key}` is empty"),
            Some(other) => bail!("`{key}` = {other} is not a string"),
            None => bail!("`{key}` is missing (each line is {{\"text\": …, \"label\": …}})"),
        }
    };
    Ok(Example {
        text: field("text")?,
        label: field("label")?,
    })
}

/// Every label of the demonstrations, then those only the test items have, in order of first
/// appearance; at least two.
fn label_set(demos: &[Example], tests: &[Example]) -> Result<Vec<String>> {
    let mut labels: Vec<String> = Vec::new();
    for e in demos.iter().chain(tests) {
        if !labels.contains(&e.label) {
            labels.push(e.label.clone());
        }
    }
    if labels.len() < 2 {
        bail!(
            "the demonstrations and test items hold {} label(s): classification needs two or more",
            labels.len()
        );
    }
    Ok(labels)
}

/// What every run is measured with.
struct Setup<'a> {
    args: &'a IclArgs,
    arrangement: Arrangement,
    prefix_template: &'a str,
    demos: &'a [Example],
    tests: &'a [Example],
    labels: &'a [String],
}

/// The tokenized material of one run's measurement.
struct Tokens {
    /// Each demonstration: first in a prompt (`[0]`), and after another (`[1]`, the whitespace
    /// between demonstrations in front).
    demos: Vec<[Vec<u32>; 2]>,
    /// Each test item: with no demonstration before it (`[0]`), and after them (`[1]`).
    items: Vec<[ItemTokens; 2]>,
    /// The index of each test item's label.
    gold: Vec<usize>,
}

/// A test item's prompt (whitespace ending it left to the labels) and each label's tokens after
/// it.
struct ItemTokens {
    prefix: Vec<u32>,
    labels: Vec<Vec<u32>>,
}

impl Tokens {
    /// The demonstrations `arranged`, in their order.
    fn demos(&self, arranged: &[usize]) -> Vec<u32> {
        arranged
            .iter()
            .enumerate()
            .flat_map(|(p, &d)| self.demos[d][usize::from(p > 0)].iter().copied())
            .collect()
    }

    /// The test items after `shots` demonstrations.
    fn items(&self, shots: usize) -> impl Iterator<Item = &ItemTokens> {
        self.items.iter().map(move |i| &i[usize::from(shots > 0)])
    }

    /// The most tokens the demonstrations `chosen` take in any order: one of them opens the
    /// prompt (without a lead), each other one follows another.
    fn longest_demos(&self, chosen: &[usize]) -> usize {
        let following: usize = chosen.iter().map(|&d| self.demos[d][1].len()).sum();
        chosen
            .iter()
            .map(|&d| following - self.demos[d][1].len() + self.demos[d][0].len())
            .max()
            .unwrap_or(0)
    }
}

impl Setup<'_> {
    fn measure(&self, dir: &Path) -> Result<IclResult> {
        let recipe = run::run_recipe(dir)?;
        let tokenizer = run::run_tokenizer(dir)?;
        let common = &self.args.common;
        let (model, weights, device, _) =
            run::load_model_on(dir, &recipe, &common.device, common.dtype)?;
        let tokens = self.tokenize(&tokenizer)?;
        let capacity = model.cache().capacity();
        let pool = permutation(self.demos.len(), self.args.seed);
        let shots = self.shots(&tokens, &pool, capacity)?;
        let mut scores = Vec::with_capacity(shots.len());
        for &k in &shots {
            let chosen = &pool[..k];
            let mut orders = Vec::with_capacity(self.args.orders);
            let mut first_outcomes = Vec::new();
            for order in 0..self.args.orders {
                let arranged = self.arrange(chosen, order as u64);
                let outcomes = classify(&model, &device, &tokens, &arranged);
                orders.push(mean(&outcomes));
                if order == 0 {
                    first_outcomes = outcomes;
                }
            }
            let estimate: Estimate = if orders.len() > 1 {
                stats::estimate(&orders)
            } else {
                stats::proportion(&first_outcomes)
            };
            let best = orders.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let worst = orders.iter().copied().fold(f64::INFINITY, f64::min);
            scores.push(ShotScore {
                shots: k,
                prompt_tokens: prompt_tokens(&tokens, chosen),
                accuracy: estimate.mean,
                ci95: estimate.ci95,
                orders,
                best,
                worst,
                spread: best - worst,
            });
        }
        Ok(IclResult {
            weights: weights.to_string(),
            labels: self.labels.to_vec(),
            chance: 1.0 / self.labels.len() as f64,
            test_items: self.tests.len(),
            arrangement: self.arrangement,
            seed: self.args.seed,
            scores,
        })
    }

    /// Each piece of a prompt (a demonstration, an item, a label) is encoded on its own, the
    /// whitespace between pieces in front of the piece after it (as the label's is): a
    /// pre-tokenizer splits a run of whitespace by what follows it, so `…\n\nInput` gives the
    /// tokens the joined text gives, where a demonstration encoded with its `\n\n` would end in
    /// a token of document ends.
    fn tokenize(&self, tokenizer: &TextTokenizer) -> Result<Tokens> {
        let rendered: Vec<String> = self
            .demos
            .iter()
            .map(|e| diffzoo_datasets::icl::render(&self.args.template, &e.text, &e.label))
            .collect();
        // The whitespace ending every demonstration (the template's), moved to the next piece;
        // demonstrations ending differently keep theirs.
        let trailing = |r: &str| r[r.trim_end().len()..].to_string();
        let lead = rendered.first().map_or(String::new(), |r| trailing(r));
        let lead = match rendered.iter().all(|r| trailing(r) == lead) {
            true => lead,
            false => String::new(),
        };
        let demos = rendered
            .iter()
            .map(|r| {
                let body = &r[..r.len() - lead.len()];
                Ok([
                    tokenizer.encode(body)?,
                    tokenizer.encode(&format!("{lead}{body}"))?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let items = self
            .tests
            .iter()
            .enumerate()
            .map(|(j, item)| {
                let at = || format!("{}: item {}", self.args.test.display(), j + 1);
                let raw = diffzoo_datasets::fill(self.prefix_template, &[("text", &item.text)]);
                Ok([
                    self.item_tokens(tokenizer, "", &raw, &at)?,
                    self.item_tokens(tokenizer, &lead, &raw, &at)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let gold = self
            .tests
            .iter()
            .map(|t| {
                self.labels
                    .iter()
                    .position(|l| *l == t.label)
                    .expect("in the set")
            })
            .collect();
        Ok(Tokens { demos, items, gold })
    }

    /// An item's prompt `raw` after `lead` and each label after it. Whitespace ending the prompt
    /// belongs to the label (as `eval choice` scores).
    fn item_tokens(
        &self,
        tokenizer: &TextTokenizer,
        lead: &str,
        raw: &str,
        at: &dyn Fn() -> String,
    ) -> Result<ItemTokens> {
        let prefix = format!("{lead}{}", raw.trim_end());
        let moved = &raw[raw.trim_end().len()..];
        let ids = tokenizer.encode(&prefix)?;
        if ids.is_empty() {
            bail!("{}: its prompt encodes to no token", at());
        }
        let labels = self
            .labels
            .iter()
            .map(|label| {
                let whole = tokenizer.encode(&format!("{prefix}{moved}{label}"))?;
                let ids = whole.get(ids.len()..).unwrap_or_default().to_vec();
                if ids.is_empty() {
                    bail!("{}: the label {label:?} adds no token to its prompt", at());
                }
                Ok(ids)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ItemTokens {
            prefix: ids,
            labels,
        })
    }

    /// The numbers of demonstrations to measure, each checked to fit before any is measured.
    fn shots(&self, tokens: &Tokens, pool: &[usize], capacity: usize) -> Result<Vec<usize>> {
        let fits = |k: usize| longest_fed(tokens, &pool[..k]) <= capacity;
        if !fits(0) {
            bail!(
                "a test item and its longest label take {} tokens, beyond the model's context of {capacity}",
                longest_fed(tokens, &[])
            );
        }
        if self.args.shots == "auto" {
            if !fits(1.min(pool.len())) {
                bail!(
                    "one demonstration and a test item take {} tokens, beyond the model's context of {capacity}: no prompt holds a demonstration",
                    longest_fed(tokens, &pool[..1])
                );
            }
            let mut shots = Vec::new();
            let mut k = 1;
            while k <= pool.len() && fits(k) {
                shots.push(k);
                k *= 2;
            }
            return Ok(shots);
        }
        let shots: Vec<usize> = super::list(&self.args.shots)
            .map_err(|e| anyhow!("--shots: {e} (give numbers such as 1,2,4 or `auto`)"))?;
        for &k in &shots {
            if k > pool.len() {
                bail!(
                    "--shots {k}: {} holds {} demonstrations",
                    self.args.data.display(),
                    pool.len()
                );
            }
            if !fits(k) {
                let most = (0..=pool.len())
                    .take_while(|&n| fits(n))
                    .last()
                    .unwrap_or(0);
                bail!(
                    "--shots {k}: the prompt takes {} tokens, beyond the model's context of {capacity} (at most {most} demonstrations fit)",
                    longest_fed(tokens, &pool[..k])
                );
            }
        }
        Ok(shots)
    }

    /// Order `order` of the demonstrations `chosen`.
    fn arrange(&self, chosen: &[usize], order: u64) -> Vec<usize> {
        let mut rng = Rng::for_item(self.args.seed ^ 0x1c1, order);
        match self.arrangement {
            Arrangement::Random => {
                let mut out = chosen.to_vec();
                rng.shuffle(&mut out);
                out
            }
            Arrangement::Alternate => {
                let mut by_label: Vec<Vec<usize>> = self
                    .labels
                    .iter()
                    .map(|l| {
                        chosen
                            .iter()
                            .copied()
                            .filter(|&d| self.demos[d].label == *l)
                            .collect()
                    })
                    .filter(|v: &Vec<usize>| !v.is_empty())
                    .collect();
                rng.shuffle(&mut by_label);
                for group in &mut by_label {
                    rng.shuffle(group);
                }
                let mut out = Vec::with_capacity(chosen.len());
                for turn in 0.. {
                    let before = out.len();
                    out.extend(by_label.iter().filter_map(|g| g.get(turn).copied()));
                    if out.len() == before {
                        break;
                    }
                }
                out
            }
        }
    }
}

/// Whether each test item is classified right after the demonstrations `arranged`.
fn classify(model: &Model, device: &Device, tokens: &Tokens, arranged: &[usize]) -> Vec<bool> {
    label_scores(model, device, tokens, arranged)
        .iter()
        .zip(&tokens.gold)
        .map(|(scores, &gold)| argmax(scores) == gold)
        .collect()
}

/// Each test item's label log-likelihoods after the demonstrations `arranged`: the
/// demonstrations once through the KV cache, each item after them and each label after the item,
/// each truncated away again (the cache's buffers written in place, never copied).
fn label_scores(
    model: &Model,
    device: &Device,
    tokens: &Tokens,
    arranged: &[usize],
) -> Vec<Vec<f64>> {
    let demos = tokens.demos(arranged);
    let mut cache = model.cache();
    if !demos.is_empty() {
        model.forward_cached_last(id_tensor(&demos, device), &mut cache);
    }
    tokens
        .items(arranged.len())
        .map(|item| {
            let prefix = &item.prefix;
            let last = model.forward_cached_last(id_tensor(prefix, device), &mut cache);
            let scores = continue_scores(model, &mut cache, last, &item.labels, device);
            cache.truncate(demos.len());
            scores
        })
        .collect()
}

/// The most tokens fed for one test item after the demonstrations `chosen` (in any order):
/// theirs, the item's prefix and its longest label but the last token (which predicts nothing
/// scored).
fn longest_fed(tokens: &Tokens, chosen: &[usize]) -> usize {
    let item = tokens
        .items(chosen.len())
        .map(|i| i.prefix.len() + i.labels.iter().map(Vec::len).max().unwrap_or(1) - 1)
        .max()
        .unwrap_or(0);
    tokens.longest_demos(chosen) + item
}

/// The longest prompt: the demonstrations `chosen` and the longest item prefix.
fn prompt_tokens(tokens: &Tokens, chosen: &[usize]) -> usize {
    tokens.longest_demos(chosen)
        + tokens
            .items(chosen.len())
            .map(|i| i.prefix.len())
            .max()
            .unwrap_or(0)
}

/// `0..n` in the order seed `seed` gives.
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut out: Vec<usize> = (0..n).collect();
    Rng::new(seed).shuffle(&mut out);
    out
}

fn mean(outcomes: &[bool]) -> f64 {
    outcomes.iter().filter(|&&c| c).count() as f64 / outcomes.len() as f64
}

fn argmax(scores: &[f64]) -> usize {
    scores
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_need_text_then_label_once() {
        assert_eq!(
            split_template("Q: {text}\nA: {label}\n").unwrap(),
            ("Q: {text}\nA: ", "\n")
        );
        for bad in ["{label} {text}", "{text}", "{text} {label} {label}"] {
            assert!(split_template(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn malformed_lines_are_named_by_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("demos.jsonl");
        std::fs::write(
            &file,
            "{\"text\": \"a\", \"label\": \"x\"}\n\n{\"text\": \"b\"}\n",
        )
        .unwrap();
        let err = read_examples(&file, None).unwrap_err().to_string();
        assert!(
            err.contains("demos.jsonl:3") && err.contains("`label` is missing"),
            "{err}"
        );
        std::fs::write(&file, "{\"text\": 3, \"label\": \"x\"}\n").unwrap();
        let err = read_examples(&file, None).unwrap_err().to_string();
        assert!(err.contains(":1: `text` = 3 is not a string"), "{err}");
        std::fs::write(&file, "not json\n").unwrap();
        assert!(
            read_examples(&file, None)
                .unwrap_err()
                .to_string()
                .contains(":1:")
        );
    }

    #[test]
    fn labels_scored_through_the_shared_cache_score_as_scored_alone() {
        use diffzoo_models::{AttentionKind, ModelConfig};
        let device = burn::tensor::Device::flex();
        device.seed(3);
        for kind in AttentionKind::ALL {
            let model = ModelConfig::new(kind, 32, 2, 4, 64, 64).init(&device);
            let ids = |seed: u32, n: usize| -> Vec<u32> {
                (0..n as u32).map(|i| (seed * 31 + i * 17) % 64).collect()
            };
            // Each piece with and without its lead (one token more).
            let piece = |seed: u32, n: usize| [ids(seed, n), ids(seed + 40, n + 1)];
            let item = |seed: u32, n: usize, labels: &[(u32, usize)]| {
                [0, 40].map(|lead| ItemTokens {
                    prefix: ids(seed + lead, n),
                    labels: labels.iter().map(|&(s, m)| ids(s + lead, m)).collect(),
                })
            };
            let tokens = Tokens {
                demos: vec![piece(1, 7), piece(2, 5), piece(3, 9)],
                items: vec![item(4, 4, &[(6, 1), (7, 3)]), item(5, 6, &[(8, 2), (9, 1)])],
                gold: vec![0, 1],
            };
            let arranged = [2, 0, 1];
            let cached = label_scores(&model, &device, &tokens, &arranged);
            let demos = tokens.demos(&arranged);
            assert_eq!(
                demos.len(),
                9 + 8 + 6,
                "the first alone, the others with their lead"
            );
            for (j, scores) in cached.iter().enumerate() {
                for (l, &score) in scores.iter().enumerate() {
                    let item = &tokens.items[j][1];
                    let label = &item.labels[l];
                    let all: Vec<u32> = demos
                        .iter()
                        .copied()
                        .chain(item.prefix.clone())
                        .chain(label.clone())
                        .collect();
                    let alone =
                        super::super::choice::teacher_forced(&model, &all, label.len(), &device);
                    assert!(
                        (score - alone).abs() < 1e-4,
                        "{kind}: item {j} label {l}: {score} through the cache, {alone} alone"
                    );
                }
            }
        }
    }

    /// With the default template (demonstrations ending in a blank line) a byte-level BPE trained
    /// on episodes learns a token for the blank line that ends a document; pieces encoded with
    /// the whitespace in front give the joined prompt's tokens, which that token is not in.
    #[test]
    fn pieces_encode_as_the_joined_prompt_does() {
        let examples: Vec<Example> = ["red", "blue", "green", "red", "blue"]
            .iter()
            .enumerate()
            .map(|(i, l)| Example {
                text: format!("item number {i}"),
                label: l.to_string(),
            })
            .collect();
        let template = diffzoo_datasets::icl::TEMPLATE;
        let render = |e: &Example| diffzoo_datasets::icl::render(template, &e.text, &e.label);
        let episodes: Vec<String> = (0..200)
            .map(|i| render(&examples[i % 5]) + &render(&examples[(i + 2) % 5]))
            .collect();
        let tokenizer = TextTokenizer::train_bpe(episodes.iter().map(String::as_str), 300).unwrap();
        let blank = tokenizer.encode("\n\n").unwrap();
        assert_eq!(
            blank.len(),
            1,
            "a token for the blank line ending a document"
        );

        let (demos, tests) = (&examples[..3], &examples[3..]);
        let labels = label_set(demos, tests).unwrap();
        let args = test_args(template);
        let (prefix_template, _) = split_template(template).unwrap();
        let setup = Setup {
            args: &args,
            arrangement: Arrangement::Random,
            prefix_template,
            demos,
            tests,
            labels: &labels,
        };
        let tokens = setup.tokenize(&tokenizer).unwrap();
        let arranged = [2, 0, 1];
        let joined: String = arranged.iter().map(|&d| render(&demos[d])).collect();
        for (j, item) in tests.iter().enumerate() {
            let prompt = joined.clone() + prefix_template.replace("{text}", &item.text).trim_end();
            let ours: Vec<u32> = tokens
                .demos(&arranged)
                .into_iter()
                .chain(tokens.items[j][1].prefix.clone())
                .collect();
            let whole = tokenizer.encode(&prompt).unwrap();
            assert_eq!(ours, whole, "item {j}");
            assert!(!whole.contains(&blank[0]));
            // Each label continues that prompt as the whole text does.
            for (l, label) in labels.iter().enumerate() {
                let with = tokenizer.encode(&format!("{prompt} {label}")).unwrap();
                assert_eq!(tokens.items[j][1].labels[l], with[whole.len()..], "{label}");
            }
        }
        // The longest order is counted exactly (the opening demonstration has no lead).
        let orders = [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ];
        let longest = orders.map(|o| tokens.demos(&o).len()).into_iter().max();
        assert_eq!(Some(tokens.longest_demos(&[0, 1, 2])), longest);
        assert_eq!(tokens.longest_demos(&[]), 0);
        // Without demonstrations the item has no lead.
        let alone = prefix_template.replace("{text}", &tests[0].text);
        assert_eq!(
            tokens.items[0][0].prefix,
            tokenizer.encode(alone.trim_end()).unwrap()
        );
    }

    fn test_args(template: &str) -> IclArgs {
        IclArgs {
            common: Common {
                run: PathBuf::new(),
                device: "cpu".into(),
                dtype: None,
                json: false,
            },
            data: PathBuf::new(),
            test: PathBuf::new(),
            shots: "auto".into(),
            orders: 1,
            arrangement: "alternate".into(),
            template: template.into(),
            seed: 5,
            limit: None,
        }
    }

    #[test]
    fn alternate_orders_take_each_label_in_turn() {
        let demos: Vec<Example> = ["x", "x", "x", "y", "y", "z"]
            .iter()
            .enumerate()
            .map(|(i, l)| Example {
                text: format!("t{i}"),
                label: l.to_string(),
            })
            .collect();
        let labels = label_set(&demos, &[]).unwrap();
        let args = test_args(diffzoo_datasets::icl::TEMPLATE);
        let setup = Setup {
            args: &args,
            arrangement: Arrangement::Alternate,
            prefix_template: "",
            demos: &demos,
            tests: &[],
            labels: &labels,
        };
        let chosen: Vec<usize> = (0..6).collect();
        let order = setup.arrange(&chosen, 0);
        let seq: Vec<&str> = order.iter().map(|&d| demos[d].label.as_str()).collect();
        // Three labels in turn while all have one left, then two, then one.
        assert_eq!(seq.len(), 6);
        let first: std::collections::BTreeSet<&str> = seq[..3].iter().copied().collect();
        assert_eq!(first.len(), 3, "{seq:?}");
        assert_ne!(seq[3], seq[4], "{seq:?}");
        assert_eq!(seq[5], "x", "{seq:?}");
        assert_eq!(order, setup.arrange(&chosen, 0), "seeded");
        let random = Setup {
            arrangement: Arrangement::Random,
            ..setup
        };
        let orders: std::collections::BTreeSet<Vec<usize>> =
            (0..10).map(|o| random.arrange(&chosen, o)).collect();
        assert!(orders.len() > 5, "orders differ");
    }
}
