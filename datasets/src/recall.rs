//! Multi-query associative recall (MQAR; Zoology, Arora et al. 2023) with controlled noise: a
//! retrieval task that a model small enough for a CPU learns in minutes, with the amount of
//! irrelevant context as its knob.
//!
//! A document lists key–value *pairs*, then asks every key again:
//!
//! ```text
//! filler  a₁ b₁ v₁ ·d· a₂ b₂ v₂ ·d· … aₚ bₚ vₚ  ·g·  a_σ₁ b_σ₁ v_σ₁ … a_σₚ b_σₚ v_σₚ
//! ```
//!
//! A key is two tokens `(a, b)`, a value one token `v`. `d` *distractor* tokens of corpus text
//! separate consecutive pairs, `g` tokens of corpus text (the query *distance*) separate the
//! last pair from the first query, and filler text in front brings the document to its length.
//! The queries come in a random order σ; each queried value is predicted from its key. Values
//! are drawn afresh for every document, so only retrieval from the context answers (chance:
//! 1 / [`VALUES`]).
//!
//! Keys and values are reserved ids at the top of the vocabulary ([`Vocabulary`]: for a
//! byte-level BPE the rarest merges, so corpus text seldom contains them). Of the
//! [`KEY_TOKENS`]² keys, about a quarter — chosen by a hash of `(a, b)` — are evaluation keys
//! that training never uses ([`KeySplit`]); every single token occurs on both sides, so an
//! evaluated key is new while each of its tokens has been learnt. Within a document all first
//! tokens, second tokens and values are distinct. Everything is a pure function of a seed.

use crate::error::{DataError, Result};
use crate::rng::{Rng, splitmix};
use crate::windows::TokenWindows;
use std::ops::Range;

/// First key tokens, and second key tokens, reserved at the top of the vocabulary.
pub const KEY_TOKENS: u32 = 64;
/// Value tokens reserved at the top of the vocabulary.
pub const VALUES: u32 = 64;
/// The most pairs in one document.
pub const MAX_PAIRS: usize = 32;
/// Token ids reserved at the top of the vocabulary: first key tokens, second key tokens, values.
pub const RESERVED: u32 = 2 * KEY_TOKENS + VALUES;
/// The smallest vocabulary the reserved ids leave most of.
pub const MIN_VOCAB: usize = 1024;

/// Where a key is used: in training documents or in evaluation prompts, never both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySplit {
    Train,
    Eval,
}

/// The reserved ids: first key tokens, then second key tokens, then values, ending at the
/// vocabulary's last id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vocabulary {
    first: u32,
}

impl Vocabulary {
    pub fn new(vocab_size: usize) -> Result<Self> {
        if !(MIN_VOCAB..=u32::MAX as usize).contains(&vocab_size) {
            return Err(DataError::Invalid(format!(
                "associative recall reserves the top {RESERVED} token ids: a vocabulary of \
                 {vocab_size} must hold between {MIN_VOCAB} and {} ids",
                u32::MAX
            )));
        }
        Ok(Self {
            first: vocab_size as u32 - RESERVED,
        })
    }

    /// The first reserved id; every id from it to the vocabulary's end is a key token or a value.
    pub fn first_reserved(&self) -> u32 {
        self.first
    }

    /// The key made of first token `i` and second token `j` (each below [`KEY_TOKENS`]).
    pub fn key(&self, i: u32, j: u32) -> [u32; 2] {
        [self.first + i, self.first + KEY_TOKENS + j]
    }

    /// Value `i` (below [`VALUES`]).
    pub fn value(&self, i: u32) -> u32 {
        self.first + 2 * KEY_TOKENS + i
    }

    /// The split of the key `(first token i, second token j)`.
    pub fn split(i: u32, j: u32) -> KeySplit {
        if splitmix(((i as u64) << 32) | j as u64).is_multiple_of(4) {
            KeySplit::Eval
        } else {
            KeySplit::Train
        }
    }

    /// The split of a key of this vocabulary; `None` for tokens that do not form one.
    pub fn split_of(&self, key: [u32; 2]) -> Option<KeySplit> {
        let i = key[0].checked_sub(self.first)?;
        let j = key[1].checked_sub(self.first + KEY_TOKENS)?;
        (i < KEY_TOKENS && j < KEY_TOKENS).then(|| Self::split(i, j))
    }
}

/// One key and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub key: [u32; 2],
    pub value: u32,
}

/// `n` pairs (1 to [`MAX_PAIRS`]) with keys of `split`, all first tokens, second tokens and
/// values distinct.
pub fn draw(rng: &mut Rng, vocab: &Vocabulary, split: KeySplit, n: usize) -> Result<Vec<Pair>> {
    if !(1..=MAX_PAIRS).contains(&n) {
        return Err(DataError::Invalid(format!(
            "{n} recall pairs: between 1 and {MAX_PAIRS} are possible"
        )));
    }
    let mut firsts = shuffled(rng, KEY_TOKENS);
    let mut seconds = shuffled(rng, KEY_TOKENS);
    let values = shuffled(rng, VALUES);
    let mut pairs = Vec::with_capacity(n);
    for (k, &value) in values.iter().take(n).enumerate() {
        // The first (first, second) among those left, in their shuffled orders, whose key is of
        // `split`: at least 33 of each are left, so one exists unless the hash is degenerate.
        let (fi, si) = (k..firsts.len())
            .flat_map(|fi| (k..seconds.len()).map(move |si| (fi, si)))
            .find(|&(fi, si)| Vocabulary::split(firsts[fi], seconds[si]) == split)
            .ok_or_else(|| DataError::Invalid(format!("no {split:?} key is left for pair {k}")))?;
        firsts.swap(k, fi);
        seconds.swap(k, si);
        pairs.push(Pair {
            key: vocab.key(firsts[k], seconds[k]),
            value: vocab.value(value),
        });
    }
    Ok(pairs)
}

/// `0..n` in a random order.
fn shuffled(rng: &mut Rng, n: u32) -> Vec<u32> {
    let mut items: Vec<u32> = (0..n).collect();
    rng.shuffle(&mut items);
    items
}

/// The amounts of corpus text in a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tokens between consecutive pairs.
    pub distractors: usize,
    /// Tokens between the last pair and the first query.
    pub distance: usize,
}

impl Layout {
    /// Tokens of a document of `pairs` pairs, all queried, without filler; `None` past `usize`.
    pub fn length(&self, pairs: usize) -> Option<usize> {
        pairs
            .saturating_sub(1)
            .checked_mul(self.distractors)?
            .checked_add(self.distance)?
            .checked_add(pairs.checked_mul(6)?)
    }
}

/// The longest training document of up to `max_pairs` pairs and `max_distractors` tokens
/// between pairs (no filler, no distance); `None` past `usize`.
pub fn longest(max_pairs: usize, max_distractors: usize) -> Option<usize> {
    Layout {
        distractors: max_distractors,
        distance: 0,
    }
    .length(max_pairs)
}

/// A queried pair in a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// Where the pair (its key and value) stands in the context.
    pub pair: Range<usize>,
    /// Where the queried value stands; the token before it (the key's second token) predicts it.
    pub answer: usize,
    pub value: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecallDocument {
    pub tokens: Vec<u32>,
    /// Where the queries begin: everything before is context.
    pub context: usize,
    pub queries: Vec<Query>,
}

/// A document of exactly `len` tokens: `pairs`, asked in the order `order` (a permutation of
/// their indices), laid out as `layout` says, with text (filler, distractors, distance) taken in
/// turn from `text`.
pub fn document(
    pairs: &[Pair],
    order: &[usize],
    layout: Layout,
    text: &[u32],
    len: usize,
) -> Result<RecallDocument> {
    let mut sorted = order.to_vec();
    sorted.sort_unstable();
    if !sorted.iter().copied().eq(0..pairs.len()) {
        return Err(DataError::Invalid(format!(
            "the query order {order:?} is not a permutation of the {} pairs",
            pairs.len()
        )));
    }
    let needed = layout.length(pairs.len()).filter(|&n| n <= len);
    let Some(needed) = needed else {
        return Err(DataError::Invalid(format!(
            "{} recall pairs with {} distractors between pairs and {} tokens before the queries \
             take {}, more than {len}",
            pairs.len(),
            layout.distractors,
            layout.distance,
            layout
                .length(pairs.len())
                .map_or("more tokens than can be counted".into(), |n| format!(
                    "{n} tokens"
                ))
        )));
    };
    let text_tokens = len - 6 * pairs.len();
    if text.len() < text_tokens {
        return Err(DataError::Invalid(format!(
            "a recall document of {len} tokens needs {text_tokens} tokens of text, {} given",
            text.len()
        )));
    }
    let mut text = text.iter().copied();
    let mut tokens: Vec<u32> = text.by_ref().take(len - needed).collect();
    let mut spans = Vec::with_capacity(pairs.len());
    for (i, pair) in pairs.iter().enumerate() {
        if i > 0 {
            tokens.extend(text.by_ref().take(layout.distractors));
        }
        spans.push(tokens.len()..tokens.len() + 3);
        tokens.extend(pair.key);
        tokens.push(pair.value);
    }
    tokens.extend(text.by_ref().take(layout.distance));
    let context = tokens.len();
    let mut queries = Vec::with_capacity(order.len());
    for &i in order {
        let pair = &pairs[i];
        tokens.extend(pair.key);
        queries.push(Query {
            pair: spans[i].clone(),
            answer: tokens.len(),
            value: pair.value,
        });
        tokens.push(pair.value);
    }
    Ok(RecallDocument {
        tokens,
        context,
        queries,
    })
}

impl RecallDocument {
    /// Over the document's next-token targets (`tokens[1..]`), which are queried values: the
    /// targets a loss on answers only scores.
    pub fn answer_targets(&self) -> Vec<bool> {
        let mut scored = vec![false; self.tokens.len() - 1];
        for q in &self.queries {
            scored[q.answer - 1] = true;
        }
        scored
    }
}

/// A random order of `n` queries.
pub fn query_order(rng: &mut Rng, n: usize) -> Vec<usize> {
    shuffled(rng, n as u32)
        .into_iter()
        .map(|i| i as usize)
        .collect()
}

/// The training mixture of the `tiny-recall` recipes: a fraction of the training windows are
/// replaced by one recall document each, of training keys, 1 to `max_pairs` pairs and 0 to
/// `max_distractors` distractor tokens between pairs (both uniform), the text that is left split
/// uniformly between filler and query distance; text from random training windows.
#[derive(Debug, Clone)]
pub struct RecallMix {
    pub vocab: Vocabulary,
    pub fraction: f64,
    pub max_pairs: usize,
    pub max_distractors: usize,
    /// Score only the queried values of these documents (as Zoology trains), not every token.
    pub answers_only: bool,
    pub seed: u64,
}

impl RecallMix {
    /// Whether the sample at stream `position` is a recall document.
    pub fn chooses(&self, position: u64) -> bool {
        Rng::for_item(self.seed ^ 0x7265_6361_6C6C, position).uniform() < self.fraction
    }

    /// The recall document at stream `position`, `len` tokens.
    pub fn window(
        &self,
        position: u64,
        windows: &TokenWindows,
        len: usize,
    ) -> Result<RecallDocument> {
        let mut rng = Rng::for_item(self.seed ^ 0x6B65_7973, position);
        let mut text = Vec::new();
        while text.len() < len {
            text.extend(windows.window(rng.below(windows.len())));
        }
        let pairs = 1 + rng.below(self.max_pairs as u64) as usize;
        let distractors = rng.below((self.max_distractors as u64).saturating_add(1)) as usize;
        let mut layout = Layout {
            distractors,
            distance: 0,
        };
        let spare = layout
            .length(pairs)
            .and_then(|n| len.checked_sub(n))
            .ok_or_else(|| {
                DataError::Invalid(format!(
                    "a window of {len} tokens cannot hold {pairs} recall pairs with {distractors} \
                     tokens between them"
                ))
            })?;
        layout.distance = rng.below(spare as u64 + 1) as usize;
        let drawn = draw(&mut rng, &self.vocab, KeySplit::Train, pairs)?;
        let order = query_order(&mut rng, pairs);
        document(&drawn, &order, layout, &text, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn about_a_quarter_of_the_keys_are_for_evaluation_and_every_token_is_in_both() {
        let eval: Vec<(u32, u32)> = (0..KEY_TOKENS)
            .flat_map(|i| (0..KEY_TOKENS).map(move |j| (i, j)))
            .filter(|&(i, j)| Vocabulary::split(i, j) == KeySplit::Eval)
            .collect();
        let share = eval.len() as f64 / (KEY_TOKENS * KEY_TOKENS) as f64;
        assert!((0.2..0.3).contains(&share), "{share}");
        for t in 0..KEY_TOKENS {
            for split in [KeySplit::Train, KeySplit::Eval] {
                assert!((0..KEY_TOKENS).any(|j| Vocabulary::split(t, j) == split));
                assert!((0..KEY_TOKENS).any(|i| Vocabulary::split(i, t) == split));
            }
        }
    }

    #[test]
    fn a_vocabulary_too_small_for_the_reserved_ids_is_refused() {
        let e = Vocabulary::new(512).unwrap_err().to_string();
        assert!(e.contains("512") && e.contains("1024"), "{e}");
        let v = Vocabulary::new(1024).unwrap();
        assert_eq!(v.value(VALUES - 1), 1023);
        assert_eq!(v.key(0, 0), [1024 - 192, 1024 - 128]);
        assert_eq!(v.split_of([5, 6]), None);
    }
}
