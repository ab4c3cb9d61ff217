//! `diffzoo generate`: sample text from a run's model with a KV cache.
//!
//! The prompts are prefilled in one pass, then each new token costs one position of attention
//! against the cached keys and values (`diffzoo_models::cache`). Several prompts (`--prompt`
//! repeated, `--prompts FILE`) run in batches of `--batch-size`, left-padded to the longest with
//! the padding masked out, each sampling from its own generator seeded with `--seed`: a batch
//! generates what each of its prompts generates alone (to rounding: padded rows sit at other
//! absolute positions, which RoPE's relative angles make equal only up to float error). A prompt
//! plus `--max-tokens` must fit the model's context (`max_seq_len`); beyond it `--sliding-window`
//! (one prompt) recomputes the last `max_seq_len` tokens for every further token, as a model
//! without a cache would. Sampling: greedy at
//! temperature 0, else the temperature's softmax restricted to the `--top-k` most likely tokens
//! and then to the smallest set whose probability reaches `--top-p`. A prompt stops at an
//! end token (unless `--ignore-eot`), at `--stop`, or after `--max-tokens`; the end tokens are
//! the tokenizer's end-of-text and the `eos_token_id`s of the run's `generation_config.json`
//! (an instruct model's end of turn).
//!
//! Chat: `--messages FILE` renders each conversation with the run's own chat template and the
//! generation prompt ([`crate::chat`]) and generates the assistant's turn; `--chat` talks with
//! the model on the terminal, one line a turn, the conversation kept and the KV cache reused
//! between turns (the next turn's rendering is compared with what the cache holds, which is
//! cut back to the tokens they share; only the rest is computed).
//!
//! Its timings say when not to believe them ([`crate::trust`]): the load average before the
//! generation and the cores' worth of CPU time other processes took while it ran, with a warning
//! (in `--json`'s `warnings`, else on stderr) when they took more than a quarter of a core.

use crate::chat::{self, Message, Template};
use crate::hf::GENERATION_CONFIG;
use crate::run;
use crate::run::WeightDtype;
use crate::trust;
use anyhow::{Result, anyhow, bail};
use burn::tensor::Device;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use diffzoo_datasets::{Rng, TextTokenizer};
use diffzoo_models::{KvCache, Model};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Run directory.
    #[arg(long)]
    pub run: PathBuf,
    /// Text to continue; repeat for a batch (none, nor --prompts: start from end-of-text).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A file of prompts, one per line, generated as one batch after any --prompt.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Conversations rendered with the run's chat template: a JSON list of {"role", "content"},
    /// or JSON lines of such lists (or of objects with `messages`), one conversation each.
    #[arg(long, conflicts_with_all = ["prompt", "prompts", "chat", "sliding_window"])]
    pub messages: Option<PathBuf>,
    /// Talk with the model: each line read is a user turn (end with an empty input or EOF).
    #[arg(long, conflicts_with_all = ["prompt", "prompts", "sliding_window", "json"])]
    pub chat: bool,
    /// With --chat, a system message that opens the conversation.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
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
    /// Prompts decoded together (a longer list runs in batches of this many).
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Untimed prefills of the first prompt before generating (benchmarks time a warm process).
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Go on past the end tokens (benchmarks generate a fixed number of tokens).
    #[arg(long)]
    pub ignore_eot: bool,
    /// Go on past the model's context (one prompt): every further token recomputes the last
    /// max_seq_len.
    #[arg(long)]
    pub sliding_window: bool,
    /// Each prompt samples from its own generator seeded with this: a batch samples as each of
    /// its prompts would alone (a prompt given twice gives one completion twice).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The dtype the weight matrices are kept in while computing in f32 (default: bf16 for a run
    /// whose weights are stored in bf16, on the CPU backend; else f32). bf16 halves the bytes
    /// each decoded token reads.
    #[arg(long, value_enum)]
    pub dtype: Option<WeightDtype>,
    /// The dtype the KV cache keeps keys and values in. bf16 halves the bytes a decoding step
    /// reads from it (at 1,619 positions of a 135M model 75 MB in f32), each rounded to 8
    /// significant bits as it is written (the prompt attends to its own unrounded); the CPU's Flex
    /// backend reads it in place, for the baseline and DIFF V2 (DIFF V1's maps would widen it
    /// at every step: refused).
    #[arg(long, value_enum, default_value = "f32")]
    pub cache_dtype: CacheDtype,
    /// Print one JSON object (each prompt's tokens, text and ending; the timings, and warnings
    /// where other processes competed for the cores) instead of the text.
    #[arg(long)]
    pub json: bool,
}

/// The dtype of the KV cache's keys and values (`--cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    F32,
    Bf16,
}

impl CacheDtype {
    /// An error naming the device where `device` would not read a bf16 cache in place (checked
    /// before the model loads).
    fn check_device(self, device: &str) -> Result<()> {
        if self == Self::Bf16 && !crate::device::is_flex(device) {
            bail!(
                "--cache-dtype bf16: device `{device}` would widen the cache at every step (only \
                 the CPU's Flex backend reads it in place); use --device cpu, or --cache-dtype f32"
            );
        }
        Ok(())
    }

    /// The dtype [`KvCache::in_dtype`] takes (`None`: the activations'), or an error naming why
    /// `model` would not read a bf16 cache in place.
    fn resolve(self, model: &Model) -> Result<Option<FloatDType>> {
        match self {
            Self::F32 => Ok(None),
            Self::Bf16 if !model.reads_cache_in_place() => bail!(
                "--cache-dtype bf16: this model's attention (DIFF V1's two maps, or logits \
                 quantised for analysis) would widen the cache at every step; the baseline and \
                 DIFF V2 read it in place. Use --cache-dtype f32"
            ),
            Self::Bf16 => Ok(Some(FloatDType::BF16)),
        }
    }

    /// What `cache` keeps its keys and values in.
    fn of(cache: &KvCache) -> Self {
        match cache.dtype() {
            Some(FloatDType::BF16) => Self::Bf16,
            _ => Self::F32,
        }
    }
}

impl std::fmt::Display for CacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        })
    }
}

#[derive(Debug, Serialize)]
struct Output {
    weights: String,
    /// The dtype the weight matrices were kept in.
    dtype: WeightDtype,
    /// The dtype the KV cache kept its keys and values in.
    cache_dtype: CacheDtype,
    generations: Vec<Generation>,
    timings: Timings,
    /// Reasons not to trust the timings ([`trust::warnings`]).
    warnings: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Generation {
    /// The prompt's text (a conversation's rendering).
    prompt: String,
    /// The ids the prompt was tokenized to, as the model read them.
    prompt_ids: Vec<u32>,
    completion: String,
    /// Every token sampled (with `stop`, the last may reach past the cut text).
    tokens: Vec<u32>,
    /// `end-of-text` (an end token), `stop` or `max-tokens`.
    stopped: Ending,
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
    /// Prompt tokens prefilled over all prompts (padding not counted; a prompt longer than the
    /// context, with `--sliding-window`, counts its last max_seq_len).
    prompt_tokens: usize,
    prefill_seconds: f64,
    prefill_tokens_per_sec: Option<f64>,
    /// Steps after the prefill times the batch (a sliding window's recomputation of the last
    /// max_seq_len tokens counts as one).
    decode_tokens: usize,
    decode_seconds: f64,
    decode_tokens_per_sec: Option<f64>,
    /// The one-minute load average before the first timed prefill (after the model's load and
    /// any `--warmup`; `None`: unknown).
    load_before: Option<f64>,
    /// Cores' worth of CPU time other processes took on this process's cores from the first
    /// timed prefill to the last token ([`trust::LoadProbe`]; `None`: unknown).
    competing_cores: Option<f64>,
}

/// One prompt's progress.
struct Row {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    completion: String,
    /// The streamed prefix of the completion.
    printed: String,
    stopped: Option<Ending>,
    rng: Rng,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    check_sampling(args)?;
    args.cache_dtype.check_device(&args.device)?;
    let recipe = run::run_recipe(&args.run)?;
    let tokenizer = run::run_tokenizer(&args.run)?;
    let ends = Ends::of(&args.run, &tokenizer)?;
    if args.chat {
        return chat(args, &recipe, &tokenizer, &ends);
    }
    let texts = match &args.messages {
        Some(file) => {
            let template = Template::find(&args.run)?;
            chat::read_conversations(file)?
                .iter()
                .map(|c| template.render(c, true))
                .collect::<Result<Vec<_>>>()?
        }
        None => prompt_texts(args)?,
    };
    let context = recipe.model_config().max_seq_len;
    let mut rows = rows(args, &texts, &tokenizer, context)?;
    let (model, weights, device, dtype) =
        run::load_model_on(&args.run, &recipe, &args.device, args.dtype)?;
    let cache_dtype = args.cache_dtype.resolve(&model)?;
    // As the decoder will make it.
    let cache = CacheDtype::of(&empty_cache(&model, cache_dtype));
    let stream_one = !args.json && rows.len() == 1;
    if stream_one {
        eprintln!("({weights}; weights in {dtype}; KV cache in {cache})");
        print!("{}", texts[0]);
    }
    let decoding = (&model, &device, cache_dtype);
    let timings = generate_timed(
        args, decoding, &tokenizer, &ends, &mut rows, stream_one, context,
    )?;
    let generations = finish(args, rows, texts, stream_one);
    // Only what competed during the generation: a load average before it still counts the
    // last minute's runs, one's own back-to-back generations included.
    let warnings = trust::warnings(
        None,
        &[trust::Figure {
            what: "generation".into(),
            spread: None,
            competing: timings.competing_cores,
        }],
    );
    if args.json {
        let out = Output {
            weights: weights.to_string(),
            dtype,
            cache_dtype: cache,
            generations,
            timings,
            warnings,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let show = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.1}"));
        eprintln!(
            "({} prompt(s); prefill {} tokens/s, decode {} tokens/s)",
            generations.len(),
            show(timings.prefill_tokens_per_sec),
            show(timings.decode_tokens_per_sec)
        );
        for warning in &warnings {
            eprintln!("warning: {warning}");
        }
    }
    Ok(())
}

/// A row to generate for each prompt text (an empty one: end-of-text alone), refused where the
/// prompt and `--max-tokens` exceed the model's `context` without `--sliding-window`, which
/// takes one prompt.
fn rows(
    args: &GenerateArgs,
    texts: &[String],
    tokenizer: &TextTokenizer,
    context: usize,
) -> Result<Vec<Row>> {
    let eot = tokenizer.eot_id();
    let mut rows = Vec::with_capacity(texts.len());
    for (i, text) in texts.iter().enumerate() {
        let prompt = if text.is_empty() {
            vec![eot]
        } else {
            tokenizer.encode(text)?
        };
        if prompt.is_empty() {
            bail!("prompt {}: {text:?} encodes to no tokens", i + 1);
        }
        if prompt.len().saturating_add(args.max_tokens) > context && !args.sliding_window {
            bail!(
                "prompt {}: its {} tokens and --max-tokens {} exceed the model's context of \
                 {context} positions (model.max_seq_len); ask for fewer tokens, or pass \
                 --sliding-window to recompute the last {context} tokens for each token beyond it",
                i + 1,
                prompt.len(),
                args.max_tokens
            );
        }
        rows.push(Row {
            prompt,
            tokens: Vec::new(),
            completion: String::new(),
            printed: String::new(),
            stopped: None,
            rng: Rng::new(args.seed),
        });
    }
    if args.sliding_window && rows.len() > 1 {
        bail!(
            "--sliding-window takes one prompt at a time ({} given)",
            rows.len()
        );
    }
    Ok(rows)
}

/// `--warmup` prefills of the first prompt, then every row generated in batches of
/// `--batch-size`, timed, with the machine's load before and what competed during (prompts
/// counted up to the model's `context`).
fn generate_timed(
    args: &GenerateArgs,
    decoding: (&Model, &Device, Option<FloatDType>),
    tokenizer: &TextTokenizer,
    ends: &Ends,
    rows: &mut [Row],
    stream_one: bool,
    context: usize,
) -> Result<Timings> {
    let (model, device, cache_dtype) = decoding;
    for _ in 0..args.warmup {
        let prompt = rows[0].prompt.as_slice();
        Decoder::prefill(model, device, cache_dtype, &[prompt], tokenizer.eot_id())?;
    }
    let (load_before, probe) = (trust::load_average(), trust::LoadProbe::start());
    let (mut prefill_seconds, mut decode_seconds, mut decode_tokens) = (0.0, 0.0, 0);
    for batch in rows.chunks_mut(args.batch_size) {
        let timed = generate_batch(args, decoding, tokenizer, ends, batch, stream_one)?;
        prefill_seconds += timed.0;
        decode_seconds += timed.1;
        decode_tokens += timed.2 * batch.len();
    }
    let prompt_tokens = rows.iter().map(|r| r.prompt.len().min(context)).sum();
    Ok(Timings {
        prompt_tokens,
        prefill_seconds,
        prefill_tokens_per_sec: rate(prompt_tokens, prefill_seconds),
        decode_tokens,
        decode_seconds,
        decode_tokens_per_sec: rate(decode_tokens, decode_seconds),
        load_before,
        competing_cores: probe.and_then(|p| p.competing_cores()),
    })
}

/// Each row's generation beside its prompt text, the completion printed: the rest of a streamed
/// one, or each whole in text mode.
fn finish(
    args: &GenerateArgs,
    rows: Vec<Row>,
    texts: Vec<String>,
    stream_one: bool,
) -> Vec<Generation> {
    rows.into_iter()
        .zip(texts)
        .map(|(row, prompt)| {
            if stream_one {
                // What was held back as an incomplete character stays as decoded.
                if let Some(rest) = row.completion.strip_prefix(row.printed.as_str()) {
                    print!("{rest}");
                }
                println!();
            } else if !args.json {
                println!("{prompt}{}\n", row.completion);
            }
            Generation {
                prompt,
                prompt_ids: row.prompt,
                completion: row.completion,
                tokens: row.tokens,
                stopped: row.stopped.unwrap_or(Ending::MaxTokens),
            }
        })
        .collect()
}

/// Generates for one batch of rows: its prefill and decoding seconds and the decoding steps.
fn generate_batch(
    args: &GenerateArgs,
    (model, device, cache_dtype): (&Model, &Device, Option<FloatDType>),
    tokenizer: &TextTokenizer,
    ends: &Ends,
    rows: &mut [Row],
    stream_one: bool,
) -> Result<(f64, f64, usize)> {
    let started = Instant::now();
    let prompts: Vec<&[u32]> = rows.iter().map(|r| r.prompt.as_slice()).collect();
    let (mut decoder, logits) =
        Decoder::prefill(model, device, cache_dtype, &prompts, tokenizer.eot_id())?;
    let prefill_seconds = started.elapsed().as_secs_f64();
    let decoding = Instant::now();
    decode(
        args,
        &mut decoder,
        logits,
        tokenizer,
        ends,
        rows,
        stream_one,
    )?;
    Ok((
        prefill_seconds,
        decoding.elapsed().as_secs_f64(),
        decoder.steps,
    ))
}

/// Samples up to `--max-tokens` tokens for each row from `logits` (those after each row's
/// prompt) on, feeding each back through `decoder`, until every row has stopped.
fn decode(
    args: &GenerateArgs,
    decoder: &mut Decoder,
    mut logits: Vec<Vec<f32>>,
    tokenizer: &TextTokenizer,
    ends: &Ends,
    rows: &mut [Row],
    stream_one: bool,
) -> Result<()> {
    let eot = tokenizer.eot_id();
    for step in 1..=args.max_tokens {
        for (row, logits) in rows.iter_mut().zip(logits) {
            if row.stopped.is_some() {
                continue;
            }
            let next = pick(
                logits,
                args.temperature,
                args.top_k,
                args.top_p,
                &mut row.rng,
            );
            if ends.contains(next) && !args.ignore_eot {
                row.stopped = Some(Ending::EndOfText);
                continue;
            }
            row.tokens.push(next);
            let text = tokenizer.decode(&row.tokens)?;
            let cut = args.stop.as_ref().and_then(|stop| text.find(stop.as_str()));
            row.completion = cut.map_or(text.as_str(), |at| &text[..at]).to_string();
            if stream_one {
                stream(&row.completion, &mut row.printed, args.stop.as_deref())?;
            }
            if cut.is_some() {
                row.stopped = Some(Ending::StopText);
            }
        }
        if step == args.max_tokens || rows.iter().all(|r| r.stopped.is_some()) {
            break;
        }
        // A finished row is fed end-of-text; its logits are not read.
        let newest: Vec<u32> = rows
            .iter()
            .map(|r| match r.stopped {
                None => r.tokens.last().copied().unwrap_or(eot),
                Some(_) => eot,
            })
            .collect();
        logits = decoder.step(&newest, &rows[0])?;
    }
    Ok(())
}

/// The tokens that end a generation: the tokenizer's end-of-text and the `eos_token_id` (one
/// id or a list) of the run's `generation_config.json`, where instruct models name their end of
/// turn.
pub struct Ends(Vec<u32>);

impl Ends {
    pub fn of(run: &Path, tokenizer: &TextTokenizer) -> Result<Self> {
        let mut ids = vec![tokenizer.eot_id()];
        let path = run.join(GENERATION_CONFIG);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let config: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
            let listed = match &config["eos_token_id"] {
                serde_json::Value::Null => Vec::new(),
                serde_json::Value::Array(list) => list.clone(),
                one => vec![one.clone()],
            };
            for id in listed {
                let id = id
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        anyhow!(
                            "{}: `eos_token_id` holds {id}, not a token id",
                            path.display()
                        )
                    })?;
                ids.push(id);
            }
        }
        Ok(Self(ids))
    }

    fn contains(&self, id: u32) -> bool {
        self.0.contains(&id)
    }
}

/// The greedy completion of `prompt` (which must leave room for `max_tokens` more in the
/// model's context): up to `max_tokens` tokens, ending before one of `ends` or before the text
/// `stop`.
pub fn greedy(
    model: &Model,
    device: &Device,
    tokenizer: &TextTokenizer,
    ends: &Ends,
    prompt: &[u32],
    max_tokens: usize,
    stop: Option<&str>,
) -> Result<String> {
    let (mut decoder, logits) =
        Decoder::prefill(model, device, None, &[prompt], tokenizer.eot_id())?;
    let mut logits = logits.into_iter().next().expect("one row");
    let mut rng = Rng::new(0);
    let mut tokens = Vec::new();
    for step in 1..=max_tokens {
        let next = pick(logits, 0.0, None, None, &mut rng);
        if ends.contains(next) {
            break;
        }
        tokens.push(next);
        let text = tokenizer.decode(&tokens)?;
        if let Some(at) = stop.and_then(|s| text.find(s)) {
            return Ok(text[..at].to_string());
        }
        if step == max_tokens {
            return Ok(text);
        }
        logits = decoder.feed(&[next], 1)?.remove(0);
    }
    Ok(tokenizer.decode(&tokens)?)
}

/// `--chat`: one user turn per line of standard input, each answer streamed, until an empty
/// line or the end of the input. The KV cache keeps the conversation: each turn computes only
/// what its rendering adds to what the cache holds.
fn chat(
    args: &GenerateArgs,
    recipe: &crate::recipe::Recipe,
    tokenizer: &TextTokenizer,
    ends: &Ends,
) -> Result<()> {
    use std::io::BufRead;
    let template = Template::find(&args.run)?;
    let (model, weights, device, dtype) =
        run::load_model_on(&args.run, recipe, &args.device, args.dtype)?;
    let cache_dtype = args.cache_dtype.resolve(&model)?;
    let context = recipe.model_config().max_seq_len;
    eprintln!(
        "({weights}; weights in {dtype}; KV cache in {}; chat template {}; an empty line ends)",
        CacheDtype::of(&empty_cache(&model, cache_dtype)),
        template.origin()
    );
    let mut conversation: Vec<Message> = args
        .system
        .iter()
        .map(|s| Message::new("system", s))
        .collect();
    let mut decoder = Decoder::new(&model, &device, cache_dtype);
    // The ids whose keys and values the cache holds.
    let mut cached: Vec<u32> = Vec::new();
    let mut rng = Rng::new(args.seed);
    let mut lines = std::io::stdin().lock().lines();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next().transpose()? else {
            break;
        };
        if line.trim().is_empty() {
            break;
        }
        conversation.push(Message::new("user", &line));
        let prompt = tokenizer.encode(&template.render(&conversation, true)?)?;
        if prompt.is_empty() {
            bail!(
                "{}: the conversation renders to no tokens",
                template.origin()
            );
        }
        if prompt.len() + args.max_tokens > context {
            bail!(
                "the conversation has grown to {} tokens: with --max-tokens {} it would pass the model's context of {context} positions",
                prompt.len(),
                args.max_tokens
            );
        }
        let shared = cached
            .iter()
            .zip(&prompt)
            .take_while(|(a, b)| a == b)
            .count();
        // The last prompt token is fed again when the cache holds it all: its logits are needed.
        let keep = shared.min(prompt.len() - 1);
        decoder.cache.truncate(keep);
        let logits = decoder.feed(&prompt[keep..], 1)?;
        let mut row = [Row {
            prompt: prompt.clone(),
            tokens: Vec::new(),
            completion: String::new(),
            printed: String::new(),
            stopped: None,
            rng: rng.clone(),
        }];
        decode(args, &mut decoder, logits, tokenizer, ends, &mut row, true)?;
        let [row] = row;
        if let Some(rest) = row.completion.strip_prefix(row.printed.as_str()) {
            print!("{rest}");
        }
        println!();
        rng = row.rng;
        // The cache holds the prompt and every token fed back: all sampled ones when an end
        // token was sampled after them, else all but the last.
        let fed = match row.stopped {
            Some(Ending::EndOfText) => row.tokens.len(),
            _ => row.tokens.len().saturating_sub(1),
        };
        cached = prompt;
        cached.extend(&row.tokens[..fed]);
        conversation.push(Message::new("assistant", &row.completion));
    }
    Ok(())
}

/// The prompts: each `--prompt`, then the lines of `--prompts`; one empty prompt without either.
fn prompt_texts(args: &GenerateArgs) -> Result<Vec<String>> {
    let mut texts = args.prompt.clone();
    if let Some(file) = &args.prompts {
        let content = std::fs::read_to_string(file)
            .map_err(|e| anyhow!("--prompts {}: {e}", file.display()))?;
        let lines: Vec<String> = content.lines().map(String::from).collect();
        if lines.is_empty() {
            bail!("--prompts {}: the file has no lines", file.display());
        }
        texts.extend(lines);
    }
    if texts.is_empty() {
        texts.push(String::new());
    }
    Ok(texts)
}

/// What `text` adds to the `printed` text that can be shown now: not a trailing replacement
/// character (a byte-level token that ends inside a UTF-8 sequence, completed by the next one),
/// nor an end that may be the start of the `stop` text. Nothing when `text` rewrote the printed
/// prefix.
fn unprinted<'a>(text: &'a str, printed: &str, stop: Option<&str>) -> &'a str {
    let mut ready = text.trim_end_matches('\u{FFFD}');
    if let Some(stop) = stop {
        let held = (1..stop.len())
            .rev()
            .filter(|&n| stop.is_char_boundary(n))
            .find(|&n| ready.ends_with(&stop[..n]))
            .unwrap_or(0);
        ready = &ready[..ready.len() - held];
    }
    ready.strip_prefix(printed).unwrap_or_default()
}

/// Prints [`unprinted`] and adds it to `printed`.
fn stream(text: &str, printed: &mut String, stop: Option<&str>) -> Result<()> {
    let rest = unprinted(text, printed, stop);
    if !rest.is_empty() {
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
    if args.batch_size == 0 {
        bail!("--batch-size 0: expected at least 1");
    }
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

/// The model with its KV cache: the logits of the position after what each row was fed.
struct Decoder<'a> {
    model: &'a Model,
    device: &'a Device,
    /// The dtype of K and V in the cache (`None`: the activations').
    cache_dtype: Option<FloatDType>,
    cache: KvCache,
    /// Positions computed one at a time (per row).
    steps: usize,
}

impl<'a> Decoder<'a> {
    /// An empty cache.
    fn new(model: &'a Model, device: &'a Device, cache_dtype: Option<FloatDType>) -> Self {
        Self {
            model,
            device,
            cache_dtype,
            cache: empty_cache(model, cache_dtype),
            steps: 0,
        }
    }

    /// The prompts in one pass, left-padded to the longest (with `pad`, masked out), each cut to
    /// its last `max_seq_len` tokens (only `--sliding-window` lets one be longer).
    fn prefill(
        model: &'a Model,
        device: &'a Device,
        cache_dtype: Option<FloatDType>,
        prompts: &[&[u32]],
        pad: u32,
    ) -> Result<(Self, Vec<Vec<f32>>)> {
        let cache = empty_cache(model, cache_dtype);
        let context = cache.capacity();
        let prompts: Vec<&[u32]> = prompts
            .iter()
            .map(|p| &p[p.len().saturating_sub(context)..])
            .collect();
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let pads: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
        let cache = match pads.iter().any(|&p| p > 0) {
            true => cache.with_left_padding(&pads, device),
            false => cache,
        };
        let mut decoder = Self {
            model,
            device,
            cache_dtype,
            cache,
            steps: 0,
        };
        let ids: Vec<u32> = prompts
            .iter()
            .zip(&pads)
            .flat_map(|(p, &n)| std::iter::repeat_n(pad, n).chain(p.iter().copied()))
            .collect();
        let logits = decoder.feed(&ids, prompts.len())?;
        Ok((decoder, logits))
    }

    /// Feeds `ids` (`rows` rows of equal length) after what the cache holds; each row's last
    /// position's logits.
    fn feed(&mut self, ids: &[u32], rows: usize) -> Result<Vec<Vec<f32>>> {
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let n = ids.len() / rows;
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows, n]), self.device);
        let logits = self.model.forward_cached_last(input, &mut self.cache);
        let v = logits.dims()[2];
        let last = logits
            .reshape([rows * v])
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow!("reading the logits: {e:?}"))?;
        Ok(last.chunks(v).map(<[f32]>::to_vec).collect())
    }

    /// The logits after each row's `newest` token. Once the cache is full (only with
    /// `--sliding-window`, one row: `first`), the last `max_seq_len` tokens of that row's prompt
    /// and tokens so far are computed afresh.
    fn step(&mut self, newest: &[u32], first: &Row) -> Result<Vec<Vec<f32>>> {
        self.steps += 1;
        if self.cache.len() < self.cache.capacity() {
            return self.feed(newest, newest.len());
        }
        let context = self.cache.capacity();
        let history: Vec<u32> = first.prompt.iter().chain(&first.tokens).copied().collect();
        self.cache = empty_cache(self.model, self.cache_dtype);
        self.feed(&history[history.len() - context..], 1)
    }
}

/// `model`'s empty KV cache, keeping K and V in `dtype` (`None`: the activations').
fn empty_cache(model: &Model, dtype: Option<FloatDType>) -> KvCache {
    match dtype {
        Some(dtype) => model.cache().in_dtype(dtype),
        None => model.cache(),
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
    // A NaN logit is no candidate.
    let logits: Vec<f32> = logits
        .into_iter()
        .map(|l| if l.is_nan() { f32::NEG_INFINITY } else { l })
        .collect();
    // Greedy, and the limit of sampling when the largest logit is infinite.
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if temperature <= 0.0 || !top.is_finite() {
        return argmax(&logits);
    }
    let mut ranked: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l as f64))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    ranked.truncate(top_k.unwrap_or(ranked.len()).max(1));
    // Shifted before the division, so that the largest weight is exactly 1 at any temperature.
    let mut weights: Vec<f64> = ranked
        .iter()
        .map(|(_, l)| ((l - top as f64) / temperature).exp())
        .collect();
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
    fn streaming_holds_back_split_characters_and_a_possible_stop() {
        assert_eq!(unprinted("ab\u{FFFD}", "a", None), "b");
        assert_eq!(unprinted("abé", "ab", None), "é");
        // "\n\n" may be arriving: a trailing "\n" waits, a completed one would have been cut.
        assert_eq!(unprinted("ab\n", "a", Some("\n\n")), "b");
        assert_eq!(unprinted("ab\nc", "ab", Some("\n\n")), "\nc");
        assert_eq!(unprinted("ab", "ab", Some("END")), "");
        assert_eq!(unprinted("xyEN", "", Some("END")), "xy");
        // A decoding that rewrote what was shown adds nothing.
        assert_eq!(unprinted("ac", "ab", None), "");
    }

    #[test]
    fn sampling_survives_extreme_temperatures_and_infinite_logits() {
        let mut rng = Rng::new(3);
        assert_eq!(pick(vec![0.5, 2.0, 1.0], 1e-300, None, None, &mut rng), 1);
        assert_eq!(
            pick(vec![0.5, f32::INFINITY, 1.0], 0.8, None, None, &mut rng),
            1
        );
        for temperature in [0.0, 1.0] {
            let got = pick(
                vec![f32::NAN, 0.5, 2.0],
                temperature,
                Some(1),
                None,
                &mut rng,
            );
            assert_eq!(got, 2, "a NaN logit is never picked");
        }
    }

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
