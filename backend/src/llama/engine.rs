//! The engine thread: continuous batching of many sequences over one llama.cpp context.
//!
//! One dedicated OS thread owns the [`LlamaContext`]. Each loop iteration it
//! 1. admits waiting requests into free slots (interactive first, then batch, background only
//!    on spare capacity, preempting background work when a user request would otherwise
//!    wait; a batch request that waited `aging` joins the interactive line in its arrival
//!    order, so interactive traffic cannot starve it),
//! 2. drops sequences whose client went away,
//! 3. builds one batch holding the next token of every generating sequence plus, with the
//!    room left under `n_batch`, a chunk of prompt for sequences still prefilling,
//! 4. decodes it, samples one token per sequence that produced logits, and streams text.
//!
//! When nothing is live the thread sleeps on a condition variable; `generate` wakes it.
//!
//! KV budget: the context's cells are shared by all sequences (unified KV cache). Each
//! admitted sequence reserves `prompt + max_tokens` cells up front (requests were capped at
//! the context size before queueing), and a request is only admitted when its reservation
//! fits. This means a decode can never fail for lack of KV space halfway through an answer,
//! at the price of admitting fewer sequences when clients ask for very long answers. An
//! interactive request waiting at the head of its line for KV room lets smaller ones behind
//! it that fit a free slot pass, at most `MAX_PASSES` of them, so one long ask neither holds
//! back short ones nor starves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::vocab::LlamaVocab;
use parking_lot::{Condvar, Mutex};
use tokio::sync::mpsc::{self, error::TrySendError};

use super::metric_names as m;
use super::text::TextStream;
use crate::{BackendError, FinishReason, GenEvent, Priority, Usage};

/// Sending half of a request's event stream.
pub(crate) type EventTx = mpsc::Sender<Result<GenEvent, BackendError>>;

/// What a preempted or evicted background request receives: the capacity went to
/// user requests, and retrying later is the right reaction.
fn preempted() -> BackendError {
    BackendError::Overloaded {
        retry_after_secs: 1,
    }
}

/// Counts a user request (interactive or batch) towards `interactive_load` for as long as it
/// exists (queued or running).
pub(crate) struct LoadGuard(Arc<AtomicUsize>);

impl LoadGuard {
    pub(crate) fn new(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter.clone())
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request accepted by `generate`, waiting for a slot.
pub(crate) struct Job {
    /// Prompt tokens (chat template already applied).
    pub prompt: Vec<LlamaToken>,
    /// Generated-token budget, already capped so that prompt plus budget fits the context.
    pub max_tokens: u32,
    /// The request's own sampler chain.
    pub sampler: LlamaSampler,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Scheduling class.
    pub priority: Priority,
    /// Where events go.
    pub tx: EventTx,
    /// When `generate` accepted it.
    pub enqueued: Instant,
    /// Present for user requests (interactive and batch).
    pub load: Option<LoadGuard>,
    /// Smaller requests admitted ahead of this one while it waited at the head of its line
    /// for KV room (at most [`MAX_PASSES`]).
    pub passed: u32,
}

/// How many smaller requests may pass a request that waits at the head of its line for KV
/// room: enough to keep free slots busy, few enough that the big one is not starved (after
/// that, its line waits for room as before).
const MAX_PASSES: u32 = 4;

impl Job {
    fn reservation(&self) -> u32 {
        self.prompt.len() as u32 + self.max_tokens
    }
}

/// The three waiting lines. The interactive line also holds the batch requests that aged
/// into it (their `priority` stays `Batch`: once running they are still not preempted).
#[derive(Default)]
pub(crate) struct Queues {
    interactive: VecDeque<Job>,
    batch: VecDeque<Job>,
    background: VecDeque<Job>,
    shutdown: bool,
}

impl Queues {
    fn len(&self) -> usize {
        self.interactive.len() + self.batch.len() + self.background.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets requests whose client already went away, so they neither use a queue place
    /// nor get a slot.
    fn purge_closed(&mut self) {
        self.interactive.retain(|j| !j.tx.is_closed());
        self.batch.retain(|j| !j.tx.is_closed());
        self.background.retain(|j| !j.tx.is_closed());
    }

    /// Moves the batch requests that waited `aging` or longer into the interactive line, in
    /// their arrival order among the interactive requests.
    fn age(&mut self, aging: Option<Duration>, now: Instant) {
        let Some(aging) = aging else {
            return;
        };
        while self
            .batch
            .front()
            .is_some_and(|j| now.saturating_duration_since(j.enqueued) >= aging)
        {
            let job = self.batch.pop_front().expect("front exists");
            let at = self
                .interactive
                .iter()
                .position(|j| j.enqueued > job.enqueued)
                .unwrap_or(self.interactive.len());
            self.interactive.insert(at, job);
        }
    }

    /// Fails every waiting request with `err`.
    fn fail_all(&mut self, err: &BackendError) {
        let lines = self
            .interactive
            .drain(..)
            .chain(self.batch.drain(..))
            .chain(self.background.drain(..));
        for job in lines {
            let _ = job.tx.try_send(Err(err.clone()));
        }
    }
}

/// Monotonic counters, cheap to read from tests and the benchmark.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub preempted: AtomicU64,
    pub decode_steps: AtomicU64,
    pub peak_occupancy: AtomicUsize,
    /// Inputs being tokenized off the async workers, and the most at once.
    pub tokenizing: AtomicUsize,
    pub peak_tokenizing: AtomicUsize,
}

/// State shared between `generate` callers and the engine thread.
pub(crate) struct Shared {
    // A plain mutex + condvar rather than a channel: admission needs to look at both queues
    // at once (interactive before background, eviction at a full queue), and the engine
    // holds the lock only for the few microseconds admission takes.
    queues: Mutex<Queues>,
    wake: Condvar,
    /// User requests (interactive and batch) queued or running.
    pub interactive_load: Arc<AtomicUsize>,
    /// Sequences holding a slot, and those of background requests among them (for `load`).
    pub running: AtomicUsize,
    pub running_background: AtomicUsize,
    /// False once the engine thread has exited (shutdown or a panic).
    pub alive: AtomicBool,
    /// Statistics.
    pub counters: Counters,
}

impl Shared {
    pub(crate) fn new() -> Self {
        Self {
            queues: Mutex::new(Queues::default()),
            wake: Condvar::new(),
            interactive_load: Arc::new(AtomicUsize::new(0)),
            running: AtomicUsize::new(0),
            running_background: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
            counters: Counters::default(),
        }
    }

    /// The engine's load: `parallel` slots, the sequences in them, the lines' lengths (a batch
    /// request aged into the interactive line counts as interactive).
    pub(crate) fn load(&self, parallel: usize) -> crate::Load {
        let q = self.queues.lock();
        crate::Load {
            capacity: parallel,
            running: self.running.load(Ordering::Relaxed),
            running_background: self.running_background.load(Ordering::Relaxed),
            queued: q.len(),
            queued_interactive: q.interactive.len(),
            queued_batch: q.batch.len(),
            // `schedule` starts background work only beyond the last free slot.
            kept_free: usize::from(parallel > 1),
        }
    }

    /// Whether a request at `priority` would be refused now by [`Shared::enqueue`] (the queue
    /// full, with nothing it may evict): checked before its prompt is tokenized, so a full
    /// queue refuses long prompts without tokenizing them. A hint only: `enqueue` decides.
    pub(crate) fn would_refuse(&self, priority: Priority, max_queue: usize) -> bool {
        let mut q = self.queues.lock();
        q.purge_closed();
        q.len() >= max_queue
            && match priority {
                Priority::Interactive => q.background.is_empty() && q.batch.is_empty(),
                Priority::Batch => q.background.is_empty(),
                Priority::Background => true,
            }
    }

    /// Queues a job, or refuses it when `max_queue` requests already wait. A user arrival
    /// (interactive or batch) at a full queue evicts the newest waiting background request
    /// instead of being refused; an interactive one with none to evict, the newest waiting
    /// batch request (a flood of batch work cannot lock interactive requests out).
    pub(crate) fn enqueue(&self, job: Job, max_queue: usize) -> Result<(), BackendError> {
        let mut q = self.queues.lock();
        if q.shutdown || !self.alive.load(Ordering::Acquire) {
            return Err(BackendError::Unavailable(
                "the llama engine is not running".into(),
            ));
        }
        q.purge_closed();
        if q.len() >= max_queue {
            let evicted = match job.priority {
                Priority::Interactive => q
                    .background
                    .pop_back()
                    .map(|j| (j, true))
                    .or_else(|| q.batch.pop_back().map(|j| (j, false))),
                Priority::Batch => q.background.pop_back().map(|j| (j, true)),
                Priority::Background => None,
            };
            match evicted {
                Some((victim, background)) => {
                    let _ = victim.tx.try_send(Err(preempted()));
                    if background {
                        self.counters.preempted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                None => {
                    return Err(BackendError::Overloaded {
                        retry_after_secs: 1,
                    })
                }
            }
        }
        match job.priority {
            Priority::Interactive => q.interactive.push_back(job),
            Priority::Batch => q.batch.push_back(job),
            Priority::Background => q.background.push_back(job),
        }
        drop(q);
        self.wake.notify_one();
        Ok(())
    }

    /// Asks the engine to stop; live and waiting requests get `Unavailable`.
    pub(crate) fn shutdown(&self) {
        self.queues.lock().shutdown = true;
        self.wake.notify_one();
    }
}

/// Marks the engine dead and fails waiting requests when the thread exits, even by panic,
/// so that `generate` never queues work nobody will serve.
struct AliveGuard(Arc<Shared>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
        let mut q = self.0.queues.lock();
        q.shutdown = true;
        q.fail_all(&BackendError::Unavailable(
            "the llama engine stopped".into(),
        ));
    }
}

/// Engine sizing, resolved at load time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineLimits {
    /// Sequences decoded together.
    pub parallel: usize,
    /// Most tokens in one decode call.
    pub n_batch: usize,
    /// KV cells shared by all sequences.
    pub n_ctx: u32,
    /// A batch request waiting this long is served as interactive; `None`: never.
    pub aging: Option<Duration>,
}

/// One live sequence.
struct Seq {
    id: i32,
    priority: Priority,
    tx: EventTx,
    sampler: LlamaSampler,
    prompt: Vec<LlamaToken>,
    /// Prompt tokens already decoded.
    prefilled: usize,
    /// Sampled token that still has to be decoded (fed back) before the next sample.
    pending: Option<LlamaToken>,
    /// Next KV position.
    n_past: i32,
    max_tokens: u32,
    reservation: u32,
    completion: u32,
    text: TextStream,
    /// Text produced but not yet sent because the client's channel was full; deltas
    /// concatenate, so a slow client gets fewer, larger deltas instead of stalling others.
    outbox: String,
    enqueued: Instant,
    admission: u64,
    first_token: Option<Instant>,
    last_token: Instant,
    /// Index in the current batch whose logits this sequence samples from.
    batch_idx: Option<i32>,
    _load: Option<LoadGuard>,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.prefilled < self.prompt.len()
    }
}

/// Terminal events of a finished sequence that did not fit the client's channel yet.
struct Outgoing {
    tx: EventTx,
    events: VecDeque<Result<GenEvent, BackendError>>,
}

/// The engine loop state; lives on the engine thread only.
pub(crate) struct Engine<'a> {
    ctx: LlamaContext<'a>,
    vocab: LlamaVocab<'a>,
    shared: Arc<Shared>,
    limits: EngineLimits,
    slots: Vec<Option<Seq>>,
    reserved: u32,
    admissions: u64,
    outgoing: Vec<Outgoing>,
}

impl<'a> Engine<'a> {
    pub(crate) fn new(
        ctx: LlamaContext<'a>,
        vocab: LlamaVocab<'a>,
        shared: Arc<Shared>,
        limits: EngineLimits,
    ) -> Self {
        Self {
            ctx,
            vocab,
            shared,
            limits,
            slots: (0..limits.parallel).map(|_| None).collect(),
            reserved: 0,
            admissions: 0,
            outgoing: Vec::new(),
        }
    }

    /// Runs until shutdown.
    pub(crate) fn run(mut self) {
        let _alive = AliveGuard(self.shared.clone());
        let mut batch = LlamaBatch::new(self.limits.n_batch, 1);
        // Sequences whose client left are let go before admission too, so a slot they hold
        // is not taken from background work for a new arrival.
        while {
            self.reap_closed();
            self.schedule()
        } {
            self.reap_closed();
            if self.live() > 0 {
                self.step(&mut batch);
                self.flush_outboxes();
            }
            self.flush_outgoing();
        }
        let err = BackendError::Unavailable("the llama backend shut down".into());
        for seq in self.slots.iter_mut().filter_map(Option::take) {
            let _ = seq.tx.try_send(Err(err.clone()));
        }
    }

    fn live(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Waits for work if there is none, then admits waiting requests. Returns false on
    /// shutdown.
    fn schedule(&mut self) -> bool {
        let shared = self.shared.clone();
        let mut q = shared.queues.lock();
        loop {
            if q.shutdown {
                q.fail_all(&BackendError::Unavailable(
                    "the llama backend shut down".into(),
                ));
                return false;
            }
            q.purge_closed();
            if self.live() > 0 || !q.is_empty() {
                break;
            }
            if self.outgoing.is_empty() {
                shared.wake.wait(&mut q);
            } else {
                // Only undelivered finish events remain: poll the slow clients now and then
                // instead of spinning.
                shared.wake.wait_for(&mut q, Duration::from_millis(5));
                return true;
            }
        }

        // Interactive requests first (with the batch requests that aged), then batch; when
        // no slot (or KV room) is free for a user request, background work is preempted.
        q.age(self.limits.aging, Instant::now());
        self.admit_users(&mut q.interactive);
        if q.interactive.is_empty() {
            self.admit_users(&mut q.batch);
        }

        // Background requests only when no user request waits, and (with more than one
        // slot) never in the last free slot, so a user arrival usually starts at once
        // without preempting anything.
        if q.interactive.is_empty() && q.batch.is_empty() {
            // Slots left free after admitting one (with one slot, background work may take
            // it, or it would never run).
            let keep_free = usize::from(self.limits.parallel > 1);
            while let Some(job) = q.background.front() {
                let free = self.slots.iter().filter(|s| s.is_none()).count();
                if free <= keep_free || self.reserved + job.reservation() > self.limits.n_ctx {
                    break;
                }
                let job = q.background.pop_front().expect("front exists");
                self.admit(job);
            }
        }
        true
    }

    /// Admits user requests from `line` in order while a slot and KV room are free; when the
    /// head does not fit, preempts the background sequence with the least progress, as long
    /// as that makes room at all (a running batch or interactive sequence is never preempted).
    fn admit_users(&mut self, line: &mut VecDeque<Job>) {
        while let Some(job) = line.front() {
            let need = job.reservation();
            if self.free_slot().is_some() && self.reserved + need <= self.limits.n_ctx {
                let job = line.pop_front().expect("front exists");
                self.admit(job);
                continue;
            }
            let (bg_count, bg_reserved) = self.background_held();
            // Preempting every background sequence frees a slot; it must also free enough
            // KV, or the request waits for user work to finish instead.
            if bg_count == 0 || self.reserved - bg_reserved + need > self.limits.n_ctx {
                // Meanwhile a smaller request behind it that fits a free slot may pass it (a
                // bounded number of times, so the head is not starved).
                if !self.pass_head(line) {
                    break;
                }
                continue;
            }
            self.preempt_youngest_background();
        }
    }

    /// Background sequences running, and the KV cells they hold.
    fn background_held(&self) -> (usize, u32) {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.priority == Priority::Background)
            .fold((0usize, 0u32), |(n, r), s| (n + 1, r + s.reservation))
    }

    /// Admits the first request behind the head of `line` that fits a slot and the KV room
    /// left, when the head may still be passed; returns whether one was admitted. Like the
    /// head, it preempts background sequences (the youngest first) for the slot and room it
    /// needs, rather than waiting for them to finish.
    fn pass_head(&mut self, line: &mut VecDeque<Job>) -> bool {
        if line.front().is_none_or(|h| h.passed >= MAX_PASSES) {
            return false;
        }
        let (bg_count, bg_reserved) = self.background_held();
        if self.free_slot().is_none() && bg_count == 0 {
            return false;
        }
        let room = self
            .limits
            .n_ctx
            .saturating_sub(self.reserved - bg_reserved);
        let Some(i) = line.iter().skip(1).position(|j| j.reservation() <= room) else {
            return false;
        };
        let job = line.remove(i + 1).expect("position is in the line");
        while self.free_slot().is_none() || self.reserved + job.reservation() > self.limits.n_ctx {
            if !self.preempt_youngest_background() {
                break;
            }
        }
        if self.free_slot().is_none() || self.reserved + job.reservation() > self.limits.n_ctx {
            // Cannot happen (all background work frees what was counted): back in line.
            line.insert(i + 1, job);
            return false;
        }
        if let Some(head) = line.front_mut() {
            head.passed += 1;
        }
        self.admit(job);
        true
    }

    fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(Option::is_none)
    }

    fn admit(&mut self, job: Job) {
        let slot = self.free_slot().expect("caller checked for a free slot");
        let now = Instant::now();
        metrics::histogram!(m::QUEUE_WAIT, "class" => job.priority.as_str())
            .record(now.duration_since(job.enqueued).as_secs_f64());
        let prompt_len = job.prompt.len() as u64;
        self.shared
            .counters
            .prompt_tokens
            .fetch_add(prompt_len, Ordering::Relaxed);
        metrics::counter!(m::PROMPT_TOKENS).increment(prompt_len);
        let reservation = job.reservation();
        self.reserved += reservation;
        self.shared.running.fetch_add(1, Ordering::Relaxed);
        if job.priority == Priority::Background {
            self.shared
                .running_background
                .fetch_add(1, Ordering::Relaxed);
        }
        self.admissions += 1;
        self.slots[slot] = Some(Seq {
            id: slot as i32,
            priority: job.priority,
            tx: job.tx,
            sampler: job.sampler,
            prompt: job.prompt,
            prefilled: 0,
            pending: None,
            n_past: 0,
            max_tokens: job.max_tokens,
            reservation,
            completion: 0,
            text: TextStream::new(job.stop),
            outbox: String::new(),
            enqueued: job.enqueued,
            admission: self.admissions,
            first_token: None,
            last_token: now,
            batch_idx: None,
            _load: job.load,
        });
    }

    /// Takes a sequence out of its slot and frees its KV cells.
    fn release(&mut self, slot: usize) -> Seq {
        let seq = self.slots[slot].take().expect("slot is live");
        // Removing a whole sequence cannot fail; the error case is only an id overflow.
        let _ = self.ctx.clear_kv_cache_seq(Some(seq.id as u32), None, None);
        self.reserved -= seq.reservation;
        self.shared.running.fetch_sub(1, Ordering::Relaxed);
        if seq.priority == Priority::Background {
            self.shared
                .running_background
                .fetch_sub(1, Ordering::Relaxed);
        }
        seq
    }

    /// Preempts the background sequence with the least progress; false when none runs.
    fn preempt_youngest_background(&mut self) -> bool {
        let victim = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
            .filter(|(_, s)| s.priority == Priority::Background)
            .min_by_key(|(_, s)| (s.completion, std::cmp::Reverse(s.admission)))
            .map(|(i, _)| i);
        if let Some(slot) = victim {
            let mut seq = self.release(slot);
            tracing::debug!(
                generated = seq.completion,
                "preempting a background sequence for user work"
            );
            self.shared
                .counters
                .preempted
                .fetch_add(1, Ordering::Relaxed);
            let mut events = VecDeque::new();
            if !seq.outbox.is_empty() {
                events.push_back(Ok(GenEvent::Delta(std::mem::take(&mut seq.outbox))));
            }
            events.push_back(Err(preempted()));
            self.outgoing.push(Outgoing { tx: seq.tx, events });
        }
        victim.is_some()
    }

    /// Cancels sequences whose stream was dropped: no compute for nobody.
    fn reap_closed(&mut self) {
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|s| s.tx.is_closed()) {
                self.cancel(slot);
            }
        }
        self.outgoing.retain(|o| !o.tx.is_closed());
    }

    fn cancel(&mut self, slot: usize) {
        let seq = self.release(slot);
        tracing::debug!(
            generated = seq.completion,
            "client went away; sequence cancelled"
        );
        self.shared
            .counters
            .cancelled
            .fetch_add(1, Ordering::Relaxed);
    }

    /// One decode step over all live sequences.
    fn step(&mut self, batch: &mut LlamaBatch) {
        batch.clear();
        let mut in_batch = 0usize;

        // The next token of every generating sequence.
        for seq in self.slots.iter_mut().flatten() {
            seq.batch_idx = None;
            if let Some(token) = seq.pending {
                // Cannot fail: n_batch >= parallel was checked at load time.
                let _ = batch.add(token, seq.n_past, &[seq.id], true);
                seq.batch_idx = Some(batch.n_tokens() - 1);
                in_batch += 1;
            }
        }

        // Prompt chunks in the room left, interactive first, then oldest first. A prompt
        // longer than that room continues next step, so a long prefill delays the other
        // sequences' next token by at most one `n_batch`-sized decode.
        let mut order: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].as_ref().is_some_and(Seq::prefilling))
            .collect();
        order.sort_by_key(|&i| {
            let s = self.slots[i].as_ref().expect("filtered live");
            (s.priority, s.admission)
        });
        for i in order {
            let room = self.limits.n_batch - batch.n_tokens() as usize;
            if room == 0 {
                break;
            }
            let seq = self.slots[i].as_mut().expect("filtered live");
            let end = seq.prompt.len().min(seq.prefilled + room);
            for pos in seq.prefilled..end {
                let last = pos + 1 == seq.prompt.len();
                let _ = batch.add(seq.prompt[pos], pos as i32, &[seq.id], last);
            }
            if end == seq.prompt.len() {
                seq.batch_idx = Some(batch.n_tokens() - 1);
            }
            seq.prefilled = end;
            in_batch += 1;
        }

        if batch.n_tokens() == 0 {
            return;
        }
        metrics::histogram!(m::BATCH_OCCUPANCY).record(in_batch as f64);
        self.shared
            .counters
            .peak_occupancy
            .fetch_max(in_batch, Ordering::Relaxed);
        self.shared
            .counters
            .decode_steps
            .fetch_add(1, Ordering::Relaxed);

        if let Err(e) = self.ctx.decode(batch) {
            // Should not happen with the KV reservations. The batch's KV state is unknown
            // now, so every live sequence fails rather than the whole engine.
            tracing::error!(error = %e, "llama_decode failed");
            let failed: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].is_some())
                .collect();
            for slot in failed {
                let seq = self.release(slot);
                self.outgoing.push(Outgoing {
                    tx: seq.tx,
                    events: VecDeque::from([Err(BackendError::Internal(format!(
                        "llama.cpp decode failed: {e}"
                    )))]),
                });
            }
            return;
        }

        // Advance positions: one for a fed-back token, up to `prefilled` for a prompt chunk.
        for seq in self.slots.iter_mut().flatten() {
            if seq.pending.take().is_some() {
                seq.n_past += 1;
            }
            seq.n_past = seq.n_past.max(seq.prefilled as i32);
        }
        for slot in 0..self.slots.len() {
            let Some(seq) = self.slots[slot].as_mut() else {
                continue;
            };
            let Some(idx) = seq.batch_idx.take() else {
                continue;
            };
            let token = seq.sampler.sample(&self.ctx, idx);
            if let Some(reason) = self.on_token(slot, token) {
                self.finish(slot, reason);
            }
        }
    }

    /// Handles one sampled token; returns a finish reason when the sequence is done.
    fn on_token(&mut self, slot: usize, token: LlamaToken) -> Option<FinishReason> {
        let seq = self.slots[slot].as_mut().expect("live");
        let now = Instant::now();
        if seq.first_token.is_none() {
            seq.first_token = Some(now);
            metrics::histogram!(m::TIME_TO_FIRST_TOKEN, "class" => seq.priority.as_str())
                .record(now.duration_since(seq.enqueued).as_secs_f64());
        }
        seq.last_token = now;
        if self.vocab.is_eog(token) {
            return Some(FinishReason::Stop);
        }
        seq.completion += 1;
        self.shared
            .counters
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::GENERATED_TOKENS).increment(1);
        let piece = self.vocab.token_to_piece(token, false, None);
        let pushed = seq.text.push(&piece);
        seq.outbox.push_str(&pushed.emit);
        if pushed.stopped {
            return Some(FinishReason::Stop);
        }
        if seq.completion >= seq.max_tokens {
            // `max_tokens` was capped by the context at admission, so this is also where a
            // sequence that filled the context ends.
            return Some(FinishReason::Length);
        }
        seq.pending = Some(token);
        None
    }

    fn finish(&mut self, slot: usize, reason: FinishReason) {
        let mut seq = self.release(slot);
        let rest = seq.text.finish();
        seq.outbox.push_str(&rest);
        if let Some(first) = seq.first_token {
            // Decode rate after the first token, comparable with the bare benchmark.
            let secs = seq.last_token.duration_since(first).as_secs_f64();
            if seq.completion > 1 && secs > 0.0 {
                metrics::histogram!(m::TOKENS_PER_SECOND)
                    .record(f64::from(seq.completion - 1) / secs);
            }
        }
        self.shared
            .counters
            .completed
            .fetch_add(1, Ordering::Relaxed);
        let mut events = VecDeque::new();
        if !seq.outbox.is_empty() {
            events.push_back(Ok(GenEvent::Delta(std::mem::take(&mut seq.outbox))));
        }
        events.push_back(Ok(GenEvent::Finish {
            reason,
            usage: Usage {
                prompt_tokens: seq.prompt.len() as u32,
                completion_tokens: seq.completion,
            },
        }));
        self.outgoing.push(Outgoing { tx: seq.tx, events });
    }

    /// Sends pending text of live sequences without ever blocking the engine.
    fn flush_outboxes(&mut self) {
        for slot in 0..self.slots.len() {
            let Some(seq) = self.slots[slot].as_mut() else {
                continue;
            };
            if seq.outbox.is_empty() {
                continue;
            }
            let text = std::mem::take(&mut seq.outbox);
            match seq.tx.try_send(Ok(GenEvent::Delta(text))) {
                Ok(()) => {}
                Err(TrySendError::Full(Ok(GenEvent::Delta(text)))) => seq.outbox = text,
                Err(TrySendError::Full(_)) => {}
                Err(TrySendError::Closed(_)) => self.cancel(slot),
            }
        }
    }

    /// Delivers terminal events in order, as far as the clients' channels allow.
    fn flush_outgoing(&mut self) {
        self.outgoing.retain_mut(|o| {
            while let Some(ev) = o.events.pop_front() {
                match o.tx.try_send(ev) {
                    Ok(()) => {}
                    Err(TrySendError::Full(ev)) => {
                        o.events.push_front(ev);
                        return true;
                    }
                    Err(TrySendError::Closed(_)) => return false,
                }
            }
            false
        });
    }
}
