//! `diffzoo compare RUN_A RUN_B`: every analysis on both runs, written as one Markdown report
//! with its figures and the raw results (`report.md`, `*.svg`, `results.json` in `--out`).
//!
//! A run directory of seeds (`RUN/seed-N`, from `sweep --seeds`) is analysed on its first seed,
//! and its validation loss is measured on every seed: the report then gives the difference of
//! the mean losses with its 95% interval over seeds (paired by seed when both sides have the
//! same seeds, which saw the same data order; Welch's otherwise).

use super::attention::{self, AttentionAllocation};
use super::lambda::{self, Lambdas};
use super::needle::{self, GridArgs, Retrieval};
use super::outliers::{self, Outliers};
use super::position::{self, NllByPosition};
use super::ppl::{self, Perplexity};
use super::quant::{self, Quantization};
use super::{Loaded, Values, list, seeds_of};
use crate::plot;
use crate::stats;
use anyhow::{Context, Result};
use diffzoo_models::AttentionKind;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    pub run_a: PathBuf,
    pub run_b: PathBuf,
    /// Directory for report.md, the figures and results.json.
    #[arg(long, default_value = "compare")]
    pub out: PathBuf,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Validation micro-batches for the loss and the quantisation study.
    #[arg(long, default_value_t = 16)]
    pub max_batches: usize,
    /// Validation windows for NLL by position (default: all).
    #[arg(long)]
    pub position_windows: Option<u64>,
    #[command(flatten)]
    pub grid: GridArgs,
    /// Samples per depth of the attention-allocation study.
    #[arg(long, default_value_t = 20)]
    pub attention_samples: usize,
    /// Needles per prompt of the attention-allocation study.
    #[arg(long, default_value_t = 4)]
    pub attention_needles: usize,
    /// Held-out tokens of the outlier study.
    #[arg(long, default_value_t = 8192)]
    pub outlier_tokens: usize,
    #[arg(long, default_value = "16,8,6,4", value_parser = list::<u32>)]
    pub bits: Values<u32>,
    /// Analyses to run, of loss, position, needle, attention, outliers, quant, lambda (default:
    /// all; the validation loss always runs).
    #[arg(long, value_parser = analyses)]
    pub only: Option<Values<String>>,
}

/// The analyses `compare` runs (`--only` chooses among them; the validation loss always runs).
pub const ANALYSES: [&str; 7] = [
    "loss",
    "position",
    "needle",
    "attention",
    "outliers",
    "quant",
    "lambda",
];

/// `--only`: analysis names from [`ANALYSES`].
fn analyses(text: &str) -> std::result::Result<Vec<String>, String> {
    let names: Vec<String> = text.split(',').map(|s| s.trim().to_string()).collect();
    match names.iter().find(|n| !ANALYSES.contains(&n.as_str())) {
        Some(bad) => Err(format!(
            "`{bad}` is not an analysis: choose among {}",
            ANALYSES.join(", ")
        )),
        None => Ok(names),
    }
}

/// Everything measured on one run; an analysis not asked for, or that the run's context cannot
/// hold, is `None` (and says why in `skipped`).
#[derive(Debug, Serialize)]
pub struct RunReport {
    pub name: String,
    pub run: String,
    pub attention: String,
    pub parameters: u64,
    pub ppl: Perplexity,
    pub nll_position: Option<NllByPosition>,
    pub needle: Option<Retrieval>,
    pub attention_allocation: Option<AttentionAllocation>,
    pub outliers: Option<Outliers>,
    pub quant: Option<Quantization>,
    pub lambda: Option<Lambdas>,
    /// A run over seeds: each seed's directory name and validation loss (empty for one run).
    pub seed_losses: Vec<(String, f64)>,
}

/// What both runs are measured with: the needle grid and attention-allocation needles fitted to
/// both contexts, or why an analysis cannot run.
struct Plan {
    needle: std::result::Result<needle::Grid, String>,
    /// The needles per prompt and the grid (its depths, first length and seed) of the attention
    /// study.
    attention: std::result::Result<(usize, needle::Grid), String>,
    /// What fitting left out, to be said.
    notes: Vec<String>,
}

impl Plan {
    /// What the report says of the analyses not run or cut down.
    fn said(&self, args: &CompareArgs) -> Vec<String> {
        let mut said = self.notes.clone();
        if let (Err(why), true) = (&self.needle, args.wants("needle")) {
            said.push(format!("multi-needle retrieval skipped: {why}"));
        }
        if let (Err(why), true) = (&self.attention, args.wants("attention")) {
            said.push(format!("attention allocation skipped: {why}"));
        }
        if let Some(only) = &args.only {
            let skipped: Vec<&str> = ANALYSES
                .iter()
                .copied()
                .filter(|a| *a != "loss" && !only.iter().any(|o| o == a))
                .collect();
            if !skipped.is_empty() {
                said.push(format!("not asked for (--only): {}", skipped.join(", ")));
            }
        }
        said
    }
}

impl CompareArgs {
    fn wants(&self, analysis: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|a| a == analysis))
    }

    /// The needle grid (resolved on run A, fitted to both) and the needles of the attention study
    /// (the largest count up to `--attention-needles` that both contexts hold).
    fn plan(&self, runs: [&Loaded; 2]) -> Result<Plan> {
        let mut notes = Vec::new();
        let mut grid = self.grid.resolve(runs[0])?;
        // Prompts no longer than the shorter context: both models read each one.
        let context = runs.iter().map(|l| l.context()).min().unwrap_or(0);
        let (kept, dropped): (Vec<usize>, Vec<usize>) =
            grid.lengths.iter().partition(|&&l| l <= context);
        if !dropped.is_empty() {
            notes.push(format!(
                "needle prompts of {dropped:?} tokens left out: longer than the shorter context ({context} tokens)"
            ));
        }
        grid.lengths = kept;
        if grid.lengths.is_empty() {
            let why = format!("no prompt length fits the shorter context of {context} tokens");
            return Ok(Plan {
                needle: Err(why.clone()),
                attention: Err(why),
                notes,
            });
        }
        for loaded in runs {
            let (fitted, note) = needle::fit(loaded, &grid)?;
            notes.extend(note);
            grid = fitted;
        }
        let needle = if grid.needles.is_empty() || grid.queries.is_empty() {
            Err(format!(
                "no needle count of --needles {:?} fits prompts of {:?} tokens",
                self.grid.needles, grid.lengths
            ))
        } else {
            Ok(grid.clone())
        };
        let single = needle::Grid {
            lengths: grid.lengths[..1].to_vec(),
            ..grid.clone()
        };
        let mut attention = Err(format!(
            "not even one needle fits prompts of {} tokens",
            single.lengths[0]
        ));
        for n in (1..=self.attention_needles).rev() {
            let mut all = true;
            for loaded in runs {
                // As the attention study samples: the run's own digits, its sample count.
                let as_measured = needle::Grid {
                    digits: loaded.needle_digits(),
                    samples: self.attention_samples,
                    ..single.clone()
                };
                all &= needle::fits(loaded, &as_measured, n, &[1])?;
            }
            if all {
                if n < self.attention_needles {
                    notes.push(format!(
                        "attention allocation with {n} needles per prompt: {} do not fit prompts of {} tokens",
                        self.attention_needles, single.lengths[0]
                    ));
                }
                attention = Ok((n, single.clone()));
                break;
            }
        }
        Ok(Plan {
            needle,
            attention,
            notes,
        })
    }
}

/// One side of the comparison: its seeds (none for a single run) and the run analysed (the first
/// seed), opened once for planning and measuring.
struct Side {
    seeds: Vec<PathBuf>,
    dir: PathBuf,
    loaded: Loaded,
}

impl Side {
    fn open(run: &Path, device: &str) -> Result<Self> {
        let seeds = seeds_of(run)?;
        let dir = seeds.first().map_or(run, PathBuf::as_path).to_path_buf();
        let loaded = Loaded::open(&dir, device, None)?;
        Ok(Self { seeds, dir, loaded })
    }
}

fn measure(args: &CompareArgs, plan: &Plan, side: &Side, name: &str) -> Result<RunReport> {
    let Side { seeds, dir, loaded } = side;
    eprintln!("{name}: {}", loaded.weights);
    let step = |what: &str| eprintln!("{name}: {what}");
    step("validation loss");
    let ppl = ppl::measure(loaded, None, Some(args.max_batches))?;
    let nll_position = match args.wants("position") {
        true => {
            step("NLL by position");
            Some(position::measure(loaded, args.position_windows)?)
        }
        false => None,
    };
    let needle = match (&plan.needle, args.wants("needle")) {
        (Ok(grid), true) => {
            step("multi-needle retrieval");
            Some(needle::measure(loaded, grid)?)
        }
        _ => None,
    };
    let attention_allocation = match (&plan.attention, args.wants("attention")) {
        (Ok((n, grid)), true) => {
            step("attention allocation");
            Some(attention::measure(
                loaded,
                *n,
                &grid.depths,
                grid.lengths.first().copied(),
                args.attention_samples,
                grid.seed,
            )?)
        }
        _ => None,
    };
    let outliers = match args.wants("outliers") {
        true => {
            step("outliers");
            Some(outliers::measure(loaded, args.outlier_tokens)?)
        }
        false => None,
    };
    let quant = match args.wants("quant") {
        true => {
            step("quantised attention");
            Some(quant::measure(loaded, &args.bits, args.max_batches, None)?)
        }
        false => None,
    };
    let lambda = match loaded.recipe.model.attention {
        AttentionKind::Transformer => None,
        _ if !args.wants("lambda") => None,
        _ => Some(lambda::measure(loaded, dir)?),
    };
    let mut seed_losses = Vec::with_capacity(seeds.len());
    for (i, seed) in seeds.iter().enumerate() {
        let loss = if i == 0 {
            ppl.loss
        } else {
            step(&format!("validation loss of {}", seed.display()));
            ppl::measure(
                &Loaded::open(seed, &args.device, None)?,
                None,
                Some(args.max_batches),
            )?
            .loss
        };
        let seed_name = seed.file_name().unwrap_or_default().to_string_lossy();
        seed_losses.push((seed_name.into_owned(), loss));
    }
    Ok(RunReport {
        name: name.to_string(),
        run: dir.display().to_string(),
        attention: loaded.recipe.model.attention.to_string(),
        parameters: loaded.recipe.model_config().param_count().total,
        ppl,
        nll_position,
        needle,
        attention_allocation,
        outliers,
        quant,
        lambda,
        seed_losses,
    })
}

/// Display names of the two runs: their directory names, told apart when equal.
fn names(a: &Path, b: &Path) -> [String; 2] {
    let name = |p: &Path| {
        p.file_name().map_or_else(
            || p.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    };
    let (na, nb) = (name(a), name(b));
    if na == nb {
        [format!("{na} (A)"), format!("{nb} (B)")]
    } else {
        [na, nb]
    }
}

/// The Markdown report of two runs; figures are referenced by file name.
pub fn report(runs: &[RunReport; 2], command: &str, said: &[String]) -> String {
    let [a, b] = runs;
    let mut s = String::new();
    let _ = writeln!(s, "# {} vs {}\n", a.name, b.name);
    let _ = writeln!(s, "Produced by `{command}`.\n");
    for line in said {
        let _ = writeln!(s, "- {line}");
    }
    if !said.is_empty() {
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "| | {} | {} |\n|---|---|---|", a.name, b.name);
    let row = |s: &mut String, what: &str, f: &dyn Fn(&RunReport) -> String| {
        let _ = writeln!(s, "| {what} | {} | {} |", f(a), f(b));
    };
    row(&mut s, "run", &|r| format!("`{}`", r.run));
    row(&mut s, "architecture", &|r| r.attention.clone());
    row(&mut s, "parameters", &|r| {
        format!("{:.2}M", r.parameters as f64 / 1e6)
    });
    row(&mut s, "weights", &|r| r.ppl.weights.clone());
    row(&mut s, "validation loss", &|r| format!("{:.4}", r.ppl.loss));
    row(&mut s, "perplexity", &|r| {
        format!("{:.2}", r.ppl.perplexity)
    });
    let _ = writeln!(s, "\n{}", loss_difference(a, b));
    if let Some(line) = seed_difference((&a.name, &a.seed_losses), (&b.name, &b.seed_losses)) {
        let _ = writeln!(s, "\n{line}");
    }

    if let (Some(pa), Some(pb)) = (&a.nll_position, &b.nll_position) {
        let _ = writeln!(s, "\n## NLL by position (Fig. 4)\n");
        let _ = writeln!(
            s,
            "Cumulative average NLL of held-out tokens up to each position.\n"
        );
        let _ = writeln!(s, "| position | {} | {} |\n|---|---|---|", a.name, b.name);
        for t in position::report_positions(pa.cumulative.len().min(pb.cumulative.len())) {
            let _ = writeln!(
                s,
                "| {t} | {:.4} | {:.4} |",
                pa.cumulative[t - 1],
                pb.cumulative[t - 1]
            );
        }
        let _ = writeln!(s, "\n![NLL by position](nll-position.svg)");
    }
    if let (Some(na), Some(nb)) = (&a.needle, &b.needle) {
        needle_section(&mut s, [(&a.name, na), (&b.name, nb)]);
    }
    if let (Some(aa), Some(ab)) = (&a.attention_allocation, &b.attention_allocation) {
        attention_section(&mut s, [(&a.name, aa), (&b.name, ab)]);
    }
    if let (Some(oa), Some(ob)) = (&a.outliers, &b.outliers) {
        outlier_section(&mut s, [(&a.name, oa), (&b.name, ob)]);
    }
    if let (Some(qa), Some(qb)) = (&a.quant, &b.quant) {
        quant_section(&mut s, [(&a.name, qa), (&b.name, qb)]);
    }
    lambda_section(&mut s, runs);
    s
}

/// The multi-needle section of the report: each run by name.
fn needle_section(s: &mut String, [(an, a), (bn, b)]: [(&String, &Retrieval); 2]) {
    let g = &a.grid;
    let _ = writeln!(s, "\n## Multi-needle retrieval (Table 2, Fig. 5)\n");
    let _ = writeln!(
        s,
        "Exact-match accuracy of greedy decoding by depth of the answer; {} samples per cell, {}-digit numbers, lengths {:?}, seed {}. \"answer tokens\": the share of answer tokens that are the model's top prediction given the ones before.\n",
        g.samples, g.digits, g.lengths, g.seed
    );
    let depths: Vec<String> = g
        .depths
        .iter()
        .map(|d| format!("{:.0}%", d * 100.0))
        .collect();
    let _ = writeln!(
        s,
        "| N | R | run | {} | mean | answer tokens |\n|---|---|---|{}---|---|",
        depths.join(" | "),
        "---|".repeat(depths.len())
    );
    for (n, r) in a.pairs() {
        for (name, run) in [(an, a), (bn, b)] {
            let cells: Vec<String> = g
                .depths
                .iter()
                .map(|&d| {
                    format!(
                        "{:.2}",
                        run.mean(|c| (c.needles, c.queries, c.depth) == (n, r, d))
                    )
                })
                .collect();
            let pair = |c: &needle::Cell| (c.needles, c.queries) == (n, r);
            let _ = writeln!(
                s,
                "| {n} | {r} | {} | {} | **{:.2}** | {:.2} |",
                name,
                cells.join(" | "),
                run.mean(pair),
                run.token_mean(pair)
            );
        }
    }
    let _ = writeln!(
        s,
        "\n![retrieval, {}](needle-a.svg) ![retrieval, {}](needle-b.svg)",
        an, bn
    );
}

/// The attention-allocation section of the report.
fn attention_section(s: &mut String, [(an, a), (bn, b)]: [(&String, &AttentionAllocation); 2]) {
    let _ = writeln!(s, "\n## Attention allocation (Table 3)\n");
    let _ = writeln!(
        s,
        "Attention of the answer-predicting token on the answer needle and on the rest of the context, mean over heads, layers and {} samples ({} needles per prompt). For DIFF the maps are the differential ones, A₁ − λ·A₂, whose rows sum to 1 − λ: a noise share below 0 means the subtracted map outweighs the first on the context, which DIFF's subtraction allows by construction.\n",
        a.samples, a.needles
    );
    let _ = writeln!(
        s,
        "| depth | {an} answer | {an} noise | {bn} answer | {bn} noise |\n|---|---|---|---|---|"
    );
    for (da, db) in a.depths.iter().zip(&b.depths) {
        let _ = writeln!(
            s,
            "| {:.0}% | {:.3} | {:.3} | {:.3} | {:.3} |",
            da.depth * 100.0,
            da.answer,
            da.noise,
            db.answer,
            db.noise
        );
    }
}

/// The activation-outlier section of the report.
fn outlier_section(s: &mut String, runs: [(&String, &Outliers); 2]) {
    let _ = writeln!(s, "\n## Activation outliers (Table 5)\n");
    let ranks: Vec<String> = outliers::RANKS.iter().map(|r| format!("top-{r}")).collect();
    let _ = writeln!(
        s,
        "| activation | run | {} | median |\n|---|---|{}---|",
        ranks.join(" | "),
        "---|".repeat(ranks.len())
    );
    for (what, pick) in [
        (
            "attention logits",
            (|o: &Outliers| o.attention_logits.clone()) as fn(&Outliers) -> outliers::Magnitudes,
        ),
        ("hidden states", |o: &Outliers| o.hidden_states.clone()),
    ] {
        for (name, run) in runs {
            let m = pick(run);
            let top: Vec<String> = m.top.iter().map(|(_, v)| format!("{v:.2}")).collect();
            let _ = writeln!(
                s,
                "| {what} | {name} | {} | {:.3} |",
                top.join(" | "),
                m.median
            );
        }
    }
}

/// The quantisation section of the report.
fn quant_section(s: &mut String, [(an, a), (bn, b)]: [(&String, &Quantization); 2]) {
    let _ = writeln!(s, "\n## Quantised attention logits (Fig. 8)\n");
    let _ = writeln!(
        s,
        "Validation loss with every attention logit map quantised (dynamic absmax), and its change from full precision.\n"
    );
    let _ = writeln!(
        s,
        "| bits | {an} loss | {an} Δ | {bn} loss | {bn} Δ |\n|---|---|---|---|---|"
    );
    for (wa, wb) in a.widths.iter().zip(&b.widths) {
        let bits = wa.bits.map_or("full".to_string(), |b| b.to_string());
        let _ = writeln!(
            s,
            "| {bits} | {:.4} | {:+.4} | {:.4} | {:+.4} |",
            wa.loss, wa.delta, wb.loss, wb.delta
        );
    }
    let _ = writeln!(s, "\n![quantisation](quant.svg)");
}

/// The λ section of the report, for the runs that have λ.
fn lambda_section(s: &mut String, runs: &[RunReport; 2]) {
    if runs.iter().all(|r| r.lambda.is_none()) {
        return;
    }
    let _ = writeln!(s, "\n## λ during training\n");
    for (i, run) in runs.iter().enumerate() {
        if let Some(l) = &run.lambda {
            let _ = writeln!(s, "{}:\n", run.name);
            let layers = l.checkpoints.first().map_or(0, |c| c.mean.len());
            let header: Vec<String> = (0..layers).map(|i| format!("layer {i}")).collect();
            let _ = writeln!(
                s,
                "| step | {} |\n|---|{}",
                header.join(" | "),
                "---|".repeat(layers)
            );
            for c in &l.checkpoints {
                let _ = writeln!(s, "| {} | {} |", c.step, l.layers(c).join(" | "));
            }
            let _ = writeln!(s, "\n![λ, {}](lambda-{}.svg)\n", run.name, ["a", "b"][i]);
        }
    }
}

/// The validation-loss difference A − B with its 95% interval over evaluation windows: paired
/// when both runs scored the same windows (the same data, tokenizer and window count), else
/// Welch's over the two sets.
pub fn loss_difference(a: &RunReport, b: &RunReport) -> String {
    let (pa, pb) = (&a.ppl, &b.ppl);
    let same = pa.data == pb.data && pa.windows == pb.windows && pa.tokens == pb.tokens;
    let (difference, windows) = if same {
        (
            stats::paired(&pa.per_window, &pb.per_window),
            format!("paired over the same {} evaluation windows", pa.windows),
        )
    } else {
        (
            stats::welch(&pa.per_window, &pb.per_window),
            format!(
                "Welch's, over {} and {} evaluation windows",
                pa.windows, pb.windows
            ),
        )
    };
    let seeds = if a.seed_losses.is_empty() || b.seed_losses.is_empty() {
        "another training seed moves each run's loss too, which needs runs over seeds on both \
         sides to show (`sweep --seeds` makes them, and compare takes them)"
    } else {
        "another training seed moves each run's loss too: see the difference over seeds below"
    };
    format!(
        "Validation loss {} − {}: {} ({windows}). The interval holds evaluation noise only: \
         {seeds}.",
        a.name,
        b.name,
        difference.describe(4),
    )
}

/// The difference of the mean validation losses over seeds, A − B, with its 95% interval:
/// paired by seed when both sides have the same seeds, else Welch's. `None` unless both sides
/// are runs over seeds. Each side: its name and its (seed, loss) pairs.
pub fn seed_difference(a: (&str, &[(String, f64)]), b: (&str, &[(String, f64)])) -> Option<String> {
    if a.1.is_empty() || b.1.is_empty() {
        return None;
    }
    let losses = |side: &[(String, f64)]| side.iter().map(|s| s.1).collect::<Vec<f64>>();
    let (la, lb) = (losses(a.1), losses(b.1));
    let same_seeds = a.1.iter().map(|s| &s.0).eq(b.1.iter().map(|s| &s.0));
    let (difference, how) = if same_seeds {
        (
            stats::paired(&la, &lb),
            format!("paired by seed over {} seeds", la.len()),
        )
    } else {
        (
            stats::welch(&la, &lb),
            format!("Welch's, over {} and {} seeds", la.len(), lb.len()),
        )
    };
    let mean = |name: &str, l: &[f64]| {
        let e = stats::estimate(l);
        match e.sd {
            Some(sd) => format!("{name} {:.4} ± {sd:.4} (sd)", e.mean),
            None => format!("{name} {:.4}", e.mean),
        }
    };
    Some(format!(
        "Validation loss over seeds, {} − {}: {} ({how}; means {}, {}). The other sections \
         analyse the first seed of each side.",
        a.0,
        b.0,
        difference.describe(4),
        mean(a.0, &la),
        mean(b.0, &lb),
    ))
}

pub fn run(args: &CompareArgs) -> Result<()> {
    let [na, nb] = names(&args.run_a, &args.run_b);
    // Both runs get the same needle prompts: resolved for RUN_A, fitted to both contexts.
    let sides = [
        Side::open(&args.run_a, &args.device)?,
        Side::open(&args.run_b, &args.device)?,
    ];
    let plan = args.plan([&sides[0].loaded, &sides[1].loaded])?;
    let said = plan.said(args);
    for line in &said {
        eprintln!("{line}");
    }
    let runs = [
        measure(args, &plan, &sides[0], &na)?,
        measure(args, &plan, &sides[1], &nb)?,
    ];
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = |f: &str| args.out.join(f);
    let [a, b] = &runs;
    if let (Some(pa), Some(pb)) = (&a.nll_position, &b.nll_position) {
        plot::write(
            &out("nll-position.svg"),
            &position::chart(&[(&a.name, pa), (&b.name, pb)]).svg(),
        )?;
    }
    for (run, file) in [(a, "needle-a.svg"), (b, "needle-b.svg")] {
        if let Some(needle) = &run.needle {
            let title = format!("Multi-needle retrieval: {}", run.name);
            plot::write(&out(file), &needle.heatmap(&title).svg())?;
        }
    }
    if let (Some(qa), Some(qb)) = (&a.quant, &b.quant) {
        plot::write(
            &out("quant.svg"),
            &quant::chart(&[(&a.name, qa), (&b.name, qb)]).svg(),
        )?;
    }
    for (run, file) in [(a, "lambda-a.svg"), (b, "lambda-b.svg")] {
        if let Some(l) = &run.lambda {
            plot::write(
                &out(file),
                &l.chart(&format!("λ by layer: {}", run.name)).svg(),
            )?;
        }
    }
    let command = std::iter::once("diffzoo".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    std::fs::write(out("report.md"), report(&runs, &command, &said))
        .with_context(|| format!("writing {}", out("report.md").display()))?;
    std::fs::write(out("results.json"), serde_json::to_string_pretty(&runs)?)
        .with_context(|| format!("writing {}", out("results.json").display()))?;
    println!("wrote {}", out("report.md").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::seed_difference;

    fn seeds(names: &[&str], losses: &[f64]) -> Vec<(String, f64)> {
        names
            .iter()
            .map(|n| n.to_string())
            .zip(losses.iter().copied())
            .collect()
    }

    #[test]
    fn seeds_pair_when_both_sides_have_the_same_ones_and_one_seed_gives_no_interval() {
        let a = seeds(&["seed-1", "seed-2", "seed-3"], &[3.0, 3.2, 3.1]);
        let b = seeds(&["seed-1", "seed-2", "seed-3"], &[3.1, 3.3, 3.2]);
        let line = seed_difference(("a", &a), ("b", &b)).unwrap();
        // Every paired difference is −0.1: a zero-width interval that excludes 0.
        assert!(
            line.contains("a − b: -0.1000 (95% interval -0.1000 to -0.1000)")
                && line.contains("paired by seed over 3 seeds")
                && line.contains("a 3.1000 ± 0.1000 (sd)"),
            "{line}"
        );
        let c = seeds(&["seed-4", "seed-5"], &[3.0, 3.4]);
        let line = seed_difference(("a", &a), ("c", &c)).unwrap();
        assert!(
            line.contains("Welch's, over 3 and 2 seeds")
                && line.contains("no detectable difference"),
            "{line}"
        );
        let one = seeds(&["seed-1"], &[3.0]);
        let line = seed_difference(("a", &one), ("b", &one.clone())).unwrap();
        assert!(
            line.contains("+0.0000 (no interval from one value)"),
            "{line}"
        );
        assert!(seed_difference(("a", &a), ("d", &[])).is_none());
    }
}
