//! Synthetic many-shot in-context classification: a task shaped like TREC or Banking-77 (a short
//! text, one label of a fixed set) that a model small enough for a CPU learns to solve from its
//! demonstrations alone, for `diffzoo eval icl` and its CPU-scale study.
//!
//! There are C classes, each with its own `cues` cue words (the lists are disjoint). A text of
//! class c has `words` words, each a cue of c with probability `signal`, else a filler word that
//! every class shares:
//!
//! ```text
//! text(c) = w₁ … w_n,   wᵢ ~ uniform(cues(c)) with probability signal, else uniform(fillers)
//! ```
//!
//! Labels are names drawn from a pool larger than C. A training *episode* (one document) maps
//! the classes to labels by a fresh random injection and lists demonstrations of random classes
//! under it, so a label means nothing until the episode's own demonstrations show it: only
//! in-context learning predicts it (chance 1/C). Evaluation sets ([`Task::items`]) hold one
//! mapping of their own, drawn from the seed. Everything is a pure function of a seed.

use crate::rng::Rng;

/// Cue words of the classes (one row per class).
pub const CUES: [[&str; 6]; 8] = [
    ["horse", "dog", "sheep", "bird", "fish", "cat"],
    ["red", "green", "blue", "white", "black", "gold"],
    ["bread", "wine", "meat", "apple", "milk", "cheese"],
    ["rain", "wind", "snow", "storm", "sun", "cloud"],
    ["hand", "eye", "head", "heart", "foot", "blood"],
    ["town", "field", "river", "hill", "sea", "wood"],
    ["sword", "shield", "spear", "bow", "arrow", "helm"],
    ["king", "queen", "prince", "duke", "lord", "knight"],
];

/// Words every class uses.
pub const FILLERS: [&str; 16] = [
    "the", "a", "of", "and", "in", "with", "on", "by", "old", "new", "great", "small", "some",
    "many", "this", "that",
];

/// Label names an episode maps its classes to.
pub const LABELS: [&str; 12] = [
    "north", "south", "east", "west", "summer", "winter", "morning", "evening", "silver", "copper",
    "iron", "stone",
];

/// How demonstrations are rendered unless told otherwise: `{text}` and `{label}` are replaced.
pub const TEMPLATE: &str = "Input: {text}\nLabel: {label}\n\n";

/// A labelled text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub text: String,
    pub label: String,
}

/// The task's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Task {
    /// Classes C (at most [`CUES`]' rows).
    pub classes: usize,
    /// Words per text.
    pub words: usize,
    /// The chance that a word is a cue of the text's class.
    pub signal: f64,
    /// Cue words of each class in use (at most [`CUES`]' columns): with 1, every text of a class
    /// holds the same cue, and classifying in context is retrieval of an earlier text's label.
    pub cues: usize,
}

impl Default for Task {
    fn default() -> Self {
        Self {
            classes: 6,
            words: 6,
            signal: 0.5,
            cues: CUES[0].len(),
        }
    }
}

impl Task {
    /// Checks the knobs; errors name the one out of range.
    pub fn validate(&self) -> Result<(), String> {
        if !(2..=CUES.len()).contains(&self.classes) {
            return Err(format!(
                "classes = {}: the task has 2 to {} classes",
                self.classes,
                CUES.len()
            ));
        }
        if self.words == 0 {
            return Err("words must be positive".into());
        }
        if !(1..=CUES[0].len()).contains(&self.cues) {
            return Err(format!(
                "cues = {}: a class has 1 to {} cue words",
                self.cues,
                CUES[0].len()
            ));
        }
        if !(self.signal > 0.0 && self.signal <= 1.0) {
            return Err(format!("signal = {} must lie in (0, 1]", self.signal));
        }
        Ok(())
    }

    /// A text of class `class`.
    pub fn text(&self, class: usize, rng: &mut Rng) -> String {
        (0..self.words)
            .map(|_| {
                if rng.uniform() < self.signal {
                    CUES[class][rng.below(self.cues as u64) as usize]
                } else {
                    FILLERS[rng.below(FILLERS.len() as u64) as usize]
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// A mapping of the classes to distinct labels.
    pub fn mapping(&self, rng: &mut Rng) -> Vec<&'static str> {
        let mut labels = LABELS.to_vec();
        rng.shuffle(&mut labels);
        labels.truncate(self.classes);
        labels
    }

    /// `count` items of random classes under the mapping `seed` draws (the same for every
    /// call with that seed); `stream` keeps sets of one seed apart (demonstrations, tests).
    pub fn items(&self, seed: u64, stream: u64, count: usize) -> Vec<Item> {
        let mapping = self.mapping(&mut Rng::new(seed));
        (0..count as u64)
            .map(|i| {
                let mut rng = Rng::for_item(seed ^ (stream << 48), i);
                let class = rng.below(self.classes as u64) as usize;
                Item {
                    text: self.text(class, &mut rng),
                    label: mapping[class].to_string(),
                }
            })
            .collect()
    }

    /// Training episode `index` of stream `seed`: a fresh mapping and `shots` demonstrations
    /// rendered with `template`, `shots` uniform in `1..=max_shots`.
    pub fn episode(&self, seed: u64, index: u64, max_shots: usize, template: &str) -> String {
        self.episode_turns(seed, index, max_shots, template)
            .into_iter()
            .map(|(prompt, label)| prompt + &label)
            .collect()
    }

    /// Training episode `index` as a conversation: each demonstration's text up to its label a
    /// user turn, the label and what follows it an assistant turn (so that a loss on the
    /// assistant's tokens scores the labels alone); [`Task::episode`]'s text, turn by turn.
    pub fn episode_turns(
        &self,
        seed: u64,
        index: u64,
        max_shots: usize,
        template: &str,
    ) -> Vec<(String, String)> {
        let (before, after) = template
            .split_once("{label}")
            .expect("a template with {label}");
        let mut rng = Rng::for_item(seed, index);
        let mapping = self.mapping(&mut rng);
        let shots = 1 + rng.below(max_shots.max(1) as u64) as usize;
        (0..shots)
            .map(|_| {
                let class = rng.below(self.classes as u64) as usize;
                let text = self.text(class, &mut rng);
                let prompt = crate::fill(before, &[("text", &text)]);
                let label = crate::fill(after, &[("text", &text)]);
                // Whitespace ending the prompt goes with the label, as evaluation scores it.
                let cut = prompt.trim_end().len();
                (
                    prompt[..cut].to_string(),
                    format!("{}{}{label}", &prompt[cut..], mapping[class]),
                )
            })
            .collect()
    }
}

/// `template` with `{text}` and `{label}` replaced.
pub fn render(template: &str, text: &str, label: &str) -> String {
    crate::fill(template, &[("text", text), ("label", label)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_a_pure_function_of_the_seed_under_one_mapping() {
        let task = Task::default();
        let a = task.items(7, 0, 50);
        assert_eq!(a, task.items(7, 0, 50));
        assert_ne!(a, task.items(7, 1, 50), "another stream");
        assert_ne!(a, task.items(8, 0, 50), "another seed");
        // One label per class: texts whose cues name one class share their label.
        for item in &a {
            let class = CUES
                .iter()
                .position(|cues| item.text.split(' ').any(|w| cues.contains(&w)));
            if let Some(class) = class {
                let others = a
                    .iter()
                    .filter(|o| o.text.split(' ').any(|w| CUES[class].contains(&w)));
                assert!(others.into_iter().all(|o| o.label == item.label));
            }
        }
        let labels: std::collections::BTreeSet<&str> = a.iter().map(|i| i.label.as_str()).collect();
        assert_eq!(labels.len(), task.classes, "50 items cover 6 classes");
    }

    #[test]
    fn episodes_map_classes_afresh_and_render_their_template() {
        let task = Task::default();
        let episode = task.episode(1, 0, 8, TEMPLATE);
        assert!(episode.starts_with("Input: ") && episode.ends_with("\n\n"));
        let turns = task.episode_turns(1, 0, 8, TEMPLATE);
        let joined: String = turns.iter().map(|(u, a)| format!("{u}{a}")).collect();
        assert_eq!(joined, episode, "the same episode, turn by turn");
        assert!(
            turns
                .iter()
                .all(|(u, a)| u.ends_with("Label:") && a.starts_with(' '))
        );
        let mappings: std::collections::BTreeSet<Vec<&str>> = (0..20)
            .map(|i| task.mapping(&mut Rng::for_item(1, i)))
            .collect();
        assert!(mappings.len() > 10, "mappings differ between episodes");
        assert!(task.validate().is_ok());
        let bad = Task { classes: 9, ..task };
        assert!(bad.validate().unwrap_err().contains("classes = 9"));
    }
}
