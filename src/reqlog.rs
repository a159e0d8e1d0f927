//! The request log: one JSON line per request (time, ids, tenant, namespace, model, outcome,
//! best candidate similarity, matched entry, gate verdict, stage latencies, what a hit saved,
//! the question), and one per verdict (`outcome: "feedback"`), written by a background task
//! so the request path never waits on the disk, and rotated by size (`[log]
//! request_log_max_bytes`, `request_log_files`) so it never fills one.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use file_rotate::compression::Compression;
use file_rotate::suffix::AppendCount;
use file_rotate::{ContentLimit, FileRotate};
use serde::Serialize;
use tokio::sync::mpsc;

/// One line of the log.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LogRecord {
    /// Milliseconds since the Unix epoch when the request arrived.
    pub time_ms: u64,
    /// The request's `x-request-id` (taken from the client or generated).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub request_id: String,
    /// The trace the request's spans were exported in, when it was traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// The caller's span (W3C `traceparent`), the parent of the request's trace; not written.
    #[serde(skip)]
    pub trace_parent: Option<opentelemetry::trace::SpanContext>,
    /// The response's `id` (what `POST /v1/feedback` names); on a verdict line, the id judged.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// The caller's tenant (absent for the anonymous tenant).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tenant: String,
    /// Namespace (inside the tenant).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// The model asked for.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub model: String,
    /// `/v1/chat/completions` or `/v1/completions`.
    #[serde(skip_serializing_if = "str::is_empty")]
    pub endpoint: &'static str,
    /// exact, semantic, prefetch, miss, bypass or error; `feedback` for a verdict.
    pub outcome: &'static str,
    /// How the answer was degraded (`stale_while_revalidate`, `stale_if_error`, ...; see
    /// `crate::degraded`); absent on ordinary answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded: Option<&'static str>,
    /// Where an exact hit was found: `memory` or `redis`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<&'static str>,
    /// A verdict line's verdict: `wrong` or `right`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict: Option<&'static str>,
    /// Error kind when the outcome is `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'static str>,
    /// Similarity of the best semantic candidate, hit or not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub similarity: Option<f32>,
    /// The threshold the semantic tier served at (learned, under `semantic.delta`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f32>,
    /// The entry that answered (hit) or was written (miss).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<String>,
    /// `pass`, or the reason the false-hit gate rejected the best candidate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gate: Option<&'static str>,
    /// The conversation's last question was matched as standing on its own (as if asked
    /// with the system prompt alone).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub standalone: bool,
    /// Exact lookup time (memory, then Redis) in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact_ms: Option<f64>,
    /// Embedding time in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embed_ms: Option<f64>,
    /// Index search time in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub search_ms: Option<f64>,
    /// Time to the backend's first token in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_ms: Option<f64>,
    /// Time to the first token (a hit: to its answer) in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Total time in milliseconds.
    pub total_ms: f64,
    /// What a hit saved: the prompt tokens of the generation it replaced.
    #[serde(skip_serializing_if = "is_zero")]
    pub saved_prompt_tokens: u32,
    /// What a hit saved: the completion tokens of the generation it replaced.
    #[serde(skip_serializing_if = "is_zero")]
    pub saved_completion_tokens: u32,
    /// What a hit saved: the backend time of the generation it replaced, milliseconds.
    #[serde(skip_serializing_if = "is_zero")]
    pub saved_backend_ms: u32,
    /// What a hit saved at `[metrics.prices]` (0 without a price for the model).
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub saved_cost: f64,
    /// The question (last user turn or prompt), cut to `log.question_chars`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub question: Option<String>,
    /// For a hit by meaning (or a predicted one): the question the entry was generated for,
    /// cut the same way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

/// `text` cut to at most `chars` characters (`None` when nothing is kept).
pub fn cut(text: &str, chars: usize) -> Option<String> {
    if chars == 0 || text.is_empty() {
        return None;
    }
    Some(match text.char_indices().nth(chars) {
        Some((at, _)) => text[..at].to_string(),
        None => text.to_string(),
    })
}

/// Lines of the request log lost, by why: `queue` (the writer far behind) or `write` (the
/// file could not be written).
pub const DROPPED: &str = "reprise_request_log_dropped_total";

/// Writes one line; whether it was written (false also when the writer panicked).
fn write_line<W: Write>(w: &mut W, line: &[u8]) -> bool {
    matches!(
        catch_unwind(AssertUnwindSafe(|| w.write_all(line))),
        Ok(Ok(()))
    )
}

/// Writes `line` (ending in its newline) with `w`; where that fails, once more with a writer
/// `open` makes anew, the line then starting a line of its own: the failed write may have
/// left part of it, and the retry must not be glued to that part (readers skip a blank
/// line). `None`: written at once; else whether the retry wrote it.
fn write_or_retry<W: Write>(
    w: &mut Option<W>,
    open: impl FnOnce() -> Option<W>,
    line: &mut Vec<u8>,
) -> Option<bool> {
    if w.as_mut().is_some_and(|w| write_line(w, line)) {
        return None;
    }
    *w = open();
    line.insert(0, b'\n');
    Some(w.as_mut().is_some_and(|w| write_line(w, line)))
}

/// Handle to the log writer.
#[derive(Clone)]
pub struct RequestLog {
    tx: mpsc::Sender<LogRecord>,
}

/// Lines buffered before new ones are dropped (the log never slows requests down).
const LOG_BUFFER: usize = 4096;

impl RequestLog {
    /// Opens (appends to) the file and starts the writer task. The file is rotated by size:
    /// once it holds more than `max_bytes`, it becomes `FILE.1` (older ones shift to `.2`, ...;
    /// beyond `keep` rotated files the oldest is deleted) and a fresh file is started, so the
    /// log never holds much more than `(keep + 1) × max_bytes`. A file ends with the line that
    /// passed `max_bytes`: lines are never cut.
    ///
    /// A path that is not a regular file (a pipe, `/dev/stdout`) is appended to without
    /// rotation: renaming it would move the device, not start a new log.
    pub fn open(path: &Path, max_bytes: usize, keep: usize) -> std::io::Result<RequestLog> {
        // Opened here first so a path that cannot be written is a start-up error (the
        // rotating writer would only drop its lines), and its directory listed, which the
        // writer does to find the rotated files (and panics where it cannot).
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let limit = if file.metadata()?.is_file() {
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            std::fs::read_dir(dir.unwrap_or(Path::new(".")))?;
            // The writer counts the bytes the file already holds and rotates before the
            // first write that finds them past `max_bytes`.
            ContentLimit::BytesSurpassed(max_bytes.max(1))
        } else {
            ContentLimit::None
        };
        drop(file);
        let path = path.to_path_buf();
        // Opening scans the directory for rotated files and panics where it cannot (a
        // directory gone, no file descriptors left): `None` then, and tried again next line.
        let open = move || {
            catch_unwind(AssertUnwindSafe(|| {
                FileRotate::new(
                    &path,
                    AppendCount::new(keep),
                    limit.clone(),
                    Compression::None,
                    None,
                )
            }))
            .ok()
        };
        let (tx, mut rx) = mpsc::channel::<LogRecord>(LOG_BUFFER);
        tokio::task::spawn_blocking(move || {
            // One write per line, unbuffered: the rotation is decided per write, so a
            // buffered batch would let a file run past its size by a whole buffer (and
            // lines appear at once without a flush). The writer is this thread's only work.
            let mut w = open();
            let mut line = Vec::with_capacity(1024);
            let mut failing = false;
            while let Some(rec) = rx.blocking_recv() {
                line.clear();
                if serde_json::to_writer(&mut line, &rec).is_err() {
                    continue;
                }
                line.push(b'\n');
                // Where the rotated files changed under the writer (one deleted by hand,
                // another process rotating the same path), the writer panics on a rename it
                // expected: it starts over from the files there now (said once while it
                // keeps failing, as on a full disk).
                if let Some(wrote) = write_or_retry(&mut w, &open, &mut line) {
                    if !wrote {
                        metrics::counter!(DROPPED, "why" => "write").increment(1);
                    }
                    if !wrote && !failing {
                        tracing::warn!("request log: a line could not be written");
                    }
                    failing = !wrote;
                } else {
                    failing = false;
                }
            }
            if let Some(mut w) = w {
                let _ = catch_unwind(AssertUnwindSafe(|| w.flush()));
            }
        });
        Ok(RequestLog { tx })
    }

    /// Queues a line; dropped (and counted) if the writer is far behind.
    pub fn write(&self, rec: LogRecord) {
        if self.tx.try_send(rec).is_err() {
            metrics::counter!(DROPPED, "why" => "queue").increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use super::{LogRecord, RequestLog};

    /// The `time_ms` of every line of `path`, in order.
    fn times(path: &Path) -> Vec<u64> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("whole JSON lines");
                v["time_ms"].as_u64().unwrap()
            })
            .collect()
    }

    /// A writer over a shared file that takes `room` bytes, then fails.
    struct Partly {
        file: std::rc::Rc<std::cell::RefCell<Vec<u8>>>,
        room: usize,
    }

    impl std::io::Write for Partly {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(std::io::Error::other("disk full"));
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            self.file.borrow_mut().extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A line whose write failed midway is written again on a line of its own: the part
    /// left is lost alone, the line reads whole.
    #[test]
    fn a_retried_line_is_not_glued_to_a_part_left_behind() {
        let file = std::rc::Rc::new(std::cell::RefCell::new(b"{\"a\":1}\n".to_vec()));
        let mut w = Some(Partly {
            file: file.clone(),
            room: 5,
        });
        let mut line = b"{\"b\":2}\n".to_vec();
        let reopened = || {
            Some(Partly {
                file: file.clone(),
                room: usize::MAX,
            })
        };
        assert_eq!(
            super::write_or_retry(&mut w, reopened, &mut line),
            Some(true)
        );
        let text = String::from_utf8(file.borrow().clone()).unwrap();
        let whole: Vec<&str> = text
            .lines()
            .filter(|l| serde_json::from_str::<serde_json::Value>(l).is_ok())
            .collect();
        assert_eq!(whole, [r#"{"a":1}"#, r#"{"b":2}"#], "{text:?}");
        // Written at once: nothing else.
        let mut next = b"{\"c\":3}\n".to_vec();
        assert_eq!(super::write_or_retry(&mut w, || None, &mut next), None);
        assert!(file.borrow().ends_with(b"}\n{\"c\":3}\n"));
    }

    #[tokio::test]
    async fn rotates_by_size_and_keeps_the_newest_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("requests.jsonl");
        let (max_bytes, keep, n) = (4096, 3, 400u64);
        let log = RequestLog::open(&path, max_bytes, keep).unwrap();
        // About 200 bytes a line: some 80 KB in all, twenty files' worth.
        for i in 0..n {
            log.write(LogRecord {
                time_ms: i,
                namespace: "n".repeat(100),
                endpoint: "/v1/chat/completions",
                outcome: "miss",
                ..LogRecord::default()
            });
        }
        drop(log);
        // The writer ends once it has written what was queued.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while times(&path).last() != Some(&(n - 1)) {
            assert!(
                std::time::Instant::now() < deadline,
                "the last line never came"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "requests.jsonl",
                "requests.jsonl.1",
                "requests.jsonl.2",
                "requests.jsonl.3"
            ]
        );
        let files: Vec<PathBuf> = names.iter().rev().map(|f| dir.path().join(f)).collect();
        let longest = files
            .iter()
            .flat_map(|f| {
                std::fs::read_to_string(f)
                    .unwrap()
                    .lines()
                    .map(|l| l.len() + 1)
                    .collect::<Vec<_>>()
            })
            .max()
            .unwrap();
        for f in &files {
            let size = std::fs::metadata(f).unwrap().len() as usize;
            assert!(size <= max_bytes + longest, "{}: {size} bytes", f.display());
        }
        // Oldest file first (.3, .2, .1, then the current one): the lines follow one another
        // and end with the newest in the current file; the oldest were deleted.
        let kept: Vec<u64> = files.iter().flat_map(|f| times(f)).collect();
        assert_eq!(kept.last(), Some(&(n - 1)));
        assert!(kept.windows(2).all(|w| w[1] == w[0] + 1), "{kept:?}");
        assert!(kept[0] > 0, "the oldest lines are gone");
        for f in &files[..3] {
            let size = std::fs::metadata(f).unwrap().len() as usize;
            assert!(size > max_bytes, "a rotated file passed the size");
        }
    }

    #[tokio::test]
    async fn a_rotated_file_deleted_by_hand_does_not_stop_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("requests.jsonl");
        let log = RequestLog::open(&path, 1024, 5).unwrap();
        let line = |i| LogRecord {
            time_ms: i,
            namespace: "n".repeat(200),
            outcome: "miss",
            ..LogRecord::default()
        };
        let rotated = |k: usize| dir.path().join(format!("requests.jsonl.{k}"));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut i = 0;
        // Until every rotated file exists.
        while !rotated(5).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "never rotated five times"
            );
            log.write(line(i));
            i += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Someone tidies up: the writer's list of rotated files is now wrong.
        std::fs::remove_file(rotated(3)).unwrap();
        let last = i + 100;
        for j in i..=last {
            log.write(line(j));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        while times(&path).last() != Some(&last) {
            assert!(
                std::time::Instant::now() < deadline,
                "the log stopped after the file was deleted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
