//! The request log as `reprise tune --log` reads it: requests with their best candidate's
//! similarity and gate verdict, and verdict lines (`"outcome": "feedback"`) joined to the hits
//! they judge by the response id.
//!
//! Read leniently into a struct of its own (not the writer's record): unknown fields are
//! ignored, missing ones default, and a line that is not such a JSON object is skipped and
//! counted, so logs written by other versions still read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::curve::LogSample;

/// The fields of a log line that tuning reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Line {
    time_ms: Option<u64>,
    tenant: Option<String>,
    outcome: Option<String>,
    id: Option<String>,
    similarity: Option<f32>,
    threshold: Option<f32>,
    gate: Option<String>,
    verdict: Option<String>,
}

/// Which requests to read.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this tenant's (`Some("")`: the anonymous tenant's); all when `None`.
    pub tenant: Option<String>,
    /// Requests at or after this time (ms since the Unix epoch).
    pub since_ms: Option<u64>,
    /// Requests before this time (ms since the Unix epoch).
    pub until_ms: Option<u64>,
}

impl Filter {
    fn keeps(&self, l: &Line) -> bool {
        let tenant = l.tenant.as_deref().unwrap_or("");
        self.tenant.as_deref().is_none_or(|t| t == tenant)
            && self
                .since_ms
                .is_none_or(|s| l.time_ms.is_some_and(|t| t >= s))
            && self
                .until_ms
                .is_none_or(|u| l.time_ms.is_some_and(|t| t < u))
    }
}

/// What was read, for the curve and for the summary the operator sees.
#[derive(Debug, Default)]
pub struct LogData {
    /// Requests with a semantic candidate, in the filter.
    pub samples: Vec<LogSample>,
    /// Lines read.
    pub lines: usize,
    /// Lines skipped as unreadable.
    pub unreadable: usize,
    /// Requests in the filter (with or without a candidate).
    pub requests: usize,
    /// Semantic hits served in the filter.
    pub served: usize,
    /// Lowest and highest threshold the hits were served at.
    pub served_at: Option<(f32, f32)>,
    /// Verdicts read (log and verdict file), any request's.
    pub verdicts: usize,
    /// Served hits with a verdict.
    pub judged: usize,
}

/// `"wrong"` → `Some(true)`, `"right"` → `Some(false)`, anything else `None`.
fn verdict(v: Option<&str>) -> Option<bool> {
    match v {
        Some("wrong") => Some(true),
        Some("right") => Some(false),
        _ => None,
    }
}

/// Reads the log files `logs`, oldest first (the rotated ones, then the live one), and the
/// extra verdicts (JSON lines of `{id, verdict}`): every request in `filter` that had a
/// similarity becomes a sample, its verdict joined by id when it was served a semantic hit
/// (the last verdict on an id counts), whichever file either is in. Verdicts are taken
/// whatever their time: a verdict given after `until` may judge a request before it. Every
/// file is opened before any is read: a live log that rotates meanwhile renames what the
/// handles point at, so none is read twice.
pub fn read(logs: &[PathBuf], verdicts: Option<&Path>, filter: &Filter) -> anyhow::Result<LogData> {
    let opened = logs
        .iter()
        .map(|p| open(p).map(|f| (p.as_path(), f)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut data = LogData::default();
    // Requests with a candidate, and the served ones' ids, until the verdicts are known.
    let mut found: Vec<(LogSample, Option<String>)> = Vec::new();
    let mut judged: HashMap<String, bool> = HashMap::new();
    let mut verdict_count = 0;
    let mut take_verdict = |l: &Line| {
        if let (Some(id), Some(wrong)) = (&l.id, verdict(l.verdict.as_deref())) {
            verdict_count += 1;
            judged.insert(id.clone(), wrong);
        }
    };
    let (mut requests, mut served_at) = (0, None::<(f32, f32)>);
    let mut each = |l: Line| {
        if l.outcome.as_deref() == Some("feedback") {
            take_verdict(&l);
            return;
        }
        if !filter.keeps(&l) {
            return;
        }
        requests += 1;
        let Some(similarity) = l.similarity.filter(|s| s.is_finite()) else {
            return;
        };
        let served = matches!(l.outcome.as_deref(), Some("semantic" | "prefetch"));
        if let Some(t) = l.threshold.filter(|_| served) {
            let (lo, hi) = served_at.unwrap_or((t, t));
            served_at = Some((lo.min(t), hi.max(t)));
        }
        // The gate runs only above the threshold a request was served at: below it there is
        // no verdict, and the candidate counts as passing.
        let gate = served || l.gate.as_deref().is_none_or(|g| g == "pass");
        let sample = LogSample {
            similarity,
            gate,
            served,
            threshold: l.threshold.filter(|t| t.is_finite()),
            wrong: None,
        };
        found.push((sample, l.id.filter(|_| served)));
    };
    for (path, file) in opened {
        read_lines(path, file, &mut data, &mut each)?;
    }
    if let Some(path) = verdicts {
        read_lines(path, open(path)?, &mut data, |l| take_verdict(&l))?;
    }
    (data.requests, data.served_at, data.verdicts) = (requests, served_at, verdict_count);
    for (mut sample, id) in found {
        sample.wrong = id.and_then(|id| judged.get(&id).copied());
        data.served += usize::from(sample.served);
        data.judged += usize::from(sample.wrong.is_some());
        data.samples.push(sample);
    }
    Ok(data)
}

/// Opens a file to read.
fn open(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::File::open(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))
}

/// Calls `each` with every readable line of `file` (opened from `path`), counting lines and
/// unreadable ones.
fn read_lines(
    path: &Path,
    file: std::fs::File,
    data: &mut LogData,
    mut each: impl FnMut(Line),
) -> anyhow::Result<()> {
    let cannot = |e: std::io::Error| anyhow::anyhow!("cannot read {}: {e}", path.display());
    let mut reader = std::io::BufReader::new(file);
    let mut buf = Vec::new();
    while let Some(whole) =
        crate::lines::next_line(&mut reader, &mut buf, MAX_LINE_BYTES).map_err(cannot)?
    {
        // A line that is not UTF-8 (cut by a full disk, say), or longer than any line the
        // log writes, is unreadable, like one that is not JSON: counted and skipped.
        let line = match whole {
            true => std::str::from_utf8(&buf).unwrap_or("\u{fffd}"),
            false => "\u{fffd}",
        };
        if line.trim().is_empty() {
            continue;
        }
        data.lines += 1;
        match serde_json::from_str::<Line>(line) {
            Ok(l) => each(l),
            Err(_) => data.unreadable += 1,
        }
    }
    Ok(())
}

/// Longest request log line read: the log cuts its texts (`log.question_chars`, at most
/// 4,096 characters), so its lines are far shorter; a longer one is damage.
pub const MAX_LINE_BYTES: u64 = 1 << 20;

/// A time on the command line: milliseconds since the Unix epoch, or an RFC 3339 timestamp
/// (`2025-06-01T00:00:00Z`, `2025-06-01T02:00:00+02:00`).
pub fn parse_time(s: &str) -> Result<u64, String> {
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(ms);
    }
    let t: jiff::Timestamp = s
        .parse()
        .map_err(|e| format!("`{s}` is neither ms since the epoch nor RFC 3339: {e}"))?;
    u64::try_from(t.as_millisecond()).map_err(|_| format!("`{s}` is before 1970"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tune::curve::{choose, log_curve};

    #[test]
    fn times_in_both_forms() {
        assert_eq!(parse_time("1700000000000"), Ok(1_700_000_000_000));
        assert_eq!(parse_time("1970-01-01T00:00:01Z"), Ok(1000));
        assert_eq!(parse_time("1970-01-01T02:00:01+02:00"), Ok(1000));
        assert!(parse_time("yesterday").is_err());
    }

    /// A log of one tenant's traffic and another's, with verdicts in the log and in a file.
    fn fixture(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let log = dir.join("requests.jsonl");
        let mut lines = vec![
            // acme: four hits served at 0.90, judged right, wrong, none, right.
            r#"{"time_ms":1000,"tenant":"acme","outcome":"semantic","id":"c-1","similarity":0.97,"threshold":0.9,"gate":"pass","total_ms":1.0}"#.to_string(),
            r#"{"time_ms":1001,"tenant":"acme","outcome":"semantic","id":"c-2","similarity":0.93,"threshold":0.9,"gate":"pass"}"#.into(),
            r#"{"time_ms":1002,"tenant":"acme","outcome":"prefetch","id":"c-3","similarity":0.91,"threshold":0.9,"gate":"pass"}"#.into(),
            r#"{"time_ms":1003,"tenant":"acme","outcome":"semantic","id":"c-4","similarity":0.90,"threshold":0.9,"gate":"pass","new_field":[1,2]}"#.into(),
            // Misses: a gate rejection, one below the threshold, one far below.
            r#"{"time_ms":1004,"tenant":"acme","outcome":"miss","id":"c-5","similarity":0.88,"threshold":0.9,"gate":"negation"}"#.into(),
            r#"{"time_ms":1005,"tenant":"acme","outcome":"miss","id":"c-6","similarity":0.80,"threshold":0.9}"#.into(),
            r#"{"time_ms":1006,"tenant":"acme","outcome":"miss","id":"c-7","similarity":0.5,"threshold":0.9}"#.into(),
            // Without a candidate, and an exact hit: requests, not samples.
            r#"{"time_ms":1007,"tenant":"acme","outcome":"miss","id":"c-8"}"#.into(),
            r#"{"time_ms":1008,"tenant":"acme","outcome":"exact","id":"c-9"}"#.into(),
            // The anonymous tenant: one hit judged wrong, outside acme's figures.
            r#"{"time_ms":1009,"outcome":"semantic","id":"c-10","similarity":0.99,"threshold":0.86,"gate":"pass"}"#.into(),
            // Verdicts; the later one on c-4 replaces the earlier.
            r#"{"time_ms":2000,"tenant":"acme","outcome":"feedback","id":"c-1","verdict":"right"}"#.into(),
            r#"{"time_ms":2001,"tenant":"acme","outcome":"feedback","id":"c-4","verdict":"wrong"}"#.into(),
            r#"{"time_ms":2002,"tenant":"acme","outcome":"feedback","id":"c-4","verdict":"right"}"#.into(),
            r#"{"time_ms":2003,"outcome":"feedback","id":"c-10","verdict":"wrong"}"#.into(),
            "not json".into(),
        ];
        lines.push(String::new());
        let mut bytes = lines.join("\n").into_bytes();
        // A line cut mid-character (a full disk): unreadable, not the end of the run.
        bytes.extend_from_slice(b"{\"time_ms\":3000,\"outcome\":\"mi\xc3\n");
        std::fs::write(&log, bytes).unwrap();
        let verdicts = dir.join("verdicts.jsonl");
        std::fs::write(
            &verdicts,
            "{\"id\":\"c-2\",\"verdict\":\"wrong\"}\n{\"id\":\"c-6\",\"verdict\":\"maybe\"}\n",
        )
        .unwrap();
        (log, verdicts)
    }

    /// A log split by rotation reads as the whole one: requests in the rotated file are
    /// judged by verdicts in the live one.
    #[test]
    fn a_rotated_log_reads_as_the_whole_one() {
        let dir = tempfile::tempdir().unwrap();
        let (log, verdicts) = fixture(dir.path());
        let whole = read(
            std::slice::from_ref(&log),
            Some(&verdicts),
            &Filter::default(),
        )
        .unwrap();
        let text = std::fs::read(&log).unwrap();
        let cut = text.iter().position(|&b| b == b'\n').unwrap() + 1;
        let cut = cut + text[cut..].iter().position(|&b| b == b'\n').unwrap() + 1;
        let older = dir.path().join("requests.jsonl.1");
        std::fs::write(&older, &text[..cut]).unwrap();
        std::fs::write(&log, &text[cut..]).unwrap();
        let split = read(&[older, log], Some(&verdicts), &Filter::default()).unwrap();
        assert_eq!(
            (split.lines, split.requests, split.served, split.judged),
            (whole.lines, whole.requests, whole.served, whole.judged)
        );
        assert_eq!(split.samples.len(), whole.samples.len());
    }

    #[test]
    fn reads_requests_and_joins_verdicts() {
        let dir = tempfile::tempdir().unwrap();
        let (log, verdicts) = fixture(dir.path());
        let acme = Filter {
            tenant: Some("acme".into()),
            ..Filter::default()
        };
        let d = read(std::slice::from_ref(&log), Some(&verdicts), &acme).unwrap();
        assert_eq!((d.lines, d.unreadable), (18, 2));
        assert_eq!((d.requests, d.samples.len()), (9, 7));
        assert_eq!((d.served, d.judged, d.verdicts), (4, 3, 5));
        assert_eq!(d.served_at, Some((0.9, 0.9)));
        let c = log_curve(&d.samples);
        let at = |t: f32| *c.iter().find(|p| (p.threshold - t).abs() < 1e-6).unwrap();
        // 0.90: c-1..c-4 hit (4 of 7), judged c-1 right, c-2 wrong, c-4 right.
        let p = at(0.90);
        assert_eq!((p.eligible, p.hits, p.judged, p.wrong), (7, 4, 3, 1));
        // 0.80: c-6 would be served too (c-5 is refused by the gate): no verdicts there.
        let p = at(0.80);
        assert_eq!((p.hits, p.judged), (5, 0));
        assert_eq!(p.wrong_share(), None);
        assert_eq!(choose(&c, 0.02).map(|p| p.threshold), Some(0.94));

        // Without the verdict file c-2 is unjudged: nothing wrong from 0.90 up.
        let d = read(std::slice::from_ref(&log), None, &acme).unwrap();
        assert_eq!(
            choose(&log_curve(&d.samples), 0.02).map(|p| p.threshold),
            Some(0.90)
        );

        // Every tenant: the anonymous tenant's wrong hit at 0.99 counts too.
        let d = read(
            std::slice::from_ref(&log),
            Some(&verdicts),
            &Filter::default(),
        )
        .unwrap();
        assert_eq!((d.samples.len(), d.served, d.judged), (8, 5, 4));
        assert_eq!(d.served_at, Some((0.86, 0.9)));
        let c = log_curve(&d.samples);
        assert_eq!(choose(&c, 0.02), None);
        // The anonymous tenant alone.
        let anon = Filter {
            tenant: Some(String::new()),
            ..Filter::default()
        };
        assert_eq!(
            read(std::slice::from_ref(&log), None, &anon)
                .unwrap()
                .samples
                .len(),
            1
        );

        // A time window: c-1 and c-2 only (until is exclusive).
        let window = Filter {
            tenant: Some("acme".into()),
            since_ms: Some(1000),
            until_ms: Some(1002),
        };
        let d = read(std::slice::from_ref(&log), Some(&verdicts), &window).unwrap();
        assert_eq!((d.requests, d.served, d.judged), (2, 2, 2));
    }
}
