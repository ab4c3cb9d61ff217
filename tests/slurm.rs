//! Against a real Slurm (Debian's slurm-wlm on this machine, started by `tests/slurm/start.sh`):
//! a sweep as a job array with a task requeued mid-run that resumes exactly and the fit job
//! after it; a cancelled task reported by `--status`; Slurm's own errors shown; partitioned
//! data preparation as an array, merged, equal to the single-machine result.
//!
//! The tests are ignored unless asked for: `tests/slurm/run.sh` starts Slurm, runs them and
//! stops it.

mod common;

use common::{ok, path};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs a Slurm client command, which must succeed.
fn slurm(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}; start Slurm with tests/slurm/run.sh"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The job ids `--submit` printed, in order.
fn submitted(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("submitted "))
        .map(|l| l.rsplit(' ').next().unwrap().to_string())
        .collect()
}

/// Slurm's state of every task of `job` (array tasks as `JOB_TASK`).
fn states(job: &str) -> HashMap<String, String> {
    slurm(
        "squeue",
        &["-h", "-r", "-t", "all", "-j", job, "-o", "%i|%T"],
    )
    .lines()
    .filter_map(|l| l.split_once('|'))
    .map(|(id, state)| (id.to_string(), state.to_string()))
    .collect()
}

fn wait_for(what: &str, seconds: u64, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(seconds),
            "waited {seconds} s for {what}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until `job` (not an array) has ended, and returns how.
fn wait_until_ended(job: &str, seconds: u64) -> String {
    let mut last = String::new();
    wait_for(&format!("job {job} to end"), seconds, || {
        last = states(job).get(job).cloned().unwrap_or_default();
        !matches!(
            last.as_str(),
            "" | "PENDING" | "RUNNING" | "CONFIGURING" | "COMPLETING" | "REQUEUED"
        )
    });
    last
}

fn records(run: &Path, split: &str) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r["split"] == split)
        .collect()
}

fn last_step(run: &Path) -> u64 {
    records(run, "train")
        .last()
        .and_then(|r| r["step"].as_u64())
        .unwrap_or(0)
}

/// A micro recipe of `steps` steps (about 130 a second in a debug build).
fn long_recipe(dir: &Path, steps: usize) -> PathBuf {
    let file = dir.join("long.toml");
    std::fs::write(
        &file,
        format!("extends = \"micro\"\n[training]\nsteps = {steps}\n[checkpoint]\ninterval = 500\n"),
    )
    .unwrap();
    file
}

#[test]
#[ignore = "needs a running Slurm: tests/slurm/run.sh"]
fn a_sweep_runs_as_an_array_a_requeued_task_resumes_exactly_and_the_fit_follows() {
    let tmp = tempfile::tempdir().unwrap();
    let recipes = tmp.path().join("recipes");
    std::fs::create_dir_all(&recipes).unwrap();
    for d in [16, 32, 48] {
        for attention in ["diff", "transformer"] {
            std::fs::write(
                recipes.join(format!("d{d}-{attention}.toml")),
                format!(
                    "extends = \"micro\"\n[model]\nattention = \"{attention}\"\nd_model = {d}\nlayers = 1\n[training]\nsteps = 6\n[checkpoint]\ninterval = 3\n"
                ),
            )
            .unwrap();
        }
    }
    let long = long_recipe(&recipes, 3000);
    let out = tmp.path().join("out");
    let sweep = |extra: &[&str]| {
        let mut args = vec!["sweep", path(&recipes), "--out", path(&out)];
        args.extend_from_slice(extra);
        ok(&args)
    };
    let ids = submitted(&sweep(&["--slurm", "--cpus-per-run", "1", "--submit"]));
    let [array, summary] = ids.as_slice() else {
        panic!("two jobs submitted: {ids:?}")
    };
    // Task 6 is `long` (runs in name order). Requeue it mid-run, as a preemption would.
    let task = format!("{array}_6");
    let run = out.join("long");
    wait_for("the long run to reach step 300", 300, || {
        last_step(&run) >= 300
    });
    slurm("scontrol", &["requeue", &task]);
    let ended = wait_until_ended(summary, 600);
    let logs = out.join("slurm/logs");
    let task_log = std::fs::read_to_string(logs.join(format!("sweep-{array}_6.out"))).unwrap();
    assert_eq!(ended, "COMPLETED", "the summary job: {task_log}");
    assert!(
        task_log.contains("long stopped (resumable)") && task_log.contains("DUE TO JOB REQUEUE"),
        "the task was requeued mid-run: {task_log}"
    );
    let status: Value = serde_json::from_str(&sweep(&["--status", "--json"])).unwrap();
    for row in status.as_array().unwrap() {
        assert_eq!(row["state"], "finished", "{status}");
    }
    assert_eq!(status[6]["slurm_job"], task.as_str());
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary.as_array().unwrap().len(), 7);
    assert!(
        std::fs::read_to_string(out.join("scaling.svg"))
            .unwrap()
            .starts_with("<svg")
    );
    // Resumed exactly: every logged loss equals an uninterrupted run's.
    let reference = tmp.path().join("reference");
    ok(&[
        "train",
        "--recipe",
        path(&long),
        "--out",
        path(&reference),
        "--no-dashboard",
    ]);
    for split in ["train", "validation"] {
        let steps_and_losses = |run: &Path| -> Vec<(u64, f64)> {
            records(run, split)
                .iter()
                .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
                .collect()
        };
        assert_eq!(
            steps_and_losses(&run),
            steps_and_losses(&reference),
            "{split}"
        );
    }
}

#[test]
#[ignore = "needs a running Slurm: tests/slurm/run.sh"]
fn a_cancelled_task_is_reported_and_slurms_errors_are_shown() {
    let tmp = tempfile::tempdir().unwrap();
    let recipes = tmp.path().join("recipes");
    std::fs::create_dir_all(&recipes).unwrap();
    long_recipe(&recipes, 100_000);
    let out = tmp.path().join("out");
    let base = ["sweep", path(&recipes), "--out", path(&out), "--slurm"];
    let message = common::fails(&[&base[..], &["--partition", "nosuch", "--submit"]].concat());
    assert!(
        message.contains("sbatch") && message.contains("nvalid partition"),
        "{message}"
    );
    let ids = submitted(&ok(&[&base[..], &["--submit"]].concat()));
    let array = &ids[0];
    let run = out.join("long");
    wait_for("the run to start", 300, || last_step(&run) >= 50);
    slurm("scancel", &[array]);
    wait_for("the task to be cancelled", 120, || {
        states(array)
            .get(&format!("{array}_0"))
            .is_some_and(|s| s == "CANCELLED")
    });
    let status: Value = serde_json::from_str(&ok(&[
        "sweep",
        path(&recipes),
        "--out",
        path(&out),
        "--status",
        "--json",
    ]))
    .unwrap();
    assert_eq!(status[0]["state"], "cancelled", "{status}");
    assert!(status[0]["step"].as_u64().unwrap() >= 50, "{status}");
    // The summary job still runs after it (afterany) and fails: a run is unfinished.
    assert_eq!(wait_until_ended(&ids[1], 120), "FAILED");
    let log = std::fs::read_dir(out.join("slurm/logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("summary-"))
        .unwrap();
    let text = std::fs::read_to_string(log).unwrap();
    assert!(
        text.contains("1 of 1 runs are not finished: long"),
        "{text}"
    );
}

#[test]
#[ignore = "needs a running Slurm: tests/slurm/run.sh"]
fn a_task_at_its_time_limit_checkpoints_requeues_itself_and_finishes() {
    let tmp = tempfile::tempdir().unwrap();
    let recipes = tmp.path().join("recipes");
    std::fs::create_dir_all(&recipes).unwrap();
    // About 60 s of training between the start and the warning: the first run is warned, the
    // second finishes (or is warned too on a slower machine and the third does).
    long_recipe(&recipes, 15_000);
    let out = tmp.path().join("out");
    // USR1 comes 120 s before the limit, about a minute after the start (Slurm checks every
    // 30 s or so).
    let ids = submitted(&ok(&[
        "sweep",
        path(&recipes),
        "--out",
        path(&out),
        "--slurm",
        "--time",
        "00:03:00",
        "--submit",
    ]));
    let task = format!("{}_0", ids[0]);
    let log = out.join(format!("slurm/logs/sweep-{task}.out"));
    wait_for("the task to requeue itself", 300, || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("requeueing"))
    });
    // One run is no scaling law: the summary job says so and succeeds, the run being finished.
    let ended = wait_until_ended(&ids[1], 600);
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(states(&ids[0])[&task], "COMPLETED", "{text}");
    assert_eq!(ended, "COMPLETED", "{text}");
    assert!(text.contains("long stopped (resumable)"), "{text}");
    assert!(out.join("long/model.bpk").exists(), "{text}");
    assert_eq!(last_step(&out.join("long")), 15_000);
}

/// Every token of a split of a shard directory, read through its manifest.
fn split_bytes(dir: &Path, split: &str) -> Vec<u8> {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    manifest[split]["shards"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| std::fs::read(dir.join(s["file"].as_str().unwrap())).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a running Slurm: tests/slurm/run.sh"]
fn data_prepared_as_an_array_of_parts_merges_to_the_single_machine_result() {
    let tmp = tempfile::tempdir().unwrap();
    let words = [
        "to", "be", "or", "not", "that", "is", "the", "question", "whether",
    ];
    let mut seed = 11u64;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let input = tmp.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    for f in 0..9 {
        let mut text = String::new();
        for _ in 0..(3 + next(25)) {
            let doc: Vec<&str> = (0..(5 + next(200)))
                .map(|_| words[next(9) as usize])
                .collect();
            text.push_str(&serde_json::json!({ "text": doc.join(" ") }).to_string());
            text.push('\n');
        }
        std::fs::write(input.join(format!("{f}.jsonl")), text).unwrap();
    }
    let options = ["--validation-every", "5", "--shard-tokens", "3000"];
    let parted = tmp.path().join("parted");
    let stdout = ok(&[
        &[
            "data",
            "prepare",
            "--input",
            path(&input),
            "--vocab-size",
            "300",
            "--out",
            path(&parted),
            "--slurm",
            "3",
            "--cpus-per-task",
            "1",
            "--submit",
        ][..],
        &options[..],
    ]
    .concat());
    let ids = submitted(&stdout);
    assert_eq!(ids.len(), 3, "tokenizer, parts, merge: {stdout}");
    assert_eq!(wait_until_ended(&ids[2], 600), "COMPLETED");
    for part in 0..3 {
        assert!(parted.join(format!("part-{part}/manifest.json")).exists());
    }
    let single = tmp.path().join("single");
    ok(&[
        &[
            "data",
            "prepare",
            "--input",
            path(&input),
            "--tokenizer",
            path(&parted.join("tokenizer-bpe-300.json")),
            "--out",
            path(&single),
        ][..],
        &options[..],
    ]
    .concat());
    for split in ["train", "validation"] {
        let (merged, one) = (split_bytes(&parted, split), split_bytes(&single, split));
        assert!(!one.is_empty());
        assert!(merged == one, "{split}: the merged tokens differ");
    }
    assert!(ok(&["data", "verify", path(&parted)]).contains("match manifest.json"));
}
