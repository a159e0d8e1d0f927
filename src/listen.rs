//! The HTTP listener: HTTP/1.1 and h2c on one port, with bounds on what a connection may hold
//! before it has asked anything.
//!
//! `axum::serve` sets none: without a timer hyper drops its header-read timeout, and the
//! protocol sniff of an `auto` connection waits for its first bytes for ever, so sockets that
//! send nothing (or a header a byte a minute) are held until the process runs out of file
//! descriptors, and `/healthz` with every other client then stalls. Here:
//! - a connection must start a request within `server.header_timeout_secs` of being accepted
//!   (the sniff, an h2 preface and the first request's headers included), and an HTTP/1.1
//!   connection must send each request's headers within that time of starting it or of
//!   finishing the previous one (hyper's header-read timeout, which also ends idle keep-alive
//!   connections); an HTTP/2 connection is pinged at that interval and closed when a ping
//!   goes unanswered;
//! - at most `server.max_connections` are open at once on each listener (the API's, and the
//!   admin one's when it has its own): one more is closed as soon as it is accepted (counted
//!   in `reprise_connections_refused_total`), rather than left in the kernel's backlog, so a
//!   client sees its connection closed at once.
//!
//! An HTTP/2 connection that answers pings stays open between requests (hyper has no idle
//! timeout for it): it holds one of the slots until the client closes it.
//!
//! A request's body and its answer have their own bounds (`body_timeout_secs`, the request,
//! token and first-token timeouts).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// What one listener lets a connection hold.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// How long a connection may take to start a request, and an HTTP/1.1 one to send a
    /// request's headers or to wait idle between requests.
    pub header_timeout: Duration,
    /// Connections open at once at most.
    pub max_connections: usize,
}

impl ConnectionLimits {
    /// The limits `config` sets.
    pub fn of(config: &crate::config::ServerConfig) -> Self {
        ConnectionLimits {
            header_timeout: config.header_timeout(),
            max_connections: config.max_connections,
        }
    }
}

/// Serves `router` on `listener` until `stop` is cancelled, then waits for the open
/// connections to finish their requests (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.header_timeout))
        .keep_alive_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let stream = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // A connection reset or aborted before it was taken: the next one.
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin, and go on.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics::counter!("reprise_connections_refused_total").increment(1);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let asked = Arc::new(AtomicBool::new(false));
        let service = {
            let (router, asked) = (router.clone(), asked.clone());
            hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                asked.store(true, Ordering::Relaxed);
                router.clone().oneshot(req.map(Body::new))
            })
        };
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        let first_request = limits.header_timeout;
        tokio::spawn(async move {
            let _slot = slot;
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tokio::time::sleep(first_request) => {}
            }
            if !asked.load(Ordering::Relaxed) {
                // Nothing asked yet: dropping the connection closes it.
                return;
            }
            if let Err(e) = conn.await {
                tracing::trace!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// An accept error that concerns that one connection only, not the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::ConnectionRefused | K::ConnectionAborted | K::ConnectionReset
    )
}
