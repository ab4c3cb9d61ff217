//! `diffzoo scaling fit`: scaling laws `L(x) = E + A·x^(−α)` per architecture over sweep runs,
//! and the paper's comparison: the baseline size (or token count) that matches DIFF's loss.
//!
//! The fit is robust nonlinear least squares by variable projection: for a given α the model is
//! linear in (E, A), solved by Huber-weighted least squares (IRLS) with E ≥ 0; α ∈ [0.01, 4] is
//! then found by a grid and golden-section search. Standard errors come from the Jacobian at the
//! optimum (omitted when E sits on its bound, where they mean nothing).

use crate::layout::{self, run_seeds};
use crate::plot::{self, Chart, Series};
use crate::run;
use anyhow::{Result, bail};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct FitArgs {
    /// Sweep directories (each holding run directories).
    #[arg(required = true)]
    pub sweeps: Vec<PathBuf>,
    /// What x is: parameters (the paper's convention) or training tokens.
    #[arg(long, default_value = "params", value_parser = ["params", "tokens"])]
    pub axis: String,
    /// Write the points and fitted curves as an SVG plot.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// A fitted law with standard errors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    pub e: f64,
    pub a: f64,
    pub alpha: f64,
    pub e_err: Option<f64>,
    pub a_err: Option<f64>,
    pub alpha_err: Option<f64>,
    pub points: usize,
}

impl Fit {
    pub fn loss(&self, x: f64) -> f64 {
        self.e + self.a * x.powf(-self.alpha)
    }

    /// The x at which this law reaches `loss`, if it ever does.
    pub fn x_at(&self, loss: f64) -> Option<f64> {
        (loss > self.e).then(|| (self.a / (loss - self.e)).powf(1.0 / self.alpha))
    }
}

/// Huber-weighted least squares of `y ≈ e + a·z` with `e ≥ 0`, for fixed z; returns
/// (e, a, weighted RSS).
fn linear_fit(z: &[f64], y: &[f64]) -> (f64, f64, f64) {
    let mut w = vec![1.0; y.len()];
    let (mut e, mut a) = (0.0, 0.0);
    for _ in 0..10 {
        let sw: f64 = w.iter().sum();
        let mz = w.iter().zip(z).map(|(w, z)| w * z).sum::<f64>() / sw;
        let my = w.iter().zip(y).map(|(w, y)| w * y).sum::<f64>() / sw;
        let szz: f64 = w.iter().zip(z).map(|(w, z)| w * (z - mz).powi(2)).sum();
        let szy: f64 = w
            .iter()
            .zip(z)
            .zip(y)
            .map(|((w, z), y)| w * (z - mz) * (y - my))
            .sum();
        a = if szz > 0.0 { szy / szz } else { 0.0 };
        e = my - a * mz;
        if e < 0.0 {
            // The irreducible loss cannot be negative: fit through E = 0.
            e = 0.0;
            let szz0: f64 = w.iter().zip(z).map(|(w, z)| w * z * z).sum();
            a = w
                .iter()
                .zip(z)
                .zip(y)
                .map(|((w, z), y)| w * z * y)
                .sum::<f64>()
                / szz0;
        }
        let residuals: Vec<f64> = z.iter().zip(y).map(|(z, y)| y - e - a * z).collect();
        let mut abs: Vec<f64> = residuals.iter().map(|r| r.abs()).collect();
        abs.sort_by(f64::total_cmp);
        let scale = (abs[abs.len() / 2] / 0.6745).max(1e-9);
        let delta = 1.345 * scale;
        w = residuals
            .iter()
            .map(|r| {
                if r.abs() <= delta {
                    1.0
                } else {
                    delta / r.abs()
                }
            })
            .collect();
    }
    let rss = z
        .iter()
        .zip(y)
        .zip(&w)
        .map(|((z, y), w)| w * (y - e - a * z).powi(2))
        .sum();
    (e, a, rss)
}

/// The losses of `points` at each size (x), sizes ascending, each size's in the points' order.
fn by_size(points: &[(f64, f64)]) -> Vec<(f64, Vec<f64>)> {
    let mut sorted = points.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut groups: Vec<(f64, Vec<f64>)> = Vec::new();
    for (x, loss) in sorted {
        match groups.last_mut() {
            Some((gx, losses)) if *gx == x => losses.push(loss),
            _ => groups.push((x, vec![loss])),
        }
    }
    groups
}

/// Fits `L(x) = E + A·x^(−α)` to the points.
pub fn fit(points: &[(f64, f64)]) -> Result<Fit> {
    let sizes = by_size(points);
    if sizes.len() < 3 {
        bail!(
            "a scaling fit needs at least 3 sizes, got {} point(s) at {} size(s)",
            points.len(),
            sizes.len()
        );
    }
    if points.iter().any(|(x, l)| !(*x > 0.0 && l.is_finite())) {
        bail!("scaling points need positive x and finite losses");
    }
    // Work with x relative to its geometric mean for conditioning.
    let x_ref = (points.iter().map(|(x, _)| x.ln()).sum::<f64>() / points.len() as f64).exp();
    let xs: Vec<f64> = points.iter().map(|(x, _)| x / x_ref).collect();
    let ys: Vec<f64> = points.iter().map(|(_, l)| *l).collect();
    let cost = |alpha: f64| {
        let z: Vec<f64> = xs.iter().map(|x| x.powf(-alpha)).collect();
        linear_fit(&z, &ys)
    };
    let grid: Vec<f64> = (1..=400).map(|i| i as f64 * 0.01).collect();
    let (best, _) = grid
        .iter()
        .map(|&alpha| (alpha, cost(alpha).2))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("non-empty grid");
    let (mut lo, mut hi) = ((best - 0.01).max(0.01), best + 0.01);
    let phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..60 {
        let (m1, m2) = (hi - phi * (hi - lo), lo + phi * (hi - lo));
        if cost(m1).2 < cost(m2).2 {
            hi = m2;
        } else {
            lo = m1;
        }
    }
    let alpha = (lo + hi) / 2.0;
    let (e, a_rel, rss) = cost(alpha);
    let a = a_rel * x_ref.powf(alpha);
    // Standard errors from J = ∂L/∂(E, A_rel, α) at the optimum, σ² = RSS / (n − 3).
    let n = points.len();
    let errors = (n > 3 && e > 0.0).then(|| {
        let rows: Vec<[f64; 3]> = xs
            .iter()
            .map(|x| {
                let p = x.powf(-alpha);
                [1.0, p, -a_rel * p * x.ln()]
            })
            .collect();
        let mut jtj = [[0.0; 3]; 3];
        for r in &rows {
            for i in 0..3 {
                for j in 0..3 {
                    jtj[i][j] += r[i] * r[j];
                }
            }
        }
        let sigma2 = rss / (n - 3) as f64;
        invert3(jtj).map(|inv| [0, 1, 2].map(|i| (inv[i][i] * sigma2).max(0.0).sqrt()))
    });
    let errors = errors.flatten();
    Ok(Fit {
        e,
        a,
        alpha,
        e_err: errors.map(|s| s[0]),
        // A = A_rel·x_ref^α: propagate A_rel's error (α's contribution is reported separately).
        a_err: errors.map(|s| s[1] * x_ref.powf(alpha)),
        alpha_err: errors.map(|s| s[2]),
        points: n,
    })
}

fn invert3(m: [[f64; 3]; 3]) -> Option<[[f64; 3]; 3]> {
    let det = m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]);
    if det.abs() < 1e-300 {
        return None;
    }
    let mut inv = [[0.0; 3]; 3];
    for (i, row) in inv.iter_mut().enumerate() {
        for (j, cell) in row.iter_mut().enumerate() {
            let (r0, r1) = ([1, 0, 0][j], [2, 2, 1][j]);
            let (c0, c1) = ([1, 0, 0][i], [2, 2, 1][i]);
            let minor = m[r0][c0] * m[r1][c1] - m[r0][c1] * m[r1][c0];
            *cell = if (i + j) % 2 == 0 { minor } else { -minor } / det;
        }
    }
    Some(inv)
}

/// The paper's comparison at one DIFF point.
#[derive(Debug, Clone, Serialize)]
pub struct Match {
    pub attention: String,
    pub x: f64,
    pub loss: f64,
    /// The baseline x reaching the same (fitted) loss.
    pub baseline_x: Option<f64>,
    /// x / baseline_x: the share of the baseline's size (or tokens) this variant needs.
    pub ratio: Option<f64>,
    /// The ratio's 95% interval, a bootstrap over seeds (`None` with one seed per size).
    pub ratio_ci95: Option<[f64; 2]>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub axis: String,
    pub points: BTreeMap<String, Vec<(f64, f64)>>,
    pub fits: BTreeMap<String, Fit>,
    pub matches: Vec<Match>,
}

/// Collects (attention → [(x, validation loss)]) from finished runs under the sweep directories.
fn collect(sweeps: &[PathBuf], axis: &str) -> Result<BTreeMap<String, Vec<(f64, f64)>>> {
    let mut points: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for sweep in sweeps {
        let entries =
            std::fs::read_dir(sweep).map_err(|e| anyhow::anyhow!("{}: {e}", sweep.display()))?;
        let runs = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .flat_map(|dir| {
                if dir.join(layout::RECIPE).exists() {
                    return vec![dir];
                }
                // A sweep over seeds: RUN/seed-N, each seed a point.
                run_seeds(&dir)
            });
        for dir in runs {
            let Ok(summary) = run::summarize(&dir, &dir.display().to_string()) else {
                continue;
            };
            if summary.status != "finished" {
                continue;
            }
            let Some(loss) = summary.validation_loss else {
                continue;
            };
            let x = if axis == "tokens" {
                summary.tokens
            } else {
                summary.params_paper
            };
            points
                .entry(summary.attention)
                .or_default()
                .push((x as f64, loss));
        }
    }
    if points.is_empty() {
        bail!("no finished runs with a validation loss under {:?}", sweeps);
    }
    for series in points.values_mut() {
        series.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(points)
}

pub fn report(points: BTreeMap<String, Vec<(f64, f64)>>, axis: &str) -> Result<Report> {
    let mut fits = BTreeMap::new();
    for (attention, series) in &points {
        fits.insert(
            attention.clone(),
            fit(series).map_err(|e| anyhow::anyhow!("{attention}: {e}"))?,
        );
    }
    let baseline = fits.get("transformer").copied();
    let mut matches = points
        .iter()
        .filter(|(a, _)| a.as_str() != "transformer")
        .flat_map(|(attention, series)| {
            let f = fits[attention];
            // One comparison per size (seeds repeat sizes).
            by_size(series).into_iter().map(move |(x, _)| {
                let x = &x;
                let loss = f.loss(*x);
                let baseline_x = baseline.and_then(|b| b.x_at(loss));
                Match {
                    attention: attention.clone(),
                    x: *x,
                    loss,
                    baseline_x,
                    ratio: baseline_x.map(|b| x / b),
                    ratio_ci95: None,
                }
            })
        })
        .collect::<Vec<_>>();
    let at: Vec<(String, f64)> = matches.iter().map(|m| (m.attention.clone(), m.x)).collect();
    for (m, interval) in matches.iter_mut().zip(ratio_intervals(&points, &at)) {
        m.ratio_ci95 = interval;
    }
    Ok(Report {
        axis: axis.to_string(),
        points,
        fits,
        matches,
    })
}

/// Bootstrap resamples behind a ratio's interval.
const RESAMPLES: usize = 200;

/// The 95% interval of the ratio at each (attention, x): every size's losses resampled with
/// replacement over its seeds, every law refitted, the ratio recomputed (percentiles of the
/// resamples whose fits reach it). `None` everywhere unless every size has two seeds or more, as
/// one seed per size leaves nothing to resample but the points themselves.
fn ratio_intervals(
    points: &BTreeMap<String, Vec<(f64, f64)>>,
    at: &[(String, f64)],
) -> Vec<Option<[f64; 2]>> {
    let groups: BTreeMap<&String, Vec<(f64, Vec<f64>)>> = points
        .iter()
        .map(|(attention, series)| (attention, by_size(series)))
        .collect();
    let seeded = groups
        .values()
        .flatten()
        .all(|(_, losses)| losses.len() > 1);
    if !seeded || !points.contains_key("transformer") {
        return vec![None; at.len()];
    }
    let mut rng = diffzoo_datasets::Rng::new(0x5eed);
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); at.len()];
    for _ in 0..RESAMPLES {
        let fits: Option<BTreeMap<&String, Fit>> = groups
            .iter()
            .map(|(attention, groups)| {
                let resampled: Vec<(f64, f64)> = groups
                    .iter()
                    .flat_map(|(x, losses)| {
                        (0..losses.len())
                            .map(|_| (*x, losses[rng.below(losses.len() as u64) as usize]))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                fit(&resampled).ok().map(|f| (*attention, f))
            })
            .collect();
        let Some(fits) = fits else { continue };
        let baseline = fits[&"transformer".to_string()];
        for ((attention, x), ratios) in at.iter().zip(&mut ratios) {
            if let Some(b) = fits.get(attention).and_then(|f| baseline.x_at(f.loss(*x))) {
                ratios.push(x / b);
            }
        }
    }
    ratios
        .into_iter()
        .map(|mut r| {
            if r.len() < RESAMPLES / 2 {
                return None;
            }
            r.sort_by(f64::total_cmp);
            let at = |q: f64| r[((q * r.len() as f64) as usize).min(r.len() - 1)];
            Some([at(0.025), at(0.975)])
        })
        .collect()
}

/// An SVG plot: log x, points and fitted curves per architecture.
pub fn svg(report: &Report) -> String {
    let x_label = if report.axis == "tokens" {
        "training tokens"
    } else {
        "parameters (paper convention)"
    };
    let mut chart = Chart::new("", x_label, "validation loss", true);
    let all: Vec<f64> = report.points.values().flatten().map(|p| p.0).collect();
    let (lo, hi) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), x| {
        (a.min(x.log10()), b.max(x.log10()))
    });
    let pad = 0.05 * (hi - lo).max(0.1);
    for (i, (attention, series)) in report.points.iter().enumerate() {
        chart
            .series
            .push(Series::points(attention, i, series.clone()));
        if let Some(f) = report.fits.get(attention) {
            let curve = (0..=100)
                .map(|k| {
                    let x = 10f64.powf(lo - pad + (hi - lo + 2.0 * pad) * k as f64 / 100.0);
                    (x, f.loss(x))
                })
                .collect();
            chart.series.push(Series {
                legend: false,
                ..Series::line(attention, i, curve)
            });
        }
    }
    chart.svg()
}

pub fn run(args: &FitArgs) -> Result<()> {
    let points = collect(&args.sweeps, &args.axis)?;
    let report = report(points, &args.axis)?;
    if let Some(path) = &args.plot {
        plot::write(path, &svg(&report))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let err = |e: Option<f64>| e.map_or(String::new(), |e| format!(" ± {e:.3}"));
    for (attention, f) in &report.fits {
        println!(
            "{attention:<12} L(x) = {:.4}{} + {:.4e}{} · x^-({:.4}{})  ({} points)",
            f.e,
            err(f.e_err),
            f.a,
            err(f.a_err),
            f.alpha,
            err(f.alpha_err),
            f.points
        );
    }
    for m in &report.matches {
        match (m.baseline_x, m.ratio) {
            (Some(b), Some(r)) => println!(
                "{:<12} at x = {:.4e} (loss {:.4}): the baseline needs x = {b:.4e}; ratio {:.1}%{}",
                m.attention,
                m.x,
                m.loss,
                r * 100.0,
                m.ratio_ci95.map_or(String::new(), |[lo, hi]| format!(
                    " (95% interval {:.1}% to {:.1}%, a bootstrap over seeds)",
                    lo * 100.0,
                    hi * 100.0
                ))
            ),
            _ => println!(
                "{:<12} at x = {:.4e} (loss {:.4}): the baseline's fit never reaches this loss",
                m.attention, m.x, m.loss
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_known_constants_from_synthetic_data() {
        let truth = Fit {
            e: 1.7,
            a: 406.4,
            alpha: 0.34,
            e_err: None,
            a_err: None,
            alpha_err: None,
            points: 0,
        };
        let xs = [1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9];
        // Exact points, then with one gross outlier that a plain least-squares fit would chase.
        let exact: Vec<(f64, f64)> = xs.iter().map(|&x| (x, truth.loss(x))).collect();
        let f = fit(&exact).unwrap();
        assert!((f.e - 1.7).abs() < 1e-3, "{f:?}");
        assert!((f.alpha - 0.34).abs() < 1e-3, "{f:?}");
        assert!((f.a / 406.4 - 1.0).abs() < 1e-2, "{f:?}");
        let mut noisy: Vec<(f64, f64)> = exact
            .iter()
            .enumerate()
            .map(|(i, (x, l))| (*x, l + 0.002 * [1.0, -1.0][i % 2]))
            .collect();
        noisy[3].1 += 1.0;
        let f = fit(&noisy).unwrap();
        assert!(
            (f.alpha - 0.34).abs() < 0.03,
            "robust to the outlier: {f:?}"
        );
        assert!(f.alpha_err.is_some());
    }

    #[test]
    fn seeds_give_the_ratio_an_interval_that_holds_the_truth_and_narrows_with_the_noise() {
        let base = Fit {
            e: 2.0,
            a: 50.0,
            alpha: 0.3,
            e_err: None,
            a_err: None,
            alpha_err: None,
            points: 0,
        };
        let sizes = [1e8, 3e8, 1e9, 3e9, 1e10];
        let mut rng = diffzoo_datasets::Rng::new(3);
        let mut width = Vec::new();
        for noise in [0.01, 0.001] {
            // Four seeds per size around laws 60% apart, independent noise per run.
            let mut seeds = |law: &dyn Fn(f64) -> f64| -> Vec<(f64, f64)> {
                sizes
                    .iter()
                    .flat_map(|&x| {
                        (0..4)
                            .map(|_| (x, law(x) + noise * (rng.below(2001) as f64 / 1000.0 - 1.0)))
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
            let points: BTreeMap<String, Vec<(f64, f64)>> = [
                ("transformer".to_string(), seeds(&|x| base.loss(x))),
                ("diff".to_string(), seeds(&|x| base.loss(x / 0.6))),
            ]
            .into();
            let report = report(points, "params").unwrap();
            assert_eq!(report.matches.len(), sizes.len(), "one comparison per size");
            let middle = &report.matches[2];
            let [lo, hi] = middle.ratio_ci95.expect("an interval from four seeds");
            assert!(
                lo <= 0.6 && 0.6 <= hi && lo <= middle.ratio.unwrap(),
                "{middle:?}"
            );
            width.push(hi - lo);
        }
        assert!(width[1] < width[0] / 3.0, "{width:?}");
    }

    #[test]
    fn the_matching_baseline_size_inverts_the_law() {
        let law = |e: f64, a: f64, alpha: f64| Fit {
            e,
            a,
            alpha,
            e_err: None,
            a_err: None,
            alpha_err: None,
            points: 0,
        };
        let base = law(2.0, 50.0, 0.3);
        let x = base.x_at(base.loss(1e8)).unwrap();
        assert!((x / 1e8 - 1.0).abs() < 1e-9);
        assert_eq!(base.x_at(1.9), None, "below the irreducible loss");
        // A DIFF law whose loss at 0.6e9 equals the baseline's at 1e9: ratio 60%.
        let points: BTreeMap<String, Vec<(f64, f64)>> = [
            (
                "transformer".to_string(),
                [1e8, 3e8, 1e9, 3e9].map(|x| (x, base.loss(x))).to_vec(),
            ),
            (
                "diff".to_string(),
                [1e8, 3e8, 1e9, 3e9]
                    .map(|x| (x, base.loss(x / 0.6)))
                    .to_vec(),
            ),
        ]
        .into();
        let report = report(points, "params").unwrap();
        for m in &report.matches {
            assert!((m.ratio.unwrap() - 0.6).abs() < 1e-3, "{m:?}");
            assert_eq!(m.ratio_ci95, None, "one seed per size: no interval");
        }
        let svg = svg(&report);
        assert!(
            svg.starts_with("<svg")
                && svg.matches("<polyline").count() == 2
                && svg.matches("<circle").count() == 8
                && svg.contains(">diff<")
                && svg.contains(">transformer<")
        );
    }

    #[test]
    fn too_few_sizes_is_an_error_however_many_seeds() {
        let err = |points: &[(f64, f64)]| fit(points).unwrap_err().to_string();
        assert!(err(&[(1.0, 2.0), (2.0, 1.5)]).contains("at least 3 sizes, got 2 point(s)"));
        // Two sizes of three seeds each: six points, still two sizes.
        let seeds = [
            (1.0, 2.0),
            (1.0, 2.1),
            (1.0, 1.9),
            (2.0, 1.5),
            (2.0, 1.6),
            (2.0, 1.4),
        ];
        assert!(err(&seeds).contains("got 6 point(s) at 2 size(s)"));
    }
}
