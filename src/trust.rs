//! What makes a speed figure (`bench`'s, `generate`'s timings) believable, measured beside it:
//! the spread of its repetitions, the CPU time other processes took on this process's cores
//! while it ran, the load before the run, and the CPU it ran on.
//!
//! ```text
//! spread width  = (max − min) / median                                  of the repetitions' tokens/s
//! competing     = (busy(cores) − own − children − 2·tick·cores) / wall    in cores, over one measurement
//! ```
//!
//! `busy(cores)` is the non-idle time (`/proc/stat`: user, nice, system, irq, softirq and steal,
//! steal being a hypervisor's other guests) of the cores this process may run on; `own` and
//! `children` are this process's CPU time and its waited-for children's (`getrusage`); the
//! counters' resolution (two ticks a core) is taken off the difference, so that a run of a few
//! tens of milliseconds is not flagged by rounding alone. A figure measured while others took
//! more than [`COMPETING`] cores, or whose repetitions spread wider than [`WIDE`], is flagged
//! rather than reported as if it were precise.

use serde::{Deserialize, Serialize};
use std::time::Instant;

/// A spread wider than this share of its median is flagged.
pub const WIDE: f64 = 0.2;

/// Cores' worth of CPU time other processes may take during a measurement before it is flagged.
pub const COMPETING: f64 = 0.25;

/// A load average (one minute) above this many cores before the run is flagged.
pub const LOADED: f64 = 0.5;

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &mut [f64]) -> f64 {
    assert!(!values.is_empty(), "median of nothing");
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Tokens per second over the timed repetitions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// The rates `tokens / s` of repetitions that took `seconds` each (at least one).
    pub fn of_rates(tokens: f64, seconds: &[f64]) -> Self {
        let mut rates: Vec<f64> = seconds.iter().map(|s| tokens / s.max(1e-12)).collect();
        let median = median(&mut rates);
        Self {
            min: rates[0],
            median,
            max: rates[rates.len() - 1],
        }
    }

    /// (max − min) / median.
    pub fn width(&self) -> f64 {
        (self.max - self.min) / self.median
    }
}

/// CPU time on this process's cores, and this process's own, from a start.
pub struct LoadProbe {
    started: Instant,
    busy: f64,
    own: f64,
}

impl LoadProbe {
    /// `None` where the counters cannot be read (not Linux).
    pub fn start() -> Option<Self> {
        Some(Self {
            started: Instant::now(),
            busy: busy_now()?.0,
            own: own_seconds()?,
        })
    }

    /// Cores' worth of CPU time other processes took since the start, less what the counters'
    /// resolution could account for ([`TICKS_PER_CORE`] ticks on each core: over a measurement
    /// of tens of milliseconds, a tick is a quarter of a core or more); 0 when none.
    pub fn competing_cores(&self) -> Option<f64> {
        let wall = self.started.elapsed().as_secs_f64();
        let (busy, resolution) = busy_now()?;
        let others = (busy - self.busy) - (own_seconds()? - self.own);
        (wall > 0.0).then(|| ((others - resolution) / wall).max(0.0))
    }
}

/// Ticks a core's non-idle time, as `/proc/stat` counts it, may be off by between two reads:
/// user and system time each counted in whole ticks.
const TICKS_PER_CORE: f64 = 2.0;

/// Non-idle seconds of the cores this process may run on, from `/proc/stat`, and the
/// resolution of their difference between two reads ([`TICKS_PER_CORE`] on each of them).
fn busy_now() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mine = allowed_cores();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
    let cores: Vec<u64> = stat
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let core: usize = fields.next()?.strip_prefix("cpu")?.parse().ok()?;
            if mine.as_ref().is_some_and(|m| !m.contains(&core)) {
                return None;
            }
            let v: Vec<u64> = fields.filter_map(|f| f.parse().ok()).collect();
            // user nice system idle iowait irq softirq steal: all but idle and iowait.
            (v.len() >= 8).then(|| v[0] + v[1] + v[2] + v[5] + v[6] + v[7])
        })
        .collect();
    let busy: u64 = cores.iter().sum();
    Some((
        busy as f64 / ticks,
        TICKS_PER_CORE * cores.len() as f64 / ticks,
    ))
}

/// The cores this process may run on (`None`: unknown, count them all).
fn allowed_cores() -> Option<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some(
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        )
    }
}

/// CPU seconds of this process and of its children it has waited for.
fn own_seconds() -> Option<f64> {
    let seconds = |who| {
        // SAFETY: a zeroed rusage is valid; getrusage fills it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        (unsafe { libc::getrusage(who, &mut usage) } == 0).then(|| {
            let time = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            time(usage.ru_utime) + time(usage.ru_stime)
        })
    };
    Some(seconds(libc::RUSAGE_SELF)? + seconds(libc::RUSAGE_CHILDREN)?)
}

/// The one-minute load average (`/proc/loadavg`).
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The CPU a figure was measured on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cpu {
    pub vendor: String,
    pub model: String,
    /// The vector and matrix extensions these kernels can use, of those it has.
    pub extensions: Vec<String>,
}

/// Extensions worth naming, widest first.
const EXTENSIONS: [&str; 9] = [
    "amx_bf16",
    "amx_tile",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx512f",
    "avx2",
    "fma",
    "avx",
];

impl Cpu {
    /// This machine's, from `/proc/cpuinfo` (its architecture alone where that is missing).
    pub fn here() -> Self {
        Self::parse(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
    }

    fn parse(cpuinfo: &str) -> Self {
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let flags = field("flags").unwrap_or_default();
        let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
        Self {
            vendor: field("vendor_id").unwrap_or_default(),
            model: field("model name").unwrap_or_else(|| std::env::consts::ARCH.to_string()),
            extensions: EXTENSIONS
                .into_iter()
                .filter(|e| has(e))
                .map(String::from)
                .collect(),
        }
    }

    /// The model and the widest extensions: `Intel(R) Xeon(R) … (avx512, avx512_bf16, amx)`.
    pub fn summary(&self) -> String {
        let has = |e: &str| self.extensions.iter().any(|x| x == e);
        let vector = ["avx512f", "avx2", "avx"].into_iter().find(|e| has(e));
        let named: Vec<&str> = vector
            .map(|v| v.trim_end_matches('f'))
            .into_iter()
            .chain(has("avx512_bf16").then_some("avx512_bf16"))
            .chain(has("amx_bf16").then_some("amx"))
            .collect();
        if named.is_empty() {
            self.model.clone()
        } else {
            format!("{} ({})", self.model, named.join(", "))
        }
    }
}

/// What a measured figure is, for its warnings: `flex diff step`, say.
pub struct Figure {
    pub what: String,
    pub spread: Option<Spread>,
    /// Cores other processes took while it was measured.
    pub competing: Option<f64>,
}

/// One line for each reason not to trust the report: a loaded machine before the run, a figure
/// measured beside other processes, repetitions spread wider than [`WIDE`].
pub fn warnings(load_before: Option<f64>, figures: &[Figure]) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(load) = load_before.filter(|&l| l > LOADED) {
        lines.push(format!(
            "the load average was {load:.2} before the run: other work was running"
        ));
    }
    for figure in figures {
        if let Some(cores) = figure.competing.filter(|&c| c > COMPETING) {
            lines.push(format!(
                "{}: other processes took {cores:.2} cores while it was measured: its figures, and ratios to others, are unsound",
                figure.what
            ));
        }
        if let Some(spread) = figure.spread.filter(|s| s.width() > WIDE) {
            lines.push(format!(
                "{}: repetitions spread {:.0}% of their median ({:.0} to {:.0} tokens/s): not a precise figure",
                figure.what,
                100.0 * spread.width(),
                spread.min,
                spread.max
            ));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut [7.0]), 7.0);
    }

    #[test]
    fn a_spread_is_of_the_repetitions_rates() {
        let s = Spread::of_rates(100.0, &[1.0, 0.5, 2.0]);
        assert_eq!((s.min, s.median, s.max), (50.0, 100.0, 200.0));
        assert_eq!(s.width(), 1.5);
    }

    #[test]
    fn warnings_name_the_load_the_competition_and_wide_spreads_only() {
        let tight = Spread::of_rates(100.0, &[1.0, 1.05, 0.98]);
        let wide = Spread::of_rates(100.0, &[1.0, 1.5, 0.9]);
        let figure = |what: &str, spread: Spread, competing| Figure {
            what: what.into(),
            spread: Some(spread),
            competing,
        };
        assert!(warnings(Some(0.1), &[figure("flex diff", tight, Some(0.05))]).is_empty());
        let lines = warnings(
            Some(1.9),
            &[
                figure("flex diff", tight, Some(0.9)),
                figure("flex transformer", wide, None),
            ],
        );
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].contains("load average was 1.90"));
        assert!(lines[1].starts_with("flex diff: other processes took 0.90 cores"));
        assert!(lines[2].starts_with("flex transformer: repetitions spread 44%"));
    }

    #[test]
    fn the_cpu_is_named_with_its_extensions() {
        let info = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx avx2 fma avx512f avx512_bf16\n";
        let cpu = Cpu::parse(info);
        assert_eq!(cpu.vendor, "AuthenticAMD");
        assert_eq!(
            cpu.extensions,
            ["avx512_bf16", "avx512f", "avx2", "fma", "avx"]
        );
        assert_eq!(cpu.summary(), "AMD EPYC 9R14 (avx512, avx512_bf16)");
        assert_eq!(Cpu::parse("").extensions, Vec::<String>::new());
    }
}
