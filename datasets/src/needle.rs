//! Multi-needle retrieval, the LWM / Gemini 1.5 protocol the paper uses (§3.3, Table 2, Fig. 5).
//!
//! A *needle* is a sentence giving a city a magic number,
//! `"The special magic number for Paris is 4821."`; N needles are hidden in a haystack of corpus
//! text and the model is asked for the number of R of them:
//! `"What is the special magic number for Paris? The special magic number for Paris is"`, to be
//! completed with `" 4821."`. The R queried needles sit together at the asked depth (0 = start of
//! the context, 1 = just before the question); the N − R distractors are spread at random.
//!
//! Cities come from two disjoint lists: training mixtures ([`NeedleMix`]) draw only from
//! [`TRAIN_CITIES`], evaluation only from [`EVAL_CITIES`], so a model cannot have memorised an
//! evaluated city. Everything is a pure function of a seed.

use crate::error::{DataError, Result};
use crate::rng::Rng;
use crate::tokenizer::TextTokenizer;
use crate::windows::TokenWindows;
use std::ops::Range;

/// Cities of evaluation prompts; never used in training.
pub const EVAL_CITIES: [&str; 40] = [
    "Paris",
    "Tokyo",
    "Cairo",
    "Lima",
    "Oslo",
    "Nairobi",
    "Madrid",
    "Hanoi",
    "Dublin",
    "Santiago",
    "Warsaw",
    "Jakarta",
    "Lisbon",
    "Bogota",
    "Vienna",
    "Manila",
    "Prague",
    "Havana",
    "Athens",
    "Seoul",
    "Helsinki",
    "Karachi",
    "Budapest",
    "Caracas",
    "Copenhagen",
    "Dakar",
    "Brussels",
    "Tehran",
    "Montevideo",
    "Kyiv",
    "Reykjavik",
    "Lagos",
    "Ottawa",
    "Bangkok",
    "Edinburgh",
    "Quito",
    "Stockholm",
    "Accra",
    "Melbourne",
    "Vancouver",
];

/// Cities of training needles; disjoint from [`EVAL_CITIES`].
pub const TRAIN_CITIES: [&str; 100] = [
    "London",
    "Berlin",
    "Rome",
    "Moscow",
    "Beijing",
    "Delhi",
    "Mumbai",
    "Sydney",
    "Toronto",
    "Chicago",
    "Boston",
    "Denver",
    "Seattle",
    "Houston",
    "Dallas",
    "Phoenix",
    "Atlanta",
    "Miami",
    "Detroit",
    "Portland",
    "Austin",
    "Montreal",
    "Calgary",
    "Winnipeg",
    "Halifax",
    "Glasgow",
    "Manchester",
    "Liverpool",
    "Bristol",
    "Leeds",
    "Cardiff",
    "Belfast",
    "Munich",
    "Hamburg",
    "Cologne",
    "Frankfurt",
    "Leipzig",
    "Dresden",
    "Zurich",
    "Geneva",
    "Basel",
    "Milan",
    "Naples",
    "Turin",
    "Venice",
    "Florence",
    "Bologna",
    "Genoa",
    "Marseille",
    "Lyon",
    "Toulouse",
    "Nice",
    "Bordeaux",
    "Seville",
    "Valencia",
    "Barcelona",
    "Bilbao",
    "Porto",
    "Antwerp",
    "Rotterdam",
    "Amsterdam",
    "Utrecht",
    "Krakow",
    "Gdansk",
    "Riga",
    "Tallinn",
    "Vilnius",
    "Minsk",
    "Bucharest",
    "Sofia",
    "Belgrade",
    "Zagreb",
    "Istanbul",
    "Ankara",
    "Baghdad",
    "Damascus",
    "Beirut",
    "Amman",
    "Riyadh",
    "Dubai",
    "Doha",
    "Muscat",
    "Kabul",
    "Lahore",
    "Dhaka",
    "Colombo",
    "Kathmandu",
    "Shanghai",
    "Osaka",
    "Kyoto",
    "Busan",
    "Taipei",
    "Singapore",
    "Perth",
    "Auckland",
    "Wellington",
    "Casablanca",
    "Tunis",
    "Algiers",
    "Khartoum",
];

/// The needle sentence (newlines around it keep it apart from the haystack's words).
pub fn needle_text(city: &str, number: &str) -> String {
    format!("\nThe special magic number for {city} is {number}.\n")
}

/// The question about `city`; the model continues it with [`answer_text`].
pub fn query_text(city: &str) -> String {
    format!("\nWhat is the special magic number for {city}? The special magic number for {city} is")
}

/// The expected continuation of [`query_text`].
pub fn answer_text(number: &str) -> String {
    format!(" {number}.")
}

/// One needle: its city, its number and, once placed, its token span in the context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needle {
    pub city: String,
    pub number: String,
    pub span: Range<usize>,
}

/// `n` needles with distinct cities drawn from `cities` and distinct numbers of `digits`
/// digits (no leading zero). The spans are empty until [`place`].
pub fn draw(rng: &mut Rng, cities: &[&str], n: usize, digits: usize) -> Result<Vec<Needle>> {
    if n == 0 || n > cities.len() {
        return Err(DataError::Invalid(format!(
            "{n} needles: between 1 and {} are possible",
            cities.len()
        )));
    }
    if !(1..=18).contains(&digits) {
        return Err(DataError::Invalid(format!(
            "magic numbers of {digits} digits: between 1 and 18 are possible"
        )));
    }
    let mut pool: Vec<&str> = cities.to_vec();
    let mut needles: Vec<Needle> = Vec::with_capacity(n);
    for i in 0..n {
        let j = i + rng.below((pool.len() - i) as u64) as usize;
        pool.swap(i, j);
        let low = 10u64.pow(digits as u32 - 1);
        let number = loop {
            let candidate = (low + rng.below(9 * low)).to_string();
            if needles.iter().all(|n| n.number != candidate) || n as u64 > 9 * low {
                break candidate;
            }
        };
        needles.push(Needle {
            city: pool[i].to_string(),
            number,
            span: 0..0,
        });
    }
    Ok(needles)
}

/// A haystack with needles in it.
#[derive(Debug, Clone)]
pub struct NeedleContext {
    pub tokens: Vec<u32>,
    /// The needles queried (`answers`) and the distractors, with their spans in `tokens`.
    pub answers: Vec<Needle>,
    pub distractors: Vec<Needle>,
}

/// Builds a context of exactly `len` tokens: the first `answers` needles of `needles` together
/// at `depth` (their block starts at `round(depth · (len − block))`, moved to the start of a
/// distractor it would split), the others at uniformly random token positions, the rest filled
/// with the start of `haystack`. With `answers == 0` every needle is placed at random.
pub fn place(
    tokenizer: &TextTokenizer,
    haystack: &[u32],
    mut needles: Vec<Needle>,
    answers: usize,
    depth: f64,
    len: usize,
    rng: &mut Rng,
) -> Result<NeedleContext> {
    if !(0.0..=1.0).contains(&depth) {
        return Err(DataError::Invalid(format!(
            "needle depth {depth} is outside [0, 1]"
        )));
    }
    if answers > needles.len() {
        return Err(DataError::Invalid(format!(
            "{answers} queried needles but only {} needles",
            needles.len()
        )));
    }
    let encoded: Vec<Vec<u32>> = needles
        .iter()
        .map(|n| tokenizer.encode(&needle_text(&n.city, &n.number)))
        .collect::<Result<_>>()?;
    let needle_tokens: usize = encoded.iter().map(Vec::len).sum();
    if needle_tokens >= len || haystack.len() < len - needle_tokens {
        return Err(DataError::Invalid(format!(
            "a context of {len} tokens cannot hold {} needles ({needle_tokens} tokens) and \
             haystack ({} tokens available)",
            needles.len(),
            haystack.len()
        )));
    }
    let hay = &haystack[..len - needle_tokens];
    // Distractors at random haystack positions, in order.
    let mut spots: Vec<(usize, usize)> = (answers..needles.len())
        .map(|i| (rng.below(hay.len() as u64 + 1) as usize, i))
        .collect();
    spots.sort_unstable();
    let mut body = Vec::with_capacity(len);
    let mut spans: Vec<(usize, Range<usize>)> = Vec::new();
    let mut at = 0;
    for (spot, i) in spots {
        body.extend_from_slice(&hay[at..spot]);
        spans.push((i, body.len()..body.len() + encoded[i].len()));
        body.extend_from_slice(&encoded[i]);
        at = spot;
    }
    body.extend_from_slice(&hay[at..]);
    // The answer block at the asked depth, never inside a distractor.
    let block: Vec<u32> = encoded[..answers].concat();
    let mut start = (depth * body.len() as f64).round() as usize;
    if let Some((_, inside)) = spans.iter().find(|(_, s)| s.start < start && start < s.end) {
        start = inside.start;
    }
    for (_, span) in spans.iter_mut().filter(|(_, s)| s.start >= start) {
        *span = span.start + block.len()..span.end + block.len();
    }
    let mut offset = start;
    for (i, tokens) in encoded[..answers].iter().enumerate() {
        spans.push((i, offset..offset + tokens.len()));
        offset += tokens.len();
    }
    body.splice(start..start, block);
    for (i, span) in spans {
        needles[i].span = span;
    }
    let distractors = needles.split_off(answers);
    Ok(NeedleContext {
        tokens: body,
        answers: needles,
        distractors,
    })
}

/// The shortest needle document packed into a training window.
pub const MIN_DOCUMENT: usize = 128;

/// The training mixture of the `tiny-needle` recipes: a fraction of the training windows are
/// replaced by windows of needle documents ([`NeedleMix::window`]): training-corpus haystack with
/// needles of [`TRAIN_CITIES`] at random positions, followed by every needle's question and
/// answer.
#[derive(Debug, Clone)]
pub struct NeedleMix {
    pub tokenizer: TextTokenizer,
    pub fraction: f64,
    pub max_needles: usize,
    pub digits: usize,
    pub seed: u64,
}

impl NeedleMix {
    /// Whether the sample at stream `position` is a needle document.
    pub fn chooses(&self, position: u64) -> bool {
        Rng::for_item(self.seed ^ 0x6E65_6564_6C65, position).uniform() < self.fraction
    }

    /// The most tokens the needles, questions and answers of one document can take (all
    /// `max_needles` with the longest-encoding cities), counting numbers as all nines — exact
    /// for the byte-level BPEs trained here, where every digit is one token; a window must be
    /// longer. (Documents that would not fit drop needles, so this only guards the recipe.)
    pub fn worst_case_tokens(&self) -> Result<usize> {
        let number = "9".repeat(self.digits);
        let mut costs = TRAIN_CITIES
            .iter()
            .map(|city| {
                Ok(self.tokenizer.encode(&needle_text(city, &number))?.len()
                    + self.tokenizer.encode(&query_text(city))?.len()
                    + self.tokenizer.encode(&answer_text(&number))?.len())
            })
            .collect::<Result<Vec<usize>>>()?;
        costs.sort_unstable_by(|a, b| b.cmp(a));
        Ok(costs.iter().take(self.max_needles).sum())
    }

    /// The needle window at stream `position`: `len` tokens of packed needle documents,
    /// haystack from `windows`. Document lengths are log-uniform between
    /// [`MIN_DOCUMENT`] and what is left of the window, so that many questions sit close to
    /// their needles — where the attention of a model that has not learnt to retrieve yet still
    /// finds them — and some as far as the window allows. Each document holds 1 to
    /// `max_needles` needles (as many as fit), then every needle's question and answer in a
    /// random order; no city appears twice in a window.
    pub fn window(&self, position: u64, windows: &TokenWindows, len: usize) -> Result<Vec<u32>> {
        let mut rng = Rng::for_item(self.seed, position);
        let mut haystack = Vec::new();
        while haystack.len() < len {
            haystack.extend(windows.window(rng.below(windows.len())));
        }
        let mut cities: Vec<&str> = TRAIN_CITIES.to_vec();
        let mut tokens = Vec::with_capacity(len);
        while tokens.len() < len {
            let room = len - tokens.len();
            let mut size = room;
            if room >= 2 * MIN_DOCUMENT {
                let u = rng.uniform();
                size = (MIN_DOCUMENT as f64 * (room as f64 / MIN_DOCUMENT as f64).powf(u)) as usize;
                if room - size < MIN_DOCUMENT {
                    size = room;
                }
            }
            let n = (1 + rng.below(self.max_needles as u64) as usize).min(cities.len());
            let offset = len - room;
            if n == 0 {
                // Every training city is used: the rest of the window is plain text.
                tokens.extend_from_slice(&haystack[offset..len]);
                break;
            }
            let doc = self.document(&mut rng, &mut cities, n, &haystack[offset..], size)?;
            tokens.extend(doc);
        }
        Ok(tokens)
    }

    /// One document of exactly `size` tokens with up to `n` needles (fewer when they do not fit;
    /// none, plain haystack, when not even one does), their cities taken out of `cities`.
    fn document(
        &self,
        rng: &mut Rng,
        cities: &mut Vec<&str>,
        n: usize,
        haystack: &[u32],
        size: usize,
    ) -> Result<Vec<u32>> {
        let mut needles = draw(rng, cities, n, self.digits)?;
        let mut order: Vec<usize> = (0..needles.len()).collect();
        rng.shuffle(&mut order);
        loop {
            let mut questions = Vec::new();
            let mut needle_tokens = 0;
            for &i in order.iter().filter(|&&i| i < needles.len()) {
                let needle = &needles[i];
                questions.extend(self.tokenizer.encode(&query_text(&needle.city))?);
                questions.extend(self.tokenizer.encode(&answer_text(&needle.number))?);
                needle_tokens += self
                    .tokenizer
                    .encode(&needle_text(&needle.city, &needle.number))?
                    .len();
            }
            if questions.len() + needle_tokens < size {
                cities.retain(|c| needles.iter().all(|n| n.city != *c));
                let context = place(
                    &self.tokenizer,
                    haystack,
                    needles,
                    0,
                    0.0,
                    size - questions.len(),
                    rng,
                )?;
                let mut tokens = context.tokens;
                tokens.extend(questions);
                return Ok(tokens);
            }
            if needles.len() == 1 {
                return Ok(haystack[..size].to_vec());
            }
            needles.pop();
        }
    }
}
