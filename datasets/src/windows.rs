//! Training samples: windows of `seq_len + 1` tokens over a split's token stream, visited in an
//! order that is a pure function of `(seed, epoch)`, so that the samples of global step `k` are
//! known without replaying steps `0..k` (exact resume), and that costs no memory per sample.

use crate::rng::splitmix;
use crate::shards::{FLAG_SCORED, FLAG_START, TokenStream};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::sync::Arc;

/// Training windows of `seq_len + 1` tokens over a token stream.
///
/// Plain shards: non-overlapping windows, window `i` is tokens `i·seq_len ..= (i+1)·seq_len`
/// (inputs and the shifted targets share `seq_len − 1` tokens; consecutive windows share one).
///
/// Conversation shards ([`TokenWindows::conversations`]): window `i` is conversation `i` alone
/// — no packing, so that no conversation attends to another — padded after its end with token
/// 0, which is never scored (causal attention keeps the padding out of every real position's
/// output), and the loss scores the targets its flags mark.
pub struct TokenWindows {
    tokens: TokenStream,
    seq_len: usize,
    /// Conversation shards: the flag bytes and where each conversation starts.
    conversations: Option<(TokenStream, Vec<u64>)>,
}

impl TokenWindows {
    pub fn new(tokens: TokenStream, seq_len: usize) -> Self {
        assert!(seq_len > 0, "sequence length must be positive");
        Self {
            tokens,
            seq_len,
            conversations: None,
        }
    }

    /// One window per conversation of a conversation shard's `tokens` and `flags` (see
    /// [`crate::shards::FLAG_START`]); a conversation longer than `seq_len + 1` tokens is cut.
    pub fn conversations(tokens: TokenStream, flags: TokenStream, seq_len: usize) -> Self {
        assert!(seq_len > 0, "sequence length must be positive");
        assert_eq!(tokens.len(), flags.len(), "a flag per token");
        let mut starts = Vec::new();
        const CHUNK: usize = 1 << 20;
        let mut at = 0;
        while at < flags.len() {
            let n = CHUNK.min((flags.len() - at) as usize);
            starts.extend(
                flags
                    .read(at, n)
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| **f as u8 & FLAG_START != 0)
                    .map(|(i, _)| at + i as u64),
            );
            at += n as u64;
        }
        Self {
            tokens,
            seq_len,
            conversations: Some((flags, starts)),
        }
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Whether windows are conversations (each with its own scored targets).
    pub fn is_conversations(&self) -> bool {
        self.conversations.is_some()
    }

    /// Number of complete windows (conversations).
    pub fn len(&self) -> u64 {
        match &self.conversations {
            Some((_, starts)) => starts.len() as u64,
            None => self.tokens.len().saturating_sub(1) / self.seq_len as u64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where conversation `i` lies in the stream, cut to one window.
    fn span(&self, starts: &[u64], i: u64) -> (u64, usize) {
        let start = starts[i as usize];
        let end = starts
            .get(i as usize + 1)
            .copied()
            .unwrap_or(self.tokens.len());
        (start, ((end - start) as usize).min(self.seq_len + 1))
    }

    /// The `seq_len + 1` tokens of window `i`.
    pub fn window(&self, i: u64) -> Vec<u32> {
        match &self.conversations {
            Some((_, starts)) => {
                let (start, len) = self.span(starts, i);
                let mut tokens = self.tokens.read(start, len);
                tokens.resize(self.seq_len + 1, 0);
                tokens
            }
            None => self.tokens.read(i * self.seq_len as u64, self.seq_len + 1),
        }
    }

    /// Which of window `i`'s `seq_len` targets the loss scores; `None`: all (plain shards).
    pub fn scored(&self, i: u64) -> Option<Vec<bool>> {
        let (flags, starts) = self.conversations.as_ref()?;
        let (start, len) = self.span(starts, i);
        let mut scored: Vec<bool> = flags
            .read(start, len)
            .iter()
            .skip(1)
            .map(|f| *f as u8 & FLAG_SCORED != 0)
            .collect();
        scored.resize(self.seq_len, false);
        Some(scored)
    }
}

/// A bijection of `0..n` for every `(seed, epoch)`: a 4-round Feistel network on the smallest
/// power-of-four domain holding `n`, cycle-walked back into range. O(1) memory, any `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleOrder {
    n: u64,
    seed: u64,
    shuffle: bool,
}

impl SampleOrder {
    /// Shuffled order; a new permutation every epoch.
    pub fn shuffled(n: u64, seed: u64) -> Self {
        assert!(n > 0, "cannot order zero samples");
        Self {
            n,
            seed,
            shuffle: true,
        }
    }

    /// Identity order (validation).
    pub fn sequential(n: u64) -> Self {
        assert!(n > 0, "cannot order zero samples");
        Self {
            n,
            seed: 0,
            shuffle: false,
        }
    }

    pub fn samples_per_epoch(&self) -> u64 {
        self.n
    }

    /// The sample at `position` of the endless stream epoch 0, epoch 1, …
    pub fn sample(&self, position: u64) -> u64 {
        let (epoch, index) = (position / self.n, position % self.n);
        if !self.shuffle {
            return index;
        }
        let half_bits = (64 - (self.n - 1).max(1).leading_zeros()).div_ceil(2);
        let mask = (1u64 << half_bits) - 1;
        let key = splitmix(self.seed ^ splitmix(epoch));
        let mut x = index;
        loop {
            let (mut left, mut right) = (x >> half_bits, x & mask);
            for round in 0..4u64 {
                let f = splitmix(right ^ key.wrapping_add(round)) & mask;
                (left, right) = (right, left ^ f);
            }
            x = (left << half_bits) | right;
            if x < self.n {
                return x;
            }
        }
    }
}

/// `len` consecutive positions of a sample order, starting at `first`, as a Burn dataset of
/// token windows. A training "epoch" of the learner is one such slice.
#[derive(Clone)]
pub struct WindowSlice {
    windows: Arc<TokenWindows>,
    order: SampleOrder,
    first: u64,
    len: usize,
}

impl WindowSlice {
    pub fn new(windows: Arc<TokenWindows>, order: SampleOrder, first: u64, len: usize) -> Self {
        Self {
            windows,
            order,
            first,
            len,
        }
    }
}

impl Dataset<Vec<u32>> for WindowSlice {
    fn get(&self, index: usize) -> Result<Vec<u32>, DatasetError> {
        if index >= self.len {
            return Err(DatasetError::new(std::io::Error::other(format!(
                "window {index} is past the end ({})",
                self.len
            ))));
        }
        Ok(self
            .windows
            .window(self.order.sample(self.first + index as u64)))
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// Inputs and next-token targets, `[batch, seq_len]` each.
#[derive(Debug, Clone)]
pub struct LmBatch {
    pub inputs: Tensor<2, Int>,
    pub targets: Tensor<2, Int>,
    /// Which targets the loss scores (1) and which it skips (0), `[B, S]`; `None`: all.
    pub scored: Option<Tensor<2>>,
}

impl LmBatch {
    /// Scores, in each window, only the targets its row of `scored` marks (`None`: all of that
    /// window's); every window must have at least one scored target.
    pub fn scoring(mut self, scored: &[Option<Vec<bool>>]) -> Self {
        let [b, s] = self.targets.dims();
        assert_eq!(scored.len(), b, "a row of flags per window");
        let flags: Vec<f32> = scored
            .iter()
            .flat_map(|row| match row {
                Some(row) => {
                    assert!(row.len() == s && row.contains(&true), "{s} flags, one set");
                    row.iter().map(|&f| f as u8 as f32).collect()
                }
                None => vec![1.0; s],
            })
            .collect();
        let device = self.targets.device();
        self.scored = Some(Tensor::from_data(TensorData::new(flags, [b, s]), &device));
        self
    }
}

/// Turns windows of `seq_len + 1` tokens into an [`LmBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LmBatcher;

impl Batcher<Vec<u32>, LmBatch> for LmBatcher {
    fn batch(&self, items: Vec<Vec<u32>>, device: &Device) -> LmBatch {
        let (b, s) = (items.len(), items[0].len() - 1);
        let part = |range: fn(&[u32]) -> &[u32]| {
            let ids: Vec<i64> = items
                .iter()
                .flat_map(|w| range(w).iter().map(|&t| t as i64))
                .collect();
            Tensor::from_data(TensorData::new(ids, [b, s]), device)
        };
        LmBatch {
            inputs: part(|w| &w[..w.len() - 1]),
            targets: part(|w| &w[1..]),
            scored: None,
        }
    }
}
