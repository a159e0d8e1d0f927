//! Predictive prefetch and refresh-ahead: learns which follow-up comes after which answer and
//! generates likely follow-ups in the background, before the user asks; regenerates hot
//! entries before they expire.
//!
//! # How it works
//!
//! 1. **Learning** (`model`): every answered request is an [`Observation`]. Its previous
//!    turn is the entry that answered the conversation's previous exchange (`prev_entry`,
//!    multi-turn history) or else the last entry served in the same session (single-turn
//!    prompts linked by `x-reprise-session` or the OpenAI `user` field). The model counts
//!    previous → this, per namespace, with exponential decay; and, so that the counts are
//!    not split over the many wordings of one question, cluster → cluster as well (a
//!    question joins a cluster when its embedding is within `cluster_threshold` of the
//!    cluster's representative and the false-hit gate passes).
//! 2. **Predicting**: after an observation answered by `E`, the follow-up clusters of `E` are
//!    ranked; when `E` was seen too rarely, the counts of its cluster are used, else those of
//!    entries with a similar embedding. Clusters that regrouping would join only at the
//!    looser `regroup_family_score` are one question's family: their counts add up. Those
//!    clearing `min_probability` (at most `max_predictions` questions, a family once with
//!    up to 4 of its clusters) become jobs, one per cluster.
//! 3. **Prefetching**: each job is the follow-up request as it will arrive (the history plus
//!    `E`'s answer plus the predicted question in the cluster's most used wording, or the
//!    same single-turn request with the question replaced), generated with
//!    [`generate_in_background`] at background priority, which skips what the cache can
//!    already answer. The same request in up to `max_wordings` other observed wordings of the
//!    cluster is then aliased (by exact key: same context, same parameters) to the answer,
//!    so the user's own wording finds it although the semantic tier would not match it. The
//!    semantic index is left alone: it holds one vector per entry, and a looser match by
//!    vector would reach unobserved wordings that no cluster check vetted. Where the backend
//!    tells its capacity (`Backend::load`), a job starts on a spare slot (free beyond what
//!    waiting user requests need) while background work holds less than
//!    `max_capacity_share` of the slots, and the backend preempts it when a user request
//!    needs the slot; where it cannot tell, only while no user request is running (and none
//!    ran for a short quiet period) within `max_backend_share`. Always within
//!    `max_concurrent` and `max_tokens_per_minute`; waiting jobs are bounded, newest first,
//!    the oldest dropped.
//! 4. **Refresh-ahead**: entries served at least `refresh_min_hits` times are regenerated
//!    (`Origin::Refresh`) when they come within `refresh_window_secs` of expiry, under the
//!    same budgets. What was learned about the old entry moves to the new one, and so do
//!    the keys that led to it (aliases of paraphrases and wordings, here and in Redis).
//! 5. **Persistence**: the counts can be exported and imported; with a Redis tier attached
//!    ([`Prefetcher::attach_redis`]) they are restored at start, saved every
//!    `persist_interval_secs` (30 s by default) when they changed, and saved on shutdown
//!    (`tasks::BackgroundTasks::stop`).
//!
//! 6. **Regrouping by use** (`regroup`): every 2 s while links are learned, clusters whose
//!    representatives are moderately similar (`regroup_min_cosine`) and that are used alike
//!    (what follows them and what precedes them, as count-weighted embedding profiles) are
//!    merged (`Model::regroup`), with the gate vetting each pair. Wordings of one
//!    question that no safe cosine threshold joins end up in one cluster, so their counts
//!    pool and a prefetched answer is aliased to all of them. Questions never linked to
//!    another (single-turn traffic) have no use to compare and are never merged.
//! 7. **Model-proposed follow-ups** (`propose`, off by default): for a new answer that traffic
//!    predicts fewer than `max_predictions` follow-ups for, a background prompt asks the model
//!    for the user's likely next questions (one worked example, then the conversation); up to
//!    `propose_questions` cleaned lines become prefetch jobs. The prompt is one background
//!    job under the same budgets; each answer is proposed for once.
//!
//! # Layout
//!
//! - `mod.rs`: the [`Prefetcher`] handle, its counters ([`PrefetchStats`]) and the saved
//!   counts in Redis;
//! - `worker.rs`: the worker task (observations in, jobs out, periodic scans and saves);
//! - `learn.rs`: learning from an observation, predicting and queueing its follow-ups, hits
//!   for refresh-ahead, regrouping;
//! - `jobs.rs`: jobs, their queue, dispatch and running them, within the budgets
//!   ([`reprise_policies::prefetch::Budget`], a pure decision);
//! - `refresh.rs`: refresh-ahead of hot entries, prefetched entries wasted;
//! - `propose.rs`: model-proposed follow-ups (the prompt, the questions of its answer);
//! - `model/`: the transition model (counts, clusters, predictions, regrouping, snapshots).
//!
//! The `[prefetch]` settings are [`PrefetchConfig`] in [`crate::config`]; the metric handles
//! are [`PrefetchMetrics`] in [`crate::metrics`].
//!
//! [`generate_in_background`]: crate::generate::generate_in_background
//! [`Observation`]: crate::observe::Observation

mod jobs;
mod learn;
mod model;
mod propose;
mod record;
mod refresh;
mod worker;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use reprise_cache::redis::{RedisError, RedisTier};
use reprise_cache::{now_ms, Digest, EntryId};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::PrefetchMetrics;
use crate::observe::Observer;
use crate::state::AppState;
use jobs::Job;
use learn::SessionLast;
use model::{Model, RegroupParams};
use refresh::Hot;
use reprise_policies::prefetch::{Budgets, BUDGET_WINDOW};

/// The `[prefetch]` section (defined with the rest of the configuration).
pub use crate::config::PrefetchConfig;
/// The learned counts as exported ([`Prefetcher::export`]) and imported.
pub use model::{ClusterSnapshot, NamespaceSnapshot, NodeSnapshot, Snapshot, SNAPSHOT_VERSION};
pub use record::{FinishedJob, PredictionRecord};

/// Observations waiting for the worker; beyond this they are dropped (learning is best
/// effort, the request path never waits).
const OBSERVATION_QUEUE: usize = 4096;
/// Bytes of observations waiting (each holds its request's texts): beyond this they are
/// dropped too.
const OBSERVATION_BYTES: u64 = 64 * 1024 * 1024;
/// Bytes of hot entries' records for refresh-ahead (each holds the request that reaches it).
const HOT_BYTES: u64 = 32 * 1024 * 1024;
/// Bytes of sessions remembered for linking single-turn prompts (namespace and session id of
/// each, with the cache's bookkeeping): about 40,000 sessions of the longest ids.
const SESSIONS_BYTES: u64 = 16 * 1024 * 1024;
/// A session idle this long is forgotten.
const SESSION_IDLE: Duration = Duration::from_secs(3600);
/// Entries remembered as already asked for follow-up proposals.
const MAX_PROPOSED: u64 = 10_000;
/// The most renames waiting for the worker; past it the oldest is dropped (its counts stay
/// under the old id and fade).
const MAX_RENAMES: usize = 4096;
/// Name of the saved counts under the Redis tier's prefix.
pub const BLOB_NAME: &str = "prefetch-transitions";

/// Counters since start, cheap to read (tests, benchmarks, admin pages).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefetchStats {
    /// Observations learned from.
    pub observations: u64,
    /// Observations dropped because the worker was behind.
    pub observations_dropped: u64,
    /// Follow-up links learned (previous entry → this entry).
    pub links: u64,
    /// Follow-ups predicted.
    pub predictions: u64,
    /// Question clusters merged by how they are used (`regroup`).
    pub merges: u64,
    /// Proposal prompts the model answered (`propose`).
    pub proposals: u64,
    /// Follow-up questions proposed by the model (`propose`).
    pub proposed: u64,
    /// Jobs queued (prefetch and refresh).
    pub queued: u64,
    /// Jobs started.
    pub started: u64,
    /// Jobs that generated and stored an entry.
    pub completed: u64,
    /// Prefetch jobs the cache could already answer (nothing generated).
    pub skipped: u64,
    /// Jobs that failed, were preempted, or were dropped from the queue.
    pub cancelled: u64,
    /// Of `cancelled`, generations the backend cut (or refused) because user requests needed
    /// the slot (`Overloaded`).
    pub preempted: u64,
    /// Prefetched entries served for the first time.
    pub hits: u64,
    /// Prefetched entries gone (evicted or expired) without ever being served.
    pub wasted: u64,
    /// Entries regenerated by refresh-ahead.
    pub refreshed: u64,
    /// Tokens generated by background jobs.
    pub tokens: u64,
    /// Seconds background jobs spent generating.
    pub backend_seconds: f64,
    /// Jobs running now.
    pub active: u64,
    /// Most jobs ever running at once.
    pub peak_active: u64,
    /// Jobs waiting now.
    pub waiting: u64,
}

/// Counters behind [`PrefetchStats`].
#[derive(Default)]
struct Counts {
    observations: AtomicU64,
    links: AtomicU64,
    predictions: AtomicU64,
    merges: AtomicU64,
    proposals: AtomicU64,
    proposed: AtomicU64,
    queued: AtomicU64,
    started: AtomicU64,
    completed: AtomicU64,
    skipped: AtomicU64,
    cancelled: AtomicU64,
    preempted: AtomicU64,
    hits: AtomicU64,
    wasted: AtomicU64,
    refreshed: AtomicU64,
    tokens: AtomicU64,
    backend_micros: AtomicU64,
    active: AtomicU64,
    peak_active: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// State shared by the handle, the worker and the job tasks.
struct Shared {
    cfg: PrefetchConfig,
    model: Mutex<Model>,
    sessions: moka::sync::Cache<(String, String), SessionLast>,
    hot: moka::sync::Cache<EntryId, Arc<Hot>>,
    /// Entries the model was already asked to propose follow-ups for.
    proposed_for: moka::sync::Cache<EntryId, ()>,
    queue: Mutex<VecDeque<Job>>,
    /// Exact keys queued or running.
    pending: Mutex<HashSet<Digest>>,
    /// Prefetched entries not yet used, with their expiry.
    prefetched: Mutex<HashMap<EntryId, u64>>,
    /// Refreshed entries whose counts move to their new id (namespace, old, new): applied
    /// by the worker's learning step, off the async threads, since regrouping may hold the
    /// model for its whole budget and a rename walks every node of its namespace.
    renames: Mutex<VecDeque<(String, EntryId, EntryId)>>,
    /// The latest prefetch jobs finished, for diagnostics.
    finished: Mutex<record::Recent<FinishedJob>>,
    /// The latest predictions made after an answer, for diagnostics.
    predicted: Mutex<record::Recent<PredictionRecord>>,
    budget: Mutex<Budgets>,
    slots: Arc<Semaphore>,
    counts: Counts,
    handles: PrefetchMetrics,
    wake: Notify,
    redis: Mutex<Option<RedisTier>>,
    next_job: AtomicU64,
    /// The running embedder's fingerprint: the model learns only its vectors, and keeps
    /// only a saved model's vectors that it made.
    embedder: std::sync::OnceLock<Digest>,
}

/// Handle to the prefetcher.
pub struct Prefetcher {
    shared: Arc<Shared>,
    observer: Observer,
    rx: Mutex<Option<crate::observe::Observations>>,
}

impl Prefetcher {
    /// A prefetcher (not yet running).
    pub fn new(cfg: PrefetchConfig) -> Arc<Prefetcher> {
        let (observer, rx) = Observer::channel(OBSERVATION_QUEUE, OBSERVATION_BYTES);
        let shared = Arc::new(Shared {
            model: Mutex::new(Model::with_budget(cfg.half_life_secs, cfg.model_bytes)),
            // Least recently used first (a new session is never turned away).
            sessions: moka::sync::Cache::builder()
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .max_capacity(SESSIONS_BYTES)
                .weigher(|(namespace, session): &(String, String), _: &SessionLast| {
                    let bytes =
                        namespace.len() + session.len() + std::mem::size_of::<SessionLast>();
                    u32::try_from(bytes)
                        .unwrap_or(u32::MAX)
                        .saturating_add(reprise_cache::ITEM_OVERHEAD)
                })
                .time_to_idle(SESSION_IDLE)
                .build(),
            // Frequency first (moka's default): a record is read on every hit of its entry
            // (`get_with`), so records of entries hit often outlast a flood of misses' ones;
            // a new record is admitted once its entry is hit again.
            hot: moka::sync::Cache::builder()
                .max_capacity(HOT_BYTES)
                .weigher(|_: &EntryId, hot: &Arc<Hot>| {
                    u32::try_from(hot.bytes())
                        .unwrap_or(u32::MAX)
                        .saturating_add(reprise_cache::ITEM_OVERHEAD)
                })
                .build(),
            proposed_for: moka::sync::Cache::builder()
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .max_capacity(MAX_PROPOSED)
                .build(),
            queue: Mutex::new(VecDeque::new()),
            pending: Mutex::new(HashSet::new()),
            prefetched: Mutex::new(HashMap::new()),
            renames: Mutex::new(VecDeque::new()),
            finished: Mutex::new(record::Recent::new()),
            predicted: Mutex::new(record::Recent::new()),
            budget: Mutex::new(Budgets::new(BUDGET_WINDOW)),
            slots: Arc::new(Semaphore::new(cfg.max_concurrent.max(1))),
            counts: Counts::default(),
            handles: PrefetchMetrics::new(),
            wake: Notify::new(),
            redis: Mutex::new(None),
            next_job: AtomicU64::new(0),
            embedder: std::sync::OnceLock::new(),
            cfg,
        });
        Arc::new(Prefetcher {
            shared,
            observer,
            rx: Mutex::new(Some(rx)),
        })
    }

    /// Starts the background worker on `tasks` (once; later calls do nothing). It holds
    /// `state` weakly and stops when `stop` is cancelled or the server is dropped.
    pub fn start(&self, state: Weak<AppState>, tasks: &TaskTracker, stop: CancellationToken) {
        let Some(rx) = self.rx.lock().take() else {
            return;
        };
        let shared = self.shared.clone();
        tasks.spawn(worker::worker(shared, rx, state, stop));
    }

    /// Shares the budgets and the queue out among tenants (`None`: one budget for all).
    pub fn set_shares(&self, shares: Option<crate::policy::Shares>) {
        let (pools, rest) = shares.map_or_else(Default::default, |s| (s.pools, s.rest));
        self.shared.budget.lock().set_shares(pools, rest);
        self.shared.wake.notify_one();
    }

    /// Where the request path reports served requests (the sending side of the worker's
    /// channel).
    pub fn observer(&self) -> Observer {
        self.observer.clone()
    }

    /// Counters since start.
    pub fn stats(&self) -> PrefetchStats {
        let c = &self.shared.counts;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefetchStats {
            observations: l(&c.observations),
            observations_dropped: self.observer.dropped(),
            links: l(&c.links),
            predictions: l(&c.predictions),
            merges: l(&c.merges),
            proposals: l(&c.proposals),
            proposed: l(&c.proposed),
            queued: l(&c.queued),
            started: l(&c.started),
            completed: l(&c.completed),
            skipped: l(&c.skipped),
            cancelled: l(&c.cancelled),
            preempted: l(&c.preempted),
            hits: l(&c.hits),
            wasted: l(&c.wasted),
            refreshed: l(&c.refreshed),
            tokens: l(&c.tokens),
            backend_seconds: l(&c.backend_micros) as f64 / 1e6,
            active: l(&c.active),
            peak_active: l(&c.peak_active),
            waiting: self.shared.queue.lock().len() as u64,
        }
    }

    /// The question clusters of namespace `ns`, each as its observed wordings (the
    /// representative first): for diagnostics and benchmarks.
    pub fn clusters(&self, ns: &str) -> Vec<Vec<String>> {
        self.shared.model.lock().clusters(ns)
    }

    /// The question clusters of namespace `ns` (as [`Prefetcher::clusters`]) as they would be
    /// after regrouping at `score` (the configured `regroup_min_cosine`, `regroup_min_seen`
    /// and the gate apply) until nothing more merges; merges nothing itself. For tuning
    /// `regroup_score` on labelled sessions learned with `regroup` off (`reprise-bench replay
    /// --regroup-curve`). Learning waits while it works on a copy of the namespace (a
    /// diagnostic, never on the request path).
    pub fn regrouped_clusters(&self, ns: &str, score: f32) -> Vec<Vec<String>> {
        let p = RegroupParams {
            min_score: score,
            ..self.shared.regroup_params()
        };
        self.shared
            .model
            .lock()
            .regrouped_clusters(ns, &p, now_ms(), learn::may_merge)
    }

    /// The latest prefetch jobs finished (as many as 4 MiB of their texts hold), oldest
    /// first.
    pub fn finished_jobs(&self) -> Vec<FinishedJob> {
        self.shared.finished.lock().to_vec()
    }

    /// The latest predictions made after an answer (as many as 4 MiB of their texts hold),
    /// oldest first.
    pub fn predictions_made(&self) -> Vec<PredictionRecord> {
        self.shared.predicted.lock().to_vec()
    }

    /// The learned counts.
    pub fn export(&self) -> Snapshot {
        self.shared.model.lock().export(now_ms())
    }

    /// Adds saved counts to what was learned; returns the number of entries read.
    pub fn import(&self, snap: &Snapshot) -> usize {
        self.shared.model.lock().import(snap, now_ms())
    }

    /// Names the running embedder (its [`reprise_embedder::Embedder::fingerprint`]): vectors
    /// of other embedders are neither learned nor restored. Set once, before the worker
    /// starts; without it no vector is.
    pub fn set_embedder(&self, fingerprint: Digest) {
        let _ = self.shared.embedder.set(fingerprint);
    }

    /// Saves the learned counts in Redis (queued like any Redis write; `false` when the
    /// write was dropped).
    pub fn persist(&self, tier: &RedisTier) -> bool {
        self.shared.persist(tier)
    }

    /// Adds the counts saved in Redis, if any; returns the number of entries read.
    pub async fn restore(&self, tier: &RedisTier) -> Result<usize, RedisError> {
        self.shared.restore(tier).await
    }

    /// Lets the worker restore the counts from `tier` and save them there every
    /// `persist_interval_secs` when they changed. May be called before or after [`Prefetcher::start`].
    pub fn attach_redis(&self, tier: RedisTier) {
        *self.shared.redis.lock() = Some(tier);
        self.shared.wake.notify_one();
    }
}

impl Shared {
    /// Queues the counts' save; `false` when it was not queued. A save must leave half the
    /// write queue to the answers (a larger one would be dropped, or crowd them out): past
    /// that, the vectors are left out (rebuilt as questions come), and past it without them,
    /// nothing is saved.
    fn persist(&self, tier: &RedisTier) -> bool {
        let mut snap = self.model.lock().export(now_ms());
        snap.embedder = self.embedder.get().map(hex::encode);
        let room = usize::try_from(tier.queue_budget() / 2).unwrap_or(usize::MAX);
        let mut bytes = match serde_json::to_vec(&snap) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "prefetch: counts not serialisable");
                return false;
            }
        };
        if bytes.len() > room {
            snap.forget_vectors();
            bytes = serde_json::to_vec(&snap).unwrap_or_default();
            tracing::warn!(
                room,
                "prefetch: the saved counts leave their vectors out (over half the redis \
                 write queue with them; raise redis.write_queue_bytes to keep them)"
            );
        }
        if bytes.is_empty() || bytes.len() > room {
            tracing::warn!(
                bytes = bytes.len(),
                room,
                "prefetch: counts not saved (over half the redis write queue)"
            );
            return false;
        }
        tier.put_blob(BLOB_NAME, bytes)
    }

    async fn restore(&self, tier: &RedisTier) -> Result<usize, RedisError> {
        // Saved as JSON: a few times the model's own budget at most.
        let max = usize::try_from(self.cfg.model_bytes.saturating_mul(4)).unwrap_or(usize::MAX);
        let Some(bytes) = tier.get_blob(BLOB_NAME, max).await? else {
            return Ok(0);
        };
        match serde_json::from_slice::<Snapshot>(&bytes) {
            Ok(mut snap) => {
                // Vectors of another embedder (a changed model, a replica on another one,
                // or a snapshot that does not say) would be compared with ours: the counts
                // are kept, the vectors are not.
                if snap.embedder.is_none() || snap.embedder != self.embedder.get().map(hex::encode)
                {
                    snap.forget_vectors();
                }
                Ok(self.model.lock().import(&snap, now_ms()))
            }
            Err(e) => {
                tracing::warn!(error = %e, "prefetch: saved counts do not decode; ignored");
                Ok(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refresh's rename never waits for the model (regrouping may hold it for its whole
    /// budget, and the job tasks that rename run on the async threads): it is queued, and
    /// the worker's learning step moves the counts to the new id.
    #[test]
    fn a_refreshed_entrys_rename_is_queued_while_the_model_is_held() {
        let p = Prefetcher::new(PrefetchConfig::default());
        let (x, y, y2) = (EntryId(1), EntryId(2), EntryId(5));
        let same = |a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>| a == b;
        {
            let mut m = p.shared.model.lock();
            for _ in 0..2 {
                m.observe("ns", x, "x?", None, 0, same);
                m.observe("ns", y, "y?", None, 0, same);
                m.link("ns", x, y, false, 0);
            }
        }
        let held = p.shared.model.lock();
        // On another thread, so a rename that waited for the model fails the test instead of
        // deadlocking it.
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = p.shared.clone();
        std::thread::spawn(move || {
            shared.renamed("ns", y, y2);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the rename waited for the model");
        drop(held);
        let params = crate::prefetch::model::tests::params();
        let before = p.shared.model.lock().predict("ns", x, &params, 0);
        assert_eq!(before[0].target, y, "not applied until the worker's step");
        assert!(p.shared.apply_renames());
        assert!(!p.shared.apply_renames(), "applied once");
        let after = p.shared.model.lock().predict("ns", x, &params, 0);
        assert_eq!(after[0].target, y2);
    }

    /// Finished jobs are remembered with what they asked and how they ended, the latest
    /// within `record::RECORD_BYTES` only.
    #[test]
    fn finished_jobs_are_remembered_within_their_bound() {
        let p = Prefetcher::new(PrefetchConfig::default());
        let req =
            crate::test_support::chat(&[("user", "first"), ("assistant", "a"), ("user", "next?")]);
        p.shared
            .finished("ns", &req, &crate::generate::Background::Skipped);
        let jobs = p.finished_jobs();
        assert_eq!(jobs[0].questions, ["first", "next?"]);
        assert_eq!(
            (jobs[0].namespace.as_str(), jobs[0].outcome),
            ("ns", "skipped")
        );
        // Long texts are cut, and the record keeps within its bytes.
        let long = "é".repeat(10_000);
        let turns: Vec<(&str, &str)> = (0..40).map(|_| ("user", long.as_str())).collect();
        let req = crate::test_support::chat(&turns);
        for _ in 0..2_000 {
            p.shared
                .finished("ns", &req, &crate::generate::Background::Skipped);
        }
        let jobs = p.finished_jobs();
        let last = jobs.last().unwrap();
        assert_eq!(last.questions.len(), record::QUESTIONS);
        assert!(last.questions.iter().all(|q| q.len() <= record::TEXT_BYTES));
        let bytes = p.shared.finished.lock().bytes();
        assert!(bytes <= record::RECORD_BYTES, "{bytes}");
        assert!(jobs.len() < 2_000, "{} jobs of 8 KiB each", jobs.len());
    }

    /// Each answer learned leaves a record of its prediction: what it rested on, the
    /// follow-ups kept and those passed over with the reason; within the same bound.
    #[test]
    fn predictions_are_remembered_with_what_they_passed_over() {
        let cfg = PrefetchConfig {
            enabled: true,
            max_predictions: 1,
            min_probability: 0.2,
            ..PrefetchConfig::default()
        };
        let p = Prefetcher::new(cfg);
        let (x, y, z, w) = (EntryId(1), EntryId(2), EntryId(3), EntryId(4));
        let same = |a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>| a == b;
        let observation = |id: EntryId, prompt: &str, req| {
            crate::test_support::observation(req, prompt, |e| e.id = id)
        };
        {
            let mut m = p.shared.model.lock();
            // After x: y six times, z three times, w once (0.6, 0.3, 0.1).
            for (next, text, times) in [(y, "y?", 6), (z, "z?", 3), (w, "w?", 1)] {
                for _ in 0..times {
                    let now = now_ms();
                    m.observe("n", x, "x?", None, now, same);
                    m.observe("n", next, text, None, now, same);
                    m.link("n", x, next, true, now);
                }
            }
        }
        let req = crate::test_support::chat(&[("user", "x?")]);
        p.shared.learn(observation(x, "x?", req));
        let made = p.predictions_made();
        let last = made.last().expect("a record");
        assert_eq!(last.questions, ["x?"]);
        assert_eq!(last.basis, "entry");
        assert_eq!(last.kept, ["y?"]);
        let passed: Vec<(&str, &str)> = last
            .passed_over
            .iter()
            .map(|(q, _, why)| (q.as_str(), *why))
            .collect();
        assert_eq!(
            passed,
            [("z?", "max_predictions"), ("w?", "min_probability")]
        );
        // An answer never seen before rests on too few observations.
        let req = crate::test_support::chat(&[("user", "new?")]);
        p.shared.learn(observation(EntryId(9), "new?", req));
        let last = p.predictions_made().pop().unwrap();
        assert_eq!((last.basis, last.kept.len()), ("too_few", 0));
        // Bounded as finished jobs are.
        let long = "é".repeat(10_000);
        let turns: Vec<(&str, &str)> = (0..40).map(|_| ("user", long.as_str())).collect();
        for _ in 0..2_000 {
            let req = crate::test_support::chat(&turns);
            p.shared.learn(observation(x, "x?", req));
        }
        assert!(p.shared.predicted.lock().bytes() <= record::RECORD_BYTES);
        assert!(p.predictions_made().len() < 2_000);
    }

    /// Sessions are bounded by bytes, not by count: ids at the longest a request may give
    /// fill the budget with fewer sessions than short ones would.
    #[test]
    fn remembered_sessions_keep_within_their_byte_budget() {
        let p = Prefetcher::new(PrefetchConfig::default());
        let sessions = &p.shared.sessions;
        let long = "s".repeat(crate::request::MAX_SESSION_BYTES - 8);
        for i in 0..100_000u64 {
            let key = ("namespace".to_string(), format!("{long}{i:08}"));
            sessions.insert(
                key,
                SessionLast {
                    entry: EntryId(u128::from(i)),
                },
            );
        }
        sessions.run_pending_tasks();
        assert!(sessions.weighted_size() <= SESSIONS_BYTES);
        let each = (9 + crate::request::MAX_SESSION_BYTES) as u64;
        assert!(
            sessions.entry_count() <= SESSIONS_BYTES / each,
            "{} sessions of {each} bytes each",
            sessions.entry_count()
        );
    }

    /// Refresh-ahead's hot records hold the request that reaches each entry: they are
    /// bounded by those requests' bytes, not by a count of records.
    #[test]
    fn hot_records_keep_within_their_byte_budget() {
        let p = Prefetcher::new(PrefetchConfig::default());
        let hot = &p.shared.hot;
        let question = "q".repeat(256 * 1024);
        for i in 0..400u64 {
            // Half carry their bulk in the long question, half in a field passed through
            // (`extra`, up to the body limit): both count.
            let mut request = crate::test_support::chat(&[("user", "short")]);
            match i % 2 {
                0 => request.input = reprise_backend::Input::Prompt(question.clone()),
                _ => {
                    let big = serde_json::json!({"schema": question.clone()});
                    request.extra.insert("response_format".into(), big);
                }
            }
            let record = Hot {
                namespace: "namespace".into(),
                endpoint: crate::openai::Endpoint::Chat,
                request,
                expires_ms: u64::MAX,
                hits: AtomicU64::new(0),
                refreshing: std::sync::atomic::AtomicBool::new(false),
            };
            hot.insert(EntryId(u128::from(i)), Arc::new(record));
        }
        hot.run_pending_tasks();
        assert!(hot.weighted_size() <= HOT_BYTES);
        let each = question.len() as u64;
        assert!(
            hot.entry_count() <= HOT_BYTES / each,
            "{}",
            hot.entry_count()
        );
    }

    /// The model learns the vectors of the running embedder only: an entry that carries
    /// another's (stored before a model change) is learned by its wording alone.
    #[test]
    fn only_the_running_embedders_vectors_are_learned() {
        let learned_vectors = |made_by: [u8; 32]| {
            let p = Prefetcher::new(PrefetchConfig::default());
            p.set_embedder([1; 32]);
            let request = crate::test_support::chat(&[("user", "a question")]);
            p.shared.learn(crate::test_support::observation(
                request,
                "a question",
                |e| {
                    e.embedding = Some(reprise_cache::Vector::new(&[0.6, 0.8]));
                    e.embedder = Some(made_by);
                },
            ));
            let snap = p.export();
            assert_eq!(snap.namespaces[0].nodes.len(), 1);
            snap.namespaces[0].nodes[0].embedding.is_some()
        };
        assert!(learned_vectors([1; 32]));
        assert!(!learned_vectors([2; 32]));
    }
}
