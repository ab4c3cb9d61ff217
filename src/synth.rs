//! `diffzoo data synth icl|grounded --out DIR`: the seeded synthetic tasks of `eval icl` and
//! `eval hallucination` as files — documents to train on (`train.jsonl`, for `data prepare`)
//! and the evaluation sets in the shapes the evaluations read.
//!
//! ```text
//! icl        train.jsonl  {"text": episode}      demonstrations under a fresh label mapping each
//!            conversations.jsonl, template.jinja  the same episodes as conversations: each
//!                         label an assistant turn (`data prepare --template` scores them alone)
//!            demos.jsonl  {"text", "label"}      one mapping, shared with test.jsonl
//!            test.jsonl   {"text", "label"}
//! grounded   train.jsonl  {"text": document}     source, question and answer
//!            task.jsonl   {"source", "instruction", "reference"}
//! ```
//!
//! See [`diffzoo_datasets::icl`] and [`diffzoo_datasets::grounded`] for the tasks.

use anyhow::{Context, Result, bail};
use diffzoo_datasets::{grounded, icl};
use serde_json::json;
use std::io::Write;
use std::path::Path;

#[derive(Debug, Clone, clap::Subcommand)]
pub enum SynthTask {
    /// In-context classification: texts of C classes, labels that only demonstrations explain.
    Icl(IclSynthArgs),
    /// Grounded question answering: facts in a source, a question, its answer a span of it.
    Grounded(GroundedSynthArgs),
}

/// A chat template that writes the turns' contents one after the other: the conversations of
/// `icl` render to the text of their episodes, with the labels (the assistant's turns) scored.
const CONCATENATION: &str = "{% for message in messages %}{{ message['content'] }}{% endfor %}";

/// What both tasks take.
#[derive(Debug, Clone, clap::Args)]
pub struct Files {
    /// The directory to write (must not exist).
    #[arg(long)]
    pub out: std::path::PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Training documents in train.jsonl.
    #[arg(long, default_value_t = 20_000)]
    pub documents: usize,
    /// Items in each evaluation file.
    #[arg(long, default_value_t = 200)]
    pub items: usize,
}

#[derive(Debug, Clone, clap::Args)]
pub struct IclSynthArgs {
    #[command(flatten)]
    pub files: Files,
    /// Classes (2 to 8).
    #[arg(long, default_value_t = 6)]
    pub classes: usize,
    /// Words per text.
    #[arg(long, default_value_t = 6)]
    pub words: usize,
    /// The chance that a word is a cue of its text's class.
    #[arg(long, default_value_t = 0.5)]
    pub signal: f64,
    /// Cue words per class (1 to 6; 1: each class's texts share their one cue).
    #[arg(long, default_value_t = 6)]
    pub cues: usize,
    /// A training episode holds 1 to this many demonstrations.
    #[arg(long, default_value_t = 32)]
    pub max_shots: usize,
    /// A demonstration's text: `{text}` and then `{label}`, each once (`eval icl --template`
    /// must then say the same).
    #[arg(long, default_value = icl::TEMPLATE)]
    pub template: String,
}

#[derive(Debug, Clone, clap::Args)]
pub struct GroundedSynthArgs {
    #[command(flatten)]
    pub files: Files,
    /// Facts per source.
    #[arg(long, default_value_t = 8)]
    pub facts: usize,
}

pub fn run(task: &SynthTask) -> Result<()> {
    match task {
        SynthTask::Icl(a) => {
            let task = icl::Task {
                classes: a.classes,
                words: a.words,
                signal: a.signal,
                cues: a.cues,
            };
            task.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
            if a.max_shots == 0 {
                bail!("--max-shots must be positive");
            }
            crate::eval::icl::split_template(&a.template)?;
            let f = start(&a.files)?;
            let episodes = (0..f.documents as u64)
                .map(|i| json!({ "text": task.episode(f.seed, i, a.max_shots, &a.template) }));
            write_lines(&f.out.join("train.jsonl"), episodes)?;
            // The same episodes as conversations, for a loss on the labels alone.
            let conversations = (0..f.documents as u64).map(|i| {
                let turns = task.episode_turns(f.seed, i, a.max_shots, &a.template);
                let messages: Vec<serde_json::Value> = turns
                    .into_iter()
                    .flat_map(|(user, assistant)| {
                        [
                            json!({ "role": "user", "content": user }),
                            json!({ "role": "assistant", "content": assistant }),
                        ]
                    })
                    .collect();
                json!({ "messages": messages })
            });
            write_lines(&f.out.join("conversations.jsonl"), conversations)?;
            std::fs::write(f.out.join("template.jinja"), CONCATENATION)
                .with_context(|| format!("writing {}", f.out.join("template.jinja").display()))?;
            // The evaluation sets: one mapping of their own (seed + 1), two streams.
            let items = |stream| {
                task.items(f.seed.wrapping_add(1), stream, f.items)
                    .into_iter()
                    .map(|i| json!({ "text": i.text, "label": i.label }))
            };
            write_lines(&f.out.join("demos.jsonl"), items(1))?;
            write_lines(&f.out.join("test.jsonl"), items(2))?;
            say(
                f,
                "train.jsonl (and as conversations.jsonl with template.jinja), demos.jsonl and test.jsonl",
            );
        }
        SynthTask::Grounded(a) => {
            let task = grounded::Task { facts: a.facts };
            task.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
            let f = start(&a.files)?;
            let documents = (0..f.documents as u64)
                .map(|i| json!({ "text": task.document(f.seed, i, grounded::TEMPLATE) }));
            write_lines(&f.out.join("train.jsonl"), documents)?;
            let items = (0..f.items as u64).map(|i| {
                let item = task.item(f.seed.wrapping_add(1), i);
                json!({
                    "source": item.source,
                    "instruction": item.instruction,
                    "reference": item.reference,
                })
            });
            write_lines(&f.out.join("task.jsonl"), items)?;
            say(f, "train.jsonl and task.jsonl");
        }
    }
    Ok(())
}

/// Checks the shared arguments and creates the directory.
fn start(files: &Files) -> Result<&Files> {
    if files.documents == 0 || files.items == 0 {
        bail!("--documents and --items must be positive");
    }
    if files.out.exists() {
        bail!("{} already exists: choose a new --out", files.out.display());
    }
    std::fs::create_dir_all(&files.out)
        .with_context(|| format!("creating {}", files.out.display()))?;
    Ok(files)
}

fn say(files: &Files, what: &str) {
    println!(
        "wrote {what} into {} ({} training documents, {} items per evaluation file, seed {})",
        files.out.display(),
        files.documents,
        files.items,
        files.seed
    );
}

fn write_lines(path: &Path, lines: impl Iterator<Item = serde_json::Value>) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for line in lines {
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("writing {}", path.display()))
}
