//! # diffzoo-datasets
//!
//! The data side of diffzoo: the embedded corpus ([`corpus`]), tokenizers ([`tokenizer`], and
//! [`tiktoken`] rank files converted), reading text inputs ([`input`]: text, JSON lines, Parquet),
//! token shards ([`shards`])
//! and training windows with an exactly resumable order ([`windows`]), two retrieval tasks:
//! needle in a haystack ([`needle`]) and multi-query associative recall ([`recall`]), and two
//! synthetic task generators: in-context classification ([`icl`]) and grounded question
//! answering ([`grounded`]).

pub mod corpus;
pub mod error;
pub mod grounded;
pub mod icl;
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

/// `template` with each `{key}` of `values` replaced by its value, in one pass: a value holding
/// `{another}` is left as it is. Other braces stay.
pub fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open..];
        let hit = values.iter().find_map(|(key, value)| {
            let placeholder = format!("{{{key}}}");
            after
                .starts_with(&placeholder)
                .then_some((placeholder.len(), *value))
        });
        match hit {
            Some((len, value)) => {
                out.push_str(value);
                rest = &after[len..];
            }
            None => {
                out.push('{');
                rest = &after[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

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

#[cfg(test)]
mod tests {
    #[test]
    fn placeholders_are_filled_once_and_values_are_not_read_as_templates() {
        let filled = super::fill("{a} and {b}, {c} {", &[("a", "x {b}"), ("b", "y")]);
        assert_eq!(filled, "x {b} and y, {c} {");
    }
}
