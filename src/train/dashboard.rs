//! Burn's dashboard, told the run's own progress. Burn's renderer counts the epochs and items of
//! the learner in this process, and diffzoo's learner epochs are checkpoint intervals of which a
//! resumed run's first starts where the run stopped: a run resumed at step 50 of 240 (intervals
//! of 80) read "Epochs 2/4, Items 5/48" and a progress bar at 34%, where a fresh run said "1/3,
//! x/80". [`Global`] hands Burn's renderer the run's intervals instead — interval k of
//! ⌈steps / interval⌉, its items the steps of that interval done (by whichever process), the
//! progress bar the run's — and the run's name and directory as the dashboard's label.
//!
//! What it cannot give: the history plots start at the resume point (Burn's renderer takes no
//! history; `diffzoo watch RUN` replays `metrics.jsonl` from the start).

use super::control::Intervals;
use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

pub struct Global {
    inner: Box<dyn MetricsRenderer>,
    intervals: Intervals,
    /// Items per optimizer step: a data-parallel loader serves each step once per device.
    ranks: usize,
    label: String,
    /// The learner's epoch now.
    epoch: usize,
    training: bool,
}

impl Global {
    pub fn new(
        inner: Box<dyn MetricsRenderer>,
        intervals: Intervals,
        ranks: usize,
        label: String,
    ) -> Self {
        Self {
            inner,
            epoch: intervals.first_epoch,
            intervals,
            ranks: ranks.max(1),
            label,
            training: true,
        }
    }

    /// The checkpoint intervals done before this process's first step: what Burn's renderer
    /// takes as the epochs its time estimate does not count.
    pub fn intervals_before(intervals: &Intervals) -> Option<usize> {
        (intervals.first_step > 0).then_some(intervals.first_step / intervals.interval)
    }

    /// The run's interval (1-based) holding 0-based step `step`.
    fn interval_of(&self, step: usize) -> usize {
        step / self.intervals.interval + 1
    }

    /// The first step of the run's interval holding `step`.
    fn interval_start(&self, step: usize) -> usize {
        (self.interval_of(step) - 1) * self.intervals.interval
    }

    fn first_step(&self, epoch: usize) -> usize {
        self.intervals.steps(epoch).0
    }
}

impl TrainingProgressLogger for Global {
    fn start(
        &mut self,
        _total_epochs: usize,
        _starting_epoch: usize,
        _total_items: Option<usize>,
        _label: Option<&str>,
    ) {
        let intervals = self.intervals.total.div_ceil(self.intervals.interval);
        let now = self.interval_of(self.first_step(self.intervals.first_epoch));
        self.inner.start(
            intervals,
            now,
            Some(self.intervals.interval),
            Some(&self.label),
        );
    }

    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
        // Burn's renderer shows the epoch after the one given.
        let next = self.interval_of(self.first_step(self.epoch));
        self.inner.update_epoch(next - 1);
    }

    fn start_split(&mut self, split_name: &str, total_items: usize) {
        self.training = split_name == "train";
        let items = match self.training {
            // The steps of the current interval (the last may be shorter).
            true => {
                let start = self.interval_start(self.first_step(self.epoch));
                (start + self.intervals.interval).min(self.intervals.total) - start
            }
            false => total_items,
        };
        self.inner.start_split(split_name, items);
    }

    fn update_split(&mut self, items_processed: usize) {
        if !self.training {
            return self.inner.update_split(items_processed);
        }
        let first = self.first_step(self.epoch);
        let start = self.interval_start(first);
        self.inner
            .update_split(first + items_processed / self.ranks - start);
    }

    fn end_split(&mut self) {
        self.inner.end_split();
    }

    fn end(&mut self) {
        self.inner.end();
    }

    fn log_event_training(&mut self, event: String) {
        self.inner.log_event_training(event);
    }
}

impl MetricsRendererTraining for Global {
    fn update_train(&mut self, state: MetricState) {
        self.inner.update_train(state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.inner.update_valid(state);
    }

    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.inner.on_train_end(summary)
    }
}

impl MetricsRendererEvaluation for Global {
    fn update_test(&mut self, name: EvaluationName, state: MetricState) {
        self.inner.update_test(name, state);
    }
}

impl EvaluationProgressLogger for Global {
    fn start_global_progress(&mut self, total_tests: usize) {
        self.inner.start_global_progress(total_tests);
    }

    fn start_test(&mut self, name: &str, total_items: usize) {
        self.inner.start_test(name, total_items);
    }

    fn update_test_progress(&mut self, items_processed: usize) {
        self.inner.update_test_progress(items_processed);
    }

    fn end_test(&mut self) {
        self.inner.end_test();
    }

    fn end_global_progress(&mut self) {
        self.inner.end_global_progress();
    }

    fn log_event_evaluation(&mut self, event: String) {
        self.inner.log_event_evaluation(event);
    }
}

impl MetricsRenderer for Global {
    fn manual_close(&mut self) {
        self.inner.manual_close();
    }

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.inner.register_metric(definition);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// What Burn's renderer was told, as (epoch, epochs, items, items per epoch) after each call.
    #[derive(Default)]
    struct Shown {
        epoch: usize,
        epochs: usize,
        items: usize,
        per_epoch: usize,
        label: String,
    }

    struct Recorder(Arc<Mutex<Shown>>);

    impl TrainingProgressLogger for Recorder {
        fn start(
            &mut self,
            total: usize,
            starting: usize,
            items: Option<usize>,
            label: Option<&str>,
        ) {
            let mut s = self.0.lock().unwrap();
            (s.epochs, s.epoch) = (total, starting);
            s.per_epoch = items.unwrap_or(0);
            s.label = label.unwrap_or_default().to_string();
        }
        fn update_epoch(&mut self, epoch: usize) {
            self.0.lock().unwrap().epoch = epoch + 1;
        }
        fn start_split(&mut self, _split: &str, total: usize) {
            self.0.lock().unwrap().per_epoch = total;
        }
        fn update_split(&mut self, items: usize) {
            self.0.lock().unwrap().items = items;
        }
        fn end_split(&mut self) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for Recorder {
        fn start_global_progress(&mut self, _total: usize) {}
        fn start_test(&mut self, _name: &str, _items: usize) {}
        fn update_test_progress(&mut self, _items: usize) {}
        fn end_test(&mut self) {}
        fn end_global_progress(&mut self) {}
        fn log_event_evaluation(&mut self, _event: String) {}
    }

    impl MetricsRendererTraining for Recorder {
        fn update_train(&mut self, _state: MetricState) {}
        fn update_valid(&mut self, _state: MetricState) {}
    }

    impl MetricsRendererEvaluation for Recorder {
        fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    }

    impl MetricsRenderer for Recorder {
        fn manual_close(&mut self) {}
        fn register_metric(&mut self, _definition: MetricDefinition) {}
    }

    /// Drives the renderer as the learner does for a run of 240 steps in intervals of 80, from
    /// `first_step` (its learner epoch `first_epoch`) on `ranks` devices; what it showed at each
    /// global step.
    fn shown(
        total: usize,
        first_epoch: usize,
        first_step: usize,
        ranks: usize,
    ) -> Vec<(usize, [usize; 4])> {
        let intervals = Intervals {
            first_epoch,
            first_step,
            interval: 80,
            total,
        };
        let seen = Arc::new(Mutex::new(Shown::default()));
        let mut global = Global::new(
            Box::new(Recorder(seen.clone())),
            intervals,
            ranks,
            "tiny (runs/tiny)".into(),
        );
        let mut out = Vec::new();
        global.start(intervals.last_epoch(), first_epoch, None, None);
        assert_eq!(seen.lock().unwrap().label, "tiny (runs/tiny)");
        for epoch in first_epoch..=intervals.last_epoch() {
            let (first, count) = intervals.steps(epoch);
            global.start_split("train", count * ranks);
            for item in 1..=count * ranks {
                global.update_split(item);
                if item % ranks == 0 {
                    let s = seen.lock().unwrap();
                    out.push((
                        first + item / ranks,
                        [s.epoch, s.epochs, s.items, s.per_epoch],
                    ));
                }
            }
            global.end_split();
            global.start_split("valid", 2);
            global.update_split(1);
            global.end_split();
            global.update_epoch(epoch);
        }
        out
    }

    #[test]
    fn a_resumed_run_shows_what_the_same_step_of_a_fresh_run_showed() {
        let fresh = shown(240, 1, 0, 1);
        assert_eq!(fresh.len(), 240);
        assert_eq!(fresh[49], (50, [1, 3, 50, 80]));
        assert_eq!(fresh[129], (130, [2, 3, 50, 80]));
        // Resumed at step 50 (a pause in the first interval, checkpoint 1), at 130 on 2 GPUs,
        // and at an interval's end (checkpoint 2).
        for resumed in [
            shown(240, 2, 50, 1),
            shown(240, 3, 130, 2),
            shown(240, 3, 160, 1),
        ] {
            let first = resumed[0].0;
            assert_eq!(resumed, fresh[first - 1..], "resumed at step {first}");
        }
        // A last interval shorter than the others fills.
        let short = shown(250, 1, 0, 1);
        assert_eq!(short[249], (250, [4, 4, 10, 10]));
        assert_eq!(shown(250, 3, 245, 1), short[245..]);
        assert_eq!(
            Global::intervals_before(&Intervals {
                first_epoch: 2,
                first_step: 130,
                interval: 80,
                total: 240
            }),
            Some(1)
        );
    }
}
