//! `diffzoo sweep`: every recipe of a sweep (a recipe folder) into one sweep directory. Finished
//! runs are skipped, interrupted ones resumed; each run is a `diffzoo train` child process with
//! its output in `<run>/train.log`, so runs are isolated and `--jobs` runs them side by side.

use crate::recipe::{self, Recipe};
use crate::run;
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

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

/// Trains one member unless finished; returns an error message on failure.
fn train_member(exe: &Path, run_dir: &Path, recipe: &str, device: Option<&str>) -> Result<()> {
    if run_dir.join(run::FINAL_MODEL).exists() {
        return Ok(());
    }
    let resume = !run::complete_checkpoints(run_dir).is_empty();
    if !resume && run_dir.exists() {
        // Interrupted before its first checkpoint: nothing to keep.
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
        .stderr(log);
    if resume {
        command.arg("--resume");
    }
    if let Some(device) = device {
        command.args(["--device", device]);
    }
    let status = command
        .status()
        .with_context(|| format!("starting {}", exe.display()))?;
    if !status.success() {
        bail!(
            "{recipe} failed ({status}); see {}",
            run_dir.join("train.log").display()
        );
    }
    Ok(())
}

pub fn run(args: &SweepArgs) -> Result<()> {
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
    std::thread::scope(|scope| {
        for _ in 0..args.jobs.max(1) {
            scope.spawn(|| {
                loop {
                    let Some((name, recipe)) = queue.lock().expect("queue").next() else {
                        break;
                    };
                    let run_dir = out.join(name);
                    eprintln!("sweep: {name}");
                    if let Err(e) = train_member(&exe, &run_dir, recipe, args.device.as_deref()) {
                        failures.lock().expect("failures").push(format!("{e:#}"));
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
    Ok(())
}
