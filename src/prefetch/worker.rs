//! The worker: one task that learns from the observations, starts the waiting jobs when the
//! backend is free, regroups clusters, scans for refresh and waste, and saves the counts.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::observe::Event;
use crate::state::AppState;

/// Worker tick while jobs wait (to catch the backend going idle).
const POLL: Duration = Duration::from_millis(10);
/// The most observations learned in one turn of the worker's loop.
const LEARN_BATCH: usize = 256;
/// Worker tick while nothing waits.
const IDLE_TICK: Duration = Duration::from_millis(100);
/// How often hot entries are checked for refresh and prefetched entries for waste.
const SCAN_EVERY: Duration = Duration::from_millis(250);
/// How often clusters are regrouped by use (when links were learned since).
const REGROUP_EVERY: Duration = Duration::from_secs(2);

impl Shared {
    /// Learns from one event of the observation channel.
    fn apply(&self, ev: Event) {
        match ev {
            Event::Served(obs) => self.learn(*obs),
            Event::PrefetchUsed(id) => self.used(id),
        }
    }
}

/// Keeps the quiet periods: a miss just answered ends on its backend, which (of unknown
/// capacity) is quiet only from now (the same client's next request often follows at once),
/// whether or not a job was waiting to see it run. A hit used no backend, and another
/// backend's users hold back none of this one's.
fn heard(state: &AppState, quiet_since: &mut HashMap<String, Instant>, ev: &Event) {
    if let Event::Served(obs) = ev {
        if obs.generated {
            quiet_since.insert(super::jobs::backend_of(state, &obs.request), Instant::now());
        }
    }
}

/// The worker: learns from observations, starts jobs, scans for refresh and waste, saves
/// the counts.
pub(super) async fn worker(
    shared: Arc<Shared>,
    mut rx: crate::observe::Observations,
    state: Weak<AppState>,
    stop: CancellationToken,
) {
    let mut quiet_since = HashMap::new();
    let mut last_scan = Instant::now();
    let mut last_persist = Instant::now();
    let mut last_regroup = Instant::now();
    let mut links_at_regroup = 0;
    let mut restored = false;
    // How often the counts are saved to Redis (when they changed); validated positive.
    let persist_every = Duration::from_secs_f64(shared.cfg.persist_interval_secs);
    loop {
        let wait = if shared.queue.lock().is_empty() {
            IDLE_TICK
        } else {
            POLL
        };
        let first = tokio::select! {
            m = rx.recv() => match m {
                Some(m) => Some(m),
                None => return,
            },
            _ = shared.wake.notified() => None,
            _ = tokio::time::sleep(wait) => None,
            _ = stop.cancelled() => {
                // What was observed before the stop is learned, so the counts saved at
                // shutdown include it.
                shared.apply_renames();
                while let Some(ev) = rx.try_recv() {
                    shared.apply(ev);
                }
                return;
            }
        };
        let Some(state) = state.upgrade() else {
            return;
        };
        // A bounded batch: what arrives faster than it is learned waits for the next turn
        // (the channel is bounded too), so dispatch and the scans below always get theirs.
        // Learning compares each question with its namespace's clusters: off the async
        // threads, which serve the requests.
        let batch: Vec<Event> = first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv()))
            .take(LEARN_BATCH)
            .collect();
        for ev in &batch {
            heard(&state, &mut quiet_since, ev);
        }
        if !batch.is_empty() || !shared.renames.lock().is_empty() {
            let s = shared.clone();
            let learning = tokio::task::spawn_blocking(move || {
                s.apply_renames();
                batch.into_iter().for_each(|ev| s.apply(ev));
            });
            if let Err(e) = learning.await {
                tracing::warn!(error = %e, "prefetch: learning failed");
            }
        }
        let tier = shared.redis.lock().clone();
        if let Some(tier) = tier {
            if !restored {
                match shared.restore(&tier).await {
                    Ok(n) => {
                        restored = true;
                        tracing::info!(entries = n, "prefetch: counts restored");
                    }
                    Err(e) => tracing::debug!(error = %e, "prefetch: restore failed"),
                }
            } else if last_persist.elapsed() >= persist_every {
                last_persist = Instant::now();
                // Not queued (the queue full, Redis down): tried again next time.
                if shared.model.lock().take_changed() && !shared.persist(&tier) {
                    shared.model.lock().set_changed();
                }
            }
        }
        if shared.cfg.regroup && last_regroup.elapsed() >= REGROUP_EVERY {
            last_regroup = Instant::now();
            let links = shared.counts.links.load(Ordering::Relaxed);
            if links != links_at_regroup {
                links_at_regroup = links;
                // Quadratic in the clusters compared (bounded): off the async threads.
                let s = shared.clone();
                let _ = tokio::task::spawn_blocking(move || s.regroup()).await;
            }
        }
        if last_scan.elapsed() >= SCAN_EVERY {
            last_scan = Instant::now();
            if shared.cfg.refresh_ahead {
                shared.scan_hot(&state).await;
            }
            shared.scan_wasted(&state);
        }
        if shared.cfg.enabled || shared.cfg.refresh_ahead {
            shared.dispatch(&state, &mut quiet_since);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::Observation;
    use crate::test_support::{chat, observation};

    /// Only a miss restarts a quiet period, and only its own backend's.
    #[test]
    fn a_miss_restarts_its_backends_quiet_period_and_a_hit_none() {
        let state = AppState::new(
            crate::config::Config::default(),
            Arc::new(reprise_backend::fake::ScriptedBackend::new(
                reprise_backend::fake::ScriptConfig::default(),
            )),
            None,
        )
        .unwrap();
        let req = chat(&[("user", "q")]);
        let backend = super::super::jobs::backend_of(&state, &req);
        let long_ago = Instant::now() - Duration::from_secs(60);
        let mut quiet = HashMap::from([
            (backend.clone(), long_ago),
            ("another".to_string(), long_ago),
        ]);
        let served = |generated| {
            let obs = Observation {
                generated,
                ..observation(req.clone(), "q", |_| {})
            };
            Event::Served(Box::new(obs))
        };
        heard(&state, &mut quiet, &served(false));
        assert_eq!(quiet[&backend], long_ago, "a hit used no backend");
        heard(&state, &mut quiet, &served(true));
        assert!(quiet[&backend] > long_ago, "quiet from the miss on");
        assert_eq!(quiet["another"], long_ago, "another backend's stays");
    }
}
