//! The fault-injection suite: `diffzoo train` killed at random moments, stopped by signals and
//! from the dashboard, its newest checkpoint torn or corrupted, its disk full, and a second
//! writer on its run. After each fault the run must resume and end exactly like an uninterrupted
//! run of the same recipe (the same training and validation losses at every step), and no fault
//! may end in a panic.

mod common;

use common::{command, fails, ok, path};
use serde_json::Value;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The exit status of a run stopped with a checkpoint to resume from.
const RESUMABLE: i32 = 75;

/// `train --recipe micro` with `sets`, into `out`.
fn train_args(out: &Path, sets: &[&str], resume: bool) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--recipe", "micro", "--no-dashboard", "--out"]
        .map(String::from)
        .to_vec();
    args.push(path(out).to_string());
    for set in sets {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    if resume {
        args.push("--resume".into());
    }
    args
}

fn train(out: &Path, sets: &[&str], resume: bool) -> String {
    let args = train_args(out, sets, resume);
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// A training run in the background, its output in `<out>.log`.
fn spawn(out: &Path, sets: &[&str], resume: bool) -> Child {
    let args = train_args(out, sets, resume);
    let log = std::fs::File::create(out.with_extension("log")).unwrap();
    command(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("the binary starts")
}

fn output(out: &Path) -> String {
    std::fs::read_to_string(out.with_extension("log")).unwrap_or_default()
}

/// `(split, step, loss)` of every record in the run's metrics log.
fn losses(run: &Path) -> Vec<(String, u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|r| {
            (
                r["split"].as_str().unwrap().to_string(),
                r["step"].as_u64().unwrap(),
                r["loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The last training step logged.
fn last_step(run: &Path) -> u64 {
    losses(run)
        .iter()
        .filter(|(split, ..)| split == "train")
        .map(|(_, step, _)| *step)
        .max()
        .unwrap_or(0)
}

/// The run ended like `reference`: every training and validation loss equal.
fn assert_same_run(run: &Path, reference: &Path) {
    let (got, want) = (losses(run), losses(reference));
    let first_difference = got
        .iter()
        .zip(&want)
        .position(|(a, b)| (&a.0, a.1) != (&b.0, b.1));
    assert!(
        got.len() == want.len() && first_difference.is_none(),
        "{}: {} records for {}; first different: {:?}",
        run.display(),
        got.len(),
        want.len(),
        first_difference.map(|i| (&got[i], &want[i]))
    );
    for ((split, step, a), (_, _, b)) in got.iter().zip(&want) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "{}: {split} loss at step {step}: {a} vs {b}",
            run.display()
        );
    }
    assert!(run.join("model.bpk").exists());
}

/// Waits until the run has logged training step `step`; panics if the process ends first.
fn wait_for_step(child: &mut Child, run: &Path, step: u64) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while last_step(run) < step {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("ended ({status}) before step {step}:\n{}", output(run));
        }
        assert!(Instant::now() < deadline, "no step {step} after 300 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, signal: libc::c_int) {
    // SAFETY: kill sends a signal to a child of this test.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
}

/// Steps held by each checkpoint's manifest.
fn manifest_steps(run: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(run.join("checkpoint")) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("manifest-") && name.ends_with(".json")
        })
        .map(|e| {
            let manifest: Value =
                serde_json::from_str(&std::fs::read_to_string(e.path()).unwrap()).unwrap();
            manifest["step"].as_u64().unwrap()
        })
        .collect();
    steps.sort_unstable();
    steps
}

/// The row `diffzoo watch RUN --once --json` shows for the run.
fn watched(run: &Path) -> Value {
    let rows: Value = serde_json::from_str(&ok(&["watch", path(run), "--once", "--json"])).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{rows}");
    rows[0].clone()
}

/// The run stopped with a resumable checkpoint at the step it says, and no final model.
fn assert_stopped(status: ExitStatus, run: &Path, signal: &str) -> u64 {
    let log = output(run);
    assert_eq!(status.code(), Some(RESUMABLE), "{log}");
    let line = log
        .lines()
        .find(|l| l.starts_with("stopped at step"))
        .unwrap_or_else(|| panic!("no stop line:\n{log}"));
    assert!(
        line.contains(&format!("({signal})")) && line.contains("--resume"),
        "{line}"
    );
    let step: u64 = line["stopped at step ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(manifest_steps(run).last(), Some(&step), "{log}");
    assert_eq!(last_step(run), step, "the log ends at the checkpoint");
    assert!(
        !run.join("model.bpk").exists(),
        "a stopped run has no final model"
    );
    step
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A copy of a finished run as if it had been killed right after checkpoint `keep_to`: the final
/// model, later checkpoints and later log lines gone.
fn killed_copy(finished: &Path, to: &Path, keep_to: usize, step: u64) {
    copy_dir(finished, to);
    std::fs::remove_file(to.join("model.bpk")).unwrap();
    for entry in std::fs::read_dir(to.join("checkpoint")).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // Checkpoint files are `<part>-<number>.<ext>` (`format` is the directory's marker).
        let number = name.split(['-', '.']).nth(1).and_then(|n| n.parse().ok());
        if number.is_some_and(|n: usize| n > keep_to) {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    let log = std::fs::read_to_string(to.join("metrics.jsonl")).unwrap();
    let kept: String = log
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
                <= step
        })
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(to.join("metrics.jsonl"), kept).unwrap();
}

/// A run of `sets` stopped twice by `stop` and then finished: `stop(round, run, resume, after)`
/// starts it (resuming after the first round), stops it once it has logged step `after` and
/// returns how it ended. Each stop must leave a resumable checkpoint where the log ends, before
/// the run's end and without a final model, and the finished run must have the losses of an
/// uninterrupted one.
fn stopped_twice_ends_exactly(
    sets: &[&str],
    total: u64,
    stop: impl Fn(usize, &Path, bool, u64) -> ExitStatus,
) {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    train(&reference, sets, false);
    let run = tmp.path().join("run");
    let mut stopped = 0;
    for round in 0..2 {
        let status = stop(round, &run, round > 0, stopped + 40);
        assert_eq!(status.code(), Some(RESUMABLE), "round {round}: {status:?}");
        let step = *manifest_steps(&run).last().unwrap();
        assert!(step > stopped && step < total, "round {round}: step {step}");
        assert_eq!(
            last_step(&run),
            step,
            "round {round}: the log ends at the checkpoint"
        );
        assert!(
            !run.join("model.bpk").exists(),
            "a stopped run has no final model"
        );
        stopped = step;
    }
    let log = train(&run, sets, true);
    assert!(log.contains("resuming from checkpoint"), "{log}");
    assert_same_run(&run, &reference);
    let args = train_args(&run, sets, true);
    assert!(fails(&args.iter().map(String::as_str).collect::<Vec<_>>()).contains("has finished"));
}

#[test]
fn signals_stop_at_a_step_with_a_checkpoint_and_resume_exactly() {
    let sets = ["training.steps=300", "checkpoint.interval=100"];
    // SIGTERM, then SIGINT after the resume.
    stopped_twice_ends_exactly(&sets, 300, |round, run, resume, after| {
        let (sig, name) = [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")][round];
        let mut child = spawn(run, &sets, resume);
        wait_for_step(&mut child, run, after);
        let row = watched(run);
        assert_eq!(row["state"], "running", "{row}");
        assert!(row["step"].as_u64() >= Some(after), "{row}");
        signal(&child, sig);
        let status = child.wait().unwrap();
        let step = assert_stopped(status, run, name);
        let row = watched(run);
        assert_eq!(
            (&row["state"], &row["resumable"], row["step"].as_u64()),
            (&Value::from("stopped"), &Value::from(true), Some(step)),
            "{row}"
        );
        // outcome.json says why.
        let outcome: Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("outcome.json")).unwrap())
                .unwrap();
        assert_eq!(
            (&outcome["state"], &outcome["reason"]),
            (&Value::from("stopped"), &Value::from(name)),
            "{outcome}"
        );
        status
    });
}

/// A mixed-precision run killed after its first checkpoint resumes exactly: the checkpoint holds
/// the f32 masters and moments, and each step recasts its bf16 copy from them. A bf16-pure run's
/// checkpoint (bf16 weights and moments) is not resumed as mixed: refused naming the key.
#[test]
fn a_mixed_precision_run_resumes_exactly_and_a_pure_one_is_not_resumed_as_mixed() {
    let tmp = tempfile::tempdir().unwrap();
    let mixed = ["training.precision=bf16-mixed"];
    let reference = tmp.path().join("reference");
    train(&reference, &mixed, false);
    let full = tmp.path().join("f32");
    train(&full, &[], false);
    assert_ne!(
        losses(&reference),
        losses(&full),
        "bf16-mixed computes in bf16"
    );
    let run = tmp.path().join("run");
    killed_copy(&reference, &run, 1, 10);
    let log = train(&run, &mixed, true);
    assert!(
        log.contains("resuming from checkpoint 1 (step 10)"),
        "{log}"
    );
    assert!(log.contains("mixed precision"), "{log}");
    assert_same_run(&run, &reference);

    let pure = tmp.path().join("pure");
    train(&pure, &["training.precision=bf16-pure"], false);
    let stopped = tmp.path().join("stopped");
    killed_copy(&pure, &stopped, 1, 10);
    let err = fails(
        &train_args(&stopped, &mixed, true)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(
        err.contains("training.precision = \"bf16-pure\" in the run, \"bf16-mixed\" now")
            && err.contains("--set training.precision=\"bf16-pure\"")
            && err.contains("training.init_from"),
        "{err}"
    );
}

/// A warm-up of the negative map (`training.lambda_warmup`) is a function of the step: a run
/// killed in the middle of it resumes at the scale it had reached and ends exactly like the
/// uninterrupted run, each step logging the scale it computed with.
#[test]
fn a_run_killed_in_its_lambda_warm_up_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let warmup = ["training.lambda_warmup=15"];
    let reference = tmp.path().join("reference");
    train(&reference, &warmup, false);
    let plain = tmp.path().join("plain");
    train(&plain, &[], false);
    assert_ne!(losses(&reference), losses(&plain), "the warm-up scales λ");
    let scales: Vec<f64> = std::fs::read_to_string(reference.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["split"] == "train")
        .map(|r| r["lambda_scale"].as_f64().unwrap())
        .collect();
    assert_eq!(scales.len(), 20);
    for (step, scale) in scales.iter().enumerate() {
        let want = (step as f64 / 15.0).min(1.0);
        assert!((scale - want).abs() < 1e-12, "step {step}: {scale}");
    }
    let run = tmp.path().join("run");
    killed_copy(&reference, &run, 1, 10);
    let log = train(&run, &warmup, true);
    assert!(
        log.contains("resuming from checkpoint 1 (step 10)"),
        "{log}"
    );
    assert_same_run(&run, &reference);
}

#[test]
fn a_second_signal_exits_at_once_and_a_repeated_one_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    // Steps of 1,024 micro-batches (seconds each): both signals come inside step 2. The first
    // waits a moment after step 1 is logged: sent at once, it may arrive before the end of step
    // 1 is handled, and the run stops there without a second step to interrupt.
    let sets = ["training.steps=10", "training.batch_tokens=131072"];
    for (gap, status) in [(1_500, 128 + libc::SIGTERM), (100, RESUMABLE)] {
        let run = tmp.path().join(format!("run-{gap}"));
        let mut child = spawn(&run, &sets, false);
        wait_for_step(&mut child, &run, 1);
        std::thread::sleep(Duration::from_millis(300));
        signal(&child, libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(gap));
        signal(&child, libc::SIGTERM);
        let got = child.wait().unwrap();
        assert_eq!(got.code(), Some(status), "{gap} ms apart: {}", output(&run));
    }
}

#[test]
fn sigkill_at_random_moments_then_resume_ends_like_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "training.steps=1000",
        "checkpoint.interval=5",
        "checkpoint.keep=2",
    ];
    let reference = tmp.path().join("reference");
    train(&reference, &sets, false);

    let run = tmp.path().join("run");
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut kills = 0;
    let mut resumed_at = Vec::new();
    for attempt in 0.. {
        assert!(attempt < 100, "no end after 100 attempts");
        // A kill before the first checkpoint leaves nothing to resume: start again.
        let resume = !manifest_steps(&run).is_empty();
        if !resume && run.exists() {
            std::fs::remove_dir_all(&run).unwrap();
        }
        let newest = manifest_steps(&run).last().copied().unwrap_or(0);
        let logged = last_step(&run);
        let mut child = spawn(&run, &sets, resume);
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let draw = state >> 33;
        // Even attempts die at a random moment of their first 0.6 s (start-up, resuming, the
        // first steps); odd ones after a random number (0–30) of new steps, wherever that falls
        // in the step and checkpoint cycle.
        let started = Instant::now();
        let due = |run: &Path| match attempt % 2 {
            0 => started.elapsed() >= Duration::from_millis(draw % 600),
            _ => last_step(run) >= logged.max(newest) + draw % 31,
        };
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if kills < 12 && due(&run) {
                signal(&child, libc::SIGKILL);
                child.wait().unwrap();
                if !manifest_steps(&run).is_empty() {
                    let row = watched(&run);
                    assert_eq!(
                        (&row["state"], &row["resumable"]),
                        (&Value::from("failed"), &Value::from(true)),
                        "{row}"
                    );
                    assert!(
                        row["detail"]
                            .as_str()
                            .unwrap()
                            .contains("recorded no outcome"),
                        "{row}"
                    );
                }
                break None;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let log = output(&run);
        if resume && let Some(line) = log.lines().find(|l| l.starts_with("resuming from")) {
            // Each resume continues from the newest checkpoint written before the kill.
            assert!(line.ends_with(&format!("(step {newest})")), "{line}");
            resumed_at.push(newest);
        }
        match status {
            None => kills += 1,
            Some(status) if status.success() => break,
            Some(status) => panic!("attempt {attempt} ended with {status}:\n{log}"),
        }
    }
    assert!(kills >= 10, "{kills} kills");
    assert!(
        resumed_at.windows(2).all(|w| w[0] <= w[1]) && resumed_at.len() >= 5,
        "resumed at {resumed_at:?}"
    );
    assert_same_run(&run, &reference);
    assert_eq!(watched(&run)["state"], "finished");
}

#[test]
fn a_torn_or_corrupted_newest_checkpoint_falls_back_to_the_one_before() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "training.steps=30",
        "checkpoint.interval=10",
        "checkpoint.keep=3",
    ];
    let reference = tmp.path().join("reference");
    train(&reference, &sets, false);

    let mut cases = 0;
    for file in [
        "model-3.bpk",
        "optim-3.bpk",
        "scheduler-3.bpk",
        "manifest-3.json",
    ] {
        for damage in ["truncated", "a flipped byte", "deleted"] {
            let run = tmp.path().join(format!("{file} {damage}"));
            killed_copy(&reference, &run, 3, 30);
            let target = run.join("checkpoint").join(file);
            let mut bytes = std::fs::read(&target).unwrap();
            match damage {
                "truncated" => bytes.truncate(bytes.len() / 2),
                "a flipped byte" => {
                    let middle = bytes.len() / 2;
                    bytes[middle] ^= 1;
                }
                _ => {}
            }
            if damage == "deleted" {
                std::fs::remove_file(&target).unwrap();
            } else {
                std::fs::write(&target, bytes).unwrap();
            }
            let out = command(
                &train_args(&run, &sets, true)
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>(),
            )
            .output()
            .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert!(out.status.success(), "{file} {damage}: {stdout}\n{stderr}");
            assert!(
                stderr.contains("warning: skipping checkpoint 3") && stderr.contains("-3."),
                "{file} {damage}: {stderr}"
            );
            assert!(
                stdout.contains("resuming from checkpoint 2 (step 20)"),
                "{file} {damage}: {stdout}"
            );
            assert_same_run(&run, &reference);
            cases += 1;
        }
    }
    assert_eq!(cases, 12);

    // Nothing verifies: an error naming every checkpoint and why.
    let run = tmp.path().join("none");
    killed_copy(&reference, &run, 3, 30);
    for n in 1..=3 {
        std::fs::write(run.join(format!("checkpoint/manifest-{n}.json")), "{").unwrap();
    }
    let err = fails(
        &train_args(&run, &sets, true)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(err.contains("no checkpoint that verifies"), "{err}");
    for n in 1..=3 {
        assert!(
            err.contains(&format!("checkpoint {n}: ")) && err.contains("not a checkpoint manifest"),
            "{err}"
        );
    }

    // A truncated final model names itself and the checkpoint holding the same weights; without
    // it, commands read that checkpoint and a resume writes the final model again.
    let run = tmp.path().join("truncated final");
    copy_dir(&reference, &run);
    let model = run.join("model.bpk");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&["eval", "ppl", "--run", path(&run)]);
    assert!(
        err.contains("model.bpk")
            && err.contains("truncated or damaged")
            && err.contains("checkpoint 3 holds the same weights (step 30"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_file(&model).unwrap();
    let loss = |run: &Path| -> Value {
        let out: Value =
            serde_json::from_str(&ok(&["eval", "ppl", "--run", path(run), "--json"])).unwrap();
        out["loss"].clone()
    };
    let want = loss(&reference);
    assert_eq!(loss(&run), want, "the checkpoint holds the final weights");
    let log = train(&run, &sets, true);
    assert!(
        log.contains("resuming from checkpoint 3 (step 30)"),
        "{log}"
    );
    assert!(model.exists());
    assert_eq!(loss(&run), want);
}

#[test]
fn a_run_killed_between_its_last_checkpoint_and_its_final_model_only_writes_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    // 25 steps in intervals of 10: the last checkpoint is at step 25, off the multiples.
    let sets = ["training.steps=25", "checkpoint.interval=10"];
    let reference = tmp.path().join("reference");
    train(&reference, &sets, false);
    let run = tmp.path().join("run");
    killed_copy(&reference, &run, 3, 25);
    let log = train(&run, &sets, true);
    assert!(
        log.contains("resuming from checkpoint 3 (step 25)"),
        "{log}"
    );
    assert_same_run(&run, &reference);
    assert!(!run.join("checkpoint/manifest-4.json").exists());
}

#[test]
fn a_full_disk_stops_training_with_a_clear_error_and_the_last_checkpoint_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "training.steps=40",
        "checkpoint.interval=10",
        "checkpoint.keep=1",
    ];
    let reference = tmp.path().join("reference");
    let mut keep_all = sets;
    keep_all[2] = "checkpoint.keep=4";
    train(&reference, &keep_all, false);
    // keep = 1: checkpoint 2 is the only one, and its deletion is asked for as 3 is written.
    let run = tmp.path().join("run");
    killed_copy(&reference, &run, 2, 20);
    let recipe = std::fs::read_to_string(run.join("recipe.toml")).unwrap();
    assert!(recipe.contains("keep = 4"), "{recipe}");
    std::fs::write(
        run.join("recipe.toml"),
        recipe.replace("keep = 4", "keep = 1"),
    )
    .unwrap();
    for name in [
        "model-1.bpk",
        "optim-1.bpk",
        "scheduler-1.bpk",
        "manifest-1.json",
    ] {
        std::fs::remove_file(run.join("checkpoint").join(name)).unwrap();
    }

    // Files may not grow past 300 kB: the optimizer's (≈ 480 kB) cannot be written.
    let args = train_args(&run, &sets, true);
    let mut full = command(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // SAFETY: setrlimit and signal are async-signal-safe.
    unsafe {
        full.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 300_000,
                rlim_max: 300_000,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let out = full.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("cannot write checkpoint 3")
            && stderr.contains("optim-3.bpk")
            && stderr.contains("checkpoint 2 (step 20) is intact"),
        "{stderr}"
    );
    let left: Vec<String> = std::fs::read_dir(run.join("checkpoint"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("-3.") || name.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(manifest_steps(&run), vec![20]);

    // Space again: it resumes from checkpoint 2 and ends like the uninterrupted run.
    let log = train(&run, &sets, true);
    assert!(
        log.contains("resuming from checkpoint 2 (step 20)"),
        "{log}"
    );
    assert_same_run(&run, &reference);
}

#[test]
fn a_second_train_on_a_live_run_is_refused_and_a_dead_ones_lock_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = ["training.steps=100000"];
    let run = tmp.path().join("run");
    let mut first = spawn(&run, &sets, false);
    wait_for_step(&mut first, &run, 15);
    let args = train_args(&run, &sets, true);
    let err = fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("is being trained by another process")
            && err.contains(&format!("process {}", first.id())),
        "{err}"
    );
    signal(&first, libc::SIGKILL);
    first.wait().unwrap();
    // The killed process's lock is taken over: the run resumes (and is stopped again).
    let mut second = spawn(&run, &sets, true);
    let resumed = last_step(&run);
    wait_for_step(&mut second, &run, resumed + 5);
    signal(&second, libc::SIGTERM);
    assert_stopped(second.wait().unwrap(), &run, "SIGTERM");
    assert!(output(&run).contains("resuming from checkpoint"));
}

/// A child on a new pseudo-terminal, as a user's shell would run it; returns it and the
/// terminal's master side (whatever the child draws is read and dropped by a thread).
fn spawn_on_terminal(args: &[String]) -> (Child, std::fs::File) {
    let (mut master, mut slave) = (0, 0);
    let size = libc::winsize {
        ws_row: 40,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty fills two descriptors this function then owns.
    let opened = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(opened, 0, "openpty");
    // SAFETY: both descriptors were just opened and are owned here only.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut command = command(&args.iter().map(String::as_str).collect::<Vec<_>>());
    command
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    // SAFETY: setsid and ioctl are async-signal-safe; the terminal becomes the child's
    // controlling terminal, so that Ctrl-C reaches it as SIGINT.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            libc::ioctl(0, libc::TIOCSCTTY, 0);
            Ok(())
        });
    }
    let child = command.spawn().expect("the binary starts");
    let master = std::fs::File::from(master);
    let mut reader = master.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut buffer = [0; 4096];
        while matches!(reader.read(&mut buffer), Ok(n) if n > 0) {}
    });
    (child, master)
}

#[test]
fn the_dashboards_stop_and_ctrl_c_in_it_leave_a_resumable_run() {
    let sets = ["training.steps=300", "checkpoint.interval=100"];
    // `q` opens the quit menu and `s` stops; then Ctrl-C (the terminal's interrupt character).
    let keys: [&[&[u8]]; 2] = [&[b"q", b"s"], &[b"\x03"]];
    stopped_twice_ends_exactly(&sets, 300, |round, run, resume, after| {
        let mut args = train_args(run, &sets, resume);
        args.retain(|a| a != "--no-dashboard");
        let (mut child, mut terminal) = spawn_on_terminal(&args);
        wait_for_step(&mut child, run, after);
        for key in keys[round] {
            terminal.write_all(key).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        }
        let status = child.wait().unwrap();
        assert!(status.signal().is_none(), "round {round}: {status:?}");
        status
    });
}

/// Runs the binary, which must refuse with status 1 (never a panic's 101) and an error holding
/// every one of `needles`.
fn refused(args: &[&str], needles: &[&str]) {
    let out = command(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: no {needle:?} in {stderr}"
        );
    }
}

#[test]
fn corrupted_data_weights_and_paths_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("texts");
    std::fs::create_dir(&text).unwrap();
    let line = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. ";
    for i in 0..40 {
        std::fs::write(text.join(format!("{i}.txt")), line.repeat(4 + i % 7)).unwrap();
    }
    let prepare = |out: &Path, input: &Path| {
        ok(&[
            "data",
            "prepare",
            "--input",
            path(input),
            "--vocab-size",
            "300",
            "--out",
            path(out),
            "--validation-every",
            "5",
            "--shard-tokens",
            "4096",
        ])
    };
    let good = tmp.path().join("good");
    prepare(&good, &text);
    let micro =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/micro.toml"))
            .unwrap()
            .replace("tokenizer = \"bpe\"\n", "")
            .replace("vocab_size = 512", "vocab_size = 300")
            .replace("steps = 20", "steps = 4");
    let on = |shards: &Path| {
        let recipe = tmp.path().join(format!(
            "on-{}.toml",
            shards.file_name().unwrap().to_string_lossy()
        ));
        let text = micro.replace(
            "corpus = \"embedded\"",
            &format!("corpus = {:?}", path(shards)),
        );
        std::fs::write(&recipe, text).unwrap();
        recipe
    };
    let out = tmp.path().join("run");
    let good_recipe = on(&good);
    let log = ok(&[
        "train",
        "--recipe",
        path(&good_recipe),
        "--out",
        path(&out),
        "--no-dashboard",
        "--verify-data",
    ]);
    assert!(log.contains("verified"), "{log}");
    assert!(ok(&["data", "verify", path(&good)]).contains("match manifest.json"));

    let shard = |dir: &Path| -> std::path::PathBuf {
        let manifest: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap())
                .unwrap();
        dir.join(manifest["train"]["shards"][0]["file"].as_str().unwrap())
    };
    let copy = |name: &str| {
        let dir = tmp.path().join(name);
        copy_dir(&good, &dir);
        dir
    };
    let train_on = |dir: &Path, extra: &[&str]| -> Vec<String> {
        let recipe = on(dir);
        let run = tmp.path().join(format!(
            "run-{}",
            dir.file_name().unwrap().to_string_lossy()
        ));
        let mut args: Vec<String> = ["train", "--recipe", path(&recipe), "--out", path(&run)]
            .map(String::from)
            .to_vec();
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    };

    // A flipped byte: same size, another checksum; found by `data verify` and --verify-data.
    let flipped = copy("flipped");
    let file = shard(&flipped);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    refused(&["data", "verify", path(&flipped)], &[&name, "corrupted"]);
    let args = train_on(&flipped, &["--verify-data"]);
    refused(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &["`data.corpus`", &name, "corrupted"],
    );
    // A torn shard, a garbled manifest, no manifest, a broken or foreign tokenizer.
    let torn = copy("torn");
    let file = shard(&torn);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let garbled = copy("garbled");
    std::fs::write(garbled.join("manifest.json"), "{\"format\": ").unwrap();
    let bare = copy("bare");
    std::fs::remove_file(bare.join("manifest.json")).unwrap();
    let broken = copy("broken");
    std::fs::write(broken.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let foreign = copy("foreign");
    let other = tmp.path().join("other");
    std::fs::write(
        tmp.path().join("other.txt"),
        "Quite another text altogether. ".repeat(300),
    )
    .unwrap();
    prepare(&other, &tmp.path().join("other.txt"));
    std::fs::copy(other.join("tokenizer.json"), foreign.join("tokenizer.json")).unwrap();
    for (dir, needles) in [
        (&torn, vec![name.as_str(), "bytes, the manifest says"]),
        (&garbled, vec!["manifest.json", "invalid manifest"]),
        (&bare, vec!["not a shard directory"]),
        (&broken, vec!["tokenizer.json", "not a usable tokenizer"]),
        (&foreign, vec!["made with tokenizer"]),
    ] {
        let args = train_on(dir, &[]);
        let mut needles = needles;
        needles.push("`data.corpus`");
        refused(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &needles,
        );
        let run = tmp.path().join(format!(
            "run-{}",
            dir.file_name().unwrap().to_string_lossy()
        ));
        assert!(
            !run.exists(),
            "{}: a refused run writes nothing",
            dir.display()
        );
    }

    // Paths and values, each named by its key.
    let model = out.join("model.bpk");
    let garbage = tmp.path().join("garbage.bin");
    std::fs::write(&garbage, "not weights").unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    for (set, needles) in [
        (
            "data.tokenizer=/no/tok.json",
            vec!["`data.tokenizer` = \"/no/tok.json\""],
        ),
        (
            "data.corpus=/no/such/dir",
            vec!["`data.corpus` = \"/no/such/dir\"", "no such"],
        ),
        ("model.vocab_size=1", vec!["`model.vocab_size` = 1"]),
        (
            "model.embedding_std=-1",
            vec!["`model.embedding_std` must be positive"],
        ),
        (
            "training.init_from=/no/model.bpk",
            vec!["`training.init_from`", "/no/model.bpk"],
        ),
        (
            &format!("training.init_from={}", path(&garbage)),
            vec!["`training.init_from`", "garbage.bin"],
        ),
    ] {
        refused(
            &[
                "train",
                "--recipe",
                "micro",
                "--set",
                set,
                "--out",
                path(&elsewhere),
            ],
            &needles,
        );
        assert!(!elsewhere.exists(), "{set}: a refused run writes nothing");
    }
    // Weights of another shape (a 300-token model into a 512-token one).
    let init = format!("training.init_from={}", path(&model));
    refused(
        &[
            "train",
            "--recipe",
            "micro",
            "--set",
            &init,
            "--out",
            path(&elsewhere),
        ],
        &["`training.init_from`", "shape mismatch"],
    );
    // A tokenizer.json named by the recipe that is not one.
    let set = format!("data.tokenizer={}", path(&broken.join("tokenizer.json")));
    refused(
        &[
            "train",
            "--recipe",
            "micro",
            "--set",
            &set,
            "--out",
            path(&elsewhere),
        ],
        &["`data.tokenizer`", "not a usable tokenizer"],
    );
    // No duplicated I/O messages.
    let out = command(&[
        "train",
        "--recipe",
        "micro",
        "--set",
        "data.tokenizer=/no/tok.json",
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("No such file").count(), 1, "{stderr}");
}

#[test]
fn a_signalled_sweep_stops_its_run_resumably_and_the_same_command_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let recipes = tmp.path().join("recipes");
    std::fs::create_dir_all(&recipes).unwrap();
    for attention in ["diff", "transformer"] {
        let text = format!(
            "extends = \"micro\"\n[model]\nattention = \"{attention}\"\n[training]\nsteps = 300\n[checkpoint]\ninterval = 100\n"
        );
        std::fs::write(recipes.join(format!("a-{attention}.toml")), text).unwrap();
    }
    let out = tmp.path().join("sweep");
    let sweep = || {
        command(&["sweep", path(&recipes), "--out", path(&out)])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = out.join("a-diff");
    let mut child = sweep();
    wait_for_step(&mut child, &first, 40);
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(RESUMABLE));
    let log = std::fs::read_to_string(first.join("train.log")).unwrap();
    assert!(
        log.contains("stopped at step") && log.contains("(SIGTERM)"),
        "{log}"
    );
    assert!(!first.join("model.bpk").exists());
    assert!(
        !out.join("a-transformer").exists(),
        "no run starts after a stop"
    );
    let done = sweep().wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let log = std::fs::read_to_string(first.join("train.log")).unwrap();
    assert!(log.contains("resuming from checkpoint"), "{log}");
    for run in ["a-diff", "a-transformer"] {
        assert!(out.join(run).join("model.bpk").exists(), "{run}");
    }
}
