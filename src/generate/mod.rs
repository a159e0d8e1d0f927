//! Backend generations: a spawned driver task runs `Backend::generate` into a [`Flight`]
//! (every waiter replays its events), writes the answer back when it finished, and only then
//! tells the waiters of the end.
//!
//! - [`spawn`]: start one generation (interactive, led by a request, or background);
//! - [`write_back`]: store a finished answer in every tier and link it for the next turn;
//! - [`background`]: generate a request at background priority unless the cache answers it
//!   (prefetch and refresh-ahead use this, and nothing of the request path); regenerate
//!   behind a stale answer (stale-while-revalidate, [`background::revalidate`]); and the
//!   backend's spare slots for such work ([`room`], also read by the checks of hits).

pub mod background;
mod deadlines;
mod write_back;

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use reprise_backend::{BackendError, FinishReason, GenEvent, GenRequest, Usage};
use reprise_cache::Digest;

use crate::flight::{End, Flight};
use crate::lookup::WritePlan;
use crate::routes::{Fallback, Routed, Target};
use crate::state::AppState;
pub(crate) use background::revalidate;
pub use background::{generate_in_background, generate_tagged, room, users_on, Background, Room};
pub(crate) use deadlines::{answer, Deadlines};
pub(crate) use write_back::write_back;

/// Starts the task that runs one generation into `flight` and, with a `plan`, writes the
/// entry back. `key`: the exact key the flight is registered under (removed at the end).
/// `fallback`: the backend that answers instead when the one serving `req.model` is
/// saturated or refuses (its answer is not written back: it is not that model's).
pub(crate) fn spawn(
    state: Arc<AppState>,
    flight: Arc<Flight>,
    key: Option<Digest>,
    req: GenRequest,
    plan: Option<WritePlan>,
    fallback: Option<Fallback>,
) {
    let partition = plan.as_ref().and_then(|p| p.partition);
    tokio::spawn(async move {
        // Whatever happens to this task (a panic included), the waiters learn of an end and
        // the flight stops taking followers.
        let settle = Settle {
            state: state.clone(),
            flight: flight.clone(),
            key,
            partition,
        };
        let start = Instant::now();
        // The backend whose stream this is, once one started (calls and refusals before
        // that are counted by the router).
        let mut streaming: Option<Arc<Target>> = None;
        let result = tokio::select! {
            r = drive(&state, &flight, req, fallback.as_ref(), &mut streaming) => r,
            _ = flight.cancelled().cancelled() => Err(BackendError::Internal("abandoned by every client".into())),
        };
        let took = start.elapsed();
        if let Some(t) = &streaming {
            crate::metrics::backend_duration(&t.name, took.as_secs_f64());
        }
        match result {
            Ok((text, reason, usage)) => {
                // Stored before the waiters learn of the end, so a request that arrives right
                // after a client got its answer finds it (a moka insert is microseconds).
                // A fallback's answer is not the model's the keys are for, and an answer a
                // content filter cut short is not whole: neither is stored.
                let whole = reason != FinishReason::ContentFilter;
                if let Some(mut plan) = plan.filter(|_| flight.fallback().is_none() && whole) {
                    // The followers' tags too: a tag delete any of them asks for must reach
                    // the answer. Beyond the tag limit the answer is served, not stored (a
                    // delete could miss it).
                    for t in flight.take_tags() {
                        if !plan.tags.contains(&t) {
                            plan.tags.push(t);
                        }
                    }
                    if plan.tags.len() <= crate::request::MAX_TAGS {
                        if let Some(near) = plan.near_miss.take() {
                            crate::bounds::check_near_miss(&state, near, text.clone());
                        }
                        let gen_ms = u32::try_from(took.as_millis()).unwrap_or(u32::MAX);
                        write_back(&state, plan, text, reason, usage, gen_ms).await;
                    } else {
                        tracing::debug!(tags = plan.tags.len(), "answer not stored: too many tags");
                    }
                }
                flight.end(End::Finished);
            }
            Err(e) => {
                state.metrics.incomplete_generations.increment(1);
                // A generation every client left is not the backend's failure.
                if let Some(t) = streaming.filter(|_| !flight.cancelled().is_cancelled()) {
                    crate::metrics::backend_error(&t.name, e.kind());
                }
                flight.end(End::Failed(e));
            }
        }
        drop(settle);
    });
}

/// Ends a generation's bookkeeping when its task ends, however it ends: a task that
/// panicked tells its waiters it failed (else they would wait for ever, and new requests
/// for the key would follow it), and the flight stops taking followers.
struct Settle {
    state: Arc<AppState>,
    flight: Arc<Flight>,
    key: Option<Digest>,
    partition: Option<Digest>,
}

impl Drop for Settle {
    fn drop(&mut self) {
        if !self.flight.is_ended() {
            let e = BackendError::Internal("the generation stopped unexpectedly".into());
            self.flight.end(End::Failed(e));
        }
        if let Some(key) = &self.key {
            self.state.flights.remove(key, &self.flight);
        }
        if let Some(partition) = &self.partition {
            self.state.paraphrases.remove(partition, &self.flight);
        }
    }
}

/// Runs the backend stream into the flight; returns the assembled answer only if a finish
/// reason was seen.
async fn drive(
    state: &AppState,
    flight: &Flight,
    req: GenRequest,
    fallback: Option<&Fallback>,
    streaming: &mut Option<Arc<Target>>,
) -> Result<(String, FinishReason, Usage), BackendError> {
    // A stall between tokens cuts a generation off (background ones too: a stalled upstream
    // would hold a prefetch permit forever). A user generation's first token comes within
    // the first-token timeout of its start, queue included: past it its first client has
    // been answered 504, and one stuck before its first token (an upstream that never
    // answers) would otherwise live on, holding its slot, while identical requests keep
    // joining it. Background ones have their own deadlines (`Deadlines`).
    let gap = state.config.server.token_timeout();
    let user = req.priority != reprise_backend::Priority::Background;
    let begun = Instant::now();
    let first_by = tokio::time::Instant::now() + state.config.server.first_token_timeout();
    let routing = state.router.generate_routed(req, fallback);
    let routed = match user {
        true => tokio::time::timeout_at(first_by, routing)
            .await
            .map_err(|_| BackendError::Timeout)?,
        false => routing.await,
    };
    let Routed {
        mut stream,
        target,
        fell_back,
        unqueued,
    } = routed?;
    *streaming = Some(target.clone());
    if let Some(model) = fell_back {
        flight.fell_back(model);
    }
    let mut first_token = None;
    let mut text = String::new();
    let mut started = false;
    loop {
        let next = if started {
            tokio::time::timeout(gap, stream.next())
                .await
                .map_err(|_| BackendError::Timeout)?
        } else if user {
            tokio::time::timeout_at(first_by, stream.next())
                .await
                .map_err(|_| BackendError::Timeout)?
        } else {
            stream.next().await
        };
        started = true;
        first_token.get_or_insert_with(|| begun.elapsed());
        let Some(ev) = next else { break };
        match ev? {
            GenEvent::Delta(d) => {
                text.push_str(&d);
                flight.push(GenEvent::Delta(d));
            }
            GenEvent::Finish { reason, usage } => {
                // Service times of user generations that found a free slot: what the
                // wait predictions of `[degrade]` start from.
                if user && unqueued {
                    target.record(first_token.unwrap_or_default(), begun.elapsed());
                }
                flight.push(GenEvent::Finish { reason, usage });
                return Ok((text, reason, usage));
            }
        }
    }
    Err(BackendError::Unavailable(
        "the backend stream ended without a finish reason".into(),
    ))
}
