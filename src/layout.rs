//! A run directory's layout: the files it holds, how its last `train` ended, the directories of
//! its seeds, and which weights it holds at which step. What reads those files into a recipe,
//! data and a model is `run`'s; this module reads no recipe, so that the recipe's own
//! resolution (a `training.init_from` run's model, tokenizer and step) can read a run's layout.
//!
//! ```text
//! runs/tiny/
//!   recipe.toml        the resolved recipe (what --resume checks against)
//!   tokenizer.json     the tokenizer (its hash must match the data's)
//!   metrics.jsonl      one JSON object per training step and per validation
//!   checkpoint/        {model,optim,scheduler}-E.bpk and manifest-E.json (its step, sizes and
//!                      SHA-256s) every checkpoint interval, and where a run was stopped; the
//!                      last K kept; `format` marks checkpoints that have manifests
//!   run.lock           held by the `train` writing the run (its process id and host inside)
//!   outcome.json       how the last `train` ended: finished, stopped or failed (with why)
//!   model.bpk          the final model (Burn's format): a hard link to the last checkpoint's
//!                      model file; model.safetensors too with `checkpoint.safetensors`
//!   import.json        where an imported run's weights came from (`diffzoo import hf`), and
//!                      the config keys transformers does not read that it ignored
//!   tokenizer_config.json, chat_template.jinja, special_tokens_map.json, generation_config.json
//!                      what the tokenizer came with (an imported instruct model's chat template
//!                      and end-of-turn ids; see [`COMPANIONS`])
//! ```

use crate::train::checkpoint::{self, Verified};
use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};

pub const RECIPE: &str = "recipe.toml";
pub const TOKENIZER: &str = "tokenizer.json";
pub const METRICS: &str = "metrics.jsonl";
pub const CHECKPOINTS: &str = "checkpoint";
pub const FINAL_MODEL: &str = "model.bpk";
pub const FINAL_SAFETENSORS: &str = "model.safetensors";
pub const OUTCOME: &str = "outcome.json";
/// A sweep directory's list of the runs it will hold, so that `watch` shows those not started.
pub const SWEEP_PLAN: &str = "sweep.json";

/// How a `train` of the run ended (`outcome.json`), and which process it was (the one
/// `run.lock` names, unless another has claimed the run since); removed when the next one starts.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunEnd {
    /// `finished`, `stopped` (with a checkpoint to resume from) or `failed`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub pid: u32,
    pub host: String,
}

impl RunEnd {
    pub fn new(state: &str, reason: Option<String>) -> Self {
        Self {
            state: state.into(),
            reason,
            pid: std::process::id(),
            host: crate::train::lock::host(),
        }
    }

    /// Written whole or not at all (a temporary file synced and renamed).
    pub fn write(&self, run: &Path) -> Result<()> {
        let path = run.join(OUTCOME);
        checkpoint::write_whole(&path, (serde_json::to_string(self)? + "\n").as_bytes())
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The run's last ending; `None` while none is recorded (or the file is unreadable).
    pub fn read(run: &Path) -> Option<Self> {
        serde_json::from_str(&std::fs::read_to_string(run.join(OUTCOME)).ok()?).ok()
    }

    pub fn clear(run: &Path) -> Result<()> {
        let path = run.join(OUTCOME);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("removing {}", path.display()))
            }
            _ => Ok(()),
        }
    }
}

/// How the directory of each seed of a run begins: `RUN/seed-N`.
pub const SEED_PREFIX: &str = "seed-";

/// The name of seed `seed` of the run named `run` in a sweep (`RUN/seed-N`).
pub fn seed_name(run: &str, seed: u64) -> String {
    format!("{run}/{SEED_PREFIX}{seed}")
}

/// The directory of seed `seed` of the run directory `run`.
pub fn seed_dir(run: &Path, seed: u64) -> PathBuf {
    run.join(format!("{SEED_PREFIX}{seed}"))
}

/// The directories of a run's seeds (`RUN/seed-N`), in the order of their seeds.
pub fn seed_dirs(run: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<(u64, PathBuf)> = std::fs::read_dir(run)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .filter_map(|p| {
            let name = p.file_name()?.to_string_lossy().into_owned();
            let seed = name.strip_prefix(SEED_PREFIX)?.parse().ok()?;
            Some((seed, p))
        })
        .collect();
    dirs.sort();
    dirs.into_iter().map(|(_, p)| p).collect()
}

/// The seeds of a run over seeds (`RUN/seed-N` holding runs, `RUN` holding none itself); empty
/// for a plain run.
pub fn run_seeds(run: &Path) -> Vec<PathBuf> {
    if run.join(RECIPE).exists() {
        return Vec::new();
    }
    let mut seeds = seed_dirs(run);
    seeds.retain(|seed| seed.join(RECIPE).exists());
    seeds
}

/// What transformers saves beside `tokenizer.json` that chat and generation read: the special
/// tokens and the chat template (in `tokenizer_config.json`, or in its own file since
/// transformers 5), and the end-of-turn ids (`generation_config.json`). A run keeps those its
/// tokenizer came with.
pub const COMPANIONS: [&str; 4] = [
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// Copies the [`COMPANIONS`] present in `from` into `to`; the names copied.
pub fn copy_companions(from: &Path, to: &Path) -> Result<Vec<&'static str>> {
    let mut copied = Vec::new();
    for name in COMPANIONS {
        let source = from.join(name);
        if source.is_file() {
            std::fs::copy(&source, to.join(name))
                .with_context(|| format!("copying {} into {}", source.display(), to.display()))?;
            copied.push(name);
        }
    }
    Ok(copied)
}

/// The run's checkpoints that verify (see [`checkpoint`]), oldest first.
pub fn verified_checkpoints(run: &Path) -> Vec<Verified> {
    checkpoint::scan(&run.join(CHECKPOINTS))
        .into_iter()
        .filter_map(|found| {
            Some(Verified {
                number: found.number,
                step: found.verdict.ok()?,
            })
        })
        .collect()
}

/// Which weights `load_weights` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Weights {
    Final(PathBuf),
    /// A verified checkpoint: its number, step and model file.
    Checkpoint(Verified, PathBuf),
    /// A model or checkpoint file named directly.
    File(PathBuf),
}

impl std::fmt::Display for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Final(path) => write!(f, "final model {}", path.display()),
            Self::Checkpoint(c, path) => write!(
                f,
                "checkpoint {} at step {} ({})",
                c.number,
                c.step,
                path.display()
            ),
            Self::File(path) => write!(f, "weights file {}", path.display()),
        }
    }
}

/// Which weights `path` (a run directory or a model file) holds: the run's final model, else
/// its newest verified checkpoint.
pub fn find_weights(path: &Path) -> Result<Weights> {
    Ok(if path.is_dir() {
        let final_path = path.join(FINAL_MODEL);
        if final_path.exists() {
            Weights::Final(final_path)
        } else {
            let dir = path.join(CHECKPOINTS);
            let (newest, rejected) = checkpoint::newest_with_warnings(&dir);
            let newest = newest.ok_or_else(|| {
                anyhow!(
                    "{} has neither {FINAL_MODEL} nor a checkpoint that verifies{}",
                    path.display(),
                    checkpoint::rejected(&rejected)
                )
            })?;
            let file = dir.join(checkpoint::part_name("model", newest.number));
            Weights::Checkpoint(newest, file)
        }
    } else if path.is_file() {
        Weights::File(path.to_path_buf())
    } else {
        bail!("{}: no such run directory or model file", path.display());
    })
}

impl Weights {
    /// The file the weights are read from.
    pub fn file(&self) -> &Path {
        match self {
            Self::Final(f) | Self::Checkpoint(_, f) | Self::File(f) => f,
        }
    }

    /// How far the weights are: `final`, a checkpoint's step, or a file.
    pub fn stage(&self) -> String {
        match self {
            Self::Final(_) => "final".into(),
            Self::Checkpoint(c, _) => format!("step {}", c.step),
            Self::File(path) => format!("file {}", path.display()),
        }
    }
}

/// The training step the run's `weights` are at: a checkpoint's; for a final model, the
/// checkpoint's whose file it is (the hard link `run::save_final` makes), else a
/// finished run's last step (`total_steps`, its recipe's), else 0 (a final model no `train`
/// wrote: an import's, a conversion's); a weights file does not say.
pub fn weights_step(run: &Path, weights: &Weights, total_steps: usize) -> Result<usize> {
    use std::os::unix::fs::MetadataExt;
    Ok(match weights {
        Weights::Checkpoint(c, _) => c.step,
        Weights::Final(file) => {
            let inode = |path: &Path| std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
            // The checkpoint whose model file it is, verified alone (not every checkpoint's
            // bytes hashed to find it).
            let dir = run.join(CHECKPOINTS);
            let linked = checkpoint::numbers(&dir).into_iter().rev().find(|&number| {
                let part = dir.join(checkpoint::part_name("model", number));
                inode(&part).is_some() && inode(&part) == inode(file)
            });
            let linked = linked.and_then(|number| checkpoint::verify(&dir, number).ok());
            match (linked, RunEnd::read(run)) {
                (Some(step), _) => step,
                (None, Some(end)) if end.state == "finished" => total_steps,
                (None, _) => 0,
            }
        }
        Weights::File(path) => bail!(
            "{}: a weights file does not say its training step, which the run's λ warm-up (`training.lambda_warmup`) needs: give the run directory",
            path.display()
        ),
    })
}
