//! `diffzoo data prepare`: text files into token shards, on one machine, as part I of N
//! (`--part`, merged by `diffzoo data merge`), or as Slurm jobs (`--slurm N`);
//! `diffzoo data tokenizer`: the BPE alone, trained once before the parts;
//! `diffzoo data verify`: shards checked against their manifest.

use crate::chat::{self, Template};
use crate::layout;
use crate::run;
use crate::slurm::{self, After, Job, SlurmArgs};
use anyhow::{Context, Result, bail};
use diffzoo_datasets::input::{InputFile, Records};
use diffzoo_datasets::parts::{self, part_dir};
use diffzoo_datasets::shards::{MANIFEST, Scored, SplitRule, prepare as prepare_shards};
use diffzoo_datasets::{Documents, PrepareOptions, Skip, Split, TextTokenizer, TokenDtype, input};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct PrepareArgs {
    /// Input files or directories (.txt, .jsonl, .txt.gz, .jsonl.gz, .parquet; directories
    /// recursively).
    #[arg(long = "input", required = true, num_args = 1..)]
    inputs: Vec<PathBuf>,
    /// A tokenizer.json to use (with --template RUN: default the run's).
    #[arg(long, conflicts_with = "vocab_size")]
    tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE of this size on the inputs instead.
    #[arg(long, required_unless_present_any = ["tokenizer", "template"])]
    vocab_size: Option<usize>,
    /// Instruction data: the inputs are JSON lines of conversations (`messages`: a list of
    /// {"role", "content"}) or of `prompt`/`completion` pairs, rendered with this chat template
    /// (a run or checkpoint directory holding one, or a .jinja file); the loss will score the
    /// assistant's tokens only.
    #[arg(long, conflicts_with_all = ["vocab_size", "part", "slurm"])]
    template: Option<PathBuf>,
    /// With --template: skip conversations longer than this many tokens (default: the template
    /// run's context, when --template is a run).
    #[arg(long, requires = "template")]
    context: Option<usize>,
    /// With --template: conversations for the validation split alone (files or directories, as
    /// --input); the --input ones then all go to training, whatever --validation-every says.
    #[arg(long, requires = "template", num_args = 1..)]
    validation_input: Vec<PathBuf>,
    /// Text bytes read from the inputs to train the BPE on.
    #[arg(long, default_value_t = 256 << 20)]
    tokenizer_sample_bytes: usize,
    /// Output directory (with --part or --slurm: the directory holding the parts).
    #[arg(long)]
    out: PathBuf,
    /// Field holding the text: of each .jsonl line's object, and the (string) column of .parquet
    /// inputs.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// About one document in N goes to the validation split, chosen by the SHA-256 of its text
    /// (0: none).
    #[arg(long, default_value_t = 200)]
    validation_every: usize,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 1 << 28)]
    shard_tokens: u64,
    /// Token storage: u16 or u32 (default: u16 when the vocabulary fits).
    #[arg(long)]
    dtype: Option<String>,
    /// Replace an existing output directory (with --part: that part's; with --slurm: the
    /// parts').
    #[arg(long)]
    overwrite: bool,
    /// Prepare only part I of N (I from 0) of the inputs into OUT/part-I; `diffzoo data merge
    /// OUT` joins the parts. Needs --tokenizer.
    #[arg(long, value_name = "I/N", conflicts_with = "slurm")]
    part: Option<String>,
    /// Write (or with --submit, submit) Slurm jobs preparing the inputs in N parts: the
    /// tokenizer (with --vocab-size), an array of N parts, the merge.
    #[arg(long, value_name = "N")]
    slurm: Option<usize>,
    #[command(flatten)]
    slurm_args: SlurmArgs,
    /// CPUs of each part's task (with --slurm).
    #[arg(long, default_value_t = 8, requires = "slurm")]
    cpus_per_task: usize,
    /// Print the manifest as JSON.
    #[arg(long)]
    json: bool,
}

pub fn prepare(args: &PrepareArgs) -> Result<()> {
    let dtype = match args.dtype.as_deref() {
        None => None,
        Some("u16") => Some(TokenDtype::U16),
        Some("u32") => Some(TokenDtype::U32),
        Some(other) => bail!("--dtype {other}: expected u16 or u32"),
    };
    if args.shard_tokens == 0 {
        bail!("--shard-tokens must be positive");
    }
    if let Some(count) = args.slurm {
        return slurm_jobs(args, count);
    }
    if let Some(template) = &args.template {
        return prepare_conversations(args, template, dtype);
    }
    let part = args.part.as_deref().map(parse_part).transpose()?;
    let out = match part {
        Some((index, _)) => part_dir(&args.out, index),
        None => args.out.clone(),
    };
    if out.exists() && !args.overwrite {
        bail!(
            "{}: already exists (pass --overwrite to replace it)",
            out.display()
        );
    }
    let (files, skipped) = input::resolve(&args.inputs)?;
    let tokenizer = match (&args.tokenizer, args.vocab_size) {
        (Some(path), _) => TextTokenizer::from_file(path)?,
        (None, Some(_)) if part.is_some() => bail!(
            "--part needs --tokenizer FILE, one tokenizer for every part: train it first with `diffzoo data tokenizer --input ... --vocab-size N --out FILE`"
        ),
        (None, Some(vocab)) => train_tokenizer(&files, vocab, args)?,
        (None, None) => bail!("give --tokenizer FILE or --vocab-size N"),
    };
    let (files, skipped, part_info) = match part {
        Some((index, count)) => {
            let part = parts::select(files, skipped, index, count)?;
            (part.files, part.skipped, Some(part.info))
        }
        None => (files, skipped, None),
    };
    if part.is_some() {
        remove_stale_merge(&args.out)?;
    }
    let options = PrepareOptions {
        out: out.clone(),
        validation_every: args.validation_every,
        split_rule: SplitRule::Sha256,
        part: part_info,
        shard_tokens: args.shard_tokens,
        dtype,
        overwrite: args.overwrite,
        progress: true,
    };
    let manifest = prepare_shards(
        Documents::new(files, &args.text_field),
        &tokenizer,
        &options,
        skipped,
    )?;
    report(&out, &manifest, args.json, "documents")
}

/// Prints what a preparation wrote (or its manifest, with `json`), and says so when the
/// validation split got nothing.
fn report(
    out: &Path,
    manifest: &diffzoo_datasets::Manifest,
    json: bool,
    documents: &str,
) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(manifest)?);
    } else {
        let scored = |split: &diffzoo_datasets::shards::SplitInfo| {
            split
                .scored_tokens
                .map_or(String::new(), |n| format!(" ({n} scored)"))
        };
        println!(
            "{}: {} train tokens{} in {} {documents}, {} validation tokens{} in {} {documents}, {} shard files, tokenizer {}",
            out.display(),
            manifest.train.tokens,
            scored(&manifest.train),
            manifest.train.documents,
            manifest.validation.tokens,
            scored(&manifest.validation),
            manifest.validation.documents,
            manifest.train.shards.len() + manifest.validation.shards.len(),
            manifest.tokenizer.hash
        );
        print_skipped(&manifest.skipped);
    }
    if manifest.validation.documents == 0
        && manifest.validation_every > 0
        && manifest.part.is_none()
    {
        eprintln!(
            "warning: the validation split is empty: none of the {} {documents} was chosen for it (about one in {}); training needs one. Pass a smaller --validation-every (e.g. --validation-every 2), or give more {documents}",
            manifest.train.documents, manifest.validation_every
        );
    }
    Ok(())
}

/// `data prepare --template`: conversations rendered with a chat template into conversation
/// shards (see `diffzoo_datasets::shards`), the assistant's tokens flagged for the loss. The
/// shard directory keeps the template and the tokenizer's companions, so that a run trained on
/// it can chat as its source did.
fn prepare_conversations(
    args: &PrepareArgs,
    template_path: &Path,
    dtype: Option<TokenDtype>,
) -> Result<()> {
    if args.out.exists() && !args.overwrite {
        bail!(
            "{}: already exists (pass --overwrite to replace it)",
            args.out.display()
        );
    }
    let template = Template::open(template_path)
        .with_context(|| format!("--template {}", template_path.display()))?;
    let run_dir = template_path.is_dir().then_some(template_path);
    let tokenizer = match (&args.tokenizer, run_dir) {
        (Some(path), _) => TextTokenizer::from_file(path)?,
        (None, Some(dir)) if dir.join(layout::TOKENIZER).is_file() => {
            TextTokenizer::from_file(&dir.join(layout::TOKENIZER))?
        }
        (None, _) => bail!(
            "--template {} holds no {}: give --tokenizer FILE",
            template_path.display(),
            layout::TOKENIZER
        ),
    };
    let context = match (args.context, run_dir) {
        (Some(n), _) => Some(n),
        (None, Some(dir)) if dir.join(layout::RECIPE).is_file() => {
            Some(run::run_recipe(dir)?.model_config().max_seq_len)
        }
        _ => None,
    };
    // The split of each input: by the rule, or given (--validation-input).
    let given = !args.validation_input.is_empty();
    let inputs = [
        (&args.inputs, given.then_some(Split::Train)),
        (&args.validation_input, Some(Split::Validation)),
    ];
    let (mut conversations, mut skipped, mut input_bytes) = (Vec::new(), Vec::new(), 0);
    for (paths, split) in inputs.into_iter().filter(|(p, _)| !p.is_empty()) {
        let (files, skips) = input::resolve(paths)?;
        skipped.extend(skips);
        input_bytes += files
            .iter()
            .map(|f| std::fs::metadata(&f.path).map_or(0, |m| m.len()))
            .sum::<u64>();
        let mut records = Records::new(files)?;
        for record in &mut records {
            let record = record?;
            let skip = |reason: String| Skip {
                file: record.file.display().to_string(),
                line: Some(record.line),
                row: None,
                reason,
            };
            let rendered = chat::training_turns(&record.value)
                .and_then(|messages| chat::scored_tokens(&template, &tokenizer, &messages));
            match rendered {
                Err(e) => skipped.push(skip(format!("{e:#}"))),
                Ok((_, ids, _)) if context.is_some_and(|c| ids.len() > c) => {
                    skipped.push(skip(format!(
                        "{} tokens, longer than the context of {}",
                        ids.len(),
                        context.unwrap_or_default()
                    )))
                }
                Ok((text, ids, scored)) => {
                    conversations.push((split, Scored { text, ids, scored }))
                }
            }
        }
        skipped.extend(records.skipped().iter().cloned());
    }
    let options = PrepareOptions {
        out: args.out.clone(),
        validation_every: args.validation_every,
        split_rule: SplitRule::Sha256,
        part: None,
        shard_tokens: args.shard_tokens,
        dtype,
        overwrite: args.overwrite,
        progress: false,
    };
    let manifest = diffzoo_datasets::shards::prepare_conversations(
        conversations.into_iter(),
        &tokenizer,
        &options,
        template.origin(),
        input_bytes,
        skipped,
    )?;
    // The template goes with the shards, with the files it was rendered with (the special
    // tokens of a tokenizer_config.json beside a template file) and the end-of-turn ids.
    match run_dir {
        Some(dir) => {
            layout::copy_companions(dir, &args.out)?;
        }
        None => {
            if let Some(dir) = template_path.parent() {
                layout::copy_companions(dir, &args.out)?;
            }
            std::fs::copy(template_path, args.out.join(chat::TEMPLATE_FILE)).with_context(
                || {
                    format!(
                        "copying {} into {}",
                        template_path.display(),
                        args.out.display()
                    )
                },
            )?;
        }
    }
    report(&args.out, &manifest, args.json, "conversations")
}

#[derive(Debug, Clone, clap::Args)]
pub struct TokenizerArgs {
    /// Input files or directories, as for `data prepare`.
    #[arg(long = "input", required = true, num_args = 1..)]
    inputs: Vec<PathBuf>,
    /// Vocabulary size of the byte-level BPE.
    #[arg(long)]
    vocab_size: usize,
    /// Text bytes read from the inputs to train on.
    #[arg(long, default_value_t = 256 << 20)]
    tokenizer_sample_bytes: usize,
    /// Field holding the text: of each .jsonl line's object, and the (string) column of .parquet
    /// inputs.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// Where to write tokenizer.json.
    #[arg(long)]
    out: PathBuf,
}

/// Trains the BPE that `data prepare --vocab-size` would, and writes it alone.
pub fn tokenizer(args: &TokenizerArgs) -> Result<()> {
    let (files, _) = input::resolve(&args.inputs)?;
    let tokenizer = train_tokenizer(
        &files,
        args.vocab_size,
        Sample {
            bytes: args.tokenizer_sample_bytes,
            text_field: &args.text_field,
        },
    )?;
    tokenizer.save(&args.out)?;
    println!("{}: tokenizer {}", args.out.display(), tokenizer.hash());
    Ok(())
}

#[derive(Debug, Clone, clap::Args)]
pub struct MergeArgs {
    /// The directory holding part-0 ... part-(N-1) from `data prepare --part`.
    dir: PathBuf,
}

/// Writes one manifest over all parts of a partitioned preparation.
pub fn merge(args: &MergeArgs) -> Result<()> {
    let (manifest, count) = parts::merge(&args.dir)?;
    println!(
        "{}: {count} parts merged: {} train tokens in {} documents, {} validation tokens in {} documents, tokenizer {}",
        args.dir.display(),
        manifest.train.tokens,
        manifest.train.documents,
        manifest.validation.tokens,
        manifest.validation.documents,
        manifest.tokenizer.hash
    );
    print_skipped(&manifest.skipped);
    Ok(())
}

#[derive(Debug, Clone, clap::Args)]
pub struct VerifyArgs {
    /// A shard directory (from `diffzoo data prepare`).
    dir: PathBuf,
}

/// Checks every shard's size and SHA-256 against the manifest, and the tokenizer's hash.
pub fn verify(args: &VerifyArgs) -> Result<()> {
    let shards = diffzoo_datasets::Shards::open(&args.dir)?;
    shards.tokenizer()?;
    let (files, bytes) = shards.verify()?;
    println!(
        "{}: {files} shard files ({bytes} bytes) and the tokenizer match manifest.json",
        args.dir.display()
    );
    Ok(())
}

/// Whether `out` holds a merge of parts (every shard in a part directory): `None` when it holds
/// no manifest.
fn merge_of_parts(out: &Path) -> Result<Option<bool>> {
    let merged = out.join(MANIFEST);
    let text = match std::fs::read_to_string(&merged) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", merged.display())),
    };
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    Ok(Some(["train", "validation"].iter().all(|split| {
        manifest[split]["shards"].as_array().is_some_and(|shards| {
            shards
                .iter()
                .all(|s| s["file"].as_str().is_some_and(|f| f.starts_with("part-")))
        })
    })))
}

/// Removes the manifest of an earlier merge of the parts in `out` (it goes stale once a part is
/// prepared again); refuses a shard directory of its own. Parts prepared at the same time may
/// each find it, or find it gone.
fn remove_stale_merge(out: &Path) -> Result<()> {
    match merge_of_parts(out)? {
        None => return Ok(()),
        Some(false) => bail!(
            "{}: a shard directory of its own; --part writes part-I directories into a directory of parts (choose another --out)",
            out.display()
        ),
        Some(true) => {}
    }
    let merged = out.join(MANIFEST);
    match std::fs::remove_file(&merged) {
        Ok(()) => eprintln!(
            "removed {}: the merge is stale once a part is prepared again; run `diffzoo data merge {}`",
            merged.display(),
            out.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", merged.display())),
    }
    Ok(())
}

/// `I/N` with I < N.
fn parse_part(text: &str) -> Result<(usize, usize)> {
    let parsed = text
        .split_once('/')
        .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
    match parsed {
        Some((index, count)) if index < count => Ok((index, count)),
        _ => bail!("--part {text}: expected I/N with parts numbered 0 to N-1, e.g. 0/8"),
    }
}

/// What the BPE is trained on.
struct Sample<'a> {
    bytes: usize,
    text_field: &'a str,
}

impl<'a> From<&'a PrepareArgs> for Sample<'a> {
    fn from(args: &'a PrepareArgs) -> Self {
        Self {
            bytes: args.tokenizer_sample_bytes,
            text_field: &args.text_field,
        }
    }
}

fn train_tokenizer<'a>(
    files: &[InputFile],
    vocab: usize,
    sample: impl Into<Sample<'a>>,
) -> Result<TextTokenizer> {
    let sample = sample.into();
    let mut texts = Vec::new();
    let mut bytes = 0;
    for doc in Documents::new(files.to_vec(), sample.text_field) {
        let doc = doc?;
        bytes += doc.text.len();
        texts.push(doc.text);
        if bytes >= sample.bytes {
            break;
        }
    }
    eprintln!(
        "training a byte-level BPE of {vocab} tokens on {:.1} MB of text",
        bytes as f64 / 1e6
    );
    Ok(TextTokenizer::train_bpe(
        texts.iter().map(String::as_str),
        vocab,
    )?)
}

fn print_skipped(skipped: &[diffzoo_datasets::Skip]) {
    if skipped.is_empty() {
        return;
    }
    println!("skipped {} (listed in manifest.json):", skipped.len());
    for skip in skipped.iter().take(10) {
        match (skip.line, skip.row) {
            (Some(line), _) => println!("  {}:{line}: {}", skip.file, skip.reason),
            (None, Some(row)) => println!("  {} row {row}: {}", skip.file, skip.reason),
            (None, None) => println!("  {}: {}", skip.file, skip.reason),
        }
    }
}

/// `--slurm N`: the tokenizer job (when one is trained), an array of N parts, the merge.
fn slurm_jobs(args: &PrepareArgs, count: usize) -> Result<()> {
    check_parts(args, count)?;
    let exe = slurm::executable()?;
    let out = slurm::absolute(&args.out)?;
    let inputs = args
        .inputs
        .iter()
        .map(|p| slurm::absolute(p))
        .collect::<Result<Vec<_>>>()?;
    let mut jobs = Vec::new();
    let tokenizer = match (&args.tokenizer, args.vocab_size) {
        (Some(path), _) => slurm::absolute(path)?,
        (None, Some(vocab)) => {
            let path = format!("{out}/tokenizer-bpe-{vocab}.json");
            jobs.push(tokenizer_job(args, &exe, &inputs, vocab, &path));
            path
        }
        (None, None) => bail!("give --tokenizer FILE or --vocab-size N"),
    };
    let after_tokenizer = (!jobs.is_empty()).then_some(After::Ok(0));
    jobs.push(Job {
        after: after_tokenizer,
        ..prepare_job(args, count, &exe, &inputs, tokenizer, &out)
    });
    let parts_job = jobs.len() - 1;
    jobs.push(Job {
        name: "merge".into(),
        about: vec![format!(
            "Writes one manifest over the {count} parts: train on {out}."
        )],
        options: vec!["--cpus-per-task=1".into()],
        array: None,
        setup: Vec::new(),
        command: slurm::command_line(&[exe, "data".into(), "merge".into(), out.clone()]),
        resumable: false,
        after: Some(After::Ok(parts_job)),
    });
    let common = args.slurm_args.common(args.slurm_args.fixed_time()?)?;
    slurm::Plan {
        dir: Path::new(&out).join("slurm"),
        jobs,
    }
    .write_and_submit(&args.slurm_args, &common)?;
    Ok(())
}

/// What `--slurm N` can check before submitting, rather than in N failed tasks: the count, the
/// inputs and their partition, and that `--out` is a directory of parts not yet prepared (or
/// `--overwrite`).
fn check_parts(args: &PrepareArgs, count: usize) -> Result<()> {
    if count == 0 {
        bail!("--slurm 0: expected the number of parts (at least 1)");
    }
    let (files, _) = input::resolve(&args.inputs)?;
    parts::select(files, Vec::new(), 0, count)?;
    if merge_of_parts(&args.out)? == Some(false) {
        bail!(
            "{}: a shard directory of its own; parts go into a directory of parts (choose another --out)",
            args.out.display()
        );
    }
    if !args.overwrite
        && let Some(index) = (0..count).find(|&i| part_dir(&args.out, i).exists())
    {
        bail!(
            "{}: already exists (pass --overwrite to prepare the parts again)",
            part_dir(&args.out, index).display()
        );
    }
    Ok(())
}

/// The words of `exe data SUBCOMMAND --input INPUTS…`, a job's command before its options.
fn data_command(exe: &str, subcommand: &str, inputs: &[String]) -> Vec<String> {
    [exe, "data", subcommand, "--input"]
        .into_iter()
        .map(String::from)
        .chain(inputs.iter().cloned())
        .collect()
}

/// The job that trains the byte-level BPE of `vocab` tokens on `inputs` into `path`, once.
fn tokenizer_job(
    args: &PrepareArgs,
    exe: &str,
    inputs: &[String],
    vocab: usize,
    path: &str,
) -> Job {
    let mut words = data_command(exe, "tokenizer", inputs);
    words.extend([
        "--vocab-size".into(),
        vocab.to_string(),
        "--tokenizer-sample-bytes".into(),
        args.tokenizer_sample_bytes.to_string(),
        "--text-field".into(),
        args.text_field.clone(),
        "--out".into(),
        path.to_string(),
    ]);
    Job {
        name: "tokenizer".into(),
        about: vec![format!(
            "Trains the byte-level BPE of {vocab} tokens once, before the parts."
        )],
        options: vec![format!("--cpus-per-task={}", args.cpus_per_task)],
        array: None,
        setup: Vec::new(),
        command: slurm::command_line(&words),
        resumable: false,
        after: None,
    }
}

/// The array of `count` tasks, each preparing its part of `inputs` with `tokenizer` into
/// `out/part-I` (after nothing: the caller says after what).
fn prepare_job(
    args: &PrepareArgs,
    count: usize,
    exe: &str,
    inputs: &[String],
    tokenizer: String,
    out: &str,
) -> Job {
    let mut words = data_command(exe, "prepare", inputs);
    words.extend([
        "--tokenizer".into(),
        tokenizer,
        "--out".into(),
        out.to_string(),
        "--text-field".into(),
        args.text_field.clone(),
        "--validation-every".into(),
        args.validation_every.to_string(),
        "--shard-tokens".into(),
        args.shard_tokens.to_string(),
        // A requeued task starts its part again.
        "--overwrite".into(),
    ]);
    if let Some(dtype) = &args.dtype {
        words.extend(["--dtype".into(), dtype.clone()]);
    }
    Job {
        name: "prepare".into(),
        about: vec![
            format!(
                "Prepares part $SLURM_ARRAY_TASK_ID of {count} of the inputs into {out}/part-I"
            ),
            "(contiguous runs of the input files of about equal size).".into(),
        ],
        options: vec![format!("--cpus-per-task={}", args.cpus_per_task)],
        array: Some(count),
        setup: Vec::new(),
        command: format!(
            "{} --part \"${{SLURM_ARRAY_TASK_ID}}/{count}\"",
            slurm::command_line(&words)
        ),
        resumable: false,
        after: None,
    }
}
