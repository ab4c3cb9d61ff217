//! The PyTorch reference's forward pass checked against transformers in the same run:
//! `bench/torch_reference.py` also times transformers' own class of the baseline's architecture
//! (`LlamaForCausalLM`, or `Qwen2ForCausalLM` with q/k/v biases) on the same shape (the same
//! parameter count), dtype, threads and attention implementation.
//!
//! ```text
//! reference / transformers = the reference baseline's forward tokens/s / transformers' (medians)
//! ```
//!
//! Below [`SLOWER`] the reference is more than 20% slower than transformers: a bug in the
//! reference, whose ratios would flatter ours, and the report says so. Only the forward pass is
//! checked, not the training step.

use super::{Measurement, TorchRun};
use crate::trust::{Figure, Spread};
use serde::{Deserialize, Serialize};

/// A reference forward pass under this share of transformers' speed is a bug in the reference.
pub const SLOWER: f64 = 0.8;

/// What the harness measured of transformers beside the reference's baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Transformers {
    /// Its class, timed as the reference's forward pass is.
    Timed {
        class: String,
        version: String,
        forward_tokens_per_sec: f64,
        forward_spread: Spread,
    },
    /// Why it was not timed (transformers not importable, another shape, a failure).
    Unavailable { unavailable: String },
}

/// The line under the PyTorch header of `run`: how its reference compares with transformers, or
/// why it was not compared.
pub fn line(run: &TorchRun) -> String {
    match baseline(run) {
        None => "  reference not checked against transformers: only its baseline is (--attention transformer)".into(),
        Some((_, Transformers::Unavailable { unavailable })) => {
            format!("  reference not checked against transformers: {unavailable}")
        }
        Some((reference, Transformers::Timed { class, version, forward_tokens_per_sec, .. })) => {
            format!(
                "  reference checked: forward {:.0} tokens/s, {:.2}× transformers {version} {class} on this shape ({forward_tokens_per_sec:.0})",
                reference.forward_tokens_per_sec,
                reference.forward_tokens_per_sec / forward_tokens_per_sec
            )
        }
    }
}

/// The report's warning about `run`'s reference on `device`, where it is more than 20% slower
/// than transformers or transformers could not be timed beside it.
pub fn warning(device: &str, run: &TorchRun) -> Option<String> {
    match baseline(run)? {
        (_, Transformers::Unavailable { unavailable }) => Some(format!(
            "PyTorch {device}: the reference was not checked against transformers ({unavailable})"
        )),
        (
            reference,
            Transformers::Timed {
                class,
                forward_tokens_per_sec,
                ..
            },
        ) => {
            let ratio = reference.forward_tokens_per_sec / forward_tokens_per_sec;
            (ratio < SLOWER).then(|| format!(
                "PyTorch {device}: the reference's forward pass runs at {ratio:.2}× transformers' {class} on this shape (more than {:.0}% slower): a bug in the reference; ratios to it flatter ours",
                100.0 * (1.0 - SLOWER)
            ))
        }
    }
}

/// transformers' forward pass beside `run`'s reference, as a figure whose spread is judged
/// ([`crate::trust::warnings`]).
pub fn figure(device: &str, run: &TorchRun) -> Option<Figure> {
    match baseline(run)? {
        (
            _,
            Transformers::Timed {
                class,
                forward_spread,
                ..
            },
        ) => Some(Figure {
            what: format!("PyTorch {device} transformers' {class} forward"),
            spread: Some(*forward_spread),
            competing: None,
        }),
        (_, Transformers::Unavailable { .. }) => None,
    }
}

/// The reference's baseline result and what was measured of transformers beside it.
fn baseline(run: &TorchRun) -> Option<(&Measurement, &Transformers)> {
    run.results
        .iter()
        .find_map(|m| Some((m, m.transformers.as_ref()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(forward: f64, transformers: Option<Transformers>) -> TorchRun {
        let json = serde_json::json!({
            "torch": "2.9.0", "threads": 2, "device": "cpu", "attention_impl": "sdpa",
            "results": [{
                "attention": "transformer", "params": 10, "forward_tokens_per_sec": forward,
                "step_tokens_per_sec": 1.0, "peak_bytes": null, "transformers": transformers,
            }],
        });
        serde_json::from_value(json).expect("the harness's output")
    }

    fn timed(forward: f64) -> Transformers {
        // As the harness prints it.
        serde_json::from_value(serde_json::json!({
            "class": "LlamaForCausalLM", "version": "5.24.0", "forward_tokens_per_sec": forward,
            "forward_spread": {"min": forward, "median": forward, "max": forward},
        }))
        .expect("a timed check")
    }

    #[test]
    fn a_reference_more_than_a_fifth_slower_than_transformers_is_flagged() {
        let ok = run(81.0, Some(timed(100.0)));
        assert_eq!(warning("cpu", &ok), None);
        assert!(line(&ok).contains("0.81× transformers 5.24.0 LlamaForCausalLM"));
        let slow = run(79.0, Some(timed(100.0)));
        let flagged = warning("cpu", &slow).expect("flagged");
        assert!(
            flagged.contains("0.79× transformers' LlamaForCausalLM"),
            "{flagged}"
        );
        // Faster than transformers is no bug in the reference.
        assert_eq!(warning("cpu", &run(300.0, Some(timed(100.0)))), None);
        // transformers' own timing is judged by its spread, as every figure is.
        let judged = figure("cpu", &ok).expect("a timed check");
        assert_eq!(
            judged.what,
            "PyTorch cpu transformers' LlamaForCausalLM forward"
        );
        assert_eq!(judged.spread.map(|s| s.median), Some(100.0));
    }

    #[test]
    fn an_unchecked_reference_says_why() {
        let missing = Transformers::Unavailable {
            unavailable: "transformers is not importable (No module named 'transformers')".into(),
        };
        let unchecked = run(100.0, Some(missing));
        assert!(
            warning("cpu", &unchecked)
                .unwrap()
                .contains("No module named")
        );
        assert!(line(&unchecked).contains("No module named"));
        assert!(figure("cpu", &unchecked).is_none());
        // Without the baseline there is nothing to check, and nothing to warn of.
        let no_baseline = run(100.0, None);
        assert_eq!(warning("cpu", &no_baseline), None);
        assert!(line(&no_baseline).contains("--attention transformer"));
    }
}
