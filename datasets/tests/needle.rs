//! The needle-in-a-haystack generator: needles land where asked, decode to their sentences, and
//! training never sees an evaluation city.

mod common;

use diffzoo_datasets::needle::{
    EVAL_CITIES, NeedleMix, TRAIN_CITIES, answer_text, draw, needle_text, place, query_text,
};
use diffzoo_datasets::{Rng, TextTokenizer, TokenWindows, corpus};
use regex::Regex;
use std::collections::HashSet;
use std::sync::OnceLock;

fn tokenizer() -> &'static TextTokenizer {
    static TOKENIZER: OnceLock<TextTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let plays = corpus::plays();
        TextTokenizer::train_bpe(plays.iter().take(3).map(|p| p.text.as_str()), 400).unwrap()
    })
}

/// Training windows of `seq_len` over two plays.
fn windows(dir: &std::path::Path, seq_len: usize) -> TokenWindows {
    common::windows(dir, tokenizer(), seq_len)
}

#[test]
fn city_lists_are_disjoint_and_distinct() {
    let eval: HashSet<&str> = EVAL_CITIES.into_iter().collect();
    let train: HashSet<&str> = TRAIN_CITIES.into_iter().collect();
    assert_eq!(eval.len(), EVAL_CITIES.len());
    assert_eq!(train.len(), TRAIN_CITIES.len());
    assert!(eval.is_disjoint(&train));
}

#[test]
fn needles_land_at_the_asked_depth_and_decode_to_their_sentences() {
    let tok = tokenizer();
    let haystack: Vec<u32> = tok
        .encode(&corpus::plays()[5].text[..40_000])
        .unwrap()
        .into_iter()
        .collect();
    let len = 600;
    for (k, depth) in [0.0, 0.25, 0.5, 0.75, 1.0].into_iter().enumerate() {
        let mut rng = Rng::new(k as u64);
        let needles = draw(&mut rng, &EVAL_CITIES, 5, 7).unwrap();
        let ctx = place(tok, &haystack, needles, 2, depth, len, &mut rng).unwrap();
        assert_eq!(ctx.tokens.len(), len);
        assert_eq!((ctx.answers.len(), ctx.distractors.len()), (2, 3));
        let longest = ctx.distractors.iter().map(|n| n.span.len()).max().unwrap();
        let block = ctx.answers[1].span.end - ctx.answers[0].span.start;
        let wanted = (depth * (len - block) as f64).round() as usize;
        let start = ctx.answers[0].span.start;
        assert!(
            start <= wanted && wanted - start < longest,
            "depth {depth}: answers start at {start}, asked {wanted}"
        );
        if depth == 0.0 {
            assert_eq!(start, 0);
        }
        if depth == 1.0 {
            assert_eq!(ctx.answers[1].span.end, len);
        }
        // The answers are adjacent; every needle decodes to its own sentence.
        assert_eq!(ctx.answers[0].span.end, ctx.answers[1].span.start);
        for n in ctx.answers.iter().chain(&ctx.distractors) {
            let text = tok.decode(&ctx.tokens[n.span.clone()]).unwrap();
            assert_eq!(text, needle_text(&n.city, &n.number));
            assert_eq!(n.number.len(), 7);
        }
        // Without the needles, the context is the start of the haystack.
        let mut spans: Vec<_> = ctx
            .answers
            .iter()
            .chain(&ctx.distractors)
            .map(|n| n.span.clone())
            .collect();
        spans.sort_by_key(|s| s.start);
        let mut rest = Vec::new();
        let mut at = 0;
        for s in spans {
            assert!(s.start >= at, "needles overlap");
            rest.extend_from_slice(&ctx.tokens[at..s.start]);
            at = s.end;
        }
        rest.extend_from_slice(&ctx.tokens[at..]);
        assert_eq!(rest, haystack[..rest.len()]);
    }
}

#[test]
fn placement_is_deterministic_and_refuses_what_cannot_fit() {
    let tok = tokenizer();
    let haystack = tok.encode(&corpus::plays()[1].text[..20_000]).unwrap();
    let make = |seed| {
        let mut rng = Rng::new(seed);
        let needles = draw(&mut rng, &EVAL_CITIES, 4, 5).unwrap();
        place(tok, &haystack, needles, 1, 0.5, 300, &mut rng)
            .unwrap()
            .tokens
    };
    assert_eq!(make(3), make(3));
    assert_ne!(make(3), make(4));
    let mut rng = Rng::new(0);
    let needles = draw(&mut rng, &EVAL_CITIES, 6, 7).unwrap();
    let err = place(tok, &haystack, needles, 1, 0.5, 60, &mut rng).unwrap_err();
    assert!(err.to_string().contains("cannot hold 6 needles"), "{err}");
    assert!(draw(&mut rng, &EVAL_CITIES, 41, 7).is_err());
    assert!(draw(&mut rng, &EVAL_CITIES, 2, 0).is_err());
    let needles = draw(&mut rng, &EVAL_CITIES, 2, 3).unwrap();
    assert!(place(tok, &haystack, needles, 1, 1.5, 300, &mut rng).is_err());
}

#[test]
fn training_mixture_asks_about_every_needle_and_never_uses_eval_cities() {
    let dir = tempfile::tempdir().unwrap();
    let seq_len = 512;
    let windows = windows(dir.path(), seq_len);
    let mix = NeedleMix {
        tokenizer: tokenizer().clone(),
        fraction: 0.3,
        max_needles: 4,
        digits: 4,
        seed: 9,
    };
    assert!(mix.worst_case_tokens().unwrap() < seq_len);
    let needle = Regex::new(r"\nThe special magic number for ([A-Za-z ]+) is (\d+)\.\n").unwrap();
    let eval: HashSet<&str> = EVAL_CITIES.into_iter().collect();
    let train: HashSet<&str> = TRAIN_CITIES.into_iter().collect();
    let chosen = (0..400).filter(|&p| mix.chooses(p)).count();
    assert!((90..150).contains(&chosen), "{chosen} of 400 chosen at 0.3");
    let (mut documents, mut close) = (0, 0);
    for position in (0..400).filter(|&p| mix.chooses(p)).take(40) {
        let tokens = mix.window(position, &windows, seq_len + 1).unwrap();
        assert_eq!(tokens.len(), seq_len + 1);
        assert_eq!(tokens, mix.window(position, &windows, seq_len + 1).unwrap());
        let text = tokenizer().decode(&tokens).unwrap();
        let found: Vec<(usize, String, String)> = needle
            .captures_iter(&text)
            .map(|c| {
                (
                    c.get(0).unwrap().start(),
                    c[1].to_string(),
                    c[2].to_string(),
                )
            })
            .collect();
        assert!(!found.is_empty());
        let cities: HashSet<&str> = found.iter().map(|f| f.1.as_str()).collect();
        assert_eq!(cities.len(), found.len(), "a city twice in one window");
        for (at, city, number) in &found {
            assert!(train.contains(city.as_str()) && !eval.contains(city.as_str()));
            assert_eq!(number.len(), 4);
            // Asked and answered after the needle.
            let qa = format!("{}{}", query_text(city), answer_text(number));
            let asked = text
                .find(&qa)
                .unwrap_or_else(|| panic!("no question for {city}"));
            assert!(asked > *at);
            close += (asked - at < 600) as usize;
        }
        documents += text.matches("What is the special magic number for").count();
    }
    // Packed documents: several per window on average, many questions near their needle.
    assert!(documents > 80, "{documents} questions in 40 windows");
    assert!(
        close > documents / 3,
        "{close} of {documents} questions near their needle"
    );
}
