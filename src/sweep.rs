//! `diffzoo sweep`: every recipe of a sweep (a recipe folder) into one sweep directory. Finished
//! runs are skipped, interrupted ones resumed; each run is a `diffzoo train` child process with
//! its output in `<run>/train.log`, so runs are isolated and `--jobs` runs them side by side.
//! `--slurm` writes (and with `--submit` submits) the same work as a Slurm job array, one task
//! per unfinished run (`--only`), and a job after it that writes the summary and fits the
//! scaling law (`--summarize`); `--status` says where each run stands.
//!
//! SIGINT or SIGTERM stops the sweep: each run in progress is sent SIGTERM (the children have
//! their own process group, so a Ctrl-C reaches them once, through the sweep), checkpoints and
//! stops, no further run starts, and the sweep exits with `train::RESUMABLE`; the same command
//! continues it.

use crate::Outcome;
use crate::layout;
use crate::plan::{Fit, Gpu, Plan};
use crate::recipe;
use crate::run;
use crate::slurm::{self, After, Job, SlurmArgs};
use crate::stats;
use crate::train::{checkpoint, signals};
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
    /// Devices of every run, trained data-parallel on one machine (e.g. cuda:0,cuda:1).
    #[arg(long, value_delimiter = ',', conflicts_with = "device")]
    pub devices: Vec<String>,
    /// Train only this run of the sweep (what each Slurm array task does).
    #[arg(long, value_name = "RUN")]
    pub only: Option<String>,
    /// Train nothing: write summary.json and fit the scaling law over the runs (the Slurm
    /// job after the array).
    #[arg(long, conflicts_with_all = ["only", "slurm", "status"])]
    pub summarize: bool,
    /// Train every recipe once per seed (`training.seed`), each into RUN/seed-N, and summarise
    /// each recipe over its seeds: mean, standard deviation and 95% interval (e.g. 1,2,3);
    /// default: the recipes' `training.seeds`.
    #[arg(long, value_delimiter = ',', value_name = "N,…",
          value_parser = clap::value_parser!(u64).range(0..=i64::MAX as u64))]
    pub seeds: Vec<u64>,
    /// With --summarize: the scaling fit's x (params or tokens).
    #[arg(long, default_value = "params", value_parser = ["params", "tokens"])]
    pub fit_axis: String,
    /// Say where each run stands: finished, running, pending, stopped, failed (from the run
    /// directories, and from squeue and sacct when they are on PATH).
    #[arg(long, conflicts_with_all = ["only", "slurm"])]
    pub status: bool,
    /// Write a Slurm job array for the unfinished runs and a job that summarises after them
    /// (into OUT/slurm); with --submit, submit them.
    #[arg(long, conflicts_with = "only")]
    pub slurm: bool,
    #[command(flatten)]
    pub slurm_args: SlurmArgs,
    /// GPU each run gets, for the planner: h100, h200, a100 or a memory size in GB (with
    /// --slurm; without it, runs are CPU jobs).
    #[arg(long, requires = "slurm")]
    pub gpu: Option<String>,
    /// GPUs of each run (one node; more than one trains data-parallel).
    #[arg(long, default_value_t = 1, requires = "gpu")]
    pub gpus_per_run: usize,
    /// CPUs of each run's task (default: the partition's).
    #[arg(long, requires = "slurm", value_parser = clap::value_parser!(u64).range(1..))]
    pub cpus_per_run: Option<u64>,
    #[arg(long)]
    pub json: bool,
}

/// A recipe of a sweep over seeds: its validation loss over the seeds that finished.
#[derive(Debug, Clone, Serialize)]
pub struct SeedSummary {
    pub recipe: String,
    pub attention: String,
    pub params: u64,
    pub tokens: u64,
    /// The seeds whose runs finished with a validation loss.
    pub seeds: Vec<u64>,
    /// Mean, standard deviation and 95% interval over those seeds (`None` before any finished).
    pub validation_loss: Option<stats::Estimate>,
}

/// One run of a sweep.
#[derive(Debug, Clone)]
struct Member {
    /// The recipe's directory under the sweep's.
    run: String,
    /// The run directory under the sweep's (`RUN`, or `RUN/seed-N` in a sweep over seeds).
    name: String,
    /// The `--recipe` argument.
    recipe: String,
    /// `training.seed`, when the sweep is over seeds.
    seed: Option<u64>,
}

/// The sweep as given, with its seeds: `--seeds`, else those its recipes set (`training.seeds`),
/// which must then be one list for all (a sweep directory has one layout).
fn with_recipe_seeds(args: &SweepArgs) -> Result<SweepArgs> {
    let mut args = args.clone();
    if !args.seeds.is_empty() {
        return Ok(args);
    }
    let listed = |seeds: &[u64]| match seeds {
        [] => "no `training.seeds`".to_string(),
        seeds => format!("`training.seeds` = {seeds:?}"),
    };
    let mut first: Option<(String, Vec<u64>)> = None;
    for (_, recipe) in recipes(&args.sweep)? {
        let seeds = recipe::resolve(&recipe, &[])?.recipe.training.seeds;
        match &first {
            None => first = Some((recipe, seeds)),
            Some((other, theirs)) if *theirs != seeds => bail!(
                "{recipe} sets {} but {other} sets {}: a sweep trains every recipe over the same \
                 seeds (--seeds chooses them for all)",
                listed(&seeds),
                listed(theirs)
            ),
            Some(_) => {}
        }
    }
    args.seeds = first.map(|(_, seeds)| seeds).unwrap_or_default();
    Ok(args)
}

/// The runs of a sweep: each recipe, or each recipe once per seed.
fn members(args: &SweepArgs) -> Result<Vec<Member>> {
    if let Some(seed) = recipe::repeated_seed(&args.seeds) {
        bail!("--seeds: {seed} is given twice");
    }
    let recipes = recipes(&args.sweep)?;
    Ok(if args.seeds.is_empty() {
        recipes
            .into_iter()
            .map(|(name, recipe)| Member {
                run: name.clone(),
                name,
                recipe,
                seed: None,
            })
            .collect()
    } else {
        recipes
            .iter()
            .flat_map(|(name, recipe)| {
                args.seeds.iter().map(move |&seed| Member {
                    run: name.clone(),
                    name: layout::seed_name(name, seed),
                    recipe: recipe.clone(),
                    seed: Some(seed),
                })
            })
            .collect()
    })
}

/// The recipes of a sweep: (name for the run directory, `--recipe` argument).
fn recipes(sweep: &str) -> Result<Vec<(String, String)>> {
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

/// Trains one member unless finished; returns whether it finished (else it was stopped by a
/// signal and can be resumed), or an error message on failure.
fn train_member(exe: &Path, run_dir: &Path, member: &Member, args: &SweepArgs) -> Result<bool> {
    let recipe = member.recipe.as_str();
    if run_dir.join(layout::FINAL_MODEL).exists() {
        return Ok(true);
    }
    let resume = crate::train::resume_or_clear(run_dir).with_context(|| recipe.to_string())?;
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    // Appended to: a resumed run's log follows the interrupted one's.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join("train.log"))?;
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
    if let Some(seed) = member.seed {
        // One run of the seed: the recipe's own `training.seeds` are the sweep's.
        command.args(["--set", &format!("training.seed={seed}")]);
        command.args(["--set", "training.seeds=[]"]);
    }
    if let Some(device) = &args.device {
        command.args(["--device", device]);
    }
    if !args.devices.is_empty() {
        command.args(["--devices", &args.devices.join(",")]);
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
    let args = &with_recipe_seeds(args)?;
    let mut members = members(args)?;
    let mut planned = Vec::new();
    for member in &members {
        let steps = recipe::resolve(&member.recipe, &[])?.recipe.total_steps();
        planned.push(run::Planned {
            name: member.name.clone(),
            steps,
        });
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("runs").join(args.sweep.trim_end_matches('/')));
    check_layout(args, &members, &out)?;
    if args.status {
        return status(args, &members, &out).map(|()| Outcome::Done);
    }
    if args.summarize {
        return summarize_and_fit(args, &members, &out).map(|()| Outcome::Done);
    }
    run::write_sweep_plan(&out, &planned)?;
    if args.slurm {
        return slurm_jobs(args, &members, &out).map(|()| Outcome::Done);
    }
    if let Some(only) = &args.only {
        members.retain(|m| &m.name == only);
        if members.is_empty() {
            bail!("--only {only}: no such run in {}", args.sweep);
        }
    }
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
                    let Some(member) = queue.lock().expect("queue").next() else {
                        break;
                    };
                    let name = &member.name;
                    let run_dir = out.join(name);
                    eprintln!("sweep: {name}");
                    match train_member(&exe, &run_dir, member, args) {
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
    if args.only.is_none() {
        write_summary(args, &members, &out)?;
    }
    let failures = failures.into_inner().expect("failures");
    if !failures.is_empty() {
        bail!("{} run(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
    if stopped.into_inner() || signals::received().is_some() {
        println!(
            "sweep stopped; the same `diffzoo sweep {}{}` command continues it",
            args.sweep,
            seeds_suffix(args)
        );
        return Ok(Outcome::Stopped(
            signals::received().unwrap_or("a run stopped").to_string(),
        ));
    }
    Ok(Outcome::Done)
}

/// Refuses to mix the layouts in one sweep directory: a sweep without seeds over runs with
/// seeds (it would take RUN for an unfinished run of its own and clear it) and one with seeds
/// inside runs without (their seeds would hide in a run directory).
fn check_layout(args: &SweepArgs, members: &[Member], out: &Path) -> Result<()> {
    for member in members {
        let dir = out.join(&member.run);
        if args.seeds.is_empty() {
            if !layout::seed_dirs(&dir).is_empty() && !dir.join(layout::RECIPE).exists() {
                bail!(
                    "{}: holds runs over seeds (seed-N): give this sweep its --seeds, or another --out",
                    dir.display()
                );
            }
        } else if dir.join(layout::RECIPE).exists() {
            bail!(
                "{}: a run without seeds; a sweep over seeds needs another --out",
                dir.display()
            );
        }
    }
    Ok(())
}

/// Writes `summary.json` over every run directory there is and prints it.
fn write_summary(args: &SweepArgs, members: &[Member], out: &Path) -> Result<()> {
    let rows: Vec<run::RunSummary> = members
        .iter()
        .filter_map(|m| {
            let mut row = run::summarize(&out.join(&m.name), &m.name).ok()?;
            row.seed = m.seed;
            Some(row)
        })
        .collect();
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&rows)?,
    )
    .with_context(|| format!("writing {}", out.join("summary.json").display()))?;
    let over_seeds = (!args.seeds.is_empty())
        .then(|| over_seeds(members, &rows))
        .transpose()?;
    if let Some(seeds) = &over_seeds {
        std::fs::write(out.join(SEEDS), serde_json::to_string_pretty(seeds)?)
            .with_context(|| format!("writing {}", out.join(SEEDS).display()))?;
    }
    if args.json {
        let json = match &over_seeds {
            None => serde_json::to_value(&rows)?,
            Some(seeds) => serde_json::json!({ "runs": rows, "seeds": seeds }),
        };
        println!("{}", serde_json::to_string_pretty(&json)?);
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
        if let Some(seeds) = &over_seeds {
            println!(
                "\n{:<28} {:<12} {:>6} {:>10} {:>8}  95% interval",
                "recipe", "attention", "seeds", "val loss", "sd"
            );
            for r in seeds {
                let loss = r.validation_loss;
                println!(
                    "{:<28} {:<12} {:>6} {:>10} {:>8}  {}",
                    r.recipe,
                    r.attention,
                    r.seeds.len(),
                    loss.map_or("-".into(), |e| format!("{:.4}", e.mean)),
                    loss.and_then(|e| e.sd)
                        .map_or("-".into(), |sd| format!("{sd:.4}")),
                    match (loss.map(|e| e.n), loss.and_then(|e| e.ci95)) {
                        (_, Some([lo, hi])) => format!("{lo:.4} to {hi:.4}"),
                        (Some(1), None) => "- (one seed has no interval)".into(),
                        _ => "- (no seed finished)".into(),
                    },
                );
            }
        }
    }
    Ok(())
}

/// Where a sweep over seeds writes each recipe's summary over its seeds.
const SEEDS: &str = "seeds.json";

/// Each recipe's validation loss over the seeds that finished, in the sweep's order (every
/// recipe, also before any of its runs exists).
fn over_seeds(members: &[Member], rows: &[run::RunSummary]) -> Result<Vec<SeedSummary>> {
    let mut out: Vec<(SeedSummary, Vec<f64>)> = Vec::new();
    for member in members {
        let recipe = member.run.as_str();
        if out.iter().all(|(s, _)| s.recipe != recipe) {
            let resolved = recipe::resolve(&member.recipe, &[])?.recipe;
            let derived = resolved.derived();
            out.push((
                SeedSummary {
                    recipe: recipe.to_string(),
                    attention: resolved.model.attention.to_string(),
                    params: derived.params_total,
                    tokens: derived.tokens,
                    seeds: Vec::new(),
                    validation_loss: None,
                },
                Vec::new(),
            ));
        }
        let at = out.len() - 1;
        let row = rows.iter().find(|r| r.recipe == member.name);
        if let Some(run::RunSummary {
            seed: Some(seed),
            validation_loss: Some(loss),
            ..
        }) = row.filter(|r| r.status == "finished")
        {
            out[at].0.seeds.push(*seed);
            out[at].1.push(*loss);
        }
    }
    Ok(out
        .into_iter()
        .map(|(mut summary, losses)| {
            summary.validation_loss = (!losses.is_empty()).then(|| stats::estimate(&losses));
            summary
        })
        .collect())
}

/// `--summarize`: the summary, then the scaling fit and its plot (`OUT/scaling.svg`) when the
/// runs allow one. Fails when a run is unfinished, so that Slurm shows the sweep is not done.
fn summarize_and_fit(args: &SweepArgs, members: &[Member], out: &Path) -> Result<()> {
    write_summary(args, members, out)?;
    let plot = out.join("scaling.svg");
    let fit = crate::scaling::run(&crate::scaling::FitArgs {
        sweeps: vec![out.to_path_buf()],
        axis: args.fit_axis.clone(),
        plot: Some(plot.clone()),
        json: false,
    });
    match fit {
        Ok(()) => println!("scaling plot: {}", plot.display()),
        Err(e) => println!("no scaling fit: {e:#}"),
    }
    let unfinished: Vec<&str> = members
        .iter()
        .filter(|m| !out.join(&m.name).join(layout::FINAL_MODEL).exists())
        .map(|m| m.name.as_str())
        .collect();
    if !unfinished.is_empty() {
        bail!(
            "{} of {} runs are not finished: {} (`diffzoo sweep {} --out {}{} --status`)",
            unfinished.len(),
            members.len(),
            unfinished.join(", "),
            args.sweep,
            out.display(),
            seeds_suffix(args)
        );
    }
    Ok(())
}

/// Where `--slurm --submit` records the jobs it submitted, for `--status`.
const SUBMITTED: &str = "slurm/submitted.jsonl";

/// One submission of a sweep: the array's job id and the run each task trains.
#[derive(Debug, Serialize, serde::Deserialize)]
struct Submission {
    array: String,
    summary: String,
    runs: Vec<String>,
}

/// `--slurm`: a job array over the unfinished runs, then the summary and fit.
fn slurm_jobs(args: &SweepArgs, members: &[Member], out: &Path) -> Result<()> {
    let pending = pending(args, members, out)?;
    let resources = Resources::of(args, &pending)?;
    let exe = slurm::executable()?;
    let runs: Vec<String> = pending.iter().map(|m| m.name.clone()).collect();
    let sweep = match Path::new(&args.sweep) {
        dir if dir.is_dir() => slurm::absolute(dir)?,
        _ => args.sweep.clone(),
    };
    let out_abs = slurm::absolute(out)?;
    let mut task_about = vec![format!(
        "One task per unfinished run of {} ({} of {}), each trained (or resumed) into {out_abs}/RUN.",
        args.sweep,
        pending.len(),
        members.len()
    )];
    task_about.extend(resources.about);
    let jobs = jobs(
        args,
        &Commands {
            exe,
            sweep,
            out: out_abs,
            devices: resources.devices,
        },
        &runs,
        task_about,
        resources.options,
    );
    let common = args.slurm_args.common(resources.time)?;
    let ids = slurm::Plan {
        dir: out.join("slurm"),
        jobs,
    }
    .write_and_submit(&args.slurm_args, &common)?;
    if let [array, summary] = ids.as_slice() {
        record_submission(
            out,
            &Submission {
                array: array.clone(),
                summary: summary.clone(),
                runs,
            },
        )?;
        println!(
            "`diffzoo sweep {} --out {} --status` follows them",
            args.sweep,
            out.display()
        );
    }
    Ok(())
}

/// The members of the sweep without a final model in `out`; an error when there are none.
fn pending<'a>(args: &SweepArgs, members: &'a [Member], out: &Path) -> Result<Vec<&'a Member>> {
    let pending: Vec<&Member> = members
        .iter()
        .filter(|m| !out.join(&m.name).join(layout::FINAL_MODEL).exists())
        .collect();
    if pending.is_empty() {
        bail!(
            "nothing to run: the {} runs of {} in {} are finished (`diffzoo sweep {} --out {}{} --summarize` writes the summary and fit again)",
            members.len(),
            args.sweep,
            out.display(),
            args.sweep,
            out.display(),
            seeds_suffix(args)
        );
    }
    Ok(pending)
}

/// What each task of the array asks Slurm for, and what the job script says of it.
struct Resources {
    /// The tasks' sbatch options.
    options: Vec<String>,
    /// Lines of the job script's comment.
    about: Vec<String>,
    /// The `--devices` each task trains on (empty: the sweep's `--device`, or the default).
    devices: Vec<String>,
    /// The array's time limit (`None`: the partition's default).
    time: Option<String>,
}

impl Resources {
    /// The nodes, CPUs and GPUs of one task, and the array's time: `--time`, or with `--gpu` and
    /// `--time auto` the longest of the pending runs' plans with a margin.
    fn of(args: &SweepArgs, pending: &[&Member]) -> Result<Self> {
        let mut resources = Self {
            time: args.slurm_args.fixed_time()?,
            options: vec!["--nodes=1".to_string(), "--ntasks=1".into()],
            about: Vec::new(),
            devices: args.devices.clone(),
        };
        if let Some(cpus) = args.cpus_per_run {
            resources.options.push(format!("--cpus-per-task={cpus}"));
        }
        match &args.gpu {
            None => resources.about.push(
                "CPU runs (no --gpu given): each task trains on its node's CPUs.".to_string(),
            ),
            Some(spec) => resources.gpus(args, spec, pending)?,
        }
        if resources.time.is_none() && args.gpu.is_none() {
            resources
                .about
                .push("No --time: the partition's default limit applies.".into());
        }
        resources.about.push(
            "A task that reaches its limit checkpoints, is requeued and resumes where it stopped."
                .into(),
        );
        Ok(resources)
    }

    /// `--gpus-per-run` of `spec` for each task, every pending run planned on them
    /// ([`plan_each`]).
    fn gpus(&mut self, args: &SweepArgs, spec: &str, pending: &[&Member]) -> Result<()> {
        let gpus = args.gpus_per_run;
        if gpus == 0 {
            bail!("--gpus-per-run 0: a GPU run needs at least one");
        }
        let longest = plan_each(spec, gpus, pending, &mut self.about)?;
        self.options.push(format!("--gres=gpu:{gpus}"));
        // The task's GPUs are numbered from 0 on its node (CUDA_VISIBLE_DEVICES).
        if self.devices.is_empty() && args.device.is_none() {
            self.devices = (0..gpus).map(|i| format!("cuda:{i}")).collect();
        }
        if gpus > 1 {
            self.about.push(format!(
                "{gpus} GPUs per run on one node, data parallel (train --devices): Burn 0.22.1 trains no model across nodes."
            ));
        }
        if self.time.is_none() {
            self.time = match longest {
                // The longest plan with a quarter's margin and a quarter of an hour for
                // start-up and checkpoints; a run that needs longer is requeued and resumes.
                Some(days) => Some(slurm::format_time(days * 86_400.0 * 1.25 + 900.0)),
                None => {
                    self.about.push("The planner cannot time a GPU given by memory alone: the partition's default limit applies.".into());
                    None
                }
            };
        }
        Ok(())
    }
}

/// Each pending run planned on `gpus` × `spec`, a line of `about` each (its memory per GPU and
/// days); the longest plan in days (`None` where one cannot be timed). An error names every run
/// that cannot run as written.
fn plan_each(
    spec: &str,
    gpus: usize,
    pending: &[&Member],
    about: &mut Vec<String>,
) -> Result<Option<f64>> {
    let mut longest: Option<f64> = Some(0.0);
    let mut unfit = Vec::new();
    for Member { name, recipe, .. } in pending.iter().copied() {
        let resolved = recipe::resolve(recipe, &[])?;
        let plan = Plan::new(&resolved.recipe, Gpu::parse(spec)?, Some(gpus), 0.4)?;
        // A recipe that fits only with recomputation it does not turn on would run out
        // of memory as written: the recipe has to say so, not the sweep.
        if plan.fit == Fit::NeedsRecomputation {
            let m = &plan.memory;
            unfit.push(format!(
                "{name} cannot run on {gpus} × {} as written: it fits only with per-block recomputation, `training.recompute = \"block\"` in its [training] ({:.1} GB per GPU with it, {:.1} GB without)",
                plan.gpu.name,
                m.peak_recomputed() / 1e9,
                m.peak() / 1e9
            ));
            continue;
        }
        if !plan.runnable() {
            // The lines after memory and activations say why (the last one is FLOPs).
            let lines = plan.lines();
            let why = lines
                .get(2..lines.len().saturating_sub(1))
                .unwrap_or_default();
            unfit.push(format!(
                "{name} cannot run on {gpus} × {}: {}",
                plan.gpu.name,
                why.join("; ")
            ));
            continue;
        }
        let memory = plan.memory.peak();
        about.push(format!(
            "{name}: {:.1} GB per GPU{}",
            memory / 1e9,
            plan.days
                .map(|d| format!(", {d:.2} days planned at 40% MFU"))
                .unwrap_or_default()
        ));
        longest = longest.zip(plan.days).map(|(a, b)| a.max(b));
    }
    if !unfit.is_empty() {
        bail!(
            "{}\n(sweep a directory of the other recipes, set what a recipe is asked to, or ask for a larger --gpu or more --gpus-per-run)",
            unfit.join("\n")
        );
    }
    Ok(longest)
}

/// What the array's tasks and the summary job run: this executable's `sweep` of `sweep` (a
/// directory made absolute) into `out` (absolute).
struct Commands {
    exe: String,
    sweep: String,
    out: String,
    devices: Vec<String>,
}

/// The array (one task per run of `runs`, with `options`, described by `about`) and the summary
/// and fit after every task has ended.
fn jobs(
    args: &SweepArgs,
    commands: &Commands,
    runs: &[String],
    about: Vec<String>,
    options: Vec<String>,
) -> Vec<Job> {
    let Commands {
        exe,
        sweep,
        out,
        devices,
    } = commands;
    let mut words = vec![
        exe.clone(),
        "sweep".into(),
        sweep.clone(),
        "--out".into(),
        out.clone(),
    ];
    if let Some(device) = &args.device {
        words.extend(["--device".into(), device.clone()]);
    }
    if !devices.is_empty() {
        words.extend(["--devices".into(), devices.join(",")]);
    }
    let seeds = seeds_argument(args);
    words.extend(seeds.clone());
    vec![
        Job {
            name: "sweep".into(),
            about,
            options,
            array: Some(runs.len()),
            setup: vec![
                format!("runs=({})", slurm::command_line(runs)),
                "run=${runs[$SLURM_ARRAY_TASK_ID]}".into(),
            ],
            command: format!("{} --only=\"$run\"", slurm::command_line(&words)),
            resumable: true,
            after: None,
        },
        Job {
            name: "summary".into(),
            about: vec![
                "After every task has ended (however it ended): summary.json, the scaling fit and"
                    .into(),
                format!("its plot {out}/scaling.svg."),
            ],
            options: vec!["--nodes=1".into(), "--ntasks=1".into()],
            array: None,
            setup: Vec::new(),
            command: slurm::command_line(
                &[
                    exe.clone(),
                    "sweep".into(),
                    sweep.clone(),
                    "--out".into(),
                    out.clone(),
                    "--summarize".into(),
                    "--fit-axis".into(),
                    args.fit_axis.clone(),
                ]
                .into_iter()
                .chain(seeds)
                .collect::<Vec<_>>(),
            ),
            resumable: false,
            after: Some(After::Any(0)),
        },
    ]
}

/// Appends a submission to the sweep's [`SUBMITTED`], which `--status` reads.
fn record_submission(out: &Path, record: &Submission) -> Result<()> {
    use std::io::Write;
    let path = out.join(SUBMITTED);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(file, "{}", serde_json::to_string(record)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// `--seeds 1,2,3` as the sweep was given it (nothing without seeds).
fn seeds_argument(args: &SweepArgs) -> Vec<String> {
    if args.seeds.is_empty() {
        return Vec::new();
    }
    let seeds: Vec<String> = args.seeds.iter().map(u64::to_string).collect();
    vec!["--seeds".into(), seeds.join(",")]
}

/// ` --seeds 1,2,3` for the commands a message suggests.
fn seeds_suffix(args: &SweepArgs) -> String {
    seeds_argument(args)
        .iter()
        .map(|w| format!(" {w}"))
        .collect()
}

/// One row of `--status`.
#[derive(Debug, Serialize)]
struct RunStatus {
    run: String,
    state: String,
    step: Option<usize>,
    steps: usize,
    slurm_job: Option<String>,
}

/// `--status`: each run's state from its directory, and from Slurm for submitted tasks.
fn status(args: &SweepArgs, members: &[Member], out: &Path) -> Result<()> {
    let path = out.join(SUBMITTED);
    let mut task_of: std::collections::HashMap<String, String> = Default::default();
    if let Ok(text) = std::fs::read_to_string(&path) {
        for (i, line) in text.lines().enumerate() {
            // A line torn by a kill while it was written: the jobs it names are not followed.
            let Ok(record) = serde_json::from_str::<Submission>(line) else {
                eprintln!(
                    "warning: {}:{}: not a submission record; skipped",
                    path.display(),
                    i + 1
                );
                continue;
            };
            for (task, run) in record.runs.iter().enumerate() {
                task_of.insert(run.clone(), format!("{}_{task}", record.array));
            }
        }
    }
    let states = slurm::task_states(task_of.values().cloned().collect());
    let mut rows = Vec::new();
    for Member { name, recipe, .. } in members {
        let run_dir = out.join(name);
        let steps = recipe::resolve(recipe, &[])?.recipe.total_steps();
        let step = last_step(&run_dir);
        let job = task_of.get(name).cloned();
        let slurm_state = job.as_ref().and_then(|j| states.get(j)).map(String::as_str);
        let state = if run_dir.join(layout::FINAL_MODEL).exists() {
            "finished".to_string()
        } else {
            match slurm_state.map(|s| s.split_whitespace().next().unwrap_or(s)) {
                Some("RUNNING" | "COMPLETING") => "running".into(),
                Some("PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "CONFIGURING") => {
                    "pending".into()
                }
                Some("CANCELLED") => "cancelled".into(),
                Some(
                    other @ ("FAILED" | "TIMEOUT" | "NODE_FAIL" | "OUT_OF_MEMORY" | "BOOT_FAIL"
                    | "DEADLINE" | "PREEMPTED"),
                ) => format!("failed ({other})"),
                _ if checkpoint::resumable(&run_dir.join(layout::CHECKPOINTS)) => {
                    "stopped (resumable)".into()
                }
                _ if run_dir.exists() => "incomplete".into(),
                _ => "not started".into(),
            }
        };
        rows.push(RunStatus {
            run: name.clone(),
            state,
            step,
            steps,
            slurm_job: job,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("{:<28} {:<22} {:>15}  slurm job", "run", "state", "step");
    for r in &rows {
        println!(
            "{:<28} {:<22} {:>15}  {}",
            r.run,
            r.state,
            format!(
                "{}/{}",
                r.step.map_or("-".into(), |s| s.to_string()),
                r.steps
            ),
            r.slurm_job.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

/// The last training step a run logged.
fn last_step(run_dir: &Path) -> Option<usize> {
    run::metrics_records(run_dir)
        .iter()
        .rev()
        .find(|r| r["split"] == "train")
        .and_then(|r| r["step"].as_u64())
        .map(|s| s as usize)
}
