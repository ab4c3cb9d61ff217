//! `bench --profile`: a training step's forward and backward passes, and a decoding step, broken
//! into classes of operation, ours beside PyTorch's.
//!
//! Ours come from [`diffzoo_models::profile`]: each class's own time where it runs, over the
//! profiled steps (after the timed ones, so that the clock never touches the reported speed), and
//! for the classes whose backward Burn's autodiff computes (the products, and attention but for
//! flash's and the query blocks' own backward) the backward of their replays timed alone at the
//! step's shapes. PyTorch's
//! come from `torch.profiler` on the same steps (`bench/torch_reference.py --profile`), its
//! operations labelled by the same classes. In both, `other` is what the pass took beyond its
//! classes: residual adds, copies and reshapes, and backward the autodiff engine's bookkeeping with
//! the backward of the unlabelled operations.

use super::Row;
use diffzoo_models::profile::{self, Class, Pass, Profile};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// The remainder's name.
pub const OTHER: &str = "other";

/// The column of the decoding step with bf16 weight matrices.
const BF16_DECODE: &str = "bf16 dec";

/// The table's columns.
const HEADER: [&str; 7] = [
    "class",
    "fwd",
    "torch fwd",
    "bwd",
    "torch bwd",
    "decode",
    BF16_DECODE,
];

/// One pass: its wall time and each class's share of it, in seconds per pass.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PassProfile {
    pub total: f64,
    /// Class name → seconds, [`OTHER`] included.
    pub classes: BTreeMap<String, f64>,
}

impl PassProfile {
    /// `total` split into `classes` (those measured: `None` is not) and the remainder
    /// ([`OTHER`], never below zero).
    fn of(total: f64, classes: impl IntoIterator<Item = (Class, Option<f64>)>) -> Self {
        let mut classes: BTreeMap<String, f64> = classes
            .into_iter()
            .filter_map(|(class, s)| Some((class.name().to_string(), s?)))
            .collect();
        let booked: f64 = classes.values().sum();
        classes.insert(OTHER.into(), (total - booked).max(0.0));
        Self { total, classes }
    }

    fn get(&self, class: &str) -> Option<f64> {
        self.classes.get(class).copied()
    }
}

/// A training step's passes and, on our side, a decoding step's (and, beside an f32 step, the
/// same decoding step with bf16 weight matrices).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepProfile {
    pub forward: PassProfile,
    pub backward: PassProfile,
    /// Classes whose backward is their replays' ([`diffzoo_models::profile::replay_backward`]).
    #[serde(default)]
    pub replayed: Vec<String>,
    /// One decoding step of one sequence after a prefill, where measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<PassProfile>,
    /// The same decoding step with the weight matrices in bf16 and the activations in f32, as
    /// `generate --dtype bf16` decodes: measured beside an f32 step on a device that reads bf16
    /// weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_bf16: Option<PassProfile>,
}

/// The step profile of `steps` profiled training steps booked in `booked`, with `replayed` the
/// replays' backward times over those steps.
pub fn step(booked: &Profile, steps: usize, replayed: &BTreeMap<Class, Duration>) -> StepProfile {
    let per = |d: Duration| d.as_secs_f64() / steps.max(1) as f64;
    let total = |pass| booked.passes.get(&pass).map_or(0.0, |&(wall, _)| per(wall));
    let forward = PassProfile::of(
        total(Pass::Forward),
        Class::ALL.map(|c| (c, Some(per(booked.own(Pass::Forward, c))))),
    );
    let mut from_replays = Vec::new();
    let backward = PassProfile::of(
        total(Pass::Backward),
        Class::ALL.map(|c| {
            // A class whose backward is neither timed where it runs nor replayed (Burn's
            // backward of the embedding; of the one-pass operations where Flex does not take
            // them) is not measured: its time is in `other`.
            let own = booked.own(Pass::Backward, c);
            match replayed.get(&c) {
                _ if !own.is_zero() => (c, Some(per(own))),
                Some(&replay) => {
                    from_replays.push(c.name().to_string());
                    (c, Some(per(replay)))
                }
                None => (c, None),
            }
        }),
    );
    StepProfile {
        forward,
        backward,
        replayed: from_replays,
        decode: None,
        decode_bf16: None,
    }
}

/// A decoding step's profile from what `booked` holds of its [`Pass::Decode`] passes.
pub fn decode(booked: &Profile) -> Option<PassProfile> {
    let &(wall, n) = booked.passes.get(&Pass::Decode)?;
    let per = |d: Duration| d.as_secs_f64() / n.max(1) as f64;
    Some(PassProfile::of(
        per(wall),
        Class::ALL.map(|c| (c, Some(per(booked.own(Pass::Decode, c))))),
    ))
}

/// Under the table: each profiled row's classes in milliseconds, ours beside PyTorch's.
pub fn print(rows: &[Row]) {
    for row in rows {
        let Some(ours) = &row.ours.profile else {
            continue;
        };
        let theirs = row.torch.as_ref().and_then(|t| t.profile.as_ref());
        println!(
            "\nprofile of a {} {} step, ms ({}; PyTorch: torch.profiler):",
            row.device,
            row.ours.attention,
            match ours.replayed.is_empty() {
                true => "each class timed where it runs".to_string(),
                false => format!(
                    "each class timed where it runs, * backward of its replays timed alone: {}; -: not measured, in other",
                    ours.replayed.join(", ")
                ),
            }
        );
        let line = |cells: [String; HEADER.len()]| {
            let [name, rest @ ..] = cells;
            let rest: Vec<String> = rest.iter().map(|c| format!("{c:>9}")).collect();
            println!("  {name:<11} {}", rest.join(" ").trim_end());
        };
        let ms = |s: Option<f64>| s.map_or("-".into(), |s| format!("{:.2}", 1e3 * s));
        let decode_bf16 = ours.decode_bf16.as_ref();
        line(HEADER.map(|h| match (h, decode_bf16) {
            (BF16_DECODE, None) => String::new(),
            _ => h.to_string(),
        }));
        let names = profile::Class::ALL
            .map(|c| c.name())
            .into_iter()
            .chain([OTHER]);
        for name in names {
            let replayed = ours.replayed.iter().any(|r| r == name);
            line([
                name.to_string(),
                ms(ours.forward.get(name)),
                ms(theirs.and_then(|t| t.forward.get(name))),
                format!(
                    "{}{}",
                    ms(ours.backward.get(name)),
                    if replayed { "*" } else { "" }
                ),
                ms(theirs.and_then(|t| t.backward.get(name))),
                ms(ours.decode.as_ref().and_then(|d| d.get(name))),
                decode_bf16.map_or(String::new(), |d| ms(d.get(name))),
            ]);
        }
        line([
            "total".to_string(),
            ms(Some(ours.forward.total)),
            ms(theirs.map(|t| t.forward.total)),
            ms(Some(ours.backward.total)),
            ms(theirs.map(|t| t.backward.total)),
            ms(ours.decode.as_ref().map(|d| d.total)),
            decode_bf16.map_or(String::new(), |d| ms(Some(d.total))),
        ]);
        if let (Some(full), Some(bf16)) = (&ours.decode, decode_bf16) {
            println!(
                "  bf16 dec: the decoding step with bf16 weight matrices and f32 activations, as \
                 `generate --dtype bf16` runs: {:.2}× the f32 step's speed",
                full.total / bf16.total
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remainder_is_what_no_class_took_and_never_negative() {
        let p = PassProfile::of(
            1.0,
            [
                (Class::Matmul, Some(0.5)),
                (Class::Norm, Some(0.2)),
                (Class::Embedding, None),
            ],
        );
        assert!((p.get(OTHER).unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(p.get("embedding"), None, "not measured is not zero");
        let p = PassProfile::of(1.0, [(Class::Matmul, Some(1.2))]);
        assert_eq!(p.get(OTHER), Some(0.0));
    }
}
