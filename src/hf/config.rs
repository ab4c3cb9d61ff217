//! `config.json` ↔ the recipe's model section.
//!
//! The policy: transformers' modeling code for a known class reads a finite set of config keys
//! ([`reads`], one table per class). Every key it reads is honoured (it becomes part of the
//! model), checked to hold a value that leaves the computation as diffzoo implements it, or
//! known to be inert for a loaded checkpoint (a token id for generation, an initialiser's
//! scale); any value diffzoo cannot honour is refused, every such key named at once. A key
//! transformers never reads cannot change what the checkpoint computes: it is accepted and
//! listed as ignored (`import hf` prints the list and records it in `import.json`).

use super::{Architecture, Dtype};
use crate::recipe::ModelSection;
use anyhow::{Context, Result, anyhow, bail};
use diffzoo_models::{DEFAULT_ATTENTION_BLOCK, ModelConfig, RopeScaling};
use serde_json::{Map, Value, json};
use std::path::Path;

/// What transformers does with a key it reads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Read {
    /// Parsed into the model by [`parse`].
    Model,
    /// Must hold this JSON value (or be null): any other changes the computation.
    Fixed(&'static str),
    /// Read, but cannot change what a loaded checkpoint computes (generation defaults and ids,
    /// the initialiser, the attention kernel, the dtype weights are loaded in).
    Inert,
}

use Read::{Fixed, Inert, Model};

/// The keys every class below reads, from transformers 5.24: `PreTrainedConfig`'s own fields
/// (`configuration_utils.py`), what `modeling_utils.py` reads to load a model
/// (`quantization_config`, `auto_map`, `torch_dtype`, `tie_word_embeddings`), what
/// `modeling_rope_utils.py` folds into `rope_parameters` (`rope_scaling`, `rope_theta`,
/// `partial_rotary_factor`, `original_max_position_embeddings`), the fields of
/// `LlamaConfig` that `modeling_llama.py` and its siblings read (each `config.X` and
/// `getattr(config, "head_dim")`), and the generation defaults transformers 4 kept in
/// config.json, which generation still reads from there.
const COMMON: &[(&str, Read)] = &[
    ("architectures", Model),
    ("model_type", Model),
    ("auto_map", Model),
    ("vocab_size", Model),
    ("hidden_size", Model),
    ("intermediate_size", Model),
    ("num_hidden_layers", Model),
    ("num_attention_heads", Model),
    ("num_key_value_heads", Model),
    ("head_dim", Model),
    ("max_position_embeddings", Model),
    ("rms_norm_eps", Model),
    ("rope_parameters", Model),
    ("rope_scaling", Model),
    ("rope_theta", Model),
    ("partial_rotary_factor", Model),
    ("original_max_position_embeddings", Model),
    ("tie_word_embeddings", Model),
    ("hidden_act", Fixed("\"silu\"")),
    ("attention_dropout", Fixed("0.0")),
    ("is_encoder_decoder", Fixed("false")),
    ("quantization_config", Fixed("null")),
    ("transformers_version", Inert),
    ("dtype", Inert),
    ("torch_dtype", Inert),
    ("output_hidden_states", Inert),
    ("return_dict", Inert),
    ("chunk_size_feed_forward", Inert),
    ("problem_type", Inert),
    ("id2label", Inert),
    ("label2id", Inert),
    ("bos_token_id", Inert),
    ("eos_token_id", Inert),
    ("pad_token_id", Inert),
    ("use_cache", Inert),
    ("initializer_range", Inert),
    ("_attn_implementation", Inert),
    ("max_length", Inert),
    ("min_length", Inert),
    ("do_sample", Inert),
    ("early_stopping", Inert),
    ("num_beams", Inert),
    ("num_beam_groups", Inert),
    ("num_return_sequences", Inert),
    ("diversity_penalty", Inert),
    ("temperature", Inert),
    ("top_k", Inert),
    ("top_p", Inert),
    ("typical_p", Inert),
    ("repetition_penalty", Inert),
    ("length_penalty", Inert),
    ("no_repeat_ngram_size", Inert),
    ("encoder_no_repeat_ngram_size", Inert),
    ("bad_words_ids", Inert),
    ("forced_bos_token_id", Inert),
    ("forced_eos_token_id", Inert),
    ("remove_invalid_values", Inert),
    ("exponential_decay_length_penalty", Inert),
    ("suppress_tokens", Inert),
    ("begin_suppress_tokens", Inert),
    ("output_attentions", Inert),
    ("output_scores", Inert),
    ("return_dict_in_generate", Inert),
];

/// `LlamaForCausalLM` (`models/llama/`): biases on every attention projection or on the MLP
/// would change the model.
const LLAMA: &[(&str, Read)] = &[
    ("attention_bias", Fixed("false")),
    ("mlp_bias", Fixed("false")),
];

/// `MistralForCausalLM` (`models/mistral/`): Llama without biases, with a sliding window on every
/// layer (its config takes `layer_types` but its modeling code never reads it).
const MISTRAL: &[(&str, Read)] = &[("sliding_window", Model)];

/// `Qwen2ForCausalLM` (`models/qwen2/`): biases on q, k and v (always), and a sliding window
/// on the layers from `max_window_layers` on when `use_sliding_window`.
const QWEN2: &[(&str, Read)] = &[
    ("use_sliding_window", Model),
    ("sliding_window", Model),
    ("max_window_layers", Model),
    ("layer_types", Model),
];

/// `DiffLlamaForCausalLM` (`models/diffllama/`): `lambda_std_dev` only initialises λ.
const DIFFLLAMA: &[(&str, Read)] = &[
    ("attention_bias", Fixed("false")),
    ("lambda_std_dev", Inert),
];

/// Our `DiffzooV2ForCausalLM` (`modeling_diffzoo_v2.py`, `DiffzooV2Config.__init__`).
const DIFFZOO_V2: &[(&str, Read)] = &[
    ("qkv_bias", Model),
    ("attention_bias", Fixed("false")),
    ("mlp_bias", Fixed("false")),
];

/// What transformers reads of a config.json of `architecture`.
fn reads(architecture: Architecture) -> impl Iterator<Item = (&'static str, Read)> {
    let own = match architecture {
        Architecture::Llama => LLAMA,
        Architecture::Mistral => MISTRAL,
        Architecture::Qwen2 => QWEN2,
        Architecture::DiffLlama => DIFFLLAMA,
        Architecture::DiffzooV2 => DIFFZOO_V2,
    };
    COMMON.iter().chain(own).copied()
}

/// RoPE's θ when a config gives none (`RotaryEmbeddingConfigMixin.default_theta`).
const DEFAULT_THETA: f64 = 10_000.0;

/// Largest values accepted, so that a mistaken or hostile config is refused before anything is
/// allocated (RoPE is tabulated for the whole context: 2^20 positions of head dim 128 take 1 GiB).
const LIMITS: &[(&str, usize)] = &[
    ("hidden_size", 1 << 20),
    ("intermediate_size", 1 << 22),
    ("num_hidden_layers", 1 << 12),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("head_dim", 1 << 12),
    ("vocab_size", 1 << 24),
    ("max_position_embeddings", 1 << 20),
];

/// What a transformers `config.json` describes.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub architecture: Architecture,
    pub model: ModelSection,
    /// `max_position_embeddings`.
    pub context: usize,
    /// Keys transformers does not read for this class (dotted inside `rope_parameters`), in
    /// key order: accepted, changing nothing.
    pub ignored: Vec<String>,
}

/// Reads and checks `config.json`.
pub fn read(path: &Path) -> Result<HfConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    parse(&value).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// What cannot be honoured, gathered so that a refusal names every key at once.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn check<T>(&mut self, result: Result<T>) -> Option<T> {
        result.map_err(|e| self.0.push(e.to_string())).ok()
    }

    fn push(&mut self, problem: String) {
        self.0.push(problem);
    }
}

fn parse(value: &Value) -> Result<HfConfig> {
    let map = value
        .as_object()
        .ok_or_else(|| anyhow!("not a JSON object"))?;
    let architecture = match map.get("architectures") {
        Some(Value::Array(list)) if list.len() == 1 => list[0]
            .as_str()
            .ok_or_else(|| anyhow!("`architectures` must hold a class name"))
            .and_then(Architecture::from_class)?,
        Some(other) => bail!("`architectures` = {other}: expected exactly one class"),
        None => bail!("no `architectures` key: cannot tell which model this is"),
    };
    let model_type = string(map, "model_type")?;
    if model_type != architecture.model_type() {
        bail!(
            "`model_type` = {model_type:?} does not match `architectures` = {} (expected {:?})",
            architecture.class(),
            architecture.model_type()
        );
    }
    let read: Vec<(&str, Read)> = reads(architecture).collect();
    let mut problems = Problems::default();
    let mut ignored = Vec::new();
    for (key, v) in map {
        match read.iter().find(|(k, _)| k == key).map(|(_, r)| *r) {
            None => ignored.push(key.clone()),
            Some(Fixed(want)) if !v.is_null() && !same(v, want) => problems.push(format!(
                "`{key}` = {v} is not supported: diffzoo implements only {key} = {want}"
            )),
            Some(_) => {}
        }
    }
    if let Some(auto_map) = map.get("auto_map")
        && !(architecture == Architecture::DiffzooV2 && *auto_map == v2_auto_map())
    {
        problems.push(format!(
            "`auto_map` = {auto_map} points transformers at custom code for {}: its computation is unknown to diffzoo, so it is refused",
            architecture.class()
        ));
    }
    let model = model_section(map, architecture, &mut problems, &mut ignored);
    match (model, problems.0.as_slice()) {
        (Some((model, context)), []) => Ok(HfConfig {
            architecture,
            model,
            context,
            ignored,
        }),
        (None, []) => bail!("the model it describes could not be read"),
        (_, [one]) => bail!("{one}"),
        (_, all) => bail!(
            "{} keys cannot be honoured:\n  {}",
            all.len(),
            all.join("\n  ")
        ),
    }
}

/// The model section (and the context) of a config whose class is `architecture`; `None` once
/// `problems` holds why not.
fn model_section(
    map: &Map<String, Value>,
    architecture: Architecture,
    problems: &mut Problems,
    ignored: &mut Vec<String>,
) -> Option<(ModelSection, usize)> {
    let d_model = problems.check(count(map, "hidden_size"));
    let heads = problems.check(count(map, "num_attention_heads"));
    let kv_heads = match map.get("num_key_value_heads") {
        None | Some(Value::Null) => heads,
        Some(_) => problems.check(count(map, "num_key_value_heads")),
    };
    let head_dim = match map.get("head_dim") {
        None | Some(Value::Null) => None,
        Some(_) => problems.check(count(map, "head_dim")),
    };
    let context = problems.check(count(map, "max_position_embeddings"));
    let layers = problems.check(count(map, "num_hidden_layers"));
    let vocab_size = problems.check(count(map, "vocab_size"));
    let ffn = problems.check(count(map, "intermediate_size"));
    let norm_eps = problems.check(number(map, "rms_norm_eps"));
    let tie = problems
        .check(boolean(map, "tie_word_embeddings"))
        .map(|tie| tie.unwrap_or(false));
    let rope = context.and_then(|context| problems.check(rope(map, context, ignored)));
    if let (Some(context), Some(layers)) = (context, layers) {
        problems.check(sliding_window(map, architecture, context, layers));
    }
    let qkv_bias = match architecture {
        Architecture::Qwen2 => true,
        Architecture::DiffzooV2 => problems.check(boolean(map, "qkv_bias"))?.unwrap_or(false),
        _ => false,
    };
    let (d_model, heads, kv_heads) = (d_model?, heads?, kv_heads?);
    let head_width = head_dim.unwrap_or(d_model / heads);
    if head_dim.is_none() && !d_model.is_multiple_of(heads) {
        problems.push(format!(
            "`num_attention_heads` = {heads} does not divide `hidden_size` = {d_model}"
        ));
    }
    if !heads.is_multiple_of(kv_heads) {
        problems.push(format!(
            "`num_key_value_heads` = {kv_heads} does not divide `num_attention_heads` = {heads}"
        ));
    }
    if !head_width.is_multiple_of(2) {
        problems.push(format!(
            "the head dimension (`head_dim`, else hidden_size / num_attention_heads) = {head_width} must be even: RoPE turns pairs"
        ));
    }
    if architecture == Architecture::DiffLlama && !(heads % 2 == 0 && kv_heads % 2 == 0) {
        problems.push(format!(
            "`num_attention_heads` = {heads} and `num_key_value_heads` = {kv_heads} must be even: DiffLlama pairs heads and splits values in halves"
        ));
    }
    let (theta, rope_scaling) = rope?;
    let model = ModelSection {
        attention: architecture.kind(),
        d_model,
        layers: layers?,
        heads,
        kv_heads: Some(kv_heads),
        vocab_size: vocab_size?,
        max_seq_len: Some(context?),
        rope_theta: theta as f32,
        ffn_dim: Some(ffn?),
        tie_embeddings: tie?,
        norm_eps: norm_eps?,
        embedding_std: 0.02,
        linear_std: None,
        attention_impl: Default::default(),
        attention_block: DEFAULT_ATTENTION_BLOCK,
        head_dim: head_dim.filter(|&d| d * heads != d_model),
        qkv_bias,
        rope_scaling,
        hf_architecture: Some(architecture),
    };
    Some((model, context?))
}

/// RoPE's θ and scaling as transformers resolves them (`convert_rope_params_to_dict` and
/// `standardize_rope_params` in `modeling_rope_utils.py`): a legacy `rope_scaling` replaces
/// `rope_parameters`; θ is the dict's `rope_theta`, else the top-level one, else 10,000; the
/// type is `rope_type`, else the legacy `type`, else `default`. The default type reads θ alone
/// (other entries are ignored); `linear` reads `factor`; `llama3` reads `factor`,
/// `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings` (a top-level
/// key first, then the dict's, else `max_position_embeddings`); both scaled types read
/// `partial_rotary_factor`, which must be 1. Any other type is refused.
fn rope(
    map: &Map<String, Value>,
    context: usize,
    ignored: &mut Vec<String>,
) -> Result<(f64, Option<RopeScaling>)> {
    let present = |key: &str| map.get(key).filter(|v| !v.is_null());
    let empty = Value::Object(Map::new());
    let legacy = present("rope_scaling").filter(|v| v.as_object().is_none_or(|m| !m.is_empty()));
    let (key, params) = match (legacy, present("rope_parameters")) {
        (Some(v), current) => {
            if current.is_some() {
                ignored.push("rope_parameters".into());
            }
            ("rope_scaling", v)
        }
        (None, Some(v)) => ("rope_parameters", v),
        (None, None) => ("rope_parameters", &empty),
    };
    let params = params
        .as_object()
        .ok_or_else(|| anyhow!("`{key}` = {params} is not an object"))?;
    if let Some((layer, _)) = params.iter().find(|(_, v)| v.is_object()) {
        bail!(
            "`{key}.{layer}` is not supported: RoPE parameters that differ by layer type are not implemented"
        );
    }
    let get = |name: &str| params.get(name).filter(|v| !v.is_null());
    let theta = match get("rope_theta") {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| anyhow!("`{key}.rope_theta` = {v} is not a number"))?,
        None => match present("rope_theta") {
            Some(_) => number(map, "rope_theta")?,
            None => DEFAULT_THETA,
        },
    };
    if !(theta > 0.0 && theta <= f32::MAX as f64) {
        bail!(
            "RoPE θ (`{key}.rope_theta` or `rope_theta`) = {theta} must be positive and fit in f32"
        );
    }
    let kind = match get("rope_type").or(get("type")) {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| anyhow!("`{key}.rope_type` = {v} is not a string"))?,
    };
    let factor = |name: &str| -> Result<f64> {
        let v = get(name)
            .ok_or_else(|| anyhow!("`{key}.{name}` is missing (rope_type {kind:?} needs it)"))?;
        v.as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| anyhow!("`{key}.{name}` = {v} is not a positive number"))
    };
    let reads: &[&str] = match kind {
        "default" => &["rope_type", "type", "rope_theta"],
        "linear" => &[
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "partial_rotary_factor",
        ],
        "llama3" => &[
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
            "partial_rotary_factor",
        ],
        other => bail!(
            "`{key}.rope_type` = {other:?} is not supported: diffzoo implements the default, linear and llama3 RoPE"
        ),
    };
    ignored.extend(
        params
            .keys()
            .filter(|k| !reads.contains(&k.as_str()))
            .map(|k| format!("{key}.{k}")),
    );
    if kind == "default" {
        return Ok((theta, None));
    }
    let partial = get("partial_rotary_factor").or(present("partial_rotary_factor"));
    if let Some(v) = partial
        && v.as_f64() != Some(1.0)
    {
        bail!("`partial_rotary_factor` = {v} is not supported: diffzoo rotates whole heads (1.0)");
    }
    let scaling = match kind {
        "linear" => RopeScaling::Linear {
            factor: factor("factor")?,
        },
        _ => {
            let original = match present("original_max_position_embeddings") {
                Some(_) => count(map, "original_max_position_embeddings")?,
                None => match get("original_max_position_embeddings") {
                    Some(v) => v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                        anyhow!("`{key}.original_max_position_embeddings` = {v} is not a positive integer")
                    })? as usize,
                    None => context,
                },

            };
            RopeScaling::Llama3 {
                factor: factor("factor")?,
                low_freq_factor: factor("low_freq_factor")?,
                high_freq_factor: factor("high_freq_factor")?,
                original_max_seq_len: original,
            }
        }
    };
    scaling
        .validate()
        .map_err(|e| anyhow!("{}", e.replace("rope_scaling", key)))?;
    Ok((theta, Some(scaling)))
}

/// A sliding window changes attention only where it is shorter than the context: the window
/// covers the last `sliding_window` keys of each query, the whole context when it is at least
/// `max_position_embeddings` long. Mistral applies `sliding_window` to every layer (its
/// `layer_types` is not read); Qwen2, when `use_sliding_window`, to the layers `layer_types`
/// names, else to those from `max_window_layers` on, and to none without it. Both classes
/// default `sliding_window` to 4096 when the key is absent (`null` means no window).
fn sliding_window(
    map: &Map<String, Value>,
    architecture: Architecture,
    context: usize,
    layers: usize,
) -> Result<()> {
    let sliding_layers = match architecture {
        Architecture::Mistral => layers,
        Architecture::Qwen2 if boolean(map, "use_sliding_window")? == Some(true) => {
            match map.get("layer_types") {
                None | Some(Value::Null) => {
                    let from = match map.get("max_window_layers") {
                        None | Some(Value::Null) => 28,
                        Some(v) => v.as_u64().ok_or_else(|| {
                            anyhow!("`max_window_layers` = {v} is not a non-negative integer")
                        })? as usize,
                    };
                    layers.saturating_sub(from)
                }
                Some(Value::Array(types)) => {
                    let mut sliding = 0;
                    for (i, t) in types.iter().enumerate() {
                        match t.as_str() {
                            Some("full_attention") => {}
                            Some("sliding_attention") => sliding += 1,
                            _ => bail!(
                                "`layer_types[{i}]` = {t} is not supported: diffzoo implements full_attention (and sliding_attention with a window no shorter than the context)"
                            ),
                        }
                    }
                    sliding
                }
                Some(other) => bail!("`layer_types` = {other} is not a list"),
            }
        }
        _ => return Ok(()),
    };
    let window = match map.get("sliding_window") {
        None => Some(4096),
        Some(Value::Null) => None,
        Some(_) => Some(count(map, "sliding_window")?),
    };
    match window {
        Some(window) if sliding_layers > 0 && window < context => bail!(
            "`sliding_window` = {window}{} is not supported: it is shorter than `max_position_embeddings` = {context}, so {sliding_layers} layer(s) would attend to the last {window} positions only, and diffzoo attends to the whole context",
            if map.contains_key("sliding_window") {
                ""
            } else {
                " (transformers' default: the key is absent)"
            }
        ),
        _ => Ok(()),
    }
}

/// A boolean key: `None` when absent or null.
fn boolean(map: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| anyhow!("`{key}` = {v} is not a boolean")),
    }
}

/// The config.json transformers loads a model of `config` from, in `architecture`'s class.
pub fn write(
    architecture: Architecture,
    config: &ModelConfig,
    dtype: Dtype,
    eos: Option<u32>,
) -> Value {
    let theta = config.rope_theta as f64;
    let rope = match config.rope_scaling {
        None => json!({"rope_type": "default", "rope_theta": theta}),
        Some(RopeScaling::Linear { factor }) => {
            json!({"rope_type": "linear", "rope_theta": theta, "factor": factor})
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_seq_len,
        }) => json!({
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_seq_len,
        }),
    };
    let mut value = json!({
        "architectures": [architecture.class()],
        "model_type": architecture.model_type(),
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden(),
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads(),
        "head_dim": config.head_dim(),
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": theta,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": dtype.torch_name(),
        "use_cache": true,
    });
    match architecture {
        Architecture::Llama => {
            value["attention_bias"] = json!(false);
            value["mlp_bias"] = json!(false);
        }
        Architecture::DiffLlama => value["attention_bias"] = json!(false),
        Architecture::Mistral => value["sliding_window"] = Value::Null,
        Architecture::Qwen2 => {
            value["use_sliding_window"] = json!(false);
            value["sliding_window"] = Value::Null;
            value["max_window_layers"] = json!(config.layers);
        }
        Architecture::DiffzooV2 => {
            value["qkv_bias"] = json!(config.qkv_bias);
            value["auto_map"] = v2_auto_map();
        }
    }
    if let Some(eos) = eos {
        value["eos_token_id"] = json!(eos);
        value["bos_token_id"] = json!(eos);
    }
    value
}

/// The `auto_map` of a DIFF V2 export: transformers' classes from our modeling file.
fn v2_auto_map() -> Value {
    let module = super::V2_MODULE;
    json!({
        "AutoConfig": format!("{module}.DiffzooV2Config"),
        "AutoModelForCausalLM": format!("{module}.DiffzooV2ForCausalLM"),
    })
}

fn same(value: &Value, want: &str) -> bool {
    let want: Value = serde_json::from_str(want).expect("a JSON literal");
    match (value.as_f64(), want.as_f64()) {
        (Some(a), Some(b)) => a == b,
        _ => *value == want,
    }
}

fn string<'a>(map: &'a Map<String, Value>, key: &str) -> Result<&'a str> {
    map.get(key)
        .ok_or_else(|| anyhow!("no `{key}` key"))?
        .as_str()
        .ok_or_else(|| anyhow!("`{key}` = {} is not a string", map[key]))
}

fn count(map: &Map<String, Value>, key: &str) -> Result<usize> {
    let v = map.get(key).ok_or_else(|| anyhow!("no `{key}` key"))?;
    let limit = LIMITS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(usize::MAX, |(_, l)| *l);
    match v.as_u64() {
        Some(n) if n > 0 && n as usize <= limit => Ok(n as usize),
        Some(n) if n > 0 => {
            bail!("`{key}` = {n} exceeds the largest value diffzoo accepts, {limit}")
        }
        _ => bail!("`{key}` = {v} is not a positive integer"),
    }
}

fn number(map: &Map<String, Value>, key: &str) -> Result<f64> {
    let v = map.get(key).ok_or_else(|| anyhow!("no `{key}` key"))?;
    match v.as_f64() {
        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => bail!("`{key}` = {v} is not a positive number"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffzoo_models::AttentionKind;

    fn llama() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false,
            "transformers_version": "5.24.0"
        })
    }

    #[test]
    fn a_llama_config_becomes_the_baseline_with_every_value_kept() {
        let c = parse(&llama()).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        let m = &c.model;
        assert_eq!(m.attention, AttentionKind::Transformer);
        assert_eq!(
            (m.d_model, m.layers, m.heads, m.kv_heads),
            (64, 2, 4, Some(2))
        );
        assert_eq!(
            (m.vocab_size, m.ffn_dim, m.max_seq_len),
            (300, Some(96), Some(128))
        );
        assert_eq!((m.rope_theta, m.norm_eps), (500000.0, 1e-6));
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        let cases: [(&str, Value, &str); 12] = [
            (
                "rope_parameters",
                json!({"rope_type": "yarn", "factor": 8.0}),
                "rope_parameters.rope_type",
            ),
            (
                "rope_parameters",
                json!({"rope_type": "llama3", "factor": 8.0, "partial_rotary_factor": 0.5,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
                "partial_rotary_factor",
            ),
            (
                "rope_parameters",
                json!({"rope_type": "llama3", "factor": 8.0}),
                "rope_parameters.low_freq_factor",
            ),
            ("attention_bias", json!(true), "attention_bias"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            (
                "quantization_config",
                json!({"bits": 4}),
                "quantization_config",
            ),
            (
                "architectures",
                json!(["GemmaForCausalLM"]),
                "GemmaForCausalLM",
            ),
            (
                "auto_map",
                json!({"AutoModelForCausalLM": "modeling_x.X"}),
                "auto_map",
            ),
            (
                "max_position_embeddings",
                json!(1u64 << 40),
                "max_position_embeddings",
            ),
            ("hidden_size", json!(1u64 << 40), "hidden_size"),
            ("num_key_value_heads", json!(3), "num_key_value_heads"),
            ("rope_theta", json!(1e300), "rope_theta"),
        ];
        for (key, value, named) in cases {
            let mut config = llama();
            config[key] = value;
            if key == "rope_theta" {
                config.as_object_mut().unwrap().remove("rope_parameters");
            }
            let err = parse(&config).unwrap_err().to_string();
            assert!(err.contains(named), "{key}: {err}");
        }
    }

    #[test]
    fn a_refusal_names_every_key_it_cannot_honour_at_once() {
        let mut config = llama();
        config["attention_bias"] = json!(true);
        config["hidden_act"] = json!("gelu");
        config["quantization_config"] = json!({"bits": 4});
        let err = parse(&config).unwrap_err().to_string();
        for key in [
            "attention_bias",
            "hidden_act",
            "quantization_config",
            "3 keys",
        ] {
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn keys_transformers_does_not_read_are_accepted_and_listed() {
        let mut config = llama();
        // What a GGUF-converted checkpoint and hub files carry.
        for (key, value) in [
            ("_model_name_or_path", json!("/tmp/gguf")),
            ("unk_token_id", json!(0)),
            ("is_llama_config", json!(true)),
            ("rope_interleaved", json!(true)),
            (
                "transformers.js_config",
                json!({"kv_cache_dtype": "float16"}),
            ),
            ("_attn_implementation_autoset", json!(true)),
            ("pretraining_tp", json!(2)),
            ("max_sequence_length", json!(2048)),
            ("rope_scaling", Value::Null),
        ] {
            config[key] = value;
        }
        // Read, and changing nothing for a loaded checkpoint: not listed.
        config["initializer_range"] = json!(0.5);
        config["bos_token_id"] = json!(1);
        let read = parse(&config).unwrap();
        assert_eq!(read.model, parse(&llama()).unwrap().model);
        assert_eq!(
            read.ignored,
            [
                "_attn_implementation_autoset",
                "_model_name_or_path",
                "is_llama_config",
                "max_sequence_length",
                "pretraining_tp",
                "rope_interleaved",
                "transformers.js_config",
                "unk_token_id",
            ]
        );
        // A key of another class's: Qwen2 reads no `attention_bias` (its q/k/v have biases).
        let mut qwen = llama();
        qwen["architectures"] = json!(["Qwen2ForCausalLM"]);
        qwen["model_type"] = json!("qwen2");
        qwen["attention_bias"] = json!(false);
        let read = parse(&qwen).unwrap();
        assert!(read.model.qkv_bias);
        assert_eq!(read.ignored, ["attention_bias"]);
    }

    #[test]
    fn rope_scaling_sliding_windows_and_head_dim_are_read_as_transformers_reads_them() {
        let mut config = llama();
        config["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        config["head_dim"] = json!(32);
        let m = parse(&config).unwrap().model;
        assert_eq!(m.head_dim, Some(32));
        assert_eq!(m.rope_theta, 5e5);
        assert_eq!(
            m.rope_scaling,
            Some(RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_seq_len: 64
            })
        );
        // The legacy spelling: `rope_scaling` with `type`, θ at the top level; the pretraining
        // context defaults to `max_position_embeddings`.
        let mut legacy = llama();
        legacy.as_object_mut().unwrap().remove("rope_parameters");
        legacy["rope_theta"] = json!(1e4);
        legacy["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        let m = parse(&legacy).unwrap().model;
        assert_eq!(
            (m.rope_theta, m.rope_scaling),
            (1e4, Some(RopeScaling::Linear { factor: 2.0 }))
        );
        // A head_dim equal to hidden / heads is no head_dim of its own.
        let mut same = llama();
        same["head_dim"] = json!(16);
        assert_eq!(parse(&same).unwrap().model.head_dim, None);
        // Mistral: a window no shorter than the context changes nothing; a shorter one is refused.
        let mut mistral = llama();
        mistral["architectures"] = json!(["MistralForCausalLM"]);
        mistral["model_type"] = json!("mistral");
        for (window, ok) in [
            (Value::Null, true),
            (json!(128), true),
            (json!(4096), true),
            (json!(64), false),
        ] {
            mistral["sliding_window"] = window.clone();
            let read = parse(&mistral);
            assert_eq!(read.is_ok(), ok, "{window}: {read:?}");
            if !ok {
                assert!(read.unwrap_err().to_string().contains("sliding_window"));
            }
        }
        // Qwen2: the window applies only with use_sliding_window, from max_window_layers on.
        let mut qwen = llama();
        qwen["architectures"] = json!(["Qwen2ForCausalLM"]);
        qwen["model_type"] = json!("qwen2");
        qwen["sliding_window"] = json!(32);
        for (use_window, from, ok) in [(false, 0, true), (true, 2, true), (true, 1, false)] {
            qwen["use_sliding_window"] = json!(use_window);
            qwen["max_window_layers"] = json!(from);
            assert_eq!(parse(&qwen).is_ok(), ok, "{use_window} {from}");
        }
        qwen["layer_types"] = json!(["full_attention", "full_attention"]);
        assert!(parse(&qwen).is_ok());
        qwen["layer_types"] = json!(["full_attention", "chunked_attention"]);
        assert!(
            parse(&qwen)
                .unwrap_err()
                .to_string()
                .contains("layer_types[1]")
        );
    }

    #[test]
    fn written_configs_read_back_to_the_same_model() {
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_seq_len: 32,
        };
        for architecture in Architecture::ALL {
            let kind = architecture.kind();
            let bias = architecture == Architecture::Qwen2;
            for (head_dim, scaling) in [(None, None), (Some(24), Some(llama3))] {
                let config = ModelConfig::new(kind, 64, 3, 4, 300, 96)
                    .with_kv_heads(Some(2))
                    .with_rope_theta(20000.0)
                    .with_norm_eps(1e-6)
                    .with_ffn_dim(Some(100))
                    .with_tie_embeddings(true)
                    .with_head_dim(head_dim)
                    .with_qkv_bias(bias)
                    .with_rope_scaling(scaling);
                let back = parse(&write(architecture, &config, Dtype::Bf16, Some(3))).unwrap();
                assert_eq!(back.architecture, architecture);
                assert!(back.ignored.is_empty(), "{:?}", back.ignored);
                assert_eq!(
                    back.model.config(0),
                    config.with_embedding_std(0.02),
                    "{architecture:?}"
                );
            }
        }
    }
}
