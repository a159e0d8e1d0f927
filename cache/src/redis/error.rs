//! Errors of the Redis tier, its health snapshot, and how a redis-rs error is classified:
//! an outage (counts against the breaker) or Redis refusing one request.

/// Errors of the Redis tier. Callers treat every one as "no answer from L2" and carry on.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The configuration cannot be used (no url, unparsable url).
    #[error("redis configuration: {0}")]
    Config(String),
    /// The circuit breaker is open (or the tier is shutting down): not even tried.
    #[error("redis unavailable")]
    Unavailable,
    /// The command did not answer within `timeout_ms`.
    #[error("redis command timed out")]
    Timeout,
    /// Redis could not be reached or the connection broke.
    #[error("redis connection: {0}")]
    Connection(#[source] ::redis::RedisError),
    /// Redis answered with an error.
    #[error("redis command: {0}")]
    Command(#[source] ::redis::RedisError),
}

impl RedisError {
    /// Low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            RedisError::Config(_) => "config",
            RedisError::Unavailable => "unavailable",
            RedisError::Timeout => "timeout",
            RedisError::Connection(_) => "connection",
            RedisError::Command(_) => "command",
        }
    }
}

/// A snapshot of the tier's state, for health endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisHealth {
    /// The last command reached Redis and the breaker is closed.
    pub up: bool,
    /// Calls currently fail fast.
    pub breaker_open: bool,
    /// Writes waiting in the queue.
    pub queued_writes: usize,
    /// Writes dropped since start (queue full, breaker open, or failed).
    pub dropped_writes: u64,
}

/// The first outage among the replies of a batch of commands, as the batch's error (errors
/// about one command alone stay with its reply).
pub(super) fn first_outage<T>(
    replies: &[Result<T, ::redis::RedisError>],
) -> Result<(), ::redis::RedisError> {
    match replies
        .iter()
        .find_map(|r| r.as_ref().err().filter(|e| is_outage(e)))
    {
        Some(e) => Err(e.clone()),
        None => Ok(()),
    }
}

/// Whether an error means Redis could not serve (counts against the breaker), as opposed to
/// Redis answering with an error about this request.
pub(super) fn is_outage(e: &::redis::RedisError) -> bool {
    use ::redis::{ErrorKind, ServerErrorKind};
    match e.kind() {
        ErrorKind::Io | ErrorKind::ClusterConnectionNotFound | ErrorKind::AuthenticationFailed => {
            true
        }
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => true,
        _ => e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal(),
    }
}

/// Whether Redis refused the command because the key holds another type (a foreign value).
pub(super) fn is_wrong_type(e: &RedisError) -> bool {
    matches!(e, RedisError::Command(e) if e.code() == Some("WRONGTYPE"))
}
