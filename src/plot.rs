//! SVG figures with no dependency: line/point charts and heatmaps. Every figure diffzoo writes
//! (scaling fits, evaluation plots, comparison reports) is drawn here.

use std::fmt::Write;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 50.0;

/// A series' colour by name: the architectures keep theirs in every figure.
pub fn color(name: &str, index: usize) -> &'static str {
    const CYCLE: [&str; 8] = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    ];
    match name {
        "transformer" => CYCLE[0],
        "diff" => CYCLE[1],
        "diff-v2" => CYCLE[2],
        _ => CYCLE[index % CYCLE.len()],
    }
}

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Line,
    Points,
}

#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
    pub color: &'static str,
    /// Listed in the legend (fitted curves drawn beside their points are not).
    pub legend: bool,
}

impl Series {
    pub fn line(name: &str, index: usize, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.to_string(),
            points,
            style: Style::Line,
            color: color(name, index),
            legend: true,
        }
    }

    pub fn points(name: &str, index: usize, points: Vec<(f64, f64)>) -> Self {
        Self {
            style: Style::Points,
            ..Self::line(name, index, points)
        }
    }
}

/// A chart of lines and points over a linear or logarithmic x axis.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub series: Vec<Series>,
}

impl Chart {
    pub fn new(title: &str, x_label: &str, y_label: &str, log_x: bool) -> Self {
        Self {
            title: title.to_string(),
            x_label: x_label.to_string(),
            y_label: y_label.to_string(),
            log_x,
            series: Vec::new(),
        }
    }

    pub fn svg(&self) -> String {
        let tx = |x: f64| if self.log_x { x.log10() } else { x };
        let all: Vec<(f64, f64)> = self
            .series
            .iter()
            .filter(|s| s.legend || s.style == Style::Points)
            .flat_map(|s| s.points.iter().copied())
            .filter(|(x, y)| tx(*x).is_finite() && y.is_finite())
            .collect();
        let range = |values: &mut dyn Iterator<Item = f64>| {
            values.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)))
        };
        let (x0, x1) = range(&mut all.iter().map(|(x, _)| tx(*x)));
        let (y0, y1) = range(&mut all.iter().map(|(_, y)| *y));
        let (x0, x1) = if all.is_empty() {
            (0.0, 1.0)
        } else {
            let pad = 0.05 * (x1 - x0).max(0.1);
            (x0 - pad, x1 + pad)
        };
        let (y0, y1) = if all.is_empty() {
            (0.0, 1.0)
        } else {
            let pad = 0.1 * (y1 - y0).max(0.05 * y1.abs().max(1e-3));
            (y0 - pad, y1 + pad)
        };
        let px = |x: f64| LEFT + (tx(x) - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT);
        let py = |y: f64| TOP + (y1 - y) / (y1 - y0) * (HEIGHT - TOP - BOTTOM);
        let mut s = header(&self.title);
        axes(&mut s, &self.x_label, &self.y_label);
        let tick = |s: &mut String, value: f64, text: String| {
            let x = px(value);
            let _ = writeln!(
                s,
                "<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{text}</text>\n<line x1=\"{x:.1}\" y1=\"{}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"black\"/>",
                HEIGHT - BOTTOM + 18.0,
                HEIGHT - BOTTOM,
                HEIGHT - BOTTOM + 5.0
            );
        };
        if self.log_x {
            for decade in (x0.floor() as i32)..=(x1.ceil() as i32) {
                for mantissa in [1.0, 2.0, 5.0] {
                    let value = mantissa * 10f64.powi(decade);
                    if (x0..=x1).contains(&value.log10()) {
                        tick(&mut s, value, format!("{mantissa}e{decade}"));
                    }
                }
            }
        } else {
            for i in 0..=5 {
                let value = x0 + (x1 - x0) * i as f64 / 5.0;
                tick(&mut s, value, short(value));
            }
        }
        for i in 0..=4 {
            let y = y0 + (y1 - y0) * i as f64 / 4.0;
            let _ = writeln!(
                s,
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                LEFT - 6.0,
                py(y) + 4.0,
                short(y)
            );
        }
        let mut legend = 0;
        for series in &self.series {
            let c = series.color;
            let inside: Vec<(f64, f64)> = series
                .points
                .iter()
                .copied()
                .filter(|(x, y)| tx(*x).is_finite() && y.is_finite())
                .collect();
            match series.style {
                Style::Line => {
                    let path: Vec<String> = inside
                        .iter()
                        .map(|&(x, y)| {
                            format!("{:.1},{:.1}", px(x), py(y).clamp(TOP, HEIGHT - BOTTOM))
                        })
                        .collect();
                    let _ = writeln!(
                        s,
                        "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>",
                        path.join(" ")
                    );
                }
                Style::Points => {
                    for (x, y) in inside {
                        let _ = writeln!(
                            s,
                            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{c}\"/>",
                            px(x),
                            py(y)
                        );
                    }
                }
            }
            if series.legend {
                let ly = TOP + 16.0 * legend as f64 + 8.0;
                legend += 1;
                let _ = writeln!(
                    s,
                    "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">{}</text>",
                    WIDTH - 190.0,
                    ly - 4.0,
                    WIDTH - 175.0,
                    ly + 5.0,
                    escape(&series.name)
                );
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

/// A grid of values in [0, 1] (accuracies), white to dark green, each cell labelled.
#[derive(Debug, Clone)]
pub struct Heatmap {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub columns: Vec<String>,
    pub rows: Vec<String>,
    /// `values[row][column]`; NaN cells are left grey.
    pub values: Vec<Vec<f64>>,
}

impl Heatmap {
    pub fn svg(&self) -> String {
        let (cols, rows) = (self.columns.len().max(1), self.rows.len().max(1));
        let cw = (WIDTH - LEFT - RIGHT) / cols as f64;
        let ch = (HEIGHT - TOP - BOTTOM) / rows as f64;
        let mut s = header(&self.title);
        axes(&mut s, &self.x_label, &self.y_label);
        for (r, row) in self.values.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let (x, y) = (LEFT + c as f64 * cw, TOP + r as f64 * ch);
                let fill = if v.is_finite() {
                    let t = v.clamp(0.0, 1.0);
                    let channel = |from: f64, to: f64| (from + (to - from) * t).round() as u8;
                    format!(
                        "#{:02x}{:02x}{:02x}",
                        channel(255.0, 0.0),
                        channel(255.0, 104.0),
                        channel(255.0, 55.0)
                    )
                } else {
                    "#cccccc".into()
                };
                let ink = if v.is_finite() && v > 0.55 {
                    "white"
                } else {
                    "black"
                };
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{cw:.1}\" height=\"{ch:.1}\" fill=\"{fill}\" stroke=\"white\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"{ink}\">{}</text>",
                    x + cw / 2.0,
                    y + ch / 2.0 + 4.0,
                    if v.is_finite() {
                        format!("{v:.2}")
                    } else {
                        "–".into()
                    }
                );
            }
        }
        for (c, label) in self.columns.iter().enumerate() {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                LEFT + (c as f64 + 0.5) * cw,
                HEIGHT - BOTTOM + 18.0,
                escape(label)
            );
        }
        for (r, label) in self.rows.iter().enumerate() {
            let _ = writeln!(
                s,
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                LEFT - 6.0,
                TOP + (r as f64 + 0.5) * ch + 4.0,
                escape(label)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

fn header(title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{}</text>\n",
        WIDTH / 2.0,
        escape(title)
    )
}

fn axes(s: &mut String, x_label: &str, y_label: &str) {
    let _ = writeln!(
        s,
        "<line x1=\"{LEFT}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/>\n<line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{0}\" stroke=\"black\"/>",
        HEIGHT - BOTTOM,
        WIDTH - RIGHT
    );
    let _ = writeln!(
        s,
        "<text x=\"{cx}\" y=\"{by}\" text-anchor=\"middle\">{xl}</text>\n<text x=\"16\" y=\"{cy}\" transform=\"rotate(-90 16 {cy})\" text-anchor=\"middle\">{yl}</text>",
        cx = (LEFT + WIDTH - RIGHT) / 2.0,
        by = HEIGHT - 12.0,
        cy = HEIGHT / 2.0,
        xl = escape(x_label),
        yl = escape(y_label)
    );
}

/// A tick label with about three significant digits.
fn short(v: f64) -> String {
    if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-2) {
        format!("{v:.2e}")
    } else {
        let digits = (2 - v.abs().max(1e-9).log10().floor() as i32).clamp(0, 4) as usize;
        format!("{v:.digits$}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Writes an SVG figure, refusing other extensions (there is no raster encoder here).
pub fn write(path: &std::path::Path, svg: &str) -> anyhow::Result<()> {
    if path.extension().is_none_or(|e| e != "svg") {
        anyhow::bail!("--plot {}: only .svg plots are written", path.display());
    }
    std::fs::write(path, svg).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_draw_every_series_and_heatmaps_every_cell() {
        let mut chart = Chart::new("t", "x", "y", true);
        chart
            .series
            .push(Series::points("diff", 0, vec![(1e3, 2.0), (1e4, 1.5)]));
        chart
            .series
            .push(Series::line("transformer", 1, vec![(1e3, 2.1), (1e4, 1.7)]));
        let svg = chart.svg();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<circle").count(), 2);
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(svg.contains("1e3") && svg.contains(color("diff", 0)));
        let map = Heatmap {
            title: "acc".into(),
            x_label: "depth".into(),
            y_label: "needles".into(),
            columns: vec!["0%".into(), "50%".into()],
            rows: vec!["1".into(), "2".into(), "4".into()],
            values: vec![vec![1.0, 0.5], vec![0.0, f64::NAN], vec![0.25, 0.75]],
        };
        let svg = map.svg();
        assert_eq!(svg.matches("<rect x=").count(), 6);
        assert!(svg.contains(">0.50<") && svg.contains(">–<") && svg.contains("#006837"));
    }

    #[test]
    fn only_svg_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let err = write(&dir.path().join("a.png"), "<svg/>").unwrap_err();
        assert!(err.to_string().contains("only .svg"));
        write(&dir.path().join("a.svg"), "<svg/>").unwrap();
    }
}
