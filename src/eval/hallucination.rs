//! `diffzoo eval hallucination`: contextual hallucination (the paper's §3.7, Table 4), as the
//! paper measures it after Lookback Lens (Chuang et al., 2024): the model answers or summarises
//! from a source, a judge decides whether the output is supported by that source, and the score
//! is the share of outputs free of hallucination.
//!
//! `--data` holds one `{"source", "instruction", "reference"?, "max_tokens"?}` per line. The run
//! generates greedily (up to the line's `max_tokens`, else `--max-tokens`): from the `--template`
//! (`{source}` and `{instruction}` filled; it stops at `--stop`, a newline unless told), or, for a
//! run with a chat template (an instruct model), from one user turn holding the same text,
//! stopping at its end of turn. The judge is either
//!
//! - `cmd:PROGRAM`, run once by `sh -c`: it reads one JSON object per line on its standard input
//!   (`source`, `instruction`, `reference`, `output`) and answers each with one line,
//!   `{"supported": true|false}`, in order — any judge, external or not (nothing here calls a
//!   network); the questions are written while the answers are read, so a judge may read ahead
//!   or buffer its answers; an answer of another shape, or none, is an error naming the item;
//! - a run directory holding an instruct model: the protocol's question
//!   (`hallucination_judge.txt`, adapted from Lookback Lens' GPT-4o prompt: the document, the
//!   reference and the proposed output, concluded by `**Conclusion: True**` or `False`) is
//!   rendered as its user turn, the assistant's answer opened with `**Conclusion:`, and the verdict
//!   is the likelier of ` True` and ` False` (a judge's free-form explanation, which GPT-4o writes
//!   first in the protocol, is not generated: a small local judge answers the conclusion alone).
//!
//! The share comes with its 95% interval over the items (Wilson's); `--json` holds every item's output and
//! verdict.

use super::choice::log_likelihoods;
use super::seeds::{self, Measurement, Metric};
use super::{Common, emit};
use crate::chat::{Message, NoTemplate, Template};
use crate::generate::{Ends, greedy};
use crate::layout;
use crate::run;
use crate::stats::{self, Estimate};
use anyhow::{Context, Result, anyhow, bail};
use burn::tensor::Device;
use diffzoo_datasets::{TextTokenizer, fill};
use diffzoo_models::Model;
use serde::Serialize;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The judge's question, with `{kind}`, `{Kind}`, `{source}`, `{instruction}`, `{reference}`
/// and `{output}` to fill.
pub const JUDGE_PROMPT: &str = include_str!("hallucination_judge.txt");

#[derive(Debug, Clone, clap::Args)]
pub struct HallucinationArgs {
    #[command(flatten)]
    pub common: Common,
    /// One {"source", "instruction", "reference"?, "max_tokens"?} per line.
    #[arg(long)]
    pub data: PathBuf,
    /// `cmd:PROGRAM` (JSON lines in and out) or a run directory of an instruct model.
    #[arg(long)]
    pub judge: String,
    /// Tokens generated per item unless its line says `max_tokens`.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// The prompt of a run without a chat template: `{source}` and `{instruction}` filled.
    #[arg(long, default_value = diffzoo_datasets::grounded::TEMPLATE)]
    pub template: String,
    /// Where an output of a run without a chat template ends (default: a newline).
    #[arg(long)]
    pub stop: Option<String>,
    /// What the outputs are, as the judge's question names them: `answer` or `summary`.
    #[arg(long, default_value = "answer")]
    pub kind: String,
    /// Judge at most this many items.
    #[arg(long)]
    pub limit: Option<usize>,
}

/// One line of the task.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Task {
    pub source: String,
    pub instruction: String,
    pub reference: Option<String>,
    pub max_tokens: Option<usize>,
    /// Where it was read: `file:line`.
    #[serde(skip)]
    pub at: String,
}

#[derive(Debug, Serialize)]
pub struct Judged {
    pub instruction: String,
    pub output: String,
    pub supported: bool,
    /// A run judge's log-likelihoods of ` True` and ` False`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge_scores: Option<[f64; 2]>,
}

#[derive(Debug, Serialize)]
pub struct HallucinationResult {
    pub weights: String,
    pub judge: String,
    /// The share of outputs judged supported by their source.
    pub free_of_hallucination: f64,
    pub ci95: Option<[f64; 2]>,
    /// Outputs that are empty (the model ended at once), judged as the others are.
    pub empty_outputs: usize,
    pub items: Vec<Judged>,
}

impl Measurement for HallucinationResult {
    fn metrics(&self) -> Vec<Metric> {
        vec![Metric::new(
            "free_of_hallucination",
            self.free_of_hallucination,
        )]
    }
}

pub fn run(args: &HallucinationArgs) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("--max-tokens must be positive");
    }
    for key in ["{source}", "{instruction}"] {
        if !args.template.contains(key) {
            bail!("--template {:?} lacks {key}", args.template);
        }
    }
    if !matches!(args.kind.as_str(), "answer" | "summary") {
        bail!("--kind {}: expected answer or summary", args.kind);
    }
    let tasks = read_tasks(&args.data, args.limit)?;
    let judge = JudgeSpec::parse(&args.judge)?;
    let common = &args.common;
    let each = |dir: &Path| measure(args, &tasks, &judge, dir);
    if seeds::over_seeds(common, "hallucination", None, each)? {
        return Ok(());
    }
    emit(common.json, &each(&common.run)?, |r| {
        let interval = r.ci95.map_or(String::new(), |[lo, hi]| {
            format!(" (95% interval {lo:.4} to {hi:.4})")
        });
        let empty = match r.empty_outputs {
            0 => String::new(),
            n => format!(" ({n} of them empty)"),
        };
        println!(
            "{}: {:.4}{interval} of {} outputs{empty} free of hallucination, judged by {}",
            r.weights,
            r.free_of_hallucination,
            r.items.len(),
            r.judge
        );
    })
}

/// The tasks of `file` (the first `limit`), each malformed line named by file and line.
pub fn read_tasks(file: &Path, limit: Option<usize>) -> Result<Vec<Task>> {
    super::read_jsonl(file, limit, "items", |line, at| {
        parse_task(line, at.to_string())
    })
}

fn parse_task(value: &Value, at: String) -> Result<Task> {
    let text = |key: &str, required: bool| -> Result<Option<String>> {
        match value.get(key) {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            None | Some(Value::Null) if !required => Ok(None),
            None | Some(Value::Null) => {
                bail!(
                    "`{key}` is missing (each line is {{\"source\", \"instruction\", \"reference\"?}})"
                )
            }
            Some(other) => bail!("`{key}` = {other} is not a string"),
        }
    };
    let max_tokens = match value.get("max_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| anyhow!("`max_tokens` = {v} is not a positive integer"))?
                as usize,
        ),
    };
    Ok(Task {
        source: text("source", true)?.expect("required"),
        instruction: text("instruction", true)?.expect("required"),
        reference: text("reference", false)?,
        max_tokens,
        at,
    })
}

/// Which judge `--judge` names.
#[derive(Debug, Clone)]
enum JudgeSpec {
    Command(String),
    Run(PathBuf),
}

impl JudgeSpec {
    fn parse(text: &str) -> Result<Self> {
        if let Some(program) = text.strip_prefix("cmd:") {
            if program.trim().is_empty() {
                bail!("--judge cmd: names no program");
            }
            return Ok(Self::Command(program.to_string()));
        }
        let dir = PathBuf::from(text);
        if !dir.join(layout::RECIPE).is_file() {
            bail!("--judge {text}: neither `cmd:PROGRAM` nor a run directory");
        }
        // Checked before any output is generated, not after.
        match Template::find(&dir) {
            Ok(_) => Ok(Self::Run(dir)),
            Err(NoTemplate::Missing(_)) => bail!(
                "--judge {text}: no chat template (an instruct model's run judges, e.g. one `import hf` brought with its template)"
            ),
            Err(NoTemplate::Invalid(e)) => Err(e.context(format!("--judge {text}"))),
        }
    }
}

/// The evaluated run's outputs, judged.
fn measure(
    args: &HallucinationArgs,
    tasks: &[Task],
    judge: &JudgeSpec,
    dir: &Path,
) -> Result<HallucinationResult> {
    let model = Generator::open(dir, &args.common)?;
    let mut outputs = Vec::with_capacity(tasks.len());
    for task in tasks {
        let output = model
            .answer(args, task)
            .with_context(|| format!("{}: generating", task.at))?;
        outputs.push(output);
    }
    let (name, verdicts) = match judge {
        JudgeSpec::Command(program) => (
            format!("cmd:{program}"),
            command_verdicts(program, tasks, &outputs)?,
        ),
        JudgeSpec::Run(judge_dir) => (
            judge_dir.display().to_string(),
            run_verdicts(judge_dir, &args.kind, tasks, &outputs, &args.common)?,
        ),
    };
    let supported: Vec<bool> = verdicts.iter().map(|(s, _)| *s).collect();
    let estimate: Estimate = stats::proportion(&supported);
    let items: Vec<Judged> = tasks
        .iter()
        .zip(outputs)
        .zip(verdicts)
        .map(|((task, output), (supported, judge_scores))| Judged {
            instruction: task.instruction.clone(),
            output,
            supported,
            judge_scores,
        })
        .collect();
    Ok(HallucinationResult {
        weights: model.weights.to_string(),
        judge: name,
        free_of_hallucination: estimate.mean,
        ci95: estimate.ci95,
        empty_outputs: items
            .iter()
            .filter(|i: &&Judged| i.output.is_empty())
            .count(),
        items,
    })
}

/// A run's model with what prompting it needs.
struct Generator {
    model: Model,
    tokenizer: TextTokenizer,
    template: Option<Template>,
    ends: Ends,
    weights: layout::Weights,
    device: Device,
}

impl Generator {
    /// The run at `dir` on `common`'s device, its weight matrices in `common`'s dtype.
    fn open(dir: &Path, common: &super::Common) -> Result<Self> {
        let recipe = run::run_recipe(dir)?;
        let tokenizer = run::run_tokenizer(dir)?;
        let template = match Template::find(dir) {
            Ok(t) => Some(t),
            Err(NoTemplate::Missing(_)) => None,
            Err(NoTemplate::Invalid(e)) => return Err(e),
        };
        let ends = Ends::of(dir, &tokenizer)?;
        let (model, weights, device, _) =
            run::load_model_on(dir, &recipe, &common.device, common.dtype)?;
        Ok(Self {
            model,
            tokenizer,
            template,
            ends,
            weights,
            device,
        })
    }

    /// The prompt's ids: `text` as one user turn of the chat template with the assistant's
    /// turn opened (and `reply` begun in it), else `text` as it is.
    fn prompt(&self, text: &str, reply: &str) -> Result<Vec<u32>> {
        let rendered = match &self.template {
            Some(template) => {
                let turn = Message::new("user", text.trim_end());
                template.render(&[turn], true)? + reply
            }
            None => format!("{text}{reply}"),
        };
        Ok(self.tokenizer.encode(&rendered)?)
    }

    fn answer(&self, args: &HallucinationArgs, task: &Task) -> Result<String> {
        let text = fill(
            &args.template,
            &[("source", &task.source), ("instruction", &task.instruction)],
        );
        let ids = self.prompt(&text, "")?;
        if ids.is_empty() {
            bail!("the prompt is empty");
        }
        let max_tokens = task.max_tokens.unwrap_or(args.max_tokens);
        let capacity = self.model.cache().capacity();
        if ids.len().saturating_add(max_tokens) > capacity {
            bail!(
                "the prompt ({} tokens) and {max_tokens} generated tokens exceed the model's context of {capacity}",
                ids.len()
            );
        }
        let stop = match (&self.template, &args.stop) {
            (_, Some(stop)) => Some(stop.as_str()),
            (None, None) => Some("\n"),
            (Some(_), None) => None,
        };
        let output = greedy(
            &self.model,
            &self.device,
            &self.tokenizer,
            &self.ends,
            &ids,
            max_tokens,
            stop,
        )?;
        Ok(output.trim().to_string())
    }
}

/// The verdicts of `cmd:PROGRAM`, one JSON line out and one in per item.
fn command_verdicts(
    program: &str,
    tasks: &[Task],
    outputs: &[String],
) -> Result<Vec<(bool, Option<[f64; 2]>)>> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(program)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the judge `{program}`"))?;
    let result = exchange(&mut child, program, tasks, outputs);
    if result.is_err() {
        let _ = child.kill();
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for the judge `{program}`"))?;
    let verdicts = result?;
    if !status.success() {
        bail!("the judge `{program}` ended with {status}");
    }
    Ok(verdicts)
}

fn exchange(
    child: &mut Child,
    program: &str,
    tasks: &[Task],
    outputs: &[String],
) -> Result<Vec<(bool, Option<[f64; 2]>)>> {
    // The questions go in from a thread of their own while the answers are read here, so that a
    // judge that reads ahead, or holds its answers back in a buffer, cannot block both sides.
    let mut stdin = child.stdin.take().expect("piped");
    let questions: Vec<String> = tasks
        .iter()
        .zip(outputs)
        .map(|(task, output)| {
            json!({
                "source": task.source,
                "instruction": task.instruction,
                "reference": task.reference,
                "output": output,
            })
            .to_string()
        })
        .collect();
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        for question in questions {
            writeln!(stdin, "{question}")?;
        }
        stdin.flush()
    });
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let mut verdicts = Vec::with_capacity(tasks.len());
    for task in tasks {
        let mut line = String::new();
        let read = stdout
            .read_line(&mut line)
            .with_context(|| format!("{}: reading the judge's answer", task.at))?;
        if read == 0 {
            bail!(
                "{}: the judge `{program}` ended its output before answering this item",
                task.at
            );
        }
        let supported = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v.get("supported").and_then(Value::as_bool));
        let Some(supported) = supported else {
            bail!(
                "{}: the judge `{program}` answered {:?}: expected {{\"supported\": true|false}}",
                task.at,
                line.trim_end()
            );
        };
        verdicts.push((supported, None));
    }
    writer
        .join()
        .expect("the writer does not panic")
        .with_context(|| format!("the judge `{program}` stopped reading its questions"))?;
    Ok(verdicts)
}

/// The verdicts of an instruct model: ` True` or ` False` after `**Conclusion:`, the likelier.
fn run_verdicts(
    dir: &Path,
    kind: &str,
    tasks: &[Task],
    outputs: &[String],
    common: &super::Common,
) -> Result<Vec<(bool, Option<[f64; 2]>)>> {
    let judge = Generator::open(dir, common)?;
    let answers: Vec<Vec<u32>> = [" True", " False"]
        .iter()
        .map(|a| judge.tokenizer.encode(a))
        .collect::<Result<_, _>>()?;
    let capital = |s: &str| {
        let mut c = s.chars();
        c.next()
            .map_or(String::new(), |f| f.to_uppercase().chain(c).collect())
    };
    tasks
        .iter()
        .zip(outputs)
        .map(|(task, output)| {
            let kind_title = capital(kind);
            let question = fill(
                JUDGE_PROMPT,
                &[
                    ("kind", kind),
                    ("Kind", &kind_title),
                    ("source", &task.source),
                    ("instruction", &task.instruction),
                    (
                        "reference",
                        task.reference.as_deref().unwrap_or("(none given)"),
                    ),
                    ("output", output),
                ],
            );
            let context = judge.prompt(&question, "**Conclusion:")?;
            let longest = answers.iter().map(Vec::len).max().unwrap_or(1);
            let capacity = judge.model.cache().capacity();
            if context.len() + longest > capacity + 1 {
                bail!(
                    "{}: the judge's question takes {} tokens, beyond its context of {capacity}",
                    task.at,
                    context.len()
                );
            }
            let scores = log_likelihoods(&judge.model, &context, &answers, &judge.device);
            Ok((scores[0] >= scores[1], Some([scores[0], scores[1]])))
        })
        .collect()
}
