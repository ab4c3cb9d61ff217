//! Token shards: flat little-endian arrays of token ids (u16 when the vocabulary fits, else u32),
//! one end-of-text token after every document, split by document into `train` and
//! `validation`, described by `manifest.json`. Readers memory-map the shards, so memory use does
//! not grow with the corpus.
//!
//! Conversation shards ([`prepare_conversations`], instruction data for fine-tuning) hold one
//! rendered conversation after another, no separator, and beside each shard a `.flags` file of
//! one byte per token: [`FLAG_SCORED`] when the loss scores the token as a target (the
//! assistant's), [`FLAG_START`] on each conversation's first token. Training reads one
//! conversation per window ([`crate::TokenWindows::conversations`]).
//!
//! `prepare` writes into `<out>.partial-<pid>` and renames it into place at the end, so an
//! interrupted run never leaves a torn output directory (rerun it to restart).

use crate::error::{DataError, Result};
use crate::input::{DocumentSource, Skip};
use crate::tokenizer::TextTokenizer;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

pub const MANIFEST: &str = "manifest.json";
pub const TOKENIZER: &str = "tokenizer.json";
const FORMAT: &str = "diffzoo-shards";
const VERSION: u32 = 1;
/// Text handed to the tokenizer workers at a time.
const BATCH_BYTES: usize = 32 << 20;

/// Storage type of token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    pub fn bytes(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }

    /// The smallest type that holds every id of a vocabulary.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            Self::U16
        } else {
            Self::U32
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Validation,
}

impl Split {
    /// The split of each of `n` documents: every `every`-th goes to validation (none if 0).
    pub fn assign(n: usize, every: usize) -> impl Iterator<Item = Split> {
        (0..n).map(move |i| SplitRule::EveryNth.split(i, "", every))
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Train => "train",
            Self::Validation => "validation",
        }
    }
}

/// Which documents go to the validation split, given `validation_every` = N.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitRule {
    /// Exactly every N-th document, counted in input order (manifests without the key).
    #[default]
    EveryNth,
    /// A document whose text's SHA-256 (its first 8 bytes, read as a big-endian number) is 0
    /// modulo N: about one in N, independent of the order and partition of the inputs, and duplicate documents
    /// always land in the same split.
    Sha256,
}

impl SplitRule {
    fn is_every_nth(&self) -> bool {
        *self == Self::EveryNth
    }

    /// The split of the `index`-th document (counted from 0), whose text is `text`.
    pub fn split(self, index: usize, text: &str, every: usize) -> Split {
        let validation = every > 0
            && match self {
                Self::EveryNth => index % every == every - 1,
                Self::Sha256 => {
                    let digest = Sha256::digest(text.as_bytes());
                    let prefix = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
                    prefix % every as u64 == 0
                }
            };
        if validation {
            Split::Validation
        } else {
            Split::Train
        }
    }
}

/// Which part of a partitioned preparation a shard directory is (`data prepare --part I/N`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartInfo {
    /// From 0.
    pub index: usize,
    pub count: usize,
    /// SHA-256 of the whole input list (every file's path and size, in order): parts of one
    /// preparation agree on it.
    pub inputs: String,
    /// Input files in this part.
    pub files: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub tokens: u64,
    pub sha256: String,
    /// Conversation shards: the SHA-256 of the `.flags` file beside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags_sha256: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitInfo {
    pub tokens: u64,
    pub documents: u64,
    pub shards: Vec<ShardInfo>,
    /// Conversation shards: the tokens the loss scores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scored_tokens: Option<u64>,
}

/// A conversation shard's flag byte: the loss scores this token as a target.
pub const FLAG_SCORED: u8 = 1;
/// A conversation shard's flag byte: a conversation starts at this token.
pub const FLAG_START: u8 = 2;

/// What a directory of conversation shards holds beyond tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationInfo {
    /// Where the chat template came from.
    pub template: String,
    /// Tokens of the longest conversation: training needs `data.seq_len` ≥ this − 1.
    pub longest: u64,
}

/// One rendered conversation to store: its text (which the validation split is chosen by), its
/// ids, and which of them the loss scores as targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub text: String,
    pub ids: Vec<u32>,
    pub scored: Vec<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    pub hash: String,
    pub vocab_size: usize,
    pub eot_id: u32,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub tokenizer: TokenizerInfo,
    pub dtype: TokenDtype,
    pub validation_every: usize,
    /// Not written when it is the default, so that manifests that mean what they always did read
    /// as before.
    #[serde(default, skip_serializing_if = "SplitRule::is_every_nth")]
    pub split_rule: SplitRule,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<PartInfo>,
    /// Set for conversation shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversations: Option<ConversationInfo>,
    pub input_bytes: u64,
    pub train: SplitInfo,
    pub validation: SplitInfo,
    pub skipped: Vec<Skip>,
}

impl Manifest {
    pub fn split(&self, split: Split) -> &SplitInfo {
        match split {
            Split::Train => &self.train,
            Split::Validation => &self.validation,
        }
    }
}

/// How `prepare` writes.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub out: PathBuf,
    /// About one document in `validation_every` goes to validation (0: none), chosen by
    /// `split_rule`.
    pub validation_every: usize,
    pub split_rule: SplitRule,
    /// Set when this is one part of a partitioned preparation: the part may then hold no tokens.
    pub part: Option<PartInfo>,
    /// Tokens per shard file.
    pub shard_tokens: u64,
    /// `None`: u16 when the vocabulary fits, else u32.
    pub dtype: Option<TokenDtype>,
    /// Replace an existing output directory.
    pub overwrite: bool,
    /// Draw a progress bar (on a terminal).
    pub progress: bool,
}

impl PrepareOptions {
    pub fn new(out: impl Into<PathBuf>) -> Self {
        Self {
            out: out.into(),
            validation_every: 200,
            split_rule: SplitRule::EveryNth,
            part: None,
            shard_tokens: 1 << 28,
            dtype: None,
            overwrite: false,
            progress: false,
        }
    }
}

/// One file being written, hashed as it goes.
struct HashedFile {
    path: PathBuf,
    writer: BufWriter<File>,
    hasher: Sha256,
}

impl HashedFile {
    fn create(path: PathBuf) -> Result<Self> {
        let handle = File::create(&path).map_err(DataError::io(&path))?;
        Ok(Self {
            path,
            writer: BufWriter::with_capacity(1 << 20, handle),
            hasher: Sha256::new(),
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.hasher.update(bytes);
        self.writer
            .write_all(bytes)
            .map_err(DataError::io(&self.path))
    }

    /// Synced to disk; its SHA-256.
    fn finish(self) -> Result<String> {
        let path = self.path;
        self.writer
            .into_inner()
            .map_err(|e| DataError::io(&path)(e.into_error()))?
            .sync_all()
            .map_err(DataError::io(&path))?;
        Ok(format!("{:x}", self.hasher.finalize()))
    }
}

/// The open shard: its tokens, its flags (conversation shards) and how many tokens so far.
struct OpenShard {
    tokens: HashedFile,
    flags: Option<HashedFile>,
    count: u64,
}

/// Writes one split's shards, hashing as it goes.
struct ShardWriter {
    dir: PathBuf,
    split: Split,
    dtype: TokenDtype,
    shard_tokens: u64,
    /// Whether shards get `.flags` files (conversation shards).
    flagged: bool,
    current: Option<OpenShard>,
    info: SplitInfo,
}

impl ShardWriter {
    fn new(dir: &Path, split: Split, dtype: TokenDtype, shard_tokens: u64, flagged: bool) -> Self {
        Self {
            dir: dir.to_path_buf(),
            split,
            dtype,
            shard_tokens,
            flagged,
            current: None,
            info: SplitInfo {
                scored_tokens: flagged.then_some(0),
                ..SplitInfo::default()
            },
        }
    }

    fn document(&mut self, ids: &[u32], eot: u32) -> Result<()> {
        for &id in ids.iter().chain(std::iter::once(&eot)) {
            self.token(id, None)?;
        }
        self.info.documents += 1;
        Ok(())
    }

    /// A conversation's tokens with their flags (no separator: the flags mark where it starts).
    fn conversation(&mut self, ids: &[u32], scored: &[bool]) -> Result<()> {
        for (i, (&id, &scored)) in ids.iter().zip(scored).enumerate() {
            let flags = (scored as u8 * FLAG_SCORED) | ((i == 0) as u8 * FLAG_START);
            self.token(id, Some(flags))?;
        }
        self.info.documents += 1;
        *self.info.scored_tokens.get_or_insert(0) += scored.iter().filter(|&&s| s).count() as u64;
        Ok(())
    }

    fn token(&mut self, id: u32, flags: Option<u8>) -> Result<()> {
        if self.current.is_none() {
            let file = format!("{}-{:05}.bin", self.split.name(), self.info.shards.len());
            let tokens = HashedFile::create(self.dir.join(&file))?;
            let flags = match self.flagged {
                true => Some(HashedFile::create(
                    self.dir.join(&file).with_extension("flags"),
                )?),
                false => None,
            };
            self.info.shards.push(ShardInfo {
                file,
                tokens: 0,
                sha256: String::new(),
                flags_sha256: None,
            });
            self.current = Some(OpenShard {
                tokens,
                flags,
                count: 0,
            });
        }
        let shard = self.current.as_mut().expect("shard is open");
        match self.dtype {
            TokenDtype::U16 => shard.tokens.write(&(id as u16).to_le_bytes())?,
            TokenDtype::U32 => shard.tokens.write(&id.to_le_bytes())?,
        }
        if let (Some(file), Some(flags)) = (shard.flags.as_mut(), flags) {
            file.write(&[flags])?;
        }
        shard.count += 1;
        self.info.tokens += 1;
        if shard.count == self.shard_tokens {
            self.close()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some(open) = self.current.take() {
            let shard = self.info.shards.last_mut().expect("open shard");
            shard.tokens = open.count;
            shard.sha256 = open.tokens.finish()?;
            shard.flags_sha256 = open.flags.map(HashedFile::finish).transpose()?;
        }
        Ok(())
    }
}

/// Tokenizes `documents` (in parallel, in batches) into shards under `options.out`, with the
/// tokenizer copied beside them. `skipped` lists what the input stage left out; documents that
/// tokenize to nothing are added to it.
pub fn prepare(
    mut documents: impl DocumentSource,
    tokenizer: &TextTokenizer,
    options: &PrepareOptions,
    mut skipped: Vec<Skip>,
) -> Result<Manifest> {
    let output = start(tokenizer, options)?;
    let mut writers = [Split::Train, Split::Validation].map(|split| {
        ShardWriter::new(
            &output.partial,
            split,
            output.dtype,
            options.shard_tokens,
            false,
        )
    });
    let bar = progress_bar(options.progress);
    let started = Instant::now();
    let (mut index, mut text_bytes, mut tokens) = (0usize, 0u64, 0u64);
    loop {
        let (mut batch, mut batch_bytes) = (Vec::new(), 0);
        while batch_bytes < BATCH_BYTES {
            let Some(doc) = documents.next() else { break };
            let doc = doc?;
            batch_bytes += doc.text.len();
            batch.push(doc);
        }
        if batch.is_empty() {
            break;
        }
        let encoded = batch
            .par_iter()
            .map(|doc| tokenizer.encode(&doc.text))
            .collect::<Result<Vec<_>>>()?;
        for (doc, ids) in batch.into_iter().zip(encoded) {
            text_bytes += doc.text.len() as u64;
            if ids.is_empty() {
                skipped.push(Skip {
                    file: doc.origin,
                    line: None,
                    row: doc.row,
                    reason: "no tokens".into(),
                });
                continue;
            }
            let split = options
                .split_rule
                .split(index, &doc.text, options.validation_every);
            writers[split as usize].document(&ids, tokenizer.eot_id())?;
            tokens += ids.len() as u64 + 1;
            index += 1;
        }
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_position(documents.bytes_read());
        bar.set_message(format!(
            "{index} docs, {tokens} tokens, {:.1} MB/s, {:.0} tokens/s",
            text_bytes as f64 / secs / 1e6,
            tokens as f64 / secs
        ));
    }
    bar.finish_and_clear();
    skipped.extend(documents.skipped());
    let input_bytes = documents.bytes_read();
    publish(
        writers,
        tokenizer,
        options,
        output,
        input_bytes,
        skipped,
        None,
    )
}

/// Where a preparation writes: its token storage type, and the partial directory it fills.
struct Started {
    dtype: TokenDtype,
    partial: PathBuf,
}

/// Checks the options against the tokenizer: the token storage type, and that `out` may be
/// written; the partial directory to write into, made empty.
fn start(tokenizer: &TextTokenizer, options: &PrepareOptions) -> Result<Started> {
    let out = &options.out;
    if out.exists() && !options.overwrite {
        return Err(DataError::shards(
            out,
            "already exists (pass --overwrite to replace it)",
        ));
    }
    // Ids, not tokens, must fit: a tokenizer's ids may have gaps (tiktoken's special tokens).
    let bound = tokenizer.id_bound();
    let dtype = options.dtype.unwrap_or(TokenDtype::for_vocab(bound));
    if dtype == TokenDtype::U16 && bound > 1 << 16 {
        return Err(DataError::Invalid(format!(
            "a tokenizer with ids up to {} does not fit u16 shards (at most 65535): use u32",
            bound - 1
        )));
    }
    let partial = partial_dir(out);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(DataError::io(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(DataError::io(&partial))?;
    Ok(Started { dtype, partial })
}

/// Closes the writers, writes the manifest and the tokenizer into `partial` and renames it to
/// `options.out`; refuses (removing `partial`) a preparation that wrote no training tokens.
fn publish(
    mut writers: [ShardWriter; 2],
    tokenizer: &TextTokenizer,
    options: &PrepareOptions,
    Started { dtype, partial }: Started,
    input_bytes: u64,
    skipped: Vec<Skip>,
    conversations: Option<ConversationInfo>,
) -> Result<Manifest> {
    let (out, partial) = (&options.out, partial.as_path());
    for writer in &mut writers {
        writer.close()?;
    }
    let [train, validation] = writers.map(|w| w.info);
    if train.tokens == 0 && options.part.is_none() {
        std::fs::remove_dir_all(partial).map_err(DataError::io(partial))?;
        return Err(DataError::Invalid(format!(
            "the input holds no usable text ({} skipped: {})",
            skipped.len(),
            skipped
                .first()
                .map(|s| format!("{}: {}", s.file, s.reason))
                .unwrap_or_default()
        )));
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        tokenizer: TokenizerInfo {
            hash: tokenizer.hash().into(),
            vocab_size: tokenizer.vocab_size(),
            eot_id: tokenizer.eot_id(),
        },
        dtype,
        validation_every: options.validation_every,
        split_rule: options.split_rule,
        part: options.part.clone(),
        conversations,
        input_bytes,
        train,
        validation,
        skipped,
    };
    tokenizer.save(&partial.join(TOKENIZER))?;
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serializes");
    crate::tokenizer::write_atomically(&partial.join(MANIFEST), json.as_bytes())?;
    if out.exists() {
        if !options.overwrite {
            std::fs::remove_dir_all(partial).map_err(DataError::io(partial))?;
            return Err(DataError::shards(
                out,
                "appeared while preparing; left it as it is",
            ));
        }
        std::fs::remove_dir_all(out).map_err(DataError::io(out))?;
    }
    std::fs::rename(partial, out).map_err(DataError::io(out))?;
    Ok(manifest)
}

/// Writes rendered conversations (see the module documentation) into shards under
/// `options.out`, each to its given split, else to the one its text's hash chooses; `template`
/// is recorded as where the chat template came from. `skipped` lists what rendering left out.
pub fn prepare_conversations(
    conversations: impl Iterator<Item = (Option<Split>, Scored)>,
    tokenizer: &TextTokenizer,
    options: &PrepareOptions,
    template: &str,
    input_bytes: u64,
    skipped: Vec<Skip>,
) -> Result<Manifest> {
    let output = start(tokenizer, options)?;
    let mut writers = [Split::Train, Split::Validation].map(|split| {
        ShardWriter::new(
            &output.partial,
            split,
            output.dtype,
            options.shard_tokens,
            true,
        )
    });
    let mut longest = 0;
    for (index, (given, c)) in conversations.enumerate() {
        assert_eq!(c.ids.len(), c.scored.len(), "one flag per token");
        let split = given.unwrap_or_else(|| {
            options
                .split_rule
                .split(index, &c.text, options.validation_every)
        });
        writers[split as usize].conversation(&c.ids, &c.scored)?;
        longest = longest.max(c.ids.len() as u64);
    }
    let info = ConversationInfo {
        template: template.into(),
        longest,
    };
    publish(
        writers,
        tokenizer,
        options,
        output,
        input_bytes,
        skipped,
        Some(info),
    )
}

/// A work directory beside `out`, unique to this process and call.
fn partial_dir(out: &Path) -> PathBuf {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    out.with_file_name(format!("{name}.partial-{}-{call}", std::process::id()))
}

fn progress_bar(show: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        None,
        if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {binary_bytes} read, {msg}")
            .expect("valid template"),
    );
    bar
}

/// The shards of one directory, memory-mapped.
pub struct Shards {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

impl Shards {
    /// Opens a shard directory, checking its manifest and that every shard has its stated size.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        if !dir.is_dir() {
            return Err(DataError::shards(dir, "no such shard directory"));
        }
        let text = std::fs::read_to_string(&path).map_err(|_| {
            DataError::shards(
                dir,
                "not a shard directory (no manifest.json); make one with `diffzoo data prepare`",
            )
        })?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| DataError::shards(&path, format!("invalid manifest: {e}")))?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(DataError::shards(
                &path,
                format!(
                    "format {} v{} is not {FORMAT} v{VERSION}",
                    manifest.format, manifest.version
                ),
            ));
        }
        for shard in manifest
            .train
            .shards
            .iter()
            .chain(&manifest.validation.shards)
        {
            let inside = Path::new(&shard.file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside || shard.file.is_empty() {
                return Err(DataError::shards(
                    &path,
                    format!(
                        "shard file {:?} is not a path inside the directory",
                        shard.file
                    ),
                ));
            }
            let file = dir.join(&shard.file);
            let len = std::fs::metadata(&file)
                .map_err(DataError::io(&file))?
                .len();
            let expected = shard.tokens.checked_mul(manifest.dtype.bytes() as u64);
            if expected != Some(len) {
                let expected = expected.map_or("more than 2^64".into(), |e| e.to_string());
                return Err(DataError::shards(
                    &file,
                    format!("{len} bytes, the manifest says {expected}"),
                ));
            }
            if manifest.conversations.is_some() {
                let flags = flags_file(&file);
                let len = std::fs::metadata(&flags)
                    .map_err(DataError::io(&flags))?
                    .len();
                if len != shard.tokens {
                    return Err(DataError::shards(
                        &flags,
                        format!("{len} bytes, one per token of {} expected", shard.tokens),
                    ));
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// Checks every shard's SHA-256 against the manifest (sizes are checked by [`Shards::open`]);
    /// returns the number of shards and of bytes read. The first shard that differs is named.
    pub fn verify(&self) -> Result<(usize, u64)> {
        let (mut shards, mut bytes) = (0, 0);
        for shard in self
            .manifest
            .train
            .shards
            .iter()
            .chain(&self.manifest.validation.shards)
        {
            let path = self.dir.join(&shard.file);
            let flags = shard
                .flags_sha256
                .as_ref()
                .map(|sha| (flags_file(&path), sha));
            for (path, want) in std::iter::once((path.clone(), &shard.sha256)).chain(flags) {
                let mut file = File::open(&path).map_err(DataError::io(&path))?;
                let mut hasher = Sha256::new();
                bytes += std::io::copy(&mut file, &mut hasher).map_err(DataError::io(&path))?;
                let sha256 = format!("{:x}", hasher.finalize());
                if sha256 != *want {
                    return Err(DataError::shards(
                        &path,
                        format!(
                            "SHA-256 {sha256}, the manifest says {want}: the shard is corrupted"
                        ),
                    ));
                }
            }
            shards += 1;
        }
        Ok((shards, bytes))
    }

    /// Errors unless the shards were made with the tokenizer of hash `hash`.
    pub fn check_tokenizer(&self, hash: &str) -> Result<()> {
        let made_with = &self.manifest.tokenizer.hash;
        if made_with != hash {
            return Err(DataError::shards(
                &self.dir,
                format!(
                    "made with tokenizer {made_with}, but this run uses tokenizer {hash}; prepare the data again with this run's tokenizer"
                ),
            ));
        }
        Ok(())
    }

    /// The tokenizer the shards were made with.
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        let tokenizer = TextTokenizer::from_file(&self.dir.join(TOKENIZER))?;
        self.check_tokenizer(tokenizer.hash())?;
        Ok(tokenizer)
    }

    /// The tokens of one split as one memory-mapped stream.
    pub fn tokens(&self, split: Split) -> Result<TokenStream> {
        self.stream(split, self.manifest.dtype.bytes(), |path| path)
    }

    /// Conversation shards: the flag bytes of one split's tokens ([`FLAG_SCORED`],
    /// [`FLAG_START`]) as one stream; `None` for plain shards.
    pub fn flags(&self, split: Split) -> Result<Option<TokenStream>> {
        match self.manifest.conversations {
            Some(_) => self.stream(split, 1, |path| flags_file(&path)).map(Some),
            None => Ok(None),
        }
    }

    /// One split's files (`file` of each shard's path) as one stream of `width`-byte values.
    fn stream(
        &self,
        split: Split,
        width: usize,
        file: impl Fn(PathBuf) -> PathBuf,
    ) -> Result<TokenStream> {
        let info = self.manifest.split(split);
        let mut maps = Vec::with_capacity(info.shards.len());
        let mut starts = Vec::with_capacity(info.shards.len());
        let mut total = 0;
        for shard in &info.shards {
            let path = file(self.dir.join(&shard.file));
            let handle = File::open(&path).map_err(DataError::io(&path))?;
            // SAFETY: shards are written once, renamed into place and never modified.
            let map = unsafe { Mmap::map(&handle) }.map_err(DataError::io(&path))?;
            starts.push(total);
            total += shard.tokens;
            maps.push(map);
        }
        Ok(TokenStream {
            maps,
            starts,
            len: total,
            width,
        })
    }
}

/// The `.flags` file beside a conversation shard.
fn flags_file(shard: &Path) -> PathBuf {
    shard.with_extension("flags")
}

/// A split's shards seen as one array of tokens (or of a conversation shard's flag bytes).
pub struct TokenStream {
    maps: Vec<Mmap>,
    starts: Vec<u64>,
    len: u64,
    /// Bytes per value: 1 (flags), 2 or 4 (tokens).
    width: usize,
}

impl TokenStream {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens `start .. start + count`, read across shard boundaries.
    pub fn read(&self, start: u64, count: usize) -> Vec<u32> {
        assert!(
            start + count as u64 <= self.len,
            "read past the end of the split"
        );
        let mut out = Vec::with_capacity(count);
        let mut shard = self.starts.partition_point(|&s| s <= start) - 1;
        let mut pos = start;
        while out.len() < count {
            let offset = (pos - self.starts[shard]) as usize;
            let bytes = &self.maps[shard][offset * self.width..];
            let take = (count - out.len()).min(bytes.len() / self.width);
            let values = bytes.chunks_exact(self.width).take(take);
            match self.width {
                1 => out.extend(values.map(|b| b[0] as u32)),
                2 => out.extend(values.map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)),
                _ => out.extend(values.map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            }
            pos += take as u64;
            shard += 1;
        }
        out
    }
}
