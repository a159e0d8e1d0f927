//! Per-request bookkeeping: the request metrics and the request log line, written once when
//! the request is done (for streams, when the stream ends or the client goes away).

use std::sync::Arc;
use std::time::Instant;

use reprise_cache::{now_ms, Entry};

use crate::candidate::Candidate;
use crate::degraded::Degraded;
use crate::error::ApiError;
use crate::lookup::Notes;
use crate::metrics::{Finished, Outcome, Saved, Stage};
use crate::openai::Endpoint;
use crate::reqlog::{cut, LogRecord};
use crate::state::AppState;

/// The error of a request whose client left its streamed answer before the end.
pub const CLIENT_CLOSED: &str = "client_closed";

/// The bookkeeping of one client request; recorded on drop.
pub struct Bookkeeping {
    state: Option<Arc<AppState>>,
    start: Instant,
    /// How the request is being answered (an error recorded with [`Bookkeeping::failed`]
    /// overrides it).
    pub outcome: Outcome,
    error: Option<&'static str>,
    first_token: Option<f64>,
    /// The request log line being filled in.
    pub record: LogRecord,
    /// The canary side the request is on, when its tenant tries a canary candidate.
    pub canary: Option<CanarySide>,
    /// How its answer was degraded, if it was.
    degraded: Option<Degraded>,
    /// Whether something reads the whole line (the request log, traces): otherwise the
    /// strings only those read are not made.
    detailed: bool,
    /// A response stream is being sent: dropped before it ended, the client left
    /// (recorded as the error `client_closed`, not as an answer sent whole).
    streaming: bool,
}

/// A request on one side of a tenant's canary: its outcome and latency are recorded there.
pub struct CanarySide {
    /// The tenant's name.
    pub tenant: String,
    /// The candidate being tried.
    pub candidate: Arc<Candidate>,
    /// Served under the candidate (else the control side).
    pub on_candidate: bool,
}

impl Bookkeeping {
    /// Bookkeeping for a request to `endpoint`, started now.
    pub fn new(state: &Arc<AppState>, endpoint: Endpoint) -> Self {
        Bookkeeping {
            detailed: state.request_log.is_some() || state.traces.is_some(),
            state: Some(state.clone()),
            start: Instant::now(),
            outcome: Outcome::Error,
            error: None,
            first_token: None,
            record: LogRecord {
                time_ms: now_ms(),
                endpoint: match endpoint {
                    Endpoint::Chat => "/v1/chat/completions",
                    Endpoint::Completion => "/v1/completions",
                },
                ..Default::default()
            },
            canary: None,
            degraded: None,
            streaming: false,
        }
    }

    /// Bookkeeping that records nothing (left behind when the real one moves into a stream,
    /// and for work that is not a client request).
    pub fn detached() -> Self {
        Bookkeeping {
            state: None,
            start: Instant::now(),
            outcome: Outcome::Error,
            error: None,
            first_token: None,
            record: LogRecord::default(),
            canary: None,
            degraded: None,
            detailed: false,
            streaming: false,
        }
    }

    /// Notes that a response stream starts; [`Bookkeeping::stream_ended`] when it ends.
    pub fn stream_started(&mut self) {
        self.streaming = true;
    }

    /// Notes that the response stream ended (whole, or with an error it sent).
    pub fn stream_ended(&mut self) {
        self.streaming = false;
    }

    /// Moves the bookkeeping out (into a response stream), leaving a detached one behind.
    pub fn take(&mut self) -> Self {
        std::mem::replace(self, Bookkeeping::detached())
    }

    /// Whether this records a client request (metrics, log).
    pub fn is_counted(&self) -> bool {
        self.state.is_some()
    }

    /// Whether the whole line is read (the request log, traces): ids and the question of an
    /// exact hit are kept only then (the metrics and the stats ring do not read them).
    pub fn is_detailed(&self) -> bool {
        self.detailed
    }

    /// Notes the first token (or the whole answer of a hit) as sent now; later calls do
    /// nothing.
    pub fn first_token(&mut self) {
        if self.first_token.is_none() {
            let t = self.start.elapsed().as_secs_f64();
            self.first_token = Some(t);
            if matches!(self.outcome, Outcome::Miss | Outcome::Bypass) {
                self.record.backend_ms = Some(t * 1000.0);
            }
        }
    }

    /// Notes the entry a hit is answered from: what it saves (its tokens, its backend
    /// time, their price) and, for a hit by meaning, the question it was generated for.
    pub fn served_from(&mut self, entry: &Entry, outcome: Outcome) {
        let Some(state) = &self.state else {
            return;
        };
        let by_meaning = matches!(outcome, Outcome::Semantic | Outcome::Prefetch);
        if self.detailed || by_meaning {
            self.record.entry_id = Some(entry.id.to_string());
        }
        self.record.saved_prompt_tokens = entry.prompt_tokens;
        self.record.saved_completion_tokens = entry.completion_tokens;
        self.record.saved_backend_ms = entry.gen_ms;
        self.record.saved_cost = state
            .config
            .metrics
            .prices
            .get(&entry.model)
            .map_or(0.0, |p| {
                p.cost(entry.prompt_tokens, entry.completion_tokens)
            });
        if by_meaning {
            self.record.matched = cut(&entry.prompt, state.config.log.question_chars);
        }
    }

    /// Notes that the answer is degraded (`kind`): in the log line and, when the request
    /// ends, in `reprise_degraded_total`.
    pub fn degraded(&mut self, kind: Degraded) {
        self.degraded = Some(kind);
        self.record.degraded = Some(kind.as_str());
    }

    /// Notes the question asked (cut to `log.question_chars`).
    pub fn question(&mut self, text: &str) {
        if let Some(state) = &self.state {
            self.record.question = cut(text, state.config.log.question_chars);
        }
    }

    /// Copies what the cache lookup saw into the log line.
    pub fn note(&mut self, notes: &Notes) {
        self.record.exact_ms = notes.exact_ms;
        self.record.tier = notes.tier;
        self.record.embed_ms = notes.embed_ms;
        self.record.search_ms = notes.search_ms;
        self.record.similarity = notes.similarity;
        self.record.threshold = notes.threshold;
        self.record.gate = notes.gate;
        self.record.standalone = notes.standalone;
    }

    /// Records the request as failed with `e`.
    pub fn fail(&mut self, e: &ApiError) {
        self.failed(e.kind());
    }

    /// Records the request as failed, by error kind.
    pub fn failed(&mut self, kind: &'static str) {
        self.error = Some(kind);
    }
}

impl Drop for Bookkeeping {
    fn drop(&mut self) {
        let Some(state) = self.state.take() else {
            return;
        };
        if self.streaming && self.error.is_none() {
            self.error = Some(CLIENT_CLOSED);
        }
        let outcome = if self.error.is_some() {
            Outcome::Error
        } else {
            self.outcome
        };
        let total = self.start.elapsed().as_secs_f64();
        let mut rec = std::mem::take(&mut self.record);
        rec.outcome = outcome.as_str();
        rec.error = self.error;
        rec.total_ms = total * 1000.0;
        rec.ttft_ms = self.first_token.map(|t| t * 1000.0);
        let hit = matches!(
            outcome,
            Outcome::Exact | Outcome::Semantic | Outcome::Prefetch
        );
        if outcome != Outcome::Exact {
            rec.tier = None;
        }
        if !hit {
            rec.saved_prompt_tokens = 0;
            rec.saved_completion_tokens = 0;
            rec.saved_backend_ms = 0;
            rec.saved_cost = 0.0;
            rec.matched = None;
        }
        if outcome == Outcome::Error {
            // Whatever it was going to be, it was not served.
            rec.degraded = None;
        }
        record_metrics(&state, outcome, &rec, total, self.first_token, hit);
        if let Some(kind) = self.degraded.filter(|_| rec.degraded.is_some()) {
            state.metrics.degraded(kind);
        }
        // A client that left says nothing of the policy that answered it: not judged.
        let left = rec.error == Some(CLIENT_CLOSED);
        if let Some(side) = self.canary.take().filter(|_| !left) {
            state
                .metrics
                .canary(&side.tenant, side.on_candidate, outcome);
            if let Some(reason) = side.candidate.record(side.on_candidate, outcome, total) {
                let judged = side.candidate.config().clone();
                crate::policy::roll_back(state.clone(), side.tenant, judged, reason);
            }
        }
        if let Some(traces) = &state.traces {
            rec.trace_id = traces.finished(&rec);
        }
        state.stats.record(&rec);
        if let Some(log) = &state.request_log {
            log.write(rec);
        }
    }
}

/// The metrics of a finished request: by outcome, tenant and model, its stages, what a hit
/// saved, the gate's rejection and a miss's best similarity.
fn record_metrics(
    state: &AppState,
    outcome: Outcome,
    rec: &LogRecord,
    total: f64,
    first_token: Option<f64>,
    hit: bool,
) {
    let m = &state.metrics;
    m.request(
        outcome,
        &Finished {
            tenant: &rec.tenant,
            model: &rec.model,
            total,
            first_token,
            saved: hit.then(|| Saved {
                prompt_tokens: rec.saved_prompt_tokens,
                completion_tokens: rec.saved_completion_tokens,
                backend_seconds: f64::from(rec.saved_backend_ms) / 1000.0,
                cost: rec.saved_cost,
            }),
        },
    );
    for (stage, ms) in [
        (Stage::Exact, rec.exact_ms),
        (Stage::Embed, rec.embed_ms),
        (Stage::Search, rec.search_ms),
        (Stage::FirstToken, rec.backend_ms),
    ] {
        if let Some(ms) = ms {
            m.stage(stage, ms / 1000.0);
        }
    }
    if let Some(reason) = rec.gate.filter(|g| *g != "pass") {
        m.gate_rejection(reason);
    }
    if let (Outcome::Miss | Outcome::Bypass, Some(sim)) = (outcome, rec.similarity) {
        m.miss_similarity(&rec.tenant, sim);
    }
}
