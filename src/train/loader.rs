//! Burn data loaders whose "epoch" is one checkpoint interval of optimizer steps. Each item is
//! one optimizer step: its global step index and its micro-batches. The samples of step `k` are
//! positions `k·B .. (k+1)·B` of the recipe's sample order, so a run resumed at a checkpoint
//! continues with exactly the samples an uninterrupted run would have seen.
//!
//! A run resumed from a checkpoint of a stopped run (see [`super::control`]) starts
//! mid-interval: its first epoch runs to the next multiple of the interval (see [`Intervals`]),
//! and later ones are whole again.
//!
//! Data-parallel training ([`StepLoader::data_parallel`]) splits each step's samples into equal
//! shares, one per device, in device order: rank `r` of `N` gets positions
//! `k·B + r·B/N .. k·B + (r+1)·B/N`, so the devices together see exactly the samples one device
//! would. Burn's DDP strategy slices the loader into one contiguous item range per device
//! (`split_dataloader`); a data-parallel loader therefore has `N ×` the epoch's steps as items,
//! rank-major, and a slice is one rank's whole share.

use super::control::{Control, Intervals};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::Device;
use diffzoo_datasets::needle::NeedleMix;
use diffzoo_datasets::recall::RecallMix;
use diffzoo_datasets::{DataError, LmBatch, LmBatcher, SampleOrder, TokenWindows};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One optimizer step's data (under data parallelism: one device's share of it).
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

/// Synthetic documents that replace some training windows (a recipe's `data.needles` or
/// `data.recall`).
#[derive(Debug)]
pub enum Mixture {
    Needles(Box<NeedleMix>),
    Recall(RecallMix),
}

#[derive(Clone)]
pub struct StepLoader {
    windows: Arc<TokenWindows>,
    order: SampleOrder,
    /// Training only: the synthetic documents replacing some windows.
    mixture: Option<Arc<Mixture>>,
    /// Sequences per item.
    sequences: usize,
    micro_batch: usize,
    /// The steps of each epoch.
    intervals: Intervals,
    epochs: Epochs,
    /// Ends training epochs early, and skips validation, once the run pauses.
    control: Option<Arc<Control>>,
    /// Items `range.0 .. range.1` of each epoch (a `slice` of the loader).
    range: Option<(usize, usize)>,
    /// Devices sharing each step (1: no data parallelism).
    ranks: usize,
    /// The one share this loader serves (a `slice` of a data-parallel loader); `None`: all.
    rank: Option<usize>,
    device: Device,
}

impl StepLoader {
    /// The training loader; successive `iter()` calls serve the epochs of `intervals` from its
    /// first.
    pub fn training(
        windows: Arc<TokenWindows>,
        seed: u64,
        sequences: usize,
        micro_batch: usize,
        intervals: Intervals,
        device: Device,
    ) -> Self {
        let order = SampleOrder::shuffled(windows.len(), seed);
        Self {
            windows,
            order,
            mixture: None,
            sequences,
            micro_batch,
            intervals,
            epochs: Epochs::Counter(Arc::new(AtomicUsize::new(intervals.first_epoch))),
            control: None,
            range: None,
            ranks: 1,
            rank: None,
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
            mixture: None,
            sequences: micro_batch,
            micro_batch,
            intervals: Intervals {
                first_epoch: 1,
                first_step: 0,
                interval: batches,
                total: batches,
            },
            epochs: Epochs::Fixed,
            control: None,
            range: None,
            ranks: 1,
            rank: None,
            device,
        }
    }

    /// Replaces the windows `mixture` chooses by its documents.
    pub fn with_mixture(mut self, mixture: Mixture) -> Self {
        self.mixture = Some(Arc::new(mixture));
        self
    }

    /// Ends epochs early (training) or serves nothing (validation) once `control` pauses.
    pub fn with_control(mut self, control: Arc<Control>) -> Self {
        self.control = Some(control);
        self
    }

    /// Splits each step across `ranks` devices; the step's micro-batches must divide evenly
    /// (see [`shares`]).
    pub fn data_parallel(mut self, ranks: usize) -> Self {
        if let Err(e) = shares(self.sequences / self.micro_batch, ranks) {
            panic!("{e}");
        }
        self.ranks = ranks;
        self
    }

    /// The ranks this loader serves.
    fn rank_range(&self) -> (usize, usize) {
        self.rank.map_or((0, self.ranks), |r| (r, r + 1))
    }

    /// The sample at `position` of the training stream, with the targets its loss scores
    /// (`None`: all).
    fn sample(&self, position: u64) -> (Vec<u32>, Option<Vec<bool>>) {
        let len = self.windows.seq_len() + 1;
        let fail = |e: DataError| -> String { format!("synthetic document {position}: {e}") };
        match self.mixture.as_deref() {
            Some(Mixture::Needles(mix)) if mix.chooses(position) => (
                mix.window(position, &self.windows, len)
                    .unwrap_or_else(|e| panic!("{}", fail(e))),
                None,
            ),
            Some(Mixture::Recall(mix)) if mix.chooses(position) => {
                let doc = mix
                    .window(position, &self.windows, len)
                    .unwrap_or_else(|e| panic!("{}", fail(e)));
                let scored = mix.answers_only.then(|| doc.answer_targets());
                (doc.tokens, scored)
            }
            _ => {
                let i = self.order.sample(position);
                (self.windows.window(i), self.windows.scored(i))
            }
        }
    }

    /// The first step and the number of steps of `epoch`.
    fn epoch_steps(&self, epoch: usize) -> (usize, usize) {
        let (first, count) = self.intervals.steps(epoch);
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

    fn item(&self, step: usize, rank: usize) -> StepBatch {
        let share = self.sequences / self.ranks;
        let first = (step * self.sequences + rank * share) as u64;
        let samples: Vec<(Vec<u32>, Option<Vec<bool>>)> =
            (0..share as u64).map(|i| self.sample(first + i)).collect();
        let micro = samples
            .chunks(self.micro_batch)
            .map(|chunk| {
                // Conversations are cut after the last target any of them scores: what follows
                // is padding, or text whose loss is not counted and which nothing before it
                // attends to.
                let len = match self.windows.is_conversations() {
                    true => chunk
                        .iter()
                        .filter_map(|(_, s)| s.as_ref()?.iter().rposition(|&f| f))
                        .max()
                        .map_or(self.windows.seq_len(), |last| last + 1),
                    false => self.windows.seq_len(),
                };
                let windows = chunk.iter().map(|(w, _)| w[..=len].to_vec()).collect();
                let batch = LmBatcher.batch(windows, &self.device);
                let scored: Vec<Option<Vec<bool>>> = chunk
                    .iter()
                    .map(|(_, s)| s.as_ref().map(|s| s[..len].to_vec()))
                    .collect();
                if scored.iter().any(Option::is_some) {
                    batch.scoring(&scored)
                } else {
                    batch
                }
            })
            .collect();
        let step = match self.epochs {
            Epochs::Counter(_) => step,
            Epochs::Fixed => 0,
        };
        StepBatch { step, micro }
    }
}

/// An epoch's items: steps `first .. first + count` of each rank in `ranks`, rank-major.
struct StepIter<'a> {
    loader: &'a StepLoader,
    first: usize,
    count: usize,
    ranks: (usize, usize),
    done: usize,
}

impl StepIter<'_> {
    fn total(&self) -> usize {
        self.count * (self.ranks.1 - self.ranks.0)
    }
}

impl Iterator for StepIter<'_> {
    type Item = Result<StepBatch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done == self.total() {
            return None;
        }
        let step = self.first + self.done % self.count;
        if let Some(control) = &self.loader.control {
            let serves = match self.loader.epochs {
                Epochs::Counter(_) => control.serves_step(step),
                Epochs::Fixed => control.serves_validation(),
            };
            if !serves {
                return None;
            }
        }
        let rank = self.ranks.0 + self.done / self.count;
        let item = self.loader.item(step, rank);
        self.done += 1;
        Some(Ok(item))
    }
}

impl DataLoaderIterator<StepBatch> for StepIter<'_> {
    fn progress(&self) -> Progress {
        Progress::new(self.done, self.total(), Some("steps".into()))
    }
}

impl DataLoader<StepBatch> for StepLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<StepBatch> + 'a> {
        // The first rank's loader (the only one, on one device) is asked for an epoch only
        // after the checkpoint of the epoch before: other ranks may get there earlier.
        if let (Some(control), Epochs::Counter(_)) = (&self.control, &self.epochs)
            && self.rank.unwrap_or(0) == 0
        {
            control.epoch_starts();
        }
        let (first, count) = self.epoch_steps(self.take_epoch());
        Box::new(StepIter {
            loader: self,
            first,
            count,
            ranks: self.rank_range(),
            done: 0,
        })
    }

    fn num_items(&self) -> usize {
        let (ranks, count) = (self.rank_range(), self.epoch_steps(self.next_epoch()).1);
        (ranks.1 - ranks.0) * count
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<StepBatch>> {
        let mut loader = self.clone();
        loader.device = device.clone();
        Arc::new(loader)
    }

    /// A data-parallel loader is sliced into whole ranks (as Burn's `split_dataloader` does, one
    /// equal range per device); each slice counts its own epochs.
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<StepBatch>> {
        let mut loader = self.clone();
        if self.ranks == 1 {
            loader.range = Some((start, end));
            return Arc::new(loader);
        }
        let count = self.epoch_steps(self.next_epoch()).1;
        let rank = start.checked_div(count).unwrap_or(0);
        assert!(
            self.rank.is_none() && end - start == count && start == rank * count,
            "a data-parallel loader of {} ranks × {count} steps is sliced by whole ranks, not {start}..{end}",
            self.ranks
        );
        loader.rank = Some(rank);
        if let Epochs::Counter(next) = &self.epochs {
            loader.epochs =
                Epochs::Counter(Arc::new(AtomicUsize::new(next.load(Ordering::SeqCst))));
        }
        Arc::new(loader)
    }
}

/// Micro-batches per device and step when `ranks` devices share a step of `micro_batches`.
pub fn shares(micro_batches: usize, ranks: usize) -> Result<usize, String> {
    if ranks == 0 || !micro_batches.is_multiple_of(ranks) {
        return Err(format!(
            "a step's {micro_batches} micro-batches (`training.batch_tokens` / `data.seq_len` / `training.micro_batch`) \
             do not divide evenly across {ranks} devices: every device runs the same number of micro-batches"
        ));
    }
    Ok(micro_batches / ranks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataloader::split::split_dataloader;
    use diffzoo_datasets::shards::prepare;
    use diffzoo_datasets::{Document, InMemory, PrepareOptions, Shards, Split, TextTokenizer};

    /// Windows of 8 tokens over the start of a play.
    fn windows(dir: &std::path::Path) -> Arc<TokenWindows> {
        let text = diffzoo_datasets::corpus::plays()[0].text[..20_000].to_string();
        let tokenizer = TextTokenizer::train_bpe(std::iter::once(text.as_str()), 300).unwrap();
        let mut options = PrepareOptions::new(dir.join("shards"));
        options.validation_every = 0;
        let docs = vec![Document {
            origin: "play".into(),
            row: None,
            text,
        }];
        prepare(InMemory::new(docs), &tokenizer, &options, Vec::new()).unwrap();
        let shards = Shards::open(&dir.join("shards")).unwrap();
        Arc::new(TokenWindows::new(shards.tokens(Split::Train).unwrap(), 8))
    }

    fn ids(batch: &LmBatch) -> Vec<i64> {
        batch.inputs.clone().into_data().iter::<i64>().collect()
    }

    /// Conversation windows: one conversation each, padded, its flags shifted onto targets.
    /// A micro-batch of conversations of different lengths, cut after its last scored target,
    /// scores each conversation as it would alone: no conversation sees another or its padding.
    #[test]
    fn conversations_are_scored_as_if_each_were_alone() {
        use diffzoo_datasets::shards::{Scored, prepare_conversations};
        let dir = tempfile::tempdir().unwrap();
        let text = diffzoo_datasets::corpus::plays()[0].text[..5_000].to_string();
        let tokenizer = TextTokenizer::train_bpe(std::iter::once(text.as_str()), 300).unwrap();
        let conversation = |ids: Vec<u32>, scored_from: usize| Scored {
            text: format!("{ids:?}"),
            scored: (0..ids.len()).map(|i| i >= scored_from).collect(),
            ids,
        };
        let conversations = vec![
            conversation(vec![5, 6, 7, 8, 9], 3),
            conversation(vec![10, 11, 12], 1),
            conversation(vec![13, 14, 15, 16, 17, 18, 19], 6),
        ];
        let mut options = PrepareOptions::new(dir.path().join("chat"));
        options.validation_every = 0;
        let conversations = conversations.into_iter().map(|c| (None, c));
        prepare_conversations(conversations, &tokenizer, &options, "t", 0, Vec::new()).unwrap();
        let shards = Shards::open(&dir.path().join("chat")).unwrap();
        shards.verify().unwrap();
        let windows = TokenWindows::conversations(
            shards.tokens(Split::Train).unwrap(),
            shards.flags(Split::Train).unwrap().unwrap(),
            8,
        );
        assert_eq!(windows.len(), 3);
        assert_eq!(windows.window(1), [10, 11, 12, 0, 0, 0, 0, 0, 0]);
        let flags = |i| windows.scored(i).unwrap();
        assert_eq!(
            flags(0),
            [false, false, true, true, false, false, false, false]
        );
        assert_eq!(
            flags(1),
            [true, true, false, false, false, false, false, false]
        );
        assert_eq!(
            flags(2),
            [false, false, false, false, false, true, false, false]
        );

        let device = burn::tensor::Device::flex();
        device.seed(3);
        let model = diffzoo_models::ModelConfig::new(
            diffzoo_models::AttentionKind::Diff,
            16,
            2,
            2,
            300,
            16,
        )
        .init(&device);
        let loader = StepLoader::training(
            Arc::new(windows),
            1,
            3,
            3,
            Intervals {
                first_epoch: 1,
                first_step: 0,
                interval: 1,
                total: 1,
            },
            device.clone(),
        );
        let item = loader.iter().next().unwrap().unwrap();
        let batch = &item.micro[0];
        // Cut after the last scored target of any: the 7-token conversation's sixth.
        assert_eq!(batch.inputs.dims(), [3, 6]);
        let got = crate::train::loss::lm_loss(&model, batch).into_scalar::<f64>();
        // Each alone, unpadded: the mean over its scored targets; the batch, the mean of those.
        let alone = |ids: &[i64], scored: &[usize]| {
            let n = ids.len() - 1;
            let input = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(ids[..n].to_vec(), [1, n]),
                &device,
            );
            let target = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(ids[1..].to_vec(), [1, n]),
                &device,
            );
            let nll = crate::eval::f64_values(crate::eval::token_nll(&model, input, target));
            scored.iter().map(|&t| nll[t]).sum::<f64>() / scored.len() as f64
        };
        let want = (alone(&[5, 6, 7, 8, 9], &[2, 3])
            + alone(&[10, 11, 12], &[0, 1])
            + alone(&[13, 14, 15, 16, 17, 18, 19], &[5]))
            / 3.0;
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }

    /// One epoch of a loader: each item's step and its micro-batches' input ids.
    fn epoch(loader: &dyn DataLoader<StepBatch>) -> Vec<(usize, Vec<Vec<i64>>)> {
        let mut iter = loader.iter();
        let mut items = Vec::new();
        for item in iter.by_ref() {
            let item = item.unwrap();
            items.push((item.step, item.micro.iter().map(ids).collect()));
        }
        assert_eq!(iter.progress().items_processed, items.len());
        items
    }

    /// A recall mixture scoring answers only gives its windows' flags to the batches, plain
    /// windows none; scoring every token gives no flags at all.
    #[test]
    fn recall_windows_carry_their_scored_targets_into_the_batches() {
        use diffzoo_datasets::recall::{RecallMix, Vocabulary};
        let dir = tempfile::tempdir().unwrap();
        let windows = windows(dir.path());
        let device = Device::flex();
        let intervals = Intervals {
            first_epoch: 1,
            first_step: 0,
            interval: 2,
            total: 2,
        };
        let mix = |answers_only| {
            Mixture::Recall(RecallMix {
                vocab: Vocabulary::new(1024).unwrap(),
                fraction: 0.5,
                max_pairs: 1,
                max_distractors: 0,
                answers_only,
                seed: 5,
            })
        };
        let loader = |answers_only| {
            StepLoader::training(windows.clone(), 3, 16, 16, intervals, device.clone())
                .with_mixture(mix(answers_only))
        };
        let item = loader(true).iter().next().unwrap().unwrap();
        let batch = &item.micro[0];
        let flags: Vec<f32> = batch
            .scored
            .clone()
            .unwrap()
            .into_data()
            .iter::<f32>()
            .collect();
        let targets: Vec<i64> = batch.targets.clone().into_data().iter::<i64>().collect();
        let (mut recall, mut plain) = (0, 0);
        for (row, row_targets) in flags.chunks(8).zip(targets.chunks(8)) {
            let scored: Vec<usize> = (0..8).filter(|&t| row[t] == 1.0).collect();
            if scored.len() == 8 {
                plain += 1;
                assert!(row_targets.iter().all(|&t| t < 300), "a plain window");
            } else {
                // One pair: its value is the last target, the only one scored.
                recall += 1;
                assert_eq!(scored, [7]);
                assert!(row_targets[7] >= 1024 - 64, "a value id");
            }
        }
        assert!(
            recall > 0 && plain > 0,
            "{recall} recall and {plain} plain windows"
        );
        let item = loader(false).iter().next().unwrap().unwrap();
        assert!(item.micro[0].scored.is_none());
    }

    #[test]
    fn data_parallel_shares_make_up_each_step_and_each_rank_counts_its_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let windows = windows(dir.path());
        let device = Device::flex();
        // 8 sequences in 4 micro-batches of 2 per step; epochs of 3 steps, 5 steps in all: a
        // fresh run (epochs of 3 and 2 steps) on 2 devices, a run resumed at epoch 2 on 4.
        for (ranks, first_epoch, epochs) in [(2, 1, vec![3, 2]), (4, 2, vec![2])] {
            let single = StepLoader::training(
                windows.clone(),
                3,
                8,
                2,
                Intervals {
                    first_epoch,
                    first_step: (first_epoch - 1) * 3,
                    interval: 3,
                    total: 5,
                },
                device.clone(),
            );
            let parallel = single.clone().data_parallel(ranks);
            assert_eq!(parallel.num_items(), ranks * epochs[0]);
            let shares = split_dataloader(Arc::new(parallel), &vec![device.clone(); ranks]);
            for steps in epochs {
                let whole = epoch(&single);
                let shares: Vec<_> = shares.iter().map(|rank| epoch(rank.as_ref())).collect();
                assert_eq!(whole.len(), steps);
                for (k, (step, micro)) in whole.iter().enumerate() {
                    let mut joined = Vec::new();
                    for share in &shares {
                        let (share_step, share_micro) = &share[k];
                        assert_eq!(share_step, step);
                        assert_eq!(share_micro.len(), 4 / ranks);
                        joined.extend(share_micro.iter().cloned());
                    }
                    assert_eq!(
                        &joined, micro,
                        "step {step}: the ranks' samples in rank order"
                    );
                }
            }
        }
    }

    #[test]
    fn a_run_resumed_mid_interval_finishes_that_interval_first_and_a_pause_ends_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let windows = windows(dir.path());
        let device = Device::flex();
        let intervals = |first_epoch, first_step| Intervals {
            first_epoch,
            first_step,
            interval: 3,
            total: 8,
        };
        let loader = |first_epoch, first_step| {
            StepLoader::training(
                windows.clone(),
                3,
                2,
                2,
                intervals(first_epoch, first_step),
                device.clone(),
            )
        };
        let steps = |loader: &StepLoader| -> Vec<usize> {
            epoch(loader).into_iter().map(|(step, _)| step).collect()
        };
        // Resumed as checkpoint 2 after 4 steps: epochs 3 and 4 run steps 4..6 and 6..8, and
        // they are the samples of a run that never stopped.
        let resumed = loader(3, 4);
        let rest: Vec<_> = (0..2).flat_map(|_| epoch(&resumed)).collect();
        let whole = loader(1, 0);
        let all: Vec<_> = (0..3).flat_map(|_| epoch(&whole)).collect();
        assert_eq!(
            rest.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
            vec![4, 5, 6, 7]
        );
        assert_eq!(rest, all[4..]);

        // A pause taken during an epoch ends it; validation is skipped mid-interval, and the
        // next epoch stops the learner.
        let interrupter = burn::train::Interrupter::new();
        let control = Arc::new(Control::new(intervals(1, 0), interrupter.clone()));
        let paused = loader(1, 0).with_control(control.clone());
        let validation = StepLoader::validation(windows.clone(), 2, 2, device.clone())
            .with_control(control.clone());
        let mut iter = paused.iter();
        assert_eq!(iter.next().unwrap().unwrap().step, 0);
        control.pause(2, "SIGTERM");
        assert_eq!(iter.next().unwrap().unwrap().step, 1);
        assert!(iter.next().is_none(), "the epoch ends at the pause");
        drop(iter);
        assert!(epoch(&validation).is_empty(), "no validation mid-interval");
        assert!(!interrupter.should_stop());
        assert!(steps(&paused).is_empty());
        assert!(
            interrupter.should_stop(),
            "the next epoch stops the learner"
        );
    }

    #[test]
    fn a_step_is_shared_only_by_a_divisor_of_its_micro_batches() {
        assert_eq!(shares(4, 2), Ok(2));
        assert_eq!(shares(4, 1), Ok(4));
        let err = shares(6, 4).unwrap_err();
        assert!(
            err.contains("6 micro-batches") && err.contains("4 devices"),
            "{err}"
        );
    }
}
