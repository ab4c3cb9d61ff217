//! `config.json` ↔ the recipe's model section. Reading is strict: every key is honoured,
//! checked to hold the one value diffzoo implements, or known to be metadata; any other key is
//! an error naming it.

use super::{Architecture, Dtype};
use crate::recipe::ModelSection;
use anyhow::{Context, Result, anyhow, bail};
use diffzoo_models::{DEFAULT_ATTENTION_BLOCK, ModelConfig};
use serde_json::{Map, Value, json};
use std::path::Path;

/// Keys that describe how the checkpoint was made, trained or is sampled from, not the function
/// its forward pass computes (transformers' modeling code for Llama and DiffLlama reads none of
/// them; `pretraining_tp` only split transformers 4's matmuls into slices of the same product).
const METADATA: &[&str] = &[
    "_name_or_path",
    "_attn_implementation_autoset",
    "transformers_version",
    "transformers.js_config",
    "torch_dtype",
    "dtype",
    "use_bfloat16",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "initializer_range",
    "lambda_std_dev",
    "pretraining_tp",
    "is_llama_config",
    "max_sequence_length",
    "tokenizer_class",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "prefix",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "return_dict",
    "return_dict_in_generate",
    "torchscript",
    "tf_legacy_loss",
    "tie_encoder_decoder",
    "is_decoder",
    "unsloth_version",
    // Generation defaults (transformers 4 wrote them into config.json).
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "num_return_sequences",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
];

/// Keys that must hold the value diffzoo implements (or be null).
const FIXED: &[(&str, &str)] = &[
    ("hidden_act", "\"silu\""),
    ("attention_bias", "false"),
    ("mlp_bias", "false"),
    ("attention_dropout", "0.0"),
    ("sliding_window", "null"),
    ("rope_interleaved", "false"),
    ("is_encoder_decoder", "false"),
    ("add_cross_attention", "false"),
    ("chunk_size_feed_forward", "0"),
    ("pruned_heads", "{}"),
];

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
}

/// Reads and checks `config.json`.
pub fn read(path: &Path) -> Result<HfConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    parse(&value).map_err(|e| anyhow!("{}: {e}", path.display()))
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
    for &(key, want) in FIXED {
        if let Some(v) = map.get(key)
            && !v.is_null()
            && !same(v, want)
        {
            bail!("`{key}` = {v} is not supported: diffzoo implements only {key} = {want}");
        }
    }
    if let Some(auto_map) = map.get("auto_map")
        && !(architecture == Architecture::DiffzooV2 && *auto_map == v2_auto_map())
    {
        bail!(
            "`auto_map` = {auto_map} points transformers at custom code for {}: its computation is unknown to diffzoo, so it is refused",
            architecture.class()
        );
    }
    let d_model = count(map, "hidden_size")?;
    let heads = count(map, "num_attention_heads")?;
    let kv_heads = match map.get("num_key_value_heads") {
        None | Some(Value::Null) => heads,
        Some(_) => count(map, "num_key_value_heads")?,
    };
    if heads == 0 || !d_model.is_multiple_of(heads) {
        bail!("`num_attention_heads` = {heads} does not divide `hidden_size` = {d_model}");
    }
    if !heads.is_multiple_of(kv_heads) {
        bail!("`num_key_value_heads` = {kv_heads} does not divide `num_attention_heads` = {heads}");
    }
    if !(d_model / heads).is_multiple_of(2) {
        bail!(
            "hidden_size / num_attention_heads = {} must be even: RoPE turns pairs",
            d_model / heads
        );
    }
    if architecture == Architecture::DiffLlama && !(heads % 2 == 0 && kv_heads % 2 == 0) {
        bail!(
            "`num_attention_heads` = {heads} and `num_key_value_heads` = {kv_heads} must be even: DiffLlama pairs heads and splits values in halves"
        );
    }
    if let Some(v) = map.get("head_dim")
        && !v.is_null()
    {
        let head_dim = count(map, "head_dim")?;
        if head_dim != d_model / heads {
            bail!(
                "`head_dim` = {head_dim} differs from hidden_size / num_attention_heads = {}: diffzoo's heads are hidden_size / heads wide",
                d_model / heads
            );
        }
    }
    let context = count(map, "max_position_embeddings")?;
    let model = ModelSection {
        attention: architecture.kind(),
        d_model,
        layers: count(map, "num_hidden_layers")?,
        heads,
        kv_heads: Some(kv_heads),
        vocab_size: count(map, "vocab_size")?,
        max_seq_len: Some(context),
        rope_theta: rope_theta(map)? as f32,
        ffn_dim: Some(count(map, "intermediate_size")?),
        tie_embeddings: match map.get("tie_word_embeddings") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| anyhow!("`tie_word_embeddings` = {v} is not a boolean"))?,
        },
        norm_eps: number(map, "rms_norm_eps")?,
        embedding_std: 0.02,
        linear_std: None,
        attention_impl: Default::default(),
        attention_block: DEFAULT_ATTENTION_BLOCK,
    };
    const HONOURED: &[&str] = &[
        "architectures",
        "auto_map",
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
    ];
    for key in map.keys() {
        let known = HONOURED.contains(&key.as_str())
            || METADATA.contains(&key.as_str())
            || FIXED.iter().any(|(k, _)| k == key)
            || key == "tie_word_embeddings";
        if !known {
            bail!(
                "key `{key}` = {} is not supported: diffzoo cannot honour it, so it refuses the checkpoint rather than ignore it",
                map[key]
            );
        }
    }
    Ok(HfConfig {
        architecture,
        model,
        context,
    })
}

/// RoPE's θ from `rope_parameters` (transformers 5) or `rope_theta` with `rope_scaling`
/// (older files). Only the default (unscaled) RoPE is implemented.
fn rope_theta(map: &Map<String, Value>) -> Result<f64> {
    let mut theta = match map.get("rope_theta") {
        Some(v) if !v.is_null() => Some(number(map, "rope_theta")?),
        _ => None,
    };
    for key in ["rope_parameters", "rope_scaling"] {
        let Some(params) = map.get(key).filter(|v| !v.is_null()) else {
            continue;
        };
        let params = params
            .as_object()
            .ok_or_else(|| anyhow!("`{key}` = {params} is not an object"))?;
        for name in ["rope_type", "type"] {
            if let Some(v) = params.get(name)
                && v.as_str() != Some("default")
            {
                bail!(
                    "`{key}.{name}` = {v} is not supported: diffzoo implements only the default (unscaled) RoPE"
                );
            }
        }
        for (name, v) in params {
            match name.as_str() {
                "rope_type" | "type" => {}
                "rope_theta" => {
                    let t = v
                        .as_f64()
                        .ok_or_else(|| anyhow!("`{key}.rope_theta` = {v} is not a number"))?;
                    if let Some(old) = theta.filter(|&old| old != t) {
                        bail!("`{key}.rope_theta` = {t} disagrees with `rope_theta` = {old}");
                    }
                    theta = Some(t);
                }
                _ => bail!(
                    "`{key}.{name}` = {v} is not supported: diffzoo implements only the default (unscaled) RoPE"
                ),
            }
        }
    }
    let theta = theta.unwrap_or(10_000.0);
    if !(theta > 0.0 && theta <= f32::MAX as f64) {
        bail!("RoPE θ (`rope_theta`) = {theta} must be positive and fit in f32");
    }
    Ok(theta)
}

/// The config.json transformers loads a model of `config` from.
pub fn write(
    architecture: Architecture,
    config: &ModelConfig,
    dtype: Dtype,
    eos: Option<u32>,
) -> Value {
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
        "rope_theta": config.rope_theta as f64,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta as f64},
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "attention_dropout": 0.0,
        "torch_dtype": dtype.torch_name(),
        "use_cache": true,
    });
    if let Some(eos) = eos {
        value["eos_token_id"] = json!(eos);
        value["bos_token_id"] = json!(eos);
    }
    if architecture == Architecture::DiffzooV2 {
        value["auto_map"] = v2_auto_map();
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
        let cases: [(&str, Value, &str); 13] = [
            (
                "rope_parameters",
                json!({"rope_type": "llama3", "factor": 8.0}),
                "rope_parameters.rope_type",
            ),
            ("attention_bias", json!(true), "attention_bias"),
            ("head_dim", json!(32), "head_dim"),
            ("sliding_window", json!(4096), "sliding_window"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            (
                "quantization_config",
                json!({"bits": 4}),
                "quantization_config",
            ),
            (
                "architectures",
                json!(["Qwen2ForCausalLM"]),
                "Qwen2ForCausalLM",
            ),
            (
                "auto_map",
                json!({"AutoModelForCausalLM": "modeling_x.X"}),
                "auto_map",
            ),
            ("rope_interleaved", json!(true), "rope_interleaved"),
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
            let err = parse(&config).unwrap_err().to_string();
            assert!(err.contains(named), "{key}: {err}");
        }
    }

    #[test]
    fn keys_hub_checkpoints_carry_that_change_nothing_are_accepted() {
        let mut config = llama();
        for (key, value) in [
            ("is_llama_config", json!(true)),
            ("rope_interleaved", json!(false)),
            (
                "transformers.js_config",
                json!({"kv_cache_dtype": "float16"}),
            ),
            ("_attn_implementation_autoset", json!(true)),
            ("pretraining_tp", json!(2)),
            ("id2label", json!({"0": "LABEL_0"})),
            ("max_sequence_length", json!(2048)),
            ("rope_scaling", Value::Null),
        ] {
            config[key] = value;
        }
        assert_eq!(parse(&config).unwrap(), parse(&llama()).unwrap());
    }

    #[test]
    fn written_configs_read_back_to_the_same_model() {
        for kind in AttentionKind::ALL {
            let config = ModelConfig::new(kind, 64, 3, 4, 300, 96)
                .with_kv_heads(Some(2))
                .with_rope_theta(20000.0)
                .with_norm_eps(1e-6)
                .with_ffn_dim(Some(100))
                .with_tie_embeddings(true);
            let arch = Architecture::of(kind);
            let back = parse(&write(arch, &config, Dtype::Bf16, Some(3))).unwrap();
            assert_eq!(back.architecture, arch);
            assert_eq!(
                back.model.config(0),
                config.with_embedding_std(0.02),
                "{kind}"
            );
        }
    }
}
