//! `diffzoo data prepare`: text files into token shards; `diffzoo data verify`: shards checked
//! against their manifest.

use anyhow::{Result, bail};
use diffzoo_datasets::shards::prepare as prepare_shards;
use diffzoo_datasets::{Documents, PrepareOptions, TextTokenizer, TokenDtype, input};
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct PrepareArgs {
    /// Input files or directories (.txt, .jsonl, .txt.gz, .jsonl.gz; directories recursively).
    #[arg(long = "input", required = true, num_args = 1..)]
    inputs: Vec<PathBuf>,
    /// A tokenizer.json to use.
    #[arg(long, conflicts_with = "vocab_size")]
    tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE of this size on the inputs instead.
    #[arg(long, required_unless_present = "tokenizer")]
    vocab_size: Option<usize>,
    /// Text bytes read from the inputs to train the BPE on.
    #[arg(long, default_value_t = 256 << 20)]
    tokenizer_sample_bytes: usize,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// JSON field holding the text of .jsonl inputs.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// Every N-th document goes to the validation split (0: none).
    #[arg(long, default_value_t = 200)]
    validation_every: usize,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 1 << 28)]
    shard_tokens: u64,
    /// Token storage: u16 or u32 (default: u16 when the vocabulary fits).
    #[arg(long)]
    dtype: Option<String>,
    /// Replace an existing output directory.
    #[arg(long)]
    overwrite: bool,
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
    if args.out.exists() && !args.overwrite {
        bail!(
            "{}: already exists (pass --overwrite to replace it)",
            args.out.display()
        );
    }
    let (files, skipped) = input::resolve(&args.inputs)?;
    let tokenizer = match (&args.tokenizer, args.vocab_size) {
        (Some(path), _) => TextTokenizer::from_file(path)?,
        (None, Some(vocab)) => {
            let mut sample = Vec::new();
            let mut bytes = 0;
            for doc in Documents::new(files.clone(), &args.text_field) {
                let doc = doc?;
                bytes += doc.text.len();
                sample.push(doc.text);
                if bytes >= args.tokenizer_sample_bytes {
                    break;
                }
            }
            eprintln!(
                "training a byte-level BPE of {vocab} tokens on {:.1} MB of text",
                bytes as f64 / 1e6
            );
            TextTokenizer::train_bpe(sample.iter().map(String::as_str), vocab)?
        }
        (None, None) => bail!("give --tokenizer FILE or --vocab-size N"),
    };
    let options = PrepareOptions {
        out: args.out.clone(),
        validation_every: args.validation_every,
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
    if args.json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
    } else {
        println!(
            "{}: {} train tokens in {} documents, {} validation tokens in {} documents, {} shard files, tokenizer {}",
            args.out.display(),
            manifest.train.tokens,
            manifest.train.documents,
            manifest.validation.tokens,
            manifest.validation.documents,
            manifest.train.shards.len() + manifest.validation.shards.len(),
            manifest.tokenizer.hash
        );
        if !manifest.skipped.is_empty() {
            println!(
                "skipped {} (listed in manifest.json):",
                manifest.skipped.len()
            );
            for skip in manifest.skipped.iter().take(10) {
                match skip.line {
                    Some(line) => println!("  {}:{line}: {}", skip.file, skip.reason),
                    None => println!("  {}: {}", skip.file, skip.reason),
                }
            }
        }
    }
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
