//! Learning-rate schedule: linear warmup to the peak, then linear or cosine decay to a floor
//! (or constant). A pure function of the optimizer step, so resumed runs need only the step.

use crate::recipe::{Decay, Recipe};
use burn::lr_scheduler::{LrScheduler, LrSchedulerRecord};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub peak: f64,
    pub min_lr: f64,
    pub warmup: usize,
    pub total: usize,
    pub decay: Decay,
}

impl Schedule {
    pub fn from_recipe(recipe: &Recipe) -> Self {
        Self {
            peak: recipe.optimizer.lr,
            min_lr: recipe.schedule.min_lr,
            warmup: recipe.schedule.warmup_steps,
            total: recipe.total_steps(),
            decay: recipe.schedule.decay,
        }
    }

    /// The learning rate of optimizer step `step` (0-based): `peak·(step+1)/warmup` during
    /// warmup, then from `peak` at step `warmup` down to `min_lr` at the last step.
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup + 1).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        let fraction = match self.decay {
            Decay::Constant => return self.peak,
            Decay::Linear => 1.0 - progress,
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        self.min_lr + (self.peak - self.min_lr) * fraction
    }
}

/// The schedule as Burn's scheduler: each `step()` returns the rate of the next optimizer step.
#[derive(Debug, Clone)]
pub struct ScheduleState {
    schedule: Schedule,
    next: usize,
}

impl ScheduleState {
    pub fn new(schedule: Schedule) -> Self {
        Self { schedule, next: 0 }
    }
}

impl LrScheduler for ScheduleState {
    fn step(&mut self) -> f64 {
        let lr = self.schedule.lr(self.next);
        self.next += 1;
        lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar("next_step", self.next as u64)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(next) = record.scalar::<u64>("next_step") {
            self.next = next as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(decay: Decay) -> Schedule {
        Schedule {
            peak: 3.2e-4,
            min_lr: 1.28e-5,
            warmup: 1000,
            total: 11_001,
            decay,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 + 1e-9 * b.abs()
    }

    #[test]
    fn warmup_is_linear_from_the_first_step() {
        let s = schedule(Decay::Linear);
        assert!(close(s.lr(0), 3.2e-4 / 1000.0));
        assert!(close(s.lr(499), 3.2e-4 * 0.5));
        assert!(close(s.lr(999), 3.2e-4));
    }

    #[test]
    fn linear_decay_reaches_the_floor_at_the_last_step() {
        // The paper's 3B schedule: 3.2e-4 → 1.28e-5 after 1,000 warmup steps.
        let s = schedule(Decay::Linear);
        assert!(close(s.lr(1000), 3.2e-4));
        // 10,001 decay steps: the middle one is step 6,000, the last 11,000.
        assert!(
            close(s.lr(6000), (3.2e-4 + 1.28e-5) / 2.0),
            "{}",
            s.lr(6000)
        );
        assert!(close(s.lr(11_000), 1.28e-5));
        assert!(
            close(s.lr(20_000), 1.28e-5),
            "stays at the floor past the end"
        );
    }

    #[test]
    fn cosine_decay_is_half_way_at_the_middle() {
        let s = schedule(Decay::Cosine);
        assert!(close(s.lr(1000), 3.2e-4));
        let expected =
            1.28e-5 + (3.2e-4 - 1.28e-5) * 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos());
        assert!(close(s.lr(3500), expected), "a quarter of the way");
        assert!(close(s.lr(6000), (3.2e-4 + 1.28e-5) / 2.0), "half way");
        assert!(close(s.lr(11_000), 1.28e-5));
        assert!(close(schedule(Decay::Constant).lr(5000), 3.2e-4));
    }

    #[test]
    fn burn_scheduler_steps_through_the_schedule_and_resumes() {
        let s = Schedule {
            peak: 1.0,
            min_lr: 0.0,
            warmup: 2,
            total: 6,
            decay: Decay::Linear,
        };
        let mut state = ScheduleState::new(s);
        let lrs: Vec<f64> = (0..6).map(|_| state.step()).collect();
        for (lr, expected) in lrs.iter().zip([0.5, 1.0, 1.0, 2.0 / 3.0, 1.0 / 3.0, 0.0]) {
            assert!(close(*lr, expected), "{lrs:?}");
        }
        let mut first = ScheduleState::new(s);
        first.step();
        first.step();
        let mut resumed = ScheduleState::new(s);
        resumed.load_record(first.to_record());
        assert_eq!(resumed.step(), lrs[2]);
    }
}
