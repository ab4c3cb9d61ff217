//! What the generator tests share: training windows over the embedded plays.

use diffzoo_datasets::shards::prepare;
use diffzoo_datasets::{
    Document, InMemory, PrepareOptions, Shards, Split, TextTokenizer, TokenWindows, corpus,
};
use std::path::Path;

/// Training windows of `seq_len` over the first two plays, sharded in `dir` with `tokenizer`.
pub fn windows(dir: &Path, tokenizer: &TextTokenizer, seq_len: usize) -> TokenWindows {
    let docs = corpus::plays()
        .iter()
        .take(2)
        .map(|p| Document {
            origin: p.title.clone(),
            row: None,
            text: p.text.clone(),
        })
        .collect();
    let mut options = PrepareOptions::new(dir.join("shards"));
    options.validation_every = 0;
    prepare(InMemory::new(docs), tokenizer, &options, Vec::new()).unwrap();
    let shards = Shards::open(&dir.join("shards")).unwrap();
    TokenWindows::new(shards.tokens(Split::Train).unwrap(), seq_len)
}
