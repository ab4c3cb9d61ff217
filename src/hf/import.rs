//! `diffzoo import hf DIR --out RUN`: a transformers checkpoint (`LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM`, `DiffLlamaForCausalLM`, or our own
//! `DiffzooV2ForCausalLM` export) as a run directory that `generate`, every `eval`, `compare`,
//! `export` and `training.init_from` accept. Config keys transformers does not read are listed
//! and recorded in `import.json` (see [`super::config`]); the tokenizer comes with the files
//! chat and generation read beside it ([`layout::COMPANIONS`]).
//!
//! The safetensors files are memory-mapped and each tensor is converted (rows permuted, see
//! [`super`]) when the writer of the run's `model.safetensors` reaches it; `model.bpk` is then
//! copied from that file. The model is never built, so memory holds a few tensors and a
//! checkpoint larger than memory imports.
//! The run is written under a temporary name and renamed at the end: an error leaves nothing at
//! `--out`.

use super::config::{self, HfConfig};
use super::{
    CONFIG, Dtype, Entry, FloatFormat, Pending, Rows, TOKENIZER, WEIGHTS, WEIGHTS_INDEX, entries,
    write_file, write_safetensors,
};
use crate::layout;
use crate::recipe::{
    CheckpointSection, DataSection, OptimizerSection, Precision, Recipe, Recompute,
    ScheduleSection, TrainingSection,
};
use anyhow::{Context, Result, anyhow, bail};
use burn::module::ParamId;
use burn::store::burn_pack::{self, Bytes};
use diffzoo_datasets::TextTokenizer;
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::{BTreeMap, BTreeSet, HashMap};
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
    if !config.ignored.is_empty() {
        println!(
            "ignored {CONFIG} keys that transformers does not read for {}: {}",
            config.architecture.class(),
            config.ignored.join(", ")
        );
    }
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
    let checkpoint = Checkpoint::open(dir)?;
    let tensors = checkpoint.plan(&entries(&model_config))?;
    let names = super::burn_names(&model_config)?;

    let tokenizer_path = dir.join(TOKENIZER);
    let tokenizer = if tokenizer_path.is_file() {
        let tokenizer = TextTokenizer::from_file(&tokenizer_path)?;
        if tokenizer.id_bound() > hf.model.vocab_size {
            bail!(
                "{}: the tokenizer has ids up to {} but `vocab_size` = {} in {CONFIG}",
                tokenizer_path.display(),
                tokenizer.id_bound() - 1,
                hf.model.vocab_size
            );
        }
        Some(tokenizer)
    } else {
        None
    };

    if tokenizer.is_some() {
        check_companions(dir)?;
    }
    std::fs::create_dir_all(staging).with_context(|| format!("creating {}", staging.display()))?;
    let recipe = recipe_of(dir, out, &hf, dtype, tokenizer.is_some())?;
    write_file(&staging.join(layout::RECIPE), recipe.to_toml())?;
    let mut companions = Vec::new();
    if let Some(tokenizer) = &tokenizer {
        write_file(&staging.join(layout::TOKENIZER), tokenizer.json())?;
        companions = layout::copy_companions(dir, staging)?;
    }
    let note = serde_json::json!({
        "format": "huggingface",
        "source": absolute(dir)?.display().to_string(),
        "architecture": hf.architecture.class(),
        "files": checkpoint.files.iter().map(|f| f.name.clone()).collect::<Vec<_>>(),
        "dtype": dtype.torch_name(),
        "tokenizer": tokenizer.is_some(),
        "tokenizer_files": companions,
        "ignored_config_keys": hf.ignored,
        "diffzoo": env!("CARGO_PKG_VERSION"),
    });
    write_file(
        &staging.join(NOTE),
        serde_json::to_string_pretty(&note)? + "\n",
    )?;
    write_model(staging, &checkpoint, &tensors, &names, dtype)?;
    Ok((hf, tokenizer.is_some()))
}

/// The tokenizer's JSON companions parse (a broken one is refused, naming its file), and a chat
/// template compiles: one that does not is said at once (chat will not work), but the checkpoint
/// imports, since what it computes does not depend on it.
fn check_companions(dir: &Path) -> Result<()> {
    for name in layout::COMPANIONS {
        let path = dir.join(name);
        if name.ends_with(".json") && path.is_file() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<serde_json::Value>(&text)
                .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        }
    }
    match crate::chat::Template::find(dir) {
        Ok(_) | Err(crate::chat::NoTemplate::Missing(_)) => Ok(()),
        Err(crate::chat::NoTemplate::Invalid(e)) => {
            eprintln!(
                "warning: {e:#}; the model imports, but `generate --messages` and `--chat` will refuse it"
            );
            Ok(())
        }
    }
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
            tokenizer: tokenizer.then(|| out.join(layout::TOKENIZER).display().to_string()),
            seq_len,
            needles: None,
            recall: None,
        },
        optimizer: OptimizerSection::default(),
        schedule: ScheduleSection::default(),
        training: TrainingSection {
            steps: Some(1),
            tokens: None,
            batch_tokens: seq_len,
            micro_batch: 1,
            seed: 42,
            seeds: Vec::new(),
            precision: precision(dtype),
            device: "cpu".into(),
            log_every: 10,
            init_from: Some(out.display().to_string()),
            recompute: Recompute::None,
            lambda_warmup: None,
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
    /// hold) and that the checkpoint holds nothing else; returns what converts each one.
    fn plan(&self, entries: &[Entry]) -> Result<Vec<Planned>> {
        let mut unused: BTreeSet<&str> = self
            .index
            .keys()
            .map(String::as_str)
            // RoPE frequencies that older transformers saved: derived from rope_theta.
            .filter(|name| !name.ends_with("rotary_emb.inv_freq"))
            .collect();
        let mut planned = Vec::with_capacity(entries.len());
        for entry in entries {
            let format = match &entry.hf {
                // DIFF V1's subln: transformers' per-head RMSNorm has no weight.
                None => None,
                Some(hf) => {
                    unused.remove(hf.as_str());
                    Some(self.check(hf, &entry.shape)?)
                }
            };
            planned.push(Planned {
                entry: entry.clone(),
                format,
            });
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
            self.release(head);
            self.release(embed);
        }
        if !unused.is_empty() {
            bail!(
                "{}: tensors diffzoo's model has no place for: {} (refused rather than dropped)",
                self.dir.display(),
                unused.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
        Ok(planned)
    }

    /// Drops a read tensor's pages from this process's memory (the kernel reads them again
    /// from the file if they are touched again), so that mapped files do not stay resident.
    fn release(&self, stored: &Stored) {
        // SAFETY: the map is a read-only mapping of a file: MADV_DONTNEED discards the pages'
        // copies, and any later read faults them in from the file with the same contents.
        // Failure only leaves the pages resident.
        let _ = unsafe {
            self.files[stored.file].map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                stored.start,
                stored.len,
            )
        };
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

/// One tensor of the run: its entry and the format transformers stored it in (`None` for DIFF
/// V1's subln, which is ones).
struct Planned {
    entry: Entry,
    format: Option<FloatFormat>,
}

impl Planned {
    /// Our tensor in Burn's layout, as `dtype` bytes: read one element at a time from the map
    /// (rows in our order, linear layers transposed), so that memory holds only the result.
    fn bytes(&self, checkpoint: &Checkpoint, dtype: Dtype) -> Vec<u8> {
        let numel: usize = self.entry.shape.iter().product();
        let mut out = Vec::with_capacity(self.entry.bytes(dtype));
        let (Some(name), Some(format)) = (&self.entry.hf, self.format) else {
            (0..numel).for_each(|_| dtype.push(1.0, &mut out));
            return out;
        };
        let stored = &checkpoint.index[name];
        let source = checkpoint.bytes(stored);
        let order = self.entry.rows.map(Rows::order);
        for i in 0..numel {
            let at = super::source_index(&self.entry, order.as_deref(), i);
            dtype.push(format.get(source, at), &mut out);
        }
        checkpoint.release(stored);
        out
    }
}

/// Writes the run's `model.safetensors` under Burn's names, converting one tensor at a time,
/// then `model.bpk` (Burn's record, what `load_model` reads) by copying each tensor from it.
fn write_model(
    dir: &Path,
    checkpoint: &Checkpoint,
    tensors: &[Planned],
    names: &HashMap<String, String>,
    dtype: Dtype,
) -> Result<()> {
    let pending: Vec<Pending> = tensors
        .iter()
        .map(|t| Pending {
            name: names[&t.entry.ours].clone(),
            shape: t.entry.burn_shape(),
            bytes: Box::new(move || Ok(t.bytes(checkpoint, dtype))),
        })
        .collect();
    let metadata = serde_json::json!({
        "format": "safetensors",
        "producer": "diffzoo import hf",
        "version": env!("CARGO_PKG_VERSION"),
    });
    write_safetensors(
        &dir.join(layout::FINAL_SAFETENSORS),
        &pending,
        dtype,
        metadata,
    )?;
    // The run's model.safetensors is itself a one-file checkpoint (`WEIGHTS` is its name).
    let written = Arc::new(Checkpoint::open(dir)?);
    let records: Vec<burn_pack::Tensor> = pending
        .into_iter()
        .map(|p| {
            let written = Arc::clone(&written);
            let len = written.index[&p.name].len;
            burn_pack::Tensor::deferred(
                p.name.clone(),
                dtype.pack(),
                p.shape,
                Some(ParamId::new().val()),
                len,
                move || {
                    let stored = &written.index[&p.name];
                    let bytes = written.bytes(stored).to_vec();
                    written.release(stored);
                    Ok(Bytes::from_bytes_vec(bytes))
                },
            )
        })
        .collect();
    let path = dir.join(layout::FINAL_MODEL);
    burn_pack::Writer::new(records)
        .write_to_file(&path)
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))
}

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}

/// How a run of weights in `dtype` fine-tunes: bf16 weights as mixed precision's compute dtype,
/// over f32 masters that hold them exactly.
fn precision(dtype: Dtype) -> Precision {
    match dtype {
        Dtype::F32 => Precision::F32,
        Dtype::Bf16 => Precision::Bf16Mixed,
    }
}
