//! Reading a run directory (its layout: [`crate::layout`]): its recipe, tokenizer, data, metrics
//! and model, and writing its final model.

use crate::device;
use crate::layout::{
    CHECKPOINTS, FINAL_MODEL, FINAL_SAFETENSORS, METRICS, RECIPE, SWEEP_PLAN, TOKENIZER, Weights,
    find_weights, run_seeds, weights_step,
};
use crate::recipe::{self, Recipe};
use crate::train::checkpoint;
use crate::train::step::Trainee;
use anyhow::{Context, Result, anyhow, bail};
use burn::module::{Module, ModuleVisitor, Param};
use burn::store::ModuleRecord;
use burn::tensor::{DType, Device, Tensor};
use diffzoo_datasets::corpus::{embedded_shards, embedded_tokenizer};
use diffzoo_datasets::shards::Shards;
use diffzoo_datasets::{Split, TextTokenizer, TokenWindows, corpus};
use diffzoo_models::{Model, ModelConfig, compute_copy};
use std::path::{Path, PathBuf};

/// The directory whose [`crate::layout::COMPANIONS`] go with the recipe's tokenizer: that of a
/// `data.tokenizer` file, or the shard directory; none for the BPE trained here.
pub fn tokenizer_home(recipe: &Recipe) -> Option<PathBuf> {
    let data = &recipe.data;
    if data.corpus != corpus::EMBEDDED {
        return Some(PathBuf::from(&data.corpus));
    }
    match data.tokenizer.as_deref() {
        None | Some("bpe") => None,
        Some(path) => Path::new(path).parent().map(Path::to_path_buf),
    }
}

/// What a run directory says of itself: one row of a sweep's summary.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunSummary {
    pub recipe: String,
    pub attention: String,
    pub params: u64,
    pub params_paper: u64,
    pub tokens: u64,
    pub validation_loss: Option<f64>,
    pub wall_sec: Option<f64>,
    pub status: String,
    /// `training.seed` of a sweep over seeds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

/// Summarises a run directory (finished or not).
pub fn summarize(run_dir: &Path, name: &str) -> Result<RunSummary> {
    let recipe: Recipe = run_recipe(run_dir)?;
    let derived = recipe.derived();
    let records = metrics_records(run_dir);
    let validation_loss = last_validation_loss(&records);
    let status = if run_dir.join(FINAL_MODEL).exists() {
        "finished"
    } else {
        "incomplete"
    };
    Ok(RunSummary {
        recipe: name.to_string(),
        attention: recipe.model.attention.to_string(),
        params: derived.params_total,
        params_paper: derived.params_paper,
        tokens: derived.tokens,
        validation_loss,
        wall_sec: records.last().and_then(|r| r["elapsed_sec"].as_f64()),
        status: status.into(),
        seed: None,
    })
}

/// The records of a run's `metrics.jsonl` (none when it has no log; unreadable lines skipped).
pub fn metrics_records(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join(METRICS))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The last validation loss among a run's metrics records.
pub fn last_validation_loss(records: &[serde_json::Value]) -> Option<f64> {
    records
        .iter()
        .rev()
        .find(|r| r["split"] == "validation")
        .and_then(|r| r["loss"].as_f64())
}

/// The recipe's tokenizer and token shards (the embedded corpus is prepared and cached on
/// first use). Errors name the recipe key at fault.
pub fn open_data(recipe: &Recipe) -> Result<(TextTokenizer, Shards)> {
    let data = &recipe.data;
    if data.corpus == corpus::EMBEDDED {
        let cache = diffzoo_datasets::cache_dir();
        let tokenizer = match data.tokenizer.as_deref() {
            Some("bpe") => embedded_tokenizer(recipe.model.vocab_size, &cache).with_context(
                || {
                    format!(
                        "`model.vocab_size` = {} (the size of the BPE trained for `data.tokenizer` = \"bpe\")",
                        recipe.model.vocab_size
                    )
                },
            )?,
            Some(path) => TextTokenizer::from_file(Path::new(path))
                .with_context(|| format!("`data.tokenizer` = {path:?}"))?,
            None => bail!("`data.tokenizer` is required with the embedded corpus"),
        };
        let shards = embedded_shards(&tokenizer, &cache)?;
        Ok((tokenizer, shards))
    } else {
        let key = || format!("`data.corpus` = {:?}", data.corpus);
        let shards = Shards::open(Path::new(&data.corpus)).with_context(key)?;
        let tokenizer = shards.tokenizer().with_context(key)?;
        Ok((tokenizer, shards))
    }
}

/// The training windows of one split of `shards`: plain windows of `seq_len + 1` tokens, or
/// one conversation each for conversation shards, whose longest conversation must fit.
pub fn windows(shards: &Shards, split: Split, seq_len: usize) -> Result<TokenWindows> {
    let tokens = shards.tokens(split)?;
    let Some(flags) = shards.flags(split)? else {
        return Ok(TokenWindows::new(tokens, seq_len));
    };
    let longest = shards
        .manifest
        .conversations
        .as_ref()
        .map_or(0, |c| c.longest);
    if longest > seq_len as u64 + 1 {
        bail!(
            "{}: its longest conversation has {longest} tokens, longer than a window of `data.seq_len` = {seq_len} (+1) tokens: set data.seq_len to at least {} (and model.max_seq_len if it is set), or prepare the data with --context {seq_len}, which skips longer conversations",
            shards.dir.display(),
            longest - 1
        );
    }
    Ok(TokenWindows::conversations(tokens, flags, seq_len))
}

/// A run directory's recipe.
pub fn run_recipe(run: &Path) -> Result<Recipe> {
    let path = run.join(RECIPE);
    if !path.exists() {
        let seeds = run_seeds(run);
        if let Some(first) = seeds.first() {
            let names: Vec<String> = seeds
                .iter()
                .filter_map(|s| Some(s.file_name()?.to_string_lossy().into_owned()))
                .collect();
            bail!(
                "{} is a directory of runs over seeds ({}): this command takes one run, such as {}",
                run.display(),
                names.join(", "),
                first.display()
            );
        }
        bail!("{} is not a run directory (no {RECIPE})", run.display());
    }
    recipe::from_run_file(&path)
}

/// The run's tokenizer.
pub fn run_tokenizer(run: &Path) -> Result<TextTokenizer> {
    let path = run.join(TOKENIZER);
    if !path.exists() {
        bail!(
            "{}: no {TOKENIZER}: only `eval ppl --tokens` and `export hf` work on a run without one (an import of a checkpoint that had none)",
            run.display()
        );
    }
    Ok(TextTokenizer::from_file(&path)?)
}

/// The run's final model, or its newest verified checkpoint when training has not finished, as
/// it computes at its step (λ scaled during a warm-up: [`lambda_scale`]).
pub fn load_model(run: &Path, recipe: &Recipe, device: &Device) -> Result<(Model, Weights)> {
    let (model, weights) = load_weights(run, &recipe.model_config(), device)?;
    let scale = lambda_scale(run, recipe, &weights)?;
    Ok((model.with_lambda_scale(scale), weights))
}

/// The dtype a loaded model keeps its weight matrices in (`--dtype`); it computes in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    F32,
    /// Half the bytes a decoding step reads, each weight rounded to 8 significant bits.
    Bf16,
}

impl WeightDtype {
    /// `asked`, else the dtype the run's weight file stores its matrices in where the device is
    /// the CPU's Flex backend (bf16 for `import hf --dtype bf16` and a pure-bf16 run), else
    /// f32. bf16 on a device that cannot read it is an error naming the device.
    pub fn resolve(asked: Option<Self>, run: &Path, device: &str) -> Result<Self> {
        match asked {
            Some(Self::Bf16) if !device::reads_bf16_weights(device) => bail!(
                "--dtype bf16: device `{device}` does not read bf16 weights (NdArray has no bf16 \
                 tensors, WGSL no bf16 type); use --device cpu, tch or cuda:N, or --dtype f32"
            ),
            Some(dtype) => Ok(dtype),
            None if device::is_flex(device) && stored_in_bf16(run)? => Ok(Self::Bf16),
            None => Ok(Self::F32),
        }
    }
}

/// Whether the weights `run` loads ([`find_weights`]) store their matrices in bf16, as the
/// file's header says.
fn stored_in_bf16(run: &Path) -> Result<bool> {
    holds_bf16(run, &find_weights(run)?, |dims| dims == 2)
}

/// Whether the file of `weights` (of the run at `run`) holds a bf16 tensor of a number of
/// dimensions `counts` takes, as its header says.
fn holds_bf16(run: &Path, weights: &Weights, counts: impl Fn(usize) -> bool) -> Result<bool> {
    use burn::store::burn_pack::{DType, Reader};
    let tensors = Reader::from_file_exact(weights.file())
        .and_then(Reader::into_tensors)
        .map_err(|e| damaged(run, weights, &e.to_string()))?;
    Ok(tensors
        .iter()
        .any(|t| counts(t.shape.num_dims()) && t.dtype == DType::BF16))
}

impl std::fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        })
    }
}

/// [`load_model`] on the device `spec` names, for inference, the weight matrices kept in `asked`
/// ([`Model::with_weight_dtype`]; None: [`WeightDtype::resolve`]'s default): the model, its
/// weights, the device and the dtype the matrices are in.
///
/// Attention takes [`device::inference_attention`]'s path.
pub fn load_model_on(
    run: &Path,
    recipe: &Recipe,
    spec: &str,
    asked: Option<WeightDtype>,
) -> Result<(Model, Weights, Device, WeightDtype)> {
    let dtype = WeightDtype::resolve(asked, run, spec)?;
    let device = device::parse(spec)?;
    let (model, weights) = load_model(run, recipe, &device)?;
    let model = match device::inference_attention(spec) {
        Some(attention) => model.with_attention_impl(attention),
        None => model,
    };
    let model = match dtype {
        WeightDtype::F32 => model,
        WeightDtype::Bf16 => model.with_weight_dtype(burn::tensor::FloatDType::BF16),
    };
    Ok((model, weights, device, dtype))
}

/// The scale of λ the run's `weights` compute with: 1 without a warm-up
/// (`training.lambda_warmup`); during one that of their step ([`weights_step`]).
pub fn lambda_scale(run: &Path, recipe: &Recipe, weights: &Weights) -> Result<f64> {
    if recipe.training.warmup_steps().is_none() {
        return Ok(1.0);
    }
    Ok(recipe
        .training
        .lambda_scale(weights_step(run, weights, recipe.total_steps())?))
}

/// Weights for a model of `config` from a run directory (its final model, else its newest
/// verified checkpoint) or from a model or checkpoint file.
pub fn load_weights(
    path: &Path,
    config: &ModelConfig,
    device: &Device,
) -> Result<(Model, Weights)> {
    let weights = find_weights(path)?;
    // As recorded: Burn's cast to the built model's dtypes would draw every parameter's random
    // initial values to read their dtype (a second at a 135M model's shape). Parameters in
    // another float dtype than the device's (a bf16 run's model into an f32 device) are cast
    // after; on an autodiff device, where a cast would be a step of the graph, by reading the
    // record again with Burn's cast, and so for bf16 weights on a device without bf16 (NdArray),
    // which cannot hold them as recorded.
    let cast = !device.supports_dtype(burn::tensor::FloatDType::BF16)
        && holds_bf16(path, &weights, |_| true)?;
    let model = read_weights(path, &weights, config, device, cast)?;
    let float = device.settings().float_dtype;
    let model = match floats_all_in(&model, float.into()) {
        true => model,
        false if !device.is_autodiff() => compute_copy(&model, Some(float)),
        false => read_weights(path, &weights, config, device, true)?,
    };
    Ok((model, weights))
}

/// The model in `weights`, its parameters in the record's dtypes or (`cast`) the device's.
fn read_weights(
    path: &Path,
    weights: &Weights,
    config: &ModelConfig,
    device: &Device,
    cast: bool,
) -> Result<Model> {
    let file = weights.file();
    let record = || {
        ModuleRecord::load(file)
            .map(|record| match cast {
                true => record.cast_to_module_dtype(),
                false => record,
            })
            .map_err(|e| damaged(path, weights, &e.to_string()))
    };
    // A `Model` (an imported run's final model, a model file), or a learner checkpoint's
    // `Trainee` (the model under `model.`): a checkpoint, and a trained run's final model, which
    // is its last checkpoint's file under a second name. The likely layout is tried first; of
    // two failures, the one that is not about the other layout's names is the one to tell.
    let as_model = || -> Result<std::result::Result<Model, String>> {
        Ok(config
            .init(device)
            .try_load_record(record()?)
            .map_err(|e| e.to_string()))
    };
    let as_trainee = || -> Result<std::result::Result<Model, String>> {
        let trainee = Trainee {
            model: config.init(device),
            context: None,
        };
        Ok(trainee
            .try_load_record(record()?)
            .map(|t| t.model)
            .map_err(|e| e.to_string()))
    };
    let linked =
        std::fs::metadata(file).is_ok_and(|m| std::os::unix::fs::MetadataExt::nlink(&m) > 1);
    let trainee_first = matches!(weights, Weights::Checkpoint(..)) || linked;
    let first = if trainee_first {
        as_trainee()?
    } else {
        as_model()?
    };
    match first {
        Ok(model) => Ok(model),
        Err(first) => {
            let second = if trainee_first {
                as_model()?
            } else {
                as_trainee()?
            };
            second.map_err(|second| {
                let why = match first.contains("Missing tensors") {
                    true => second,
                    false => first,
                };
                anyhow!("{}: {why}", file.display())
            })
        }
    }
}

/// Whether every float parameter of `model` is in `dtype`.
fn floats_all_in(model: &Model, dtype: DType) -> bool {
    struct Check(DType, bool);
    impl ModuleVisitor for Check {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1 &= param.val().dtype() == self.0;
        }
    }
    let mut check = Check(dtype, true);
    model.visit(&mut check);
    check.1
}

/// Why `weights` of the run (or file) `path` cannot be read: Burn's error, and for a run's
/// final model (truncated by a full disk, say) where the same or the latest weights still are.
fn damaged(path: &Path, weights: &Weights, error: &str) -> anyhow::Error {
    let file = weights.file();
    if !matches!(weights, Weights::Final(_)) {
        return anyhow!(
            "{}: cannot be read ({error}): truncated or damaged",
            file.display()
        );
    }
    let newest = checkpoint::newest_with_warnings(&path.join(CHECKPOINTS)).0;
    let steps = run_recipe(path).ok().map(|r| r.total_steps());
    let hint = match (newest, steps) {
        (Some(c), Some(total)) if c.step == total => format!(
            "checkpoint {} holds the same weights (step {}, the run's last): remove {FINAL_MODEL} and every command reads that checkpoint, and `train --resume` writes {FINAL_MODEL} again from it",
            c.number, c.step
        ),
        (Some(c), _) => format!(
            "the newest checkpoint that verifies is {} at step {}: remove {FINAL_MODEL} and `train --resume` trains on from it",
            c.number, c.step
        ),
        (None, _) => "no checkpoint verifies either: the run must be trained again".into(),
    };
    anyhow!(
        "{}: cannot be read ({error}): the final model is truncated or damaged; {hint}",
        file.display()
    )
}

/// Writes the final model: `model.bpk`, whose presence marks a finished run, and with
/// `safetensors` also `model.safetensors`, each to a temporary name renamed into place (a crash
/// leaves no torn file). `model.bpk` is a second name (a hard link) of `checkpoint`, the final
/// checkpoint's verified model file, where there is one: one copy of the final weights on disk,
/// and the checkpoint stays whole for an extension to resume from. Files get the mode any new
/// file gets (0644 under the usual umask 022; where /proc tells the umask): Burn's store creates
/// its file for its owner only.
pub fn save_final(
    run: &Path,
    model: &Model,
    checkpoint: Option<&Path>,
    safetensors: bool,
) -> Result<()> {
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    if safetensors {
        let tmp = run.join("model.safetensors.tmp");
        let mut store = SafetensorsStore::from_file(&tmp).overwrite(true);
        model
            .save_into(&mut store)
            .map_err(|e| anyhow!("{}: {e}", tmp.display()))?;
        publish(&tmp, &run.join(FINAL_SAFETENSORS))?;
    }
    let bpk = run.join(FINAL_MODEL);
    let tmp = run.join("model.bpk.tmp");
    let _ = std::fs::remove_file(&tmp);
    if let Some(checkpoint) = checkpoint
        && std::fs::hard_link(checkpoint, &tmp).is_ok()
    {
        return std::fs::rename(&tmp, &bpk)
            .with_context(|| format!("renaming {} to {}", tmp.display(), bpk.display()));
    }
    model
        .clone()
        .save_file(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    publish(&tmp, &bpk)
}

/// Gives the written `tmp` the mode of a new file (where the umask can be read) and renames it
/// to `path`.
fn publish(tmp: &Path, path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    new_file_mode()
        .map_or(Ok(()), |mode| {
            std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(mode))
        })
        .and_then(|()| std::fs::rename(tmp, path))
        .with_context(|| format!("writing {}", path.display()))
}

/// 0666 less the process's umask, read from /proc (none where it cannot be read).
fn new_file_mode() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let umask = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
    Some(0o666 & !u32::from_str_radix(umask.trim(), 8).ok()?)
}

/// One run a sweep will train: its directory under the sweep's and its steps.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Planned {
    pub name: String,
    pub steps: usize,
}

/// Writes the sweep directory's `sweep.json` (the runs it will hold).
pub fn write_sweep_plan(out: &Path, runs: &[Planned]) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let path = out.join(SWEEP_PLAN);
    let json = serde_json::to_string_pretty(&serde_json::json!({ "runs": runs }))?;
    std::fs::write(&path, json + "\n").with_context(|| format!("writing {}", path.display()))
}

/// The runs a sweep directory's `sweep.json` lists (none where it has none or it does not read).
pub fn sweep_plan(dir: &Path) -> Vec<Planned> {
    #[derive(serde::Deserialize)]
    struct Plan {
        runs: Vec<Planned>,
    }
    std::fs::read(dir.join(SWEEP_PLAN))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Plan>(&bytes).ok())
        .map_or_else(Vec::new, |plan| plan.runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    use diffzoo_models::{AttentionImpl, AttentionKind};

    #[test]
    fn the_final_model_is_written_whole_in_both_formats() {
        let dir = tempfile::tempdir().unwrap();
        let device = Device::flex();
        let config = ModelConfig::new(AttentionKind::Diff, 16, 2, 2, 20, 8);
        device.seed(1);
        let model = config.init(&device);
        save_final(dir.path(), &model, None, true).unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        use std::os::unix::fs::PermissionsExt;
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        let plain = tempfile::tempdir().unwrap();
        std::fs::File::create(plain.path().join("new")).unwrap();
        for name in &names {
            assert_eq!(
                mode(&dir.path().join(name)),
                mode(&plain.path().join("new")),
                "{name}"
            );
        }
        // Loaded into models initialised differently: equal logits mean every weight was read.
        device.seed(2);
        let (from_bpk, _) = load_weights(dir.path(), &config, &device).unwrap();
        let mut from_safetensors = config.init(&device);
        from_safetensors
            .load_from(&mut SafetensorsStore::from_file(
                dir.path().join(FINAL_SAFETENSORS),
            ))
            .unwrap();
        let want = model.forward(ids(&device));
        for loaded in [from_bpk, from_safetensors] {
            let got = loaded.forward(ids(&device));
            let diff = (got - want.clone()).abs().max().into_scalar::<f32>();
            assert_eq!(diff, 0.0);
        }
    }

    #[test]
    fn the_final_model_is_the_final_checkpoints_file_under_a_second_name() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let device = Device::flex();
        let config = ModelConfig::new(AttentionKind::Diff, 16, 2, 2, 20, 8);
        device.seed(1);
        let model = config.init(&device);
        let checkpoint = dir.path().join("model-1.bpk");
        model.clone().save_file(&checkpoint).unwrap();
        save_final(dir.path(), &model, Some(&checkpoint), false).unwrap();
        let inode = |name: &str| std::fs::metadata(dir.path().join(name)).unwrap().ino();
        assert_eq!(inode(FINAL_MODEL), inode("model-1.bpk"), "one copy on disk");
        assert!(!dir.path().join(FINAL_SAFETENSORS).exists());
        device.seed(2);
        let (loaded, weights) = load_weights(dir.path(), &config, &device).unwrap();
        assert!(matches!(weights, Weights::Final(_)));
        let diff = (loaded.forward(ids(&device)) - model.forward(ids(&device)))
            .abs()
            .max()
            .into_scalar::<f32>();
        assert_eq!(diff, 0.0);
    }

    #[test]
    fn a_bf16_model_loads_widened_to_f32_on_plain_and_autodiff_devices() {
        let dir = tempfile::tempdir().unwrap();
        let device = Device::flex();
        let config = ModelConfig::new(AttentionKind::Diff, 16, 2, 2, 20, 8);
        device.seed(1);
        let bf16 = compute_copy(&config.init(&device), Some(burn::tensor::FloatDType::BF16));
        save_final(dir.path(), &bf16, None, false).unwrap();
        let widened = compute_copy(&bf16, Some(burn::tensor::FloatDType::F32));
        assert!(floats_all_in(&widened, DType::F32));
        for device in [device.clone(), device.clone().autodiff()] {
            device.seed(2);
            let (loaded, _) = load_weights(dir.path(), &config, &device).unwrap();
            assert!(floats_all_in(&loaded, DType::F32), "{device:?}");
            let diff = (loaded.forward(ids(&device)) - widened.forward(ids(&Device::flex())))
                .abs()
                .max()
                .into_scalar::<f32>();
            // Autodiff computes through Burn's ops, not Flex's fused ones: the same to rounding.
            let tolerance = if device.is_autodiff() { 1e-5 } else { 0.0 };
            assert!(diff <= tolerance, "{device:?}: {diff}");
        }
    }

    /// For inference Flex takes the explicit path whatever the recipe trains with, and over more
    /// positions than a block of queries (`blocks::BLOCK`) gives the logits of the recipe's flash
    /// path; other devices keep the recipe's.
    #[test]
    fn inference_on_flex_takes_the_explicit_path() {
        let implementations = |model: &Model| -> Vec<AttentionImpl> {
            model
                .blocks
                .iter()
                .map(|b| b.attn.implementation())
                .collect()
        };
        let flash = AttentionImpl::Flash { block: 16 };
        let positions = diffzoo_models::attention::blocks::BLOCK + 12;
        let long = |device: &Device| {
            let ids: Vec<i64> = (0..positions as i64).map(|i| i * 7 % 20).collect();
            burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(ids, [1, positions]),
                device,
            )
        };
        for attention in AttentionKind::ALL {
            let dir = tempfile::tempdir().unwrap();
            let recipe = recipe::resolve(
                "micro",
                &[
                    format!("model.attention=\"{attention}\""),
                    "model.attention_impl=\"flash\"".into(),
                    "model.attention_block=16".into(),
                    format!("model.max_seq_len={}", positions),
                ],
            )
            .unwrap()
            .recipe;
            let device = Device::flex();
            device.seed(1);
            let trained = recipe.model_config().init(&device);
            assert!(implementations(&trained).iter().all(|&i| i == flash));
            save_final(dir.path(), &trained, None, false).unwrap();
            // A CPU backend beside Flex: Flex and LibTorch where compiled in.
            let specs = device::compiled()
                .into_iter()
                .filter(|s| ["flex", "tch"].contains(s));
            for spec in specs {
                let (model, _, device, _) = load_model_on(dir.path(), &recipe, spec, None).unwrap();
                let want = if device::is_flex(spec) {
                    AttentionImpl::Explicit
                } else {
                    flash
                };
                assert!(
                    implementations(&model).iter().all(|&i| i == want),
                    "{attention} on {spec}"
                );
                if spec == "flex" {
                    let diff = (model.forward(long(&device)) - trained.forward(long(&device)))
                        .abs()
                        .max()
                        .into_scalar::<f32>();
                    assert!(diff <= 1e-5, "{attention}: logits {diff} apart");
                }
            }
        }
    }

    fn ids(device: &Device) -> burn::tensor::Tensor<2, burn::tensor::Int> {
        burn::tensor::Tensor::from_data([[1, 5, 7, 19]], device)
    }
}
