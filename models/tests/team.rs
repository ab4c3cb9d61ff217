//! The team of threads that runs decoding's few-row products (`team::run`): every part of every
//! job runs exactly once — from one caller, from callers racing for the team (the losers run on
//! rayon), after the helpers have parked — a part's panic reaches the caller, and helpers take
//! parts after it. One test: the checks share the process's one team and
//! must not race each other's timing.

use diffzoo_models::team;
use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How many times each part of a `parts`-part job ran, `work` called in each.
fn runs(parts: usize, work: impl Fn(usize) + Sync) -> Vec<usize> {
    let counts: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
    team::run(parts, &|p| {
        work(p);
        counts[p].fetch_add(1, Ordering::Relaxed);
    });
    counts.into_iter().map(AtomicUsize::into_inner).collect()
}

#[test]
fn every_part_runs_once_helpers_take_parts_and_panics_reach_the_caller() {
    for parts in (0..=40).chain([1000]) {
        assert_eq!(runs(parts, |_| {}), vec![1; parts], "{parts} parts");
    }

    // Callers racing for the team: each job's parts still run once.
    std::thread::scope(|scope| {
        for caller in 0..4 {
            scope.spawn(move || {
                for job in 0..300 {
                    let parts = 1 + (caller + job) % 9;
                    assert_eq!(
                        runs(parts, |_| {}),
                        vec![1; parts],
                        "caller {caller} job {job}"
                    );
                }
            });
        }
    });

    // Parked helpers wake for the next job.
    std::thread::sleep(team::SPIN * 20);
    assert_eq!(runs(7, |_| {}), vec![1; 7]);

    // A part's panic is resumed in the caller once the others ran; the team goes on
    // (its helpers take parts below).
    let ran = AtomicUsize::new(0);
    let caught = catch_unwind(AssertUnwindSafe(|| {
        team::run(6, &|p| {
            ran.fetch_add(1, Ordering::Relaxed);
            assert_ne!(p, 2, "part 2 fails");
        })
    }));
    let message = caught
        .err()
        .and_then(|e| e.downcast_ref::<String>().cloned());
    assert!(message.is_some_and(|m| m.contains("part 2 fails")));
    assert_eq!(ran.into_inner(), 6);
    assert_eq!(runs(5, |_| {}), vec![1; 5]);

    // Parts long enough for a helper to claim some (on a machine with more than one thread).
    let names = Mutex::new(BTreeSet::new());
    for _ in 0..20 {
        let counts = runs(4, |_| {
            std::thread::sleep(Duration::from_millis(2));
            let name = std::thread::current().name().map(str::to_string);
            names.lock().unwrap().insert(name.unwrap_or_default());
        });
        assert_eq!(counts, vec![1; 4]);
    }
    let names = names.into_inner().unwrap();
    if rayon::current_num_threads() > 1 {
        assert!(
            names.iter().any(|n| n.starts_with("diffzoo-team-")),
            "no part ran on a helper: {names:?}"
        );
    }
}
