//! Deadlines of a generation nobody waits on (prefetch, refresh-ahead, proposals, checks of
//! hits): a client's request has its own, but without these a backend that never answers
//! (a stalled upstream, a queue that never frees a slot) would hold background work forever.

use std::future::Future;

use futures::StreamExt;
use reprise_backend::{BackendError, FinishReason, GenEvent, GenRequest, Usage};
use tokio::time::{Duration, Instant};

use crate::config::ServerConfig;
use crate::state::AppState;

/// The first event within `server.first_token_timeout_secs` of the start (the backend's
/// opening of the stream included), each later one within `server.token_timeout_secs`, all
/// within `server.request_timeout_secs` of the start.
pub(crate) struct Deadlines {
    first_by: Instant,
    gap: Duration,
    end: Instant,
    started: bool,
}

impl Deadlines {
    /// Deadlines counted from now.
    pub(crate) fn new(server: &ServerConfig) -> Self {
        let now = Instant::now();
        let end = now + server.request_timeout();
        Deadlines {
            first_by: end.min(now + server.first_token_timeout()),
            gap: server.token_timeout(),
            end,
            started: false,
        }
    }

    /// Awaits the backend's opening of a stream (`open`: a slot, an upstream's headers)
    /// within the first event's deadline, or [`BackendError::Timeout`].
    pub(crate) async fn open<T>(
        &self,
        open: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        tokio::time::timeout_at(self.first_by, open)
            .await
            .map_err(|_| BackendError::Timeout)?
    }

    /// Awaits the next event (`next`), or [`BackendError::Timeout`] past its deadline.
    pub(crate) async fn next<T>(
        &mut self,
        next: impl Future<Output = Option<T>>,
    ) -> Result<Option<T>, BackendError> {
        let by = match self.started {
            true => self.end.min(Instant::now() + self.gap),
            false => self.first_by,
        };
        self.started = true;
        tokio::time::timeout_at(by, next)
            .await
            .map_err(|_| BackendError::Timeout)
    }
}

/// The whole answer of `req` from the backend, not stored (proposals, checks of hits): its
/// text, why it ended and its usage, within [`Deadlines`] from the call (opening the stream
/// included). An incomplete stream is an error.
pub(crate) async fn answer(
    state: &AppState,
    req: GenRequest,
) -> Result<(String, FinishReason, Usage), BackendError> {
    let mut deadlines = Deadlines::new(&state.config.server);
    let mut stream = deadlines.open(state.backend.generate(req)).await?;
    let mut text = String::new();
    while let Some(ev) = deadlines.next(stream.next()).await? {
        match ev? {
            GenEvent::Delta(t) => text.push_str(&t),
            GenEvent::Finish { reason, usage } => return Ok((text, reason, usage)),
        }
    }
    Err(BackendError::Internal(
        "the stream ended without finishing".into(),
    ))
}
