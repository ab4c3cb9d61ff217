//! `diffzoo generate`: sample text from a run's model with a KV cache.
//!
//! The prompt is prefilled in one pass, then each new token costs one position of attention
//! against the cached keys and values (`diffzoo_models::cache`). The prompt plus `--max-tokens`
//! must fit the model's context (`max_seq_len`); beyond it `--sliding-window` recomputes the last
//! `max_seq_len` tokens for every further token, as a model without a cache would. Sampling:
//! greedy at temperature 0, else the temperature's softmax restricted to the `--top-k` most likely
//! tokens and then to the smallest set whose probability reaches `--top-p`. Generation stops at
//! the end-of-text token, at `--stop`, or after `--max-tokens`.

use crate::{device, run};
use anyhow::{Result, anyhow, bail};
use burn::tensor::{Int, Tensor, TensorData};
use diffzoo_datasets::Rng;
use diffzoo_models::Model;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Run directory.
    #[arg(long)]
    pub run: PathBuf,
    /// Text to continue (empty: start from the end-of-text token).
    #[arg(long, default_value = "")]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 decodes greedily.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities sum to p (nucleus sampling).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Stop once the completion contains this text (it is cut there).
    #[arg(long)]
    pub stop: Option<String>,
    /// Go on past the model's context: every further token recomputes the last max_seq_len.
    #[arg(long)]
    pub sliding_window: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print one JSON object (tokens, text, timings) instead of streaming the text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Generation {
    weights: String,
    prompt: String,
    completion: String,
    tokens: Vec<u32>,
    /// `end-of-text`, `stop` or `max-tokens`.
    stopped: Ending,
    timings: Timings,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Ending {
    EndOfText,
    #[serde(rename = "stop")]
    StopText,
    MaxTokens,
}

#[derive(Debug, Serialize)]
struct Timings {
    prompt_tokens: usize,
    prefill_seconds: f64,
    prefill_tokens_per_sec: Option<f64>,
    /// Tokens computed one at a time after the prefill (the last sampled one needs none).
    decode_tokens: usize,
    decode_seconds: f64,
    decode_tokens_per_sec: Option<f64>,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    check_sampling(args)?;
    let recipe = run::run_recipe(&args.run)?;
    let tokenizer = run::run_tokenizer(&args.run)?;
    let context = recipe.model_config().max_seq_len;
    let prompt = if args.prompt.is_empty() {
        vec![tokenizer.eot_id()]
    } else {
        tokenizer.encode(&args.prompt)?
    };
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    if prompt.len() + args.max_tokens > context && !args.sliding_window {
        bail!(
            "the prompt's {} tokens and --max-tokens {} exceed the model's context of {context} \
             positions (model.max_seq_len); ask for fewer tokens, or pass --sliding-window to \
             recompute the last {context} tokens for each token beyond it",
            prompt.len(),
            args.max_tokens
        );
    }
    let device = device::parse(&args.device)?;
    let (model, weights) = run::load_model(&args.run, &recipe, &device)?;
    if !args.json {
        eprintln!("({weights})");
        print!("{}", args.prompt);
    }
    let mut decoder = Decoder::new(&model, &device);
    let started = Instant::now();
    let mut logits = decoder.prefill(&prompt, context)?;
    let prefill_seconds = started.elapsed().as_secs_f64();
    let decoding = Instant::now();
    let mut rng = Rng::new(args.seed);
    let mut tokens: Vec<u32> = Vec::new();
    let mut completion = String::new();
    // The streamed prefix of the completion.
    let mut printed = String::new();
    let mut stopped = Ending::MaxTokens;
    for _ in 0..args.max_tokens {
        let next = pick(logits, args.temperature, args.top_k, args.top_p, &mut rng);
        if next == tokenizer.eot_id() {
            stopped = Ending::EndOfText;
            break;
        }
        tokens.push(next);
        let text = tokenizer.decode(&tokens)?;
        let cut = args.stop.as_ref().and_then(|stop| text.find(stop.as_str()));
        let text = cut.map_or(text.as_str(), |at| &text[..at]).to_string();
        if !args.json {
            stream(&text, &mut printed)?;
        }
        completion = text;
        if cut.is_some() {
            stopped = Ending::StopText;
            break;
        }
        if tokens.len() == args.max_tokens {
            break;
        }
        logits = decoder.step(&prompt, &tokens, context)?;
    }
    let decode_seconds = decoding.elapsed().as_secs_f64();
    let timings = Timings {
        prompt_tokens: prompt.len(),
        prefill_seconds,
        prefill_tokens_per_sec: rate(prompt.len(), prefill_seconds),
        decode_tokens: decoder.steps,
        decode_seconds,
        decode_tokens_per_sec: rate(decoder.steps, decode_seconds),
    };
    if args.json {
        let out = Generation {
            weights: weights.to_string(),
            prompt: args.prompt.clone(),
            completion,
            tokens,
            stopped,
            timings,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        // What was held back as an incomplete character stays as decoded.
        if let Some(rest) = completion.strip_prefix(printed.as_str()) {
            print!("{rest}");
        }
        println!();
        let show = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.1}"));
        eprintln!(
            "(prefill {} tokens/s, decode {} tokens/s)",
            show(timings.prefill_tokens_per_sec),
            show(timings.decode_tokens_per_sec)
        );
    }
    Ok(())
}

/// Prints what `text` adds to the `printed` text, holding back a trailing replacement character
/// (a byte-level token that ends inside a UTF-8 sequence, completed by the next one). A text that
/// rewrites the printed prefix prints nothing more.
fn stream(text: &str, printed: &mut String) -> Result<()> {
    let ready = text.trim_end_matches('\u{FFFD}');
    if let Some(rest) = ready.strip_prefix(printed.as_str())
        && !rest.is_empty()
    {
        print!("{rest}");
        std::io::stdout().flush()?;
        printed.push_str(rest);
    }
    Ok(())
}

/// Tokens per second; none for no tokens.
fn rate(tokens: usize, seconds: f64) -> Option<f64> {
    (tokens > 0).then(|| tokens as f64 / seconds)
}

/// Sampling options outside their ranges are refused by name.
fn check_sampling(args: &GenerateArgs) -> Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!(
            "--temperature {}: expected a finite value ≥ 0",
            args.temperature
        );
    }
    if args.top_k == Some(0) {
        bail!("--top-k 0: expected at least 1");
    }
    if let Some(p) = args.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        bail!("--top-p {p}: expected a probability in (0, 1]");
    }
    if args.stop.as_deref() == Some("") {
        bail!("--stop: expected a non-empty text");
    }
    Ok(())
}

/// The model with its KV cache: logits of the position after the tokens fed so far.
struct Decoder<'a> {
    model: &'a Model,
    device: &'a burn::tensor::Device,
    cache: diffzoo_models::KvCache,
    /// Positions computed one at a time.
    steps: usize,
}

impl<'a> Decoder<'a> {
    fn new(model: &'a Model, device: &'a burn::tensor::Device) -> Self {
        Self {
            model,
            device,
            cache: model.cache(),
            steps: 0,
        }
    }

    /// Feeds `ids` after what the cache holds; the last position's logits.
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let n = ids.len();
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), self.device);
        let logits = self.model.forward_cached(input, &mut self.cache);
        let v = logits.dims()[2];
        logits
            .narrow(1, n - 1, 1)
            .reshape([v])
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow!("reading the logits: {e:?}"))
    }

    /// The prompt in one pass (its last `context` tokens, which only `--sliding-window` lets
    /// be fewer than all).
    fn prefill(&mut self, prompt: &[u32], context: usize) -> Result<Vec<f32>> {
        self.feed(&prompt[prompt.len().saturating_sub(context)..])
    }

    /// The logits after the newest of `tokens` (which follow `prompt`). Once the cache is full
    /// (only with `--sliding-window`), the last `context` tokens are computed afresh.
    fn step(&mut self, prompt: &[u32], tokens: &[u32], context: usize) -> Result<Vec<f32>> {
        self.steps += 1;
        let newest = &tokens[tokens.len() - 1..];
        if self.cache.len() < self.cache.capacity() {
            return self.feed(newest);
        }
        let all: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
        self.cache = self.model.cache();
        self.feed(&all[all.len() - context..])
    }
}

/// Picks the next token from the last position's logits.
fn pick(
    logits: Vec<f32>,
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    rng: &mut Rng,
) -> u32 {
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32)
    };
    if temperature <= 0.0 {
        return argmax(&logits);
    }
    let mut ranked: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l as f64 / temperature))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    ranked.truncate(top_k.unwrap_or(ranked.len()).max(1));
    let max = ranked[0].1;
    let mut weights: Vec<f64> = ranked.iter().map(|(_, l)| (l - max).exp()).collect();
    if let Some(p) = top_p {
        let total: f64 = weights.iter().sum();
        let mut cumulative = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                cumulative += w / total;
                cumulative >= p
            })
            .map_or(weights.len(), |i| i + 1);
        weights.truncate(keep);
    }
    let mut target = rng.uniform() * weights.iter().sum::<f64>();
    for ((id, _), w) in ranked.iter().zip(&weights) {
        if target < *w {
            return *id;
        }
        target -= w;
    }
    ranked[weights.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut rng = Rng::new(1);
        assert_eq!(
            pick(vec![0.1, 3.0, -1.0, 2.9], 0.0, None, None, &mut rng),
            1
        );
    }

    #[test]
    fn top_k_and_top_p_sample_only_from_the_head() {
        // Probabilities at temperature 1: ≈ 0.64, 0.24, 0.09, 0.03.
        let logits = vec![3.0f32, 2.0, 1.0, 0.0];
        let draw = |top_k, top_p| {
            let mut rng = Rng::new(7);
            let mut seen = [0usize; 4];
            for _ in 0..2000 {
                seen[pick(logits.clone(), 1.0, top_k, top_p, &mut rng) as usize] += 1;
            }
            seen
        };
        let all = draw(None, None);
        assert!(all.iter().all(|&n| n > 0), "{all:?}");
        let k2 = draw(Some(2), None);
        assert_eq!(&k2[2..], &[0, 0], "{k2:?}");
        // 0.64 < 0.85 ≤ 0.64 + 0.24: the two most likely.
        let p = draw(None, Some(0.85));
        assert!(p[0] > 0 && p[1] > 0 && p[2] == 0 && p[3] == 0, "{p:?}");
        // p below the first probability keeps the first alone.
        assert_eq!(draw(None, Some(0.5)), [2000, 0, 0, 0]);
        // Renormalised over the two kept: ≈ 0.73 and 0.27.
        let share = p[0] as f64 / 2000.0;
        assert!((share - 0.731).abs() < 0.04, "{share}");
    }
}
