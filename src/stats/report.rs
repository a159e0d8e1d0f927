//! `reprise report --log FILE`: the request log folded into [`Rollup`]s by interval and
//! summed up as markdown (stdout) or a self-contained HTML page with SVG charts
//! ([`super::html`]).
//!
//! Each JSON line of the log is one request (verdict lines, `outcome: "feedback"`, are
//! counted apart); lines that do not parse are skipped and counted. A request counts in the
//! interval it ended in (`time_ms + total_ms`), as the live stats count it, and
//! `--since`/`--until` select by that time too. With `--rotated`, the files `FILE.1`,
//! `FILE.2`, ... that log rotation left beside `FILE` are read too (uncompressed ones; the
//! first missing number ends the list). Per-interval rollups keep counts only; the question
//! lists are kept once, for the whole window, so memory stays bounded by the number of
//! intervals (at most [`MAX_INTERVALS`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::Deserialize;

use super::hist::Histogram;
use super::rollup::{Facts, Rollup};
use crate::config::SloConfig;
use crate::metrics::RequestMetrics;

/// Intervals a report may span (empty ones included): past it, a larger `--interval-secs` or
/// a narrower `--since`/`--until` is asked for.
pub const MAX_INTERVALS: u64 = 10_000;
/// Progress is written to stderr every this many lines.
const PROGRESS_EVERY: u64 = 100_000;

/// What to read and how to sum it up.
#[derive(Debug, Clone)]
pub struct Options {
    /// The request log.
    pub log: PathBuf,
    /// Also read `LOG.1`, `LOG.2`, ...
    pub rotated: bool,
    /// Interval length, seconds.
    pub interval_secs: u64,
    /// Only requests that ended at or after this time (ms since the epoch).
    pub since_ms: Option<u64>,
    /// Only requests that ended before this time (ms since the epoch).
    pub until_ms: Option<u64>,
    /// Only this tenant's requests (`anonymous`: those without a tenant).
    pub tenant: Option<String>,
    /// The latency targets compared against.
    pub slo: SloConfig,
    /// The currency of the costs saved.
    pub currency: Option<String>,
}

/// One line of the request log, as far as a report reads it (other fields are ignored).
#[derive(Debug, Deserialize)]
struct Line {
    time_ms: u64,
    #[serde(default)]
    tenant: String,
    outcome: String,
    tier: Option<String>,
    similarity: Option<f32>,
    entry_id: Option<String>,
    gate: Option<String>,
    ttft_ms: Option<f64>,
    #[serde(default)]
    total_ms: f64,
    #[serde(default)]
    saved_prompt_tokens: u64,
    #[serde(default)]
    saved_completion_tokens: u64,
    #[serde(default)]
    saved_backend_ms: u64,
    #[serde(default)]
    saved_cost: f64,
    question: Option<String>,
    matched: Option<String>,
}

impl Line {
    fn facts(&self) -> Facts<'_> {
        Facts {
            tenant: &self.tenant,
            outcome: &self.outcome,
            tier: self.tier.as_deref(),
            similarity: self.similarity,
            entry_id: self.entry_id.as_deref(),
            gate: self.gate.as_deref(),
            ttft_ms: self.ttft_ms,
            total_ms: self.total_ms,
            saved_prompt_tokens: self.saved_prompt_tokens,
            saved_completion_tokens: self.saved_completion_tokens,
            saved_backend_ms: self.saved_backend_ms,
            saved_cost: self.saved_cost,
            question: self.question.as_deref(),
            matched: self.matched.as_deref(),
        }
    }

    fn end_ms(&self) -> u64 {
        let total = if self.total_ms.is_finite() {
            self.total_ms.max(0.0)
        } else {
            0.0
        };
        self.time_ms.saturating_add(total as u64)
    }
}

/// The log folded into rollups.
#[derive(Debug, Default)]
pub struct Report {
    /// Files read, in order.
    pub files: Vec<PathBuf>,
    /// Interval length, milliseconds.
    pub interval_ms: u64,
    /// Rollups by interval start (counts only, no question lists).
    pub intervals: BTreeMap<u64, Rollup>,
    /// The whole window, question lists included.
    pub total: Rollup,
    /// Lines read.
    pub lines: u64,
    /// Verdict lines (`outcome: "feedback"`).
    pub verdicts: u64,
    /// Lines that are not a log line (not JSON, or without its fields), or of an unknown
    /// outcome.
    pub skipped: u64,
    /// Requests outside `--since`/`--until`/`--tenant`.
    pub filtered: u64,
    /// Requests fell in more intervals than [`MAX_INTERVALS`]: those beyond were not kept.
    pub too_many: bool,
}

impl Report {
    /// An empty report of intervals of `interval_secs`.
    pub fn new(interval_secs: u64) -> Report {
        Report {
            interval_ms: interval_secs.max(1) * 1000,
            ..Default::default()
        }
    }

    /// Counts one line of the log.
    pub fn add_line(&mut self, text: &str, opts: &Options) {
        self.lines += 1;
        let Ok(line) = serde_json::from_str::<Line>(text) else {
            self.skipped += 1;
            return;
        };
        if line.outcome == "feedback" {
            self.verdicts += 1;
            return;
        }
        let end = line.end_ms();
        let tenant = RequestMetrics::tenant_label(&line.tenant);
        if opts.since_ms.is_some_and(|s| end < s)
            || opts.until_ms.is_some_and(|u| end >= u)
            || opts.tenant.as_deref().is_some_and(|t| t != tenant)
        {
            self.filtered += 1;
            return;
        }
        let facts = line.facts();
        if !self.total.add_facts(&facts) {
            self.skipped += 1;
            return;
        }
        let start = end - end % self.interval_ms;
        if self.intervals.len() >= MAX_INTERVALS as usize && !self.intervals.contains_key(&start) {
            // More intervals than a report shows (`series` says so): not held.
            self.too_many = true;
            return;
        }
        let counts_only = Facts {
            question: None,
            matched: None,
            ..facts
        };
        self.intervals
            .entry(start)
            .or_default()
            .add_facts(&counts_only);
    }

    /// Reads every line of `reader` (`progress` is called every 100k lines with the count so
    /// far).
    pub fn read(
        &mut self,
        reader: impl BufRead,
        opts: &Options,
        progress: &mut dyn FnMut(u64),
    ) -> std::io::Result<()> {
        let mut reader = reader;
        let mut buf = Vec::new();
        let cap = crate::tune::log::MAX_LINE_BYTES;
        while let Some(whole) = crate::lines::next_line(&mut reader, &mut buf, cap)? {
            match std::str::from_utf8(&buf) {
                Ok(text) if whole && text.trim().is_empty() => continue,
                Ok(text) if whole => self.add_line(text, opts),
                // Not UTF-8, or longer than any line the log writes: damage.
                _ => {
                    self.lines += 1;
                    self.skipped += 1;
                }
            }
            if self.lines.is_multiple_of(PROGRESS_EVERY) {
                progress(self.lines);
            }
        }
        Ok(())
    }

    /// Every interval from the first to the last with requests, empty ones as zeros.
    pub fn series(&self) -> anyhow::Result<Vec<(u64, Rollup)>> {
        let (Some(first), Some(last)) = (
            self.intervals.keys().next().copied(),
            self.intervals.keys().last().copied(),
        ) else {
            return Ok(Vec::new());
        };
        let n = (last - first) / self.interval_ms + 1;
        let span = match self.too_many {
            true => format!("more than {MAX_INTERVALS}"),
            false => n.to_string(),
        };
        anyhow::ensure!(
            n <= MAX_INTERVALS && !self.too_many,
            "the requests span {span} intervals of {} s; at most {MAX_INTERVALS}: pass a \
             larger --interval-secs or a narrower --since/--until",
            self.interval_ms / 1000
        );
        Ok((0..n)
            .map(|i| {
                let start = first + i * self.interval_ms;
                (
                    start,
                    self.intervals.get(&start).cloned().unwrap_or_default(),
                )
            })
            .collect())
    }
}

/// The log file and, with `rotated`, `FILE.1`, `FILE.2`, ... up to the first missing one.
pub fn files(log: &Path, rotated: bool) -> Vec<PathBuf> {
    let mut out = vec![log.to_path_buf()];
    if rotated {
        for n in 1.. {
            let mut name = log.as_os_str().to_owned();
            name.push(format!(".{n}"));
            let p = PathBuf::from(name);
            if !p.is_file() {
                break;
            }
            out.push(p);
        }
    }
    out
}

/// Reads the log (and its rotated files) into a report, with progress on stderr.
pub fn fold(opts: &Options) -> anyhow::Result<Report> {
    let mut report = Report::new(opts.interval_secs);
    // Every file is opened before any is read: a live log that rotates meanwhile renames
    // what the handles point at, so no file is read twice (as `FILE`, then as `FILE.1`).
    let mut opened = Vec::new();
    for path in files(&opts.log, opts.rotated) {
        let file = std::fs::File::open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        opened.push((path, file));
    }
    for (path, file) in opened {
        let mut progress = |n: u64| eprintln!("{n} lines read ({})", path.display());
        report
            .read(std::io::BufReader::new(file), opts, &mut progress)
            .with_context(|| format!("cannot read {}", path.display()))?;
        report.files.push(path);
    }
    Ok(report)
}

/// Reads the log, prints the markdown summary on stdout and, with `html`, writes the HTML
/// page there.
pub fn run(opts: &Options, html: Option<&Path>) -> anyhow::Result<()> {
    let report = fold(opts)?;
    let blocks = blocks(&report, opts)?;
    print!("{}", markdown(&blocks));
    if let Some(path) = html {
        let page = super::html::page(&blocks, &report.series()?, &opts.slo);
        std::fs::write(path, page).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// A time given as milliseconds since the epoch or RFC 3339 (`2026-01-31T12:00:00Z`).
pub fn parse_time(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|e| format!("`{text}`: {e}"));
    }
    let ts: jiff::Timestamp = text
        .parse()
        .map_err(|e| format!("`{text}` is neither epoch milliseconds nor RFC 3339: {e}"))?;
    u64::try_from(ts.as_millisecond()).map_err(|_| format!("`{text}` is before 1970"))
}

/// A time as RFC 3339 in UTC, to the second.
pub fn format_time(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(|| ms.to_string(), |t| format!("{t:.0}"))
}

/// A piece of the report, written as markdown or HTML.
#[derive(Debug, Clone)]
pub enum Block {
    /// A section title.
    Heading(String),
    /// A paragraph.
    Text(String),
    /// A bullet list.
    Items(Vec<String>),
    /// A table: its header, its rows.
    Table(Vec<&'static str>, Vec<Vec<String>>),
    /// Where the HTML page draws its charts (nothing in markdown).
    Charts,
}

/// `part / whole` as a percentage with one decimal, `–` when `whole` is 0.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "–".into()
    } else {
        format!("{:.1} %", part as f64 * 100.0 / whole as f64)
    }
}

/// A quantile of `h` in seconds, to the millisecond, `–` without samples.
fn secs(h: &Histogram, q: f64) -> String {
    h.quantile_ms(q)
        .map_or_else(|| "–".into(), |ms| format!("{:.3}", ms / 1000.0))
}

/// The report's content, in order.
pub fn blocks(report: &Report, opts: &Options) -> anyhow::Result<Vec<Block>> {
    let t = &report.total;
    let o = &t.by_outcome;
    let mut out = vec![Block::Heading("reprise report".into())];
    let files: Vec<String> = report
        .files
        .iter()
        .map(|p| format!("`{}`", p.display()))
        .collect();
    let series = report.series()?;
    let from = opts.since_ms.or(series.first().map(|(s, _)| *s));
    let to = opts.until_ms.or(series
        .last()
        .map(|(s, _)| s.saturating_add(report.interval_ms)));
    let window = format!(
        "{} to {}",
        from.map_or_else(|| "the start".into(), format_time),
        to.map_or_else(|| "the end".into(), format_time),
    );
    out.push(Block::Items(vec![
        format!(
            "Log: {} ({} lines: {} requests counted, {} verdict lines, {} lines skipped as \
             unreadable, {} requests outside the filters)",
            files.join(", "),
            report.lines,
            t.requests,
            report.verdicts,
            report.skipped,
            report.filtered
        ),
        format!(
            "Window: {window} (UTC; requests count when they ended), intervals of {} s",
            report.interval_ms / 1000
        ),
        format!(
            "Tenant: {}",
            opts.tenant.as_deref().unwrap_or("all tenants")
        ),
    ]));

    out.push(Block::Heading("Requests".into()));
    out.push(Block::Table(
        vec![
            "requests",
            "hits",
            "hit rate",
            "exact (memory)",
            "exact (redis)",
            "semantic",
            "prefetch",
            "miss",
            "bypass",
            "error",
        ],
        vec![vec![
            t.requests.to_string(),
            o.hits().to_string(),
            percent(o.hits(), t.requests),
            t.by_tier.memory.to_string(),
            t.by_tier.redis.to_string(),
            t.by_tier.semantic.to_string(),
            t.by_tier.prefetch.to_string(),
            o.miss.to_string(),
            o.bypass.to_string(),
            o.error.to_string(),
        ]],
    ));
    out.push(Block::Charts);

    out.push(Block::Heading("Latency".into()));
    out.push(Block::Text(format!(
        "Seconds. Targets (`[slo]`, as the 95th percentile): whole answer {} s, first token {} s. \
         Percentiles are read from histogram buckets (within 26.3 % of the true value).",
        opts.slo.total_secs, opts.slo.ttft_secs
    )));
    let row = |name: &str, h: &Histogram, target: f64| {
        let p95 = h.quantile_ms(0.95).map(|ms| ms / 1000.0);
        vec![
            name.to_string(),
            h.count().to_string(),
            secs(h, 0.5),
            secs(h, 0.95),
            secs(h, 0.99),
            target.to_string(),
            p95.map_or_else(
                || "–".into(),
                |p| if p <= target { "yes" } else { "no" }.to_string(),
            ),
        ]
    };
    out.push(Block::Table(
        vec!["", "count", "p50", "p95", "p99", "target", "p95 within"],
        vec![
            row("whole answer, hits", &t.latency.hit, opts.slo.total_secs),
            row("whole answer, misses", &t.latency.miss, opts.slo.total_secs),
            row("first token, hits", &t.ttft.hit, opts.slo.ttft_secs),
            row("first token, misses", &t.ttft.miss, opts.slo.ttft_secs),
        ],
    ));

    out.push(Block::Heading("Savings".into()));
    let currency = opts.currency.as_deref().unwrap_or("");
    out.push(Block::Table(
        vec![
            "prompt tokens",
            "completion tokens",
            "backend seconds",
            "cost",
        ],
        vec![vec![
            t.saved.prompt_tokens.to_string(),
            t.saved.completion_tokens.to_string(),
            format!("{:.1}", t.saved.backend_seconds),
            format!("{:.4} {currency}", t.saved.cost)
                .trim_end()
                .to_string(),
        ]],
    ));
    out.push(Block::Text(format!(
        "Prefetch: {} requests served from prefetched entries ({} of the hits). The log does \
         not record background generations: `GET /admin/stats` counts those completed and \
         wasted.",
        o.prefetch,
        percent(o.prefetch, o.hits())
    )));

    out.push(Block::Heading("Top missed questions".into()));
    out.push(Block::Table(
        vec!["question", "count", "at least", "best similarity"],
        t.top_missed
            .sorted()
            .iter()
            .map(|c| {
                vec![
                    c.key.clone(),
                    c.count.to_string(),
                    (c.count - c.error).to_string(),
                    c.detail.0.map_or_else(|| "–".into(), |s| format!("{s:.3}")),
                ]
            })
            .collect(),
    ));
    out.push(Block::Heading("Top semantic pairs".into()));
    out.push(Block::Table(
        vec![
            "question",
            "served the answer to",
            "similarity",
            "count",
            "at least",
        ],
        t.top_pairs
            .sorted()
            .iter()
            .map(|c| {
                vec![
                    c.key.0.clone(),
                    c.key.1.clone(),
                    format!("{:.3}", c.detail.similarity),
                    c.count.to_string(),
                    (c.count - c.error).to_string(),
                ]
            })
            .collect(),
    ));
    out.push(Block::Text(
        "Both lists come from a bounded summary (Space-Saving, 50 counters): with many \
         distinct questions a count may exceed the truth, which is between `at least` and \
         `count`."
            .into(),
    ));
    out.push(Block::Heading("Gate rejections".into()));
    out.push(Block::Table(
        vec!["reason", "count"],
        t.gate_rejections
            .iter()
            .map(|(r, n)| vec![r.clone(), n.to_string()])
            .collect(),
    ));

    out.push(Block::Heading("By interval".into()));
    out.push(Block::Table(
        vec![
            "start (UTC)",
            "requests",
            "hit rate",
            "exact",
            "semantic",
            "prefetch",
            "p95 whole (s)",
            "p95 first token (s)",
        ],
        series
            .iter()
            .filter(|(_, r)| r.requests > 0)
            .map(|(start, r)| {
                vec![
                    format_time(*start),
                    r.requests.to_string(),
                    percent(r.by_outcome.hits(), r.requests),
                    r.by_outcome.exact.to_string(),
                    r.by_outcome.semantic.to_string(),
                    r.by_outcome.prefetch.to_string(),
                    secs(&r.latency.both(), 0.95),
                    secs(&r.ttft.both(), 0.95),
                ]
            })
            .collect(),
    ));
    Ok(out)
}

/// A table cell's text for markdown: one line, pipes escaped.
fn md_cell(text: &str) -> String {
    text.replace(['\n', '\r'], " ").replace('|', "\\|")
}

/// The report as markdown.
pub fn markdown(blocks: &[Block]) -> String {
    let mut s = String::new();
    for b in blocks {
        match b {
            Block::Heading(h) if s.is_empty() => {
                let _ = writeln!(s, "# {h}\n");
            }
            Block::Heading(h) => {
                let _ = writeln!(s, "## {h}\n");
            }
            Block::Text(t) => {
                let _ = writeln!(s, "{t}\n");
            }
            Block::Items(items) => {
                for i in items {
                    let _ = writeln!(s, "- {i}");
                }
                s.push('\n');
            }
            Block::Table(_, rows) if rows.is_empty() => s.push_str("None.\n\n"),
            Block::Table(head, rows) => {
                let _ = writeln!(s, "| {} |", head.join(" | "));
                let _ = writeln!(
                    s,
                    "|{}|",
                    head.iter().map(|_| "---").collect::<Vec<_>>().join("|")
                );
                for r in rows {
                    let cells: Vec<String> = r.iter().map(|c| md_cell(c)).collect();
                    let _ = writeln!(s, "| {} |", cells.join(" | "));
                }
                s.push('\n');
            }
            Block::Charts => {}
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> Options {
        Options {
            log: PathBuf::from("log"),
            rotated: false,
            interval_secs: 60,
            since_ms: None,
            until_ms: None,
            tenant: None,
            slo: SloConfig::default(),
            currency: Some("USD".into()),
        }
    }

    #[test]
    fn times_parse_as_epoch_ms_or_rfc_3339() {
        assert_eq!(parse_time("1700000000000"), Ok(1_700_000_000_000));
        assert_eq!(parse_time("1970-01-01T00:00:01Z"), Ok(1000));
        assert_eq!(
            parse_time("2026-01-31T12:00:00+01:00"),
            parse_time("2026-01-31T11:00:00Z")
        );
        assert!(parse_time("yesterday").is_err());
        assert_eq!(format_time(1000), "1970-01-01T00:00:01Z");
    }

    #[test]
    fn lines_fold_by_the_interval_they_ended_in_and_bad_ones_are_counted() {
        let mut r = Report::new(60);
        let text = [
            r#"{"time_ms":59000,"outcome":"miss","total_ms":2000,"question":"q"}"#,
            r#"{"time_ms":1000,"outcome":"exact","tier":"redis","total_ms":1}"#,
            r#"{"time_ms":1000,"outcome":"feedback","verdict":"wrong"}"#,
            "not json",
            r#"{"time_ms":1000,"outcome":"bogus"}"#,
            "",
        ]
        .join("\n");
        let mut calls = 0;
        r.read(text.as_bytes(), &opts(), &mut |_| calls += 1)
            .unwrap();
        assert_eq!((r.lines, r.verdicts, r.skipped), (5, 1, 2));
        assert_eq!(r.total.requests, 2);
        let starts: Vec<u64> = r.intervals.keys().copied().collect();
        assert_eq!(starts, [0, 60_000]);
        assert_eq!(r.total.by_tier.redis, 1);
        assert!(r.intervals[&60_000].top_missed.is_empty(), "counts only");
        assert_eq!(r.total.top_missed.sorted()[0].key, "q");
        assert_eq!(calls, 0);
    }

    #[test]
    fn markdown_tables_escape_their_cells() {
        let md = markdown(&[
            Block::Heading("t".into()),
            Block::Table(vec!["a"], vec![vec!["x | y\nz".into()]]),
            Block::Table(vec!["b"], vec![]),
        ]);
        assert!(md.contains("| x \\| y z |"), "{md}");
        assert!(md.contains("None."), "{md}");
    }
}
