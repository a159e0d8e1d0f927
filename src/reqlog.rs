//! The request log: one JSON line per request (time, ids, tenant, namespace, model, outcome,
//! best candidate similarity, matched entry, gate verdict, stage latencies, what a hit saved,
//! the question), and one per verdict (`outcome: "feedback"`), written by a background task
//! so the request path never waits on the disk.

use std::io::Write;
use std::path::Path;

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

/// Handle to the log writer.
#[derive(Clone)]
pub struct RequestLog {
    tx: mpsc::Sender<LogRecord>,
}

/// Lines buffered before new ones are dropped (the log never slows requests down).
const LOG_BUFFER: usize = 4096;

impl RequestLog {
    /// Opens (appends to) the file and starts the writer task.
    pub fn open(path: &Path) -> std::io::Result<RequestLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let (tx, mut rx) = mpsc::channel::<LogRecord>(LOG_BUFFER);
        tokio::task::spawn_blocking(move || {
            let mut w = std::io::BufWriter::new(file);
            while let Some(rec) = rx.blocking_recv() {
                if serde_json::to_writer(&mut w, &rec).is_ok() {
                    let _ = w.write_all(b"\n");
                }
                // Flush when nothing else is queued, so lines appear promptly.
                if rx.is_empty() {
                    let _ = w.flush();
                }
            }
            let _ = w.flush();
        });
        Ok(RequestLog { tx })
    }

    /// Queues a line; dropped if the writer is far behind.
    pub fn write(&self, rec: LogRecord) {
        let _ = self.tx.try_send(rec);
    }
}
