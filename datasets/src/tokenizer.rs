//! Tokenizers in Hugging Face's `tokenizer.json` format: a byte-level BPE trained here
//! (deterministically, cached) or any file the user gives (a tiktoken rank file is converted). Each tokenizer is identified by a
//! hash of its canonical JSON, recorded in shards and checkpoints.

use crate::error::{DataError, Result};
use sha2::{Digest, Sha256};
use std::path::Path;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The end-of-text token of tokenizers trained here.
pub const EOT: &str = "<|endoftext|>";

/// End-of-text tokens looked for in a user's tokenizer, in this order.
pub const EOT_CANDIDATES: [&str; 5] = [EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>"];

/// Where a token lies in the text it was encoded from: its byte range.
pub type Offsets = (usize, usize);

/// A tokenizer with its end-of-text id and identity hash.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    json: String,
    hash: String,
    eot: u32,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("hash", &self.hash)
            .field("vocab_size", &self.vocab_size())
            .field("eot", &self.eot)
            .finish()
    }
}

impl TextTokenizer {
    fn from_tokenizer(inner: Tokenizer, origin: &Path) -> Result<Self> {
        let invalid = |reason: String| DataError::Tokenizer {
            path: origin.to_path_buf(),
            reason,
        };
        let json = inner.to_string(false).map_err(|e| invalid(e.to_string()))?;
        let eot = EOT_CANDIDATES
            .iter()
            .find_map(|t| inner.token_to_id(t))
            .ok_or_else(|| {
                invalid(format!(
                    "it has none of the end-of-text tokens {EOT_CANDIDATES:?}"
                ))
            })?;
        let hash = format!("{:x}", Sha256::digest(json.as_bytes()))[..16].to_string();
        Ok(Self {
            inner,
            json,
            hash,
            eot,
        })
    }

    /// Loads a `tokenizer.json`, or a tiktoken rank file (`*.tiktoken`, converted: see
    /// [`crate::tiktoken`]).
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = if path.extension().is_some_and(|e| e == "tiktoken") {
            let converted = crate::tiktoken::convert(path)?;
            if let Some(warning) = converted.warning {
                eprintln!("warning: {warning}");
            }
            converted.json.into_bytes()
        } else {
            std::fs::read(path).map_err(DataError::io(path))?
        };
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::from_tokenizer(inner, path)
    }

    /// Trains a GPT-2 style byte-level BPE of `vocab_size` tokens (the 256 byte symbols and
    /// [`EOT`] included) on `texts`. The result depends only on the texts and their order.
    pub fn train_bpe<'a>(
        texts: impl Iterator<Item = &'a str> + Send,
        vocab_size: usize,
    ) -> Result<Self> {
        let alphabet = ByteLevel::alphabet();
        if vocab_size < alphabet.len() + 1 {
            return Err(DataError::Invalid(format!(
                "vocabulary size {vocab_size} is below the byte-level minimum {}",
                alphabet.len() + 1
            )));
        }
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(0)
            .show_progress(false)
            .special_tokens(vec![AddedToken::from(EOT, true)])
            .initial_alphabet(alphabet.into_iter().collect())
            .build()
            .into();
        let mut inner = Tokenizer::new(BPE::default());
        inner
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
            .with_decoder(Some(ByteLevel::default()))
            .with_post_processor(Some(ByteLevel::new(false, true, true)));
        inner
            .train(&mut trainer, texts)
            .map_err(|e| DataError::Invalid(format!("training the tokenizer failed: {e}")))?;
        Self::from_tokenizer(inner, Path::new("<trained>"))
    }

    /// Writes the tokenizer atomically (temporary name, then rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        write_atomically(path, self.json.as_bytes())
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DataError::Invalid(format!("tokenization failed: {e}")))
    }

    /// The ids of `text` and each one's byte range in it.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Offsets>)> {
        self.inner
            .encode(text, false)
            .map(|e| (e.get_ids().to_vec(), e.get_offsets().to_vec()))
            .map_err(|e| DataError::Invalid(format!("tokenization failed: {e}")))
    }

    /// The id of token `token`, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::Invalid(format!("detokenization failed: {e}")))
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// One more than the largest id (the vocabulary size a model needs; more than
    /// [`Self::vocab_size`] when added tokens leave gaps).
    pub fn id_bound(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1)
    }

    /// The end-of-text token's text, e.g. `<|endoftext|>`.
    pub fn eot_token(&self) -> String {
        self.inner
            .id_to_token(self.eot)
            .expect("the end-of-text id was found by its token")
    }

    pub fn eot_id(&self) -> u32 {
        self.eot
    }

    /// First 16 hex digits of the SHA-256 of the canonical JSON.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    pub fn json(&self) -> &str {
        &self.json
    }
}

/// Writes `bytes` to `path` through a temporary sibling and a rename, creating parents.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(DataError::io(parent))?;
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(DataError::io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(DataError::io(path))
}
