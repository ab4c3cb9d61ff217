//! Burn data loaders whose "epoch" is one checkpoint interval of optimizer steps. Each item is
//! one optimizer step: its global step index and its micro-batches. The samples of step `k` are
//! positions `k·B .. (k+1)·B` of the recipe's sample order, so a run resumed at a checkpoint
//! continues with exactly the samples an uninterrupted run would have seen.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::Device;
use diffzoo_datasets::needle::NeedleMix;
use diffzoo_datasets::{LmBatch, LmBatcher, SampleOrder, TokenWindows};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One optimizer step's data.
#[derive(Debug, Clone)]
pub struct StepBatch {
    /// Global 0-based optimizer step (0 for validation).
    pub step: usize,
    pub micro: Vec<LmBatch>,
}

/// Which epoch an `iter()` call serves.
#[derive(Debug, Clone)]
enum Epochs {
    /// Training: successive calls serve successive epochs (1-based), starting after a resumed
    /// checkpoint.
    Counter(Arc<AtomicUsize>),
    /// Validation: always the same items.
    Fixed,
}

#[derive(Clone)]
pub struct StepLoader {
    windows: Arc<TokenWindows>,
    order: SampleOrder,
    /// Training only: the needle documents replacing some windows.
    needles: Option<Arc<NeedleMix>>,
    /// Sequences per item.
    sequences: usize,
    micro_batch: usize,
    steps_per_epoch: usize,
    total_steps: usize,
    epochs: Epochs,
    /// Items `range.0 .. range.1` of each epoch (a `slice` of the loader).
    range: Option<(usize, usize)>,
    device: Device,
}

impl StepLoader {
    /// The training loader; the first `iter()` serves epoch `first_epoch` (1-based).
    #[allow(clippy::too_many_arguments)]
    pub fn training(
        windows: Arc<TokenWindows>,
        seed: u64,
        sequences: usize,
        micro_batch: usize,
        steps_per_epoch: usize,
        total_steps: usize,
        first_epoch: usize,
        device: Device,
    ) -> Self {
        let order = SampleOrder::shuffled(windows.len(), seed);
        Self {
            windows,
            order,
            needles: None,
            sequences,
            micro_batch,
            steps_per_epoch,
            total_steps,
            epochs: Epochs::Counter(Arc::new(AtomicUsize::new(first_epoch))),
            range: None,
            device,
        }
    }

    /// The validation loader: the first `batches · micro_batch` windows, in order, every time.
    pub fn validation(
        windows: Arc<TokenWindows>,
        micro_batch: usize,
        batches: usize,
        device: Device,
    ) -> Self {
        let order = SampleOrder::sequential(windows.len());
        Self {
            windows,
            order,
            needles: None,
            sequences: micro_batch,
            micro_batch,
            steps_per_epoch: batches,
            total_steps: batches,
            epochs: Epochs::Fixed,
            range: None,
            device,
        }
    }

    /// Replaces the windows `mix` chooses by its needle documents.
    pub fn with_needles(mut self, mix: NeedleMix) -> Self {
        self.needles = Some(Arc::new(mix));
        self
    }

    /// The sample at `position` of the training stream.
    fn sample(&self, position: u64) -> Vec<u32> {
        match &self.needles {
            Some(mix) if mix.chooses(position) => mix
                .window(position, &self.windows, self.windows.seq_len() + 1)
                .unwrap_or_else(|e| panic!("needle document {position}: {e}")),
            _ => self.windows.window(self.order.sample(position)),
        }
    }

    /// The first step and the number of steps of `epoch`.
    fn epoch_steps(&self, epoch: usize) -> (usize, usize) {
        let first = (epoch - 1) * self.steps_per_epoch;
        let count = self
            .steps_per_epoch
            .min(self.total_steps.saturating_sub(first));
        match self.range {
            Some((start, end)) => (first + start, end.min(count).saturating_sub(start)),
            None => (first, count),
        }
    }

    fn next_epoch(&self) -> usize {
        match &self.epochs {
            Epochs::Counter(next) => next.load(Ordering::SeqCst),
            Epochs::Fixed => 1,
        }
    }

    fn take_epoch(&self) -> usize {
        match &self.epochs {
            Epochs::Counter(next) => next.fetch_add(1, Ordering::SeqCst),
            Epochs::Fixed => 1,
        }
    }

    fn item(&self, step: usize) -> StepBatch {
        let first = (step * self.sequences) as u64;
        let windows: Vec<Vec<u32>> = (0..self.sequences as u64)
            .map(|i| self.sample(first + i))
            .collect();
        let micro = windows
            .chunks(self.micro_batch)
            .map(|chunk| LmBatcher.batch(chunk.to_vec(), &self.device))
            .collect();
        let step = match self.epochs {
            Epochs::Counter(_) => step,
            Epochs::Fixed => 0,
        };
        StepBatch { step, micro }
    }
}

struct StepIter<'a> {
    loader: &'a StepLoader,
    first: usize,
    count: usize,
    done: usize,
}

impl Iterator for StepIter<'_> {
    type Item = Result<StepBatch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done == self.count {
            return None;
        }
        let item = self.loader.item(self.first + self.done);
        self.done += 1;
        Some(Ok(item))
    }
}

impl DataLoaderIterator<StepBatch> for StepIter<'_> {
    fn progress(&self) -> Progress {
        Progress::new(self.done, self.count, Some("steps".into()))
    }
}

impl DataLoader<StepBatch> for StepLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<StepBatch> + 'a> {
        let (first, count) = self.epoch_steps(self.take_epoch());
        Box::new(StepIter {
            loader: self,
            first,
            count,
            done: 0,
        })
    }

    fn num_items(&self) -> usize {
        self.epoch_steps(self.next_epoch()).1
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<StepBatch>> {
        let mut loader = self.clone();
        loader.device = device.clone();
        Arc::new(loader)
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<StepBatch>> {
        let mut loader = self.clone();
        loader.range = Some((start, end));
        Arc::new(loader)
    }
}
