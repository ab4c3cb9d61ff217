//! The associative-recall generator: every answer stands where the document says, the layout is
//! the one asked for, and training never sees an evaluation key.

mod common;

use diffzoo_datasets::recall::{
    self, KeySplit, Layout, MAX_PAIRS, Pair, RecallMix, Vocabulary, document, draw, query_order,
};
use diffzoo_datasets::{Rng, TextTokenizer, TokenWindows, corpus};
use std::collections::{HashMap, HashSet};

const VOCAB: usize = 1024;

/// Training windows of `seq_len` over two plays, in a tokenizer of 400 ids: every id at or above
/// 400 in a window is a reserved recall id.
fn windows(dir: &std::path::Path, seq_len: usize) -> TokenWindows {
    let plays = corpus::plays();
    let tokenizer =
        TextTokenizer::train_bpe(plays.iter().take(2).map(|p| p.text.as_str()), 400).unwrap();
    common::windows(dir, &tokenizer, seq_len)
}

#[test]
fn answers_stand_where_the_document_says_in_the_layout_asked_for() {
    let vocab = Vocabulary::new(VOCAB).unwrap();
    // Text tokens that say where they came from: 100_000 + their index in the text.
    let text: Vec<u32> = (100_000..110_000).collect();
    let mut rng = Rng::new(7);
    for case in 0..300 {
        let split = [KeySplit::Train, KeySplit::Eval][case % 2];
        let n = 1 + rng.below(MAX_PAIRS as u64) as usize;
        let layout = Layout {
            distractors: rng.below(20) as usize,
            distance: rng.below(50) as usize,
        };
        let len = layout.length(n).unwrap() + rng.below(30) as usize;
        let pairs = draw(&mut rng, &vocab, split, n).unwrap();
        let order = query_order(&mut rng, n);
        let doc = document(&pairs, &order, layout, &text, len).unwrap();
        assert_eq!(doc.tokens.len(), len);
        // Distinct first tokens, second tokens and values, all of the split.
        let parts: [fn(&Pair) -> u32; 3] = [|p| p.key[0], |p| p.key[1], |p| p.value];
        for part in parts {
            let seen: HashSet<u32> = pairs.iter().map(part).collect();
            assert_eq!(seen.len(), n);
        }
        assert!(pairs.iter().all(|p| vocab.split_of(p.key) == Some(split)));
        // Every pair asked once, in the order given; each answer after its key, its pair
        // before the queries.
        assert_eq!(doc.queries.len(), n);
        for (query, &i) in doc.queries.iter().zip(&order) {
            let pair = pairs[i];
            assert_eq!(query.value, pair.value);
            assert_eq!(doc.tokens[query.answer], pair.value);
            assert_eq!(doc.tokens[query.answer - 2..query.answer], pair.key);
            assert_eq!(
                doc.tokens[query.pair.clone()],
                [pair.key[0], pair.key[1], pair.value]
            );
            assert!(query.pair.end <= doc.context && query.answer > doc.context);
            let occurrences = doc.tokens.windows(2).filter(|w| *w == pair.key).count();
            assert_eq!(
                occurrences, 2,
                "the key stands once as a pair, once as a query"
            );
        }
        // Filler, distractors and distance: text in order, the amounts asked.
        let mut spans: Vec<_> = doc.queries.iter().map(|q| q.pair.clone()).collect();
        spans.sort_by_key(|s| s.start);
        assert_eq!(spans[0].start, len - layout.length(n).unwrap());
        for w in spans.windows(2) {
            assert_eq!(w[1].start - w[0].end, layout.distractors);
        }
        assert_eq!(doc.context - spans[n - 1].end, layout.distance);
        let texts: Vec<u32> = doc
            .tokens
            .iter()
            .copied()
            .filter(|&t| t >= 100_000)
            .collect();
        assert_eq!(texts, text[..len - 6 * n]);
        // Draws are a pure function of the generator's state.
        let seed = case as u64;
        assert_eq!(
            draw(&mut Rng::new(seed), &vocab, split, n).unwrap(),
            draw(&mut Rng::new(seed), &vocab, split, n).unwrap()
        );
    }
}

#[test]
fn documents_that_cannot_fit_and_pair_counts_out_of_range_are_refused() {
    let vocab = Vocabulary::new(VOCAB).unwrap();
    let mut rng = Rng::new(1);
    for n in [0, MAX_PAIRS + 1] {
        let e = draw(&mut rng, &vocab, KeySplit::Train, n).unwrap_err();
        assert!(e.to_string().contains(&n.to_string()), "{e}");
    }
    let pairs = draw(&mut rng, &vocab, KeySplit::Train, 4).unwrap();
    let layout = Layout {
        distractors: 10,
        distance: 5,
    };
    let e = document(&pairs, &[0, 1, 2, 3], layout, &[1; 1000], 58).unwrap_err();
    assert!(e.to_string().contains("59 tokens, more than 58"), "{e}");
    let e = document(&pairs, &[0, 1, 2, 3], layout, &[1; 10], 59).unwrap_err();
    assert!(e.to_string().contains("35 tokens of text, 10 given"), "{e}");
    for order in [&[0, 1, 2][..], &[0, 1, 2, 2], &[0, 1, 2, 4]] {
        let e = document(&pairs, order, layout, &[1; 1000], 80).unwrap_err();
        assert!(
            e.to_string().contains("not a permutation of the 4 pairs"),
            "{e}"
        );
    }
    let huge = Layout {
        distractors: usize::MAX,
        distance: 0,
    };
    assert_eq!(huge.length(3), None);
    let e = document(&pairs, &[0, 1, 2, 3], huge, &[1; 1000], 80).unwrap_err();
    assert!(
        e.to_string().contains("more tokens than can be counted"),
        "{e}"
    );
}

#[test]
fn training_windows_recall_their_own_pairs_with_training_keys_only() {
    let dir = tempfile::tempdir().unwrap();
    let seq_len = 256;
    let windows = windows(dir.path(), seq_len);
    let vocab = Vocabulary::new(VOCAB).unwrap();
    let mix = RecallMix {
        vocab,
        fraction: 0.4,
        max_pairs: 12,
        max_distractors: 8,
        answers_only: false,
        seed: 3,
    };
    assert!(recall::longest(mix.max_pairs, mix.max_distractors).unwrap() < seq_len);
    let chosen = (0..500).filter(|&p| mix.chooses(p)).count();
    assert!(
        (160..240).contains(&chosen),
        "{chosen} of 500 chosen at 0.4"
    );
    let (mut pair_counts, mut gaps) = (HashSet::new(), HashSet::new());
    for position in (0..500).filter(|&p| mix.chooses(p)).take(100) {
        let doc = mix.window(position, &windows, seq_len + 1).unwrap();
        assert_eq!(doc, mix.window(position, &windows, seq_len + 1).unwrap());
        let tokens = doc.tokens.clone();
        assert_eq!(tokens.len(), seq_len + 1);
        // The scored targets (target t is token t + 1) are exactly the queried values, found
        // again after their keys.
        let scored: Vec<usize> = (0..seq_len).filter(|&t| doc.answer_targets()[t]).collect();
        assert_eq!(scored.len(), doc.queries.len());
        for (&t, q) in scored.iter().zip(&doc.queries) {
            assert_eq!(doc.tokens[t + 1], q.value);
            assert_eq!(
                doc.tokens[t - 1..t + 1],
                doc.tokens[q.pair.start..q.pair.start + 2]
            );
        }
        // The reserved ids, in order: key tokens and values (the text is below 400).
        let reserved: Vec<(usize, u32)> = tokens
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, t)| t >= 400)
            .collect();
        assert_eq!(reserved.len() % 6, 0);
        let n = reserved.len() / 6;
        let triples: Vec<(usize, [u32; 2], u32)> = reserved
            .chunks(3)
            .map(|c| {
                assert_eq!((c[1].0, c[2].0), (c[0].0 + 1, c[0].0 + 2), "a split triple");
                (c[0].0, [c[0].1, c[1].1], c[2].1)
            })
            .collect();
        let (stated, asked) = triples.split_at(n);
        let values: HashMap<[u32; 2], u32> = stated.iter().map(|&(_, k, v)| (k, v)).collect();
        assert_eq!(values.len(), n);
        for &(_, key, value) in asked {
            assert_eq!(vocab.split_of(key), Some(KeySplit::Train));
            assert_eq!(values.get(&key), Some(&value), "a query answered otherwise");
        }
        let asked_keys: HashSet<[u32; 2]> = asked.iter().map(|a| a.1).collect();
        assert_eq!(asked_keys.len(), n, "every pair asked once");
        pair_counts.insert(n);
        gaps.extend(stated.windows(2).map(|w| w[1].0 - w[0].0 - 3));
        // All distractor gaps of a document are equal.
        let doc_gaps: HashSet<usize> = stated.windows(2).map(|w| w[1].0 - w[0].0 - 3).collect();
        assert!(doc_gaps.len() <= 1);
    }
    assert!(pair_counts.len() >= 10 && pair_counts.iter().all(|&n| n <= 12));
    assert!(gaps.len() == 9 && gaps.iter().all(|&g| g <= 8));
}
