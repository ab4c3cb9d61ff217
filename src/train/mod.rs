//! `diffzoo train`: a recipe trained through burn-train's `SupervisedTraining` / `Learner`.
//!
//! A learner "epoch" is one checkpoint interval of optimizer steps; validation and checkpoints
//! happen at its end. Each loader item is one optimizer step (all its micro-batches), so
//! accumulation averages and clipping uses the global norm (see [`step`]), and the data cursor
//! is a function of the step (see [`loader`]), which makes `--resume` exact. With `--devices`,
//! Burn's DDP runs one replica per GPU: each takes an equal share of every step's micro-batches
//! and the gradients are all-reduced (mean) in the backward pass, so clipping and the update are
//! those of one device seeing the whole batch (see [`loader`] and [`step`]).
//!
//! Checkpoints are verified (see [`checkpoint`]); SIGINT, SIGTERM and the dashboard's stop end
//! the step in progress, write a checkpoint and exit with [`RESUMABLE`] (see [`control`]); a lock
//! file keeps a second `train` out of a live run's directory.

mod adamw;
pub mod checkpoint;
pub mod control;
mod dashboard;
pub mod grads;
pub mod loader;
pub mod lock;
pub mod loss;
pub mod metrics;
#[cfg(test)]
mod parity;
mod quiet;
pub mod schedule;
pub mod signals;
pub mod step;
pub mod tensorboard;

use crate::Outcome;
use crate::device;
use crate::layout::{self, RunEnd};
use crate::recipe::{self, NeedleSection, OptimizerSection, Precision, Recipe, Recompute};
use crate::run;
use anyhow::{Context, Result, anyhow, bail};
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::ParamGroup;
use burn::optim::ModuleOptimizer;
use burn::tensor::distributed::{DistributedConfig, ReduceOperation};
use burn::tensor::{Device, DeviceConfig, FloatDType};
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::metric::LearningRateMetric;
use burn::train::renderer::default_renderer;
use burn::train::{ExecutionStrategy, Interrupter, Learner, LearningResult, SupervisedTraining};
use checkpoint::{CheckpointWriter, Verified};
use control::Intervals;
use diffzoo_datasets::needle::NeedleMix;
use diffzoo_datasets::recall::{self, RecallMix, Vocabulary};
use diffzoo_datasets::{Split, TextTokenizer, TokenWindows};
use diffzoo_models::Model;
use loader::{Mixture, StepLoader};
use metrics::{MetricsLog, StatMetric, StepMetric};
use schedule::{Schedule, ScheduleState};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use step::{StepContext, Trainee};

/// The exit status of a run that stopped early with a checkpoint to resume from (sysexits'
/// `EX_TEMPFAIL`: "try again later").
pub const RESUMABLE: i32 = 75;

/// What `diffzoo train` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// A built-in recipe name (`diffzoo recipe list`) or a TOML file.
    #[arg(long)]
    pub recipe: String,
    /// Device, e.g. cpu, flex, ndarray, wgpu, tch, tch-cuda:0, cuda:0 (default: the recipe's).
    #[arg(long)]
    pub device: Option<String>,
    /// Train data-parallel on these GPUs, e.g. cuda:0,cuda:1 (Burn's DDP: each step's batch is
    /// split across them and the gradients all-reduced).
    #[arg(long, value_delimiter = ',', conflicts_with = "device")]
    pub devices: Vec<String>,
    /// Run directory (default: runs/<recipe name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in the run directory from its newest complete checkpoint (over seeds:
    /// each unfinished seed, skipping the finished).
    #[arg(long)]
    pub resume: bool,
    /// Train once per seed, each into OUT/seed-N with `training.seed = N`, one after another, and
    /// print the validation loss over the seeds (default: the recipe's `training.seeds`).
    #[arg(long, value_delimiter = ',', value_name = "N,…",
          value_parser = clap::value_parser!(u64).range(0..=i64::MAX as u64))]
    pub seeds: Vec<u64>,
    /// Override a recipe value, e.g. --set model.layers=4 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print metric lines instead of the dashboard, even on a terminal.
    #[arg(long)]
    pub no_dashboard: bool,
    /// Check every shard's SHA-256 against its manifest before training (sizes are always
    /// checked).
    #[arg(long)]
    pub verify_data: bool,
}

/// A float dtype by its recipe name (`f32`, `bf16`, `f16`; validated recipes hold no other).
pub fn float_dtype(name: &str) -> Result<FloatDType> {
    match name {
        "f32" => Ok(FloatDType::F32),
        "bf16" => Ok(FloatDType::BF16),
        "f16" => Ok(FloatDType::F16),
        other => bail!("dtype `{other}`: expected f32, bf16 or f16"),
    }
}

/// Sets the device's float dtype to the one named (before any tensor exists), refusing what the
/// device cannot run; `setting` names where the dtype came from in the error.
pub fn configure_dtype(device: &mut Device, name: &str, spec: &str, setting: &str) -> Result<()> {
    let dtype = float_dtype(name).with_context(|| format!("`{setting}`"))?;
    configure_float(
        device,
        dtype,
        dtype,
        spec,
        &format!("{setting} = \"{name}\""),
    )
}

/// Sets the device up for `precision` (before any tensor exists): its float dtype is what
/// weights and optimizer state are kept in, and it must also compute in the dtype a mixed step
/// computes in.
pub fn configure_precision(device: &mut Device, precision: Precision, spec: &str) -> Result<()> {
    let storage = precision.storage();
    let compute = precision.compute().unwrap_or(storage);
    let setting = format!("training.precision = \"{}\"", precision.name());
    configure_float(device, storage, compute, spec, &setting)
}

/// Configures `device` to keep floats in `storage`, refusing it where it cannot compute in
/// `compute`; `setting` says what asked for them.
fn configure_float(
    device: &mut Device,
    storage: FloatDType,
    compute: FloatDType,
    spec: &str,
    setting: &str,
) -> Result<()> {
    if ![storage, compute]
        .into_iter()
        .all(|d| device.supports_dtype(d))
    {
        bail!("device `{spec}` does not support `{setting}`; use f32 or another device");
    }
    if storage == FloatDType::F32 {
        return Ok(());
    }
    device
        .configure(DeviceConfig::default().float_dtype(storage))
        .map_err(|e| anyhow!("configuring {spec} for `{setting}`: {e:?}"))
}

/// What keeps `given` from resuming a run trained with `stored`: each key that differs, with
/// both values (the device and `training.recompute` may change on resume: neither changes the
/// arithmetic).
fn resume_conflicts(stored: &Recipe, given: &Recipe) -> Vec<String> {
    // The length may grow (see `extend`); where it runs and whether it recomputes may change.
    // Paths compare as absolute (a run's recipe.toml stores them so).
    let unplaced = |recipe: &Recipe| {
        let mut recipe = recipe.with_absolute_paths();
        recipe.training.device = String::new();
        recipe.training.recompute = Recompute::None;
        recipe.checkpoint.safetensors = false;
        recipe.training.steps = None;
        recipe.training.tokens = None;
        recipe
    };
    let unset = || "unset".to_string();
    unplaced(stored)
        .differences(&unplaced(given))
        .into_iter()
        .map(|(key, was, now)| {
            let hint = if key == "training.precision" {
                format!(
                    " (its checkpoints keep weights and AdamW moments in the run's dtypes: resume it as trained with --set training.precision={}, or start a new run in another precision from its weights with training.init_from)",
                    was.as_deref().unwrap_or("\"f32\"")
                )
            } else {
                String::new()
            };
            format!(
                "{key} = {} in the run, {} now{hint}",
                was.unwrap_or_else(unset),
                now.unwrap_or_else(unset),
            )
        })
        .collect()
}

/// Gives a new run the files its tokenizer came with (an imported model's chat template and
/// end-of-turn ids): those beside the data's tokenizer, else, when the run starts from one with
/// the same tokenizer, that run's.
fn copy_tokenizer_files(dir: &Path, recipe: &Recipe, tokenizer: &TextTokenizer) -> Result<()> {
    if let Some(home) = run::tokenizer_home(recipe)
        && !layout::copy_companions(&home, dir)?.is_empty()
    {
        return Ok(());
    }
    if let Some(init) = recipe.training.init_from.as_deref().map(Path::new)
        && init.join(layout::TOKENIZER).is_file()
        && run::run_tokenizer(init)?.hash() == tokenizer.hash()
    {
        layout::copy_companions(init, dir)?;
    }
    Ok(())
}

/// Prepares the run directory; returns the checkpoint to resume from (number 0: a fresh run).
fn prepare_run_dir(
    dir: &Path,
    recipe: &Recipe,
    tokenizer: &TextTokenizer,
    resume: bool,
) -> Result<Verified> {
    let fresh = Verified { number: 0, step: 0 };
    let recipe_path = dir.join(layout::RECIPE);
    if !resume {
        if recipe_path.exists() {
            bail!(
                "{} already holds a run: pass --resume to continue it, or --out for a new run",
                dir.display()
            );
        }
        if !layout::run_seeds(dir).is_empty() {
            bail!(
                "{} holds runs over seeds (seed-N): train them with their --seeds, or a run of \
                 one seed into another --out",
                dir.display()
            );
        }
        checkpoint::mark_format(&dir.join(layout::CHECKPOINTS)).map_err(|e| anyhow!(e))?;
        std::fs::write(&recipe_path, recipe.with_absolute_paths().to_toml())
            .with_context(|| format!("writing {}", recipe_path.display()))?;
        tokenizer.save(&dir.join(layout::TOKENIZER))?;
        copy_tokenizer_files(dir, recipe, tokenizer)?;
        return Ok(fresh);
    }
    let stored = run::run_recipe(dir)?;
    let conflicts = resume_conflicts(&stored, recipe);
    if !conflicts.is_empty() {
        bail!(
            "{} was trained with another recipe; refusing to resume with this one:\n  {}",
            recipe_path.display(),
            conflicts.join("\n  ")
        );
    }
    let (was, now) = (stored.total_steps(), recipe.total_steps());
    if now < was {
        bail!(
            "{} trains for {was} steps; resuming it with {now} would shorten it: a run can be extended (more steps), not cut (its schedule decays to its last step)",
            recipe_path.display()
        );
    }
    let stored_tokenizer = run::run_tokenizer(dir)?;
    if stored_tokenizer.hash() != tokenizer.hash() {
        bail!(
            "{} was trained with tokenizer {}, the data now gives tokenizer {}; refusing to resume",
            dir.display(),
            stored_tokenizer.hash(),
            tokenizer.hash()
        );
    }
    let finished = dir.join(layout::FINAL_MODEL).exists();
    if finished && now == was {
        let key = match stored.training.tokens {
            Some(_) => "training.tokens",
            None => "training.steps",
        };
        bail!(
            "{} has finished ({} exists): `--set {key}=N` with a larger N extends it",
            dir.display(),
            layout::FINAL_MODEL
        );
    }
    let checkpoints = dir.join(layout::CHECKPOINTS);
    checkpoint::remove_temporaries(dir);
    checkpoint::remove_temporaries(&checkpoints);
    // Legacy checkpoints are labelled by the run as it was trained, not as it is extended.
    let adopted = checkpoint::adopt_legacy(&checkpoints, recipe.checkpoint.interval, was)
        .map_err(|e| anyhow!(e))?;
    if !adopted.is_empty() {
        say!(
            "checkpoints {adopted:?} had no manifests (written by an older diffzoo): manifests written for them as they are"
        );
    }
    let (newest, rejected) = checkpoint::newest_with_warnings(&checkpoints);
    let Some(newest) = newest else {
        bail!(
            "{} has no checkpoint that verifies, nothing to resume from{}",
            dir.display(),
            checkpoint::rejected(&rejected)
        );
    };
    if finished && now > was && newest.step != was {
        bail!(
            "{} has finished, but its newest checkpoint that verifies holds step {} of {was}: \
             extending it would train again from there and drop the final model; export or copy \
             the run first, or extend a copy",
            dir.display(),
            newest.step
        );
    }
    checkpoint::remove_unfinished(&checkpoints, newest.number).map_err(|e| anyhow!(e))?;
    truncate_log(&dir.join(layout::METRICS), newest.step)?;
    if now > was {
        extend(dir, recipe, finished, was)?;
    }
    Ok(newest)
}

/// Extends a run to the recipe's (larger) number of steps: the recipe is rewritten with it, and
/// a finished run's final model, which its last checkpoint holds too, is removed (the run is
/// unfinished again). From the step it is at, the run follows the schedule of a run of the new
/// length: with `decay = "constant"` (or while still warming up) it is exactly the run that
/// was asked for that many steps from the start; a decaying rate jumps to that schedule's value.
fn extend(dir: &Path, recipe: &Recipe, finished: bool, was: usize) -> Result<()> {
    if finished {
        for name in [layout::FINAL_MODEL, layout::FINAL_SAFETENSORS] {
            let path = dir.join(name);
            if path.exists() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            }
        }
    }
    let path = dir.join(layout::RECIPE);
    checkpoint::write_whole(&path, recipe.with_absolute_paths().to_toml().as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    say!(
        "extending {} from {was} to {} steps (the schedule of a {}-step run from here on)",
        dir.display(),
        recipe.total_steps(),
        recipe.total_steps()
    );
    Ok(())
}

/// Drops metrics logged after `step` (by a run killed after its last checkpoint), and a line a
/// kill cut short. The log is replaced whole: a kill while it is rewritten loses nothing.
fn truncate_log(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("step")?.as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    checkpoint::write_whole(path, kept.as_bytes())
        .with_context(|| format!("rewriting {}", path.display()))
}

/// The optimizer: AdamW (decoupled decay) with no decay on parameters matching `no_decay`;
/// Burn's `AdamW`'s numbers, each parameter's update in one pass on Flex ([`adamw`]).
pub fn optimizer(o: &OptimizerSection) -> Result<burn::optim::ModuleOptimizer> {
    let adamw = |weight_decay: f64| {
        adamw::FusedAdamW::new(
            o.betas[0] as f32,
            o.betas[1] as f32,
            o.eps as f32,
            weight_decay as f32,
        )
    };
    let no_decay =
        ParamGroup::from_regex(&o.no_decay).map_err(|e| anyhow!("`optimizer.no_decay`: {e:?}"))?;
    Ok(ModuleOptimizer::from(adamw(o.weight_decay)).with_group(no_decay, adamw(0.0), None))
}

pub fn run(args: &TrainArgs) -> Result<Outcome> {
    let resolved = recipe::resolve(&args.recipe, &args.overrides)?;
    let seeds = match args.seeds.as_slice() {
        [] => resolved.recipe.training.seeds.clone(),
        given => given.to_vec(),
    };
    if !seeds.is_empty() {
        return over_seeds(args, &resolved.name, &seeds);
    }
    let mut claimed = None;
    let result = train(args, &mut claimed);
    // How the run ended, for `diffzoo watch` (a killed process leaves nothing: watch says so),
    // written while the run is still locked.
    if let Some((dir, lock)) = claimed {
        let end = match &result {
            Ok(Outcome::Done) => RunEnd::new("finished", None),
            Ok(Outcome::Stopped(why)) => RunEnd::new("stopped", Some(why.clone())),
            Err(e) => RunEnd::new("failed", Some(format!("{e:#}"))),
        };
        if let Err(e) = end.write(&dir) {
            eprintln!("warning: {e:#}");
        }
        drop(lock);
    }
    result
}

/// Whether the unfinished run in `dir` resumes from a checkpoint. A run stopped before its first
/// checkpoint was complete has nothing to keep and is cleared to train again (unless a `train`
/// still writes it: the lock refuses then); one whose checkpoints all fail to verify is refused.
pub fn resume_or_clear(dir: &Path) -> Result<bool> {
    let checkpoints = dir.join(layout::CHECKPOINTS);
    if checkpoint::resumable(&checkpoints) {
        return Ok(true);
    }
    if dir.exists() {
        let found = checkpoint::scan(&checkpoints);
        if found
            .iter()
            .any(|f| checkpoint::has_manifest(&checkpoints, f.number))
        {
            bail!(
                "{} has checkpoints but none verifies ({}); look at them, or delete the directory to train it again",
                dir.display(),
                checkpoint::describe(&found)
            );
        }
        let _lock = lock::RunLock::take(dir)?;
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    Ok(false)
}

/// Trains the recipe once per seed, each a run of its own in `OUT/seed-N` (`training.seed = N`),
/// in the order given, then prints the validation loss over the seeds. Every seed's directory is
/// checked before any trains; a stopped seed stops the rest (`--resume` continues: finished seeds
/// whose recipe is this one are skipped, the stopped one resumed).
fn over_seeds(args: &TrainArgs, name: &str, seeds: &[u64]) -> Result<Outcome> {
    if let Some(seed) = recipe::repeated_seed(seeds) {
        bail!("--seeds: {seed} is given twice");
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("runs").join(name));
    if out.join(layout::RECIPE).exists() {
        bail!(
            "{} holds a run without seeds: train over seeds into another --out (or train that \
             run with --set 'training.seeds=[]')",
            out.display()
        );
    }
    let seed_args = |seed: u64| {
        let mut one = args.clone();
        one.seeds.clear();
        one.out = Some(layout::seed_dir(&out, seed));
        one.overrides.push(format!("training.seed={seed}"));
        one.overrides.push("training.seeds=[]".into());
        one
    };
    // The seeds of one directory share one recipe: every seed there is checked, listed or not.
    // Those trained to this recipe's length, if finished, are skipped below.
    let mut full_length = Vec::new();
    for dir in layout::run_seeds(&out) {
        let stored = run::run_recipe(&dir)?;
        let given = recipe::resolve(&args.recipe, &seed_args(stored.training.seed).overrides)?;
        let conflicts = resume_conflicts(&stored, &given.recipe);
        if !conflicts.is_empty() {
            bail!(
                "{} was trained with another recipe; refusing to train the seeds of {} with this one:\n  {}",
                dir.display(),
                out.display(),
                conflicts.join("\n  ")
            );
        }
        // One length for every seed of the directory: an extension covers them all.
        let (was, now) = (stored.total_steps(), given.recipe.total_steps());
        let listed = seeds.contains(&stored.training.seed);
        if now < was || (now > was && !listed) {
            bail!(
                "{} trains for {was} steps, this recipe for {now}: the seeds of {} share one \
                 length (extend every seed at once, listing each in --seeds)",
                dir.display(),
                out.display()
            );
        }
        if now == was {
            full_length.push(stored.training.seed);
        }
    }
    let mut skip = Vec::with_capacity(seeds.len());
    for &seed in seeds {
        let dir = layout::seed_dir(&out, seed);
        let holds_run = dir.join(layout::RECIPE).exists();
        if holds_run && !args.resume {
            bail!(
                "{} already holds a run: pass --resume to continue the seeds, or --out for new ones",
                dir.display()
            );
        }
        // A finished seed is skipped unless this recipe extends it.
        skip.push(
            holds_run && dir.join(layout::FINAL_MODEL).exists() && full_length.contains(&seed),
        );
    }
    for (&seed, skip) in seeds.iter().zip(skip) {
        let dir = layout::seed_dir(&out, seed);
        if skip {
            say!("seed {seed}: {} has finished", dir.display());
            continue;
        }
        if signals::received().is_some() {
            say!("stopped before seed {seed}; the same command with --resume continues");
            let why = signals::received().unwrap_or("a signal");
            return Ok(Outcome::Stopped(format!("{why} before seed {seed}")));
        }
        say!("seed {seed}: training into {}", dir.display());
        let mut one = seed_args(seed);
        one.resume = args.resume && resume_or_clear(&dir)?;
        if let Outcome::Stopped(why) = run(&one)? {
            say!("stopped at seed {seed}; the same command with --resume continues");
            return Ok(Outcome::Stopped(format!("seed {seed}: {why}")));
        }
    }
    let losses: Option<Vec<f64>> = seeds
        .iter()
        .map(|&seed| {
            run::last_validation_loss(&run::metrics_records(&layout::seed_dir(&out, seed)))
        })
        .collect();
    match losses {
        Some(losses) => {
            let e = crate::stats::estimate(&losses);
            say!(
                "{}: validation loss over {} seeds {:.4}{}",
                out.display(),
                e.n,
                e.mean,
                e.spread(4, "seeds")
            );
        }
        None => say!("{}: a seed has no validation loss logged", out.display()),
    }
    Ok(Outcome::Done)
}

/// Trains; `claimed` holds the run directory and its lock once the directory is this run's.
/// What the user gave (devices, data, weights) is checked before the run directory is written.
fn train(args: &TrainArgs, claimed: &mut Option<(PathBuf, lock::RunLock)>) -> Result<Outcome> {
    let resolved = recipe::resolve(&args.recipe, &args.overrides)?;
    let recipe = &resolved.recipe;
    let dashboard = dashboard_shown(args, recipe);
    for note in &resolved.notes {
        say!("{}: {note}", resolved.source);
    }
    if let (Some(init), false) = (&recipe.training.init_from, args.resume) {
        crate::convert::check_start(Path::new(init), recipe)
            .with_context(|| format!("`training.init_from` of {}", resolved.source))?;
    }
    let (specs, devices, shares) = training_devices(args, &resolved)?;
    let (ranks, spec, device) = (specs.len(), specs.join(","), devices[0].clone());
    let dir = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("runs").join(&resolved.name));
    let data = TrainingData::open(args, &resolved)?;
    let train_device = device.autodiff();
    train_device.seed(recipe.training.seed);
    let model = initial_model(args, &resolved, &train_device)?;

    // What the user gave is checked: from here on the run directory is written.
    let resume_from = claim_run_dir(args, &dir, recipe, &data.tokenizer, claimed)?;
    // The epochs left end at multiples of the interval (a stopped run's checkpoint may not).
    let intervals = Intervals {
        first_epoch: resume_from.number + 1,
        first_step: resume_from.step,
        interval: recipe.checkpoint.interval,
        total: recipe.total_steps(),
    };
    let interrupter = Interrupter::new();
    let context = step_context(
        recipe,
        &dir,
        intervals,
        &interrupter,
        dashboard,
        data.valid_batches,
        &specs,
    )?;
    let trainee = Trainee {
        model,
        context: Some(context.clone()),
    };
    announce(&resolved, &spec, &dir, shares, ranks, &resume_from);

    let batches = loaders(recipe, data, intervals, devices, train_device, &context);
    let checkpoints = CheckpointWriter::new(
        &dir.join(layout::CHECKPOINTS),
        (resume_from.number > 0).then_some(resume_from),
        context.control.clone(),
    );
    let mut training = supervised(recipe, &dir, intervals, batches, &checkpoints, interrupter);
    // Before the dashboard takes the terminal: an exit at once restores the terminal as it is now.
    signals::install(dashboard);
    // The dashboard's stop goes through the context, which pauses every device at one step.
    training = training.renderer(if dashboard {
        Box::new(dashboard::Global::new(
            default_renderer(
                context.requests(),
                dashboard::Global::intervals_before(&intervals),
            ),
            intervals,
            ranks,
            format!("{} ({})", resolved.name, dir.display()),
        ))
    } else {
        Box::new(quiet::QuietRenderer)
    });
    if dashboard {
        signals::ctrl_c_interrupts_soon();
    }
    if resume_from.number > 0 {
        training = training.checkpoint(resume_from.number);
    }
    let scheduler = ModuleLrScheduler::new(ScheduleState::new(Schedule::from_recipe(recipe)));
    let result = training.launch(Learner::new(
        trainee,
        optimizer(&recipe.optimizer)?,
        scheduler,
    ));
    finish(args, recipe, &dir, &context, &checkpoints, result)
}

/// Whether the dashboard shows (asked for, on a terminal); says why not where it was asked for.
fn dashboard_shown(args: &TrainArgs, recipe: &Recipe) -> bool {
    let dashboard = !args.no_dashboard && std::io::stdout().is_terminal();
    if !args.no_dashboard && !dashboard {
        say!(
            "the dashboard is off: standard output is not a terminal; a line every {} steps (training.log_every)",
            recipe.training.log_every
        );
    }
    dashboard
}

/// Makes `dir` this run's: refuses a `--resume` of what is not a run directory, takes its lock,
/// prepares it (see [`prepare_run_dir`]) and clears the last run's outcome; `claimed` then holds
/// the directory and its lock. Returns the checkpoint to resume from (number 0: a fresh run).
fn claim_run_dir(
    args: &TrainArgs,
    dir: &Path,
    recipe: &Recipe,
    tokenizer: &TextTokenizer,
    claimed: &mut Option<(PathBuf, lock::RunLock)>,
) -> Result<Verified> {
    if args.resume && !dir.join(layout::RECIPE).exists() {
        bail!(
            "{} is not a run directory to resume (no {})",
            dir.display(),
            layout::RECIPE
        );
    }
    let mut lock = lock::RunLock::take(dir)?;
    let resume_from = prepare_run_dir(dir, recipe, tokenizer, args.resume)?;
    lock.claim()?;
    RunEnd::clear(dir)?;
    *claimed = Some((dir.to_path_buf(), lock));
    Ok(resume_from)
}

/// The learner's paradigm for a run in `dir`: the [`loaders`] and their strategy, the metrics
/// (λ per layer for DIFF V1), the verified checkpoints kept as the recipe says, `interrupter` to
/// stop it, as many epochs as `intervals` leave.
fn supervised(
    recipe: &Recipe,
    dir: &Path,
    intervals: Intervals,
    (train, valid, strategy): (StepLoader, StepLoader, ExecutionStrategy),
    checkpoints: &Arc<CheckpointWriter>,
    interrupter: Interrupter,
) -> SupervisedTraining<Trainee> {
    let mut training = SupervisedTraining::new(dir, Arc::new(train), Arc::new(valid))
        .metric_train(StepMetric::new(intervals.total, recipe.checkpoint.interval))
        .metric_train_numeric(StatMetric::loss())
        .metric_valid_numeric(StatMetric::loss())
        .metric_train_numeric(StatMetric::perplexity())
        .metric_valid_numeric(StatMetric::perplexity())
        .metric_train_numeric(LearningRateMetric::new())
        .metric_train_numeric(StatMetric::tokens_per_sec())
        .metric_train_numeric(StatMetric::grad_norm())
        .with_custom_checkpointers(
            checkpoints.part(checkpoint::PARTS[0]),
            checkpoints.part(checkpoint::PARTS[1]),
            checkpoints.part(checkpoint::PARTS[2]),
        )
        .with_checkpointing_strategy(KeepLastNCheckpoints::new(recipe.checkpoint.keep))
        .with_interrupter(interrupter)
        .with_training_strategy(strategy.into())
        .num_epochs(intervals.last_epoch());
    if recipe.model.attention == diffzoo_models::AttentionKind::Diff {
        for layer in 0..recipe.model.layers {
            training = training.metric_train_numeric(StatMetric::lambda(layer));
        }
    }
    training
}

/// What every step of a run in `dir` reports to and computes with: the recipe's schedule,
/// clipping, tokens per step, recomputation, precision and λ warm-up, the checkpoint
/// `intervals`, the `interrupter` that stops it, `valid_batches` validation batches at each
/// checkpoint with validation's attention on `specs`' first device (where validation runs),
/// the metrics log and TensorBoard's events, a line every `training.log_every` steps without
/// the dashboard, one share of each step per device.
fn step_context(
    recipe: &Recipe,
    dir: &Path,
    intervals: Intervals,
    interrupter: &Interrupter,
    dashboard: bool,
    valid_batches: usize,
    specs: &[String],
) -> Result<Arc<StepContext>> {
    let metrics = dir.join(layout::METRICS);
    let log = MetricsLog::open(&metrics)
        .with_context(|| format!("opening {}", metrics.display()))?
        .with_tensorboard(&dir.join(tensorboard::DIR), &metrics)
        .with_context(|| format!("writing {}", dir.join(tensorboard::DIR).display()))?;
    let context = StepContext::new(
        Schedule::from_recipe(recipe),
        recipe.optimizer.grad_clip,
        recipe.training.batch_tokens as u64,
        intervals,
        interrupter.clone(),
        (!dashboard).then_some(recipe.training.log_every),
        valid_batches,
        log,
    )
    .recomputing(recipe.training.recompute)
    .computing_in(recipe.training.precision.compute())
    .warming_up(recipe.training.warmup_steps())
    .validating_with(device::inference_attention(&specs[0]))
    .data_parallel(specs.len());
    Ok(Arc::new(context))
}

/// The loaders of a run's training and validation batches (on the first of `devices`, where
/// `train_device` is its autodiff view), and how the learner runs a step: on that device, or
/// data-parallel over all of them, each loading its share.
fn loaders(
    recipe: &Recipe,
    data: TrainingData,
    intervals: Intervals,
    devices: Vec<Device>,
    train_device: Device,
    context: &StepContext,
) -> (StepLoader, StepLoader, ExecutionStrategy) {
    let (micro, ranks, device) = (
        recipe.training.micro_batch,
        devices.len(),
        devices[0].clone(),
    );
    let mut train_loader = StepLoader::training(
        data.train,
        recipe.training.seed,
        recipe.batch_sequences(),
        micro,
        intervals,
        device.clone(),
    )
    .with_control(context.control.clone());
    if let Some(mixture) = data.mixture {
        train_loader = train_loader.with_mixture(mixture);
    }
    let strategy = if ranks == 1 {
        ExecutionStrategy::single(train_device)
    } else {
        train_loader = train_loader.data_parallel(ranks);
        ExecutionStrategy::ddp(
            devices.into_iter().map(Device::autodiff).collect(),
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        )
    };
    let valid_loader = StepLoader::validation(data.valid, micro, data.valid_batches, device)
        .with_control(context.control.clone());
    (train_loader, valid_loader, strategy)
}

/// The devices `train` runs on (`--devices`, `--device` or the recipe's), each set up for the
/// recipe's precision, with the names they were given and each device's share of a step's
/// micro-batches.
fn training_devices(
    args: &TrainArgs,
    resolved: &recipe::Resolved,
) -> Result<(Vec<String>, Vec<Device>, usize)> {
    let recipe = &resolved.recipe;
    let specs: Vec<String> = match (&args.device, args.devices.is_empty()) {
        (_, false) => args.devices.iter().map(|d| d.trim().to_string()).collect(),
        (Some(spec), true) => vec![spec.clone()],
        (None, true) => vec![recipe.training.device.clone()],
    };
    let shares = loader::shares(recipe.accumulation(), specs.len())
        .map_err(|e| anyhow!("{}: --devices {}: {e}", resolved.source, specs.join(",")))?;
    let precision = recipe.training.precision;
    let devices = device::parse_data_parallel(&specs, |device, spec| {
        configure_precision(device, precision, spec)
    })?;
    // Burn puts a resumed run's optimizer state on its default device (the CPU's: see
    // `cpu_default_device` in main.rs) before moving it to each parameter's: in the run's dtype.
    let mut default = Device::default();
    if args.resume && default != devices[0] {
        configure_float(
            &mut default,
            precision.storage(),
            precision.storage(),
            "Burn's default (BURN_DEVICE)",
            &format!("training.precision = \"{}\"", precision.name()),
        )?;
    }
    Ok((specs, devices, shares))
}

/// A run's data, opened and checked against its recipe.
struct TrainingData {
    tokenizer: TextTokenizer,
    train: Arc<TokenWindows>,
    valid: Arc<TokenWindows>,
    /// Validation batches at each checkpoint (`checkpoint.eval_batches`, at most the split).
    valid_batches: usize,
    /// Synthetic documents mixed into training windows (`data.needles`, `data.recall`).
    mixture: Option<Mixture>,
}

impl TrainingData {
    fn open(args: &TrainArgs, resolved: &recipe::Resolved) -> Result<Self> {
        let recipe = &resolved.recipe;
        let (tokenizer, shards) = run::open_data(recipe)?;
        if args.verify_data {
            let (files, bytes) = shards
                .verify()
                .with_context(|| format!("`data.corpus` = {:?}", recipe.data.corpus))?;
            say!(
                "verified {files} shard files ({bytes} bytes) of {}",
                shards.dir.display()
            );
        }
        if tokenizer.id_bound() > recipe.model.vocab_size {
            bail!(
                "{}: the tokenizer's ids run to {} but `model.vocab_size` = {} (`--set model.vocab_size={}` fixes it)",
                resolved.source,
                tokenizer.id_bound() - 1,
                recipe.model.vocab_size,
                tokenizer.id_bound()
            );
        }
        let seq = recipe.data.seq_len;
        let train = Arc::new(run::windows(&shards, Split::Train, seq)?);
        let valid = Arc::new(run::windows(&shards, Split::Validation, seq)?);
        if train.is_conversations()
            && (recipe.data.needles.is_some() || recipe.data.recall.is_some())
        {
            bail!(
                "{}: conversation shards train one conversation per window; `data.needles` and `data.recall` mix documents into plain text windows: drop them",
                shards.dir.display()
            );
        }
        let micro = recipe.training.micro_batch;
        if train.len() < recipe.batch_sequences() as u64 {
            bail!(
                "{}: the training split has {} windows of {seq} tokens, fewer than one batch ({})",
                shards.dir.display(),
                train.len(),
                recipe.batch_sequences()
            );
        }
        if valid.len() < micro as u64 {
            bail!(
                "{}: the validation split has {} windows of {seq} tokens, fewer than one micro-batch ({micro})",
                shards.dir.display(),
                valid.len()
            );
        }
        let valid_batches = recipe
            .checkpoint
            .eval_batches
            .min(valid.len() as usize / micro);
        let mixture = mixture(recipe, &tokenizer)?;
        Ok(Self {
            tokenizer,
            train,
            valid,
            valid_batches,
            mixture,
        })
    }
}

/// The model a run starts from: `training.init_from`'s weights, or a fresh initialisation (also
/// on resume, where the checkpoint's weights replace it).
fn initial_model(args: &TrainArgs, resolved: &recipe::Resolved, device: &Device) -> Result<Model> {
    let recipe = &resolved.recipe;
    Ok(match (&recipe.training.init_from, args.resume) {
        (Some(path), false) => {
            let (model, weights) =
                run::load_weights(Path::new(path), &recipe.model_config(), device)
                    .with_context(|| format!("`training.init_from` of {}", resolved.source))?;
            say!("initialised from {weights}");
            model
        }
        _ => recipe.model_config().init(device),
    })
}

/// Says what is about to train, where and how.
fn announce(
    resolved: &recipe::Resolved,
    spec: &str,
    dir: &Path,
    shares: usize,
    ranks: usize,
    resume_from: &Verified,
) {
    let recipe = &resolved.recipe;
    let params = recipe.model_config().param_count();
    say!(
        "{}: {} model, {:.2}M parameters ({:.2}M non-embedding), {} steps of {} tokens ({} micro-batches of {} × {}) on {spec}; run directory {}",
        resolved.name,
        recipe.model.attention,
        params.total as f64 / 1e6,
        params.non_embedding as f64 / 1e6,
        recipe.total_steps(),
        recipe.training.batch_tokens,
        recipe.accumulation(),
        recipe.training.micro_batch,
        recipe.data.seq_len,
        dir.display()
    );
    if recipe.training.recompute == Recompute::Block {
        say!(
            "blocks recomputed in the backward pass (training.recompute = \"block\"): each keeps only its input, one more forward pass per step"
        );
    }
    let precision = recipe.training.precision;
    if precision.compute().is_some() {
        say!(
            "mixed precision (training.precision = \"{}\"): forward and backward passes in bf16 from f32 master weights; gradients accumulated, clipped and all-reduced in f32, AdamW and its moments in f32",
            precision.name()
        );
    }
    if ranks > 1 {
        say!(
            "data parallel over {ranks} devices: {shares} micro-batches each per step, gradients averaged by all-reduce"
        );
    }
    if resume_from.number > 0 {
        say!(
            "resuming from checkpoint {} (step {})",
            resume_from.number,
            resume_from.step
        );
    }
}

/// What the learner's end means: a failure, a stop at a checkpoint to resume from, or the end
/// of the run, whose last checkpoint's model becomes the final model.
fn finish(
    args: &TrainArgs,
    recipe: &Recipe,
    dir: &Path,
    context: &StepContext,
    checkpoints: &CheckpointWriter,
    result: LearningResult<Trainee>,
) -> Result<Outcome> {
    let LearningResult {
        model,
        renderer,
        interrupted,
        error,
    } = result;
    // Leaves the dashboard's screen before anything is printed.
    drop(renderer);
    if let Some(failure) = context.failure() {
        bail!("{failure}");
    }
    if let Some(error) = error {
        bail!("training failed: {error}");
    }
    let total = recipe.total_steps();
    let done = context.control.steps_done();
    if done < total {
        let why = match context.control.paused() {
            Some((_, reason)) => reason,
            None => interrupted
                .and_then(|i| i.reason)
                .unwrap_or_else(|| "no reason given".into()),
        };
        if checkpoints.newest().is_none_or(|c| c.step != done) {
            bail!("training stopped at step {done} of {total} ({why}) without a checkpoint there");
        }
        let sets: String = args
            .overrides
            .iter()
            .map(|o| format!(" --set {o}"))
            .collect();
        say!(
            "stopped at step {done} ({why}); continue with `diffzoo train --recipe {}{sets} --out {} --resume`",
            args.recipe,
            dir.display()
        );
        return Ok(Outcome::Stopped(why));
    }
    // The final checkpoint's model file becomes the final model (one copy on disk).
    let last = checkpoints.newest().filter(|c| c.step == total).map(|c| {
        dir.join(layout::CHECKPOINTS)
            .join(checkpoint::part_name("model", c.number))
    });
    run::save_final(
        dir,
        &model.model,
        last.as_deref(),
        recipe.checkpoint.safetensors,
    )?;
    say!("done: {}", dir.join(layout::FINAL_MODEL).display());
    Ok(Outcome::Done)
}

/// The recipe's synthetic documents, if any, checked to fit its windows.
fn mixture(recipe: &Recipe, tokenizer: &TextTokenizer) -> Result<Option<Mixture>> {
    if let Some(needles) = &recipe.data.needles {
        let mix = needle_mix(recipe, needles, tokenizer)?;
        return Ok(Some(Mixture::Needles(Box::new(mix))));
    }
    let Some(recall) = &recipe.data.recall else {
        return Ok(None);
    };
    let vocab = Vocabulary::new(recipe.model.vocab_size)
        .context("`data.recall` with `model.vocab_size`")?;
    let eot = tokenizer.eot_id();
    if eot >= vocab.first_reserved() {
        bail!(
            "`data.recall` reserves ids {} and up of `model.vocab_size` = {}, and the tokenizer's \
             end-of-text token is {eot}: it would be a recall key token or value; a `model.vocab_size` of at \
             least {} keeps them apart",
            vocab.first_reserved(),
            recipe.model.vocab_size,
            tokenizer.id_bound() + recall::RESERVED as usize
        );
    }
    Ok(Some(Mixture::Recall(RecallMix {
        vocab,
        fraction: recall.fraction,
        max_pairs: recall.max_pairs,
        max_distractors: recall.max_distractors,
        answers_only: recall.loss == recipe::RecallLoss::Answers,
        seed: recipe.training.seed,
    })))
}

/// The recipe's needle mixture, checked to fit its windows.
fn needle_mix(
    recipe: &Recipe,
    needles: &NeedleSection,
    tokenizer: &TextTokenizer,
) -> Result<NeedleMix> {
    let mix = NeedleMix {
        tokenizer: tokenizer.clone(),
        fraction: needles.fraction,
        max_needles: needles.max_needles,
        digits: needles.digits,
        seed: recipe.training.seed,
    };
    let worst = mix.worst_case_tokens()?;
    if worst >= recipe.data.seq_len {
        bail!(
            "`data.needles.max_needles` = {}: its needles and questions can take {worst} tokens, \
             more than a window of `data.seq_len` = {}",
            needles.max_needles,
            recipe.data.seq_len
        );
    }
    Ok(mix)
}
