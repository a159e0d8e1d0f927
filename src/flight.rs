//! Single-flight: identical concurrent misses share one backend generation.
//!
//! A [`Flight`] records every event of one generation. Each waiting client holds a
//! [`Subscriber`] that replays the events from the start and then follows them live, so a
//! streaming client that joins late still gets the whole answer, chunk by chunk. The
//! generation is cancelled when the last subscriber goes away before it finished: nobody is
//! left to read it, and an abandoned answer is never cached.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use reprise_backend::{BackendError, GenEvent, Priority};
use reprise_cache::{Digest, EntryId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How a flight ended.
#[derive(Debug, Clone)]
pub enum End {
    /// A `Finish` event was recorded.
    Finished,
    /// The backend failed or the stream was cut off.
    Failed(BackendError),
}

/// One generation shared by its waiters.
pub struct Flight {
    events: Mutex<Vec<GenEvent>>,
    /// Number of recorded events and, once known, how it ended.
    progress: watch::Sender<(usize, Option<End>)>,
    subscribers: Mutex<usize>,
    cancel: CancellationToken,
    /// The id its answer is stored under, when it is stored.
    entry: Option<EntryId>,
    /// The model of the fallback backend that answered instead of the route's own (set
    /// before the first event; such an answer is not stored).
    fallback: std::sync::OnceLock<String>,
    /// Invalidation tags of the requests that followed it, stored with its answer beside the
    /// leader's (a tag delete any of them asks for reaches the answer they were served).
    tags: Mutex<Vec<String>>,
    /// The priority its generation was asked at.
    priority: Priority,
}

impl Flight {
    fn new(entry: Option<EntryId>, priority: Priority) -> Arc<Self> {
        Arc::new(Flight {
            priority,
            events: Mutex::new(Vec::new()),
            progress: watch::channel((0, None)).0,
            subscribers: Mutex::new(0),
            cancel: CancellationToken::new(),
            entry,
            fallback: std::sync::OnceLock::new(),
            tags: Mutex::new(Vec::new()),
        })
    }

    /// The followers' tags, for the write-back (those added later come too late for it).
    pub fn take_tags(&self) -> Vec<String> {
        std::mem::take(&mut *self.tags.lock())
    }

    /// Records that the fallback backend serving `model` answers this flight (before its
    /// first event).
    pub fn fell_back(&self, model: String) {
        let _ = self.fallback.set(model);
    }

    /// The fallback's model, when the fallback answered.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.get().map(String::as_str)
    }

    /// Records an event and wakes the subscribers.
    pub fn push(&self, ev: GenEvent) {
        let mut events = self.events.lock();
        events.push(ev);
        let n = events.len();
        drop(events);
        self.progress.send_modify(|p| p.0 = n);
    }

    /// Marks the flight ended.
    pub fn end(&self, end: End) {
        self.progress.send_modify(|p| p.1 = Some(end));
    }

    /// Cancelled when the last subscriber left before the end.
    pub fn cancelled(&self) -> &CancellationToken {
        &self.cancel
    }

    /// A new subscriber replaying from the first event.
    fn subscribe(self: &Arc<Self>) -> Subscriber {
        *self.subscribers.lock() += 1;
        self.subscriber()
    }

    /// A subscriber at the first event; the caller has counted it.
    fn subscriber(self: &Arc<Self>) -> Subscriber {
        Subscriber {
            flight: self.clone(),
            rx: self.progress.subscribe(),
            pos: 0,
            done: false,
        }
    }

    /// A new subscriber, unless the flight is over: ended, cancelled, or left by its last
    /// subscriber before its answer was whole (about to be cancelled). Decided under the lock
    /// a leaving subscriber takes, so a request never follows a flight its last client is
    /// leaving. A whole answer being written back is followed (replayed at once), so a
    /// request arriving then is not generated again.
    fn follow(self: &Arc<Self>) -> Option<Subscriber> {
        let mut n = self.subscribers.lock();
        if self.cancel.is_cancelled() || self.is_ended() || (*n == 0 && !self.answered()) {
            return None;
        }
        *n += 1;
        Some(self.subscriber())
    }

    /// Whether its answer is whole (the finish event is recorded), written back or not.
    fn answered(&self) -> bool {
        matches!(self.events.lock().last(), Some(GenEvent::Finish { .. }))
    }

    /// Whether [`Flight::end`] was called.
    pub fn is_ended(&self) -> bool {
        self.progress.borrow().1.is_some()
    }

    /// Whether a request at `priority` may follow it: one at a higher priority waits behind
    /// a lower one's place in the backend's queue only once it started answering (until
    /// then it leads its own generation, served in its own turn).
    fn followable_by(&self, priority: Priority) -> bool {
        self.priority <= priority || self.progress.borrow().0 > 0
    }

    /// Whether the flight is still under way: someone follows it and it is neither ended
    /// nor cancelled.
    fn is_live(&self) -> bool {
        *self.subscribers.lock() > 0 && !self.cancel.is_cancelled() && !self.is_ended()
    }
}

/// One waiter's view of a flight.
pub struct Subscriber {
    flight: Arc<Flight>,
    rx: watch::Receiver<(usize, Option<End>)>,
    pos: usize,
    done: bool,
}

impl Subscriber {
    /// Adds a follower's invalidation tags to those stored with the answer (each once). At
    /// most one beyond [`crate::request::MAX_TAGS`] are held: that many already keep the
    /// answer from being stored, so more followers cost nothing more.
    pub fn add_tags(&self, tags: &[String]) {
        let mut held = self.flight.tags.lock();
        for t in tags {
            if held.len() > crate::request::MAX_TAGS {
                break;
            }
            if !held.contains(t) {
                held.push(t.clone());
            }
        }
    }

    /// The id the flight's answer is stored under, when it is stored (never when a
    /// fallback answered).
    pub fn entry(&self) -> Option<EntryId> {
        self.flight
            .entry
            .filter(|_| self.flight.fallback().is_none())
    }

    /// The model of the fallback backend that answered, when one did (known once the first
    /// event arrived).
    pub fn fallback(&self) -> Option<&str> {
        self.flight.fallback()
    }

    /// The next event; `None` after the end. A failure is delivered once as `Err`.
    pub async fn next(&mut self) -> Option<Result<GenEvent, BackendError>> {
        if self.done {
            return None;
        }
        loop {
            let (len, end) = {
                let p = self.rx.borrow_and_update();
                (p.0, p.1.clone())
            };
            if self.pos < len {
                let ev = self.flight.events.lock()[self.pos].clone();
                self.pos += 1;
                return Some(Ok(ev));
            }
            match end {
                Some(End::Finished) => {
                    self.done = true;
                    return None;
                }
                Some(End::Failed(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                None => {}
            }
            if self.rx.changed().await.is_err() {
                // The driver is gone without an end: treat as cut off.
                self.done = true;
                return Some(Err(BackendError::Internal("generation abandoned".into())));
            }
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let mut n = self.flight.subscribers.lock();
        *n -= 1;
        // A whole answer is written back whoever is left to read it.
        if *n == 0 && !self.flight.is_ended() && !self.flight.answered() {
            self.flight.cancel.cancel();
        }
    }
}

/// The in-flight generations by exact key.
#[derive(Default)]
pub struct Flights {
    map: Mutex<HashMap<Digest, Arc<Flight>>>,
}

/// The result of [`Flights::join`].
pub enum Joined {
    /// A generation for this key was already running; follow it.
    Follower(Subscriber),
    /// This caller must start the generation and drive the returned flight.
    Leader(Arc<Flight>, Subscriber),
}

impl Flights {
    /// Joins the running flight for `key`, or registers a new one for the caller to drive,
    /// whose answer will be stored as `entry`, generated at `priority`. A flight of a lower
    /// priority that has not started answering is not joined: the caller leads another
    /// (the first goes on, unregistered).
    #[cfg(test)]
    pub fn join(&self, key: Digest, entry: EntryId, priority: Priority) -> Joined {
        match self.join_admitted(key, entry, priority, || Ok::<(), ()>(())) {
            Ok(joined) => joined,
            Err(()) => unreachable!("admitted"),
        }
    }

    /// [`Flights::join`], where leading must be admitted first (the tenant's token budget
    /// charged): `admit` runs under the registry's lock only when the caller is about to
    /// lead, so following a running flight is never charged, and of callers racing for one
    /// key only the one that leads is. Its error is returned, and nothing is registered.
    pub fn join_admitted<E>(
        &self,
        key: Digest,
        entry: EntryId,
        priority: Priority,
        admit: impl FnOnce() -> Result<(), E>,
    ) -> Result<Joined, E> {
        let mut map = self.map.lock();
        // A cancelled (or abandoned) flight is on its way out; start afresh rather than join
        // a corpse.
        let running = map.get(&key).filter(|f| f.followable_by(priority));
        if let Some(sub) = running.and_then(|f| f.follow()) {
            return Ok(Joined::Follower(sub));
        }
        admit()?;
        let f = Flight::new(Some(entry), priority);
        let sub = f.subscribe();
        map.insert(key, f.clone());
        Ok(Joined::Leader(f, sub))
    }

    /// Registers a new flight for `key` for the caller to drive (stored as `entry`), unless
    /// one is under way for it (the key's answer is being generated: nothing to start) or
    /// `admit` refuses. `admit` runs under the registry's lock, and only when the caller is
    /// about to lead, so of callers racing for one key exactly one is admitted and leads.
    pub fn lead(
        &self,
        key: Digest,
        entry: EntryId,
        priority: Priority,
        admit: impl FnOnce() -> bool,
    ) -> Option<(Arc<Flight>, Subscriber)> {
        let mut map = self.map.lock();
        if map.get(&key).is_some_and(|f| f.is_live()) || !admit() {
            return None;
        }
        let f = Flight::new(Some(entry), priority);
        let sub = f.subscribe();
        map.insert(key, f.clone());
        Some((f, sub))
    }

    /// Follows the running flight for `key`, if there is one a request at `priority` may
    /// follow (see [`Flights::join`]).
    pub fn follow(&self, key: &Digest, priority: Priority) -> Option<Subscriber> {
        let map = self.map.lock();
        map.get(key).filter(|f| f.followable_by(priority))?.follow()
    }

    /// [`Flights::follow`] for a paraphrase of the flight's question: only while its own
    /// backend answers it. A fallback's answer is another model's, not stored, and a
    /// paraphrase served it would be told it was a hit by meaning.
    pub fn follow_by_meaning(&self, key: &Digest, priority: Priority) -> Option<Subscriber> {
        let map = self.map.lock();
        map.get(key)
            .filter(|f| f.followable_by(priority) && f.fallback().is_none())?
            .follow()
    }

    /// A flight that is not shared (requests that must not be joined: `no-store`, background
    /// generations), stored as `entry` when it is stored at all.
    pub fn solo(&self, entry: Option<EntryId>) -> (Arc<Flight>, Subscriber) {
        // Never registered: nobody follows it, whatever its priority.
        let f = Flight::new(entry, Priority::Interactive);
        let sub = f.subscribe();
        (f, sub)
    }

    /// Removes `flight` from the registry if it is still the one registered for `key`.
    pub fn remove(&self, key: &Digest, flight: &Arc<Flight>) {
        let mut map = self.map.lock();
        if map.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            map.remove(key);
        }
    }

    /// Number of generations in flight.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A generation in flight that a paraphrase may wait for instead of generating again.
struct InFlightQuestion {
    /// The generation: a later one for the same key is another registration.
    flight: std::sync::Weak<Flight>,
    exact: Digest,
    /// What the false-hit gate reads of its prompt.
    prompt: Arc<str>,
    embedding: Arc<[f32]>,
}

/// A question in flight similar to another one: its exact key, the similarity and what the
/// gate reads of its prompt.
pub type SimilarInFlight = (Digest, f32, Arc<str>);

/// In-flight generations by semantic partition: single-flight extended to near-duplicates
/// (a paraphrase of a question being generated right now follows that generation).
///
/// The lock guards only the map: [`InFlightParaphrases::similar`] copies out the candidates
/// (pointers to their prompts), and the caller judges them after releasing it, so a long
/// judgement never holds up another request's registration or lookup.
#[derive(Default)]
pub struct InFlightParaphrases {
    map: Mutex<HashMap<Digest, Vec<InFlightQuestion>>>,
}

impl InFlightParaphrases {
    /// Registers `flight`, led for `exact` in `partition`; `prompt` is what the gate reads
    /// of its prompt.
    pub fn register(
        &self,
        flight: &Arc<Flight>,
        partition: Digest,
        exact: Digest,
        prompt: Arc<str>,
        embedding: Arc<[f32]>,
    ) {
        self.map
            .lock()
            .entry(partition)
            .or_default()
            .push(InFlightQuestion {
                flight: Arc::downgrade(flight),
                exact,
                prompt,
                embedding,
            });
    }

    /// Forgets `flight`'s registration in `partition` (a later flight for the same key,
    /// started while this one was being written back, stays).
    pub fn remove(&self, partition: &Digest, flight: &Arc<Flight>) {
        let mut map = self.map.lock();
        if let Some(v) = map.get_mut(partition) {
            v.retain(|t| !std::ptr::eq(t.flight.as_ptr(), Arc::as_ptr(flight)));
            if v.is_empty() {
                map.remove(partition);
            }
        }
    }

    /// The questions in flight in `partition` at or above `threshold`, most similar first
    /// (equal similarities in the order they were registered).
    pub fn similar(
        &self,
        partition: &Digest,
        embedding: &[f32],
        threshold: f32,
    ) -> Vec<SimilarInFlight> {
        let map = self.map.lock();
        let Some(questions) = map.get(partition) else {
            return Vec::new();
        };
        let mut found: Vec<SimilarInFlight> = questions
            .iter()
            .filter_map(|t| {
                let sim = reprise_cache::vector::dot(&t.embedding, embedding);
                (sim >= threshold).then(|| (t.exact, sim, t.prompt.clone()))
            })
            .collect();
        drop(map);
        found.sort_by(|a, b| b.1.total_cmp(&a.1));
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reprise_backend::{FinishReason, Usage};

    /// A fallback's answer is followed by identical requests (marked degraded) but not by
    /// paraphrases, which would be told it was a hit by meaning on an answer never stored.
    #[test]
    fn a_paraphrase_never_follows_a_fallbacks_answer() {
        let flights = Flights::default();
        let key = [8; 32];
        let Joined::Leader(flight, _sub) = flights.join(key, EntryId(1), Priority::Interactive)
        else {
            panic!("the first leads");
        };
        assert!(flights
            .follow_by_meaning(&key, Priority::Interactive)
            .is_some());
        flight.fell_back("small".into());
        assert!(flights
            .follow_by_meaning(&key, Priority::Interactive)
            .is_none());
        assert!(flights.follow(&key, Priority::Interactive).is_some());
    }

    /// Of several callers asking to lead one key, one leads (and only it is admitted); the
    /// key is free again once its flight ended, and a refused admission leads nothing.
    #[test]
    fn one_leader_per_key_and_admission_only_for_it() {
        let flights = Flights::default();
        let key = [7; 32];
        let mut admitted = 0;
        let led: Vec<_> = (0..5)
            .filter_map(|i| {
                flights.lead(key, EntryId(i), Priority::Interactive, || {
                    admitted += 1;
                    true
                })
            })
            .collect();
        assert_eq!((led.len(), admitted), (1, 1));
        // An identical miss follows the flight being led.
        assert!(flights.follow(&key, Priority::Interactive).is_some());
        let (flight, _sub) = led.into_iter().next().unwrap();
        flight.end(End::Finished);
        assert!(
            flights
                .lead(key, EntryId(9), Priority::Interactive, || false)
                .is_none(),
            "refused"
        );
        assert!(
            flights
                .lead(key, EntryId(9), Priority::Interactive, || true)
                .is_some(),
            "free again"
        );
    }

    /// A request that joins a flight while its last client leaves either follows a flight
    /// that goes on (it keeps it alive) or leads a fresh one: never follows a cancelled one,
    /// whose waiters would get an error instead of an answer.
    #[test]
    fn joining_as_the_last_client_leaves_never_follows_a_cancelled_flight() {
        let flights = Arc::new(Flights::default());
        let mut followed_cancelled = 0;
        for i in 0..20_000u32 {
            let key = [(i % 251) as u8; 32];
            let Joined::Leader(_, leader) = flights.join(key, EntryId(1), Priority::Interactive)
            else {
                panic!("a fresh key leads")
            };
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let b = barrier.clone();
            let leaving = std::thread::spawn(move || {
                b.wait();
                drop(leader);
            });
            barrier.wait();
            let joined = flights.join(key, EntryId(2), Priority::Interactive);
            leaving.join().unwrap();
            match joined {
                Joined::Follower(sub) => {
                    if sub.flight.cancel.is_cancelled() {
                        followed_cancelled += 1;
                    }
                }
                Joined::Leader(f, sub) => {
                    drop(sub);
                    flights.remove(&key, &f);
                }
            }
            let map = flights.map.lock().get(&key).cloned();
            if let Some(f) = map {
                flights.remove(&key, &f);
            }
        }
        assert_eq!(followed_cancelled, 0, "joined a cancelled flight");
    }

    #[tokio::test]
    async fn only_the_leader_is_admitted_and_a_refusal_registers_nothing() {
        let flights = Flights::default();
        let admitted = std::cell::Cell::new(0);
        let admit = || {
            admitted.set(admitted.get() + 1);
            Ok::<(), &str>(())
        };
        let key = [9; 32];
        let refused = flights.join_admitted(key, EntryId(1), Priority::Interactive, || Err("no"));
        assert!(matches!(refused, Err("no")));
        assert!(flights.is_empty(), "a refused leader registers nothing");
        let Ok(Joined::Leader(_f, _a)) =
            flights.join_admitted(key, EntryId(1), Priority::Interactive, admit)
        else {
            panic!("first must lead")
        };
        for _ in 0..3 {
            let joined = flights.join_admitted(key, EntryId(2), Priority::Interactive, admit);
            assert!(matches!(joined, Ok(Joined::Follower(_))));
        }
        assert_eq!(admitted.get(), 1, "followers are never admitted (charged)");
    }

    #[tokio::test]
    async fn late_joiner_replays_everything() {
        let flights = Flights::default();
        let Joined::Leader(f, mut a) = flights.join([1; 32], EntryId(1), Priority::Interactive)
        else {
            panic!("first must lead")
        };
        f.push(GenEvent::Delta("a".into()));
        let Joined::Follower(mut b) = flights.join([1; 32], EntryId(1), Priority::Interactive)
        else {
            panic!("second must follow")
        };
        f.push(GenEvent::Delta("b".into()));
        f.push(GenEvent::Finish {
            reason: FinishReason::Stop,
            usage: Usage::default(),
        });
        f.end(End::Finished);
        for sub in [&mut a, &mut b] {
            let mut n = 0;
            while let Some(ev) = sub.next().await {
                ev.unwrap();
                n += 1;
            }
            assert_eq!(n, 3);
        }
    }

    #[tokio::test]
    async fn last_subscriber_leaving_cancels() {
        let flights = Flights::default();
        let Joined::Leader(f, a) = flights.join([2; 32], EntryId(2), Priority::Interactive) else {
            panic!()
        };
        let Joined::Follower(b) = flights.join([2; 32], EntryId(2), Priority::Interactive) else {
            panic!()
        };
        drop(a);
        assert!(!f.cancelled().is_cancelled());
        drop(b);
        assert!(f.cancelled().is_cancelled());
        // A new request for the same key starts a fresh flight.
        assert!(matches!(
            flights.join([2; 32], EntryId(2), Priority::Interactive),
            Joined::Leader(..)
        ));
    }

    #[test]
    fn similar_questions_come_most_similar_first_and_only_from_their_partition() {
        let p = InFlightParaphrases::default();
        let v = |x: f32, y: f32| -> Arc<[f32]> { Arc::from(vec![x, y]) };
        let flights: Vec<_> = (0..4)
            .map(|i| Flight::new(Some(EntryId(i)), Priority::Interactive))
            .collect();
        p.register(&flights[0], [1; 32], [10; 32], "a".into(), v(1.0, 0.0));
        p.register(&flights[1], [1; 32], [11; 32], "b".into(), v(0.6, 0.8));
        p.register(&flights[2], [1; 32], [12; 32], "c".into(), v(0.0, 1.0));
        p.register(&flights[3], [2; 32], [13; 32], "d".into(), v(0.8, 0.6));
        let found = p.similar(&[1; 32], &[0.8, 0.6], 0.5);
        let keys: Vec<(Digest, &str)> = found.iter().map(|(k, _, t)| (*k, &**t)).collect();
        assert_eq!(keys, [([11; 32], "b"), ([10; 32], "a"), ([12; 32], "c")]);
        assert!(found[0].1 > found[1].1);
        assert!(p.similar(&[1; 32], &[0.0, 1.0], 0.9).len() == 1);
        p.remove(&[1; 32], &flights[0]);
        assert_eq!(p.similar(&[1; 32], &[0.8, 0.6], 0.5).len(), 2);
        assert!(p.similar(&[3; 32], &[0.8, 0.6], 0.0).is_empty());
    }

    /// The last client leaving once the answer is whole cancels nothing, and a request
    /// arriving while it is written back follows it instead of generating it again.
    #[tokio::test]
    async fn a_whole_answer_is_followed_while_it_is_written_back() {
        let flights = Flights::default();
        let Joined::Leader(f, mut leader) =
            flights.join([1; 32], EntryId(1), Priority::Interactive)
        else {
            panic!("leads")
        };
        f.push(GenEvent::Delta("answer".into()));
        f.push(GenEvent::Finish {
            reason: FinishReason::Stop,
            usage: Usage::default(),
        });
        assert!(matches!(leader.next().await, Some(Ok(GenEvent::Delta(_)))));
        drop(leader);
        assert!(!f.cancelled().is_cancelled());
        let mut late = flights
            .follow(&[1; 32], Priority::Interactive)
            .expect("follows");
        assert!(matches!(late.next().await, Some(Ok(GenEvent::Delta(_)))));
        assert!(matches!(
            late.next().await,
            Some(Ok(GenEvent::Finish { .. }))
        ));
        drop(late);
        f.end(End::Finished);
        assert!(flights.follow(&[1; 32], Priority::Interactive).is_none());
        // Left before its answer was whole: cancelled, and not followed.
        let Joined::Leader(g, leader) = flights.join([2; 32], EntryId(2), Priority::Interactive)
        else {
            panic!("leads")
        };
        g.push(GenEvent::Delta("half".into()));
        drop(leader);
        assert!(g.cancelled().is_cancelled());
        assert!(flights.follow(&[2; 32], Priority::Interactive).is_none());
    }

    /// A request does not wait in a lower priority's place: it leads its own generation
    /// until the lower one started answering; one of the same or a lower priority follows.
    #[test]
    fn a_request_follows_a_lower_priority_flight_only_once_it_answers() {
        let flights = Flights::default();
        let Joined::Leader(batch, _leader) = flights.join([1; 32], EntryId(1), Priority::Batch)
        else {
            panic!("leads")
        };
        assert!(matches!(
            flights.join([1; 32], EntryId(2), Priority::Background),
            Joined::Follower(_)
        ));
        assert!(flights.follow(&[1; 32], Priority::Batch).is_some());
        assert!(flights.follow(&[1; 32], Priority::Interactive).is_none());
        batch.push(GenEvent::Delta("a".into()));
        assert!(flights.follow(&[1; 32], Priority::Interactive).is_some());
        // Before it answers, an interactive request leads; the batch flight goes on alone.
        let flights = Flights::default();
        let Joined::Leader(batch, _leader) = flights.join([2; 32], EntryId(3), Priority::Batch)
        else {
            panic!("leads")
        };
        let Joined::Leader(user, _user) = flights.join([2; 32], EntryId(4), Priority::Interactive)
        else {
            panic!("an interactive request leads its own")
        };
        flights.remove(&[2; 32], &batch);
        assert!(flights.follow(&[2; 32], Priority::Interactive).is_some());
        flights.remove(&[2; 32], &user);
        assert!(flights.follow(&[2; 32], Priority::Interactive).is_none());
    }

    /// A flight for a key whose earlier flight is still being written back keeps its
    /// registration when the earlier one ends.
    #[test]
    fn an_ending_flight_forgets_only_its_own_registration() {
        let p = InFlightParaphrases::default();
        let (old, new) = (
            Flight::new(None, Priority::Interactive),
            Flight::new(None, Priority::Interactive),
        );
        let v: Arc<[f32]> = Arc::from(vec![1.0, 0.0]);
        p.register(&old, [1; 32], [10; 32], "a".into(), v.clone());
        p.register(&new, [1; 32], [10; 32], "a".into(), v);
        p.remove(&[1; 32], &old);
        assert_eq!(p.similar(&[1; 32], &[1.0, 0.0], 0.9).len(), 1);
        p.remove(&[1; 32], &new);
        assert!(p.similar(&[1; 32], &[1.0, 0.0], 0.9).is_empty());
    }

    /// Followers' tags are held only up to one beyond the limit (enough to keep the answer
    /// from being stored), however many followers bring new ones.
    #[test]
    fn followers_tags_are_held_up_to_one_beyond_the_limit() {
        let flights = Flights::default();
        let Joined::Leader(f, leader) = flights.join([4; 32], EntryId(5), Priority::Interactive)
        else {
            panic!("leads")
        };
        let few: Vec<String> = (0..3).map(|i| format!("t{i}")).collect();
        leader.add_tags(&few);
        leader.add_tags(&few);
        assert_eq!(f.take_tags(), few, "each once");
        for follower in 0..100 {
            let tags: Vec<String> = (0..32).map(|i| format!("f{follower}-{i}")).collect();
            leader.add_tags(&tags);
        }
        assert_eq!(f.take_tags().len(), crate::request::MAX_TAGS + 1);
    }

    #[tokio::test]
    async fn failure_reaches_subscribers() {
        let flights = Flights::default();
        let Joined::Leader(f, mut a) = flights.join([3; 32], EntryId(3), Priority::Interactive)
        else {
            panic!()
        };
        f.end(End::Failed(BackendError::Timeout));
        assert!(matches!(a.next().await, Some(Err(BackendError::Timeout))));
        assert!(a.next().await.is_none());
    }
}
