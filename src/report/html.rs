//! HTML (`--html FILE`): one self-contained page (inline CSS and SVG, nothing
//! fetched). Per run and step, an SVG plot (plotters, SVG backend) of each
//! stage's error through the layers in execution order, log scale, with the
//! tolerance line and the first divergence highlighted; then every failing
//! check's full message. The page model (`Page`, `Section`, `Plot`) is filled
//! from a run report here and from a diff in `crate::diff`, so the drawing
//! code knows nothing about either.

use std::collections::BTreeMap;
use std::fmt::Write;

use plotters::prelude::*;

use super::{Outcome, Report};
use crate::checks::{Family, Status};
use crate::stage::{Stage, Step};

/// Errors of exactly zero are drawn on this floor (a log axis has no zero).
const FLOOR: f64 = 1e-12;

pub struct Series {
    pub name: String,
    pub color: RGBColor,
    /// (x index, error, failed)
    pub points: Vec<(usize, f64, bool)>,
}

pub struct Plot {
    pub title: String,
    /// Stage names, one per x index, in execution order.
    pub x_labels: Vec<String>,
    pub series: Vec<Series>,
    /// A horizontal reference line: (value, label).
    pub tolerance: Option<(f64, String)>,
    /// The x index to highlight: (index, label).
    pub highlight: Option<(usize, String)>,
    /// The y axis' description.
    pub y_desc: String,
}

pub struct Section {
    pub title: String,
    /// Trusted HTML (built with `escape`).
    pub summary_html: String,
    pub plots: Vec<Plot>,
    /// (title, preformatted text), shown open.
    pub details: Vec<(String, String)>,
}

pub const BLUE: RGBColor = RGBColor(31, 119, 180);
pub const ORANGE: RGBColor = RGBColor(255, 127, 14);
pub const GREEN: RGBColor = RGBColor(44, 160, 44);
pub const PURPLE: RGBColor = RGBColor(148, 103, 189);
const FAIL_RED: RGBColor = RGBColor(214, 39, 40);

/// Pixels per stage on the x axis: enough for a 10 px rotated label.
const PX_PER_STAGE: usize = 14;
/// Above this many stages only block boundaries (and the stages outside any
/// block) are labelled, so that labels never overlap.
const LABEL_EVERY_STAGE_UP_TO: usize = 80;

/// Draws one plot as an SVG string. The SVG is as wide as its labels need
/// (at least 1100 px) and scales to the page width in the browser.
pub fn svg(plot: &Plot) -> String {
    let n = plot.x_labels.len().max(1);
    let width = (n * PX_PER_STAGE + 160).max(1100) as u32;
    let sparse = n > LABEL_EVERY_STAGE_UP_TO;
    let ys: Vec<f64> = plot
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(plot.tolerance.iter().map(|t| t.0))
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v.max(FLOOR))
        .collect();
    let lo = ys.iter().cloned().fold(f64::INFINITY, f64::min).clamp(FLOOR, 1e-9) / 3.0;
    // Headroom above the largest value keeps the legend clear of the data.
    let hi = ys.iter().cloned().fold(0.0, f64::max).max(lo * 100.0) * 300.0;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (width, 460)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let labels = plot.x_labels.clone();
        let chart = ChartBuilder::on(&root)
            .caption(&plot.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(130)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), (lo..hi).log_scale());
        let Ok(mut chart) = chart else {
            return String::new();
        };
        let _ = chart
            .configure_mesh()
            .x_labels(n)
            // Labels are drawn below (see the loop after): the mesh's own
            // rotated labels are centred on the tick and run into the plot.
            .x_label_formatter(&|_| String::new())
            .y_desc(plot.y_desc.as_str())
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .light_line_style(WHITE.mix(0.0))
            .draw();
        // Stage labels, rotated, starting just below the axis at each stage.
        // Many stages: label each block where it starts (`blk.5.attn_norm`
        // reads as "block 5") and the stages outside blocks, so none overlap.
        let label_style = TextStyle::from(("sans-serif", 11).into_font().transform(FontTransform::Rotate90)).pos(
            plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Left,
                plotters::style::text_anchor::VPos::Center,
            ),
        );
        for (i, l) in labels.iter().enumerate() {
            if sparse && l.starts_with("blk.") && !l.ends_with(".attn_norm") {
                continue;
            }
            let (px, py) = chart.backend_coord(&(i as f64, lo));
            let _ = root.draw(&Text::new(l.clone(), (px, py + 6), label_style.clone()));
        }
        if let Some((i, label)) = &plot.highlight {
            let x = *i as f64;
            let _ = chart.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.5, lo), (x + 0.5, hi)],
                FAIL_RED.mix(0.15).filled(),
            )));
            let _ = chart.draw_series(std::iter::once(Text::new(
                label.clone(),
                (x + 0.6, hi / 4.0),
                ("sans-serif", 13).into_font().color(&FAIL_RED),
            )));
        }
        if let Some((t, label)) = &plot.tolerance {
            let style = ShapeStyle::from(&BLACK.mix(0.6)).stroke_width(1);
            let _ = chart
                .draw_series(DashedLineSeries::new(
                    vec![(-0.5, *t), (n as f64 - 0.5, *t)],
                    6,
                    4,
                    style,
                ))
                .map(|s| {
                    s.label(label.clone())
                        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.mix(0.6)))
                });
        }
        for s in &plot.series {
            let pts: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0 as f64, p.1.max(FLOOR))).collect();
            let color = s.color;
            let _ = chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map(|l| {
                    l.label(s.name.clone())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)))
                });
            let _ = chart.draw_series(s.points.iter().map(|&(x, y, failed)| {
                let (c, r) = if failed { (FAIL_RED, 5) } else { (color, 3) };
                Circle::new((x as f64, y.max(FLOOR)), r, c.filled())
            }));
        }
        let _ = chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw();
        let _ = root.present();
    }
    out
}

const CSS: &str = "body{font-family:sans-serif;margin:24px;color:#222}\
.plot svg{width:100%;height:auto}\
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}\
.pass{color:#2a7a2a;font-weight:bold}.fail{color:#c62828;font-weight:bold}\
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}\
details{margin:6px 0}summary{cursor:pointer;font-family:monospace}.note{color:#666;font-size:12px}";

/// The whole page.
pub fn page(title: &str, header_html: &str, sections: &[Section]) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{CSS}</style></head><body>\n<h1>{}</h1>\n{header_html}\n",
        escape(title),
        escape(title)
    );
    for s in sections {
        let _ = writeln!(out, "<h2>{}</h2>\n{}", escape(&s.title), s.summary_html);
        for p in &s.plots {
            let _ = writeln!(out, "<div class=\"plot\">{}</div>", svg(p));
        }
        if !s.details.is_empty() {
            let _ = writeln!(out, "<h3>Failing checks ({})</h3>", s.details.len());
            for (t, body) in &s.details {
                let _ = writeln!(
                    out,
                    "<details open><summary>{}</summary><pre>{}</pre></details>",
                    escape(t),
                    escape(body)
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "<p class=\"note\">Errors of exactly 0 are drawn at {FLOOR:e}. Red points are failing checks.</p>\n</body></html>"
    );
    out
}

/// Escapes text for HTML content and attribute values; characters a page
/// cannot hold are replaced by U+FFFD.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

const PALETTE: [RGBColor; 4] = [BLUE, ORANGE, GREEN, PURPLE];

/// The scaled policy's view of a step: per stage, the engine's error against
/// the oracle divided by each reference's (or the floor), and each
/// reference's error divided by its own floor; a check fails above the
/// factor (the dashed line). `None` when no check of the step was scaled.
fn ratio_plot(
    step: Step,
    stages: &BTreeMap<Stage, Vec<&Outcome>>,
    x_labels: Vec<String>,
    highlight: Option<(usize, String)>,
) -> Option<Plot> {
    let mut checks: Vec<(&str, &Family)> = stages
        .values()
        .flatten()
        .filter(|o| o.metrics.contains_key("ratio"))
        .map(|o| (o.check.as_str(), &o.family))
        .collect();
    checks.sort();
    checks.dedup();
    if checks.is_empty() {
        return None;
    }
    let series = checks
        .iter()
        .enumerate()
        .map(|(k, (check, family))| Series {
            name: match family {
                Family::ReferencesAgree { base, other } => format!("{other} vs {base} / its floor"),
                Family::Golden { source } => format!("engine error / {source}'s error ({check})"),
                _ => check.to_string(),
            },
            color: PALETTE[k % PALETTE.len()],
            points: stages
                .values()
                .enumerate()
                .filter_map(|(i, outs)| {
                    let o = outs.iter().find(|o| o.check == *check)?;
                    Some((i, *o.metrics.get("ratio")?, o.status == Status::Fail))
                })
                .collect(),
        })
        .collect();
    let factors: Vec<f64> = stages
        .values()
        .flatten()
        .filter_map(|o| o.metrics.get("factor").copied())
        .collect();
    let factor = factors.first().copied().filter(|a| factors.iter().all(|b| b == a));
    Some(Plot {
        title: format!("{step}: scaled policy, error ratio per stage"),
        x_labels,
        series,
        tolerance: factor.map(|f| (f, format!("factor {f} (fails above)"))),
        highlight,
        y_desc: "error ratio (log)".into(),
    })
}

/// A run report as a page: per run, one plot per step of every golden source's
/// max |Δ| through the stages.
pub fn render(report: &Report) -> String {
    let c = report.counts();
    let verdict = if c.failed > 0 { "fail" } else { "pass" };
    let header = format!(
        "<p class=\"{verdict}\">{}: {} passed, {} failed, {} skipped{}</p>",
        if c.failed > 0 { "FAILED" } else { "PASSED" },
        c.passed,
        c.failed,
        c.skipped,
        c.not_applicable_tail()
    );
    let mut sections = Vec::new();
    for run in &report.runs {
        let mut summary = String::new();
        if let Some(r) = &run.skipped {
            summary += &format!("<p>skipped: {}</p>", escape(r));
        }
        if let Some(d) = &run.suspect_golden {
            summary += &format!(
                "<p class=\"fail\">Golden suspect: {}/{} ({}): the references are outside their own allowance there</p>",
                escape(&d.step),
                escape(&d.stage),
                escape(&d.check)
            );
        }
        if let Some(d) = &run.first_divergence {
            summary += &format!(
                "<p class=\"fail\">First divergence: {}/{} ({})</p>",
                escape(&d.step),
                escape(&d.stage),
                escape(&d.check)
            );
        } else if run.skipped.is_none() {
            summary += &format!(
                "<p class=\"{}\">{}</p>",
                if run.passed { "pass" } else { "fail" },
                if run.passed { "all checks passed" } else { "failed" }
            );
        }
        // step -> stage -> outcomes of golden checks
        let mut steps: BTreeMap<Step, BTreeMap<Stage, Vec<&Outcome>>> = BTreeMap::new();
        for o in run.outcomes.iter().filter(|o| o.is_golden() || o.is_references_agree()) {
            if let Some((step, stage)) = o.at {
                steps.entry(step).or_default().entry(stage).or_default().push(o);
            }
        }
        let mut sources: Vec<&str> = run
            .outcomes
            .iter()
            .filter(|o| o.is_golden() && !o.metrics.contains_key("ratio"))
            .map(|o| o.check.as_str())
            .collect();
        sources.sort();
        sources.dedup();
        let mut plots = Vec::new();
        for (step, stages) in &steps {
            let x_labels: Vec<String> = stages.keys().map(Stage::to_string).collect();
            let series = sources
                .iter()
                .enumerate()
                .map(|(k, src)| Series {
                    name: src.to_string(),
                    color: PALETTE[k % PALETTE.len()],
                    points: stages
                        .values()
                        .enumerate()
                        .filter_map(|(i, outs)| {
                            let o = outs.iter().find(|o| o.check == *src)?;
                            let v = o.metrics.get("max_abs")?;
                            Some((i, *v, o.status == Status::Fail))
                        })
                        .collect(),
                })
                .collect();
            // One dashed line only when every golden check of the step has the
            // same atol; per-stage allowances (a real model's spec) differ,
            // and a single line would misstate them.
            let atols: Vec<f64> = stages
                .values()
                .flatten()
                .filter(|o| o.is_golden())
                .filter_map(|o| o.metrics.get("atol").copied())
                .collect();
            let atol = atols.first().copied().filter(|a| atols.iter().all(|b| b == a));
            let highlight = stages.iter().enumerate().find_map(|(i, (_, outs))| {
                outs.iter()
                    .find(|o| o.first_divergence)
                    .map(|o| (i, format!("first divergence ({})", o.check)))
            });
            if !sources.is_empty() {
                plots.push(Plot {
                    title: format!("{step}: max |Δ| vs golden per stage"),
                    x_labels: x_labels.clone(),
                    series,
                    tolerance: atol.map(|a| (a, format!("atol {a:e} (allowed |Δ| where expected = 0)"))),
                    highlight: highlight.clone(),
                    y_desc: "max |Δ| (log)".into(),
                });
            }
            if let Some(p) = ratio_plot(*step, stages, x_labels, highlight) {
                plots.push(p);
            }
        }
        let mut failing: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.status == Status::Fail).collect();
        failing.sort_by_key(|o| !o.first_divergence);
        let details = failing
            .iter()
            .map(|o| {
                let tag = if o.first_divergence {
                    " [FIRST DIVERGENCE]".to_string()
                } else {
                    o.downstream_of
                        .as_ref()
                        .map(|d| format!(" [downstream of {d}]"))
                        .unwrap_or_default()
                };
                (
                    format!("{}{tag}", o.full_id()),
                    format!("{}\nrerun: {}", o.message, o.rerun),
                )
            })
            .collect();
        sections.push(Section {
            title: format!(
                "{} on engine {}, storage {} ({})",
                run.spec, run.engine, run.storage, run.spec_path
            ),
            summary_html: summary,
            plots,
            details,
        });
    }
    page("touchstone report", &header, &sections)
}
