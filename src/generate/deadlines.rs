//! Deadlines of a generation nobody waits on (prefetch, refresh-ahead, proposals, checks of
//! hits): a client's request has its own, but without these a backend that never answers
//! (a stalled upstream, a queue that never frees a slot) would hold background work forever.

use std::future::Future;

use reprise_backend::BackendError;
use tokio::time::{Duration, Instant};

use crate::config::ServerConfig;

/// The first event within `server.first_token_timeout_secs`, each later one within
/// `server.token_timeout_secs`, all within `server.request_timeout_secs` of the start.
pub(crate) struct Deadlines {
    first: Duration,
    gap: Duration,
    end: Instant,
    started: bool,
}

impl Deadlines {
    /// Deadlines counted from now.
    pub(crate) fn new(server: &ServerConfig) -> Self {
        Deadlines {
            first: server.first_token_timeout(),
            gap: server.token_timeout(),
            end: Instant::now() + server.request_timeout(),
            started: false,
        }
    }

    /// Awaits the next event (`next`), or [`BackendError::Timeout`] past its deadline.
    pub(crate) async fn next<T>(
        &mut self,
        next: impl Future<Output = Option<T>>,
    ) -> Result<Option<T>, BackendError> {
        let wait = if self.started { self.gap } else { self.first };
        self.started = true;
        let by = self.end.min(Instant::now() + wait);
        tokio::time::timeout_at(by, next)
            .await
            .map_err(|_| BackendError::Timeout)
    }
}
