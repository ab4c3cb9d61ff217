//! One optimizer step as the learner sees it: forward and backward over every micro-batch,
//! gradients averaged, clipped by their global norm; and validation batches. Under mixed
//! precision (`training.precision = "bf16-mixed"`) each micro-batch's passes read a bf16 copy
//! of the f32 masters ([`diffzoo_models::precision`]): the gradients reach the masters in f32,
//! and are accumulated, clipped and all-reduced in f32 before AdamW steps them.

use super::control::{Control, Intervals};
use super::grads;
use super::loader::StepBatch;
use super::loss::{batch_loss, lm_loss};
use super::metrics::{LogRecord, MetricsLog, StepStats};
use super::schedule::Schedule;
use super::signals;
use crate::recipe::Recompute;
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, FloatDType, Gradients, Tensor};
use burn::train::{InferenceStep, Interrupter, TrainOutput, TrainStep};
use diffzoo_datasets::LmBatch;
use diffzoo_models::profile::{self, Pass};
use diffzoo_models::{AttentionImpl, Model, compute_copy};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

/// Mean loss and token count over micro-batches, each micro-batch's loss from `loss`.
fn over_batches(batches: &[LmBatch], mut loss: impl FnMut(&LmBatch) -> Tensor<1>) -> (f64, usize) {
    let (mut sum, mut tokens) = (0.0, 0);
    for batch in batches {
        sum += loss(batch).into_scalar::<f64>();
        let [b, s] = batch.targets.dims();
        tokens += b * s;
    }
    (sum / batches.len() as f64, tokens)
}

/// A micro-batch's loss, its gradients handed to `accumulate` (one backward pass, or one per
/// block when blocks are recomputed), computing in `compute` from a copy of the weights
/// (`None`: in their own dtype).
pub fn backward(
    model: &Model,
    batch: &LmBatch,
    recompute: Recompute,
    compute: Option<FloatDType>,
    mut accumulate: impl FnMut(Gradients),
) -> Tensor<1> {
    match recompute {
        Recompute::None => {
            let loss = profile::pass(Pass::Forward, || {
                lm_loss(&compute_copy(model, compute), batch)
            });
            accumulate(profile::pass(Pass::Backward, || loss.backward()));
            loss
        }
        Recompute::Block => model.backward_recomputed(
            batch.inputs.clone(),
            compute,
            |logits| batch_loss(logits, batch),
            accumulate,
        ),
    }
}

/// How a run reports and stops: the metrics log, printing (when no dashboard is shown),
/// stopping on a non-finite loss or an unwritable log, and pausing at a step boundary when a
/// signal or the dashboard asks (see [`super::control`]). Shared by the training and validation
/// copies of the model.
pub struct StepContext {
    pub schedule: Schedule,
    pub grad_clip: f64,
    /// Whether each block's forward runs again in the backward pass (`training.recompute`).
    pub recompute: Recompute,
    /// The dtype the passes compute in from a copy of the weights (mixed precision), if any.
    pub compute: Option<FloatDType>,
    /// Steps of the warm-up of DIFF's negative map (`training.lambda_warmup`), if any.
    pub lambda_warmup: Option<usize>,
    /// The attention validation passes computing in f32 take instead of the recipe's, if any
    /// ([`crate::device::inference_attention`]).
    valid_attention: Option<AttentionImpl>,
    pub batch_tokens: u64,
    pub total_steps: usize,
    pub interrupter: Interrupter,
    print_every: Option<usize>,
    valid_batches: usize,
    requests: Interrupter,
    pub control: Arc<Control>,
    /// Devices training data-parallel, each reporting its share of every step.
    rank_count: usize,
    ranks: Barrier,
    state: Mutex<ContextState>,
}

struct ContextState {
    log: MetricsLog,
    started: Instant,
    last_step_end: Option<Instant>,
    /// When the first step of this process ended, and its number of steps done then.
    first_step_end: Option<(Instant, usize)>,
    valid: (f64, usize, usize),
    /// The ranks' summed losses and tokens of the step being gathered.
    gathering: (f64, usize),
    /// The last step's statistics, as recorded.
    gathered: Option<StepStats>,
}

impl std::fmt::Debug for StepContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepContext")
    }
}

impl StepContext {
    /// A run over `intervals` (its steps done: their first step), stopped through the learner's
    /// `interrupter`; `print_every`: print a line every so many steps (when no dashboard is
    /// shown).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        schedule: Schedule,
        grad_clip: f64,
        batch_tokens: u64,
        intervals: Intervals,
        interrupter: Interrupter,
        print_every: Option<usize>,
        valid_batches: usize,
        log: MetricsLog,
    ) -> Self {
        Self {
            schedule,
            grad_clip,
            recompute: Recompute::None,
            compute: None,
            lambda_warmup: None,
            valid_attention: None,
            batch_tokens,
            total_steps: intervals.total,
            requests: Interrupter::new(),
            control: Arc::new(Control::new(intervals, interrupter.clone())),
            interrupter,
            print_every,
            valid_batches,
            rank_count: 1,
            ranks: Barrier::new(1),
            state: Mutex::new(ContextState {
                log,
                started: Instant::now(),
                last_step_end: None,
                first_step_end: None,
                valid: (0.0, 0, 0),
                gathering: (0.0, 0),
                gathered: None,
            }),
        }
    }

    /// Blocks recomputed in the backward pass or not (`training.recompute`).
    pub fn recomputing(mut self, recompute: Recompute) -> Self {
        self.recompute = recompute;
        self
    }

    /// Passes compute in `compute` from a copy of the weights (`training.precision`'s
    /// [`crate::recipe::Precision::compute`]).
    pub fn computing_in(mut self, compute: Option<FloatDType>) -> Self {
        self.compute = compute;
        self
    }

    /// λ scaled by min(1, step/N) over the first `lambda_warmup` = N steps.
    pub fn warming_up(mut self, lambda_warmup: Option<usize>) -> Self {
        self.lambda_warmup = lambda_warmup;
        self
    }

    /// Validation passes computing in f32 take `attention` (`None`: the recipe's).
    pub fn validating_with(mut self, attention: Option<AttentionImpl>) -> Self {
        self.valid_attention = attention;
        self
    }

    /// The model validation computes with after `done` steps: [`Self::model_at`]'s, in the
    /// compute dtype, with [`Self::validating_with`]'s attention where that dtype is f32.
    fn valid_model(&self, model: &Model, done: usize) -> Model {
        let model = compute_copy(&self.model_at(model, done), self.compute);
        match self.valid_attention {
            Some(attention) if model.dtype() == DType::F32 => model.with_attention_impl(attention),
            _ => model,
        }
    }

    /// The warm-up's scale of λ after `done` steps, when there is a warm-up.
    fn lambda_scale(&self, done: usize) -> Option<f64> {
        self.lambda_warmup
            .map(|n| (done as f64 / n as f64).min(1.0))
    }

    /// The model as it computes after `done` steps: with λ scaled during a warm-up.
    fn model_at(&self, model: &Model, done: usize) -> Model {
        match self.lambda_scale(done) {
            Some(scale) => model.clone().with_lambda_scale(scale),
            None => model.clone(),
        }
    }

    /// Steps are shared by `ranks` devices (data parallelism), each reporting its share.
    pub fn data_parallel(mut self, ranks: usize) -> Self {
        self.rank_count = ranks;
        self.ranks = Barrier::new(ranks);
        self
    }

    /// Where the dashboard asks training to stop. The step leader takes the request (or a
    /// signal) at the end of the next step and pauses the run there, on every rank at once
    /// (under data parallelism Burn's workers each check the learner's interrupter between
    /// steps, and a worker that stopped while the others went on would leave them waiting in the
    /// gradient all-reduce); see [`super::control`].
    pub fn requests(&self) -> Interrupter {
        self.requests.clone()
    }

    /// Waits for every rank to finish a backward pass. Burn 0.22.1's gradient sync server
    /// counts registrations per round and starts a new round only once every device's sync has
    /// been handled: a fast rank's next registration must not arrive before that.
    fn backward_done(&self) {
        self.ranks.wait();
    }

    /// Why training stopped early, if it did.
    pub fn failure(&self) -> Option<String> {
        self.control.failure()
    }

    /// Records step `step` once every rank has reported its share: the loss is the mean of the
    /// ranks' losses (each the mean of as many micro-batches), tokens their sum; the gradient
    /// norm and λ (equal on every rank up to rounding, after the all-reduce) are the leader's.
    /// Every rank gets the step's statistics back, and a stop decided here — or passed on from
    /// [`StepContext::requests`] or a signal — is seen by all of them before any checks it.
    fn train_step(&self, step: usize, local: &StepStats, started: Instant) -> StepStats {
        {
            let mut state = self.state.lock().expect("context lock");
            state.gathering.0 += local.loss;
            state.gathering.1 += local.tokens;
        }
        if self.ranks.wait().is_leader() {
            signals::ctrl_c_interrupts();
            if let Some(failure) = self.control.failure()
                && !self.interrupter.should_stop()
            {
                self.interrupter.stop(Some(&failure));
            }
            let mut state = self.state.lock().expect("context lock");
            let (loss, tokens) = std::mem::take(&mut state.gathering);
            let stats = StepStats {
                loss: loss / self.rank_count as f64,
                tokens,
                ..local.clone()
            };
            let stats = self.record(&mut state, step, &stats, started);
            state.gathered = Some(stats);
            self.take_stop_request(step + 1);
        }
        self.ranks.wait();
        let state = self.state.lock().expect("context lock");
        state
            .gathered
            .clone()
            .expect("the leader recorded the step")
    }

    fn record(
        &self,
        state: &mut ContextState,
        step: usize,
        stats: &StepStats,
        started: Instant,
    ) -> StepStats {
        let now = Instant::now();
        let since = state.last_step_end.unwrap_or(started);
        state.last_step_end = Some(now);
        let (first_end, first_done) = *state.first_step_end.get_or_insert((now, step + 1));
        self.control.step_done(step + 1);
        let stats = StepStats {
            tokens_per_sec: Some(stats.tokens as f64 / (now - since).as_secs_f64().max(1e-9)),
            step: Some(step + 1),
            ..stats.clone()
        };
        let record = LogRecord {
            split: "train",
            step: step + 1,
            tokens_seen: (step as u64 + 1) * self.batch_tokens,
            loss: stats.loss,
            perplexity: stats.loss.exp(),
            lr: Some(self.schedule.lr(step)),
            grad_norm: stats.grad_norm,
            tokens_per_sec: stats.tokens_per_sec,
            lambda: stats.lambdas.clone(),
            lambda_scale: self.lambda_scale(step),
            elapsed_sec: state.started.elapsed().as_secs_f64(),
        };
        if let Err(e) = state.log.write(&record) {
            let reason = format!("cannot write the metrics log: {e}");
            self.interrupter.stop(Some(&reason));
            self.control.fail(reason);
        }
        if let Some(every) = self.print_every
            && ((step + 1).is_multiple_of(every) || step + 1 == self.total_steps || step == 0)
        {
            let mut lambdas = match stats.lambdas.as_slice() {
                [] => String::new(),
                l => format!(
                    " | λ {}",
                    l.iter()
                        .map(|x| format!("{x:.3}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
            };
            if let Some(scale) = self.lambda_scale(step) {
                lambdas += &format!(" | λ scale {scale:.3}");
            }
            let remaining = eta(
                step + 1 - first_done,
                self.total_steps.saturating_sub(step + 1),
                (now - first_end).as_secs_f64(),
            )
            .map_or_else(|| "ETA …".to_string(), |s| format!("ETA {}", clock(s)));
            say!(
                "step {:>6}/{} | loss {:.4} | ppl {:>8.2} | lr {:.3e} | grad norm {:.3} | {:.0} tok/s | {} elapsed, {remaining}{lambdas}",
                step + 1,
                self.total_steps,
                stats.loss,
                stats.loss.exp(),
                self.schedule.lr(step),
                stats.grad_norm.unwrap_or(f64::NAN),
                stats.tokens_per_sec.unwrap_or(0.0),
                clock(state.started.elapsed().as_secs_f64()),
            );
        }
        if !(stats.loss.is_finite() && stats.grad_norm.is_none_or(f64::is_finite)) {
            let reason = format!(
                "non-finite loss or gradient at step {} (loss {}, gradient norm {:?}); stopped, the last checkpoint is kept",
                step + 1,
                stats.loss,
                stats.grad_norm
            );
            self.interrupter.stop(Some(&reason));
            self.control.fail(reason);
        }
        stats
    }

    /// Pauses after `done` steps if a signal or the dashboard asked for a stop.
    fn take_stop_request(&self, done: usize) {
        if self.interrupter.should_stop() || self.control.paused().is_some() {
            return;
        }
        let reason = match signals::received() {
            Some(signal) => signal.to_string(),
            None if self.requests.should_stop() => "the dashboard's stop".to_string(),
            None => return,
        };
        self.control.pause(done, &reason);
        if self.print_every.is_some() {
            say!(
                "{reason}: stopping after step {done} and writing a checkpoint (a second SIGINT or SIGTERM exits at once)"
            );
        }
    }

    fn valid_batch(&self, stats: &StepStats) {
        let mut state = self.state.lock().expect("context lock");
        let (sum, tokens, batches) = state.valid;
        state.valid = (
            sum + stats.loss * stats.tokens as f64,
            tokens + stats.tokens,
            batches + 1,
        );
        if batches + 1 < self.valid_batches {
            return;
        }
        let (sum, tokens, _) = std::mem::take(&mut state.valid);
        let loss = sum / tokens as f64;
        let step = self.control.steps_done();
        let record = LogRecord {
            split: "validation",
            step,
            tokens_seen: step as u64 * self.batch_tokens,
            loss,
            perplexity: loss.exp(),
            lr: None,
            grad_norm: None,
            tokens_per_sec: None,
            lambda: Vec::new(),
            lambda_scale: self.lambda_scale(step),
            elapsed_sec: state.started.elapsed().as_secs_f64(),
        };
        if let Err(e) = state.log.write(&record) {
            self.control
                .fail(format!("cannot write the metrics log: {e}"));
        }
        if self.print_every.is_some() {
            say!(
                "step {step:>6}/{} | validation loss {loss:.4} | ppl {:.2} (its first {} batches; `diffzoo eval ppl` scores the whole split)",
                self.total_steps,
                loss.exp(),
                self.valid_batches
            );
        }
    }
}

/// The model as the learner trains it: the LM plus the run's reporting context.
#[derive(Module, Debug)]
pub struct Trainee {
    pub model: Model,
    #[module(skip)]
    pub context: Option<Arc<StepContext>>,
}

impl Trainee {
    fn context(&self) -> &StepContext {
        self.context.as_deref().expect("a training context")
    }
}

impl TrainStep for Trainee {
    type Input = StepBatch;
    type Output = StepStats;

    fn step(&self, item: StepBatch) -> TrainOutput<StepStats> {
        let started = Instant::now();
        let context = self.context();
        let model = context.model_at(&self.model, item.step);
        let mut accumulator = GradientsAccumulator::new();
        let (loss, tokens) = over_batches(&item.micro, |batch| {
            backward(&model, batch, context.recompute, context.compute, |grads| {
                context.backward_done();
                accumulator
                    .accumulate(&self.model, GradientsParams::from_grads(grads, &self.model));
            })
        });
        let mut grads = accumulator.grads();
        // Burn's accumulation sums; PyTorch users expect the mean over micro-batches.
        grads::scale(&self.model, &mut grads, 1.0 / item.micro.len() as f64);
        let stats = StepStats {
            loss,
            tokens,
            grad_norm: Some(grads::global_norm(&self.model, &mut grads)),
            tokens_per_sec: None,
            lambdas: self.model.lambdas(),
            step: None,
        };
        let stats = context.train_step(item.step, &stats, started);
        if context.interrupter.should_stop() {
            // Never apply a non-finite update.
            grads = GradientsParams::new();
        } else {
            // Every replica clips by the one recorded norm: their updates cannot drift apart
            // through last-bit differences of their own reductions.
            let norm = stats
                .grad_norm
                .expect("a training step has a gradient norm");
            grads::clip_to(&self.model, &mut grads, context.grad_clip, norm);
        }
        TrainOutput { grads, item: stats }
    }
}

impl InferenceStep for Trainee {
    type Input = StepBatch;
    type Output = StepStats;

    fn step(&self, item: StepBatch) -> StepStats {
        let context = self.context();
        let model = context.valid_model(&self.model, context.control.steps_done());
        let (loss, tokens) = over_batches(&item.micro, |batch| lm_loss(&model, batch));
        let stats = StepStats {
            loss,
            tokens,
            ..Default::default()
        };
        context.valid_batch(&stats);
        stats
    }
}

/// Seconds until `left` more steps are done, at the pace of the `done` steps that took
/// `seconds` (none before that pace is known).
pub fn eta(done: usize, left: usize, seconds: f64) -> Option<f64> {
    (done > 0).then(|| seconds / done as f64 * left as f64)
}

/// `seconds` as `m:ss`, or `h:mm:ss` from an hour on.
pub fn clock(seconds: f64) -> String {
    let whole = seconds.max(0.0).round() as u64;
    let (h, m, s) = (whole / 3600, whole / 60 % 60, whole % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe;

    #[test]
    fn progress_lines_tell_elapsed_time_and_the_time_left() {
        assert_eq!(clock(0.4), "0:00");
        assert_eq!(clock(83.0), "1:23");
        assert_eq!(clock(3600.0 * 26.0 + 61.0), "26:01:01");
        assert_eq!(eta(0, 10, 5.0), None);
        assert_eq!(eta(4, 10, 2.0), Some(5.0));
        assert_eq!(eta(4, 0, 2.0), Some(0.0));
    }

    fn context(dir: &std::path::Path, ranks: usize) -> Arc<StepContext> {
        Arc::new(micro_context(dir).data_parallel(ranks))
    }

    fn micro_context(dir: &std::path::Path) -> StepContext {
        let micro = recipe::resolve("micro", &[]).unwrap().recipe;
        let log = MetricsLog::open(&dir.join("metrics.jsonl")).unwrap();
        let intervals = Intervals {
            first_epoch: 1,
            first_step: 0,
            interval: 10,
            total: 20,
        };
        StepContext::new(
            Schedule::from_recipe(&micro),
            1.0,
            256,
            intervals,
            Interrupter::new(),
            None,
            2,
            log,
        )
    }

    /// Validation computing in f32 takes the attention it is given (on Flex, inference's
    /// explicit path) in place of the recipe's; a bf16 compute copy keeps the recipe's (the
    /// blocks path takes f32 only, elsewhere the explicit path would hold S×S maps).
    #[test]
    fn validation_in_f32_takes_the_inference_attention() {
        let dir = tempfile::tempdir().unwrap();
        let flash = AttentionImpl::Flash { block: 16 };
        let recipe = recipe::resolve(
            "micro",
            &[
                "model.attention_impl=\"flash\"".into(),
                "model.attention_block=16".into(),
            ],
        )
        .unwrap()
        .recipe;
        let model = recipe.model_config().init(&burn::tensor::Device::flex());
        let validated = |context: StepContext| -> Vec<AttentionImpl> {
            let model = context.valid_model(&model, 0);
            model
                .blocks
                .iter()
                .map(|b| b.attn.implementation())
                .collect()
        };
        let explicit = crate::device::inference_attention("flex");
        assert_eq!(explicit, Some(AttentionImpl::Explicit));
        assert_eq!(crate::device::inference_attention("ndarray"), None);
        assert_eq!(validated(micro_context(dir.path())), [flash; 2]);
        let context = micro_context(dir.path()).validating_with(explicit);
        assert_eq!(validated(context), [AttentionImpl::Explicit; 2]);
        let context = micro_context(dir.path())
            .validating_with(explicit)
            .computing_in(Some(FloatDType::BF16));
        assert_eq!(validated(context), [flash; 2]);
    }

    /// Each rank reports its share of `step` from its own thread, as DDP's workers do.
    fn report(context: &Arc<StepContext>, step: usize, losses: &[f64]) -> Vec<StepStats> {
        let workers: Vec<_> = losses
            .iter()
            .map(|&loss| {
                let context = context.clone();
                std::thread::spawn(move || {
                    let local = StepStats {
                        loss,
                        tokens: 64,
                        grad_norm: Some(0.5),
                        ..Default::default()
                    };
                    context.train_step(step, &local, Instant::now())
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    }

    fn logged(dir: &std::path::Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn ranks_report_one_step_once_with_the_mean_loss_and_all_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let context = context(dir.path(), 2);
        for step in 0..3 {
            let got = report(&context, step, &[1.0 + step as f64, 3.0 + step as f64]);
            for stats in got {
                assert_eq!(stats.loss, 2.0 + step as f64);
                assert_eq!(stats.tokens, 128);
                assert_eq!(stats.grad_norm, Some(0.5));
            }
        }
        let records = logged(dir.path());
        assert_eq!(records.len(), 3, "one record per step: {records:?}");
        for (step, record) in records.iter().enumerate() {
            assert_eq!(record["step"], step + 1);
            assert_eq!(record["loss"], 2.0 + step as f64);
        }
    }

    #[test]
    fn a_stop_asked_between_steps_pauses_every_rank_after_the_next_step() {
        let dir = tempfile::tempdir().unwrap();
        for ranks in [1, 2] {
            let context = context(dir.path(), ranks);
            context.requests().stop(Some("quit"));
            assert!(context.control.paused().is_none());
            let got = report(&context, 4, &vec![1.0; ranks]);
            assert_eq!(
                context.control.paused(),
                Some((5, "the dashboard's stop".to_string()))
            );
            assert!(
                !context.interrupter.should_stop(),
                "the step's update is applied and the learner goes on to checkpoint"
            );
            assert!(got.iter().all(|s| s.loss == 1.0));
        }
    }

    #[test]
    fn a_non_finite_loss_on_one_rank_stops_every_rank() {
        let dir = tempfile::tempdir().unwrap();
        let context = context(dir.path(), 3);
        let got = report(&context, 0, &[1.0, f64::NAN, 1.0]);
        assert!(got.iter().all(|s| s.loss.is_nan()));
        assert!(context.interrupter.should_stop());
        assert!(context.failure().unwrap().contains("step 1"));
    }
}
