//! Slurm batch scripts for the work around training that spans machines: `sweep --slurm` (an
//! array task per run, then a job that summarises and fits) and `data prepare --slurm N` (the
//! tokenizer, an array task per part, the merge). The scripts are written into a `slurm/`
//! directory and printed with the `sbatch` lines that chain them; `--submit` runs those lines.
//!
//! Preemption and time limits: every task is requeueable (`--requeue`). A training task also
//! asks Slurm for SIGUSR1 to the batch shell 120 s before its limit (`--signal=B:USR1@120`); the
//! script passes it on to diffzoo as SIGTERM, diffzoo checkpoints at the end of the step in
//! progress and exits 75, and the script requeues its own task, which resumes from that
//! checkpoint. A requeue by Slurm (or a preemption under `PreemptMode=REQUEUE`) sends SIGTERM to
//! every process of the task: diffzoo checkpoints the same way (within the cluster's
//! `KillWait`) and Slurm requeues it. A `scancel` also checkpoints, and the task stays cancelled.
//! Data tasks keep nothing when stopped: a requeued one prepares its part again.

use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Exit status of a run stopped with a checkpoint (`train::RESUMABLE`), which the scripts
/// requeue after a time-limit signal.
const RESUMABLE: i32 = crate::train::RESUMABLE;
/// Seconds between the time-limit warning and the limit.
const WARNING: u64 = 120;
/// The shortest time limit taken: the warning, start-up, one step and a checkpoint.
const SHORTEST: u64 = 180;

#[derive(Debug, Clone, clap::Args)]
pub struct SlurmArgs {
    /// Slurm partition of every job (default: the cluster's default partition).
    #[arg(long, requires = "slurm")]
    pub partition: Option<String>,
    /// Slurm account charged.
    #[arg(long, requires = "slurm")]
    pub account: Option<String>,
    /// Time limit of each task: Slurm's [D-]HH:MM:SS, or auto (a GPU sweep's from the planner,
    /// else the partition's default).
    #[arg(long, default_value = "auto", requires = "slurm")]
    pub time: String,
    /// Array tasks running at once (default: as many as Slurm starts).
    #[arg(long, requires = "slurm")]
    pub max_parallel: Option<usize>,
    /// Submit the jobs with sbatch and print their ids (default: write and print the scripts
    /// and the sbatch lines).
    #[arg(long, requires = "slurm")]
    pub submit: bool,
}

impl SlurmArgs {
    /// The `#SBATCH` options every job gets; `time` is the limit worked out for the job
    /// (`None`: the partition's default).
    pub fn common(&self, time: Option<String>) -> Result<Vec<String>> {
        let mut options = Vec::new();
        if self.max_parallel == Some(0) {
            bail!("--max-parallel 0: expected at least 1");
        }
        for (flag, value) in [("partition", &self.partition), ("account", &self.account)] {
            if let Some(value) = value {
                check_word(&format!("--{flag}"), value)?;
                options.push(format!("--{flag}={value}"));
            }
        }
        if let Some(time) = time {
            options.push(format!("--time={time}"));
        }
        Ok(options)
    }

    /// `--time` checked: `None` for auto.
    pub fn fixed_time(&self) -> Result<Option<String>> {
        if self.time == "auto" {
            return Ok(None);
        }
        let seconds = parse_time(&self.time).with_context(|| format!("--time {}", self.time))?;
        if seconds < SHORTEST {
            bail!(
                "--time {}: at least {} minutes, so that a task warned {WARNING} s before its limit can still start, train a step and checkpoint (else it would requeue itself without end)",
                self.time,
                SHORTEST / 60
            );
        }
        Ok(Some(self.time.clone()))
    }
}

/// Seconds of a Slurm time limit: `[D-]HH:MM:SS`, `[D-]HH:MM`, `MM:SS` or minutes.
pub fn parse_time(text: &str) -> Result<u64> {
    let (days, clock) = match text.split_once('-') {
        Some((d, rest)) => (Some(d), rest),
        None => (None, text),
    };
    let number = |s: &str| -> Result<u64> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.len() > 6 {
            bail!("expected [D-]HH:MM:SS");
        }
        Ok(s.parse()?)
    };
    let fields = clock.split(':').map(number).collect::<Result<Vec<u64>>>()?;
    let seconds = match (days.is_some(), fields.as_slice()) {
        (false, [m]) => m * 60,
        (false, [m, s]) => m * 60 + s,
        (true, [h]) => h * 3600,
        (true, [h, m]) => h * 3600 + m * 60,
        (_, [h, m, s]) => h * 3600 + m * 60 + s,
        _ => bail!("expected [D-]HH:MM:SS"),
    };
    let seconds = seconds + days.map(number).transpose()?.unwrap_or(0) * 86_400;
    if seconds == 0 {
        bail!("a time limit must be positive");
    }
    Ok(seconds)
}

/// Slurm's `D-HH:MM:SS` for a number of seconds (rounded up to minutes).
pub fn format_time(seconds: f64) -> String {
    let minutes = (seconds / 60.0).ceil().max(1.0) as u64;
    let (days, hours, minutes) = (minutes / 1440, minutes / 60 % 24, minutes % 60);
    format!("{days}-{hours:02}:{minutes:02}:00")
}

/// A value that goes into an `#SBATCH` line must be one word.
fn check_word(flag: &str, value: &str) -> Result<()> {
    if value.is_empty()
        || !value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.,:@+=".contains(c))
    {
        bail!("{flag} {value:?}: expected a Slurm name (letters, digits and -_.,:@+=)");
    }
    Ok(())
}

/// A word for the shell, quoted when it needs to be.
pub fn quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./,:=@+%".contains(c))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A command line for the shell.
pub fn command_line<S: AsRef<str>>(words: &[S]) -> String {
    words
        .iter()
        .map(|w| quote(w.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `path` made absolute, as a job's command names it (a job runs in another directory).
pub fn absolute(path: &Path) -> Result<String> {
    Ok(std::path::absolute(path)
        .with_context(|| format!("resolving {}", path.display()))?
        .display()
        .to_string())
}

/// How a job waits for an earlier one of the same plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Starts when the earlier job (every task of an array) succeeded.
    Ok(usize),
    /// Starts when the earlier job ended, however it ended.
    Any(usize),
}

/// One batch job of a plan.
#[derive(Debug, Clone)]
pub struct Job {
    /// File stem and job name suffix.
    pub name: String,
    /// What the script says it does (comment lines at its top).
    pub about: Vec<String>,
    /// `#SBATCH` options beyond the common ones.
    pub options: Vec<String>,
    /// Array tasks (the script reads `$SLURM_ARRAY_TASK_ID`).
    pub array: Option<usize>,
    /// Shell lines run before the command (e.g. choosing the array task's run).
    pub setup: Vec<String>,
    /// The diffzoo command line.
    pub command: String,
    /// Whether the command stops with a checkpoint on SIGTERM (exit 75): then the task is
    /// warned before its time limit, passes signals on and requeues itself at the limit.
    pub resumable: bool,
    /// The earlier job this one waits for.
    pub after: Option<After>,
}

/// Jobs, their scripts and how they chain.
pub struct Plan {
    pub dir: PathBuf,
    pub jobs: Vec<Job>,
}

impl Plan {
    /// Writes each job's script into `dir` and either prints the sbatch lines or runs them;
    /// returns the job ids submitted (none when only printing).
    pub fn write_and_submit(&self, args: &SlurmArgs, common: &[String]) -> Result<Vec<String>> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let dir = std::path::absolute(&self.dir)
            .with_context(|| format!("resolving {}", self.dir.display()))?;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let mut paths = Vec::new();
        for job in &self.jobs {
            let path = dir.join(format!("{}.sbatch", job.name));
            let script = self.script(job, args, common, &logs)?;
            std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
            paths.push(path);
        }
        if !args.submit {
            for path in &paths {
                println!("# {}", path.display());
                print!(
                    "{}",
                    std::fs::read_to_string(path).with_context(|| path.display().to_string())?
                );
                println!();
            }
            println!("# submit with:");
            for (i, (job, path)) in self.jobs.iter().zip(&paths).enumerate() {
                let dependency = job
                    .after
                    .map(|after| format!("{} ", dependency(after, |j| format!("${{job{j}}}"))))
                    .unwrap_or_default();
                // `--parsable` prints `id;cluster` on a federation: the id is before the `;`.
                println!(
                    "job{i}=$(sbatch --parsable {dependency}{}); job{i}=${{job{i}%%;*}}",
                    quote(&path.display().to_string())
                );
            }
            return Ok(Vec::new());
        }
        let sbatch = which("sbatch").ok_or_else(|| {
            anyhow::anyhow!(
                "sbatch is not on PATH, so this machine cannot submit Slurm jobs; the scripts are in {} (submit them from a Slurm login node), or run the same command without --slurm to work on this machine alone",
                self.dir.display()
            )
        })?;
        let mut ids: Vec<String> = Vec::new();
        for (job, path) in self.jobs.iter().zip(&paths) {
            let mut command = Command::new(&sbatch);
            command.arg("--parsable");
            if let Some(after) = job.after {
                command.arg(dependency(after, |j| ids[j].clone()));
            }
            command.arg(path);
            let output = command
                .output()
                .with_context(|| format!("running {}", sbatch.display()))?;
            if !output.status.success() {
                let stderr = String::from_utf8_lossy(&output.stderr);
                bail!(
                    "sbatch {} failed ({}): {}{}",
                    path.display(),
                    output.status,
                    stderr.trim(),
                    if ids.is_empty() {
                        String::new()
                    } else {
                        format!(
                            "; jobs {} were submitted before it (scancel them if you fix and resubmit)",
                            ids.join(", ")
                        )
                    }
                );
            }
            let stdout = String::from_utf8_lossy(&output.stdout);
            let id = stdout
                .trim()
                .split(';')
                .next()
                .filter(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
                .with_context(|| {
                    format!("sbatch {} printed no job id: {stdout:?}", path.display())
                })?
                .to_string();
            println!("submitted {} as job {id}", job.name);
            ids.push(id);
        }
        Ok(ids)
    }

    fn script(
        &self,
        job: &Job,
        args: &SlurmArgs,
        common: &[String],
        logs: &Path,
    ) -> Result<String> {
        let mut s = String::from("#!/bin/bash\n");
        for line in &job.about {
            // A newline (from a file name) would end the comment.
            let line: String = line
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
            writeln!(s, "# {line}")?;
        }
        // `%` starts a Slurm file name pattern.
        let logs = logs.display().to_string().replace('%', "%%");
        let log = match job.array {
            Some(_) => format!("{logs}/{}-%A_%a.out", job.name),
            None => format!("{logs}/{}-%j.out", job.name),
        };
        let mut options = vec![format!("--job-name=diffzoo-{}", job.name)];
        if let Some(tasks) = job.array {
            let mut array = format!("--array=0-{}", tasks.saturating_sub(1));
            if let Some(k) = args.max_parallel {
                write!(array, "%{k}")?;
            }
            options.push(array);
        }
        options.extend(common.iter().cloned());
        options.extend(job.options.iter().cloned());
        let cwd = std::env::current_dir().context("reading the working directory")?;
        options.extend([
            format!("--chdir={}", cwd.display()),
            format!("--output={log}"),
            // A requeued task appends to its log rather than starting it again.
            "--open-mode=append".into(),
            "--requeue".into(),
        ]);
        if job.resumable {
            options.push(format!("--signal=B:USR1@{WARNING}"));
        }
        if matches!(job.after, Some(After::Ok(_))) {
            // Else a failed earlier job leaves this one pending for ever.
            options.push("--kill-on-invalid-dep=yes".into());
        }
        for option in options {
            // sbatch reads quotes, backslashes and `#` in these lines.
            if option
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || "'\"\\#".contains(c))
            {
                bail!(
                    "Slurm option {option:?}: paths in #SBATCH lines cannot hold whitespace, quotes, backslashes or #"
                );
            }
            writeln!(s, "#SBATCH {option}")?;
        }
        s.push_str("\nset -u\n");
        for line in &job.setup {
            writeln!(s, "{line}")?;
        }
        if !job.resumable {
            writeln!(s, "\nexec {}", job.command)?;
            return Ok(s);
        }
        let task = if job.array.is_some() {
            "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
        } else {
            "${SLURM_JOB_ID}"
        };
        write!(
            s,
            r#"
# Signals reach diffzoo as SIGTERM: it checkpoints at the end of the step in progress and exits
# {RESUMABLE}. Only the time-limit warning (USR1) requeues this task from here; a requeue by
# Slurm requeues it by itself, and a scancel leaves it cancelled. `wait` returns early when a
# signal arrives, so it is called again until diffzoo has exited.
timelimit=0
signalled=0
child=
trap 'signalled=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
trap 'signalled=1; timelimit=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' USR1
{command} &
child=$!
if [ "$signalled" -eq 1 ]; then kill -TERM "$child" 2>/dev/null; fi
while :; do
    signalled=0
    wait "$child"
    status=$?
    if [ "$signalled" -eq 0 ] || [ "$status" -le 128 ]; then break; fi
done
if [ "$status" -eq {RESUMABLE} ] && [ "$timelimit" -eq 1 ]; then
    echo "diffzoo stopped at the time limit with a checkpoint; requeueing {task}"
    scontrol requeue "{task}"
fi
exit "$status"
"#,
            command = job.command
        )?;
        Ok(s)
    }
}

/// `--dependency=afterok:ID` (or afterany) for the job `after` names, with ids from `id`.
fn dependency(after: After, id: impl Fn(usize) -> String) -> String {
    match after {
        After::Ok(j) => format!("--dependency=afterok:{}", id(j)),
        After::Any(j) => format!("--dependency=afterany:{}", id(j)),
    }
}

/// Slurm's state of each array task (`JOB_TASK`) it still knows: from `squeue` (jobs the
/// controller holds, finished ones for a few minutes) and else `sacct` (accounting), each used
/// when on PATH. Tasks neither knows are left out.
pub fn task_states(tasks: Vec<String>) -> std::collections::HashMap<String, String> {
    let mut states = std::collections::HashMap::new();
    let mut arrays: Vec<&str> = tasks.iter().filter_map(|t| t.split('_').next()).collect();
    arrays.sort();
    arrays.dedup();
    let run = |program: &str, args: &[&str]| -> Option<String> {
        let output = Command::new(which(program)?).args(args).output().ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
    };
    for array in arrays {
        let queued = run(
            "squeue",
            &["-h", "-r", "-t", "all", "-j", array, "-o", "%i|%T"],
        );
        let accounted = run(
            "sacct",
            &["-n", "-P", "-X", "-j", array, "-o", "JobID,State"],
        );
        // squeue first: it knows the current state of a task that was requeued.
        for text in [accounted, queued].into_iter().flatten() {
            for line in text.lines() {
                if let Some((task, state)) = line.split_once('|') {
                    states.insert(task.trim().to_string(), state.trim().to_string());
                }
            }
        }
    }
    states
}

/// The first executable `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The diffzoo executable, as the jobs run it (nodes share the file system with this one).
pub fn executable() -> Result<String> {
    Ok(std::env::current_exe()
        .context("locating the diffzoo executable")?
        .display()
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_limits_parse_as_slurm_reads_them() {
        assert_eq!(parse_time("90").unwrap(), 5400);
        assert_eq!(parse_time("01:30").unwrap(), 90);
        assert_eq!(parse_time("02:00:00").unwrap(), 7200);
        assert_eq!(parse_time("1-00").unwrap(), 86_400);
        assert_eq!(parse_time("1-02:03").unwrap(), 86_400 + 2 * 3600 + 180);
        assert_eq!(parse_time("2-00:00:01").unwrap(), 2 * 86_400 + 1);
        for bad in [
            "",
            "auto",
            "1:2:3:4",
            "-1",
            "1h",
            "00:00:00",
            "1-",
            "a-01:00:00",
        ] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
        assert_eq!(format_time(1.0), "0-00:01:00");
        assert_eq!(format_time(3.5 * 86_400.0 + 61.0), "3-12:02:00");
        for seconds in [60.0, 3599.0, 86_400.0, 1e6] {
            let text = format_time(seconds);
            let back = parse_time(&text).unwrap() as f64;
            assert!(back >= seconds && back < seconds + 60.0, "{text}");
        }
    }

    #[test]
    fn words_are_quoted_for_the_shell_and_slurm_names_checked() {
        assert_eq!(quote("runs/a-1"), "runs/a-1");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert!(check_word("--partition", "gpu-h100").is_ok());
        for bad in ["", "a b", "x\n#SBATCH --mem=1", "$(rm)"] {
            assert!(check_word("--partition", bad).is_err(), "{bad}");
        }
    }
}
