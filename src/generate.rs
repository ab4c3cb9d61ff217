//! `diffzoo generate`: sample text from a run's model.

use crate::{device, run};
use anyhow::{Result, bail};
use burn::tensor::activation::softmax;
use burn::tensor::{Int, Tensor, TensorData};
use diffzoo_datasets::Rng;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Run directory.
    #[arg(long)]
    pub run: PathBuf,
    #[arg(long, default_value = "")]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 decodes greedily.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Generation {
    weights: String,
    prompt: String,
    completion: String,
    tokens: Vec<u32>,
}

/// Picks the next token from the last position's logits.
fn pick(logits: Vec<f32>, temperature: f64, top_k: Option<usize>, rng: &mut Rng) -> u32 {
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
    let weights: Vec<f64> = ranked.iter().map(|(_, l)| (l - max).exp()).collect();
    let mut target = rng.uniform() * weights.iter().sum::<f64>();
    for ((id, _), w) in ranked.iter().zip(&weights) {
        if target < *w {
            return *id;
        }
        target -= w;
    }
    ranked.last().map_or(0, |(id, _)| *id)
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    let recipe = run::run_recipe(&args.run)?;
    let tokenizer = run::run_tokenizer(&args.run)?;
    let device = device::parse(&args.device)?;
    let (model, weights) = run::load_model(&args.run, &recipe, &device)?;
    let context = recipe.model_config().max_seq_len;
    let mut tokens = if args.prompt.is_empty() {
        vec![tokenizer.eot_id()]
    } else {
        tokenizer.encode(&args.prompt)?
    };
    if tokens.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let prompt_len = tokens.len();
    let mut rng = Rng::new(args.seed);
    for _ in 0..args.max_tokens {
        let window = &tokens[tokens.len().saturating_sub(context)..];
        let ids: Vec<i64> = window.iter().map(|&t| t as i64).collect();
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, window.len()]), &device);
        let logits = model.forward(input);
        let [_, s, v] = logits.dims();
        let last = logits.narrow(1, s - 1, 1).reshape([v]);
        let last = if args.temperature > 0.0 {
            last
        } else {
            softmax(last, 0)
        };
        let next = pick(
            last.into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| anyhow::anyhow!("{e:?}"))?,
            args.temperature,
            args.top_k,
            &mut rng,
        );
        tokens.push(next);
    }
    let completion = tokenizer.decode(&tokens[prompt_len..])?;
    if args.json {
        let out = Generation {
            weights: weights.to_string(),
            prompt: args.prompt.clone(),
            completion,
            tokens: tokens[prompt_len..].to_vec(),
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        eprintln!("({weights})");
        println!("{}{completion}", args.prompt);
    }
    Ok(())
}
