//! `diffzoo import hf DIR --out RUN`: a transformers checkpoint (`LlamaForCausalLM`,
//! `DiffLlamaForCausalLM`, or our own `DiffzooV2ForCausalLM` export) as a run directory that
//! `generate`, every `eval`, `compare`, `export` and `training.init_from` accept.
//!
//! The safetensors files are memory-mapped and each tensor is converted (rows permuted, see
//! [`super`]) only when the model asks for it, so memory holds the model and one tensor. The run
//! is written under a temporary name and renamed at the end: an error leaves nothing at `--out`.

use super::config::{self, HfConfig};
use super::{CONFIG, Dtype, Entry, FloatFormat, TOKENIZER, WEIGHTS, WEIGHTS_INDEX, entries};
use crate::recipe::{
    CheckpointSection, DataSection, OptimizerSection, Recipe, ScheduleSection, TrainingSection,
};
use crate::{device, run};
use anyhow::{Context, Result, anyhow, bail};
use burn::store::burn_pack::{self, Bytes};
use burn::store::{ModuleSnapshot, PyTorchToBurnAdapter};
use diffzoo_datasets::TextTokenizer;
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, clap::Args)]
pub struct ImportArgs {
    /// A Hugging Face model directory: config.json, model.safetensors or a sharded
    /// model.safetensors.index.json, and tokenizer.json when there is one.
    pub dir: PathBuf,
    /// The run directory to write (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// Float format of the imported weights: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// What `import.json` in the run records of the source.
const NOTE: &str = "import.json";
const HEAD: &str = "lm_head.weight";
const EMBED: &str = "model.embed_tokens.weight";

pub fn run(args: &ImportArgs) -> Result<()> {
    let dtype = Dtype::parse(&args.dtype)?;
    let staging = super::staging(&args.out)?;
    let result = import(&args.dir, &args.out, &staging, dtype);
    if result.is_err() {
        std::fs::remove_dir_all(&staging).ok();
    }
    let (config, tokenizer) = result?;
    std::fs::rename(&staging, &args.out)
        .with_context(|| format!("renaming {} to {}", staging.display(), args.out.display()))?;
    println!(
        "imported {} ({}, {} layers × {}, vocabulary {}{}) into {}",
        args.dir.display(),
        config.architecture.class(),
        config.model.layers,
        config.model.d_model,
        config.model.vocab_size,
        if tokenizer {
            ", with its tokenizer"
        } else {
            ", no tokenizer"
        },
        args.out.display()
    );
    Ok(())
}

/// Writes the run into `staging`; `out` is where it will be renamed to.
fn import(dir: &Path, out: &Path, staging: &Path, dtype: Dtype) -> Result<(HfConfig, bool)> {
    let config_path = dir.join(CONFIG);
    if !config_path.is_file() {
        bail!(
            "{}: no {CONFIG}: not a Hugging Face model directory",
            dir.display()
        );
    }
    let hf = config::read(&config_path)?;
    let model_config = hf.model.config(hf.context);
    model_config
        .validate()
        .map_err(|e| anyhow!("{}: {e}", config_path.display()))?;
    let checkpoint = Arc::new(Checkpoint::open(dir)?);
    let tensors = checkpoint.plan(&entries(&model_config), dtype)?;

    let device = device::parse("cpu")?;
    let mut model = model_config.init(&device);
    let applied = model.apply(tensors, None, Some(Box::new(PyTorchToBurnAdapter)), true);
    if !(applied.errors.is_empty() && applied.missing.is_empty() && applied.unused.is_empty()) {
        bail!(
            "{}: the weights do not fit the model: errors {:?}, missing {:?}, unused {:?}",
            dir.display(),
            applied.errors,
            applied.missing,
            applied.unused
        );
    }

    let tokenizer_path = dir.join(TOKENIZER);
    let tokenizer = if tokenizer_path.is_file() {
        let tokenizer = TextTokenizer::from_file(&tokenizer_path)?;
        if tokenizer.vocab_size() > hf.model.vocab_size {
            bail!(
                "{}: the tokenizer has {} tokens but `vocab_size` = {} in {CONFIG}",
                tokenizer_path.display(),
                tokenizer.vocab_size(),
                hf.model.vocab_size
            );
        }
        Some(tokenizer)
    } else {
        None
    };

    std::fs::create_dir_all(staging).with_context(|| format!("creating {}", staging.display()))?;
    let recipe = recipe_of(dir, out, &hf, dtype, tokenizer.is_some())?;
    write(&staging.join(run::RECIPE), recipe.to_toml())?;
    if let Some(tokenizer) = &tokenizer {
        write(&staging.join(run::TOKENIZER), tokenizer.json())?;
    }
    let note = serde_json::json!({
        "format": "huggingface",
        "source": absolute(dir)?.display().to_string(),
        "architecture": hf.architecture.class(),
        "files": checkpoint.files.iter().map(|f| f.name.clone()).collect::<Vec<_>>(),
        "dtype": dtype.torch_name(),
        "tokenizer": tokenizer.is_some(),
        "diffzoo": env!("CARGO_PKG_VERSION"),
    });
    write(
        &staging.join(NOTE),
        serde_json::to_string_pretty(&note)? + "\n",
    )?;
    run::save_final(staging, &model)?;
    Ok((hf, tokenizer.is_some()))
}

/// The run's recipe: the model from config.json; the embedded corpus read with the checkpoint's
/// own tokenizer (when it has one) for evaluation; training that continues from these weights.
fn recipe_of(
    dir: &Path,
    out: &Path,
    hf: &HfConfig,
    dtype: Dtype,
    tokenizer: bool,
) -> Result<Recipe> {
    let out = absolute(out)?;
    let seq_len = hf.context.min(1024);
    Ok(Recipe {
        description: format!(
            "{} imported from {} (set training.steps to fine-tune it)",
            hf.architecture.class(),
            absolute(dir)?.display()
        ),
        model: hf.model.clone(),
        data: DataSection {
            corpus: diffzoo_datasets::corpus::EMBEDDED.into(),
            tokenizer: tokenizer.then(|| out.join(run::TOKENIZER).display().to_string()),
            seq_len,
            needles: None,
        },
        optimizer: OptimizerSection::default(),
        schedule: ScheduleSection::default(),
        training: TrainingSection {
            steps: Some(1),
            tokens: None,
            batch_tokens: seq_len,
            micro_batch: 1,
            seed: 42,
            dtype: match dtype {
                Dtype::F32 => "f32",
                Dtype::Bf16 => "bf16",
            }
            .into(),
            device: "cpu".into(),
            log_every: 10,
            init_from: Some(out.display().to_string()),
        },
        checkpoint: CheckpointSection::default(),
    })
}

/// One safetensors file of the checkpoint, memory-mapped.
struct File {
    name: String,
    path: PathBuf,
    map: Mmap,
}

/// Where a tensor's bytes are.
struct Stored {
    file: usize,
    format: StDtype,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

/// The checkpoint's files and where each tensor is.
struct Checkpoint {
    dir: PathBuf,
    files: Vec<File>,
    index: BTreeMap<String, Stored>,
}

impl Checkpoint {
    /// Opens `model.safetensors`, else every shard `model.safetensors.index.json` names,
    /// checking that each file is whole and holds the tensors the index says it does.
    fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(WEIGHTS_INDEX);
        // transformers reads model.safetensors when both are there: so do we.
        let shards: BTreeMap<String, Option<BTreeSet<String>>> = if dir.join(WEIGHTS).is_file() {
            BTreeMap::from([(WEIGHTS.to_string(), None)])
        } else if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("reading {}", index_path.display()))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| anyhow!("{}: {e}", index_path.display()))?;
            let map = value["weight_map"]
                .as_object()
                .ok_or_else(|| anyhow!("{}: no `weight_map` object", index_path.display()))?;
            let mut shards: BTreeMap<String, Option<BTreeSet<String>>> = BTreeMap::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    anyhow!(
                        "{}: `weight_map.{tensor}` is not a file name",
                        index_path.display()
                    )
                })?;
                if Path::new(file).file_name() != Some(file.as_ref()) {
                    bail!(
                        "{}: `weight_map.{tensor}` = {file:?} is not a file in the directory",
                        index_path.display()
                    );
                }
                shards
                    .entry(file.into())
                    .or_insert_with(|| Some(BTreeSet::new()))
                    .as_mut()
                    .expect("a set")
                    .insert(tensor.clone());
            }
            shards
        } else {
            bail!(
                "{}: neither {WEIGHTS} nor {WEIGHTS_INDEX} (diffzoo reads safetensors checkpoints only)",
                dir.display()
            );
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for (name, wanted) in shards {
            let file = File::open(dir, &name)?;
            let parsed = SafeTensors::deserialize(&file.map).map_err(|e| {
                anyhow!(
                    "{}: not a whole safetensors file ({e:?})",
                    file.path.display()
                )
            })?;
            let base = file.map.as_ptr() as usize;
            for (tensor, view) in parsed.tensors() {
                if wanted.as_ref().is_some_and(|w| !w.contains(&tensor)) {
                    continue;
                }
                let stored = Stored {
                    file: files.len(),
                    format: view.dtype(),
                    shape: view.shape().to_vec(),
                    start: view.data().as_ptr() as usize - base,
                    len: view.data().len(),
                };
                index.insert(tensor, stored);
            }
            if let Some(missing) = wanted
                .iter()
                .flatten()
                .find(|t| index.get(*t).is_none_or(|s: &Stored| s.file != files.len()))
            {
                bail!(
                    "{}: tensor `{missing}` is not in this file, where {WEIGHTS_INDEX} places it",
                    file.path.display()
                );
            }
            files.push(file);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            index,
        })
    }

    /// Checks every tensor the model needs (present, of its shape, of a float format we can
    /// hold) and that the checkpoint holds nothing else, then returns them as tensors that
    /// convert their data when the model reads them.
    fn plan(self: &Arc<Self>, entries: &[Entry], dtype: Dtype) -> Result<Vec<burn_pack::Tensor>> {
        let mut unused: BTreeSet<&str> = self
            .index
            .keys()
            .map(String::as_str)
            // RoPE frequencies that older transformers saved: derived from rope_theta.
            .filter(|name| !name.ends_with("rotary_emb.inv_freq"))
            .collect();
        let pack_dtype = match dtype {
            Dtype::F32 => burn_pack::DType::F32,
            Dtype::Bf16 => burn_pack::DType::BF16,
        };
        let mut tensors = Vec::with_capacity(entries.len());
        for entry in entries {
            let numel: usize = entry.shape.iter().product();
            let Some(hf) = &entry.hf else {
                // DIFF V1's subln: transformers' per-head RMSNorm has no weight.
                let ones = Bytes::from_bytes_vec(dtype.bytes(&vec![1.0; numel]));
                tensors.push(burn_pack::Tensor::new(
                    entry.ours.clone(),
                    pack_dtype,
                    entry.shape.clone(),
                    None,
                    ones,
                ));
                continue;
            };
            let format = self.check(hf, &entry.shape)?;
            unused.remove(hf.as_str());
            let this = Arc::clone(self);
            let (hf, rows) = (hf.clone(), entry.rows);
            let cols = if entry.shape.len() == 2 {
                entry.shape[1]
            } else {
                1
            };
            let len = numel * dtype.size();
            tensors.push(burn_pack::Tensor::deferred(
                entry.ours.clone(),
                pack_dtype,
                entry.shape.clone(),
                None,
                len,
                move || {
                    let values = super::decode_floats(this.bytes(&this.index[&hf]), format);
                    let values = match rows {
                        Some(rows) => super::gather_rows(&values, &rows.order(), cols),
                        None => values,
                    };
                    Ok(Bytes::from_bytes_vec(dtype.bytes(&values)))
                },
            ));
        }
        // A tied checkpoint may store the head anyway; transformers ties it to the embedding.
        let tied = !entries.iter().any(|e| e.hf.as_deref() == Some(HEAD));
        if tied && unused.remove(HEAD) {
            let (head, embed) = (&self.index[HEAD], &self.index[EMBED]);
            if head.shape != embed.shape
                || head.format != embed.format
                || self.bytes(head) != self.bytes(embed)
            {
                bail!(
                    "{}: `{HEAD}` differs from `{EMBED}` but tie_word_embeddings = true: one of them would be dropped",
                    self.files[head.file].path.display()
                );
            }
        }
        if !unused.is_empty() {
            bail!(
                "{}: tensors diffzoo's model has no place for: {} (refused rather than dropped)",
                self.dir.display(),
                unused.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
        Ok(tensors)
    }

    /// A stored tensor's bytes.
    fn bytes(&self, stored: &Stored) -> &[u8] {
        &self.files[stored.file].map[stored.start..stored.start + stored.len]
    }

    /// The float format of tensor `name`, checking that it is there with the model's shape.
    fn check(&self, name: &str, shape: &[usize]) -> Result<FloatFormat> {
        let stored = self.index.get(name).ok_or_else(|| {
            anyhow!(
                "{}: tensor `{name}` is missing from the checkpoint",
                self.dir.display()
            )
        })?;
        let path = &self.files[stored.file].path;
        if stored.shape != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?} but {CONFIG} implies {shape:?}",
                path.display(),
                stored.shape
            );
        }
        match stored.format {
            StDtype::F32 => Ok(FloatFormat::F32),
            StDtype::BF16 => Ok(FloatFormat::Bf16),
            StDtype::F16 => Ok(FloatFormat::F16),
            other => bail!(
                "{}: tensor `{name}` is {other:?}: diffzoo holds weights as f32 or bf16 and reads F32, BF16 and F16 exactly",
                path.display()
            ),
        }
    }
}

impl File {
    fn open(dir: &Path, name: &str) -> Result<Self> {
        let path = dir.join(name);
        let file =
            std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the map is read-only and lives as long as the checkpoint; like every
        // safetensors reader we assume no other process truncates the file meanwhile.
        let map =
            unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        Ok(Self {
            name: name.into(),
            path,
            map,
        })
    }
}

fn write(path: &Path, text: impl AsRef<[u8]>) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}
