//! The request log: one JSON line per request (time, tenant, namespace, outcome, best candidate
//! similarity, matched entry, gate verdict, stage latencies), written by a background task
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
    /// The caller's tenant (absent for the anonymous tenant).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tenant: String,
    /// Namespace (inside the tenant).
    pub namespace: String,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub endpoint: &'static str,
    /// exact, semantic, prefetch, miss, bypass or error.
    pub outcome: &'static str,
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
    /// Embedding time in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embed_ms: Option<f64>,
    /// Index search time in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub search_ms: Option<f64>,
    /// Time to the backend's first token in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_ms: Option<f64>,
    /// Total time in milliseconds.
    pub total_ms: f64,
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
