//! What the request path and generation tell the learning side (prefetch) about served
//! requests, over a bounded channel that never blocks the sender.
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
}

/// What travels on the channel.
#[derive(Debug)]
pub enum Event {
    /// A request was answered (a hit, or a miss whose answer was stored).
    Served(Box<Observation>),
    /// A prefetched entry served its first request.
    PrefetchUsed(EntryId),
}

/// The sending side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct Observer {
    tx: mpsc::Sender<Event>,
    dropped: Arc<AtomicU64>,
}

impl Observer {
    /// A channel holding up to `capacity` events: the sender and the receiver.
    pub fn channel(capacity: usize) -> (Observer, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let observer = Observer {
            tx,
            dropped: Arc::default(),
        };
        (observer, rx)
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
        if self.tx.try_send(ev).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}
