//! A scripted backend for timing, failure-injection and counting tests and for benchmarks.
//!
//! It answers from a template (`{prompt}` is replaced by the last user message or the raw
//! prompt), streams the answer word by word with an optional delay, counts its calls, and
//! can be told to fail at the start or after a number of chunks. It never stands in for the
//! real backends in tests of their behaviour; it makes the server's own behaviour observable.
//!
//! By default its capacity is unlimited (every stream sleeps on its own). With
//! [`ScriptConfig::slots`] it runs at most that many generations at once, like a server with
//! a fixed number of decode slots, scheduled like the upstream's concurrency limit (the
//! crate's priority semaphore): a request takes its place in the line when `generate` is
//! called, gets a slot interactive first, then batch (aged into interactive after
//! [`ScriptConfig::priority_aging`]), then background, and keeps it (before its first-token
//! delay) until its stream ends, fails or is dropped; the wait counts in its time to first
//! token. A background stream holding a slot that a user request needs is preempted: it ends
//! with `Overloaded` at once, and the slot passes on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::slots::{Permit, Slots, Ticket};
use crate::{
    Backend, BackendError, FinishReason, GenEvent, GenRequest, GenStream, Input, Load, Usage,
};

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
    /// The model name served; empty: any model (like an upstream without a model list).
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
    /// Generations running at once; `None` is unlimited. Requests beyond wait for a slot by
    /// priority (see the module header).
    pub slots: Option<usize>,
    /// With `slots`: requests that may wait for one; beyond, `generate` answers `Overloaded`
    /// (a user request evicts the newest waiting background one instead). `None`: unbounded.
    pub max_queue: Option<usize>,
    /// With `slots`: a batch request waiting this long is served as interactive; `None`:
    /// never.
    pub priority_aging: Option<Duration>,
    /// Requests remembered for [`ScriptedBackend::requests`] (the latest; [`LOG_LEN`] by
    /// default, 0: none): a soak sending millions of long prompts sets it low, so its memory
    /// figures are the server's.
    pub log_len: usize,
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
            slots: None,
            max_queue: None,
            priority_aging: Some(Duration::from_secs(5)),
            log_len: LOG_LEN,
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
    /// The slots of `cfg.slots`, replaced when a new config changes them.
    slots: Mutex<Option<Slots>>,
    failure: Mutex<Failure>,
    calls: AtomicUsize,
    active: AtomicUsize,
    interactive: AtomicUsize,
    completed: AtomicUsize,
    /// Cleared by [`ScriptedBackend::set_ready`]: then it fails every generation at once
    /// as unavailable, like a stopped engine.
    down: std::sync::atomic::AtomicBool,
    /// The latest requests received (at most [`LOG_LEN`]: a benchmark sending millions must
    /// not measure this log).
    log: Mutex<std::collections::VecDeque<GenRequest>>,
}

impl ScriptedBackend {
    /// A backend following `cfg`.
    pub fn new(cfg: ScriptConfig) -> Self {
        ScriptedBackend {
            inner: Arc::new(Inner {
                slots: Mutex::new(slot_line(&cfg)),
                cfg: Mutex::new(cfg),
                failure: Mutex::new(Failure::None),
                calls: AtomicUsize::new(0),
                active: AtomicUsize::new(0),
                interactive: AtomicUsize::new(0),
                completed: AtomicUsize::new(0),
                down: std::sync::atomic::AtomicBool::new(false),
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

    /// Makes it ready or not: a backend that is not fails every generation at once as
    /// unavailable, like a stopped llama engine.
    pub fn set_ready(&self, ready: bool) {
        self.inner.down.store(!ready, Ordering::SeqCst);
    }

    /// Sets how the next calls misbehave.
    pub fn set_failure(&self, failure: Failure) {
        *self.inner.failure.lock() = failure;
    }

    /// Background streams preempted (or evicted from the line) for user requests.
    pub fn preempted(&self) -> u64 {
        self.inner
            .slots
            .lock()
            .as_ref()
            .map_or(0, Slots::preempted_count)
    }

    /// Changes the script. New slot settings apply to streams started from now on (streams
    /// already holding or awaiting a slot keep the old ones).
    pub fn set_config(&self, cfg: ScriptConfig) {
        let mut cur = self.inner.cfg.lock();
        if (cur.slots, cur.max_queue, cur.priority_aging)
            != (cfg.slots, cfg.max_queue, cfg.priority_aging)
        {
            *self.inner.slots.lock() = slot_line(&cfg);
        }
        *cur = cfg;
    }

    /// Changes only the delay between chunks.
    pub fn set_token_delay(&self, delay: Duration) {
        self.inner.cfg.lock().token_delay = delay;
    }
}

fn slot_line(cfg: &ScriptConfig) -> Option<Slots> {
    cfg.slots
        .map(|n| Slots::new(n, cfg.max_queue, cfg.priority_aging))
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
    fn default_max_tokens(&self) -> Option<u32> {
        Some(self.inner.cfg.lock().default_max_tokens)
    }

    async fn generate(&self, req: GenRequest) -> Result<GenStream, BackendError> {
        self.inner.calls.fetch_add(1, Ordering::SeqCst);
        let keep = self.inner.cfg.lock().log_len;
        let mut log = self.inner.log.lock();
        while log.len() >= keep.max(1) {
            log.pop_front();
        }
        if keep > 0 {
            log.push_back(req.clone());
        }
        drop(log);
        let cfg = self.inner.cfg.lock().clone();
        if !cfg.model.is_empty() && req.model != cfg.model {
            return Err(BackendError::UnknownModel(req.model));
        }
        if self.inner.down.load(Ordering::SeqCst) {
            return Err(BackendError::Unavailable(
                "the scripted backend is down".into(),
            ));
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
        // Its place in the line is taken now, so requests are served in the order they came.
        let ticket = match self.inner.slots.lock().as_ref() {
            Some(slots) => Some(slots.enter(req.priority)?),
            None => None,
        };
        let interactive = req.priority.is_user();
        self.inner.active.fetch_add(1, Ordering::SeqCst);
        if interactive {
            self.inner.interactive.fetch_add(1, Ordering::SeqCst);
        }
        let guard = ActiveGuard {
            inner: self.inner.clone(),
            interactive,
        };
        let stream =
            async_stream_like(parts, cfg, fail_after, reason, prompt_tokens, guard, ticket);
        Ok(stream)
    }

    fn models(&self) -> Vec<String> {
        let model = self.inner.cfg.lock().model.clone();
        if model.is_empty() {
            Vec::new()
        } else {
            vec![model]
        }
    }

    fn ready(&self) -> bool {
        !self.inner.down.load(Ordering::SeqCst)
    }

    fn interactive_load(&self) -> usize {
        self.inner.interactive.load(Ordering::SeqCst)
    }

    /// With slots, the line's load; unlimited, capacity 0 and every live stream running.
    fn load(&self) -> Load {
        match self.inner.slots.lock().as_ref() {
            Some(slots) => slots.load(),
            None => Load {
                running: self.active(),
                ..Load::default()
            },
        }
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
    ticket: Option<Ticket>,
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
        /// The place in the line, until a slot is this stream's; then the slot held.
        ticket: Option<Ticket>,
        permit: Option<Permit>,
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
        ticket,
        permit: None,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        if let Some(ticket) = st.ticket.take() {
            match ticket.wait().await {
                Ok(permit) => st.permit = Some(permit),
                Err(e) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
            }
        }
        let delay = if st.sent == 0 {
            st.cfg.first_token_delay
        } else {
            st.cfg.token_delay
        };
        // A background stream whose slot went to a user request stops at once.
        let preemption = st.permit.as_ref().map(Permit::preemption);
        if !pause(delay, preemption).await {
            st.done = true;
            st.permit = None;
            return Some((Err(crate::slots::preempted()), st));
        }
        if st.fail_after == Some(st.sent) {
            st.done = true;
            st.permit = None;
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
                // The generation is over: its slot is free before the consumer polls again.
                st.permit = None;
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

/// Sleeps `delay` (not at all when zero); false when `preemption` fired first.
async fn pause(delay: Duration, preemption: Option<CancellationToken>) -> bool {
    let Some(token) = preemption else {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        return true;
    };
    if delay.is_zero() {
        return !token.is_cancelled();
    }
    tokio::select! {
        biased;
        () = token.cancelled() => false,
        () = tokio::time::sleep(delay) => true,
    }
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
            backend: None,
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

    fn with_slots(slots: Option<usize>) -> ScriptedBackend {
        ScriptedBackend::new(ScriptConfig {
            token_delay: Duration::from_millis(5),
            slots,
            ..ScriptConfig::default()
        })
    }

    /// Plays `a` (already past its first chunk) and `b` at once, recording `(name, event)`
    /// in the order the events came.
    async fn race(a: GenStream, b: GenStream) -> Vec<(&'static str, bool)> {
        let log = Arc::new(Mutex::new(vec![("a", false)]));
        let drain = |name: &'static str, mut s: GenStream, log: Arc<Mutex<Vec<_>>>| async move {
            while let Some(ev) = s.next().await {
                let finish = matches!(ev.unwrap(), GenEvent::Finish { .. });
                log.lock().push((name, finish));
            }
        };
        let one = tokio::spawn(drain("a", a, log.clone()));
        let two = tokio::spawn(drain("b", b, log.clone()));
        // Generous: it only turns a hang (a slot never freed) into a failure, it times nothing.
        tokio::time::timeout(Duration::from_secs(30), async {
            one.await.unwrap();
            two.await.unwrap();
        })
        .await
        .expect("a stream never got a slot");
        let out = log.lock().clone();
        out
    }

    #[tokio::test]
    async fn one_slot_makes_the_second_stream_wait_for_the_first() {
        let b = with_slots(Some(1));
        let mut first = b
            .generate(req("one two three four five six", None))
            .await
            .unwrap();
        assert!(matches!(first.next().await, Some(Ok(GenEvent::Delta(_)))));
        let mut background = req("seven eight", None);
        background.priority = Priority::Background;
        let second = b.generate(background).await.unwrap();
        let log = race(first, second).await;
        let a_finished = log.iter().position(|e| *e == ("a", true)).unwrap();
        let b_first = log.iter().position(|e| e.0 == "b").unwrap();
        assert!(a_finished < b_first, "{log:?}");
        assert_eq!(b.completed(), 2);
    }

    #[tokio::test]
    async fn without_slots_streams_interleave() {
        let b = with_slots(None);
        let mut first = b
            .generate(req("one two three four five six", None))
            .await
            .unwrap();
        assert!(matches!(first.next().await, Some(Ok(GenEvent::Delta(_)))));
        let second = b.generate(req("seven eight", None)).await.unwrap();
        let log = race(first, second).await;
        let a_finished = log.iter().position(|e| *e == ("a", true)).unwrap();
        let b_first = log.iter().position(|e| e.0 == "b").unwrap();
        assert!(b_first < a_finished, "{log:?}");
    }

    #[tokio::test]
    async fn a_dropped_stream_frees_its_slot() {
        let b = with_slots(Some(1));
        let mut first = b.generate(req("one two three", None)).await.unwrap();
        assert!(matches!(first.next().await, Some(Ok(GenEvent::Delta(_)))));
        let second = b.generate(req("four five", None)).await.unwrap();
        let waiting = tokio::spawn(async move { collect_stream(second).await });
        drop(first);
        // Generous: it only bounds a hang (a slot never freed), it times nothing.
        let text = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the second stream never got the slot")
            .unwrap();
        assert_eq!(text, "You asked: four five");
    }

    #[tokio::test]
    async fn a_failed_stream_frees_its_slot() {
        let b = with_slots(Some(1));
        b.set_failure(Failure::AfterChunks(1));
        let mut first = b.generate(req("one two three", None)).await.unwrap();
        assert!(matches!(first.next().await, Some(Ok(GenEvent::Delta(_)))));
        assert!(matches!(first.next().await, Some(Err(_))));
        b.set_failure(Failure::None);
        let second = b.generate(req("four five", None)).await.unwrap();
        // `first` is still held, ended but not dropped.
        let text = tokio::time::timeout(Duration::from_secs(30), collect_stream(second))
            .await
            .expect("the failed stream kept its slot");
        assert_eq!(text, "You asked: four five");
        drop(first);
    }

    fn with_priority(text: &str, priority: Priority) -> GenRequest {
        GenRequest {
            priority,
            ..req(text, None)
        }
    }

    /// Drains `s` in a task, noting `name` in `log` at its first event; returns the text.
    fn drain_noting(
        name: &'static str,
        mut s: GenStream,
        log: Arc<Mutex<Vec<&'static str>>>,
    ) -> tokio::task::JoinHandle<String> {
        tokio::spawn(async move {
            let mut text = String::new();
            while let Some(ev) = s.next().await {
                if text.is_empty() {
                    log.lock().push(name);
                }
                if let GenEvent::Delta(d) = ev.unwrap() {
                    text.push_str(&d);
                }
            }
            text
        })
    }

    #[tokio::test]
    async fn a_waiting_interactive_request_goes_before_an_earlier_batch_one() {
        let b = with_slots(Some(1));
        let mut running = b.generate(req("one two three four", None)).await.unwrap();
        assert!(matches!(running.next().await, Some(Ok(GenEvent::Delta(_)))));
        let log = Arc::new(Mutex::new(Vec::new()));
        let batch = b
            .generate(with_priority("batch question", Priority::Batch))
            .await
            .unwrap();
        let batch = drain_noting("batch", batch, log.clone());
        let interactive = b
            .generate(with_priority("interactive question", Priority::Interactive))
            .await
            .unwrap();
        let interactive = drain_noting("interactive", interactive, log.clone());
        let load = b.load();
        assert_eq!((load.capacity, load.running), (1, 1));
        assert_eq!((load.queued_interactive, load.queued_batch), (1, 1));
        collect_stream(running).await;
        // Generous: it only turns a hang into a failure, it times nothing.
        let both = tokio::time::timeout(Duration::from_secs(30), async {
            (batch.await.unwrap(), interactive.await.unwrap())
        })
        .await
        .expect("both were served");
        assert_eq!(both.0, "You asked: batch question");
        assert_eq!(*log.lock(), ["interactive", "batch"]);
    }

    #[tokio::test]
    async fn an_aged_batch_request_gets_through_a_steady_interactive_stream() {
        let b = ScriptedBackend::new(ScriptConfig {
            token_delay: Duration::from_millis(2),
            slots: Some(1),
            priority_aging: Some(Duration::from_millis(100)),
            ..ScriptConfig::default()
        });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Two clients asking back to back: whenever the slot frees, one of them waits.
        let clients: Vec<_> = (0..2)
            .map(|i| {
                let (b, stop) = (b.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let s = b.generate(req(&format!("client {i} asks"), None)).await;
                        collect_stream(s.unwrap()).await;
                    }
                })
            })
            .collect();
        let busy = || {
            let l = b.load();
            l.running == 1 && l.queued_interactive >= 1
        };
        while !busy() {
            tokio::task::yield_now().await;
        }
        let batch = b
            .generate(with_priority("batch question", Priority::Batch))
            .await
            .unwrap();
        // Generous: without aging it waits as long as the stream goes on, i.e. forever here.
        let text = tokio::time::timeout(Duration::from_secs(30), collect_stream(batch))
            .await
            .expect("the batch request starved");
        assert_eq!(text, "You asked: batch question");
        assert!(
            !stop.load(Ordering::SeqCst),
            "served while the stream went on"
        );
        stop.store(true, Ordering::SeqCst);
        for c in clients {
            c.await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_user_request_preempts_a_background_stream() {
        let b = with_slots(Some(1));
        let mut background = b
            .generate(with_priority(
                "one two three four five six",
                Priority::Background,
            ))
            .await
            .unwrap();
        assert!(matches!(
            background.next().await,
            Some(Ok(GenEvent::Delta(_)))
        ));
        assert_eq!(b.load().running_background, 1);
        let user = b
            .generate(with_priority("a batch question", Priority::Batch))
            .await
            .unwrap();
        let text = tokio::time::timeout(Duration::from_secs(30), collect_stream(user))
            .await
            .expect("the user request never got the slot");
        assert_eq!(text, "You asked: a batch question");
        // The background stream was cut: an error, no finish.
        let mut rest = Vec::new();
        while let Some(ev) = background.next().await {
            rest.push(ev);
        }
        assert!(
            matches!(rest.last(), Some(Err(BackendError::Overloaded { .. }))),
            "{rest:?}"
        );
        assert!(!rest
            .iter()
            .any(|e| matches!(e, Ok(GenEvent::Finish { .. }))));
        assert_eq!(b.preempted(), 1);
        assert_eq!(b.completed(), 1);
    }

    async fn collect_stream(mut s: GenStream) -> String {
        let mut text = String::new();
        while let Some(ev) = s.next().await {
            if let GenEvent::Delta(d) = ev.unwrap() {
                text.push_str(&d);
            }
        }
        text
    }
}
