//! The report as one self-contained HTML page: the markdown's sections as HTML tables, and
//! charts drawn as inline SVG by this code (hit rate by tier over time; whole-answer and
//! first-token latency percentiles over time with their `[slo]` targets). No script, no
//! external asset: the file can be mailed or archived as it is.

use std::fmt::Write as _;

use super::hist::Histogram;
use super::report::{format_time, Block};
use super::rollup::Rollup;
use crate::config::SloConfig;

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 260.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 40.0;

/// Text with `&`, `<`, `>` and quotes escaped.
pub fn escape(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            '\'' => s.push_str("&#39;"),
            c => s.push(c),
        }
    }
    s
}

/// The page: `blocks` in order, the charts over `series` where [`Block::Charts`] stands.
pub fn page(blocks: &[Block], series: &[(u64, Rollup)], slo: &SloConfig) -> String {
    let mut s = String::from(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>reprise report</title>\n<style>\n\
         body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}\n\
         table{border-collapse:collapse;margin:.5em 0 1.5em}\n\
         th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\n\
         th{background:#f4f4f4}\nsvg{display:block;margin:.5em 0 1.5em}\n\
         svg text{font:12px system-ui,sans-serif;fill:#333}\n</style>\n</head>\n<body>\n",
    );
    let mut first = true;
    for b in blocks {
        match b {
            Block::Heading(h) => {
                let tag = if first { "h1" } else { "h2" };
                first = false;
                let _ = writeln!(s, "<{tag}>{}</{tag}>", escape(h));
            }
            Block::Text(t) => {
                let _ = writeln!(s, "<p>{}</p>", code(&escape(t)));
            }
            Block::Items(items) => {
                s.push_str("<ul>\n");
                for i in items {
                    let _ = writeln!(s, "<li>{}</li>", code(&escape(i)));
                }
                s.push_str("</ul>\n");
            }
            Block::Table(_, rows) if rows.is_empty() => s.push_str("<p>None.</p>\n"),
            Block::Table(head, rows) => {
                s.push_str("<table>\n<tr>");
                for h in head {
                    let _ = write!(s, "<th>{}</th>", escape(h));
                }
                s.push_str("</tr>\n");
                for r in rows {
                    s.push_str("<tr>");
                    for c in r {
                        let _ = write!(s, "<td>{}</td>", escape(c));
                    }
                    s.push_str("</tr>\n");
                }
                s.push_str("</table>\n");
            }
            Block::Charts => {
                s.push_str(&charts(series, slo));
            }
        }
    }
    s.push_str("</body>\n</html>\n");
    s
}

/// Markdown's `code` spans as `<code>` (the text is escaped already).
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{part}</code>");
        } else {
            out.push_str(part);
        }
    }
    out
}

/// Every chart of the page.
pub fn charts(series: &[(u64, Rollup)], slo: &SloConfig) -> String {
    if series.is_empty() {
        return "<p>No requests in the window: no charts.</p>\n".into();
    }
    let mut s = String::new();
    s.push_str(&hit_rate_chart(series));
    s.push_str(&latency_chart(
        "Whole answer: latency percentiles (s)",
        series,
        |r| r.latency.both(),
        slo.total_secs,
    ));
    s.push_str(&latency_chart(
        "First token: latency percentiles (s)",
        series,
        |r| r.ttft.both(),
        slo.ttft_secs,
    ));
    s
}

/// x of the middle of interval `i` of `n`.
fn x_of(i: usize, n: usize) -> f64 {
    LEFT + (i as f64 + 0.5) * (WIDTH - LEFT - RIGHT) / n as f64
}

/// y of `v` on an axis from 0 to `max`.
fn y_of(v: f64, max: f64) -> f64 {
    let h = HEIGHT - TOP - BOTTOM;
    TOP + h - (v / max).clamp(0.0, 1.0) * h
}

/// The frame: title, y ticks with labels, time labels, legend.
fn frame(
    s: &mut String,
    title: &str,
    ticks: &[(f64, String)],
    max: f64,
    series: &[(u64, Rollup)],
    legend: &[(&str, &str)],
) {
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\" aria-label=\"{t}\">\n<title>{t}</title>\n\
         <text x=\"{LEFT}\" y=\"16\" font-weight=\"bold\">{t}</text>\n",
        t = escape(title)
    );
    for (v, label) in ticks {
        let y = y_of(*v, max);
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e4e4e4\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            escape(label)
        );
    }
    let n = series.len();
    let mut labelled = vec![(0, "start"), (n / 2, "middle"), (n - 1, "end")];
    labelled.dedup_by_key(|(i, _)| *i);
    for (i, anchor) in labelled {
        let text = format_time(series[i].0).replace('T', " ");
        let short = text.get(5..16).unwrap_or(&text).to_string();
        // The first and last labels stay inside the frame.
        let x = match anchor {
            "start" if n > 1 => LEFT,
            "end" => WIDTH - RIGHT,
            _ => x_of(i, n),
        };
        let anchor = if n == 1 { "middle" } else { anchor };
        let _ = writeln!(
            s,
            "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"{anchor}\">{}</text>",
            HEIGHT - BOTTOM + 18.0,
            escape(&short)
        );
    }
    let mut x = WIDTH - RIGHT - 110.0 * legend.len() as f64;
    for (name, color) in legend {
        let _ = writeln!(
            s,
            "<rect x=\"{x:.1}\" y=\"6\" width=\"10\" height=\"10\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"15\">{}</text>",
            x + 14.0,
            escape(name)
        );
        x += 110.0;
    }
}

/// Stacked bars: each interval's hits by tier as a share of its requests.
fn hit_rate_chart(series: &[(u64, Rollup)]) -> String {
    const TIERS: [(&str, &str); 4] = [
        ("memory", "#1f77b4"),
        ("redis", "#9467bd"),
        ("semantic", "#2ca02c"),
        ("prefetch", "#ff7f0e"),
    ];
    let mut s = String::new();
    let ticks: Vec<(f64, String)> = (0..=4)
        .map(|i| (i as f64 * 25.0, format!("{} %", i * 25)))
        .collect();
    frame(
        &mut s,
        "Hit rate by tier (% of requests)",
        &ticks,
        100.0,
        series,
        &TIERS,
    );
    let n = series.len();
    let bar = ((WIDTH - LEFT - RIGHT) / n as f64 * 0.8).max(0.5);
    for (i, (_, r)) in series.iter().enumerate() {
        if r.requests == 0 {
            continue;
        }
        let t = &r.by_tier;
        let mut base = 0.0;
        for ((name, color), count) in TIERS
            .iter()
            .zip([t.memory, t.redis, t.semantic, t.prefetch])
        {
            if count == 0 {
                continue;
            }
            let share = count as f64 * 100.0 / r.requests as f64;
            let (y_top, y_bottom) = (y_of(base + share, 100.0), y_of(base, 100.0));
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{y_top:.1}\" width=\"{bar:.1}\" height=\"{:.1}\" \
                 fill=\"{color}\"><title>{name}: {share:.1} %</title></rect>",
                x_of(i, n) - bar / 2.0,
                y_bottom - y_top
            );
            base += share;
        }
    }
    s.push_str("</svg>\n");
    s
}

/// The smallest of 1, 2, 2.5 or 5 times a power of ten that is at least `raw` (a tick step).
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|step| *step >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * power)
}

/// p50, p95 and p99 lines of `hist` per interval (gaps where an interval has no samples),
/// and the target as a dashed line.
fn latency_chart(
    title: &str,
    series: &[(u64, Rollup)],
    hist: impl Fn(&Rollup) -> Histogram,
    target: f64,
) -> String {
    const LINES: [(&str, f64, &str); 3] = [
        ("p50", 0.5, "#2ca02c"),
        ("p95", 0.95, "#ff7f0e"),
        ("p99", 0.99, "#d62728"),
    ];
    let hists: Vec<Histogram> = series.iter().map(|(_, r)| hist(r)).collect();
    let values: Vec<[Option<f64>; 3]> = hists
        .iter()
        .map(|h| LINES.map(|(_, q, _)| h.quantile_ms(q).map(|ms| ms / 1000.0)))
        .collect();
    let highest = values
        .iter()
        .flatten()
        .flatten()
        .fold(target, |a, b| a.max(*b));
    let step = nice_step(highest * 1.05 / 4.0);
    let max = step * 4.0;
    let ticks: Vec<(f64, String)> = (0..=4)
        .map(|i| {
            let v = step * i as f64;
            (v, format!("{}", (v * 1e6).round() / 1e6))
        })
        .collect();
    let mut legend: Vec<(&str, &str)> = LINES.iter().map(|(n, _, c)| (*n, *c)).collect();
    legend.push(("target", "#555"));
    let mut s = String::new();
    frame(&mut s, title, &ticks, max, series, &legend);
    let y = y_of(target, max);
    let _ = writeln!(
        s,
        "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#555\" \
         stroke-dasharray=\"6 4\"><title>target (p95): {target} s</title></line>",
        WIDTH - RIGHT
    );
    let n = series.len();
    for (k, (name, _, color)) in LINES.iter().enumerate() {
        // Runs of intervals with samples, each one polyline (a lone point: a dot).
        let mut run: Vec<(f64, f64)> = Vec::new();
        let flush = |run: &mut Vec<(f64, f64)>, s: &mut String| {
            match run.as_slice() {
                [] => {}
                [(x, y)] => {
                    let _ = writeln!(
                        s,
                        "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.5\" fill=\"{color}\"><title>{name}</title></circle>"
                    );
                }
                points => {
                    let pts: Vec<String> = points
                        .iter()
                        .map(|(x, y)| format!("{x:.1},{y:.1}"))
                        .collect();
                    let _ = writeln!(
                        s,
                        "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" \
                         stroke-width=\"1.5\"><title>{name}</title></polyline>",
                        pts.join(" ")
                    );
                }
            }
            run.clear();
        };
        for (i, v) in values.iter().enumerate() {
            match v[k] {
                Some(v) => run.push((x_of(i, n), y_of(v, max))),
                None => flush(&mut run, &mut s),
            }
        }
        flush(&mut run, &mut s);
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reqlog::LogRecord;

    #[test]
    fn tick_steps_are_round() {
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(0.21), 0.25);
        assert_eq!(nice_step(0.0004), 0.0005);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn the_page_escapes_text_and_draws_charts() {
        let mut r = Rollup::default();
        for (outcome, tier, ms) in [
            ("exact", Some("memory"), 1.0),
            ("miss", None, 900.0),
            ("semantic", None, 5.0),
        ] {
            r.add(&LogRecord {
                outcome,
                tier,
                total_ms: ms,
                ttft_ms: Some(ms / 2.0),
                ..Default::default()
            });
        }
        let series = vec![(0, r.clone()), (60_000, Rollup::default()), (120_000, r)];
        let blocks = vec![
            Block::Heading("reprise report".into()),
            Block::Text("a `code` <b>".into()),
            Block::Table(vec!["q"], vec![vec!["<script>alert(1)</script>".into()]]),
            Block::Charts,
        ];
        let html = page(&blocks, &series, &SloConfig::default());
        assert!(html.starts_with("<!doctype html>"));
        assert_eq!(html.matches("<svg").count(), 3);
        assert!(html.contains("<code>code</code> &lt;b&gt;"));
        assert!(!html.contains("<script>"));
        assert!(html.contains("stroke-dasharray"), "the target line");
        assert!(html.contains("<polyline") || html.contains("<circle"));
        assert!(
            !html.contains("src=") && !html.contains("href="),
            "no external asset"
        );
    }
}
