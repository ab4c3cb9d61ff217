//! Means with 95% intervals, and differences of means, for the numbers diffzoo compares: losses
//! over evaluation windows (many, correlated only within a document) and, later, over seeds (a
//! handful).
//!
//! Intervals are Student-t intervals: `mean ± t(0.975, n−1) · sd/√n` for one sample (paired
//! differences are one sample of differences), and Welch's `Δ ± t(0.975, ν) · √(s²ₐ/nₐ + s²ᵦ/nᵦ)`
//! with the Welch–Satterthwaite ν for two. With n = 3 seeds a percentile bootstrap covers the
//! mean only about 70% of the time (its resamples take at most 10 values); the t interval covers
//! it at the nominal 95% for normal draws (both tested by simulation). One value has no interval:
//! none is reported rather than a fake one.
//!
//! A share of items (accuracy, the share judged supported) is a binomial proportion: its interval
//! is Wilson's score interval, which stays inside [0, 1] and is not a point at 0 or n successes
//! (a t interval of 0/1 outcomes is both).

use serde::Serialize;

/// A mean with its spread and 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    pub n: usize,
    pub mean: f64,
    /// Sample standard deviation (n − 1 in the denominator); `None` for one value.
    pub sd: Option<f64>,
    /// The 95% interval of the mean; `None` for one value.
    pub ci95: Option<[f64; 2]>,
}

impl Estimate {
    /// " ± 0.0123 (sd), 95% interval 3.1000 to 3.2000 over seeds" (`over` names the sample),
    /// " (no interval from one value)", or " (not finite: no interval)".
    pub fn spread(&self, digits: usize, over: &str) -> String {
        match (self.sd, self.ci95) {
            (Some(sd), Some([lo, hi])) => format!(
                " ± {sd:.digits$} (sd), 95% interval {lo:.digits$} to {hi:.digits$} over {over}"
            ),
            _ if self.n < 2 => " (no interval from one value)".to_string(),
            _ => " (not finite: no interval)".to_string(),
        }
    }
}

/// The difference of two means (first minus second) with its 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Difference {
    pub mean: f64,
    pub ci95: Option<[f64; 2]>,
    /// Whether the interval excludes 0; `None` without an interval.
    pub detectable: Option<bool>,
}

impl Difference {
    /// "−0.0123 (95% interval −0.0200 to −0.0046)" and whether a difference was detected.
    pub fn describe(&self, digits: usize) -> String {
        match (self.ci95, self.detectable) {
            (Some([lo, hi]), Some(detectable)) => format!(
                "{:+.digits$} (95% interval {lo:+.digits$} to {hi:+.digits$}){}",
                self.mean,
                if detectable {
                    ""
                } else {
                    ": no detectable difference"
                }
            ),
            _ => format!("{:+.digits$} (no interval from one value)", self.mean),
        }
    }
}

/// The mean of `xs` (at least one value) with its t interval; none when a value is not finite.
pub fn estimate(xs: &[f64]) -> Estimate {
    let n = xs.len();
    assert!(n > 0, "a mean of no values");
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n < 2 || !mean.is_finite() {
        return Estimate {
            n,
            mean,
            sd: None,
            ci95: None,
        };
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half = t_quantile(0.975, (n - 1) as f64) * (var / n as f64).sqrt();
    Estimate {
        n,
        mean,
        sd: Some(var.sqrt()),
        ci95: Some([mean - half, mean + half]),
    }
}

/// The share of `outcomes` that are true (at least one) with Wilson's 95% score interval:
/// `(p̂ + z²/2n ± z·√(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)`, z the normal 0.975 quantile.
pub fn proportion(outcomes: &[bool]) -> Estimate {
    const Z: f64 = 1.959_963_984_540_054;
    let n = outcomes.len();
    assert!(n > 0, "a share of no items");
    let k = outcomes.iter().filter(|&&o| o).count();
    let (nf, p) = (n as f64, k as f64 / n as f64);
    let z2 = Z * Z;
    let centre = (p + z2 / (2.0 * nf)) / (1.0 + z2 / nf);
    let half = Z * (p * (1.0 - p) / nf + z2 / (4.0 * nf * nf)).sqrt() / (1.0 + z2 / nf);
    let sd = (n > 1).then(|| (p * (1.0 - p) * nf / (nf - 1.0)).sqrt());
    Estimate {
        n,
        mean: p,
        sd,
        ci95: Some([(centre - half).max(0.0), (centre + half).min(1.0)]),
    }
}

/// `a − b` for paired values (the same evaluation windows under two models); Welch's when the
/// counts differ.
pub fn paired(a: &[f64], b: &[f64]) -> Difference {
    if a.len() != b.len() {
        return welch(a, b);
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let e = estimate(&d);
    difference(e.mean, e.ci95)
}

/// `mean(a) − mean(b)` for independent samples (Welch).
pub fn welch(a: &[f64], b: &[f64]) -> Difference {
    let (ea, eb) = (estimate(a), estimate(b));
    let mean = ea.mean - eb.mean;
    let (Some(sa), Some(sb)) = (ea.sd, eb.sd) else {
        return difference(mean, None);
    };
    let (va, vb) = (sa * sa / ea.n as f64, sb * sb / eb.n as f64);
    let se = (va + vb).sqrt();
    if se == 0.0 {
        return difference(mean, Some([mean, mean]));
    }
    let df = (va + vb).powi(2) / (va * va / (ea.n - 1) as f64 + vb * vb / (eb.n - 1) as f64);
    let half = t_quantile(0.975, df) * se;
    difference(mean, Some([mean - half, mean + half]))
}

fn difference(mean: f64, ci95: Option<[f64; 2]>) -> Difference {
    // A non-finite loss (a diverged model) has no interval, and no verdict.
    let ci95 = ci95.filter(|[lo, hi]| mean.is_finite() && lo.is_finite() && hi.is_finite());
    Difference {
        mean,
        ci95,
        detectable: ci95.map(|[lo, hi]| lo > 0.0 || hi < 0.0),
    }
}

/// The `p` quantile (p > 0.5) of Student's t with `df` degrees of freedom, by bisection on its
/// distribution function.
pub fn t_quantile(p: f64, df: f64) -> f64 {
    let (mut lo, mut hi) = (0.0, 1e4);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if t_cdf(mid, df) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// P(T ≤ t) for t ≥ 0: 1 − ½ I_{df/(df+t²)}(df/2, ½).
fn t_cdf(t: f64, df: f64) -> f64 {
    1.0 - 0.5 * incomplete_beta(df / (df + t * t), 0.5 * df, 0.5)
}

/// The regularized incomplete beta function I_x(a, b), by its continued fraction (evaluated
/// with the modified Lentz method on whichever side converges).
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let front =
        (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp();
    if x < (a + 1.0) / (a + b + 2.0) {
        front * beta_fraction(x, a, b) / a
    } else {
        1.0 - front * beta_fraction(1.0 - x, b, a) / b
    }
}

fn beta_fraction(x: f64, a: f64, b: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    d = 1.0 / if d.abs() < TINY { TINY } else { d };
    let mut h = d;
    for m in 1..=300 {
        let m = m as f64;
        let m2 = 2.0 * m;
        for aa in [
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ] {
            d = 1.0 + aa * d;
            d = 1.0 / if d.abs() < TINY { TINY } else { d };
            c = 1.0 + aa / c;
            if c.abs() < TINY {
                c = TINY;
            }
            h *= d * c;
        }
        if (d * c - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, 9 terms; ~1e-15 relative).
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x)Γ(1−x) = π / sin(πx).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let sum = G[1..]
        .iter()
        .enumerate()
        .fold(G[0], |acc, (i, g)| acc + g / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffzoo_datasets::Rng;

    /// A standard normal draw (Box–Muller).
    fn normal(rng: &mut Rng) -> f64 {
        let u = (rng.below(1 << 53) as f64 + 0.5) / (1u64 << 53) as f64;
        let v = rng.below(1 << 53) as f64 / (1u64 << 53) as f64;
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    #[test]
    fn a_share_has_wilson_interval_inside_zero_and_one() {
        // 19 of 20 and 20 of 20: Wilson's tabulated 0.7639–0.9911 and 0.8389–1.
        let share = |k: usize, n: usize| proportion(&(0..n).map(|i| i < k).collect::<Vec<_>>());
        let e = share(19, 20);
        let [lo, hi] = e.ci95.unwrap();
        assert_eq!(e.mean, 0.95);
        assert!(
            (lo - 0.7639).abs() < 1e-4 && (hi - 0.9911).abs() < 1e-4,
            "{lo} {hi}"
        );
        let [lo, hi] = share(20, 20).ci95.unwrap();
        assert!((lo - 0.8389).abs() < 1e-4 && hi == 1.0, "{lo} {hi}");
        let [lo, hi] = share(0, 20).ci95.unwrap();
        assert!(lo == 0.0 && (hi - 0.1611).abs() < 1e-4, "{lo} {hi}");
        // One item still has an interval (not a point), and the sample sd of 0/1 outcomes.
        let [lo, hi] = share(1, 1).ci95.unwrap();
        assert!(lo > 0.0 && lo < 0.25 && hi == 1.0);
        let sd = share(1, 2).sd.unwrap();
        assert!((sd - estimate(&[1.0, 0.0]).sd.unwrap()).abs() < 1e-12);
    }

    #[test]
    fn t_quantiles_match_the_tables() {
        for (df, want) in [
            (1.0, 12.706_204_736),
            (2.0, 4.302_652_730),
            (4.0, 2.776_445_105),
            (10.0, 2.228_138_852),
            (30.0, 2.042_272_456),
            (1e6, 1.959_966_35),
        ] {
            let got = t_quantile(0.975, df);
            assert!((got - want).abs() < 1e-6 * want, "df {df}: {got} vs {want}");
        }
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-12);
    }

    #[test]
    fn intervals_cover_the_true_mean_at_the_nominal_rate() {
        let mut rng = Rng::new(2024);
        let trials = 4000;
        let (mut one, mut two, mut pairs) = (0, 0, 0);
        for _ in 0..trials {
            // Three seeds of a run whose true loss is 3.2, sd 0.05.
            let xs: Vec<f64> = (0..3).map(|_| 3.2 + 0.05 * normal(&mut rng)).collect();
            let [lo, hi] = estimate(&xs).ci95.unwrap();
            one += usize::from(lo <= 3.2 && 3.2 <= hi);
            // Two architectures 0.03 apart, unequal spreads, 3 and 4 seeds.
            let a: Vec<f64> = (0..3).map(|_| 3.20 + 0.08 * normal(&mut rng)).collect();
            let b: Vec<f64> = (0..4).map(|_| 3.17 + 0.02 * normal(&mut rng)).collect();
            let [lo, hi] = welch(&a, &b).ci95.unwrap();
            two += usize::from(lo <= 0.03 && 0.03 <= hi);
            // 50 windows under two models: a shared per-window difficulty, a 0.01 gap.
            let hard: Vec<f64> = (0..50).map(|_| normal(&mut rng)).collect();
            let a: Vec<f64> = hard
                .iter()
                .map(|h| 4.0 + h + 0.1 * normal(&mut rng))
                .collect();
            let b: Vec<f64> = hard
                .iter()
                .map(|h| 3.99 + h + 0.1 * normal(&mut rng))
                .collect();
            let [lo, hi] = paired(&a, &b).ci95.unwrap();
            pairs += usize::from(lo <= 0.01 && 0.01 <= hi);
        }
        // The percentile bootstrap the t interval replaces, on the same three-seed draws.
        let mut boot = 0;
        for _ in 0..trials {
            let xs: Vec<f64> = (0..3).map(|_| 3.2 + 0.05 * normal(&mut rng)).collect();
            let mut means: Vec<f64> = (0..1000)
                .map(|_| (0..3).map(|_| xs[rng.below(3) as usize]).sum::<f64>() / 3.0)
                .collect();
            means.sort_by(f64::total_cmp);
            boot += usize::from(means[25] <= 3.2 && 3.2 <= means[974]);
        }
        let rate = boot as f64 / trials as f64;
        assert!(rate < 0.85, "bootstrap over 3 seeds covers {rate}");
        // 4000 trials: the standard error of a 95% rate is 0.0034. Welch's ν ≈ 2 with spreads
        // this unequal covers a little under 95% (0.94 here), as it does in the literature.
        for (what, hits, low) in [
            ("one sample", one, 0.935),
            ("Welch", two, 0.92),
            ("paired", pairs, 0.935),
        ] {
            let rate = hits as f64 / trials as f64;
            assert!((low..=0.965).contains(&rate), "{what}: {rate}");
        }
    }

    #[test]
    fn order_does_not_matter_and_one_value_has_no_interval() {
        let xs = [3.1, 3.4, 2.9, 3.3, 3.0];
        let mut ys = xs;
        ys.reverse();
        let (a, b) = (estimate(&xs), estimate(&ys));
        assert!((a.mean - b.mean).abs() < 1e-12 && (a.sd.unwrap() - b.sd.unwrap()).abs() < 1e-12);
        assert_eq!(estimate(&[3.0]).ci95, None);
        assert_eq!(estimate(&[3.0]).sd, None);
        let d = welch(&[3.0], &[2.0, 2.5]);
        assert_eq!((d.mean, d.ci95, d.detectable), (0.75, None, None));
        assert_eq!(d.describe(2), "+0.75 (no interval from one value)");
        assert_eq!(
            estimate(&[3.0]).spread(2, "seeds"),
            " (no interval from one value)"
        );
        assert_eq!(
            estimate(&[3.0, f64::INFINITY]).spread(2, "seeds"),
            " (not finite: no interval)"
        );
        // Two values: t(0.975, 1) = 12.706, sd = 0.5·√2, half width 12.706 · 0.5.
        assert_eq!(
            estimate(&[1.0, 2.0]).spread(2, "seeds"),
            " ± 0.71 (sd), 95% interval -4.85 to 7.85 over seeds"
        );
        let diverged = paired(&[f64::NAN, 2.0], &[1.0, 1.0]);
        assert_eq!((diverged.ci95, diverged.detectable), (None, None));
        assert_eq!(estimate(&[1.0, f64::INFINITY]).ci95, None);
        let clear = paired(&[2.0, 2.1, 2.2], &[1.0, 1.05, 1.2]);
        assert_eq!(clear.detectable, Some(true));
        let noise = welch(&[1.0, 2.0, 3.0], &[1.5, 2.5, 2.0]);
        assert!(
            noise.describe(3).ends_with(": no detectable difference"),
            "{}",
            noise.describe(3)
        );
    }
}
