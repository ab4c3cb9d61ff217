//! What a step reports, the dashboard metrics built from it, and the run's metrics log
//! (`metrics.jsonl`, one JSON object per training step and per validation).

use super::tensorboard::EventFile;
use burn::tensor::ExecutionError;
use burn::tensor::TensorReadError;
use burn::train::ItemLazy;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes,
    NumericEntry, SerializedEntry,
};
use serde::Serialize;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

/// The numbers of one training step (or one validation batch).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepStats {
    /// Mean next-token cross-entropy (nats).
    pub loss: f64,
    /// Target tokens the loss is averaged over.
    pub tokens: usize,
    /// Global gradient norm before clipping (training only).
    pub grad_norm: Option<f64>,
    /// Training throughput since the previous step.
    pub tokens_per_sec: Option<f64>,
    /// DIFF V1's λ of every layer (empty for other variants).
    pub lambdas: Vec<f32>,
    /// Optimizer steps completed (training only).
    pub step: Option<usize>,
}

impl ItemLazy for StepStats {
    fn sync(self) -> Result<Self, ExecutionError> {
        Ok(self)
    }
}

impl Adaptor<StepStats> for StepStats {
    fn adapt(&self) -> StepStats {
        self.clone()
    }
}

type Select = Arc<dyn Fn(&StepStats) -> Option<f64> + Send + Sync>;

/// A numeric dashboard metric reading one number of [`StepStats`], averaged over the epoch
/// weighted by tokens.
#[derive(Clone)]
pub struct StatMetric {
    name: MetricName,
    select: Select,
    precision: usize,
    higher_is_better: bool,
    state: NumericMetricState,
}

impl StatMetric {
    fn new(name: &str, precision: usize, higher_is_better: bool, select: Select) -> Self {
        Self {
            name: Arc::new(name.to_string()),
            select,
            precision,
            higher_is_better,
            state: NumericMetricState::default(),
        }
    }

    pub fn loss() -> Self {
        Self::new("Loss", 4, false, Arc::new(|s| Some(s.loss)))
    }

    /// exp(loss) per step; the epoch value is the mean over steps (the exact validation
    /// perplexity, exp of the mean loss, is in `metrics.jsonl`).
    pub fn perplexity() -> Self {
        Self::new("Perplexity", 2, false, Arc::new(|s| Some(s.loss.exp())))
    }

    pub fn grad_norm() -> Self {
        Self::new("Gradient norm", 3, false, Arc::new(|s| s.grad_norm))
    }

    pub fn tokens_per_sec() -> Self {
        Self::new("Tokens per second", 0, true, Arc::new(|s| s.tokens_per_sec))
    }

    /// λ of layer `layer` (DIFF V1).
    pub fn lambda(layer: usize) -> Self {
        Self::new(
            &format!("λ layer {layer}"),
            4,
            true,
            Arc::new(move |s| s.lambdas.get(layer).map(|&l| l as f64)),
        )
    }
}

impl Metric for StatMetric {
    type Input = StepStats;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: self.higher_is_better,
        }
        .into()
    }

    fn update(
        &mut self,
        item: &StepStats,
        _metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        if let Some(value) = (self.select)(item) {
            self.state.update(value, item.tokens.max(1));
        }
        Ok(self
            .state
            .compute_update(FormatOptions::new(self.name.clone()).precision(self.precision)))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self
            .state
            .compute_final(FormatOptions::new(self.name.clone()).precision(self.precision)))
    }

    fn clear(&mut self) {
        self.state.reset();
    }
}

impl Numeric for StatMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }

    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}

/// The dashboard's "Step" line: the optimizer step of the run, which Burn's dashboard does not
/// show (its "epoch" is a checkpoint interval, its iterations that interval's steps).
#[derive(Clone)]
pub struct StepMetric {
    total: usize,
    interval: usize,
    last: Option<SerializedEntry>,
}

impl StepMetric {
    pub fn new(total: usize, interval: usize) -> Self {
        Self {
            total,
            interval,
            last: None,
        }
    }
}

impl Metric for StepMetric {
    type Input = StepStats;

    fn name(&self) -> MetricName {
        Arc::new("Step".to_string())
    }

    fn update(
        &mut self,
        item: &StepStats,
        _metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let entry = match item.step {
            Some(step) => {
                let text = format!(
                    "{step} of {} (an epoch here is a checkpoint interval, {} steps)",
                    self.total, self.interval
                );
                SerializedEntry::new(text, step.to_string())
            }
            None => SerializedEntry::not_available(None),
        };
        self.last = Some(entry.clone());
        Ok(entry)
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self
            .last
            .clone()
            .unwrap_or_else(|| SerializedEntry::not_available(None)))
    }

    fn clear(&mut self) {
        self.last = None;
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Serialize)]
pub struct LogRecord<'a> {
    pub split: &'a str,
    /// Optimizer steps completed.
    pub step: usize,
    pub tokens_seen: u64,
    pub loss: f64,
    pub perplexity: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lambda: Vec<f32>,
    /// The warm-up's scale of λ this step computed with (`training.lambda_warmup`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lambda_scale: Option<f64>,
    pub elapsed_sec: f64,
}

/// The metrics log, appended to (a resumed run continues it) and flushed every record; with
/// [`MetricsLog::with_tensorboard`], also written as TensorBoard events.
pub struct MetricsLog {
    file: BufWriter<File>,
    events: Option<EventFile>,
}

impl MetricsLog {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self {
            file: BufWriter::new(file),
            events: None,
        })
    }

    /// Writes every record to a new event file in `dir` too, after the records of the log at
    /// `log` so far (see [`super::tensorboard`]).
    pub fn with_tensorboard(mut self, dir: &Path, log: &Path) -> std::io::Result<Self> {
        self.events = Some(EventFile::replacing(dir, log)?);
        Ok(self)
    }

    pub fn write(&mut self, record: &LogRecord) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.file, record)?;
        self.file.write_all(b"\n")?;
        self.file.flush()?;
        if let Some(events) = &mut self.events {
            events.write(&serde_json::to_value(record)?)?;
            events.flush()?;
        }
        Ok(())
    }
}
