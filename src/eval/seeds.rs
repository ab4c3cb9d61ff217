//! A task over a run's seeds (`RUN/seed-N`, from `sweep --seeds` or `train --seeds`): every seed
//! is measured as one run would be, then each number the task reports ([`Measurement::metrics`])
//! is summarised over the seeds — mean, standard deviation and 95% t interval ([`stats`]) —
//! under its name and coordinates (grid cell, layer, position, file, …), which must be the same
//! for every seed. The JSON holds each seed's whole result and the summaries; the text lists the
//! summaries. `ppl` and `recall` have their own (a pooled loss; prompts shared across seeds).

use super::{Common, emit, seeds_of};
use crate::stats::{self, Estimate};
use anyhow::{Result, bail};
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// A task's result for one run.
pub trait Measurement: Serialize {
    /// Each number that depends on the run's weights, with where it was measured.
    fn metrics(&self) -> Vec<Metric>;
}

/// One number of a result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metric {
    /// What was measured (the result's field name: `accuracy`, `loss`, `cumulative`, …).
    pub name: &'static str,
    /// Where it was measured (the cell, layer, position, …); empty for the run as a whole.
    pub at: Map<String, Value>,
    #[serde(skip)]
    pub value: f64,
    /// Whether the text lists it (the JSON holds all).
    #[serde(skip)]
    pub listed: bool,
}

impl Metric {
    pub fn new(name: &'static str, value: f64) -> Self {
        Self {
            name,
            at: Map::new(),
            value,
            listed: true,
        }
    }

    /// The same, measured at `key` = `value`.
    pub fn at(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.at.insert(key.to_string(), value.into());
        self
    }

    /// Left out of the text (many of a kind, e.g. every position of the context).
    pub fn unlisted(mut self) -> Self {
        self.listed = false;
        self
    }
}

/// "accuracy (needles 4, depth 0.5)".
fn label(name: &str, at: &Map<String, Value>) -> String {
    if at.is_empty() {
        return name.to_string();
    }
    let at: Vec<String> = at
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k} {s}"),
            Value::Null => format!("{k} -"),
            other => format!("{k} {other}"),
        })
        .collect();
    format!("{name} ({})", at.join(", "))
}

/// A number over the seeds.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub name: &'static str,
    pub at: Map<String, Value>,
    /// Each seed's value, in the seeds' order.
    pub values: Vec<f64>,
    #[serde(flatten)]
    pub estimate: Estimate,
    #[serde(skip)]
    listed: bool,
}

/// A task's result over seeds.
#[derive(Debug, Serialize)]
pub struct OverSeeds<T> {
    pub run: String,
    /// The seeds' run directories.
    pub seed_runs: Vec<String>,
    /// Each seed's result, as for one run.
    pub seeds: Vec<T>,
    /// Each number over the seeds.
    pub metrics: Vec<Summary>,
}

/// When `common.run` holds seeds: measures each with `measure` (given the seed's directory),
/// prints the summary (`task` names it) and returns true; false for one run. `plot` (a task's
/// `--plot`, which draws one run) is refused over seeds.
pub fn over_seeds<T: Measurement>(
    common: &Common,
    task: &str,
    plot: Option<&PathBuf>,
    measure_seed: impl FnMut(&Path) -> Result<T>,
) -> Result<bool> {
    let seeds = seeds_of(&common.run)?;
    if seeds.is_empty() {
        return Ok(false);
    }
    if plot.is_some() {
        bail!(
            "eval {task} --plot draws one run, and {} holds {} seeds: plot one of them (e.g. --run {})",
            common.run.display(),
            seeds.len(),
            seeds[0].display()
        );
    }
    let result = measure(&common.run, &seeds, measure_seed)?;
    emit(common.json, &result, |r| r.print(task))?;
    Ok(true)
}

/// Measures every seed of `run` with `measure` (given the seed's run directory) and summarises
/// each number over them; refused when the seeds' results differ in what they measure.
pub fn measure<T: Measurement>(
    run: &Path,
    seeds: &[PathBuf],
    mut measure: impl FnMut(&Path) -> Result<T>,
) -> Result<OverSeeds<T>> {
    let results = seeds
        .iter()
        .map(|seed| measure(seed))
        .collect::<Result<Vec<T>>>()?;
    let metrics = summarise(seeds, &results)?;
    Ok(OverSeeds {
        run: run.display().to_string(),
        seed_runs: seeds.iter().map(|s| s.display().to_string()).collect(),
        seeds: results,
        metrics,
    })
}

fn summarise<T: Measurement>(seeds: &[PathBuf], results: &[T]) -> Result<Vec<Summary>> {
    let per_seed: Vec<Vec<Metric>> = results.iter().map(Measurement::metrics).collect();
    let Some((first, rest)) = per_seed.split_first() else {
        bail!("no seeds to summarise");
    };
    for (i, other) in rest.iter().enumerate() {
        let differs = |a: &Metric, b: &Metric| a.name != b.name || a.at != b.at;
        if let Some((a, b)) = first.iter().zip(other).find(|(a, b)| differs(a, b)) {
            bail!(
                "{} measured {} where {} measured {}: its seeds were not measured alike",
                seeds[i + 1].display(),
                label(b.name, &b.at),
                seeds[0].display(),
                label(a.name, &a.at)
            );
        }
        if other.len() != first.len() {
            bail!(
                "{} gave {} numbers where {} gave {}: its seeds were not measured alike",
                seeds[i + 1].display(),
                other.len(),
                seeds[0].display(),
                first.len()
            );
        }
    }
    Ok(first
        .iter()
        .enumerate()
        .map(|(k, m)| {
            let values: Vec<f64> = per_seed.iter().map(|ms| ms[k].value).collect();
            Summary {
                name: m.name,
                at: m.at.clone(),
                estimate: stats::estimate(&values),
                values,
                listed: m.listed,
            }
        })
        .collect())
}

impl<T: Measurement> OverSeeds<T> {
    /// One line per listed number: its mean, spread and interval over the seeds.
    pub fn print(&self, task: &str) {
        println!(
            "{}: eval {task} over {} seeds ({})",
            self.run,
            self.seed_runs.len(),
            self.seed_runs.join(", ")
        );
        let lines: Vec<(String, &Summary)> = self
            .metrics
            .iter()
            .filter(|s| s.listed)
            .map(|s| (label(s.name, &s.at), s))
            .collect();
        let width = lines.iter().map(|(l, _)| l.chars().count()).max();
        for (label, s) in &lines {
            println!(
                "  {label:<width$} {:.4}{}",
                s.estimate.mean,
                s.estimate.spread(4, "seeds"),
                width = width.unwrap_or(0)
            );
        }
        let unlisted = self.metrics.len() - lines.len();
        if unlisted > 0 {
            println!("  ({unlisted} more in --json)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Scores(Vec<(f64, f64)>);

    impl Measurement for Scores {
        fn metrics(&self) -> Vec<Metric> {
            self.0
                .iter()
                .map(|&(depth, accuracy)| Metric::new("accuracy", accuracy).at("depth", depth))
                .collect()
        }
    }

    fn dirs(n: usize) -> Vec<PathBuf> {
        (1..=n)
            .map(|s| PathBuf::from(format!("run/seed-{s}")))
            .collect()
    }

    #[test]
    fn each_number_is_summarised_over_the_seeds_in_place() {
        let results = [
            Scores(vec![(0.0, 0.5), (1.0, 0.25)]),
            Scores(vec![(0.0, 0.7), (1.0, 0.25)]),
            Scores(vec![(0.0, 0.9), (1.0, 0.25)]),
        ];
        let summaries = summarise(&dirs(3), &results).unwrap();
        assert_eq!(summaries.len(), 2);
        let s = &summaries[0];
        assert_eq!((s.name, s.at["depth"].as_f64()), ("accuracy", Some(0.0)));
        assert_eq!(s.values, [0.5, 0.7, 0.9]);
        assert_eq!(s.estimate, stats::estimate(&[0.5, 0.7, 0.9]));
        assert!((s.estimate.mean - 0.7).abs() < 1e-12);
        let [lo, hi] = s.estimate.ci95.unwrap();
        assert!(lo < 0.5 && hi > 0.9);
        assert_eq!(summaries[1].estimate.ci95, Some([0.25, 0.25]));
        // The order of the seeds changes no summary.
        let reordered = [
            Scores(vec![(0.0, 0.9), (1.0, 0.25)]),
            Scores(vec![(0.0, 0.5), (1.0, 0.25)]),
            Scores(vec![(0.0, 0.7), (1.0, 0.25)]),
        ];
        let again = &summarise(&dirs(3), &reordered).unwrap()[0].estimate;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let [alo, ahi] = again.ci95.unwrap();
        assert!(close(again.mean, s.estimate.mean) && close(alo, lo) && close(ahi, hi));
        // One seed: a mean, no interval.
        let one = summarise(&dirs(1), &results[..1]).unwrap();
        assert_eq!((one[0].estimate.sd, one[0].estimate.ci95), (None, None));
    }

    #[test]
    fn seeds_measured_differently_are_refused_by_name() {
        let results = [
            Scores(vec![(0.0, 0.5), (1.0, 0.25)]),
            Scores(vec![(0.0, 0.7), (0.5, 0.25)]),
        ];
        let err = summarise(&dirs(2), &results).unwrap_err().to_string();
        assert!(
            err.contains("run/seed-2 measured accuracy (depth 0.5) where run/seed-1 measured accuracy (depth 1.0)"),
            "{err}"
        );
        let results = [
            Scores(vec![(0.0, 0.5)]),
            Scores(vec![(0.0, 0.7), (1.0, 0.1)]),
        ];
        let err = summarise(&dirs(2), &results).unwrap_err().to_string();
        assert!(
            err.contains("gave 2 numbers where run/seed-1 gave 1"),
            "{err}"
        );
    }
}
