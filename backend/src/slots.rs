//! A priority semaphore: a fixed number of generation slots handed out by class, used by the
//! upstream's concurrency limit (`backend.max_concurrent`) and by the scripted backend's
//! `slots` (the llama engine schedules its own sequences the same way, in `llama::engine`).
//!
//! Rules, checked whenever a slot frees or a request arrives:
//! - a waiting request is served interactive first, then batch, then background, and in
//!   arrival order within a class;
//! - aging: a batch request that has waited `aging` or longer counts as interactive (in its
//!   arrival order, so it goes before the interactive requests that came after it), so a
//!   steady interactive stream cannot starve it; background work does not age;
//! - a user request (interactive or batch) that finds no free slot preempts the background
//!   holder that started last: that holder's [`Permit::preempted`] fires and its slot passes
//!   to the user request at once (the holder's stream ends with an error when it notices; it
//!   is never cached). A batch holder is never preempted, whatever waits;
//! - background requests only get a slot when no user request waits;
//! - at most `max_queue` requests wait: a user request arriving at a full queue evicts the
//!   newest waiting background request (which gets `Overloaded`), an interactive one with no
//!   background to evict the newest waiting batch request (a flood of batch work cannot
//!   lock interactive requests out; the oldest batch requests keep their places and age),
//!   otherwise the newcomer is refused with `Overloaded`.
//!
//! A request takes its place in the line when it arrives ([`Slots::enter`]), and its
//! [`Ticket`] resolves to a [`Permit`] once a slot is its. Dropping a ticket leaves the line;
//! dropping a permit frees the slot.
//!
//! Why one lock over a hand-made queue rather than `tokio::sync::Semaphore`: tokio's
//! semaphore is FIFO only, and picking by class with aging and preemption needs the whole line
//! and every holder at once. The lock is held for a scan of the line (bounded by
//! `max_queue`); grants are sent after it is released.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::{BackendError, Load, Priority};

/// What a preempted holder or an evicted waiter gets: capacity went to user requests; a
/// retry later is the right reaction.
pub(crate) fn preempted() -> BackendError {
    BackendError::Overloaded {
        retry_after_secs: 1,
    }
}

/// The slots; clones share them.
#[derive(Clone)]
pub(crate) struct Slots {
    shared: Arc<Shared>,
}

struct Shared {
    capacity: usize,
    /// Most requests waiting; `None` unbounded.
    max_queue: Option<usize>,
    /// Batch requests waiting this long are served as interactive; `None` never.
    aging: Option<Duration>,
    state: Mutex<State>,
    /// Background holders preempted and background waiters evicted.
    preempted: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Holders of a slot, by id (a preempted holder is no longer here: its slot was passed on).
    running: HashMap<u64, Holder>,
    /// Waiting requests in arrival order (ids grow with arrival).
    waiting: VecDeque<Waiter>,
    next_id: u64,
}

struct Holder {
    priority: Priority,
    preempt: CancellationToken,
}

struct Waiter {
    id: u64,
    priority: Priority,
    since: Instant,
    tx: oneshot::Sender<Result<Permit, BackendError>>,
}

/// What a pass over the line decided, carried out once the lock is released.
#[derive(Default)]
struct Decisions {
    grants: Vec<(oneshot::Sender<Result<Permit, BackendError>>, Permit)>,
    refusals: Vec<oneshot::Sender<Result<Permit, BackendError>>>,
    preempt: Vec<CancellationToken>,
}

impl Decisions {
    fn carry_out(self) {
        for token in self.preempt {
            token.cancel();
        }
        for tx in self.refusals {
            let _ = tx.send(Err(preempted()));
        }
        for (tx, permit) in self.grants {
            // A waiter that left meanwhile: the permit comes back and is dropped here, outside
            // the lock, which frees the slot for the next one.
            drop(tx.send(Ok(permit)));
        }
    }
}

impl Slots {
    /// `capacity` slots (at least one), at most `max_queue` waiting (`None`: unbounded),
    /// batch requests aged into interactive after `aging` (`None`: never).
    pub(crate) fn new(capacity: usize, max_queue: Option<usize>, aging: Option<Duration>) -> Self {
        Slots {
            shared: Arc::new(Shared {
                capacity: capacity.max(1),
                max_queue,
                aging,
                state: Mutex::new(State::default()),
                preempted: AtomicU64::new(0),
            }),
        }
    }

    /// Takes a place in the line at `priority`. `Overloaded` when the line is full (see the
    /// module header).
    pub(crate) fn enter(&self, priority: Priority) -> Result<Ticket, BackendError> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.shared.state.lock();
        let id = st.next_id;
        st.next_id += 1;
        st.waiting.push_back(Waiter {
            id,
            priority,
            since: Instant::now(),
            tx,
        });
        let mut decisions = self.shared.schedule(&mut st);
        let mut refused = false;
        if let Some(max) = self.shared.max_queue {
            if st.waiting.len() > max && st.waiting.iter().any(|w| w.id == id) {
                // The newest waiting background request goes, unless the newcomer is one; for
                // an interactive newcomer, else the newest waiting batch request.
                // By rank: a batch request that waited past the aging counts as interactive,
                // and keeps its place.
                let now = Instant::now();
                let newest = |rank: u8| {
                    st.waiting
                        .iter()
                        .rposition(|w| self.shared.rank(w, now) == rank)
                };
                let victim = match priority {
                    Priority::Background => None,
                    Priority::Batch => newest(2),
                    Priority::Interactive => newest(2).or_else(|| newest(1)),
                };
                match victim {
                    Some(i) => {
                        let w = st.waiting.remove(i).expect("position is in the line");
                        if w.priority == Priority::Background {
                            self.shared.preempted.fetch_add(1, Ordering::Relaxed);
                        }
                        decisions.refusals.push(w.tx);
                    }
                    None => {
                        st.waiting.retain(|w| w.id != id);
                        refused = true;
                    }
                }
            }
        }
        drop(st);
        decisions.carry_out();
        if refused {
            return Err(preempted());
        }
        Ok(Ticket {
            id,
            rx,
            shared: self.shared.clone(),
            settled: false,
        })
    }

    /// Capacity, holders and waiting requests by the class they are served at: a batch
    /// request aged into interactive rank counts as interactive (it goes before a new
    /// interactive one), as in the llama engine's lines.
    pub(crate) fn load(&self) -> Load {
        let st = self.shared.state.lock();
        let now = Instant::now();
        let waiting = |p: Priority| {
            st.waiting
                .iter()
                .filter(|w| w.priority != Priority::Background)
                .filter(|w| (self.shared.rank(w, now) == 0) == (p == Priority::Interactive))
                .count()
        };
        Load {
            capacity: self.shared.capacity,
            running: st.running.len(),
            running_background: st
                .running
                .values()
                .filter(|h| h.priority == Priority::Background)
                .count(),
            queued: st.waiting.len(),
            queued_interactive: waiting(Priority::Interactive),
            queued_batch: waiting(Priority::Batch),
            kept_free: 0,
        }
    }

    /// Background holders preempted and background waiters evicted so far.
    pub(crate) fn preempted_count(&self) -> u64 {
        self.shared.preempted.load(Ordering::Relaxed)
    }
}

impl Shared {
    /// The rank a waiter is served by (lower first): interactive and aged batch 0, batch 1,
    /// background 2.
    fn rank(&self, w: &Waiter, now: Instant) -> u8 {
        match w.priority {
            Priority::Interactive => 0,
            Priority::Batch
                if self
                    .aging
                    .is_some_and(|a| now.saturating_duration_since(w.since) >= a) =>
            {
                0
            }
            Priority::Batch => 1,
            Priority::Background => 2,
        }
    }

    /// Hands free slots to the best waiters, preempting background holders for user requests.
    fn schedule(self: &Arc<Self>, st: &mut State) -> Decisions {
        let mut out = Decisions::default();
        let now = Instant::now();
        // The line is in arrival order, so the first of the lowest rank is the one.
        while let Some((i, rank)) = st
            .waiting
            .iter()
            .enumerate()
            .map(|(i, w)| (i, self.rank(w, now)))
            .min_by_key(|&(i, rank)| (rank, i))
        {
            if st.running.len() >= self.capacity {
                if rank == 2 {
                    break;
                }
                // The background holder that started last has done the least.
                let victim = st
                    .running
                    .iter()
                    .filter(|(_, h)| h.priority == Priority::Background)
                    .map(|(id, _)| *id)
                    .max();
                let Some(victim) = victim else {
                    break;
                };
                let holder = st.running.remove(&victim).expect("found above");
                self.preempted.fetch_add(1, Ordering::Relaxed);
                out.preempt.push(holder.preempt);
            }
            let w = st.waiting.remove(i).expect("index is in the line");
            let preempt = CancellationToken::new();
            st.running.insert(
                w.id,
                Holder {
                    priority: w.priority,
                    preempt: preempt.clone(),
                },
            );
            let permit = Permit {
                id: w.id,
                shared: self.clone(),
                preempt,
            };
            out.grants.push((w.tx, permit));
        }
        out
    }

    /// Frees the slot of holder `id` (if it still holds one) or its place in the line.
    fn leave(self: &Arc<Self>, id: u64) {
        let mut st = self.state.lock();
        let held = st.running.remove(&id).is_some();
        let len = st.waiting.len();
        st.waiting.retain(|w| w.id != id);
        if !held && st.waiting.len() == len {
            return;
        }
        let decisions = self.schedule(&mut st);
        drop(st);
        decisions.carry_out();
    }
}

/// A place in the line; [`Ticket::wait`] resolves it to a slot. Dropped, it leaves the line
/// (or frees the slot it was just given).
pub(crate) struct Ticket {
    id: u64,
    rx: oneshot::Receiver<Result<Permit, BackendError>>,
    shared: Arc<Shared>,
    /// The answer was collected: the permit (if any) owns the slot now.
    settled: bool,
}

impl Ticket {
    /// Waits for a slot; `Overloaded` when evicted from the line for a user request.
    pub(crate) async fn wait(mut self) -> Result<Permit, BackendError> {
        let answer = (&mut self.rx).await;
        self.settled = true;
        match answer {
            Ok(granted) => granted,
            // The sender is only dropped with the line's state, which outlives every ticket.
            Err(_) => Err(BackendError::Internal("slot line closed".into())),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // Still waiting: leave the line. A grant already sent is dropped with `rx` after this,
        // and its permit frees the slot.
        self.rx.close();
        self.shared.leave(self.id);
    }
}

/// A slot, held until dropped.
pub(crate) struct Permit {
    id: u64,
    shared: Arc<Shared>,
    preempt: CancellationToken,
}

impl Permit {
    /// Fires when the slot was taken for a user request (background holders only); the holder
    /// must stop and end its stream with [`preempted`].
    pub(crate) fn preemption(&self) -> CancellationToken {
        self.preempt.clone()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shared.leave(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(capacity: usize, max_queue: Option<usize>, aging: Option<Duration>) -> Slots {
        Slots::new(capacity, max_queue, aging)
    }

    /// Whether the ticket already resolved (without waiting); settles it when it did.
    fn granted(t: &mut Ticket) -> Option<Result<Permit, BackendError>> {
        let answer = t.rx.try_recv().ok();
        t.settled |= answer.is_some();
        answer
    }

    #[tokio::test]
    async fn waiting_requests_are_served_by_class_then_arrival() {
        let s = slots(1, None, None);
        let held = s.enter(Priority::Batch).unwrap().wait().await.unwrap();
        let mut bg = s.enter(Priority::Background).unwrap();
        let mut batch = s.enter(Priority::Batch).unwrap();
        let mut first = s.enter(Priority::Interactive).unwrap();
        let mut second = s.enter(Priority::Interactive).unwrap();
        let load = s.load();
        assert_eq!((load.capacity, load.running, load.queued), (1, 1, 4));
        assert_eq!((load.queued_interactive, load.queued_batch), (2, 1));
        assert!(
            granted(&mut first).is_none(),
            "a batch holder is never preempted"
        );
        drop(held);
        let p = granted(&mut first).expect("interactive first").unwrap();
        assert!(granted(&mut second).is_none());
        drop(p);
        let p = granted(&mut second)
            .expect("then the next interactive")
            .unwrap();
        drop(p);
        let p = granted(&mut batch).expect("then batch").unwrap();
        assert!(granted(&mut bg).is_none());
        drop(p);
        granted(&mut bg).expect("background last").unwrap();
    }

    #[tokio::test]
    async fn an_aged_batch_request_goes_before_later_interactive_ones() {
        let s = slots(1, None, Some(Duration::ZERO));
        let held = s
            .enter(Priority::Interactive)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let mut batch = s.enter(Priority::Batch).unwrap();
        let mut interactive = s.enter(Priority::Interactive).unwrap();
        // Counted where it is served: ahead of a new interactive request (the wait a new one
        // is predicted counts it).
        let load = s.load();
        assert_eq!((load.queued_interactive, load.queued_batch), (2, 0));
        drop(held);
        let _slot = granted(&mut batch)
            .expect("aged: served in arrival order")
            .unwrap();
        assert!(granted(&mut interactive).is_none());
    }

    #[tokio::test]
    async fn a_user_request_preempts_the_latest_background_holder() {
        let s = slots(2, None, None);
        let old = s.enter(Priority::Background).unwrap().wait().await.unwrap();
        let new = s.enter(Priority::Background).unwrap().wait().await.unwrap();
        assert_eq!(s.load().running_background, 2);
        let mut user = s.enter(Priority::Batch).unwrap();
        let p = granted(&mut user)
            .expect("the slot passed at once")
            .unwrap();
        assert!(new.preemption().is_cancelled());
        assert!(!old.preemption().is_cancelled());
        assert_eq!(s.preempted_count(), 1);
        // The preempted holder's drop frees nothing more: the slot is the user's.
        drop(new);
        let load = s.load();
        assert_eq!((load.running, load.running_background), (2, 1));
        drop((p, old));
        assert_eq!(s.load().running, 0);
    }

    /// A full line evicts background work for user requests, batch work for interactive
    /// ones (the newest of each), and refuses the rest.
    #[tokio::test]
    async fn a_full_line_evicts_background_for_users_and_refuses_the_rest() {
        let s = slots(1, Some(1), None);
        let _held = s
            .enter(Priority::Interactive)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let bg = s.enter(Priority::Background).unwrap();
        assert!(matches!(
            s.enter(Priority::Background),
            Err(BackendError::Overloaded { .. })
        ));
        let batch = s.enter(Priority::Batch).unwrap();
        assert!(matches!(
            bg.wait().await,
            Err(BackendError::Overloaded { .. })
        ));
        assert_eq!(s.preempted_count(), 1);
        // A flood of batch work does not lock interactive requests out.
        let _interactive = s.enter(Priority::Interactive).unwrap();
        assert!(matches!(
            batch.wait().await,
            Err(BackendError::Overloaded { .. })
        ));
        assert_eq!(s.preempted_count(), 1, "background preemptions only");
        for p in [Priority::Batch, Priority::Interactive] {
            assert!(matches!(s.enter(p), Err(BackendError::Overloaded { .. })));
        }
        let load = s.load();
        assert_eq!((load.queued, load.queued_interactive), (1, 1));
    }

    /// A batch request that waited past the aging counts as interactive: an interactive
    /// arrival at a full line does not evict it.
    #[tokio::test]
    async fn an_aged_batch_request_keeps_its_place_in_a_full_line() {
        let s = slots(1, Some(1), Some(Duration::ZERO));
        let _held = s
            .enter(Priority::Interactive)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let mut aged = s.enter(Priority::Batch).unwrap();
        assert!(matches!(
            s.enter(Priority::Interactive),
            Err(BackendError::Overloaded { .. })
        ));
        assert!(granted(&mut aged).is_none(), "still waiting");
    }

    #[tokio::test]
    async fn a_dropped_ticket_leaves_the_line_and_a_dropped_grant_frees_the_slot() {
        let s = slots(1, None, None);
        let held = s
            .enter(Priority::Interactive)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let gone = s.enter(Priority::Interactive).unwrap();
        let mut next = s.enter(Priority::Interactive).unwrap();
        drop(gone);
        assert_eq!(s.load().queued, 1);
        drop(held);
        let p = granted(&mut next).expect("the one that stayed").unwrap();
        // Granted but never collected: the slot comes back when the ticket goes.
        let unread = s.enter(Priority::Interactive).unwrap();
        drop(p);
        assert_eq!(s.load().running, 1);
        drop(unread);
        assert_eq!(
            s.load(),
            Load {
                capacity: 1,
                ..Load::default()
            }
        );
    }
}
