//! What the request path and generation tell the learning side (prefetch) about served
//! requests, over a channel bounded in events and in bytes that never blocks the sender.
//!
//! This module is the neutral ground between the two: the request path and [`crate::generate`]
//! send, [`crate::prefetch`] receives, and neither imports the other.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use reprise_backend::GenRequest;
use reprise_cache::{Entry, EntryId};
use tokio::sync::mpsc;

use crate::openai::Endpoint;

/// One served request, as the prefetcher learns from it.
#[derive(Debug, Clone)]
pub struct Observation {
    /// Tenant.
    pub namespace: String,
    /// Endpoint of the request.
    pub endpoint: Endpoint,
    /// The request as asked.
    pub request: GenRequest,
    /// Session id (`x-reprise-session` or the `user` field).
    pub session: Option<String>,
    /// The entry that answered the previous turn of the conversation, when reprise served it.
    pub prev_entry: Option<EntryId>,
    /// The entry that answered this request.
    pub entry: Arc<Entry>,
    /// Answers may be stored for it (not a read-only tenant's, not `no-store`): without,
    /// it is learned from, and nothing is generated in the background for it.
    pub may_store: bool,
    /// The backend generated its answer (a miss): the backend was just busy with a user.
    pub generated: bool,
}

impl Observation {
    /// About the bytes it holds of its own (the request's texts; the entry is shared).
    pub fn bytes(&self) -> u64 {
        let session = self.session.as_ref().map_or(0, String::len);
        let texts = self.request.heap_bytes();
        (std::mem::size_of::<Observation>() + self.namespace.len() + session + texts) as u64
    }
}

/// What travels on the channel.
#[derive(Debug)]
pub enum Event {
    /// A request was answered (a hit, or a miss whose answer was stored).
    Served(Box<Observation>),
    /// A prefetched entry served its first request.
    PrefetchUsed(EntryId),
}

impl Event {
    fn bytes(&self) -> u64 {
        match self {
            Event::Served(obs) => obs.bytes(),
            Event::PrefetchUsed(_) => 0,
        }
    }
}

/// The sending side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct Observer {
    tx: mpsc::Sender<Event>,
    dropped: Arc<AtomicU64>,
    /// Bytes of the events sent and not yet received.
    queued: Arc<AtomicU64>,
    max_bytes: u64,
}

/// The receiving side: takes events off the channel, and their bytes off its count.
pub struct Observations {
    rx: mpsc::Receiver<Event>,
    queued: Arc<AtomicU64>,
}

impl Observations {
    /// The next event; `None` once every sender is gone.
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await?;
        self.queued.fetch_sub(ev.bytes(), Ordering::Relaxed);
        Some(ev)
    }

    /// The next event if one is waiting.
    pub fn try_recv(&mut self) -> Option<Event> {
        let ev = self.rx.try_recv().ok()?;
        self.queued.fetch_sub(ev.bytes(), Ordering::Relaxed);
        Some(ev)
    }
}

impl Observer {
    /// A channel holding up to `capacity` events and `max_bytes` of them: the sender and the
    /// receiver.
    pub fn channel(capacity: usize, max_bytes: u64) -> (Observer, Observations) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let queued = Arc::<AtomicU64>::default();
        let observer = Observer {
            tx,
            dropped: Arc::default(),
            queued: queued.clone(),
            max_bytes,
        };
        (observer, Observations { rx, queued })
    }

    /// Reports a served request; dropped (and counted) when the receiver is far behind.
    pub fn served(&self, obs: Observation) {
        self.send(Event::Served(Box::new(obs)));
    }

    /// Reports the first use of a prefetched entry.
    pub fn prefetch_used(&self, id: EntryId) {
        self.send(Event::PrefetchUsed(id));
    }

    /// Events dropped because the channel was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn send(&self, ev: Event) {
        let bytes = ev.bytes();
        let queued = self.queued.fetch_add(bytes, Ordering::Relaxed);
        if queued.saturating_add(bytes) > self.max_bytes || self.tx.try_send(ev).is_err() {
            self.queued.fetch_sub(bytes, Ordering::Relaxed);
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observation(text_bytes: usize) -> Observation {
        let request = crate::test_support::chat(&[("user", &"q".repeat(text_bytes))]);
        crate::test_support::observation(request, "p", |_| {})
    }

    /// Observations wait within a byte budget as well as a count: big requests are dropped
    /// (and counted) once the bytes are used, and their bytes come back as they are taken.
    #[test]
    fn observations_wait_within_their_bytes() {
        let (observer, mut rx) = Observer::channel(100, 1 << 20);
        for _ in 0..4 {
            observer.served(observation(300 * 1024));
        }
        assert_eq!(observer.dropped(), 1, "the fourth would pass 1 MiB");
        assert!(rx.try_recv().is_some());
        observer.served(observation(300 * 1024));
        assert_eq!(observer.dropped(), 1, "room again once one was taken");
        // Small ones are bounded by the count.
        let (observer, _rx) = Observer::channel(2, 1 << 20);
        for _ in 0..3 {
            observer.served(observation(10));
        }
        assert_eq!(observer.dropped(), 1);
    }
}
