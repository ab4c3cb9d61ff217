//! # diffzoo-datasets
//!
//! The data side of diffzoo: the embedded corpus ([`corpus`]), tokenizers ([`tokenizer`], and
//! [`tiktoken`] rank files converted), reading text inputs ([`input`]: text, JSON lines, Parquet),
//! token shards ([`shards`])
//! and training windows with an exactly resumable order ([`windows`]), and two retrieval tasks:
//! needle in a haystack ([`needle`]) and multi-query associative recall ([`recall`]).

pub mod corpus;
pub mod error;
pub mod input;
pub mod needle;
pub mod parquet_text;
pub mod parts;
pub mod recall;
pub mod rng;
pub mod shards;
pub mod tiktoken;
pub mod tokenizer;
pub mod windows;

pub use error::{DataError, Result};
pub use input::{Document, DocumentSource, Documents, InMemory, Skip};
pub use rng::Rng;
pub use shards::{Manifest, PrepareOptions, Shards, Split, TokenDtype, TokenStream};
pub use tokenizer::TextTokenizer;
pub use windows::{LmBatch, LmBatcher, SampleOrder, TokenWindows, WindowSlice};

use std::path::PathBuf;

/// Where tokenizers and prepared shards of the embedded corpus are cached: `$DIFFZOO_CACHE`,
/// else `$XDG_CACHE_HOME/diffzoo`, else `~/.cache/diffzoo`.
pub fn cache_dir() -> PathBuf {
    let env = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("DIFFZOO_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("diffzoo")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("diffzoo")))
        .unwrap_or_else(|| PathBuf::from(".diffzoo-cache"))
}
