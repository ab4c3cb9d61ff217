//! Hugging Face interop: `diffzoo import hf` reads a transformers checkpoint into a run
//! directory, `diffzoo export hf` writes a run's model as one transformers loads.
//!
//! | diffzoo | transformers | tensor |
//! |---|---|---|
//! | `transformer` | `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` (q/k/v biases) | |
//! | `diff` (V1) | `DiffLlamaForCausalLM` | |
//! | `diff-v2` | `DiffzooV2ForCausalLM` (`auto_map`, our `modeling_diffzoo_v2.py`) | |
//! | `embed.weight` | `model.embed_tokens.weight` | copied |
//! | `blocks.i.attn_norm.weight` | `model.layers.i.input_layernorm.weight` | copied |
//! | `blocks.i.attn.{q,k}_proj.weight` | `model.layers.i.self_attn.{q,k}_proj.weight` | rows permuted |
//! | `blocks.i.attn.v_proj.weight` | `model.layers.i.self_attn.v_proj.weight` | rows permuted (V1) |
//! | `blocks.i.attn.{q,k,v}_proj.bias` | `model.layers.i.self_attn.{q,k,v}_proj.bias` (Qwen2) | as their weights' rows |
//! | `blocks.i.attn.o_proj.weight` | `model.layers.i.self_attn.o_proj.weight` | V1: subln folded in |
//! | `blocks.i.attn.lambda_{q1,k1,q2,k2}` | `model.layers.i.self_attn.lambda_{q1,k1,q2,k2}` | copied |
//! | `blocks.i.attn.subln.weight` | — (DiffLlama's per-head RMSNorm has no weight) | import: ones |
//! | `blocks.i.attn.lambda_proj.weight` | `model.layers.i.self_attn.lambda_proj.weight` (V2) | copied |
//! | `blocks.i.ffn_norm.weight` | `model.layers.i.post_attention_layernorm.weight` | copied |
//! | `blocks.i.ffn.{w_g,w1,w2}.weight` | `model.layers.i.mlp.{gate,up,down}_proj.weight` | copied |
//! | `norm.weight`, `lm_head.weight` | `model.norm.weight`, `lm_head.weight` (absent when tied) | copied |
//!
//! Row permutations (every one a pure reordering, so conversions are exact):
//! - RoPE: we rotate adjacent pairs (2i, 2i+1) of each head, transformers rotates halves
//!   (i, i + d/2) (`rotate_half`): our row `2i + c` of a head is its row `i + c·d/2`.
//! - DIFF V1 pairs query heads as (h, h + H/2) and splits V by kv-head halves; we hold each
//!   head's two half-heads next to each other: our half-head `2h + c` of q, k and v is its head
//!   `h + c·n/2` (n = H for q, H_kv for k and v).
//! - DIFF V1's `(1 − λ_init)·subln(·)` is followed by o_proj, so exporting folds the subln weight
//!   into o_proj's columns; importing sets subln to ones.

pub mod config;
pub mod export;
pub mod import;

use anyhow::{Context, Result, bail};
use diffzoo_models::{AttentionKind, ModelConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const CONFIG: &str = "config.json";
pub const WEIGHTS: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
pub const TOKENIZER: &str = "tokenizer.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";
/// The self-contained transformers implementation of DIFF V2 written beside its export.
pub const V2_MODULE: &str = "modeling_diffzoo_v2";
pub const V2_SOURCE: &str = include_str!("modeling_diffzoo_v2.py");

/// Where to write before renaming to `out` (which must not exist): a name beside `out`, cleared
/// of what an earlier failure left. The caller creates it once its input has been checked.
pub fn staging(out: &Path) -> Result<PathBuf> {
    if out.exists() {
        bail!("{} already exists: choose a new --out", out.display());
    }
    let name = out
        .file_name()
        .ok_or_else(|| anyhow::anyhow!("--out {} names no directory", out.display()))?;
    let staging = out.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing {}", staging.display()))?;
    }
    Ok(staging)
}

/// The transformers classes diffzoo reads and writes: Llama, Mistral and Qwen2 hold the
/// baseline Transformer (Qwen2 with biases on q, k and v), DiffLlama DIFF V1, and our own
/// class DIFF V2. Recipes name them (`model.hf_architecture`) by class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    DiffLlama,
    DiffzooV2,
}

impl Architecture {
    pub const ALL: [Architecture; 5] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::DiffLlama,
        Self::DiffzooV2,
    ];

    /// The class a model of `kind` exports as unless its recipe names one: Qwen2 for a
    /// baseline with q/k/v biases (Llama has biases on every projection or none).
    pub fn of(kind: AttentionKind, qkv_bias: bool) -> Self {
        match kind {
            AttentionKind::Transformer if qkv_bias => Self::Qwen2,
            AttentionKind::Transformer => Self::Llama,
            AttentionKind::Diff => Self::DiffLlama,
            AttentionKind::DiffV2 => Self::DiffzooV2,
        }
    }

    pub fn kind(self) -> AttentionKind {
        match self {
            Self::Llama | Self::Mistral | Self::Qwen2 => AttentionKind::Transformer,
            Self::DiffLlama => AttentionKind::Diff,
            Self::DiffzooV2 => AttentionKind::DiffV2,
        }
    }

    /// Whether this class holds a model of `kind` with (or without) q/k/v biases; otherwise
    /// why not.
    pub fn holds(self, kind: AttentionKind, qkv_bias: bool) -> Result<()> {
        if self.kind() != kind {
            bail!(
                "{} holds `attention = \"{}\"` models, not \"{kind}\"",
                self.class(),
                self.kind()
            );
        }
        let biased = match self {
            Self::Qwen2 => true,
            Self::DiffzooV2 => qkv_bias,
            _ => false,
        };
        match (biased, qkv_bias, kind) {
            (true, false, _) => bail!(
                "{} has biases on q, k and v: it needs `qkv_bias = true`",
                self.class()
            ),
            (false, true, AttentionKind::Diff) => bail!(
                "no transformers class holds DIFF V1 with biases on q, k and v alone ({} has them on every projection or none): it cannot be exported",
                self.class()
            ),
            (false, true, _) => bail!(
                "{} has no biases on q, k and v alone: `qkv_bias = true` needs {}",
                self.class(),
                Self::of(kind, true).class()
            ),
            _ => Ok(()),
        }
    }

    /// The `architectures` entry of config.json.
    pub fn class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::DiffLlama => "DiffLlamaForCausalLM",
            Self::DiffzooV2 => "DiffzooV2ForCausalLM",
        }
    }

    /// The `model_type` of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::DiffLlama => "diffllama",
            Self::DiffzooV2 => "diffzoo_v2",
        }
    }

    pub fn from_class(class: &str) -> Result<Self> {
        match Self::ALL.into_iter().find(|a| a.class() == class) {
            Some(a) => Ok(a),
            None => bail!(
                "architecture `{class}` is not supported: diffzoo imports {}",
                Self::ALL.map(Self::class).join(", ")
            ),
        }
    }
}

impl serde::Serialize for Architecture {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.class())
    }
}

impl<'de> serde::Deserialize<'de> for Architecture {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let class = String::deserialize(deserializer)?;
        Self::from_class(&class).map_err(serde::de::Error::custom)
    }
}

/// One tensor of the model under both names, in PyTorch layout (`[out, in]` for linear layers).
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Our name as PyTorch would write it (the module path without enum variants, norms'
    /// `weight`); Burn's own files name it as [`burn_names`] says.
    pub ours: String,
    /// The transformers name; `None` for DIFF V1's subln, which transformers does not have.
    pub hf: Option<String>,
    pub shape: Vec<usize>,
    /// How our rows are ordered relative to transformers'; `None` when in the same order.
    pub rows: Option<Rows>,
    /// A linear layer's weight, which Burn stores transposed (`[in, out]`).
    pub linear: bool,
}

/// The row order of a projection onto `heads` heads of `d` rows (see [`head_rows`]), kept as a
/// description so that nothing is allocated before a checkpoint's shapes are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub heads: usize,
    pub d: usize,
    pub paired: bool,
    pub rotary: bool,
}

impl Entry {
    /// The shape Burn stores: linear layers transposed.
    pub fn burn_shape(&self) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if self.linear {
            shape.reverse();
        }
        shape
    }

    /// Bytes of the tensor in `dtype`.
    pub fn bytes(&self, dtype: Dtype) -> usize {
        self.shape.iter().product::<usize>() * dtype.size()
    }
}

impl Rows {
    /// Our row `i` is transformers' row `order()[i]`.
    pub fn order(self) -> Vec<usize> {
        head_rows(self.heads, self.d, self.paired, self.rotary)
    }
}

/// Every tensor of a model of `config`, in transformers' order.
pub fn entries(config: &ModelConfig) -> Vec<Entry> {
    let kind = config.attention;
    let (d_model, d, vocab) = (config.d_model, config.head_dim(), config.vocab_size);
    let (heads, kv_heads, ffn) = (config.heads, config.kv_heads(), config.ffn_hidden());
    let q_heads = if kind == AttentionKind::DiffV2 {
        2 * heads
    } else {
        heads
    };
    let paired = kind == AttentionKind::Diff;
    let rows = |heads, d, paired, rotary| Rows {
        heads,
        d,
        paired,
        rotary,
    };
    let entry = |ours: String, hf: Option<String>, shape: Vec<usize>, rows| Entry {
        linear: false,
        ours,
        hf,
        shape,
        rows,
    };
    let mut all = vec![entry(
        "embed.weight".into(),
        Some("model.embed_tokens.weight".into()),
        vec![vocab, d_model],
        None,
    )];
    for i in 0..config.layers {
        let (ours, hf) = (format!("blocks.{i}."), format!("model.layers.{i}."));
        // A `.weight`: a linear layer's when it is a matrix, else a norm's.
        let weight = |o: &str, h: &str, shape: &[usize], rows| Entry {
            linear: shape.len() == 2,
            ..entry(
                format!("{ours}{o}.weight"),
                Some(format!("{hf}{h}.weight")),
                shape.to_vec(),
                rows,
            )
        };
        all.push(weight("attn_norm", "input_layernorm", &[d_model], None));
        all.push(weight(
            "attn.q_proj",
            "self_attn.q_proj",
            &[q_heads * d, d_model],
            Some(rows(q_heads, d, paired, true)),
        ));
        all.push(weight(
            "attn.k_proj",
            "self_attn.k_proj",
            &[kv_heads * d, d_model],
            Some(rows(kv_heads, d, paired, true)),
        ));
        all.push(weight(
            "attn.v_proj",
            "self_attn.v_proj",
            &[kv_heads * d, d_model],
            paired.then(|| rows(kv_heads, d, true, false)),
        ));
        if config.qkv_bias {
            // Each bias in the order of its projection's rows.
            let biases: Vec<Entry> = all[all.len() - 3..]
                .iter()
                .map(|w| Entry {
                    ours: w.ours.replace(".weight", ".bias"),
                    hf: w.hf.as_ref().map(|h| h.replace(".weight", ".bias")),
                    shape: vec![w.shape[0]],
                    rows: w.rows,
                    linear: false,
                })
                .collect();
            all.extend(biases);
        }
        all.push(weight(
            "attn.o_proj",
            "self_attn.o_proj",
            &[d_model, heads * d],
            None,
        ));
        match kind {
            AttentionKind::Transformer => {}
            AttentionKind::Diff => {
                for p in ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"] {
                    all.push(entry(
                        format!("{ours}attn.{p}"),
                        Some(format!("{hf}self_attn.{p}")),
                        vec![d],
                        None,
                    ));
                }
                all.push(entry(
                    format!("{ours}attn.subln.weight"),
                    None,
                    vec![2 * d],
                    None,
                ));
            }
            AttentionKind::DiffV2 => all.push(weight(
                "attn.lambda_proj",
                "self_attn.lambda_proj",
                &[heads, d_model],
                None,
            )),
        }
        all.push(weight(
            "ffn_norm",
            "post_attention_layernorm",
            &[d_model],
            None,
        ));
        all.push(weight("ffn.w_g", "mlp.gate_proj", &[ffn, d_model], None));
        all.push(weight("ffn.w1", "mlp.up_proj", &[ffn, d_model], None));
        all.push(weight("ffn.w2", "mlp.down_proj", &[d_model, ffn], None));
    }
    all.push(entry(
        "norm.weight".into(),
        Some("model.norm.weight".into()),
        vec![d_model],
        None,
    ));
    if !config.tie_embeddings {
        all.push(Entry {
            linear: true,
            ..entry(
                "lm_head.weight".into(),
                Some("lm_head.weight".into()),
                vec![vocab, d_model],
                None,
            )
        });
    }
    all
}

/// Burn's name of each tensor (module paths with enum variants, norms' `gamma`), keyed by
/// [`Entry::ours`]: read off a model of the same structure but tiny dimensions, so that naming
/// a big model allocates nothing.
pub fn burn_names(config: &ModelConfig) -> Result<HashMap<String, String>> {
    use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot};
    let tiny = ModelConfig::new(config.attention, 16, config.layers, 4, 8, 2)
        .with_kv_heads(Some(2))
        .with_ffn_dim(Some(8))
        .with_tie_embeddings(config.tie_embeddings)
        .with_qkv_bias(config.qkv_bias)
        .init(&crate::device::parse("cpu")?);
    let burn = tiny.collect(None, None, false);
    let ours = tiny.collect(None, Some(Box::new(BurnToPyTorchAdapter)), true);
    let count = burn.len();
    let names: HashMap<String, String> = ours
        .into_iter()
        .zip(burn)
        .map(|(o, b)| (o.name, b.name))
        .collect();
    assert_eq!(names.len(), count, "one Burn name per tensor");
    Ok(names)
}

/// One tensor to write: its name, shape and what produces its bytes in the file's dtype (called
/// once, when the writer reaches it).
pub struct Pending<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub bytes: Box<dyn Fn() -> Result<Vec<u8>> + 'a>,
}

/// Writes a safetensors file of `tensors` in `dtype`, one tensor in memory at a time, with
/// `metadata` in its header.
pub fn write_safetensors(
    path: &Path,
    tensors: &[Pending],
    dtype: Dtype,
    metadata: serde_json::Value,
) -> Result<()> {
    use std::io::Write;
    let name = match dtype {
        Dtype::F32 => "F32",
        Dtype::Bf16 => "BF16",
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), metadata);
    let mut offset = 0usize;
    for t in tensors {
        let len = t.shape.iter().product::<usize>() * dtype.size();
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": name, "shape": t.shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let context = || format!("writing {}", path.display());
    out.write_all(&(header.len() as u64).to_le_bytes())
        .with_context(context)?;
    out.write_all(&header).with_context(context)?;
    for t in tensors {
        let bytes = (t.bytes)()?;
        out.write_all(&bytes).with_context(context)?;
    }
    out.into_inner()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        .sync_all()
        .with_context(context)
}

/// Writes `text` to `path`, naming the file in an error.
pub fn write_file(path: &Path, text: impl AsRef<[u8]>) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The row order of a projection onto `heads` heads of `d` rows: our head `j` is transformers'
/// head `j` (or with `paired`, `j = 2h + c` is its head `h + c·heads/2`), and with `rotary` our
/// row `2i + c` within a head is its row `i + c·d/2`.
pub fn head_rows(heads: usize, d: usize, paired: bool, rotary: bool) -> Vec<usize> {
    (0..heads * d)
        .map(|row| {
            let (j, r) = (row / d, row % d);
            let head = if paired {
                j / 2 + (j % 2) * heads / 2
            } else {
                j
            };
            let within = if rotary { r / 2 + (r % 2) * d / 2 } else { r };
            head * d + within
        })
        .collect()
}

/// Where element `i` of our tensor, in Burn's layout (linear layers `[in, out]`), is in
/// transformers' row-major tensor, whose row `order[r]` is our row `r` (import: transformers →
/// ours, one element at a time).
pub fn source_index(entry: &Entry, order: Option<&[usize]>, i: usize) -> usize {
    let (r, c, cols) = match entry.shape[..] {
        [rows, cols] if entry.linear => (i % rows, i / rows, cols),
        [_, cols] => (i / cols, i % cols, cols),
        _ => (i, 0, 1),
    };
    order.map_or(r, |o| o[r]) * cols + c
}

/// Row `i` of a row-major `[rows.len(), cols]` matrix goes to row `rows[i]` (export: ours →
/// transformers; the inverse of [`source_index`]'s reordering).
pub fn scatter_rows(x: &[f32], rows: &[usize], cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (i, &r) in rows.iter().enumerate() {
        out[r * cols..(r + 1) * cols].copy_from_slice(&x[i * cols..(i + 1) * cols]);
    }
    out
}

/// The float formats a checkpoint is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => bail!("--dtype `{other}` is not supported: use f32 or bf16"),
        }
    }

    /// burn-pack's dtype.
    pub fn pack(self) -> burn::store::burn_pack::DType {
        match self {
            Self::F32 => burn::store::burn_pack::DType::F32,
            Self::Bf16 => burn::store::burn_pack::DType::BF16,
        }
    }

    /// transformers' name (`torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }

    /// One value's little-endian bytes appended to `out` (bf16 rounds to nearest even).
    pub fn push(self, v: f32, out: &mut Vec<u8>) {
        match self {
            Self::F32 => out.extend_from_slice(&v.to_le_bytes()),
            Self::Bf16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }

    /// Little-endian bytes of `x` in this format (bf16 rounds to nearest even).
    pub fn bytes(self, x: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(x.len() * self.size());
        x.iter().for_each(|&v| self.push(v, &mut out));
        out
    }
}

/// Stored float formats that convert to f32 exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatFormat {
    F32,
    Bf16,
    F16,
}

impl FloatFormat {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    /// Value `i` of little-endian `bytes`.
    pub fn get(self, bytes: &[u8], i: usize) -> f32 {
        let b = &bytes[i * self.size()..];
        match self {
            Self::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Self::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            Self::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        }
    }
}

/// Decodes little-endian floats of a format that converts to f32 exactly.
pub fn decode_floats(bytes: &[u8], format: FloatFormat) -> Vec<f32> {
    (0..bytes.len() / format.size())
        .map(|i| format.get(bytes, i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rows_pair_each_half_with_its_partner() {
        // d = 4: our rows (0, 1) are transformers' (0, 2), ours (2, 3) its (1, 3).
        assert_eq!(head_rows(1, 4, false, true), vec![0, 2, 1, 3]);
        assert_eq!(head_rows(2, 4, false, true), vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }

    #[test]
    fn diff_half_heads_come_from_both_halves_of_the_heads() {
        // 4 heads of 2 rows: our half-heads 0, 1, 2, 3 are its heads 0, 2, 1, 3.
        assert_eq!(head_rows(4, 2, true, false), vec![0, 1, 4, 5, 2, 3, 6, 7]);
    }

    #[test]
    fn every_row_order_is_a_permutation_and_import_inverts_export() {
        for (heads, d) in [(1, 2), (2, 4), (4, 8), (6, 4), (8, 16)] {
            for paired in [false, true] {
                if paired && heads % 2 == 1 {
                    continue;
                }
                for rotary in [false, true] {
                    let rows = head_rows(heads, d, paired, rotary);
                    let mut sorted = rows.clone();
                    sorted.sort_unstable();
                    assert_eq!(sorted, (0..heads * d).collect::<Vec<_>>());
                    // Ours in PyTorch layout [out, in], exported, then read back element by
                    // element into Burn's [in, out].
                    let (out, cols) = (heads * d, 3);
                    let ours: Vec<f32> = (0..out * cols).map(|v| v as f32).collect();
                    let theirs = scatter_rows(&ours, &rows, cols);
                    let entry = Entry {
                        ours: "w".into(),
                        hf: None,
                        shape: vec![out, cols],
                        rows: None,
                        linear: true,
                    };
                    let burn: Vec<f32> = (0..out * cols)
                        .map(|i| theirs[source_index(&entry, Some(&rows), i)])
                        .collect();
                    for r in 0..out {
                        for c in 0..cols {
                            assert_eq!(burn[c * out + r], ours[r * cols + c]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn entries_cover_every_parameter_of_every_variant() {
        use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot};
        let device = burn::tensor::Device::flex();
        for kind in AttentionKind::ALL {
            for tie in [false, true] {
                let config = ModelConfig::new(kind, 32, 2, 4, 40, 16)
                    .with_kv_heads(Some(2))
                    .with_tie_embeddings(tie);
                let model = config.init(&device);
                let mut have: Vec<(String, Vec<usize>)> = model
                    .collect(None, Some(Box::new(BurnToPyTorchAdapter)), true)
                    .into_iter()
                    .map(|t| (t.name.clone(), t.shape.to_vec()))
                    .collect();
                let mut want: Vec<(String, Vec<usize>)> = entries(&config)
                    .into_iter()
                    .map(|e| (e.ours, e.shape))
                    .collect();
                have.sort();
                want.sort();
                assert_eq!(have, want, "{kind}, tied {tie}");
            }
        }
    }

    #[test]
    fn burn_names_and_layouts_are_those_of_the_real_model() {
        use burn::store::ModuleSnapshot;
        let device = burn::tensor::Device::flex();
        for kind in AttentionKind::ALL {
            let config = ModelConfig::new(kind, 24, 2, 4, 40, 16)
                .with_kv_heads(Some(2))
                .with_ffn_dim(Some(20));
            let names = burn_names(&config).unwrap();
            let model = config.init(&device);
            let burn: HashMap<String, Vec<usize>> = model
                .collect(None, None, false)
                .into_iter()
                .map(|t| (t.name.clone(), t.shape.to_vec()))
                .collect();
            let entries = entries(&config);
            assert_eq!(entries.len(), burn.len(), "{kind}");
            for e in entries {
                assert_eq!(burn[&names[&e.ours]], e.burn_shape(), "{kind}: {}", e.ours);
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_decodes_back() {
        let x = [1.0f32, -2.5, 1.0 + 1.0 / 256.0, 3.0e-5];
        let bytes = Dtype::Bf16.bytes(&x);
        let back = decode_floats(&bytes, FloatFormat::Bf16);
        assert_eq!(back[..2], [1.0, -2.5]);
        // 1 + 2⁻⁸ lies halfway between two bf16 values: rounds to the even one, 1.0.
        assert_eq!(back[2], 1.0);
        assert!((back[3] - 3.0e-5).abs() < 3.0e-5 / 128.0);
        let f32s = decode_floats(&Dtype::F32.bytes(&x), FloatFormat::F32);
        assert_eq!(f32s, x);
    }
}
