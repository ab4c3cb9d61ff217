//! `diffzoo sweep`: every recipe of a sweep (a recipe folder) into one sweep directory. Finished
//! runs are skipped, interrupted ones resumed; each run is a `diffzoo train` child process with
//! its output in `<run>/train.log`, so runs are isolated and `--jobs` runs them side by side.
//!
//! SIGINT or SIGTERM stops the sweep: each run in progress is sent SIGTERM (the children have
//! their own process group, so a Ctrl-C reaches them once, through the sweep), checkpoints and
//! stops, no further run starts, and the sweep exits with `train::RESUMABLE`; the same command
//! continues it.

use crate::Outcome;
use crate::recipe::{self, Recipe};
use crate::run;
use crate::train::{checkpoint, lock, signals};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct SweepArgs {
    /// A built-in recipe folder (e.g. mini/size-scaling) or a directory of recipe files.
    pub sweep: String,
    /// Sweep directory (default: runs/<sweep>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Runs trained at the same time.
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Device for every run (default: each recipe's).
    #[arg(long)]
    pub device: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// One row of the summary.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub recipe: String,
    pub attention: String,
    pub params: u64,
    pub params_paper: u64,
    pub tokens: u64,
    pub validation_loss: Option<f64>,
    pub wall_sec: Option<f64>,
    pub status: String,
}

/// The recipes of a sweep: (name for the run directory, `--recipe` argument).
fn members(sweep: &str) -> Result<Vec<(String, String)>> {
    let dir = Path::new(sweep);
    let mut found: Vec<(String, String)> = if dir.is_dir() {
        std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .map(|p| {
                let stem = p
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                (stem, p.display().to_string())
            })
            .collect()
    } else {
        let prefix = format!("{}/", sweep.trim_end_matches('/'));
        recipe::builtin_names()
            .into_iter()
            .filter_map(|n| {
                n.strip_prefix(&prefix)
                    .filter(|rest| !rest.contains('/'))
                    .map(|rest| (rest.to_string(), n.to_string()))
            })
            .collect()
    };
    found.sort();
    if found.is_empty() {
        bail!("`{sweep}` is neither a directory of recipes nor a built-in recipe folder");
    }
    Ok(found)
}

/// Summarises a run directory (finished or not).
pub fn summarize(run_dir: &Path, name: &str) -> Result<RunSummary> {
    let recipe: Recipe = run::run_recipe(run_dir)?;
    let derived = recipe.derived();
    let log = std::fs::read_to_string(run_dir.join(run::METRICS)).unwrap_or_default();
    let records: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let validation_loss = records
        .iter()
        .rev()
        .find(|r| r["split"] == "validation")
        .and_then(|r| r["loss"].as_f64());
    let status = if run_dir.join(run::FINAL_MODEL).exists() {
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
    })
}

/// Trains one member unless finished; returns whether it finished (else it was stopped by a
/// signal and can be resumed), or an error message on failure.
fn train_member(exe: &Path, run_dir: &Path, recipe: &str, device: Option<&str>) -> Result<bool> {
    if run_dir.join(run::FINAL_MODEL).exists() {
        return Ok(true);
    }
    let checkpoints = run_dir.join(run::CHECKPOINTS);
    let resume = checkpoint::resumable(&checkpoints);
    if !resume && run_dir.exists() {
        let found = checkpoint::scan(&checkpoints);
        if found
            .iter()
            .any(|f| checkpoint::has_manifest(&checkpoints, f.number))
        {
            bail!(
                "{recipe}: {} has checkpoints but none verifies ({}); look at them, or delete the directory to train it again",
                run_dir.display(),
                checkpoint::describe(&found)
            );
        }
        // Stopped before its first checkpoint was complete: nothing to keep, unless a `train`
        // is still writing it (the lock refuses then).
        let _lock = lock::RunLock::take(run_dir)?;
        std::fs::remove_dir_all(run_dir)
            .with_context(|| format!("clearing {}", run_dir.display()))?;
    }
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let log = std::fs::File::create(run_dir.join("train.log"))?;
    let mut command = Command::new(exe);
    command
        .args(["train", "--recipe", recipe, "--no-dashboard", "--out"])
        .arg(run_dir)
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0);
    if resume {
        command.arg("--resume");
    }
    if let Some(device) = device {
        command.args(["--device", device]);
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let mut forwarded = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if !forwarded && signals::received().is_some() {
            // SAFETY: kill sends a signal to our own child's process id.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            forwarded = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Stopped, or ended at once by a signal (the sweep's passed on, or one of its own before it
    // could stop): resumable from its checkpoints.
    let by_signal = |signal: libc::c_int| {
        status.signal() == Some(signal) || status.code() == Some(128 + signal)
    };
    if status.code() == Some(crate::train::RESUMABLE)
        || (forwarded && (by_signal(libc::SIGTERM) || by_signal(libc::SIGINT)))
    {
        return Ok(false);
    }
    if !status.success() {
        bail!(
            "{recipe} failed ({status}); see {}",
            run_dir.join("train.log").display()
        );
    }
    Ok(true)
}

pub fn run(args: &SweepArgs) -> Result<Outcome> {
    let members = members(&args.sweep)?;
    for (_, recipe) in &members {
        recipe::resolve(recipe, &[])?;
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("runs").join(args.sweep.trim_end_matches('/')));
    let exe = std::env::current_exe().context("locating the diffzoo executable")?;
    let queue = Mutex::new(members.iter());
    let failures = Mutex::new(Vec::new());
    let stopped = AtomicBool::new(false);
    signals::install(false);
    std::thread::scope(|scope| {
        for _ in 0..args.jobs.max(1) {
            scope.spawn(|| {
                loop {
                    if signals::received().is_some() || stopped.load(Ordering::SeqCst) {
                        break;
                    }
                    let Some((name, recipe)) = queue.lock().expect("queue").next() else {
                        break;
                    };
                    let run_dir = out.join(name);
                    eprintln!("sweep: {name}");
                    match train_member(&exe, &run_dir, recipe, args.device.as_deref()) {
                        Ok(true) => {}
                        Ok(false) => {
                            eprintln!("sweep: {name} stopped (resumable)");
                            stopped.store(true, Ordering::SeqCst);
                        }
                        Err(e) => failures.lock().expect("failures").push(format!("{e:#}")),
                    }
                }
            });
        }
    });
    let rows: Vec<RunSummary> = members
        .iter()
        .filter_map(|(name, _)| summarize(&out.join(name), name).ok())
        .collect();
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&rows)?,
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<28} {:<12} {:>10} {:>12} {:>10} {:>9}  status",
            "recipe", "attention", "params", "tokens", "val loss", "wall s"
        );
        for r in &rows {
            println!(
                "{:<28} {:<12} {:>9.2}M {:>12} {:>10} {:>9}  {}",
                r.recipe,
                r.attention,
                r.params as f64 / 1e6,
                r.tokens,
                r.validation_loss.map_or("-".into(), |l| format!("{l:.4}")),
                r.wall_sec.map_or("-".into(), |s| format!("{s:.0}")),
                r.status
            );
        }
    }
    let failures = failures.into_inner().expect("failures");
    if !failures.is_empty() {
        bail!("{} run(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
    if stopped.into_inner() || signals::received().is_some() {
        println!(
            "sweep stopped; the same `diffzoo sweep {}` command continues it",
            args.sweep
        );
        return Ok(Outcome::Stopped);
    }
    Ok(Outcome::Done)
}
