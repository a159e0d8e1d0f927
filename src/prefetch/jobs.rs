//! Background jobs: what a job is, the queue (bounded, newest first, stale jobs dropped),
//! dispatch and running a prefetch or refresh generation.
//!
//! Dispatch, on the backend the job's generation goes to (`[[backends]]`: each its own): where
//! it tells its capacity ([`crate::generate::room`]), a job starts
//! when a slot is free beyond what waiting user requests need and background work holds less
//! than `max_capacity_share` of the slots (a pool with a `prefetch_share` at most its share
//! of those), within the concurrency and token budgets; the backend preempts it when a user
//! request needs its slot. Where it cannot tell, a job starts only while no user request
//! runs (and none ran for a short quiet period), within the concurrency, token and
//! wall-time (`max_backend_share`) budgets.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reprise_backend::GenRequest;
use reprise_cache::{Digest, EntryId, Origin};
use tokio::sync::OwnedSemaphorePermit;

use super::propose::Proposal;
use super::{bump, Shared};
use crate::auth::scope_of as pool_of;
use crate::generate::{generate_tagged, room, users_on, Background, Room};
use crate::openai::Endpoint;
use crate::state::AppState;

/// Jobs waiting for the backend to be free; beyond this the oldest is dropped.
const JOB_QUEUE: usize = 32;
/// A job that waited this long is dropped: its user has most likely asked already.
const JOB_TTL: Duration = Duration::from_secs(30);
/// Where the backend's capacity is unknown: how long it must have had no user request before
/// a job starts. Requests
/// of one client follow each other with a gap of a few milliseconds (the client reads the
/// answer, sends the next, the server looks it up); a job started in such a gap would run
/// beside the next request.
const QUIET: Duration = Duration::from_millis(50);
/// Prefetched entries tracked until used or gone (beyond this, new ones go untracked).
const MAX_TRACKED: usize = 100_000;

/// What a job does.
#[derive(Debug, Clone)]
pub(super) enum JobKind {
    /// Generate a predicted follow-up.
    Prefetch,
    /// Regenerate this entry before it expires.
    Refresh(EntryId),
    /// Ask the model for likely follow-ups of `answer` (the job's request is that question
    /// to the model; the follow-ups are built from `asked`) and queue them as prefetches.
    Propose(Box<Proposal>),
}

/// One background generation waiting for the backend.
pub(super) struct Job {
    pub(super) kind: JobKind,
    pub(super) namespace: String,
    pub(super) endpoint: Endpoint,
    pub(super) request: GenRequest,
    /// Exact key of the request, to queue each follow-up once.
    pub(super) key: Digest,
    /// Exact keys of the same follow-up asked in the cluster's other observed wordings (same
    /// history, same parameters): pointed at the generated entry.
    pub(super) aliases: Vec<Digest>,
    /// Invalidation tags stored with the answer: a prefetched follow-up carries those of the
    /// answer it follows (a tag delete of that answer reaches it), a refresh those of the
    /// entry it renews.
    pub(super) tags: Vec<String>,
    pub(super) queued_at: Instant,
}

impl Shared {
    /// Queues a job (newest first); drops the oldest beyond the bound. False when one for
    /// the same key is already queued or running.
    pub(super) fn enqueue(&self, job: Job) -> bool {
        self.enqueue_at(job, true)
    }

    /// Queues a job at the front (newest first) or at the back (after everything waiting:
    /// the model's guesses), then drops from the back beyond the bound.
    pub(super) fn enqueue_at(&self, job: Job, front: bool) -> bool {
        let key = job.key;
        if !self.pending.lock().insert(key) {
            return false;
        }
        bump(&self.counts.queued, 1);
        self.handles.queued.increment(1);
        let pool = pool_of(&job.namespace).to_string();
        let dropped = {
            let mut q = self.queue.lock();
            if front {
                q.push_front(job);
            } else {
                q.push_back(job);
            }
            // A pool beyond its share of the queue drops its own oldest job; otherwise the
            // oldest of all goes when the queue is full.
            let budgets = self.budget.lock();
            let share = budgets.queue_share(&pool, JOB_QUEUE);
            let same = |j: &Job| budgets.same_pool(pool_of(&j.namespace), &pool);
            if q.iter().filter(|j| same(j)).count() > share {
                q.iter().rposition(same).and_then(|i| q.remove(i))
            } else if q.len() > JOB_QUEUE {
                q.pop_back()
            } else {
                None
            }
        };
        // The queued job itself may be the one dropped (queued at the back of a full queue).
        let kept = dropped.as_ref().is_none_or(|old| old.key != key);
        if let Some(old) = dropped {
            self.cancel(&old);
        }
        kept
    }

    pub(super) fn cancel(&self, job: &Job) {
        self.pending.lock().remove(&job.key);
        cancelled(self, &job.kind);
    }

    /// Starts waiting jobs while the backend is free of interactive work and budgets allow.
    pub(super) fn dispatch(
        self: &Arc<Self>,
        state: &Arc<AppState>,
        quiet_since: &mut HashMap<String, Instant>,
    ) {
        loop {
            let now = Instant::now();
            {
                // Stale jobs go first, whatever the backend is doing; so do the jobs of a
                // read-only tenant (made so since they were queued, or observed on its hits):
                // nothing generated for it may be stored, so nothing is generated.
                let mut q = self.queue.lock();
                let mut stale = Vec::new();
                // Anywhere in the queue: most jobs are queued at the front (newest first), but
                // proposals and their follow-ups go to the back, so the back is not always
                // the oldest.
                let tenants = &state.policies.load().tenants;
                let read_only = |j: &Job| tenants.for_namespace(&j.namespace).policy().read_only;
                let dropped = |j: &Job| j.queued_at + JOB_TTL < now || read_only(j);
                if q.iter().any(dropped) {
                    let (refused, kept): (VecDeque<Job>, VecDeque<Job>) =
                        std::mem::take(&mut *q).into_iter().partition(dropped);
                    *q = kept;
                    stale.extend(refused);
                }
                let empty = q.is_empty();
                drop(q);
                for j in &stale {
                    self.cancel(j);
                }
                if empty {
                    return;
                }
            }
            let Ok(permit) = self.slots.clone().try_acquire_owned() else {
                return;
            };
            // Re-checked before every start, on the backend each job's generation goes to
            // (one backend's users never hold back another's spare slots). The newest job
            // whose backend has an opening and whose pool's budgets (and the whole budgets)
            // allow it.
            let active = self.counts.active.load(Ordering::Relaxed) as usize;
            let n = self.next_job.fetch_add(1, Ordering::Relaxed);
            let job = {
                let mut q = self.queue.lock();
                let mut budgets = self.budget.lock();
                let (tokens, share) = (self.cfg.max_tokens_per_minute, self.cfg.max_backend_share);
                let mut openings: HashMap<String, Opening> = HashMap::new();
                let found = q.iter().position(|j| {
                    // Per backend (the one the job's generation goes to).
                    let key = backend_of(state, &j.request);
                    let opening = *openings.entry(key.clone()).or_insert_with(|| {
                        opening(state, &j.request, &key, active, quiet_since, now)
                    });
                    let pool = pool_of(&j.namespace);
                    let reserve = reserve_of(state, j);
                    match opening {
                        Opening::Closed => false,
                        Opening::Slots(room) => {
                            budgets.allows_tokens(pool, now, tokens, reserve)
                                && budgets.running_in(pool) < budgets.slot_share(pool, room.slots)
                        }
                        Opening::Idle => budgets.allows(pool, now, tokens, share, reserve),
                    }
                });
                let job = found.and_then(|i| q.remove(i));
                if let Some(j) = &job {
                    // The most it may generate is held against the token budget while it
                    // runs.
                    let reserve = reserve_of(state, j);
                    budgets.start(pool_of(&j.namespace), n, Instant::now(), reserve);
                }
                job
            };
            let Some(job) = job else {
                return;
            };
            bump(&self.counts.started, 1);
            self.handles.started.increment(1);
            let active = self.counts.active.fetch_add(1, Ordering::Relaxed) + 1;
            self.counts.peak_active.fetch_max(active, Ordering::Relaxed);
            tokio::spawn(run_job(self.clone(), state.clone(), job, n, permit));
        }
    }
}

/// The tokens a job may generate at most (its `max_tokens`, else the bound its backend
/// applies to a request without one, else, for an upstream that applies its own unknown
/// one, `backend.max_tokens_cap`): held against the token budget while it runs.
pub(super) fn reserve_of(state: &AppState, job: &Job) -> u64 {
    let max = job.request.params.max_tokens.or_else(|| {
        let target = state.router.target_for(&job.request);
        target.and_then(|t| t.backend.default_max_tokens())
    });
    u64::from(max.unwrap_or(state.config.backend.max_tokens_cap))
}

/// The name of the backend `req` goes to (its model's when no configured one serves it):
/// what the quiet periods are kept by.
pub(super) fn backend_of(state: &AppState, req: &GenRequest) -> String {
    state
        .router
        .target_for(req)
        .map_or_else(|| req.model.clone(), |t| t.name.clone())
}

/// Whether a background generation for one model may start now on its backend.
#[derive(Debug, Clone, Copy)]
enum Opening {
    /// No: no spare slot, or (capacity unknown) a user request runs there or ran lately.
    Closed,
    /// A spare slot (the backend tells its capacity): within the capacity share.
    Slots(Room),
    /// Capacity unknown and no user request for a quiet period: within the wall-time share.
    Idle,
}

/// The [`Opening`] for a generation of `req` on the backend `backend` (its name);
/// `active`: background generations started here; `quiet_since`: per backend, since when
/// it (of unknown capacity) has run no user request.
fn opening(
    state: &AppState,
    req: &GenRequest,
    backend: &str,
    active: usize,
    quiet_since: &mut HashMap<String, Instant>,
    now: Instant,
) -> Opening {
    match room(state, req, active) {
        Some(room) => {
            quiet_since.remove(backend);
            if room.spare == 0 {
                Opening::Closed
            } else {
                Opening::Slots(room)
            }
        }
        None if users_on(state, req) > 0 => {
            quiet_since.remove(backend);
            Opening::Closed
        }
        None => {
            let since = *quiet_since.entry(backend.to_string()).or_insert(now);
            if now.duration_since(since) < QUIET {
                Opening::Closed
            } else {
                Opening::Idle
            }
        }
    }
}

/// Runs one job and accounts for it.
async fn run_job(
    shared: Arc<Shared>,
    state: Arc<AppState>,
    job: Job,
    n: u64,
    permit: OwnedSemaphorePermit,
) {
    let start = Instant::now();
    let mut unwinding = Unwinding {
        shared: &shared,
        n,
        job: &job,
        armed: true,
    };
    let Ran {
        generated,
        decoded,
        charged,
    } = match &job.kind {
        JobKind::Propose(p) => shared.propose(&state, &job, p).await,
        JobKind::Prefetch | JobKind::Refresh(_) => generate_job(&shared, &state, &job).await,
    };
    let end = Instant::now();
    let secs = end.duration_since(start).as_secs_f64();
    {
        let mut b = shared.budget.lock();
        if generated {
            b.finish(n, start, end, charged);
        } else {
            b.abandon(n);
        }
    }
    if generated {
        bump(&shared.counts.tokens, decoded);
        shared.handles.tokens.increment(decoded);
        bump(&shared.counts.backend_micros, (secs * 1e6) as u64);
        shared.handles.backend_seconds.increment(secs);
    }
    unwinding.armed = false;
    shared.pending.lock().remove(&job.key);
    shared.counts.active.fetch_sub(1, Ordering::Relaxed);
    drop(permit);
    shared.wake.notify_one();
}

/// Gives back what a running job holds (its budget reservation, its pending key, its place
/// among the active jobs, a refresh's mark on its entry, a proposal's on the answer it
/// asks about) when it ends without being accounted for: a panic in it, or its task
/// dropped. Without it the reservation would count as busy time for ever, and prefetch
/// would stop on a backend of unknown capacity; the entry would never be refreshed again.
struct Unwinding<'a> {
    shared: &'a Shared,
    n: u64,
    job: &'a Job,
    armed: bool,
}

impl Drop for Unwinding<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.shared.budget.lock().abandon(self.n);
        // Stored nothing: counted cancelled, its marks cleared, its key no longer pending.
        self.shared.cancel(self.job);
        self.shared.counts.active.fetch_sub(1, Ordering::Relaxed);
        self.shared.wake.notify_one();
    }
}

/// What running a job spent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Ran {
    /// The backend generated (or tried to).
    pub generated: bool,
    /// Tokens known to be decoded (the tokens metric).
    pub decoded: u64,
    /// Tokens charged to the budget: those decoded, or the job's reserve where what it
    /// decoded is not known.
    pub charged: u64,
}

impl Ran {
    /// Generated, `tokens` decoded and charged.
    pub(super) fn decoded(tokens: u64) -> Self {
        Ran {
            generated: true,
            decoded: tokens,
            charged: tokens,
        }
    }
}

/// Runs a prefetch or refresh job.
async fn generate_job(shared: &Shared, state: &Arc<AppState>, job: &Job) -> Ran {
    let (origin, check_cache) = match job.kind {
        JobKind::Refresh(_) => (Origin::Refresh, false),
        _ => (Origin::Prefetch, true),
    };
    // An entry deleted (or evicted) while its refresh waited is not renewed: the renewed
    // one would escape the delete.
    if let JobKind::Refresh(old) = job.kind {
        if state.store.get(old).await.is_none() {
            shared.cancel(job);
            return Ran::default();
        }
    }
    let result = generate_tagged(
        state,
        &job.namespace,
        job.endpoint,
        job.request.clone(),
        origin,
        check_cache,
        job.tags.clone(),
    )
    .await;
    // The answer serves the follow-up in the cluster's other observed wordings too: their
    // exact keys point at it. When the cache could already answer the asked wording (exactly
    // or semantically), the entry it would serve is the answer (nothing was generated, the
    // aliases cost nothing).
    let answer = match &result {
        Background::Generated { id, .. } => state.store.get(*id).await,
        Background::Cached(entry) => Some(entry.clone()),
        Background::Failed { .. } | Background::Skipped => None,
    };
    // Only where the namespace's policy matches by meaning at all: a rule that turns the
    // semantic tier off for it keeps every wording to its own answer.
    if let (JobKind::Prefetch, Some(entry)) = (&job.kind, answer) {
        if crate::lookup::matches_by_meaning(state, &job.namespace, &entry.model) {
            state.store.alias_unclaimed(&job.aliases, &entry).await;
        }
    }
    if matches!(job.kind, JobKind::Prefetch) {
        shared.finished(&job.namespace, &job.request, &result);
    }
    let mut tokens = 0;
    let generated = !matches!(result, Background::Cached(_) | Background::Skipped);
    match result {
        Background::Cached(_) => {
            bump(&shared.counts.skipped, 1);
        }
        // Tried again later, as a cancelled job: nothing was spent.
        Background::Skipped => cancelled(shared, &job.kind),
        Background::Generated { id, usage } => {
            tokens = u64::from(usage.completion_tokens);
            bump(&shared.counts.completed, 1);
            shared.handles.completed.increment(1);
            match job.kind {
                JobKind::Refresh(old) => {
                    bump(&shared.counts.refreshed, 1);
                    shared.handles.refresh.increment(1);
                    shared.hot.invalidate(&old);
                    shared.renamed(&job.namespace, old, id);
                    // Every key that led to the old answer (aliases of paraphrases and other
                    // wordings) leads to the renewed one, here and in Redis.
                    if let Some(new) = state.store.get(id).await {
                        state.store.repoint(old, &new).await;
                    }
                }
                _ => {
                    // Served already (its first use made it a live entry): nothing to track.
                    if let Some(e) = state.store.get(id).await {
                        if e.origin == Origin::Prefetch {
                            let mut map = shared.prefetched.lock();
                            if map.len() < MAX_TRACKED {
                                map.insert(id, e.expires_ms);
                            }
                        }
                    }
                }
            }
        }
        Background::Failed { error: e, decoded } => {
            // What it decoded before it stopped was spent all the same.
            tokens = decoded;
            tracing::debug!(error = %e, "prefetch: background generation failed");
            if matches!(e, reprise_backend::BackendError::Overloaded { .. }) {
                bump(&shared.counts.preempted, 1);
            }
            cancelled(shared, &job.kind);
        }
    }
    Ran {
        generated,
        ..Ran::decoded(tokens)
    }
}

/// Counts a job that stored nothing as cancelled; a refresh may be tried again, and a
/// proposal asked again the next time its answer is served.
fn cancelled(shared: &Shared, kind: &JobKind) {
    match kind {
        JobKind::Refresh(old) => {
            if let Some(h) = shared.hot.get(old) {
                h.refreshing.store(false, Ordering::Relaxed);
            }
        }
        JobKind::Propose(p) => shared.proposed_for.invalidate(&p.entry),
        JobKind::Prefetch => {}
    }
    bump(&shared.counts.cancelled, 1);
    shared.handles.cancelled.increment(1);
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::config::PrefetchConfig;
    use crate::policy::Shares;
    use crate::prefetch::Prefetcher;
    use crate::test_support::chat;

    fn job(namespace: &str, n: u32) -> Job {
        Job {
            kind: JobKind::Prefetch,
            namespace: namespace.into(),
            endpoint: Endpoint::Chat,
            request: chat(&[("user", "q")]),
            key: *blake3::hash(format!("{namespace}{n}").as_bytes()).as_bytes(),
            aliases: Vec::new(),
            tags: Vec::new(),
            queued_at: Instant::now(),
        }
    }

    fn queued(p: &Prefetcher, pool: &str) -> usize {
        let q = p.shared.queue.lock();
        q.iter().filter(|j| pool_of(&j.namespace) == pool).count()
    }

    /// A job that ends unaccounted (it panicked, or its task was dropped) gives back its
    /// reservation, its pending key and its place among the active jobs.
    #[test]
    fn a_job_that_never_finishes_gives_back_what_it_held() {
        let p = Prefetcher::new(PrefetchConfig::default());
        let s = &p.shared;
        let mut j = job("ns", 7);
        // A refresh: its entry is marked while it runs.
        let id = EntryId(7);
        j.kind = JobKind::Refresh(id);
        s.hot.insert(
            id,
            Arc::new(super::super::refresh::Hot {
                namespace: "ns".into(),
                endpoint: Endpoint::Chat,
                request: chat(&[("user", "q")]),
                expires_ms: u64::MAX,
                hits: std::sync::atomic::AtomicU64::new(0),
                refreshing: std::sync::atomic::AtomicBool::new(true),
            }),
        );
        s.budget.lock().start("ns", 7, Instant::now(), 100);
        s.pending.lock().insert(j.key);
        s.counts.active.fetch_add(1, Ordering::Relaxed);
        let held = Unwinding {
            shared: s,
            n: 7,
            job: &j,
            armed: true,
        };
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = held;
            panic!("the job failed");
        }));
        assert!(done.is_err());
        assert_eq!(s.budget.lock().running_in("ns"), 0);
        assert!(s.pending.lock().is_empty());
        assert_eq!(s.counts.active.load(Ordering::Relaxed), 0);
        assert_eq!(s.counts.cancelled.load(Ordering::Relaxed), 1);
        // The entry may be refreshed again.
        assert!(!s.hot.get(&id).unwrap().refreshing.load(Ordering::Relaxed));
        // Accounted for: nothing is given back twice.
        s.counts.active.fetch_add(1, Ordering::Relaxed);
        drop(Unwinding {
            shared: s,
            n: 7,
            job: &j,
            armed: false,
        });
        assert_eq!(s.counts.active.load(Ordering::Relaxed), 1);
        assert_eq!(s.counts.cancelled.load(Ordering::Relaxed), 1);
    }

    /// A background job's reservation: its own `max_tokens`, else its backend's own default
    /// (llama, scripted), else, on an upstream (whose default is its own to decide),
    /// `backend.max_tokens_cap`: never a guess smaller than what it may generate.
    #[tokio::test]
    async fn a_jobs_reservation_is_its_bound_or_its_backends_default() {
        use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
        let scripted = ScriptedBackend::new(ScriptConfig {
            default_max_tokens: 77,
            ..ScriptConfig::default()
        });
        let config = crate::config::Config::default();
        let state = crate::state::AppState::new(config, Arc::new(scripted), None).unwrap();
        let mut j = job("ns", 1);
        j.request.model = "fake".into();
        assert_eq!(reserve_of(&state, &j), 77);
        j.request.params.max_tokens = Some(12);
        assert_eq!(reserve_of(&state, &j), 12);

        let mut config = crate::config::Config::default();
        config.backend.kind = crate::config::BackendKind::Openai;
        config.backend.base_url = Some("http://127.0.0.1:9/v1".into());
        config.backend.max_tokens_cap = 999;
        let backend = crate::state::build_backend(&config).await.unwrap();
        assert_eq!(backend.default_max_tokens(), None);
        let state = crate::state::AppState::new(config, backend, None).unwrap();
        let mut j = job("ns", 2);
        assert_eq!(reserve_of(&state, &j), 999);
        j.request.params.max_tokens = Some(12);
        assert_eq!(reserve_of(&state, &j), 12);
    }

    /// A job past its time is dropped wherever it waits: a fresh one queued behind it
    /// (proposals go to the back) does not shield it.
    #[tokio::test]
    async fn a_stale_job_is_dropped_wherever_it_waits() {
        let state = crate::state::AppState::new(
            crate::config::Config::default(),
            std::sync::Arc::new(reprise_backend::fake::ScriptedBackend::new(
                reprise_backend::fake::ScriptConfig::default(),
            )),
            None,
        )
        .unwrap();
        let p = Prefetcher::new(PrefetchConfig::default());
        let mut old = job("ns", 1);
        old.queued_at = Instant::now()
            .checked_sub(JOB_TTL + Duration::from_secs(1))
            .unwrap();
        let old_key = old.key;
        p.shared.enqueue_at(old, true);
        p.shared.enqueue_at(job("ns", 2), false);
        p.shared.dispatch(&state, &mut HashMap::new());
        assert!(!p.shared.queue.lock().iter().any(|j| j.key == old_key));
        assert_eq!(p.stats().cancelled, 1);
    }

    /// The scan for wasted prefetches does not keep them: an unused prefetched answer is
    /// evicted as the tier fills with answers that are read, and is then counted wasted.
    #[tokio::test]
    async fn an_unused_prefetch_is_evicted_and_counted_wasted() {
        use reprise_cache::Origin;
        let mut config = crate::config::Config::default();
        config.cache.memory_bytes = 1 << 20;
        let state = crate::state::AppState::new(
            config,
            std::sync::Arc::new(reprise_backend::fake::ScriptedBackend::new(
                reprise_backend::fake::ScriptConfig::default(),
            )),
            None,
        )
        .unwrap();
        let answer = reprise_cache::testing::big_answer;
        let p = Prefetcher::new(PrefetchConfig::default());
        let unused = answer(0, Origin::Prefetch);
        state.store.insert(unused.clone(), &[]).await;
        p.shared
            .prefetched
            .lock()
            .insert(unused.id, unused.expires_ms);
        // Four times the budget of answers, each read twice (as hits would be), the scan
        // running between them.
        for i in 1..500 {
            p.shared.scan_wasted(&state);
            let other = answer(i, Origin::Live);
            state.store.insert(other.clone(), &[]).await;
            state.store.get(other.id).await;
            state.store.get(other.id).await;
            state.store.run_pending_tasks().await;
        }
        p.shared.scan_wasted(&state);
        assert!(!state.store.holds(unused.id), "evicted");
        assert_eq!(p.stats().wasted, 1);
    }

    #[test]
    fn a_tenants_flood_of_jobs_keeps_to_its_share_of_the_queue() {
        let p = Prefetcher::new(PrefetchConfig::default());
        p.set_shares(Some(Shares {
            pools: HashMap::from([("a".to_string(), 0.25)]),
            rest: 0.75,
        }));
        for n in 0..20 {
            p.shared.enqueue(job("ns", n));
        }
        for n in 0..100 {
            p.shared.enqueue(job("a\u{1f}ns", n));
        }
        // A quarter of 32 for `a`; nothing of the others' was pushed out by it.
        assert_eq!(queued(&p, "a"), 8);
        assert_eq!(queued(&p, ""), 20);
        // Its newest jobs are the ones kept.
        let newest = job("a\u{1f}ns", 99).key;
        assert!(p.shared.queue.lock().iter().any(|j| j.key == newest));
        // The others fill their share: the oldest of theirs go beyond it.
        for n in 20..40 {
            p.shared.enqueue(job("ns", n));
        }
        assert_eq!(queued(&p, ""), 24);
        assert_eq!(queued(&p, "a"), 8);
        // Not shared out: the whole queue is anyone's.
        p.set_shares(None);
        for n in 100..140 {
            p.shared.enqueue(job("a\u{1f}ns", n));
        }
        assert_eq!(p.shared.queue.lock().len(), JOB_QUEUE);
        assert_eq!(queued(&p, "a"), JOB_QUEUE);
    }
}
