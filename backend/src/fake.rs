//! A scripted backend for timing, failure-injection and counting tests and for benchmarks.
//!
//! It answers from a template (`{prompt}` is replaced by the last user message or the raw
//! prompt), streams the answer word by word with an optional delay, counts its calls, and
//! can be told to fail at the start or after a number of chunks. It never stands in for the
//! real backends in tests of their behaviour; it makes the server's own behaviour observable.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::{Backend, BackendError, FinishReason, GenEvent, GenRequest, GenStream, Input, Usage};

/// How the scripted backend should misbehave.
#[derive(Debug, Clone)]
pub enum Failure {
    /// Behave.
    None,
    /// Fail `generate` itself with this error.
    AtStart(BackendError),
    /// Send this many chunks, then an error event (a cut-off stream).
    AfterChunks(usize),
}

/// Requests a [`ScriptedBackend`] remembers for [`ScriptedBackend::requests`].
pub const LOG_LEN: usize = 10_000;

/// Settings of a [`ScriptedBackend`].
#[derive(Debug, Clone)]
pub struct ScriptConfig {
    /// The model name served.
    pub model: String,
    /// Reply template; `{prompt}` is replaced by the last user message or the raw prompt.
    pub reply: String,
    /// Replies for particular requests: the first rule whose needle occurs in any message
    /// (or the raw prompt) gives the template instead of `reply`.
    pub rules: Vec<(String, String)>,
    /// Delay before the first chunk.
    pub first_token_delay: Duration,
    /// Delay between chunks.
    pub token_delay: Duration,
    /// `max_tokens` when the request sets none (a "token" is one word here).
    pub default_max_tokens: u32,
}

impl Default for ScriptConfig {
    fn default() -> Self {
        ScriptConfig {
            model: "fake".into(),
            reply: "You asked: {prompt}".into(),
            rules: Vec::new(),
            first_token_delay: Duration::ZERO,
            token_delay: Duration::ZERO,
            default_max_tokens: 256,
        }
    }
}

/// The scripted backend. Clones share counters and script.
#[derive(Clone)]
pub struct ScriptedBackend {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: Mutex<ScriptConfig>,
    failure: Mutex<Failure>,
    calls: AtomicUsize,
    active: AtomicUsize,
    interactive: AtomicUsize,
    completed: AtomicUsize,
    /// The latest requests received (at most [`LOG_LEN`]: a benchmark sending millions must
    /// not measure this log).
    log: Mutex<std::collections::VecDeque<GenRequest>>,
}

impl ScriptedBackend {
    /// A backend following `cfg`.
    pub fn new(cfg: ScriptConfig) -> Self {
        ScriptedBackend {
            inner: Arc::new(Inner {
                cfg: Mutex::new(cfg),
                failure: Mutex::new(Failure::None),
                calls: AtomicUsize::new(0),
                active: AtomicUsize::new(0),
                interactive: AtomicUsize::new(0),
                completed: AtomicUsize::new(0),
                log: Mutex::new(std::collections::VecDeque::new()),
            }),
        }
    }

    /// Number of `generate` calls so far.
    pub fn calls(&self) -> usize {
        self.inner.calls.load(Ordering::SeqCst)
    }

    /// Number of generations that ran to their end (sent `Finish`).
    pub fn completed(&self) -> usize {
        self.inner.completed.load(Ordering::SeqCst)
    }

    /// Number of streams currently alive.
    pub fn active(&self) -> usize {
        self.inner.active.load(Ordering::SeqCst)
    }

    /// The requests received, in order (the latest [`LOG_LEN`]).
    pub fn requests(&self) -> Vec<GenRequest> {
        self.inner.log.lock().iter().cloned().collect()
    }

    /// Sets how the next calls misbehave.
    pub fn set_failure(&self, failure: Failure) {
        *self.inner.failure.lock() = failure;
    }

    /// Changes the script.
    pub fn set_config(&self, cfg: ScriptConfig) {
        *self.inner.cfg.lock() = cfg;
    }

    /// Changes only the delay between chunks.
    pub fn set_token_delay(&self, delay: Duration) {
        self.inner.cfg.lock().token_delay = delay;
    }
}

/// Splits text into word-sized pieces that concatenate back to the text.
fn pieces(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in text.chars() {
        if ch.is_whitespace() && !cur.trim().is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(ch);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Counts this stream's liveness for [`ScriptedBackend::active`] and load reporting.
struct ActiveGuard {
    inner: Arc<Inner>,
    interactive: bool,
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.inner.active.fetch_sub(1, Ordering::SeqCst);
        if self.interactive {
            self.inner.interactive.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[async_trait::async_trait]
impl Backend for ScriptedBackend {
    async fn generate(&self, req: GenRequest) -> Result<GenStream, BackendError> {
        self.inner.calls.fetch_add(1, Ordering::SeqCst);
        let mut log = self.inner.log.lock();
        if log.len() == LOG_LEN {
            log.pop_front();
        }
        log.push_back(req.clone());
        drop(log);
        let cfg = self.inner.cfg.lock().clone();
        if req.model != cfg.model {
            return Err(BackendError::UnknownModel(req.model));
        }
        let failure = self.inner.failure.lock().clone();
        if let Failure::AtStart(e) = failure {
            return Err(e);
        }
        let prompt = match &req.input {
            Input::Prompt(p) => p.clone(),
            Input::Chat(msgs) => msgs
                .iter()
                .rev()
                .find(|m| m.role == "user")
                .map(|m| m.content.clone())
                .unwrap_or_default(),
        };
        let prompt_tokens = match &req.input {
            Input::Prompt(p) => pieces(p).len(),
            Input::Chat(msgs) => msgs.iter().map(|m| pieces(&m.content).len()).sum(),
        } as u32;
        let mentions = |needle: &str| match &req.input {
            Input::Prompt(p) => p.contains(needle),
            Input::Chat(msgs) => msgs.iter().any(|m| m.content.contains(needle)),
        };
        let template = cfg
            .rules
            .iter()
            .find(|(needle, _)| mentions(needle))
            .map_or(&cfg.reply, |(_, t)| t);
        let mut text = template.replace("{prompt}", &prompt);
        let mut reason = FinishReason::Stop;
        if let Some(pos) = req
            .params
            .stop
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(pos);
        }
        let mut parts = pieces(&text);
        let max = req.params.max_tokens.unwrap_or(cfg.default_max_tokens) as usize;
        if parts.len() > max {
            parts.truncate(max);
            reason = FinishReason::Length;
        }
        let fail_after = match failure {
            Failure::AfterChunks(n) => Some(n),
            _ => None,
        };
        let interactive = req.priority == crate::Priority::Interactive;
        self.inner.active.fetch_add(1, Ordering::SeqCst);
        if interactive {
            self.inner.interactive.fetch_add(1, Ordering::SeqCst);
        }
        let guard = ActiveGuard {
            inner: self.inner.clone(),
            interactive,
        };
        let stream = async_stream_like(parts, cfg, fail_after, reason, prompt_tokens, guard);
        Ok(stream)
    }

    fn models(&self) -> Vec<String> {
        vec![self.inner.cfg.lock().model.clone()]
    }

    fn ready(&self) -> bool {
        true
    }

    fn interactive_load(&self) -> usize {
        self.inner.interactive.load(Ordering::SeqCst)
    }
}

/// Builds the event stream with `futures::stream::unfold` (no macro, so rustfmt reaches it).
fn async_stream_like(
    parts: Vec<String>,
    cfg: ScriptConfig,
    fail_after: Option<usize>,
    reason: FinishReason,
    prompt_tokens: u32,
    guard: ActiveGuard,
) -> GenStream {
    struct State {
        parts: std::vec::IntoIter<String>,
        sent: usize,
        done: bool,
        cfg: ScriptConfig,
        fail_after: Option<usize>,
        reason: FinishReason,
        prompt_tokens: u32,
        guard: ActiveGuard,
    }
    let state = State {
        parts: parts.into_iter(),
        sent: 0,
        done: false,
        cfg,
        fail_after,
        reason,
        prompt_tokens,
        guard,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let delay = if st.sent == 0 {
            st.cfg.first_token_delay
        } else {
            st.cfg.token_delay
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if st.fail_after == Some(st.sent) {
            st.done = true;
            return Some((
                Err(BackendError::Unavailable("scripted failure".into())),
                st,
            ));
        }
        match st.parts.next() {
            Some(p) => {
                st.sent += 1;
                Some((Ok(GenEvent::Delta(p)), st))
            }
            None => {
                st.done = true;
                st.guard.inner.completed.fetch_add(1, Ordering::SeqCst);
                let usage = Usage {
                    prompt_tokens: st.prompt_tokens,
                    completion_tokens: st.sent as u32,
                };
                Some((
                    Ok(GenEvent::Finish {
                        reason: st.reason,
                        usage,
                    }),
                    st,
                ))
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChatMessage, Priority, SamplingParams};
    use futures::StreamExt;

    /// The request log keeps the latest [`LOG_LEN`]: a benchmark sending millions of
    /// requests measures the server, not this log.
    #[tokio::test]
    async fn the_request_log_keeps_the_latest() {
        let b = ScriptedBackend::new(ScriptConfig::default());
        for i in 0..LOG_LEN + 5 {
            drop(b.generate(req(&format!("q{i}"), Some(1))).await.unwrap());
        }
        let log = b.requests();
        assert_eq!(log.len(), LOG_LEN);
        assert_eq!(b.calls(), LOG_LEN + 5);
        match &log[0].input {
            Input::Chat(m) => assert_eq!(m[0].content, "q5"),
            other => panic!("{other:?}"),
        }
    }

    fn req(text: &str, max: Option<u32>) -> GenRequest {
        GenRequest {
            model: "fake".into(),
            input: Input::Chat(vec![ChatMessage::new("user", text)]),
            params: SamplingParams {
                max_tokens: max,
                ..Default::default()
            },
            priority: Priority::Interactive,
            extra: Default::default(),
        }
    }

    async fn collect(b: &ScriptedBackend, r: GenRequest) -> (String, Option<GenEvent>) {
        let mut s = b.generate(r).await.unwrap();
        let mut text = String::new();
        let mut last = None;
        while let Some(ev) = s.next().await {
            match ev.unwrap() {
                GenEvent::Delta(d) => text.push_str(&d),
                f @ GenEvent::Finish { .. } => last = Some(f),
            }
        }
        (text, last)
    }

    #[tokio::test]
    async fn echoes_and_counts() {
        let b = ScriptedBackend::new(ScriptConfig::default());
        let (text, fin) = collect(&b, req("hello there", None)).await;
        assert_eq!(text, "You asked: hello there");
        assert!(matches!(
            fin,
            Some(GenEvent::Finish {
                reason: FinishReason::Stop,
                ..
            })
        ));
        assert_eq!(b.calls(), 1);
        assert_eq!(b.active(), 0);
    }

    #[tokio::test]
    async fn max_tokens_gives_length() {
        let b = ScriptedBackend::new(ScriptConfig::default());
        let (text, fin) = collect(&b, req("a b c d e", Some(3))).await;
        assert_eq!(text, "You asked: a");
        assert!(matches!(
            fin,
            Some(GenEvent::Finish {
                reason: FinishReason::Length,
                usage: Usage {
                    completion_tokens: 3,
                    ..
                }
            })
        ));
    }

    #[tokio::test]
    async fn fails_mid_stream() {
        let b = ScriptedBackend::new(ScriptConfig::default());
        b.set_failure(Failure::AfterChunks(1));
        let mut s = b.generate(req("x y z", None)).await.unwrap();
        assert!(matches!(s.next().await, Some(Ok(GenEvent::Delta(_)))));
        assert!(matches!(s.next().await, Some(Err(_))));
        assert!(s.next().await.is_none());
    }
}
