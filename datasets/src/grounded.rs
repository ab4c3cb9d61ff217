//! Synthetic grounded question answering, for `diffzoo eval hallucination` and its CPU-scale
//! study: a source states facts, the instruction asks about one, and the faithful answer is a
//! span of the source.
//!
//! ```text
//! source:       The horse of Anne is grey. The ring of Hugh is silver. … (facts in random order)
//! instruction:  What is the ring of Hugh?
//! reference:    silver
//! ```
//!
//! A source holds `facts` facts about distinct (person, thing) pairs, several of them about one
//! thing or one person, so that an answer taken from the wrong fact, or made up, is possible; the
//! values are drawn afresh for every item. Training documents ([`Task::document`]) are items
//! followed by their answer. Everything is a pure function of a seed.

use crate::rng::Rng;

pub const PEOPLE: [&str; 16] = [
    "Anne", "Hugh", "Mary", "John", "Kate", "Ralph", "Jane", "Giles", "Alice", "Robert", "Agnes",
    "Walter", "Joan", "Henry", "Maud", "Roger",
];

pub const THINGS: [&str; 8] = [
    "horse", "ring", "cloak", "dog", "house", "boat", "sword", "garden",
];

pub const VALUES: [&str; 24] = [
    "grey", "silver", "green", "small", "old", "red", "golden", "black", "white", "blue", "brown",
    "large", "new", "yellow", "tall", "short", "dark", "bright", "plain", "fine", "broken",
    "quiet", "swift", "strong",
];

/// How a source, an instruction and an answer are joined into a prompt (and, followed by the
/// answer and a newline, into a training document) unless told otherwise.
pub const TEMPLATE: &str = "{source}\n\n{instruction}\n";

/// One question about a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub source: String,
    pub instruction: String,
    pub reference: String,
}

/// The task's knob: facts per source.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Task {
    pub facts: usize,
}

impl Default for Task {
    fn default() -> Self {
        Self { facts: 8 }
    }
}

impl Task {
    /// Checks the knob; the error names it.
    pub fn validate(&self) -> Result<(), String> {
        let most = PEOPLE.len() * THINGS.len();
        if !(1..=most).contains(&self.facts) {
            return Err(format!(
                "facts = {}: a source holds 1 to {most}",
                self.facts
            ));
        }
        Ok(())
    }

    /// Item `index` of stream `seed`.
    pub fn item(&self, seed: u64, index: u64) -> Item {
        let mut rng = Rng::for_item(seed, index);
        // Few people and things, so that facts share them, and enough pairs for every fact.
        let n_people = self.facts.div_ceil(2).min(PEOPLE.len());
        let n_things = (self.facts.div_ceil(n_people) + 1).min(THINGS.len());
        let people = pick(&mut rng, &PEOPLE, n_people);
        let things = pick(&mut rng, &THINGS, n_things);
        let mut pairs: Vec<(&str, &str)> = people
            .iter()
            .flat_map(|p| things.iter().map(move |t| (*p, *t)))
            .collect();
        rng.shuffle(&mut pairs);
        pairs.truncate(self.facts);
        let facts: Vec<(&str, &str, &str)> = pairs
            .into_iter()
            .map(|(p, t)| (p, t, VALUES[rng.below(VALUES.len() as u64) as usize]))
            .collect();
        let source = facts
            .iter()
            .map(|(p, t, v)| format!("The {t} of {p} is {v}."))
            .collect::<Vec<_>>()
            .join(" ");
        let (p, t, v) = facts[rng.below(facts.len() as u64) as usize];
        Item {
            source,
            instruction: format!("What is the {t} of {p}?"),
            reference: v.to_string(),
        }
    }

    /// Training document `index` of stream `seed`: the item's prompt by `template`, its answer
    /// and a newline.
    pub fn document(&self, seed: u64, index: u64, template: &str) -> String {
        let item = self.item(seed, index);
        format!("{}{}\n", render(template, &item), item.reference)
    }
}

/// `template` with `{source}` and `{instruction}` replaced.
pub fn render(template: &str, item: &Item) -> String {
    crate::fill(
        template,
        &[("source", &item.source), ("instruction", &item.instruction)],
    )
}

/// `n` distinct entries of `from`, in random order.
fn pick<'a>(rng: &mut Rng, from: &[&'a str], n: usize) -> Vec<&'a str> {
    let mut all = from.to_vec();
    rng.shuffle(&mut all);
    all.truncate(n.min(from.len()));
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_is_a_span_of_the_source_stated_of_the_asked_pair() {
        let task = Task::default();
        for i in 0..50 {
            let item = task.item(3, i);
            assert_eq!(item, task.item(3, i));
            let asked = item
                .instruction
                .trim_start_matches("What is the ")
                .trim_end_matches('?');
            let (thing, person) = asked.split_once(" of ").unwrap();
            let fact = format!("The {thing} of {person} is {}.", item.reference);
            assert!(item.source.contains(&fact), "{item:?}");
            assert_eq!(item.source.matches(". ").count() + 1, task.facts);
        }
        for facts in 1..=PEOPLE.len() * THINGS.len() {
            let item = Task { facts }.item(9, facts as u64);
            assert_eq!(item.source.matches('.').count(), facts, "{facts} facts");
        }
        let doc = task.document(3, 0, TEMPLATE);
        assert!(doc.ends_with(&format!("?\n{}\n", task.item(3, 0).reference)));
        assert!(Task { facts: 0 }.validate().is_err());
    }
}
