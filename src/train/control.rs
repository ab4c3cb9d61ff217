//! How a run stops early: at a step boundary when asked (a "pause"), or on a failure.
//!
//! A stop asked for by a signal or by the dashboard is taken by the step leader at the end of the
//! step in progress: that step completes (its update applied) and the training loaders serve no
//! further step, so the learner's epoch ends there. Its validation runs only if the pause falls
//! where an interval ends anyway (a resumed run validates that interval when it completes it);
//! then Burn writes the checkpoint, and the first rank's loader stops the learner as the next epoch
//! starts. Every rank stops at the same step boundary: under data parallelism the learner's
//! interrupter may only be stopped where all ranks check it alike, which is why a failure found
//! elsewhere (a checkpoint that cannot be written) is recorded here and acted on by the step
//! leader at the next step (or reported when training ends).

use burn::train::Interrupter;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The learner's epochs as optimizer steps: epoch `first_epoch` starts at 0-based step
/// `first_step` (a resumed run's steps done) and every epoch ends at the next multiple of
/// `interval` or at `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intervals {
    pub first_epoch: usize,
    pub first_step: usize,
    pub interval: usize,
    pub total: usize,
}

impl Intervals {
    /// The first step and the number of steps of `epoch`.
    pub fn steps(&self, epoch: usize) -> (usize, usize) {
        let k = epoch - self.first_epoch;
        let interval = self.first_step / self.interval + k;
        let first = match k {
            0 => self.first_step,
            _ => interval * self.interval,
        };
        let end = ((interval + 1) * self.interval).min(self.total);
        (first, end.saturating_sub(first))
    }

    /// The learner's last epoch.
    pub fn last_epoch(&self) -> usize {
        let left = match self.first_step {
            done if done >= self.total => 0,
            done => self.total.div_ceil(self.interval) - done / self.interval,
        };
        self.first_epoch - 1 + left
    }

    /// Whether `done` steps complete an interval (or the run).
    pub fn ends_interval(&self, done: usize) -> bool {
        done.is_multiple_of(self.interval) || done == self.total
    }
}

/// The run's completed steps, a pause taken and a failure, shared by the step leader, the
/// loaders and the checkpointer.
pub struct Control {
    intervals: Intervals,
    done: AtomicUsize,
    /// Steps done when the pause was taken (`usize::MAX`: none), for the loaders' checks.
    paused_at: AtomicUsize,
    pause: Mutex<Option<(usize, String)>>,
    failure: Mutex<Option<String>>,
    interrupter: Interrupter,
}

impl Control {
    /// A run over `intervals` (its steps done: `first_step`); `interrupter` is the learner's.
    pub fn new(intervals: Intervals, interrupter: Interrupter) -> Self {
        Self {
            intervals,
            done: AtomicUsize::new(intervals.first_step),
            paused_at: AtomicUsize::new(usize::MAX),
            pause: Mutex::new(None),
            failure: Mutex::new(None),
            interrupter,
        }
    }

    /// Optimizer steps completed.
    pub fn steps_done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }

    /// Records that `done` steps are complete.
    pub fn step_done(&self, done: usize) {
        self.done.store(done, Ordering::SeqCst);
    }

    /// Pauses after `done` steps, for `reason`; the first request wins.
    pub fn pause(&self, done: usize, reason: &str) {
        let mut pause = self.pause.lock().expect("control lock");
        if pause.is_none() {
            *pause = Some((done, reason.to_string()));
            self.paused_at.store(done, Ordering::SeqCst);
        }
    }

    /// The steps done when the run paused, and why; `None` while it runs.
    pub fn paused(&self) -> Option<(usize, String)> {
        self.pause.lock().expect("control lock").clone()
    }

    /// Records why the run cannot go on (the first failure wins); the step leader stops the
    /// learner at the next step.
    pub fn fail(&self, reason: String) {
        self.failure
            .lock()
            .expect("control lock")
            .get_or_insert(reason);
    }

    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("control lock").clone()
    }

    /// Whether the training loaders may serve 0-based step `step`.
    pub fn serves_step(&self, step: usize) -> bool {
        step < self.paused_at.load(Ordering::SeqCst)
    }

    /// Whether validation runs: not after a pause in the middle of an interval.
    pub fn serves_validation(&self) -> bool {
        match self.paused_at.load(Ordering::SeqCst) {
            usize::MAX => true,
            at => self.intervals.ends_interval(at),
        }
    }

    /// The steps checkpoint (learner epoch) `epoch` holds: its epoch's end, or the pause's step
    /// if the run paused in it. Known from the epoch, not from the steps done when the file is
    /// written: the learner has gone on by then.
    pub fn checkpoint_step(&self, epoch: usize) -> usize {
        let (first, count) = self.intervals.steps(epoch);
        (first + count).min(self.paused_at.load(Ordering::SeqCst))
    }

    /// Called by the first rank as a training epoch starts: once paused (the pause's checkpoint
    /// was written at the end of the epoch before), the learner stops before its first step (the
    /// other ranks' epochs are empty).
    pub fn epoch_starts(&self) {
        if let Some((at, reason)) = self.paused() {
            self.interrupter
                .stop(Some(&format!("stopped at step {at} ({reason})")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intervals(first_epoch: usize, first_step: usize) -> Intervals {
        Intervals {
            first_epoch,
            first_step,
            interval: 10,
            total: 25,
        }
    }

    #[test]
    fn epochs_end_at_multiples_of_the_interval_whatever_step_a_run_resumed_at() {
        let fresh = intervals(1, 0);
        assert_eq!(
            (1..=3).map(|e| fresh.steps(e)).collect::<Vec<_>>(),
            [(0, 10), (10, 10), (20, 5)]
        );
        assert_eq!(fresh.last_epoch(), 3);
        // Checkpoint 2 was a pause at step 13: epoch 3 finishes the interval.
        let resumed = intervals(3, 13);
        assert_eq!(
            (3..=4).map(|e| resumed.steps(e)).collect::<Vec<_>>(),
            [(13, 7), (20, 5)]
        );
        assert_eq!(resumed.last_epoch(), 4);
        // Killed after the last checkpoint, before the final model: nothing is left.
        assert_eq!(intervals(4, 25).last_epoch(), 3);
        assert!(fresh.ends_interval(20) && fresh.ends_interval(25) && !fresh.ends_interval(13));
    }

    #[test]
    fn the_first_pause_decides_and_the_learner_stops_as_the_next_epoch_starts() {
        let interrupter = Interrupter::new();
        let control = Control::new(intervals(1, 0), interrupter.clone());
        assert!(control.serves_step(100) && control.serves_validation());
        control.epoch_starts();
        assert!(!interrupter.should_stop());
        control.pause(13, "SIGTERM");
        control.pause(14, "SIGINT");
        assert_eq!(control.paused(), Some((13, "SIGTERM".to_string())));
        assert!(control.serves_step(12) && !control.serves_step(13));
        assert!(!control.serves_validation(), "mid-interval: no validation");
        assert_eq!(control.checkpoint_step(1), 10, "written before the pause");
        assert_eq!(control.checkpoint_step(2), 13);
        control.epoch_starts();
        assert_eq!(
            interrupter.get_message().as_deref(),
            Some("stopped at step 13 (SIGTERM)")
        );
    }

    #[test]
    fn a_pause_where_an_interval_ends_keeps_its_validation() {
        let control = Control::new(intervals(1, 0), Interrupter::new());
        control.pause(20, "SIGTERM");
        assert!(control.serves_validation());
    }
}
