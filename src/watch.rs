//! `diffzoo watch DIR…`: many runs followed from their files — a sweep's directory, a Slurm
//! array's output, run directories — in a terminal dashboard: a table of every run's state,
//! progress, validation loss, throughput and time left, and the training and validation loss of
//! the marked runs overlaid, refreshed as the files grow: runs that appear under a directory
//! later (a sweep's next run) join the table, and marked too when all are marked. `--once` prints
//! the table (or JSON) and exits.
//!
//! A run's state comes from its directory: `model.bpk` (finished), `run.lock` held by a live
//! `train` on this host (running; on another host, recent writes to `metrics.jsonl` say so),
//! `outcome.json` (how the last `train` ended: stopped or failed, with why), and otherwise a
//! process that is gone without a word (killed, out of memory, a lost node): failed.

use crate::layout::{self, RunEnd};
use crate::recipe::Recipe;
use crate::run;
use crate::train::checkpoint;
use crate::train::lock::{self, Holder};
use crate::train::step::{clock, eta};
use anyhow::{Result, bail};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols;
use ratatui::text::Line;
use ratatui::widgets::{Axis, Block, Chart, Dataset, GraphType, Paragraph, Row, Table, TableState};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Seek};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

#[derive(Debug, Clone, clap::Args)]
pub struct WatchArgs {
    /// Run directories, or directories holding runs (a sweep's output, a Slurm array's), searched
    /// four levels deep.
    #[arg(required = true, value_name = "DIR")]
    dirs: Vec<PathBuf>,
    /// Print the table once and exit.
    #[arg(long)]
    once: bool,
    /// With --once: the table as JSON.
    #[arg(long, requires = "once")]
    json: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 2.0)]
    interval: f64,
}

pub fn run(args: &WatchArgs) -> Result<()> {
    if !(args.interval > 0.0 && args.interval <= 3600.0) {
        bail!(
            "--interval {}: expected a number of seconds above 0, at most 3600",
            args.interval
        );
    }
    let mut runs = Runs::default();
    let problems = runs.refresh(&args.dirs);
    if args.once {
        if let Some(problem) = problems.first() {
            bail!("{problem}");
        }
        if args.json {
            println!("{}", serde_json::to_string_pretty(&runs.rows)?);
        } else {
            print!("{}", table(&runs.rows));
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        bail!(
            "standard output is not a terminal, where watch draws: use --once (or --once --json)"
        );
    }
    let mut terminal = ratatui::init();
    let result = dashboard(&mut terminal, &mut runs, args, problems);
    ratatui::restore();
    result
}

/// Seconds without a write to `metrics.jsonl` or `run.lock` after which a run claimed on
/// another host is no longer taken to be running.
const SILENT_SECS: f64 = 600.0;

/// What the table shows of one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunRow {
    pub run: String,
    pub dir: PathBuf,
    /// `running`, `finished`, `stopped`, `failed` or `not started`.
    pub state: String,
    /// Why it failed, or where it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Whether a checkpoint to resume from exists (for stopped and failed runs).
    pub resumable: bool,
    pub step: usize,
    /// The recipe's steps (`None` while its recipe.toml does not read).
    pub steps: Option<usize>,
    pub tokens: u64,
    pub val_loss: Option<f64>,
    pub best_val_loss: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    /// Seconds left at the pace of this process's steps so far (running runs).
    pub eta_sec: Option<f64>,
}

/// The runs found so far, what their logs said and the rows made of both at the last refresh.
#[derive(Default)]
struct Runs {
    runs: BTreeMap<PathBuf, Watched>,
    rows: Vec<RunRow>,
}

struct Watched {
    name: String,
    steps: Option<usize>,
    /// The steps its sweep's `sweep.json` plans (shown until its recipe.toml reads).
    planned_steps: Option<usize>,
    log: LogFollower,
    /// Whether a checkpoint resumes the run, as of the checkpoint directory's modification time
    /// (verifying hashes every checkpoint: done again only when the directory changes).
    resumable: Option<(Option<SystemTime>, bool)>,
}

impl Runs {
    /// Finds the runs under `dirs` (new ones are added), reads what their logs gained and makes
    /// the rows; returns what went wrong with which directory (the others are still read).
    fn refresh(&mut self, dirs: &[PathBuf]) -> Vec<String> {
        let mut problems = Vec::new();
        for dir in dirs {
            if !dir.is_dir() {
                problems.push(format!("{}: not a directory", dir.display()));
                continue;
            }
            let found = find_runs(dir);
            if found.is_empty() {
                problems.push(format!(
                    "{}: no run directories in it or four levels below (a run directory holds {})",
                    dir.display(),
                    layout::RECIPE
                ));
            }
            for (path, planned_steps) in found {
                let name = path
                    .strip_prefix(dir)
                    .ok()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(&path)
                    .display()
                    .to_string();
                let watched = self.runs.entry(path.clone()).or_insert_with(|| Watched {
                    name,
                    steps: None,
                    planned_steps: None,
                    log: LogFollower::new(path.join(layout::METRICS)),
                    resumable: None,
                });
                watched.planned_steps = planned_steps;
            }
        }
        for (dir, watched) in &mut self.runs {
            if watched.steps.is_none() {
                // Read again until it reads (a recipe.toml being written, or of another build).
                watched.steps = run::run_recipe(dir).as_ref().ok().map(Recipe::total_steps);
            }
            watched.log.read();
        }
        self.rows = self.runs.iter_mut().map(|(dir, w)| row(dir, w)).collect();
        problems
    }
}

/// Run directories (those holding a recipe.toml) at or below `dir`, and those a sweep
/// directory's `sweep.json` plans but that are not there yet (with their planned steps), sorted.
fn find_runs(dir: &Path) -> Vec<(PathBuf, Option<usize>)> {
    fn walk(dir: &Path, depth: usize, out: &mut Vec<(PathBuf, Option<usize>)>) {
        if dir.join(layout::RECIPE).is_file() {
            out.push((dir.to_path_buf(), None));
            return;
        }
        for planned in run::sweep_plan(dir) {
            let path = dir.join(&planned.name);
            if !path.join(layout::RECIPE).is_file() {
                out.push((path, Some(planned.steps)));
            }
        }
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut children: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .collect();
        children.sort();
        if depth > 0 {
            for child in children {
                walk(&child, depth - 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, 4, &mut out);
    out.sort();
    out
}

fn row(dir: &Path, watched: &mut Watched) -> RunRow {
    let (state, detail) = state(dir, &watched.log);
    let running = state == "running";
    let resumable = !running && state != "finished" && {
        let checkpoints = dir.join(layout::CHECKPOINTS);
        let modified = std::fs::metadata(&checkpoints)
            .and_then(|m| m.modified())
            .ok();
        match watched.resumable {
            Some((at, resumable)) if at == modified => resumable,
            _ => {
                let resumable = checkpoint::resumable(&checkpoints);
                watched.resumable = Some((modified, resumable));
                resumable
            }
        }
    };
    let log = &watched.log;
    RunRow {
        run: watched.name.clone(),
        dir: dir.to_path_buf(),
        resumable,
        state,
        detail,
        step: log.step,
        steps: watched.steps.or(watched.planned_steps),
        tokens: log.tokens,
        val_loss: log.val_loss,
        best_val_loss: log.best_val_loss,
        tokens_per_sec: log.tokens_per_sec,
        eta_sec: running
            .then(|| log.pace.eta(watched.steps?.saturating_sub(log.step)))
            .flatten(),
    }
}

/// The state of a run and a detail (why it failed, where it runs).
fn state(dir: &Path, log: &LogFollower) -> (String, Option<String>) {
    if dir.join(layout::FINAL_MODEL).exists() {
        return ("finished".into(), None);
    }
    let Some(holder) = Holder::of(dir) else {
        return ("not started".into(), None);
    };
    let held = holder.holds(dir);
    if held == Some(true) {
        return ("running".into(), Some(format!("process {}", holder.pid)));
    }
    // An outcome counts only if the process that recorded it is the last to claim the run.
    if let Some(end) = RunEnd::read(dir).filter(|e| e.pid == holder.pid && e.host == holder.host) {
        return (end.state, end.reason);
    }
    if held.is_some() {
        return (
            "failed".into(),
            Some("the process is gone and recorded no outcome (killed? out of memory?)".into()),
        );
    }
    let lock = std::fs::metadata(dir.join(lock::LOCK))
        .and_then(|m| m.modified())
        .ok();
    match [log.modified, lock]
        .into_iter()
        .flatten()
        .max()
        .map(silent_secs)
    {
        Some(secs) if secs < SILENT_SECS => ("running".into(), Some(format!("on {}", holder.host))),
        silent => (
            "failed".into(),
            Some(format!(
                "ran on {}, silent for {} and recorded no outcome (killed? a lost node?)",
                holder.host,
                silent.map_or("ever".into(), clock)
            )),
        ),
    }
}

/// Seconds since `time`.
fn silent_secs(time: SystemTime) -> f64 {
    SystemTime::now()
        .duration_since(time)
        .unwrap_or_default()
        .as_secs_f64()
}

/// `metrics.jsonl` read as it grows: only the bytes appended since the last read are parsed, a
/// line still being written waits for its newline, and a log that shrank (replaced) is read anew.
struct LogFollower {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    step: usize,
    tokens: u64,
    val_loss: Option<f64>,
    best_val_loss: Option<f64>,
    tokens_per_sec: Option<f64>,
    /// Training loss by step; a resumed run's repeated steps replace what followed its
    /// checkpoint.
    losses: Vec<(f64, f64)>,
    /// Validation loss by step, replaced the same way.
    val_losses: Vec<(f64, f64)>,
    pace: Pace,
    modified: Option<SystemTime>,
    inode: Option<u64>,
}

impl LogFollower {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: Vec::new(),
            step: 0,
            tokens: 0,
            val_loss: None,
            best_val_loss: None,
            tokens_per_sec: None,
            losses: Vec::new(),
            val_losses: Vec::new(),
            pace: Pace::default(),
            modified: None,
            inode: None,
        }
    }

    fn read(&mut self) {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return;
        };
        let Ok(meta) = file.metadata() else { return };
        self.modified = meta.modified().ok();
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        if meta.len() < self.offset || self.inode.is_some_and(|i| i != inode) {
            *self = Self::new(std::mem::take(&mut self.path));
            return self.read();
        }
        self.inode = Some(inode);
        let mut fresh = Vec::new();
        if file.seek(std::io::SeekFrom::Start(self.offset)).is_err()
            || file.read_to_end(&mut fresh).is_err()
        {
            return;
        }
        self.offset += fresh.len() as u64;
        let mut bytes = std::mem::take(&mut self.partial);
        bytes.extend(fresh);
        let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        self.partial = bytes.split_off(complete);
        for line in bytes.split(|&b| b == b'\n') {
            if let Ok(record) = serde_json::from_slice::<Record>(line) {
                self.record(record);
            }
        }
    }

    fn record(&mut self, r: Record) {
        let step = r.step as f64;
        let from = |points: &mut Vec<(f64, f64)>| {
            let keep = points.partition_point(|&(s, _)| s < step);
            points.truncate(keep);
        };
        if r.split == "train" {
            from(&mut self.losses);
            from(&mut self.val_losses);
            self.losses.extend(r.loss.map(|loss| (step, loss)));
            self.step = r.step;
            self.tokens = r.tokens_seen;
            self.tokens_per_sec = r.tokens_per_sec.or(self.tokens_per_sec);
            self.pace.step(r.step, r.elapsed_sec);
        } else {
            from(&mut self.val_losses);
            self.val_losses.extend(r.loss.map(|loss| (step, loss)));
            self.val_loss = r.loss;
            if let Some(loss) = r.loss {
                self.best_val_loss = Some(self.best_val_loss.map_or(loss, |b| b.min(loss)));
            }
        }
    }
}

/// The fields of a `metrics.jsonl` line that watch uses.
#[derive(serde::Deserialize)]
struct Record {
    split: String,
    step: usize,
    #[serde(default)]
    tokens_seen: u64,
    /// `null` where it was not finite.
    loss: Option<f64>,
    #[serde(default)]
    tokens_per_sec: Option<f64>,
    #[serde(default)]
    elapsed_sec: f64,
}

/// Steps per second of the current process: `elapsed_sec` restarts with each `train`, so the
/// pace is measured from the first step that process logged.
#[derive(Default)]
struct Pace {
    first: Option<(usize, f64)>,
    last: Option<(usize, f64)>,
}

impl Pace {
    fn step(&mut self, step: usize, elapsed: f64) {
        if self.last.is_none_or(|(_, e)| elapsed < e) {
            self.first = Some((step, elapsed));
        }
        self.last = Some((step, elapsed));
    }

    fn eta(&self, left: usize) -> Option<f64> {
        let ((s0, e0), (s1, e1)) = (self.first?, self.last?);
        if e1 <= e0 {
            return None;
        }
        eta(s1.saturating_sub(s0), left, e1 - e0)
    }
}

const HEADER: [&str; 8] = [
    "run", "state", "step", "tokens", "val loss", "best val", "tok/s", "ETA",
];

/// The cells of a row, as the table and the dashboard show them.
fn cells(r: &RunRow) -> [String; 8] {
    let number = |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
    // Where a run runs is short enough for the table; why one failed goes under it.
    let state = match (r.state.as_str(), &r.detail) {
        ("running", Some(detail)) => format!("running ({detail})"),
        _ => r.state.clone(),
    };
    let state = if r.resumable {
        format!("{state}, resumable")
    } else {
        state
    };
    [
        r.run.clone(),
        state,
        format!(
            "{}/{}",
            r.step,
            r.steps.map_or("?".into(), |s| s.to_string())
        ),
        tokens(r.tokens),
        number(r.val_loss, 4),
        number(r.best_val_loss, 4),
        number(r.tokens_per_sec, 0),
        r.eta_sec.map_or("-".into(), clock),
    ]
}

/// `1234567` as `1.23M`.
fn tokens(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2}M", n as f64 / 1e6),
        _ => format!("{:.2}B", n as f64 / 1e9),
    }
}

/// The plain table of `--once`, failures' reasons under it.
fn table(rows: &[RunRow]) -> String {
    let all: Vec<[String; 8]> = std::iter::once(HEADER.map(String::from))
        .chain(rows.iter().map(cells))
        .collect();
    let widths: Vec<usize> = (0..8)
        .map(|c| all.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for cells in &all {
        let line: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, &w))| {
                if c < 2 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    for r in rows.iter().filter(|r| r.state != "running") {
        if let Some(detail) = &r.detail {
            out.push_str(&format!("{}: {}\n", r.run, detail));
        }
    }
    out
}

const COLORS: [Color; 8] = [
    Color::Cyan,
    Color::Yellow,
    Color::Magenta,
    Color::Green,
    Color::LightRed,
    Color::LightBlue,
    Color::White,
    Color::LightGreen,
];

/// The terminal dashboard: ↑/↓ move, space marks a run's curve, `a` marks all, `q` quits.
fn dashboard(
    terminal: &mut ratatui::DefaultTerminal,
    runs: &mut Runs,
    args: &WatchArgs,
    mut problems: Vec<String>,
) -> Result<()> {
    let mut selected = TableState::default().with_selected(Some(0));
    let mut marks = Marks::All(Vec::new());
    let interval = Duration::from_secs_f64(args.interval);
    let mut next = std::time::Instant::now() + interval;
    loop {
        if std::time::Instant::now() >= next {
            problems = runs.refresh(&args.dirs);
            next = std::time::Instant::now() + interval;
        }
        let rows = &runs.rows;
        terminal.draw(|frame| {
            let [top, bottom, note, help] = Layout::vertical([
                Constraint::Length(rows.len() as u16 + 3),
                Constraint::Min(8),
                Constraint::Length(1),
                Constraint::Length(1),
            ])
            .areas(frame.area());
            frame.render_stateful_widget(runs_table(rows, &marks), top, &mut selected);
            let curves = curves(runs, &marks);
            frame.render_widget(loss_chart(&curves), bottom);
            let chosen = selected.selected().and_then(|i| rows.get(i));
            frame.render_widget(Paragraph::new(note_line(&problems, chosen)), note);
            let keys = format!(
                "↑/↓ select · space mark · a mark all · n mark none · q quit · every {}s",
                args.interval
            );
            frame.render_widget(Paragraph::new(keys), help);
        })?;
        let wait = next.saturating_duration_since(std::time::Instant::now());
        if event::poll(wait.min(Duration::from_millis(250)))?
            && let Event::Key(key) = event::read()?
            && key.kind == KeyEventKind::Press
        {
            let dirs: Vec<&PathBuf> = rows.iter().map(|r| &r.dir).collect();
            match key.code {
                KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                    return Ok(());
                }
                KeyCode::Down | KeyCode::Char('j') => selected.select_next(),
                KeyCode::Up | KeyCode::Char('k') => selected.select_previous(),
                KeyCode::Char(' ') => {
                    if let Some(dir) = selected.selected().and_then(|i| dirs.get(i)) {
                        marks.toggle(dir);
                    }
                }
                KeyCode::Char('a') => marks = Marks::All(Vec::new()),
                KeyCode::Char('n') => marks = Marks::Only(Vec::new()),
                _ => {}
            }
        }
    }
}

/// The runs' table: a row per run, coloured by its state, its name marked ● when its curve is
/// drawn.
fn runs_table(rows: &[RunRow], marks: &Marks) -> Table<'static> {
    let body = rows.iter().map(|r| {
        let color = match r.state.as_str() {
            "running" => Color::Green,
            "failed" => Color::Red,
            "stopped" => Color::Yellow,
            _ => Color::Reset,
        };
        let mut cells = cells(r);
        if marks.holds(&r.dir) {
            cells[0] = format!("● {}", cells[0]);
        } else {
            cells[0] = format!("  {}", cells[0]);
        }
        Row::new(cells).style(Style::default().fg(color))
    });
    let widths = [
        Constraint::Fill(3),
        Constraint::Fill(2),
        Constraint::Length(13),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(7),
        Constraint::Length(8),
    ];
    Table::new(body, widths)
        .header(Row::new(HEADER).style(Style::default().add_modifier(Modifier::BOLD)))
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED))
        .block(Block::bordered().title(format!(" {} runs ", rows.len())))
}

/// The marked runs' curves: name, training losses, validation losses (each thinned).
fn curves<'a>(runs: &'a Runs, marks: &Marks) -> Vec<(&'a str, Points, Points)> {
    runs.runs
        .iter()
        .filter(|(dir, _)| marks.holds(dir))
        .map(|(_, w)| {
            let train = thinned(&w.log.losses, 1000);
            (w.name.as_str(), train, thinned(&w.log.val_losses, 1000))
        })
        .collect()
}

/// The chart of `curves`: training as lines, validation as dots, one colour per run, the axes
/// spanning every point.
fn loss_chart<'a>(curves: &'a [(&'a str, Points, Points)]) -> Chart<'a> {
    let (mut x_max, mut y_min, mut y_max) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for (_, train, validation) in curves {
        for &(x, y) in train.iter().chain(validation) {
            x_max = x_max.max(x);
            y_min = y_min.min(y);
            y_max = y_max.max(y);
        }
    }
    if !y_min.is_finite() {
        (y_min, y_max) = (0.0, 1.0);
    }
    // A flat curve (or one point) needs a range to be drawn in.
    if y_max - y_min < 1e-6 {
        (y_min, y_max) = (y_min - 0.5, y_max + 0.5);
    }
    let datasets = curves
        .iter()
        .enumerate()
        .flat_map(|(i, (name, train, validation))| {
            let style = Style::default().fg(COLORS[i % COLORS.len()]);
            [
                Dataset::default()
                    .name(name.to_string())
                    .marker(symbols::Marker::Braille)
                    .graph_type(GraphType::Line)
                    .style(style)
                    .data(train),
                Dataset::default()
                    .marker(symbols::Marker::Dot)
                    .graph_type(GraphType::Scatter)
                    .style(style.add_modifier(Modifier::BOLD))
                    .data(validation),
            ]
        })
        .collect();
    Chart::new(datasets)
        .block(
            Block::bordered()
                .title(" loss of the marked runs: training (line), validation (dots) "),
        )
        .x_axis(Axis::default().title("step").bounds([0.0, x_max]).labels([
            "0".to_string(),
            format!("{:.0}", x_max / 2.0),
            format!("{x_max:.0}"),
        ]))
        .y_axis(
            Axis::default()
                .title("loss")
                .bounds([y_min, y_max])
                .labels([y_min, (y_min + y_max) / 2.0, y_max].map(|v| format!("{v:.3}"))),
        )
}

/// A directory's problem, else why the `selected` run failed or stopped.
fn note_line(problems: &[String], selected: Option<&RunRow>) -> Line<'static> {
    let red = Style::default().fg(Color::Red);
    match (problems.first(), selected) {
        (Some(problem), _) => Line::styled(problem.clone(), red),
        (None, Some(r)) if r.state != "running" && r.detail.is_some() => Line::styled(
            format!("{}: {}", r.run, r.detail.as_deref().unwrap_or_default()),
            red,
        ),
        _ => Line::default(),
    }
}

/// Which runs' curves are drawn. After `a` every run is, those that appear later too, but the
/// ones unmarked since; after `n` only those marked since.
#[derive(Debug, PartialEq)]
enum Marks {
    All(Vec<PathBuf>),
    Only(Vec<PathBuf>),
}

impl Marks {
    fn holds(&self, dir: &Path) -> bool {
        match self {
            Marks::All(except) => !except.iter().any(|d| d == dir),
            Marks::Only(marked) => marked.iter().any(|d| d == dir),
        }
    }

    fn toggle(&mut self, dir: &Path) {
        let list = match self {
            Marks::All(list) | Marks::Only(list) => list,
        };
        match list.iter().position(|d| d == dir) {
            Some(i) => drop(list.remove(i)),
            None => list.push(dir.to_path_buf()),
        }
    }
}

/// A curve: (step, loss) pairs.
type Points = Vec<(f64, f64)>;

/// At most about `max` of `points`, evenly spaced, the last kept.
fn thinned(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    let every = points.len().div_ceil(max.max(1)).max(1);
    let mut out: Vec<_> = points.iter().step_by(every).copied().collect();
    if let Some(&last) = points.last()
        && out.last() != Some(&last)
    {
        out.push(last);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn line(split: &str, step: usize, loss: f64, elapsed: f64) -> String {
        format!(
            "{{\"split\":\"{split}\",\"step\":{step},\"tokens_seen\":{},\"loss\":{loss},\"perplexity\":1.0,\"tokens_per_sec\":100.0,\"elapsed_sec\":{elapsed}}}\n",
            step * 64
        )
    }

    #[test]
    fn a_growing_log_is_read_once_torn_lines_wait_and_resumed_steps_replace_the_old() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(layout::METRICS);
        let mut file = std::fs::File::create(&path).unwrap();
        let mut log = LogFollower::new(path.clone());
        log.read();
        assert_eq!(log.step, 0);
        for step in 1..=4 {
            file.write_all(line("train", step, 5.0 - step as f64 * 0.5, step as f64).as_bytes())
                .unwrap();
        }
        let torn = line("validation", 4, 3.25, 4.0);
        file.write_all(&torn.as_bytes()[..20]).unwrap();
        log.read();
        assert_eq!((log.step, log.tokens, log.val_loss), (4, 256, None));
        file.write_all(&torn.as_bytes()[20..]).unwrap();
        log.read();
        assert_eq!(log.val_loss, Some(3.25));
        // 1 step per second so far: 6 steps left take 6 s.
        assert_eq!(log.pace.eta(6), Some(6.0));
        // Resumed from a checkpoint at step 2 by a new process: steps 3 and 4 come again.
        file.write_all(line("train", 3, 9.0, 0.5).as_bytes())
            .unwrap();
        file.write_all(line("train", 4, 8.0, 2.5).as_bytes())
            .unwrap();
        file.write_all(line("validation", 4, 3.5, 2.5).as_bytes())
            .unwrap();
        log.read();
        let steps: Vec<f64> = log.losses.iter().map(|p| p.0).collect();
        assert_eq!(steps, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(log.val_losses, [(4.0, 3.5)]);
        assert_eq!(log.losses[3].1, 8.0);
        assert_eq!((log.val_loss, log.best_val_loss), (Some(3.5), Some(3.25)));
        // The new process's pace: one step in 2 s.
        assert_eq!(log.pace.eta(3), Some(6.0));
        // A replaced, shorter log is read from its start.
        std::fs::write(&path, line("train", 1, 7.0, 1.0)).unwrap();
        log.read();
        assert_eq!((log.step, log.losses.len()), (1, 1));
    }

    #[test]
    fn a_resumed_run_drops_the_validation_after_its_checkpoint_until_it_comes_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(layout::METRICS);
        let mut log = String::new();
        for step in 1..=4 {
            log += &line("train", step, 5.0, step as f64);
            if step % 2 == 0 {
                log += &line("validation", step, 3.0 + step as f64, step as f64);
            }
        }
        // Resumed at step 2: the validation of step 4 is gone until step 4 is validated again.
        log += &line("train", 3, 5.0, 0.5);
        std::fs::write(&path, &log).unwrap();
        let mut follower = LogFollower::new(path);
        follower.read();
        assert_eq!(follower.val_losses, [(2.0, 5.0)]);
    }

    #[test]
    fn a_sweeps_planned_runs_are_listed_before_they_start() {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("a");
        std::fs::create_dir_all(&started).unwrap();
        std::fs::write(started.join(layout::RECIPE), "").unwrap();
        let plan = [("a", 20), ("b", 40)].map(|(name, steps)| run::Planned {
            name: name.into(),
            steps,
        });
        run::write_sweep_plan(dir.path(), &plan).unwrap();
        let found = find_runs(dir.path());
        assert_eq!(found, [(started, None), (dir.path().join("b"), Some(40))]);
        let mut runs = Runs::default();
        assert!(runs.refresh(&[dir.path().to_path_buf()]).is_empty());
        let b = &runs.rows[1];
        assert_eq!(
            (b.run.as_str(), b.state.as_str(), b.steps),
            ("b", "not started", Some(40))
        );
    }

    #[test]
    fn marking_all_marks_runs_that_appear_later_and_unmarking_one_keeps_the_rest() {
        let (a, b, later) = (Path::new("a"), Path::new("b"), Path::new("later"));
        let mut marks = Marks::All(Vec::new());
        marks.toggle(b);
        assert!(marks.holds(a) && !marks.holds(b) && marks.holds(later));
        marks = Marks::Only(Vec::new());
        marks.toggle(a);
        assert!(marks.holds(a) && !marks.holds(b) && !marks.holds(later));
        marks.toggle(a);
        assert_eq!(marks, Marks::Only(Vec::new()));
    }

    #[test]
    fn thinning_keeps_the_ends_and_at_most_about_max_points() {
        let points: Vec<(f64, f64)> = (0..10_001).map(|i| (i as f64, 0.0)).collect();
        let thin = thinned(&points, 1000);
        assert!(thin.len() <= 1001, "{}", thin.len());
        assert_eq!((thin[0].0, thin.last().unwrap().0), (0.0, 10_000.0));
        assert_eq!(thinned(&points[..3], 1000).len(), 3);
    }

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(tokens(999), "999");
        assert_eq!(tokens(12_345), "12.3K");
        assert_eq!(tokens(1_234_567), "1.23M");
        assert_eq!(tokens(3_000_000_000), "3.00B");
    }
}
