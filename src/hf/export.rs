//! `diffzoo export hf RUN --out DIR`: a run's model as a directory transformers loads with
//! `AutoModelForCausalLM.from_pretrained(DIR)` (DIFF V2 with `trust_remote_code=True`): weights
//! (sharded above `--max-shard-size`, with the index file), `config.json`,
//! `generation_config.json`, and the run's tokenizer as `tokenizer.json` with
//! `tokenizer_config.json` (those an imported run brought, with its chat template, as they came).
//! The class is the recipe's `model.hf_architecture` (an import's own), else the variant's. Tensors are converted one at a time as they are written; the
//! directory is written under a temporary name and renamed at the end.

use super::{
    Architecture, CONFIG, Dtype, Entry, FloatFormat, GENERATION_CONFIG, Pending, TOKENIZER,
    V2_MODULE, V2_SOURCE, WEIGHTS, WEIGHTS_INDEX, config, entries, write_file, write_safetensors,
};
use crate::recipe::Recipe;
use crate::{device, layout, run};
use anyhow::{Context, Result, anyhow, bail};
use burn::store::burn_pack::{self, DType};
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot};
use diffzoo_models::{AttentionKind, Model, ModelConfig};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// Run directory (its final model, else its newest complete checkpoint).
    pub run: std::path::PathBuf,
    /// The directory to write (must not exist).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Float format of the written weights: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Largest weights file before sharding, as transformers counts it (and its default):
    /// bytes, or with a unit (KB, MB, GB: powers of 1000; KiB, MiB, GiB: of 1024).
    #[arg(long, default_value = "50GB")]
    pub max_shard_size: String,
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let dtype = Dtype::parse(&args.dtype)?;
    let limit = parse_size(&args.max_shard_size)?;
    let staging = super::staging(&args.out)?;
    let result = export(&args.run, &staging, dtype, limit);
    if result.is_err() {
        std::fs::remove_dir_all(&staging).ok();
    }
    let (architecture, weights, shards) = result?;
    std::fs::rename(&staging, &args.out)
        .with_context(|| format!("renaming {} to {}", staging.display(), args.out.display()))?;
    println!(
        "exported {weights} of {} as {} ({}, {shards} weights file{}) into {}",
        args.run.display(),
        architecture.class(),
        dtype.torch_name(),
        if shards == 1 { "" } else { "s" },
        args.out.display()
    );
    if architecture == Architecture::DiffzooV2 {
        println!(
            "DIFF V2 has no class in transformers: load it with trust_remote_code=True ({V2_MODULE}.py)"
        );
    }
    Ok(())
}

/// Writes the export into `staging`: the architecture, which weights, and how many files.
fn export(
    run_dir: &Path,
    staging: &Path,
    dtype: Dtype,
    limit: u64,
) -> Result<(Architecture, layout::Weights, usize)> {
    let recipe = run::run_recipe(run_dir)?;
    let config = recipe.model_config();
    let device = device::parse("cpu")?;
    let (model, weights) = run::load_model(run_dir, &recipe, &device)?;
    let architecture = recipe.model.architecture();
    // Checked before anything is written: a class that cannot hold the model would drop weights.
    check_exportable(run_dir, &recipe, &config, &weights, architecture)?;
    std::fs::create_dir_all(staging).with_context(|| format!("creating {}", staging.display()))?;
    let count = write_weights(staging, &model, &config, dtype, limit)?;
    write_configs(run_dir, staging, architecture, &config, dtype)?;
    Ok((architecture, weights, count))
}

/// Refuses what no transformers class would compute as the run does: `weights` inside a λ
/// warm-up, a variant the recipe's class cannot hold, a Llama whose width the heads do not
/// divide.
fn check_exportable(
    run_dir: &Path,
    recipe: &Recipe,
    config: &ModelConfig,
    weights: &layout::Weights,
    architecture: Architecture,
) -> Result<()> {
    if let Some(n) = recipe.training.warmup_steps() {
        let step = layout::weights_step(run_dir, weights, recipe.total_steps())?;
        if step < n {
            bail!(
                "{}: its {weights} is at step {step} of a {n}-step λ warm-up (`training.lambda_warmup`) and computes with λ scaled by {}, which no transformers class holds: export a run fine-tuned past its warm-up",
                run_dir.display(),
                recipe.training.lambda_scale(step)
            );
        }
    }
    architecture
        .holds(config.attention, config.qkv_bias)
        .map_err(|e| anyhow!("{}: {e}", run_dir.display()))?;
    if architecture == Architecture::Llama && !config.d_model.is_multiple_of(config.heads) {
        bail!(
            "{}: {} requires hidden_size = {} to be a multiple of num_attention_heads = {} (its config refuses it even with head_dim); MistralForCausalLM has no such rule: set model.hf_architecture = \"MistralForCausalLM\" for a baseline",
            run_dir.display(),
            architecture.class(),
            config.d_model,
            config.heads
        );
    }
    Ok(())
}

/// Writes `model`'s weights as transformers names them into `staging`, in files of at most
/// `limit` bytes (with the index file where there are several); returns how many files.
fn write_weights(
    staging: &Path,
    model: &Model,
    config: &ModelConfig,
    dtype: Dtype,
    limit: u64,
) -> Result<usize> {
    let ours: BTreeMap<String, burn_pack::Tensor> = model
        .collect(None, Some(Box::new(BurnToPyTorchAdapter)), true)
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let tensors: Vec<Entry> = entries(config)
        .into_iter()
        .filter(|e| e.hf.is_some())
        .collect();
    let sizes: Vec<u64> = tensors.iter().map(|e| e.bytes(dtype) as u64).collect();
    let shards = shard(&sizes, limit);
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, members) in shards.iter().enumerate() {
        let file = if count == 1 {
            WEIGHTS.to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let pending: Vec<Pending> = members
            .iter()
            .map(|&m| {
                let entry = &tensors[m];
                let ours = &ours;
                Pending {
                    name: entry.hf.clone().expect("exported"),
                    shape: entry.shape.clone(),
                    bytes: Box::new(move || Ok(dtype.bytes(&hf_values(entry, ours, config)?))),
                }
            })
            .collect();
        write_safetensors(
            &staging.join(&file),
            &pending,
            dtype,
            json!({"format": "pt"}),
        )?;
        for t in pending {
            weight_map.insert(t.name, file.clone());
        }
    }
    if count > 1 {
        let index = json!({
            "metadata": {"total_size": sizes.iter().sum::<u64>()},
            "weight_map": weight_map,
        });
        write_json(&staging.join(WEIGHTS_INDEX), &index)?;
    }
    Ok(count)
}

/// Writes `config.json`, the generation config and the run's tokenizer with its companions (or
/// defaults) into `staging`, and DIFF V2's modelling code for `trust_remote_code`.
fn write_configs(
    run_dir: &Path,
    staging: &Path,
    architecture: Architecture,
    config: &ModelConfig,
    dtype: Dtype,
) -> Result<()> {
    let tokenizer_path = run_dir.join(layout::TOKENIZER);
    let tokenizer = if tokenizer_path.is_file() {
        Some(run::run_tokenizer(run_dir)?)
    } else {
        None
    };
    let eos = tokenizer.as_ref().map(|t| t.eot_id());
    write_json(
        &staging.join(CONFIG),
        &config::write(architecture, config, dtype, eos),
    )?;
    // What the run's tokenizer came with (an import's chat template, special tokens and
    // end-of-turn ids) goes out as it came in; a run trained here gets the defaults below.
    let companions = match &tokenizer {
        Some(_) => layout::copy_companions(run_dir, staging)?,
        None => Vec::new(),
    };
    if !companions.contains(&GENERATION_CONFIG) {
        let mut generation = json!({});
        if let Some(eos) = eos {
            generation = json!({"bos_token_id": eos, "eos_token_id": eos});
        }
        write_json(&staging.join(GENERATION_CONFIG), &generation)?;
    }
    if let Some(tokenizer) = &tokenizer {
        write_file(&staging.join(TOKENIZER), tokenizer.json())?;
        let eot = tokenizer.eot_token();
        if !companions.contains(&crate::chat::TOKENIZER_CONFIG) {
            write_json(
                &staging.join(crate::chat::TOKENIZER_CONFIG),
                &json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": eot,
                    "eos_token": eot,
                    "model_max_length": config.max_seq_len,
                    "clean_up_tokenization_spaces": false,
                }),
            )?;
        }
    }
    if architecture == Architecture::DiffzooV2 {
        write_file(&staging.join(format!("{V2_MODULE}.py")), V2_SOURCE)?;
    }
    Ok(())
}

/// One transformers tensor computed from ours: DIFF V1's subln folded into o_proj's columns
/// (`o_proj·diag(tile(subln))`, exact up to one rounding per weight), rows put in transformers'
/// order.
fn hf_values(
    entry: &Entry,
    ours: &BTreeMap<String, burn_pack::Tensor>,
    config: &ModelConfig,
) -> Result<Vec<f32>> {
    let mut values = floats(ours, &entry.ours)?;
    if config.attention == AttentionKind::Diff && entry.ours.ends_with("attn.o_proj.weight") {
        let subln = floats(ours, &entry.ours.replace("o_proj.weight", "subln.weight"))?;
        let cols = entry.shape[1];
        for (i, w) in values.iter_mut().enumerate() {
            *w *= subln[(i % cols) % subln.len()];
        }
    }
    Ok(match &entry.rows {
        Some(rows) => {
            super::scatter_rows(&values, &rows.order(), entry.shape.get(1).map_or(1, |&c| c))
        }
        None => values,
    })
}

/// Our tensor `name` as f32 values.
fn floats(ours: &BTreeMap<String, burn_pack::Tensor>, name: &str) -> Result<Vec<f32>> {
    let tensor = ours
        .get(name)
        .ok_or_else(|| anyhow!("the model has no tensor `{name}`"))?;
    let format = match tensor.dtype {
        DType::F32 => FloatFormat::F32,
        DType::BF16 => FloatFormat::Bf16,
        DType::F16 => FloatFormat::F16,
        other => bail!("tensor `{name}` is {other:?}: only f32, bf16 and f16 are exported"),
    };
    let bytes = tensor
        .to_bytes()
        .map_err(|e| anyhow!("reading tensor `{name}`: {e}"))?;
    Ok(super::decode_floats(&bytes, format))
}

/// Groups tensors of `sizes` bytes, in order, into files of at most `limit` bytes (a larger
/// tensor gets a file of its own), as transformers shards.
fn shard(sizes: &[u64], limit: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0;
    for (i, &size) in sizes.iter().enumerate() {
        if shards.last().is_some_and(|s| !s.is_empty()) && used + size > limit {
            shards.push(Vec::new());
            used = 0;
        }
        shards.last_mut().expect("one shard").push(i);
        used += size;
    }
    shards
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    write_file(path, serde_json::to_string_pretty(value)? + "\n")
}

/// `5GB`, `500MB`, `100KiB` or plain bytes.
fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        _ => bail!("--max-shard-size `{text}`: the unit must be B, KB, MB, GB, KiB, MiB or GiB"),
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 => n
            .checked_mul(scale)
            .ok_or_else(|| anyhow!("--max-shard-size `{text}` is too large")),
        _ => bail!("--max-shard-size `{text}` is not a positive size such as 5GB"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_transformers_writes_them() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("100KB").unwrap(), 100_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        for bad in ["", "0GB", "5XB", "-1", "GB", "1.5GB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn shards_fill_in_order_and_a_large_tensor_stands_alone() {
        assert_eq!(shard(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
        assert_eq!(shard(&[2, 20, 2, 2], 8), vec![vec![0], vec![1], vec![2, 3]]);
        assert_eq!(shard(&[1, 1], 100), vec![vec![0, 1]]);
    }
}
