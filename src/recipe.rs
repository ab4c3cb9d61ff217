//! Recipes: one TOML file describes one run. `extends = "other"` inherits another recipe
//! (tables merge key by key), `--set section.key=value` overrides, and validation is strict:
//! unknown keys, wrong types and inconsistent values are errors naming the key and the file.
//! `needs = ["training.init_from", …]` marks keys a recipe leaves to its user (a fine-tuning
//! recipe's starting point and data); a recipe without a model of its own that starts from a
//! run (`training.init_from`) takes that run's model.
//!
//! The files under `recipes/` are compiled into the binary, so `--recipe NAME` works from any
//! directory; `--recipe PATH` reads a file.

use crate::hf::Architecture;
use crate::layout;
use anyhow::{Context, Result, anyhow, bail};
use burn::tensor::FloatDType;
use diffzoo_models::{
    AttentionImpl, AttentionKind, DEFAULT_ATTENTION_BLOCK, ModelConfig, RopeScaling,
};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

include!(concat!(env!("OUT_DIR"), "/recipes.rs"));

/// A fully resolved recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// One line saying what the run is for.
    #[serde(default)]
    pub description: String,
    pub model: ModelSection,
    pub data: DataSection,
    #[serde(default)]
    pub optimizer: OptimizerSection,
    #[serde(default)]
    pub schedule: ScheduleSection,
    pub training: TrainingSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub attention: AttentionKind,
    pub d_model: usize,
    pub layers: usize,
    /// The baseline's heads (DIFF V1 uses half, V2 twice as many query heads).
    pub heads: usize,
    /// The baseline's key/value heads; default `heads`.
    pub kv_heads: Option<usize>,
    pub vocab_size: usize,
    /// Default: the data section's `seq_len`.
    pub max_seq_len: Option<usize>,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    /// Default `floor(8·d_model/3)`.
    pub ffn_dim: Option<usize>,
    #[serde(default)]
    pub tie_embeddings: bool,
    /// RMSNorm epsilon (blocks, final norm and DIFF's subln).
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Standard deviation of the embedding initialisation.
    #[serde(default = "default_embedding_std")]
    pub embedding_std: f64,
    /// Unset: PyTorch's `nn.Linear` default for every linear layer; set: N(0, σ²).
    pub linear_std: Option<f64>,
    /// How attention is computed in training: `"explicit"` (S×S maps kept for the backward
    /// pass), `"flash"` (blocks with their own backward: memory grows with S) or `"auto"`.
    #[serde(default)]
    pub attention_impl: AttentionChoice,
    /// Positions per query and key block of the flash path.
    #[serde(default = "default_attention_block")]
    pub attention_block: usize,
    /// Per-head width; default `d_model / heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Biases on the query, key and value projections (Qwen2's layout).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qkv_bias: bool,
    /// RoPE's frequency scaling: `{ type = "linear", factor = F }` or `{ type = "llama3",
    /// factor, low_freq_factor, high_freq_factor, original_max_seq_len }`; default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// The transformers class `export hf` writes (`import hf` records the source's); default
    /// the variant's own: `LlamaForCausalLM` (`Qwen2ForCausalLM` with `qkv_bias`),
    /// `DiffLlamaForCausalLM`, `DiffzooV2ForCausalLM`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_architecture: Option<Architecture>,
}

/// `model.attention_impl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionChoice {
    /// Flash from [`FLASH_FROM_SEQ_LEN`] positions on, explicit below (see there).
    #[default]
    Auto,
    Explicit,
    Flash,
}

/// Where `attention_impl = "auto"` switches to the flash path. Measured with
/// `bench/long_context.sh` (d 256 × 4 layers, Flex, 2-core AMD EPYC with AVX-512; the book's
/// Performance chapter, "Long sequences"): a training step through flash was as fast as through
/// the explicit maps or faster at every length tried (1.14–1.26× at 8 × 256, 0.99× at worst),
/// with less memory; below 512 the recipes keep the explicit path they were validated on.
pub const FLASH_FROM_SEQ_LEN: usize = 512;

fn default_attention_block() -> usize {
    DEFAULT_ATTENTION_BLOCK
}

fn default_rope_theta() -> f32 {
    10_000.0
}

impl ModelSection {
    /// The model this section describes; `seq_len` stands in for an unset `max_seq_len`.
    pub fn config(&self, seq_len: usize) -> ModelConfig {
        let m = self;
        ModelConfig::new(
            m.attention,
            m.d_model,
            m.layers,
            m.heads,
            m.vocab_size,
            m.max_seq_len.unwrap_or(seq_len),
        )
        .with_kv_heads(m.kv_heads)
        .with_rope_theta(m.rope_theta)
        .with_ffn_dim(m.ffn_dim)
        .with_tie_embeddings(m.tie_embeddings)
        .with_norm_eps(m.norm_eps)
        .with_embedding_std(m.embedding_std)
        .with_linear_std(m.linear_std)
        .with_attention_impl(m.attention_impl(seq_len))
        .with_head_dim(m.head_dim)
        .with_qkv_bias(m.qkv_bias)
        .with_rope_scaling(m.rope_scaling)
    }

    /// The transformers class this model exports as.
    pub fn architecture(&self) -> Architecture {
        self.hf_architecture
            .unwrap_or_else(|| Architecture::of(self.attention, self.qkv_bias))
    }

    /// The attention implementation for training sequences of `seq_len` positions.
    pub fn attention_impl(&self, seq_len: usize) -> AttentionImpl {
        let flash = AttentionImpl::Flash {
            block: self.attention_block,
        };
        match self.attention_impl {
            AttentionChoice::Explicit => AttentionImpl::Explicit,
            AttentionChoice::Flash => flash,
            AttentionChoice::Auto if seq_len >= FLASH_FROM_SEQ_LEN => flash,
            AttentionChoice::Auto => AttentionImpl::Explicit,
        }
    }
}

fn default_norm_eps() -> f64 {
    1e-5
}

fn default_embedding_std() -> f64 {
    0.02
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// `"embedded"` or a shard directory made by `diffzoo data prepare`.
    pub corpus: String,
    /// With the embedded corpus: `"bpe"` (a byte-level BPE of `model.vocab_size`, trained once
    /// and cached) or a `tokenizer.json`. With shards: unset (the shards' tokenizer).
    pub tokenizer: Option<String>,
    pub seq_len: usize,
    /// Mix synthetic needle-retrieval documents into the training windows.
    pub needles: Option<NeedleSection>,
    /// Mix multi-query associative recall documents into the training windows.
    pub recall: Option<RecallSection>,
}

/// The associative-recall training mixture (training keys only; validation stays plain text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecallSection {
    /// Share of training windows replaced by recall documents.
    pub fraction: f64,
    /// Each document holds 1 to this many key–value pairs, all of them asked about.
    pub max_pairs: usize,
    /// Each document puts 0 to this many tokens of text between consecutive pairs.
    pub max_distractors: usize,
    /// What the loss scores in a recall document: `"all"` its tokens, or `"answers"` only its
    /// queried values (as Zoology trains MQAR; the other windows are scored whole).
    #[serde(default)]
    pub loss: RecallLoss,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecallLoss {
    #[default]
    All,
    Answers,
}

/// The needle-retrieval training mixture (training cities only; validation stays plain text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NeedleSection {
    /// Share of training windows replaced by needle documents.
    pub fraction: f64,
    /// Each needle document holds 1 to this many needles, all of them asked about.
    #[serde(default = "default_max_needles")]
    pub max_needles: usize,
    /// Digits of the magic numbers.
    #[serde(default = "default_digits")]
    pub digits: usize,
}

fn default_max_needles() -> usize {
    6
}

pub fn default_digits() -> usize {
    7
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// Peak learning rate.
    pub lr: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
    /// Parameters whose path matches this regex get no weight decay (norms, embeddings, λ).
    pub no_decay: String,
    /// Clip the global gradient norm (all parameters together) to this; 0 disables.
    pub grad_clip: f64,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            lr: 3e-4,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
            no_decay: r"norm|subln|embed|lambda_[qk][12]".into(),
            grad_clip: 1.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    Linear,
    Cosine,
    Constant,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleSection {
    pub warmup_steps: usize,
    pub decay: Decay,
    /// The learning rate at the last step.
    pub min_lr: f64,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        Self {
            warmup_steps: 0,
            decay: Decay::Cosine,
            min_lr: 0.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSection {
    /// Optimizer steps; give this or `tokens`.
    pub steps: Option<usize>,
    /// Training tokens; converted to steps of `batch_tokens`.
    pub tokens: Option<u64>,
    /// Tokens per optimizer step (global batch).
    pub batch_tokens: usize,
    /// Sequences per forward/backward pass; gradients of a step's micro-batches are averaged.
    pub micro_batch: usize,
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Train once per seed instead, each run in `RUN/seed-N` with `seed = N` (its own data order
    /// and initialisation, unless `init_from` gives every seed the same weights); `diffzoo
    /// sweep` does the same for every recipe of a sweep.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seeds: Vec<u64>,
    /// What a step computes in and what it keeps ([`Precision`]); `training.dtype`, its old
    /// name, is read into it ([`legacy_dtype`]).
    #[serde(default)]
    pub precision: Precision,
    /// Default device, overridden by `--device`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Print metrics every this many steps when no dashboard is shown.
    #[serde(default = "default_log_every")]
    pub log_every: usize,
    /// Start from these weights (a run directory, or a model or checkpoint file) instead of a
    /// fresh initialisation; the optimizer and schedule start anew.
    pub init_from: Option<String>,
    /// `"none"` or `"block"`: each block keeps only its input and runs again in the backward
    /// pass (one more forward pass per step; activations of one block at a time).
    #[serde(default)]
    pub recompute: Recompute,
    /// A warm-up of DIFF's negative map over this many steps: λ (V1) or the subtracted output
    /// (V2) is scaled by min(1, step/N), so that a model converted from a pretrained Transformer
    /// (`diffzoo convert`) starts from the source's maps; unset or 0: none (0 also declines the
    /// warm-up a model-less recipe would take from its `init_from` run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lambda_warmup: Option<usize>,
}

impl TrainingSection {
    /// The steps of the warm-up of DIFF's negative map, when there is one.
    pub fn warmup_steps(&self) -> Option<usize> {
        self.lambda_warmup.filter(|&n| n > 0)
    }

    /// The scale of λ after `step` optimizer steps: min(1, step/N) during a warm-up over N
    /// steps, else 1.
    pub fn lambda_scale(&self, step: usize) -> f64 {
        self.warmup_steps()
            .map_or(1.0, |n| (step as f64 / n as f64).min(1.0))
    }
}

/// `training.precision`: the dtypes a step computes in and keeps between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Weights, activations, gradients and AdamW moments in f32.
    #[default]
    F32,
    /// The forward and backward passes in bf16, from a bf16 copy of f32 master weights
    /// ([`diffzoo_models::precision`]); gradients accumulated, clipped and all-reduced in f32,
    /// AdamW's update and both moments f32. What large runs use.
    Bf16Mixed,
    /// Everything in bf16, weights and AdamW moments included (the device's float dtype): an
    /// update below half a bf16 step (2⁻⁹ to 2⁻⁸ of its weight) rounds away. Kept to compare.
    Bf16Pure,
    /// Everything in f16, as `bf16-pure` (no loss scaling).
    F16Pure,
}

impl Precision {
    pub const ALL: [Precision; 4] = [
        Precision::F32,
        Precision::Bf16Mixed,
        Precision::Bf16Pure,
        Precision::F16Pure,
    ];

    /// Its name in a recipe.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16Mixed => "bf16-mixed",
            Self::Bf16Pure => "bf16-pure",
            Self::F16Pure => "f16-pure",
        }
    }

    /// The dtype weights, gradients and AdamW moments are kept in: the device's float dtype.
    pub fn storage(self) -> FloatDType {
        match self {
            Self::F32 | Self::Bf16Mixed => FloatDType::F32,
            Self::Bf16Pure => FloatDType::BF16,
            Self::F16Pure => FloatDType::F16,
        }
    }

    /// The dtype a step computes in from a copy of the weights, where it is not their own.
    pub fn compute(self) -> Option<FloatDType> {
        (self == Self::Bf16Mixed).then_some(FloatDType::BF16)
    }

    /// Bytes per element of activations (and of the compute copy of the weights).
    pub fn activation_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            _ => 2,
        }
    }
}

/// `training.recompute`: what the backward pass recomputes instead of keeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recompute {
    /// Every activation of the forward pass is kept for the backward pass.
    #[default]
    None,
    /// Per-block recomputation ([`diffzoo_models::recompute`]).
    Block,
}

/// The first seed of `seeds` that is given twice.
pub fn repeated_seed(seeds: &[u64]) -> Option<u64> {
    let mut seen = std::collections::BTreeSet::new();
    seeds.iter().find(|s| !seen.insert(**s)).copied()
}

fn default_seed() -> u64 {
    42
}

fn default_device() -> String {
    "cpu".into()
}

fn default_log_every() -> usize {
    10
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Steps between checkpoints; validation runs at the same points. One Burn learner "epoch".
    pub interval: usize,
    /// Checkpoints kept (the newest ones).
    pub keep: usize,
    /// Validation micro-batches per evaluation.
    pub eval_batches: usize,
    /// Also write the final weights as `model.safetensors` (Burn's names), a second copy for
    /// tools that read safetensors; `export hf` writes transformers' own layout either way.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub safetensors: bool,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self {
            interval: 1000,
            keep: 2,
            eval_batches: 16,
            safetensors: false,
        }
    }
}

/// The keys whose values name files or directories, with the values that name none. In a recipe
/// file a relative path resolves against the file's folder (as `extends` does); in a built-in
/// recipe or a `--set`, against the current directory.
const PATH_KEYS: [(&str, &[&str]); 3] = [
    ("data.corpus", &[diffzoo_datasets::corpus::EMBEDDED]),
    ("data.tokenizer", &["bpe"]),
    ("training.init_from", &[]),
];

/// Whether `value` of the path key `key` names a file or directory (not a special value).
fn names_a_file(key: &str, value: &str) -> bool {
    PATH_KEYS
        .iter()
        .any(|(k, special)| *k == key && !special.contains(&value))
}

/// Rewrites the relative paths of the recipe file `file`'s `table` onto the file's folder, `..`
/// folded away (`exp/../data` is `data`). Not in a run directory's own recipe.toml (a run keeps
/// its paths absolute; one written before kept them relative to where it was started), nor in
/// the shipped recipes named by their path (`recipes/paper/…`: as the built-in recipes they are,
/// their paths are the current directory's).
fn rebase_paths(table: &mut toml::Table, file: &Path) {
    let dir = file.parent().unwrap_or(Path::new(""));
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
    if dir.join(layout::CHECKPOINTS).is_dir()
        || file
            .canonicalize()
            .is_ok_and(|f| shipped.canonicalize().is_ok_and(|s| f.starts_with(s)))
    {
        return;
    }
    for (dotted, _) in PATH_KEYS {
        let (section, key) = dotted.split_once('.').expect("a dotted key");
        if let Some(toml::Value::String(value)) = table
            .get_mut(section)
            .and_then(|s| s.as_table_mut())
            .and_then(|s| s.get_mut(key))
            && names_a_file(dotted, value)
            && Path::new(value.as_str()).is_relative()
        {
            *value = folded(&dir.join(value.as_str())).display().to_string();
        }
    }
}

/// `path` with each `..` folded into the folder before it, where there is one.
fn folded(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            part => out.push(part),
        }
    }
    out
}

impl Recipe {
    /// The values of the path keys that name a file or directory, mutably.
    fn paths_mut(&mut self) -> Vec<(&'static str, &mut String)> {
        let mut out = vec![("data.corpus", &mut self.data.corpus)];
        out.extend(self.data.tokenizer.as_mut().map(|t| ("data.tokenizer", t)));
        out.extend(
            self.training
                .init_from
                .as_mut()
                .map(|i| ("training.init_from", i)),
        );
        out.retain(|(key, value)| names_a_file(key, value));
        out
    }

    /// The recipe with every path absolute, as a run directory stores it: the run's
    /// `recipe.toml` then names the same files wherever it is read from.
    pub fn with_absolute_paths(&self) -> Recipe {
        let mut recipe = self.clone();
        for (_, value) in recipe.paths_mut() {
            if let Ok(path) = std::path::absolute(value.as_str()) {
                *value = path.display().to_string();
            }
        }
        recipe
    }

    /// A line for each path the recipe names that does not exist.
    pub fn missing_paths(&self) -> Vec<String> {
        let mut recipe = self.clone();
        recipe
            .paths_mut()
            .into_iter()
            .filter(|(_, value)| !Path::new(value.as_str()).exists())
            .map(|(key, value)| {
                format!(
                    "`{key}` = {value:?} does not exist (a recipe file's relative paths resolve \
                     against its folder, --set's against the current directory)"
                )
            })
            .collect()
    }

    /// Sequences per optimizer step.
    pub fn batch_sequences(&self) -> usize {
        self.training.batch_tokens / self.data.seq_len
    }

    /// Micro-batches per optimizer step.
    pub fn accumulation(&self) -> usize {
        self.batch_sequences() / self.training.micro_batch
    }

    /// Optimizer steps of the run.
    pub fn total_steps(&self) -> usize {
        match (self.training.steps, self.training.tokens) {
            (Some(steps), _) => steps,
            (None, Some(tokens)) => tokens.div_ceil(self.training.batch_tokens as u64) as usize,
            (None, None) => 0,
        }
    }

    /// Upper bounds far beyond any real run, under which every count the planner and `recipe
    /// show` derive fits its integer type (beyond them a recipe is a typo).
    fn within_limits(&self) -> std::result::Result<(), String> {
        let (m, t) = (&self.model, &self.training);
        let limits = [
            ("model.d_model", m.d_model as u64, 1 << 20),
            ("model.layers", m.layers as u64, 1 << 12),
            ("model.heads", m.heads as u64, 1 << 16),
            ("model.kv_heads", m.kv_heads.unwrap_or(0) as u64, 1 << 16),
            ("model.vocab_size", m.vocab_size as u64, 1 << 32),
            (
                "model.max_seq_len",
                m.max_seq_len.unwrap_or(0) as u64,
                1 << 24,
            ),
            ("model.ffn_dim", m.ffn_dim.unwrap_or(0) as u64, 1 << 22),
            ("model.attention_block", m.attention_block as u64, 1 << 24),
            ("data.seq_len", self.data.seq_len as u64, 1 << 24),
            (
                "data.recall.max_distractors",
                self.data.recall.as_ref().map_or(0, |r| r.max_distractors) as u64,
                1 << 24,
            ),
            ("training.steps", t.steps.unwrap_or(0) as u64, 1 << 40),
            (
                "training.lambda_warmup",
                t.lambda_warmup.unwrap_or(0) as u64,
                1 << 40,
            ),
            ("training.tokens", t.tokens.unwrap_or(0), 1 << 56),
            ("training.batch_tokens", t.batch_tokens as u64, 1 << 40),
            ("training.micro_batch", t.micro_batch as u64, 1 << 24),
            ("training.log_every", t.log_every as u64, 1 << 40),
            (
                "schedule.warmup_steps",
                self.schedule.warmup_steps as u64,
                1 << 40,
            ),
            (
                "checkpoint.interval",
                self.checkpoint.interval as u64,
                1 << 40,
            ),
            ("checkpoint.keep", self.checkpoint.keep as u64, 1 << 20),
            (
                "checkpoint.eval_batches",
                self.checkpoint.eval_batches as u64,
                1 << 32,
            ),
        ];
        if let Some((key, value, max)) = limits.iter().find(|(_, value, max)| value > max) {
            return Err(format!("`{key}` = {value} is above the limit {max}"));
        }
        let tokens = t.steps.map_or(0, |s| s as u128) * t.batch_tokens as u128;
        if tokens > 1 << 56 {
            return Err(format!(
                "`training.steps` × `training.batch_tokens` = {tokens} tokens is above the limit {}",
                1u64 << 56
            ));
        }
        Ok(())
    }

    pub fn model_config(&self) -> ModelConfig {
        self.model.config(self.data.seq_len)
    }

    /// Consistency checks; each error names the keys involved.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.within_limits()?;
        if self.model.attention_block == 0 {
            return Err("`model.attention_block` must be positive".into());
        }
        let seq = self.data.seq_len;
        if seq == 0 {
            return Err("`data.seq_len` must be positive".into());
        }
        self.model_config()
            .validate()
            .map_err(|e| in_section("model", &e))?;
        if let Some(class) = self.model.hf_architecture {
            class
                .holds(self.model.attention, self.model.qkv_bias)
                .map_err(|e| format!("`model.hf_architecture`: {e}"))?;
        }
        let t = &self.training;
        if let Some(max) = self.model.max_seq_len
            && max < seq
        {
            return Err(format!(
                "`model.max_seq_len` = {max} is below `data.seq_len` = {seq}"
            ));
        }
        match (t.steps, t.tokens) {
            (Some(_), Some(_)) => {
                return Err("give `training.steps` or `training.tokens`, not both".into());
            }
            (None, None) => return Err("give `training.steps` or `training.tokens`".into()),
            _ => {}
        }
        if self.total_steps() == 0 {
            return Err("the run has no steps (`training.steps` or `training.tokens` is 0)".into());
        }
        if t.micro_batch == 0 {
            return Err("`training.micro_batch` must be positive".into());
        }
        if t.batch_tokens == 0 || !t.batch_tokens.is_multiple_of(seq) {
            return Err(format!(
                "`training.batch_tokens` = {} is not a positive multiple of `data.seq_len` = {seq}",
                t.batch_tokens
            ));
        }
        if !self.batch_sequences().is_multiple_of(t.micro_batch) {
            return Err(format!(
                "`training.batch_tokens` / `data.seq_len` = {} sequences is not divisible by `training.micro_batch` = {}",
                self.batch_sequences(),
                t.micro_batch
            ));
        }
        if t.log_every == 0 {
            return Err("`training.log_every` must be positive".into());
        }
        if t.seeds.len() > 1 << 10 {
            return Err(format!(
                "`training.seeds` holds {} seeds, above the limit {}",
                t.seeds.len(),
                1 << 10
            ));
        }
        if let Some(seed) = repeated_seed(&t.seeds) {
            return Err(format!("`training.seeds`: {seed} is given twice"));
        }
        if t.warmup_steps().is_some() && self.model.attention == AttentionKind::Transformer {
            return Err("`training.lambda_warmup` warms up DIFF's negative map: `model.attention = \"transformer\"` has none".into());
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return Err(format!("`optimizer.lr` = {} must be positive", o.lr));
        }
        if o.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return Err(format!(
                "`optimizer.betas` = {:?} must lie in [0, 1)",
                o.betas
            ));
        }
        if !(o.eps > 0.0 && o.eps.is_finite()) {
            return Err(format!("`optimizer.eps` = {} must be positive", o.eps));
        }
        for (key, value) in [
            ("optimizer.weight_decay", o.weight_decay),
            ("optimizer.grad_clip", o.grad_clip),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(format!("`{key}` = {value} must be non-negative"));
            }
        }
        if o.lr * o.weight_decay >= 1.0 {
            return Err(format!(
                "`optimizer.lr` × `optimizer.weight_decay` = {} × {} = {} is at least 1: AdamW's decoupled decay multiplies every weight by 1 − lr·wd each step, which then zeroes or flips its sign; lower one of them (typical: lr 3e-4, weight_decay 0.1)",
                o.lr,
                o.weight_decay,
                o.lr * o.weight_decay
            ));
        }
        regex::Regex::new(&o.no_decay)
            .map_err(|e| format!("`optimizer.no_decay` is not a valid regex: {e}"))?;
        let s = &self.schedule;
        if s.warmup_steps > self.total_steps() {
            return Err(format!(
                "`schedule.warmup_steps` = {} exceeds the run's {} steps",
                s.warmup_steps,
                self.total_steps()
            ));
        }
        if !(s.min_lr >= 0.0 && s.min_lr <= o.lr) {
            return Err(format!(
                "`schedule.min_lr` = {} must lie in [0, optimizer.lr = {}]",
                s.min_lr, o.lr
            ));
        }
        let c = &self.checkpoint;
        if c.interval == 0 || c.keep == 0 || c.eval_batches == 0 {
            return Err("`checkpoint.interval`, `checkpoint.keep` and `checkpoint.eval_batches` must be positive".into());
        }
        if let Some(n) = &self.data.needles {
            if !(0.0..=1.0).contains(&n.fraction) {
                return Err(format!(
                    "`data.needles.fraction` = {} must lie in [0, 1]",
                    n.fraction
                ));
            }
            let cities = diffzoo_datasets::needle::TRAIN_CITIES.len();
            if !(1..=cities).contains(&n.max_needles) {
                return Err(format!(
                    "`data.needles.max_needles` = {} must lie in [1, {cities}]",
                    n.max_needles
                ));
            }
            if !(1..=18).contains(&n.digits) {
                return Err(format!(
                    "`data.needles.digits` = {} must lie in [1, 18]",
                    n.digits
                ));
            }
        }
        if let Some(r) = &self.data.recall {
            self.validate_recall(r)?;
        }
        let tok = self.data.tokenizer.as_deref();
        let corpus = &self.data.corpus;
        if corpus == diffzoo_datasets::corpus::EMBEDDED && tok.is_none() {
            return Err("`data.tokenizer` is required with the embedded corpus (\"bpe\" or a tokenizer.json)".into());
        }
        // A missing directory is reported as such when the data is opened.
        if let Some(tok) = tok
            && corpus != diffzoo_datasets::corpus::EMBEDDED
            && Path::new(corpus).exists()
        {
            return Err(format!(
                "`data.tokenizer` = {tok:?} must be unset for a shard directory (`data.corpus` = {corpus:?}): the shards' tokenizer is used"
            ));
        }
        Ok(())
    }

    /// The recall mixture fits the vocabulary and the windows, and is the run's only mixture.
    fn validate_recall(&self, r: &RecallSection) -> std::result::Result<(), String> {
        use diffzoo_datasets::recall::{MAX_PAIRS, MIN_VOCAB, RESERVED, longest};
        if self.data.needles.is_some() {
            return Err(
                "`data.needles` and `data.recall` cannot both be mixed into one run: keep one"
                    .into(),
            );
        }
        if !(0.0..=1.0).contains(&r.fraction) {
            return Err(format!(
                "`data.recall.fraction` = {} must lie in [0, 1]",
                r.fraction
            ));
        }
        if !(1..=MAX_PAIRS).contains(&r.max_pairs) {
            return Err(format!(
                "`data.recall.max_pairs` = {} must lie in [1, {MAX_PAIRS}]",
                r.max_pairs
            ));
        }
        if self.model.vocab_size < MIN_VOCAB {
            return Err(format!(
                "`data.recall` reserves the top {RESERVED} token ids: `model.vocab_size` = {} must be at least {MIN_VOCAB}",
                self.model.vocab_size
            ));
        }
        let longest = longest(r.max_pairs, r.max_distractors).unwrap_or(usize::MAX);
        if longest > self.data.seq_len {
            return Err(format!(
                "`data.recall.max_pairs` = {} with `data.recall.max_distractors` = {} makes documents of {longest} tokens, longer than `data.seq_len` = {}",
                r.max_pairs, r.max_distractors, self.data.seq_len
            ));
        }
        Ok(())
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a recipe serializes")
    }

    /// The dotted keys whose values differ from `other`'s, each with this recipe's value and
    /// `other`'s as TOML (`None`: unset).
    pub fn differences(&self, other: &Recipe) -> Vec<(String, Option<String>, Option<String>)> {
        let (a, b) = (self.flat(), other.flat());
        let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        keys.into_iter()
            .filter(|k| a.get(*k) != b.get(*k))
            .map(|k| (k.clone(), a.get(k).cloned(), b.get(k).cloned()))
            .collect()
    }

    /// Every value of the recipe under its dotted key.
    fn flat(&self) -> std::collections::BTreeMap<String, String> {
        fn walk(
            prefix: &str,
            table: &toml::Table,
            out: &mut std::collections::BTreeMap<String, String>,
        ) {
            for (key, value) in table {
                let key = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                match value {
                    toml::Value::Table(inner) => walk(&key, inner, out),
                    value => {
                        out.insert(key, value.to_string());
                    }
                }
            }
        }
        let table: toml::Table = self.to_toml().parse().expect("a serialized recipe parses");
        let mut out = std::collections::BTreeMap::new();
        walk("", &table, &mut out);
        out
    }
}

/// Where a recipe came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Builtin(&'static str),
    File(PathBuf),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Builtin(name) => write!(f, "recipes/{name}.toml"),
            Self::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Names of the built-in recipes, smallest family first (tiny, micro, mini, paper), each folder
/// by the size its name states (`830m` before `1.4b`, `d064` before `d128`), then by name.
pub fn builtin_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = BUILTIN.iter().map(|(name, _)| *name).collect();
    names.sort_by(|a, b| {
        natural_key(a)
            .partial_cmp(&natural_key(b))
            .expect("finite sizes")
    });
    names
}

/// The order of [`builtin_names`]: family, folder (by its stated size), size, name.
fn natural_key(name: &str) -> (usize, f64, &str, f64, &str) {
    const FAMILIES: [&str; 4] = ["tiny", "micro", "mini", "paper"];
    let family = name.split(['/', '-']).next().unwrap_or(name);
    let rank = FAMILIES
        .iter()
        .position(|f| *f == family)
        .unwrap_or(FAMILIES.len());
    let (folder, stem) = name.rsplit_once('/').unwrap_or(("", name));
    let folder_size = stated_size(folder.rsplit('/').next().unwrap_or(folder));
    (rank, folder_size, folder, stated_size(stem), name)
}

/// The size a name starts with: `830m` → 830e6, `1.4b` → 1.4e9, `d064` → 64; 0 when none.
fn stated_size(name: &str) -> f64 {
    let first = name.split('-').next().unwrap_or(name);
    let digits = first.trim_start_matches(['d', 't']);
    let end = digits
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(digits.len());
    let scale = match &digits[end..] {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "b" => 1e9,
        "t" => 1e12,
        _ => return 0.0,
    };
    digits[..end].parse::<f64>().map_or(0.0, |n| n * scale)
}

/// The built-in names a mistyped `key` most likely meant: those it names the last part of
/// (`830m-diff`), else the closest within a third of its length in edits (`tny` → `tiny`).
fn suggestions(key: &str) -> Vec<&'static str> {
    let names = builtin_names();
    let tail: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.rsplit('/').next() == Some(key))
        .collect();
    if !tail.is_empty() {
        return tail;
    }
    let limit = (key.chars().count() / 3).max(1);
    let distance = |n: &str| {
        let last = n.rsplit('/').next().unwrap_or(n);
        strsim::levenshtein(key, n).min(strsim::levenshtein(key, last))
    };
    let Some(best) = names.iter().map(|n| distance(n)).min() else {
        return Vec::new();
    };
    if best > limit {
        return Vec::new();
    }
    names.into_iter().filter(|n| distance(n) == best).collect()
}

/// Finds a recipe: an existing file path, else a built-in name.
fn locate(name: &str, relative_to: Option<&Path>) -> Result<(Source, String)> {
    let candidates = [
        relative_to.map(|dir| dir.join(name)),
        relative_to.map(|dir| dir.join(format!("{name}.toml"))),
        Some(PathBuf::from(name)),
    ];
    for path in candidates.into_iter().flatten() {
        if path.is_file() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            return Ok((Source::File(path), text));
        }
    }
    let key = name
        .trim_end_matches(".toml")
        .trim_start_matches("recipes/");
    BUILTIN
        .iter()
        .find(|(n, _)| *n == key)
        .map(|(n, text)| (Source::Builtin(n), text.to_string()))
        .ok_or_else(|| {
            let near = suggestions(key);
            let near = if near.is_empty() {
                String::new()
            } else {
                let quoted: Vec<String> = near.iter().map(|n| format!("`{n}`")).collect();
                format!("; did you mean {}?", quoted.join(" or "))
            };
            anyhow!(
                "no recipe `{name}`: not a file, nor a built-in recipe{near} (`diffzoo recipe list` shows all {})",
                BUILTIN.len()
            )
        })
}

/// Loads `name` and its `extends` chain: the tables of each file, the furthest ancestor first.
fn load_layers(
    name: &str,
    relative_to: Option<&Path>,
    depth: usize,
) -> Result<(Source, Vec<toml::Table>)> {
    if depth > 16 {
        bail!("recipe `{name}`: `extends` chain is deeper than 16 (a cycle?)");
    }
    let (source, text) = locate(name, relative_to)?;
    let mut table: toml::Table = text.parse().map_err(|e| anyhow!("{source}: {e}"))?;
    if let Source::File(path) = &source {
        rebase_paths(&mut table, path);
    }
    let mut layers = Vec::new();
    if let Some(parent) = table.remove("extends") {
        let parent = parent
            .as_str()
            .ok_or_else(|| anyhow!("{source}: `extends` must be a string naming a recipe"))?;
        let dir = match &source {
            Source::File(path) => path.parent().map(Path::to_path_buf),
            Source::Builtin(_) => None,
        };
        layers = load_layers(parent, dir.as_deref(), depth + 1)
            .with_context(|| format!("{source}: extends"))?
            .1;
    }
    layers.push(table);
    Ok((source, layers))
}

/// The last of `layers` that sets the dotted `key`.
fn last_setting(layers: &[toml::Table], key: &str) -> Option<usize> {
    layers.iter().rposition(|layer| {
        let mut keys = key.split('.');
        let first = keys.next().and_then(|k| layer.get(k));
        keys.try_fold(first, |value, k| value.map(|v| v.get(k)))
            .flatten()
            .is_some()
    })
}

/// What a vocabulary that follows a tokenizer is padded to: the paper's 100,288 is cl100k_base's
/// 100,277 ids so padded.
const VOCAB_MULTIPLE: usize = 64;

/// Settings written for other data follow a shard directory named by a later layer (a child
/// recipe or `--set`): an inherited `data.tokenizer` is dropped (the shards carry theirs) and an
/// inherited `model.vocab_size` becomes the number of ids of the shards' tokenizer (one more
/// than its largest), padded to a multiple of [`VOCAB_MULTIPLE`]. Returns what it changed, to
/// be said. (Not the vocabulary of a recipe that starts from trained weights,
/// `training.init_from`, whose embedding fixes it.)
fn follow_shards(table: &mut toml::Table, layers: &[toml::Table]) -> Vec<String> {
    let Some(corpus_layer) = last_setting(layers, "data.corpus") else {
        return Vec::new();
    };
    let Some(corpus) = table
        .get("data")
        .and_then(|d| d.get("corpus"))
        .and_then(toml::Value::as_str)
        .map(str::to_string)
    else {
        return Vec::new();
    };
    if corpus == diffzoo_datasets::corpus::EMBEDDED || !Path::new(&corpus).is_dir() {
        return Vec::new();
    }
    let inherited = |key| last_setting(layers, key).is_none_or(|layer| layer < corpus_layer);
    let mut notes = Vec::new();
    if last_setting(layers, "data.tokenizer").is_some() && inherited("data.tokenizer") {
        let data = table
            .get_mut("data")
            .and_then(toml::Value::as_table_mut)
            .expect("data.corpus is set");
        if let Some(tokenizer) = data.remove("tokenizer") {
            notes.push(format!(
                "`data.tokenizer` = {tokenizer} (inherited) dropped: the shard directory {corpus:?} brings its own tokenizer"
            ));
        }
    }
    // A model initialised from trained weights keeps their vocabulary: the tokenizer must fit
    // it, which training checks.
    if !inherited("model.vocab_size") || last_setting(layers, "training.init_from").is_some() {
        return notes;
    }
    let Ok(ids) = diffzoo_datasets::shards::Shards::open(Path::new(&corpus))
        .and_then(|shards| shards.tokenizer())
        .map(|tokenizer| tokenizer.id_bound())
    else {
        // Opening the data reports what is wrong with it.
        return notes;
    };
    let size = ids.next_multiple_of(VOCAB_MULTIPLE);
    let model = table
        .entry("model")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let Some(model) = model.as_table_mut() {
        let was = model.insert("vocab_size".into(), (size as i64).into());
        if was.as_ref().and_then(toml::Value::as_integer) != Some(size as i64) {
            notes.push(format!(
                "`model.vocab_size` = {size}: the {ids} ids of the tokenizer of {corpus:?}, padded to a multiple of {VOCAB_MULTIPLE}{}",
                was.map(|w| format!(" (not the inherited {w})")).unwrap_or_default()
            ));
        }
    }
    notes
}

/// Merges `over` into `base`, table by table.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Applies one `section.key=value` override; the value is parsed as TOML, else taken as a string.
/// `message` with the keys it names (`` `key` ``) named in full (`` `section.key` ``).
fn in_section(section: &str, message: &str) -> String {
    let key = regex::Regex::new(r"`([a-z_]+)\b").expect("a valid regex");
    key.replace_all(message, format!("`{section}.$1").as_str())
        .into_owned()
}

fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let (path, raw) = assignment
        .split_once('=')
        .ok_or_else(|| anyhow!("--set {assignment}: expected section.key=value"))?;
    let value: toml::Value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let keys: Vec<&str> = path.trim().split('.').collect();
    let (last, sections) = keys.split_last().expect("split yields one item");
    let mut current = table;
    for key in sections {
        current = current
            .entry(key.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| anyhow!("--set {assignment}: `{key}` is not a table"))?;
    }
    current.insert(last.to_string(), value);
    Ok(())
}

/// A recipe with its source, resolved (`extends` and overrides applied) and validated.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Recipe name (file stem or built-in name).
    pub name: String,
    pub source: Source,
    pub recipe: Recipe,
    /// What resolving changed and the user should be told (see `follow_shards`).
    pub notes: Vec<String>,
}

/// A recipe that leaves keys for its user to set (its `needs`), resolved without them.
#[derive(Debug)]
pub struct Needs {
    pub recipe: String,
    pub keys: Vec<String>,
}

impl std::fmt::Display for Needs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|k| format!("`{k}`")).collect();
        let sets: Vec<String> = self.keys.iter().map(|k| format!("--set {k}=...")).collect();
        write!(
            f,
            "{} needs {}: give {}, or set them in a recipe that extends it",
            self.recipe,
            keys.join(" and "),
            sets.join(" ")
        )
    }
}

impl std::error::Error for Needs {}

pub fn resolve(name: &str, overrides: &[String]) -> Result<Resolved> {
    let (source, mut layers) = load_layers(name, None, 0)?;
    let needs: Vec<String> = layers
        .iter_mut()
        .filter_map(|layer| layer.remove("needs"))
        .map(|needs| match needs {
            toml::Value::Array(keys) => keys
                .into_iter()
                .map(|k| {
                    k.as_str().map(str::to_string).ok_or_else(|| {
                        anyhow!("{source}: `needs` must list dotted keys, such as \"data.corpus\"")
                    })
                })
                .collect::<Result<Vec<_>>>(),
            _ => bail!("{source}: `needs` must list dotted keys, such as [\"data.corpus\"]"),
        })
        .collect::<Result<Vec<_>>>()?
        .concat();
    let mut table = toml::Table::new();
    for layer in &layers {
        merge(&mut table, layer.clone());
    }
    let mut set = toml::Table::new();
    for assignment in overrides {
        apply_override(&mut table, assignment)?;
        apply_override(&mut set, assignment)?;
    }
    layers.push(set);
    let missing: Vec<String> = needs
        .into_iter()
        .filter(|key| last_setting(std::slice::from_ref(&table), key).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(Needs {
            recipe: source.to_string(),
            keys: missing,
        }
        .into());
    }
    let mut notes = model_of_init(&mut table)?;
    notes.extend(follow_shards(&mut table, &layers));
    let origin = if overrides.is_empty() {
        source.to_string()
    } else {
        format!("{source} (with --set)")
    };
    notes.extend(legacy_dtype(&mut table, &layers).map_err(|e| anyhow!("{origin}: {e}"))?);
    let recipe: Recipe =
        serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let path = e.path().to_string();
            if path == "." || path.is_empty() {
                anyhow!("{origin}: {}", e.inner())
            } else {
                anyhow!("{origin}: `{path}`: {}", e.inner())
            }
        })?;
    recipe.validate().map_err(|e| anyhow!("{origin}: {e}"))?;
    let name = match &source {
        Source::Builtin(n) => n.to_string(),
        Source::File(path) => path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    Ok(Resolved {
        name,
        source,
        recipe,
        notes,
    })
}

/// A recipe without a model of its own (no `model.attention`) that starts from trained weights
/// (`training.init_from`, a run directory) takes the model of that run's recipe, with any
/// `model.*` keys it does give on top (`model.attention_impl`, say): what fine-tuning an
/// imported model needs.
fn model_of_init(table: &mut toml::Table) -> Result<Vec<String>> {
    let init = table
        .get("training")
        .and_then(|t| t.get("init_from"))
        .and_then(toml::Value::as_str)
        .map(str::to_string);
    // A model of its own names its attention; keys without it adjust the inherited model.
    let own = table.get("model").and_then(toml::Value::as_table);
    let (false, Some(init)) = (own.is_some_and(|m| m.contains_key("attention")), init) else {
        return Ok(Vec::new());
    };
    let path = Path::new(&init).join(layout::RECIPE);
    if !path.is_file() {
        bail!(
            "the recipe has no [model], so it takes that of `training.init_from` = {init:?}, which is no run directory (no {})",
            path.display()
        );
    }
    let init_recipe = from_run_file(&path)?;
    let mut inherited = inherit_unset(table, &init_recipe, Path::new(&init))?;
    let mut model = toml::Table::try_from(&init_recipe.model).expect("a model section serializes");
    let adjusted = match table.remove("model") {
        Some(toml::Value::Table(own)) => {
            let keys: Vec<String> = own.keys().map(|k| format!("model.{k}")).collect();
            merge(&mut model, own);
            keys
        }
        _ => Vec::new(),
    };
    table.insert("model".into(), toml::Value::Table(model));
    inherited.insert(0, "[model]".to_string());
    Ok(vec![format!(
        "{} that of `training.init_from` = {init:?} ({}){}",
        match inherited.as_slice() {
            [one] => format!("{one} is"),
            many => format!("{} are", many.join(", ")),
        },
        path.display(),
        match adjusted.as_slice() {
            [] => String::new(),
            keys => format!(", with {} as given", keys.join(", ")),
        }
    )])
}

/// What a model-less recipe also takes from the run it starts from (`init`, at `dir`), where it
/// does not set them: that run's tokenizer for the embedded corpus (`data.tokenizer`, or the
/// run's own `tokenizer.json` when it trained on shards: the model's vocabulary is that
/// tokenizer's) and, when that run's weights are at step 0 of a warm-up of the negative map (a
/// fresh conversion's), that warm-up (`training.lambda_warmup`; weights past it do not start it
/// again). Weights inside a warm-up are refused: a new run would restart it at scale 0. Returns
/// the keys taken.
fn inherit_unset(table: &mut toml::Table, init: &Recipe, dir: &Path) -> Result<Vec<String>> {
    let mut taken = Vec::new();
    // A section that is not a table is left as it is, for deserialising to name.
    let section = |table: &mut toml::Table, name: &str| -> Option<toml::Table> {
        match table.get(name) {
            None => Some(toml::Table::new()),
            Some(toml::Value::Table(t)) => Some(t.clone()),
            Some(_) => None,
        }
    };
    if let Some(mut data) = section(table, "data") {
        let embedded = data
            .get("corpus")
            .and_then(toml::Value::as_str)
            .is_some_and(|c| c == diffzoo_datasets::corpus::EMBEDDED);
        let own = dir.join(layout::TOKENIZER);
        let tokenizer = match &init.data.tokenizer {
            Some(tokenizer) => Some(tokenizer.clone()),
            None => own.is_file().then(|| {
                std::path::absolute(&own)
                    .unwrap_or(own)
                    .display()
                    .to_string()
            }),
        };
        if let (true, false, Some(tokenizer)) =
            (embedded, data.contains_key("tokenizer"), tokenizer)
        {
            data.insert("tokenizer".into(), tokenizer.into());
            taken.push("`data.tokenizer`".to_string());
            table.insert("data".into(), data.into());
        }
    }
    if let (Some(mut training), Some(n)) =
        (section(table, "training"), init.training.warmup_steps())
    {
        let step = layout::find_weights(dir)
            .and_then(|w| layout::weights_step(dir, &w, init.total_steps()))
            .ok();
        match step {
            _ if training.contains_key("lambda_warmup") => {}
            Some(0) => {
                training.insert("lambda_warmup".into(), (n as i64).into());
                taken.push("`training.lambda_warmup`".to_string());
                table.insert("training".into(), training.into());
            }
            Some(step) if step < n => bail!(
                "`training.init_from` = {:?}: its weights are at step {step} of their {n}-step λ warm-up (scale {:.3}), and a new run would start its own warm-up at scale 0: train that run on past step {n} first, or set `training.lambda_warmup` yourself (0: scale 1 from the start)",
                dir.display().to_string(),
                step as f64 / n as f64
            ),
            _ => {}
        }
    }
    Ok(taken)
}

/// `training.dtype`, the name `training.precision` had before mixed precision, read into it:
/// "f32" is "f32", "bf16" is "bf16-pure" and "f16" "f16-pure" (what they always did). Where
/// both are set the later of `layers` wins; set together, they must agree. Says what a low
/// precision maps to (an old run's recipe.toml holds `dtype = "f32"`: not worth a line).
fn legacy_dtype(table: &mut toml::Table, layers: &[toml::Table]) -> Result<Option<String>> {
    let Some(training) = table
        .get_mut("training")
        .and_then(toml::Value::as_table_mut)
    else {
        return Ok(None);
    };
    let Some(dtype) = training.remove("dtype") else {
        return Ok(None);
    };
    let name = dtype.as_str().unwrap_or_default().to_string();
    let mapped = match name.as_str() {
        "f32" => Precision::F32,
        "bf16" => Precision::Bf16Pure,
        "f16" => Precision::F16Pure,
        _ => bail!(
            "`training.dtype` = {dtype} is not one of f32, bf16, f16 (it is the old name of `training.precision`: {})",
            Precision::ALL.map(Precision::name).join(", ")
        ),
    };
    let (by_dtype, by_precision) = (
        last_setting(layers, "training.dtype"),
        last_setting(layers, "training.precision"),
    );
    if let Some(precision) = training.get("precision")
        && by_precision >= by_dtype
    {
        if by_precision == by_dtype && precision.as_str() != Some(mapped.name()) {
            bail!(
                "`training.dtype` = {dtype} (the old name of `training.precision` = \"{}\") and `training.precision` = {precision} disagree: give `training.precision` alone",
                mapped.name()
            );
        }
        return Ok(None);
    }
    training.insert("precision".into(), mapped.name().into());
    Ok((mapped != Precision::F32).then(|| {
        format!(
            "`training.dtype` = {dtype} is read as `training.precision` = \"{}\": weights, gradients and AdamW moments all in {name}; \"bf16-mixed\" keeps f32 master weights and moments",
            mapped.name()
        )
    }))
}

/// Parses a resolved recipe written into a run directory (one written before
/// `training.precision` existed holds `training.dtype`, read as [`legacy_dtype`] says).
pub fn from_run_file(path: &Path) -> Result<Recipe> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut table: toml::Table = text
        .parse()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    if table
        .get("training")
        .is_none_or(|t| t.get("dtype").is_none())
    {
        // Nothing to read anew: parsed from the text, errors keep their line and column.
        return toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()));
    }
    let layers = [table.clone()];
    legacy_dtype(&mut table, &layers).with_context(|| path.display().to_string())?;
    toml::Value::Table(table)
        .try_into()
        .map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// Numbers derived from a recipe, all computed (see `diffzoo_models::budget`).
#[derive(Debug, Clone, Serialize)]
pub struct Derived {
    pub params_total: u64,
    pub params_non_embedding: u64,
    pub params_paper: u64,
    pub steps: usize,
    pub tokens: u64,
    pub batch_sequences: usize,
    pub accumulation: usize,
    pub training_flops_per_token: f64,
    pub training_flops: f64,
}

impl Recipe {
    pub fn derived(&self) -> Derived {
        let config = self.model_config();
        let params = config.param_count();
        let steps = self.total_steps();
        let tokens = steps as u64 * self.training.batch_tokens as u64;
        let per_token = config.flops_per_token(self.data.seq_len).training;
        Derived {
            params_total: params.total,
            params_non_embedding: params.non_embedding,
            params_paper: params.paper,
            steps,
            tokens,
            batch_sequences: self.batch_sequences(),
            accumulation: self.accumulation(),
            training_flops_per_token: per_token,
            training_flops: per_token * tokens as f64,
        }
    }
}

#[derive(Serialize)]
struct Listed<'a> {
    name: &'a str,
    description: String,
    attention: Option<String>,
    params: Option<u64>,
    error: Option<String>,
}

/// The `description` a built-in recipe's own file gives.
fn builtin_description(name: &str) -> String {
    BUILTIN
        .iter()
        .find(|(n, _)| *n == name)
        .and_then(|(_, text)| text.parse::<toml::Table>().ok())
        .and_then(|t| t.get("description")?.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// `diffzoo recipe list`.
pub fn list(json: bool) -> Result<()> {
    let rows: Vec<Listed> = builtin_names()
        .into_iter()
        .map(|name| match resolve(name, &[]) {
            Ok(r) => Listed {
                name,
                description: r.recipe.description.clone(),
                attention: Some(r.recipe.model.attention.to_string()),
                params: Some(r.recipe.derived().params_total),
                error: None,
            },
            Err(e) => match e.downcast_ref::<Needs>() {
                Some(needs) => Listed {
                    name,
                    description: format!(
                        "{} (needs {})",
                        builtin_description(name),
                        needs.keys.join(", ")
                    ),
                    attention: None,
                    params: None,
                    error: None,
                },
                None => Listed {
                    name,
                    description: String::new(),
                    attention: None,
                    params: None,
                    error: Some(format!("{e:#}")),
                },
            },
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<36} {:<12} {:>11}  DESCRIPTION",
        "NAME", "ATTENTION", "PARAMETERS"
    );
    for row in rows {
        match (&row.attention, row.params, &row.error) {
            (Some(a), Some(p), _) => {
                println!(
                    "{:<36} {:<12} {:>10.2}M  {}",
                    row.name,
                    a,
                    p as f64 / 1e6,
                    row.description
                )
            }
            (_, _, Some(e)) => println!("{:<36} invalid: {e}", row.name),
            _ => println!(
                "{:<36} {:<12} {:>11}  {}",
                row.name, "-", "-", row.description
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_checked_and_left_out_of_a_recipe_without_them() {
        let tiny = resolve("tiny", &[]).unwrap().recipe;
        assert!(tiny.training.seeds.is_empty() && !tiny.to_toml().contains("seeds"));
        let seeded = resolve("tiny", &["training.seeds=[3,1,2]".into()])
            .unwrap()
            .recipe;
        assert_eq!(seeded.training.seeds, [3, 1, 2]);
        let again: Recipe = toml::from_str(&seeded.to_toml()).unwrap();
        assert_eq!(again.training.seeds, [3, 1, 2]);
        let twice = resolve("tiny", &["training.seeds=[1,2,1]".into()]).unwrap_err();
        assert!(
            format!("{twice:#}").contains("`training.seeds`: 1 is given twice"),
            "{twice:#}"
        );
        let negative = resolve("tiny", &["training.seeds=[-1]".into()]).unwrap_err();
        assert!(
            format!("{negative:#}").contains("training.seeds"),
            "{negative:#}"
        );
    }

    #[test]
    fn a_decay_that_would_flip_every_weight_is_refused_naming_both_keys() {
        let err = resolve("tiny", &["optimizer.weight_decay=1e9".into()]).unwrap_err();
        let err = format!("{err:#}");
        assert!(
            err.contains("`optimizer.lr`") && err.contains("`optimizer.weight_decay`"),
            "{err}"
        );
        assert!(resolve("tiny", &["optimizer.weight_decay=0.5".into()]).is_ok());
    }

    #[test]
    fn a_recipe_without_a_model_takes_that_of_the_run_it_starts_from() {
        let err = resolve("sft", &[]).unwrap_err();
        let needs = err
            .downcast_ref::<Needs>()
            .expect("the keys sft leaves to its user");
        assert_eq!(needs.keys, ["training.init_from", "data.corpus"]);
        let run = tempfile::tempdir().unwrap();
        let tiny = resolve("tiny", &[]).unwrap().recipe;
        std::fs::write(run.path().join(layout::RECIPE), tiny.to_toml()).unwrap();
        let set = |extra: &[&str]| {
            let mut all = vec![
                format!("training.init_from={:?}", run.path().display().to_string()),
                "data.corpus=\"data/sft\"".to_string(),
            ];
            all.extend(extra.iter().map(|s| s.to_string()));
            all
        };
        let r = resolve("sft", &set(&[])).unwrap();
        assert_eq!(r.recipe.model, tiny.model);
        assert!(r.notes[0].contains("training.init_from"), "{:?}", r.notes);
        // From the embedded corpus it reads the run's tokenizer; from shards, theirs.
        assert_eq!(r.recipe.data.tokenizer, None);
        let retrofit = |extra: &[String]| {
            let mut all = vec![format!(
                "training.init_from={:?}",
                run.path().display().to_string()
            )];
            all.extend(extra.iter().cloned());
            resolve("retrofit/finetune", &all).unwrap()
        };
        let r = retrofit(&[]);
        assert_eq!(r.recipe.data.tokenizer.as_deref(), Some("bpe"));
        assert_eq!(r.recipe.training.lambda_warmup, None);
        assert!(r.notes[0].contains("`data.tokenizer` are"), "{:?}", r.notes);
        // A converted run's warm-up comes with its model (its final model, which no `train`
        // wrote, is at step 0), unless the recipe sets its own or declines it with 0 …
        let mut converted = tiny.clone();
        converted.training.lambda_warmup = Some(30);
        std::fs::write(run.path().join(layout::RECIPE), converted.to_toml()).unwrap();
        std::fs::write(run.path().join(layout::FINAL_MODEL), b"").unwrap();
        let r = retrofit(&[]);
        assert_eq!(r.recipe.training.lambda_warmup, Some(30));
        assert!(
            r.notes[0].contains("`training.lambda_warmup`"),
            "{:?}",
            r.notes
        );
        let own = retrofit(&["training.lambda_warmup=5".into()]);
        assert_eq!(own.recipe.training.lambda_warmup, Some(5));
        let none = retrofit(&["training.lambda_warmup=0".into()]);
        assert_eq!(none.recipe.training.warmup_steps(), None);
        // … and not once the run's weights are past it (a finished run of 240 steps).
        layout::RunEnd::new("finished", None)
            .write(run.path())
            .unwrap();
        assert_eq!(retrofit(&[]).recipe.training.lambda_warmup, None);
        // Weights part-way through one (step 240 of 300) would restart it at scale 0: refused
        // unless the recipe sets its own.
        converted.training.lambda_warmup = Some(300);
        std::fs::write(run.path().join(layout::RECIPE), converted.to_toml()).unwrap();
        let init = format!("training.init_from={:?}", run.path().display().to_string());
        let err = format!(
            "{:#}",
            resolve("retrofit/finetune", std::slice::from_ref(&init)).unwrap_err()
        );
        assert!(
            err.contains("step 240 of their 300-step λ warm-up (scale 0.800)")
                && err.contains("`training.lambda_warmup`"),
            "{err}"
        );
        let none = retrofit(&["training.lambda_warmup=0".into()]);
        assert_eq!(none.recipe.training.warmup_steps(), None);
        std::fs::remove_file(run.path().join(layout::FINAL_MODEL)).unwrap();
        // A run trained on shards (no `data.tokenizer`) lends its own tokenizer.json.
        let mut sharded = tiny.clone();
        sharded.data.corpus = "shards".into();
        sharded.data.tokenizer = None;
        std::fs::write(run.path().join(layout::RECIPE), sharded.to_toml()).unwrap();
        let own = run.path().join(layout::TOKENIZER);
        std::fs::write(&own, b"{}").unwrap();
        let r = retrofit(&[]);
        let want = std::path::absolute(&own).unwrap().display().to_string();
        assert_eq!(r.recipe.data.tokenizer.as_deref(), Some(want.as_str()));
        std::fs::remove_file(&own).unwrap();
        std::fs::write(run.path().join(layout::RECIPE), tiny.to_toml()).unwrap();
        // A model key given adjusts the inherited model; the rest stays the run's.
        let flash = resolve("sft", &set(&["model.attention_impl=\"flash\""])).unwrap();
        assert_eq!(flash.recipe.model.attention_impl, AttentionChoice::Flash);
        assert_eq!(flash.recipe.model.d_model, tiny.model.d_model);
        assert!(
            flash.notes[0].contains("model.attention_impl"),
            "{:?}",
            flash.notes
        );
        let missing = resolve(
            "sft",
            &[
                "training.init_from=\"/nonexistent\"".into(),
                "data.corpus=\"x\"".into(),
            ],
        );
        assert!(format!("{:#}", missing.unwrap_err()).contains("no run directory"));
    }

    #[test]
    fn real_model_keys_round_trip_and_are_checked() {
        let set = [
            "model.head_dim=48".to_string(),
            "model.qkv_bias=true".into(),
            "model.rope_scaling={type=\"llama3\", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64}".into(),
            "model.attention=\"transformer\"".into(),
        ];
        let r = resolve("tiny", &set).unwrap().recipe;
        let config = r.model_config();
        assert_eq!((config.head_dim(), config.qkv_bias), (48, true));
        assert!(matches!(
            config.rope_scaling,
            Some(RopeScaling::Llama3 {
                original_max_seq_len: 64,
                ..
            })
        ));
        assert_eq!(r.model.architecture(), Architecture::Qwen2);
        let again: Recipe = toml::from_str(&r.to_toml()).unwrap();
        assert_eq!(again, r);
        // Without the new keys a recipe reads and writes as before.
        let tiny = resolve("tiny", &[]).unwrap().recipe;
        let text = tiny.to_toml();
        for key in ["head_dim", "qkv_bias", "rope_scaling", "hf_architecture"] {
            assert!(!text.contains(key), "{key} in {text}");
        }
        for (set, named) in [
            ("model.rope_scaling={type=\"yarn\", factor=2.0}", "yarn"),
            (
                "model.rope_scaling={type=\"linear\", factor=0.0}",
                "model.rope_scaling.factor",
            ),
            (
                "model.hf_architecture=\"GemmaForCausalLM\"",
                "GemmaForCausalLM",
            ),
            ("model.hf_architecture=\"Qwen2ForCausalLM\"", "qkv_bias"),
            (
                "model.hf_architecture=\"DiffLlamaForCausalLM\"",
                "model.hf_architecture",
            ),
        ] {
            let err = format!(
                "{:#}",
                resolve("tiny-transformer", &[set.to_string()]).unwrap_err()
            );
            assert!(err.contains(named), "{set}: {err}");
        }
    }

    #[test]
    fn differences_name_each_changed_key_with_both_values() {
        let tiny = resolve("tiny", &[]).unwrap().recipe;
        assert!(tiny.differences(&tiny).is_empty());
        let changed = resolve("tiny", &["optimizer.lr=0.01".into()])
            .unwrap()
            .recipe;
        let differences = tiny.differences(&changed);
        assert_eq!(differences.len(), 1, "{differences:?}");
        let (key, was, now) = &differences[0];
        assert_eq!(key, "optimizer.lr");
        let was: f64 = was.as_deref().unwrap().parse().unwrap();
        assert_eq!(was, tiny.optimizer.lr);
        assert_eq!(now.as_deref(), Some("0.01"));
        let baseline = resolve("tiny-transformer", &[]).unwrap().recipe;
        let keys: Vec<String> = tiny
            .differences(&baseline)
            .into_iter()
            .map(|(k, _, _)| k)
            .collect();
        assert!(keys.contains(&"model.attention".to_string()), "{keys:?}");
    }

    #[test]
    fn built_in_names_come_smallest_first_and_a_typo_gets_the_nearest() {
        let names = builtin_names();
        assert_eq!(names.len(), BUILTIN.len());
        assert_eq!(names[0], "tiny");
        let at = |n: &str| names.iter().position(|m| *m == n).expect(n);
        let order = [
            "tiny-transformer",
            "micro",
            "micro-transformer",
            "mini/size-scaling/d064-diff",
            "mini/size-scaling/d096-diff",
            "mini/size-scaling/d256-transformer",
            "mini/token-scaling/t040-diff",
            "mini/token-scaling/t320-transformer",
            "paper/size-scaling/830m-diff",
            "paper/size-scaling/1.4b-diff",
            "paper/size-scaling/6.8b-transformer",
            "paper/size-scaling/13.1b-diff",
            "paper/3b/diff-1t",
        ];
        for pair in order.windows(2) {
            assert!(at(pair[0]) < at(pair[1]), "{pair:?} in {names:?}");
        }
        let message = |name: &str| format!("{:#}", resolve(name, &[]).unwrap_err());
        for (typed, meant) in [
            ("tny", "did you mean `tiny`?"),
            ("micro-transformr", "did you mean `micro-transformer`?"),
            ("830m-diff", "did you mean `paper/size-scaling/830m-diff`?"),
        ] {
            let got = message(typed);
            assert!(got.contains(meant), "{typed}: {got}");
        }
        let far = message("qqqqqqqq");
        assert!(
            !far.contains("did you mean") && far.contains(&format!("shows all {}", BUILTIN.len())),
            "{far}"
        );
    }

    #[test]
    fn paper_sizes_match_their_labels_within_one_percent() {
        let labels = [
            ("830m", 0.834e9),
            ("1.4b", 1.413e9),
            ("2.8b", 2.773e9),
            ("6.8b", 6.853e9),
            ("13.1b", 13.096e9),
        ];
        for (size, label) in labels {
            for variant in ["diff", "transformer"] {
                let name = format!("paper/size-scaling/{size}-{variant}");
                let recipe = resolve(&name, &[]).unwrap().recipe;
                let paper = recipe.derived().params_paper as f64;
                assert!(
                    (paper - label).abs() / label < 0.01,
                    "{name}: {paper} vs {label}"
                );
                assert_eq!(recipe.total_steps(), 40_000);
                assert_eq!(
                    recipe.training.batch_tokens * recipe.total_steps(),
                    10_485_760_000
                );
            }
            let diff = resolve(&format!("paper/size-scaling/{size}-diff"), &[])
                .unwrap()
                .recipe;
            let head_dim = diff.model.d_model / diff.model.heads;
            assert_eq!(head_dim, if size == "830m" { 96 } else { 128 });
        }
    }

    #[test]
    fn a_recipe_files_relative_paths_resolve_against_its_folder_and_sets_against_the_current_one() {
        let tmp = tempfile::tempdir().unwrap();
        let (sub, other) = (tmp.path().join("sub"), tmp.path().join("other"));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(
            sub.join("a.toml"),
            "extends = \"tiny\"\n[data]\ncorpus = \"shards\"\n",
        )
        .unwrap();
        std::fs::write(
            other.join("b.toml"),
            "extends = \"../sub/a\"\n[training]\ninit_from = \"/abs/base\"\n",
        )
        .unwrap();
        let b = other.join("b.toml").display().to_string();
        let r = resolve(&b, &["data.tokenizer=\"t.json\"".into()])
            .unwrap()
            .recipe;
        assert_eq!(r.data.corpus, sub.join("shards").display().to_string());
        assert_eq!(r.data.tokenizer.as_deref(), Some("t.json"));
        assert_eq!(r.training.init_from.as_deref(), Some("/abs/base"));
        let missing = r.missing_paths();
        assert_eq!(missing.len(), 3, "{missing:?}");
        assert!(missing[0].starts_with("`data.corpus`"), "{missing:?}");
        let stored = r.with_absolute_paths();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            stored.data.tokenizer.as_deref(),
            Some(cwd.join("t.json").display().to_string().as_str())
        );
        assert_eq!(folded(Path::new("a/./b/../../../c")), Path::new("../c"));
        // The special values name no file.
        let tiny = resolve("tiny", &[]).unwrap().recipe;
        assert_eq!(tiny.with_absolute_paths(), tiny);
        assert!(tiny.missing_paths().is_empty());
    }

    #[test]
    fn paper_3b_recipes_follow_appendix_d() {
        let r = resolve("paper/3b/diff-360b", &[]).unwrap().recipe;
        assert_eq!(
            (
                r.model.d_model,
                r.model.layers,
                r.model.heads,
                r.model.ffn_dim
            ),
            (3072, 28, 24, Some(8192))
        );
        assert_eq!(r.total_steps(), 85_831, "360B tokens of 4,194,304");
        assert_eq!(
            r.checkpoint.interval * r.training.batch_tokens,
            40_001_077_248,
            "every 40B tokens"
        );
        let t = resolve("paper/3b/diff-1t", &[]).unwrap().recipe;
        assert_eq!(t.total_steps(), 238_419);
        let x = resolve("paper/3b/diff-64k", &[]).unwrap().recipe;
        assert_eq!(
            (x.data.seq_len, x.model.rope_theta, x.optimizer.lr),
            (65_536, 640_000.0, 8e-5)
        );
        assert_eq!(x.total_steps(), 358, "1.5B tokens");
        assert_eq!(
            x.training.init_from.as_deref(),
            Some("runs/paper/3b/diff-360b")
        );
    }

    /// `training.dtype`, the old name, reads as the precision it always was; the later of it and
    /// `training.precision` wins, set together they must agree, and a run's recipe.toml written
    /// before `training.precision` reads too.
    #[test]
    fn training_dtype_reads_as_the_precision_it_always_was() {
        for (dtype, precision) in [
            ("f32", Precision::F32),
            ("bf16", Precision::Bf16Pure),
            ("f16", Precision::F16Pure),
        ] {
            let r = resolve("micro", &[format!("training.dtype=\"{dtype}\"")]).unwrap();
            assert_eq!(r.recipe.training.precision, precision);
            let said = r
                .notes
                .iter()
                .any(|n| n.contains("is read as `training.precision`"));
            assert_eq!(said, dtype != "f32", "{dtype}: {:?}", r.notes);
            assert!(!r.recipe.to_toml().contains("dtype"), "{dtype}");
        }
        let tmp = tempfile::tempdir().unwrap();
        let old = tmp.path().join("old.toml");
        std::fs::write(&old, "extends = \"micro\"\n[training]\ndtype = \"bf16\"\n").unwrap();
        let old = old.display().to_string();
        let precision = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            resolve(&old, &sets).map(|r| r.recipe.training.precision)
        };
        assert_eq!(precision(&[]).unwrap(), Precision::Bf16Pure);
        assert_eq!(
            precision(&["training.precision=bf16-mixed"]).unwrap(),
            Precision::Bf16Mixed
        );
        let both = tmp.path().join("both.toml");
        std::fs::write(
            &both,
            "extends = \"micro\"\n[training]\ndtype = \"bf16\"\nprecision = \"bf16-mixed\"\n",
        )
        .unwrap();
        let err = resolve(&both.display().to_string(), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "`training.dtype` = \"bf16\" (the old name of `training.precision` = \"bf16-pure\")"
            ) && err.contains("disagree"),
            "{err}"
        );
        let err = resolve("micro", &["training.dtype=f8".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`training.dtype` = \"f8\""), "{err}");
        let err = resolve("micro", &["training.precision=bf16".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`training.precision`") && err.contains("bf16-mixed"),
            "{err}"
        );

        let run = tmp.path().join("recipe.toml");
        let written = resolve("micro", &[]).unwrap().recipe.to_toml();
        assert!(written.contains("precision = \"f32\""), "{written}");
        std::fs::write(
            &run,
            written.replace("precision = \"f32\"", "dtype = \"bf16\""),
        )
        .unwrap();
        assert_eq!(
            from_run_file(&run).unwrap().training.precision,
            Precision::Bf16Pure
        );
    }
}
