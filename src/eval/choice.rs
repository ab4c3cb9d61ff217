//! `diffzoo eval choice`: zero-shot multiple-choice accuracy, scored as LM Evaluation Harness
//! scores ARC, BoolQ, HellaSwag, OBQA, PIQA and WinoGrande (the paper's Table 1).
//!
//! Each line of a `--data` file is one question, in either of two shapes:
//!
//! ```text
//! {"context": "Q: …\nA:", "choices": [" yes", " no"], "gold": 0}
//! {"arguments": {"gen_args_0": {"arg_0": CONTEXT, "arg_1": " yes"}, …}, "target": "0", …}
//! ```
//!
//! the second being a line of the harness's `--log_samples` output (`samples_<task>.jsonl`; other
//! fields are ignored), where each choice may have a context of its own (WinoGrande puts the
//! option in the context and scores the same continuation). A choice is the text that follows the
//! context, its leading space included, as the harness writes it. `gold` (`target`) is the index
//! of the right choice (a number or a string of digits).
//!
//! A choice's score is the sum over its tokens of log p(token | context, earlier tokens). As in
//! the harness, whitespace that ends the context moves to the start of the choice, the context is
//! tokenized alone and the choice as what `context + choice` adds after it, an empty context
//! starts from the end-of-text token, and a pair longer than the model's context keeps its last
//! `max_seq_len + 1` tokens (a choice longer than the model's context is refused, as the harness
//! asserts). A context runs once; each of its choices continues from its KV cache. `acc` takes
//! the best score, `acc_norm` the best score per character of the choice (without its joining
//! space, as the harness counts); each comes with the standard error of its mean over the
//! questions. With a context per choice (WinoGrande) the harness reports `acc` alone.

use super::seeds::{self, Measurement, Metric};
use super::{Common, emit, id_tensor, target_log_probs};
use crate::run;
use anyhow::{Context, Result, anyhow, bail};
use burn::tensor::{Device, Tensor};
use diffzoo_datasets::TextTokenizer;
use diffzoo_models::{KvCache, Model};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct ChoiceArgs {
    #[command(flatten)]
    pub common: Common,
    /// JSONL files of questions, one per line: {"context": …, "choices": […], "gold": i} or a line
    /// of LM Evaluation Harness's --log_samples output; each file is scored on its own.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// Score at most this many questions of each file.
    #[arg(long)]
    pub limit: Option<usize>,
}

/// One file's accuracy.
#[derive(Debug, Serialize)]
pub struct FileScore {
    pub file: String,
    pub questions: usize,
    pub acc: f64,
    pub acc_stderr: f64,
    pub acc_norm: f64,
    pub acc_norm_stderr: f64,
}

#[derive(Debug, Serialize)]
pub struct ChoiceResult {
    pub weights: String,
    pub files: Vec<FileScore>,
}

/// A question as read from a line.
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    /// Each choice's context (in our line shape, one context repeated).
    pub contexts: Vec<String>,
    pub choices: Vec<String>,
    pub gold: usize,
}

pub fn run(args: &ChoiceArgs) -> Result<()> {
    if args.limit == Some(0) {
        bail!("--limit 0: expected at least one question");
    }
    let sets: Vec<Vec<Question>> = args
        .data
        .iter()
        .map(|file| read_questions(file, args.limit))
        .collect::<Result<_>>()?;
    let common = &args.common;
    let each = |dir: &Path| measure(dir, common, &args.data, &sets);
    if seeds::over_seeds(common, "choice", None, each)? {
        return Ok(());
    }
    emit(common.json, &each(&common.run)?, |r| {
        println!("{}", r.weights);
        for f in &r.files {
            println!(
                "{}: acc {:.4} ± {:.4}, acc_norm {:.4} ± {:.4} over {} questions",
                f.file, f.acc, f.acc_stderr, f.acc_norm, f.acc_norm_stderr, f.questions
            );
        }
    })
}

impl Measurement for ChoiceResult {
    fn metrics(&self) -> Vec<Metric> {
        self.files
            .iter()
            .flat_map(|f| {
                [
                    Metric::new("acc", f.acc).at("file", f.file.as_str()),
                    Metric::new("acc_norm", f.acc_norm).at("file", f.file.as_str()),
                ]
            })
            .collect()
    }
}

/// The accuracy of the run in `dir` on each file's questions.
fn measure(
    dir: &Path,
    common: &super::Common,
    data: &[PathBuf],
    sets: &[Vec<Question>],
) -> Result<ChoiceResult> {
    let recipe = run::run_recipe(dir)?;
    let tokenizer = run::run_tokenizer(dir)?;
    let (model, weights, device, _) =
        run::load_model_on(dir, &recipe, &common.device, common.dtype)?;
    let mut files = Vec::with_capacity(sets.len());
    for (file, questions) in data.iter().zip(sets) {
        let mut correct = Vec::with_capacity(questions.len());
        let mut correct_norm = Vec::with_capacity(questions.len());
        for (i, q) in questions.iter().enumerate() {
            let scores = score_question(&model, &tokenizer, q, &device)
                .with_context(|| format!("{}: question {}", file.display(), i + 1))?;
            let norm = normalised(&scores, &q.choices);
            correct.push(argmax(&scores) == q.gold);
            correct_norm.push(argmax(&norm) == q.gold);
        }
        let (acc, acc_stderr) = mean_and_stderr(&correct);
        let (acc_norm, acc_norm_stderr) = mean_and_stderr(&correct_norm);
        files.push(FileScore {
            file: file.display().to_string(),
            questions: questions.len(),
            acc,
            acc_stderr,
            acc_norm,
            acc_norm_stderr,
        });
    }
    Ok(ChoiceResult {
        weights: weights.to_string(),
        files,
    })
}

/// Reads the questions of one file (the first `limit`); a malformed line is refused with the
/// file and line named.
pub fn read_questions(file: &Path, limit: Option<usize>) -> Result<Vec<Question>> {
    super::read_jsonl(file, limit, "questions", |line, _| parse_question(line))
}

/// One line, in our shape or the harness's.
fn parse_question(line: &Value) -> Result<Question> {
    let object = line
        .as_object()
        .ok_or_else(|| anyhow!("expected a JSON object"))?;
    let (contexts, choices, gold) = if let Some(arguments) = object.get("arguments") {
        let (contexts, choices) = harness_requests(arguments)?;
        let target = object
            .get("target")
            .ok_or_else(|| anyhow!("`target` is missing"))?;
        let gold = harness_gold(target, object.get("doc"), &choices)?;
        (contexts, choices, gold)
    } else {
        let context = object
            .get("context")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("expected `context` (a string) or the harness's `arguments`"))?;
        let choices = object
            .get("choices")
            .and_then(Value::as_array)
            .ok_or_else(|| anyhow!("`choices` must be a list of strings"))?
            .iter()
            .map(|c| c.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| anyhow!("`choices` must be a list of strings"))?;
        let gold = object
            .get("gold")
            .ok_or_else(|| anyhow!("`gold` is missing"))?;
        let contexts = vec![context.to_string(); choices.len()];
        (contexts, choices, index(gold, "gold")?)
    };
    if choices.len() < 2 {
        bail!("{} choice(s): a question needs at least two", choices.len());
    }
    if let Some(i) = choices.iter().position(String::is_empty) {
        bail!("choice {i} is empty");
    }
    if gold >= choices.len() {
        bail!(
            "the gold index {gold} is beyond the {} choices",
            choices.len()
        );
    }
    Ok(Question {
        contexts,
        choices,
        gold,
    })
}

/// The harness's `arguments`: `{"gen_args_i": {"arg_0": context, "arg_1": choice}}` (or a list of
/// `[context, choice]` pairs): each choice's context, and the choices.
fn harness_requests(arguments: &Value) -> Result<(Vec<String>, Vec<String>)> {
    let pairs: Vec<(Value, Value)> = match arguments {
        Value::Object(map) => (0..map.len())
            .map(|i| {
                let request = map
                    .get(&format!("gen_args_{i}"))
                    .ok_or_else(|| anyhow!("`arguments` lacks `gen_args_{i}`"))?;
                Ok((request["arg_0"].clone(), request["arg_1"].clone()))
            })
            .collect::<Result<_>>()?,
        Value::Array(list) => list
            .iter()
            .map(|pair| (pair[0].clone(), pair[1].clone()))
            .collect(),
        _ => bail!("`arguments` must be an object or a list"),
    };
    let mut contexts = Vec::with_capacity(pairs.len());
    let mut choices = Vec::with_capacity(pairs.len());
    for (i, (ctx, choice)) in pairs.into_iter().enumerate() {
        let (Some(ctx), Some(choice)) = (ctx.as_str(), choice.as_str()) else {
            bail!("request {i}: expected a context and a continuation, both strings");
        };
        contexts.push(ctx.to_string());
        choices.push(choice.to_string());
    }
    Ok((contexts, choices))
}

/// The gold index of a harness line: `target` as an index, else (WinoGrande, whose target is the
/// shared continuation) the document's 1-based `answer`, else the one choice equal to `target`.
fn harness_gold(target: &Value, doc: Option<&Value>, choices: &[String]) -> Result<usize> {
    if let Ok(i) = index(target, "target") {
        return Ok(i);
    }
    let answer = doc
        .and_then(|d| d.get("answer"))
        .and_then(|a| index(a, "doc.answer").ok());
    if let Some(answer) = answer.filter(|&a| a >= 1) {
        return Ok(answer - 1);
    }
    let text = target.as_str().unwrap_or_default().trim();
    let matching: Vec<usize> = (0..choices.len())
        .filter(|&i| choices[i].trim() == text)
        .collect();
    match matching[..] {
        [i] => Ok(i),
        _ => bail!(
            "`target` = {target}: neither an index, nor one of the choices, and no `doc.answer`"
        ),
    }
}

/// A gold index: a non-negative integer or a string of digits.
fn index(value: &Value, key: &str) -> Result<usize> {
    let parsed = match value {
        Value::Number(n) => n.as_u64().map(|n| n as usize),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    parsed.ok_or_else(|| anyhow!("`{key}` = {value}: expected the index of the right choice"))
}

/// Each choice's summed log-probability given its context (see the module documentation); the
/// choices of one context share its pass.
pub fn score_question(
    model: &Model,
    tokenizer: &TextTokenizer,
    question: &Question,
    device: &Device,
) -> Result<Vec<f64>> {
    let mut scores = vec![0.0; question.choices.len()];
    let mut done = vec![false; question.choices.len()];
    for first in 0..question.choices.len() {
        if done[first] {
            continue;
        }
        let raw = &question.contexts[first];
        let group: Vec<usize> = (first..question.choices.len())
            .filter(|&i| question.contexts[i] == *raw)
            .collect();
        // Whitespace ending the context belongs to the choice.
        let context = raw.trim_end();
        let moved = &raw[context.len()..];
        // An empty context (or one a tokenizer maps to nothing) starts from end-of-text.
        let encoded = tokenizer.encode(context)?;
        let known = encoded.len();
        let context_ids = if encoded.is_empty() {
            vec![tokenizer.eot_id()]
        } else {
            encoded
        };
        let capacity = model.cache().capacity();
        let continuations = group
            .iter()
            .map(|&i| {
                let whole =
                    tokenizer.encode(&format!("{context}{moved}{}", question.choices[i]))?;
                let ids = whole.get(known..).unwrap_or_default().to_vec();
                if ids.is_empty() {
                    bail!("choice {i} adds no token to its context");
                }
                if ids.len() > capacity {
                    bail!(
                        "choice {i} is {} tokens, more than the model's context of {capacity} \
                         can score",
                        ids.len()
                    );
                }
                Ok(ids)
            })
            .collect::<Result<Vec<_>>>()?;
        let group_scores = log_likelihoods(model, &context_ids, &continuations, device);
        for (&i, score) in group.iter().zip(group_scores) {
            scores[i] = score;
            done[i] = true;
        }
    }
    Ok(scores)
}

/// `Σ log p(c_j | context, c_<j)` for each continuation `c`: the context once through the KV
/// cache, each continuation after it ([`continue_scores`]). A pair longer than the model's context keeps its
/// last `max_seq_len + 1` tokens (recomputed without the shared cache).
pub fn log_likelihoods(
    model: &Model,
    context: &[u32],
    continuations: &[Vec<u32>],
    device: &Device,
) -> Vec<f64> {
    let capacity = model.cache().capacity();
    let fits = continuations
        .iter()
        .all(|c| context.len() + c.len() <= capacity + 1);
    if !fits {
        return continuations
            .iter()
            .map(|c| {
                let all: Vec<u32> = context.iter().chain(c).copied().collect();
                let kept = &all[all.len().saturating_sub(capacity + 1)..];
                teacher_forced(model, kept, c.len(), device)
            })
            .collect();
    }
    let mut cache = model.cache();
    let first = model.forward_cached_last(id_tensor(context, device), &mut cache);
    continue_scores(model, &mut cache, first, continuations, device)
}

/// `Σ log p(c_j | what `cache` holds, c_<j)` for each continuation `c`; `first`: the logits
/// `[1, 1, vocab]` after the cached positions. Each continuation is appended to `cache` and
/// truncated away again, so that its buffers are written in place, never copied.
pub fn continue_scores(
    model: &Model,
    cache: &mut KvCache,
    first: Tensor<3>,
    continuations: &[Vec<u32>],
    device: &Device,
) -> Vec<f64> {
    let len = cache.len();
    continuations
        .iter()
        .map(|c| {
            // The last choice token predicts nothing that is scored.
            let fed = &c[..c.len() - 1];
            let logits = if fed.is_empty() {
                first.clone()
            } else {
                let rest = model.forward_cached(id_tensor(fed, device), cache);
                cache.truncate(len);
                Tensor::cat(vec![first.clone(), rest], 1)
            };
            summed_log_probs(logits, c, device)
        })
        .collect()
}

/// The same by one forward pass over `tokens`, scoring its last `scored` tokens.
pub fn teacher_forced(model: &Model, tokens: &[u32], scored: usize, device: &Device) -> f64 {
    let s = tokens.len();
    let logits =
        model
            .forward(id_tensor(&tokens[..s - 1], device))
            .narrow(1, s - 1 - scored, scored);
    summed_log_probs(logits, &tokens[s - scored..], device)
}

/// `Σ_j log softmax(logits[j])[targets[j]]` in f32; `logits`: `[1, n, vocab]`.
fn summed_log_probs(logits: Tensor<3>, targets: &[u32], device: &Device) -> f64 {
    target_log_probs(logits, id_tensor(targets, device))
        .sum()
        .into_scalar::<f64>()
}

/// Scores per character of each choice, without the leading space that joins it to the context
/// (the harness's `acc_norm` length).
fn normalised(scores: &[f64], choices: &[String]) -> Vec<f64> {
    scores
        .iter()
        .zip(choices)
        .map(|(s, c)| s / c.strip_prefix(' ').unwrap_or(c).chars().count().max(1) as f64)
        .collect()
}

/// Index of the largest value (the first of equals).
fn argmax(values: &[f64]) -> usize {
    values
        .iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0
}

/// Mean of 0/1 outcomes and the standard error of that mean (sample standard deviation over
/// √n, as the harness reports it; 0 for one question).
fn mean_and_stderr(outcomes: &[bool]) -> (f64, f64) {
    let n = outcomes.len() as f64;
    let mean = outcomes.iter().filter(|&&c| c).count() as f64 / n;
    if outcomes.len() < 2 {
        return (mean, 0.0);
    }
    let variance = outcomes
        .iter()
        .map(|&c| (f64::from(u8::from(c)) - mean).powi(2))
        .sum::<f64>()
        / (n - 1.0);
    (mean, (variance / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffzoo_models::{AttentionKind, ModelConfig};

    #[test]
    fn kv_shared_scores_equal_teacher_forcing() {
        let device = Device::flex();
        for attention in AttentionKind::ALL {
            device.seed(4);
            let model = ModelConfig::new(attention, 32, 2, 4, 50, 16).init(&device);
            let context = [3, 17, 9, 41, 5];
            let continuations = vec![vec![7], vec![12, 30, 2], vec![49, 1]];
            let shared = log_likelihoods(&model, &context, &continuations, &device);
            for (c, got) in continuations.iter().zip(shared) {
                let all: Vec<u32> = context.iter().chain(c).copied().collect();
                let want = teacher_forced(&model, &all, c.len(), &device);
                assert!((got - want).abs() < 1e-4, "{attention}: {got} vs {want}");
                assert!(got < 0.0);
            }
            // 5 + 14 tokens are too long for 16 positions: the last 17 are kept, so the first two
            // context tokens do not matter, the third does.
            let long = vec![(0..14).collect::<Vec<u32>>()];
            let got = log_likelihoods(&model, &context, &long, &device)[0];
            let shorter = log_likelihoods(&model, &context[2..], &long, &device)[0];
            assert!(
                (got - shorter).abs() < 1e-4,
                "{attention}: {got} vs {shorter}"
            );
            let other = log_likelihoods(&model, &[3, 17, 10, 41, 5], &long, &device)[0];
            assert!(
                (got - other).abs() > 1e-4,
                "{attention}: the third token counts"
            );
        }
    }

    #[test]
    fn both_line_shapes_read_the_same_question() {
        let ours =
            serde_json::json!({"context": "Q: sky?\nA:", "choices": [" blue", " red"], "gold": 1});
        let harness = serde_json::json!({
            "doc_id": 0,
            "arguments": {
                "gen_args_0": {"arg_0": "Q: sky?\nA:", "arg_1": " blue"},
                "gen_args_1": {"arg_0": "Q: sky?\nA:", "arg_1": " red"}
            },
            "target": "1",
            "resps": [[["-1.0", "False"]]]
        });
        let listed = serde_json::json!({
            "arguments": [["Q: sky?\nA:", " blue"], ["Q: sky?\nA:", " red"]],
            "target": 1
        });
        let want = parse_question(&ours).unwrap();
        assert_eq!(want.gold, 1);
        assert_eq!(want.contexts, ["Q: sky?\nA:", "Q: sky?\nA:"]);
        assert_eq!(parse_question(&harness).unwrap(), want);
        assert_eq!(parse_question(&listed).unwrap(), want);
        // WinoGrande's shape: the option in the context, one continuation.
        let partial = serde_json::json!({
            "arguments": [["The trophy", " did not fit."], ["The case", " did not fit."]],
            "target": "0"
        });
        let q = parse_question(&partial).unwrap();
        assert_eq!(q.contexts, ["The trophy", "The case"]);
        assert_eq!(q.choices, [" did not fit.", " did not fit."]);
        // As the harness writes it: the target is the continuation, the answer in the document.
        let winogrande = serde_json::json!({
            "doc": {"sentence": "…", "option1": "The trophy", "option2": "The case", "answer": "2"},
            "arguments": [["The trophy", " did not fit."], ["The case", " did not fit."]],
            "target": "did not fit."
        });
        assert_eq!(parse_question(&winogrande).unwrap().gold, 1);
        // A target naming a choice.
        let named =
            serde_json::json!({"arguments": [["Q:", " yes"], ["Q:", " no"]], "target": "no"});
        assert_eq!(parse_question(&named).unwrap().gold, 1);
    }

    #[test]
    fn malformed_questions_are_named() {
        let err = |v: Value| parse_question(&v).unwrap_err().to_string();
        let cases = [
            (serde_json::json!([1]), "expected a JSON object"),
            (
                serde_json::json!({"choices": ["a", "b"], "gold": 0}),
                "expected `context`",
            ),
            (
                serde_json::json!({"context": "", "choices": "ab", "gold": 0}),
                "`choices` must be",
            ),
            (
                serde_json::json!({"context": "", "choices": ["a"], "gold": 0}),
                "at least two",
            ),
            (
                serde_json::json!({"context": "", "choices": ["a", ""], "gold": 0}),
                "choice 1 is empty",
            ),
            (
                serde_json::json!({"context": "", "choices": ["a", "b"], "gold": 2}),
                "gold index 2",
            ),
            (
                serde_json::json!({"context": "", "choices": ["a", "b"], "gold": -1}),
                "`gold` = -1",
            ),
            (
                serde_json::json!({"context": "", "choices": ["a", "b"]}),
                "`gold` is missing",
            ),
            (
                serde_json::json!({"arguments": [["x", 1], ["y", "b"]], "target": "0"}),
                "request 0: expected a context and a continuation",
            ),
            (
                serde_json::json!({"arguments": {"gen_args_1": {"arg_0": "x", "arg_1": "a"}}, "target": "0"}),
                "lacks `gen_args_0`",
            ),
        ];
        for (line, expected) in cases {
            let message = err(line.clone());
            assert!(message.contains(expected), "{line}: {message}");
        }
    }

    #[test]
    fn standard_errors_are_the_harness_s() {
        // 3 of 4: mean 0.75, sample variance 0.25, stderr √(0.25/4) = 0.25.
        let (mean, stderr) = mean_and_stderr(&[true, true, false, true]);
        assert_eq!(mean, 0.75);
        assert!((stderr - 0.25).abs() < 1e-12);
        assert_eq!(mean_and_stderr(&[true]), (1.0, 0.0));
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        // Per character without the joining space: −1/1 < −2.5/3, so the longer choice wins.
        let norm = normalised(&[-1.0, -2.5], &[" a".into(), " abc".into()]);
        assert_eq!(argmax(&norm), 1);
        assert_eq!(normalised(&[-2.0], &["é".into()]), [-2.0]);
    }
}
