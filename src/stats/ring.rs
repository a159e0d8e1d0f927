//! The ring of this replica's recent intervals: one [`Interval`] (the all-tenant rollup and
//! one per tenant) per `interval_secs`, the latest `intervals` of them, within a byte budget.
//!
//! A request counts in the interval it ended in (`time_ms + total_ms`, as `reprise report`
//! counts it). A new interval is opened by the first request (or prefetch sample) that ends
//! in it; intervals without traffic are not held (views fill them with zeros). Past
//! `memory_bytes`, the oldest intervals' question lists go first (their counts stay; the open
//! interval's last), then their per-tenant rollups (the all-tenant one stays), and only if
//! that is not enough the oldest intervals themselves. The
//! budget is checked when an interval opens and every [`FIT_EVERY`] requests.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::rollup::{PrefetchCounts, Rollup};
use crate::metrics::RequestMetrics;
use crate::reqlog::LogRecord;

/// One interval's rollups: what a replica publishes to Redis.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Interval {
    /// Every request.
    pub all: Rollup,
    /// Each tenant's requests, by tenant label (at most `stats.tenants` of them).
    pub tenants: BTreeMap<String, Rollup>,
}

impl Interval {
    /// The rollup of `tenant` (a label; `None`: every request), if any.
    pub fn of(&self, tenant: Option<&str>) -> Option<&Rollup> {
        match tenant {
            None => Some(&self.all),
            Some(t) => self.tenants.get(t),
        }
    }

    /// Applies the rollups' bounds, and at most `max_tenants` tenants (read from Redis).
    pub fn bound(&mut self, max_tenants: usize) {
        self.all.bound();
        while self.tenants.len() > max_tenants {
            self.tenants.pop_last();
        }
        for r in self.tenants.values_mut() {
            r.bound();
        }
    }

    fn approx_bytes(&self) -> u64 {
        self.all.approx_bytes()
            + self
                .tenants
                .iter()
                .map(|(k, r)| k.len() as u64 + 32 + r.approx_bytes())
                .sum::<u64>()
    }

    /// Drops the per-tenant rollups (the all-tenant one stays); whether there were any.
    pub fn drop_tenants(&mut self) -> bool {
        let had = !self.tenants.is_empty();
        self.tenants.clear();
        had
    }

    /// Drops every rollup's question lists (their counts stay); whether there were any.
    pub fn drop_detail(&mut self) -> bool {
        let had = self.all.has_detail() || self.tenants.values().any(Rollup::has_detail);
        self.all.drop_detail();
        for r in self.tenants.values_mut() {
            r.drop_detail();
        }
        had
    }
}

/// One held interval.
#[derive(Debug)]
struct Slot {
    start_ms: u64,
    data: Interval,
    /// Changed since it was last published.
    dirty: bool,
    /// Its size once closed (recomputed when the budget is checked).
    bytes: u64,
}

/// The ring's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Interval length, milliseconds.
    pub interval_ms: u64,
    /// Intervals held.
    pub intervals: usize,
    /// Bytes the held intervals may take (approximately).
    pub memory_bytes: u64,
    /// Tenants with a rollup of their own per interval.
    pub tenants: usize,
}

/// This replica's recent intervals.
#[derive(Debug)]
pub struct Ring {
    bounds: Bounds,
    slots: VecDeque<Slot>,
    /// The prefetcher's totals at the last sample (none before the first).
    prefetch_base: Option<PrefetchCounts>,
    /// Requests added since the budget was last checked.
    adds: u32,
}

/// Gives up part of an interval to keep the budget; whether there was anything to give up.
type Shed = fn(&mut Interval) -> bool;

/// Requests added between checks of the budget (a check measures the open interval: every
/// tenant's rollup).
const FIT_EVERY: u32 = 256;

impl Ring {
    /// An empty ring.
    pub fn new(bounds: Bounds) -> Ring {
        Ring {
            bounds: Bounds {
                interval_ms: bounds.interval_ms.max(1),
                intervals: bounds.intervals.max(1),
                ..bounds
            },
            slots: VecDeque::new(),
            prefetch_base: None,
            adds: 0,
        }
    }

    /// The ring's bounds.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// The start of the interval holding `t_ms`.
    pub fn start_of(&self, t_ms: u64) -> u64 {
        t_ms - t_ms % self.bounds.interval_ms
    }

    /// Milliseconds the ring spans.
    pub fn span_ms(&self) -> u64 {
        self.bounds.interval_ms * self.bounds.intervals as u64
    }

    /// Counts a finished request in the interval it ended in (too old for the ring: not
    /// counted).
    pub fn add(&mut self, rec: &LogRecord) {
        let end = rec.time_ms.saturating_add(rec.total_ms.max(0.0) as u64);
        let max_tenants = self.bounds.tenants;
        let Some(slot) = self.slot(end) else { return };
        if !slot.data.all.add(rec) {
            return;
        }
        slot.dirty = true;
        let label = RequestMetrics::tenant_label(&rec.tenant);
        let tenants = &mut slot.data.tenants;
        if let Some(r) = tenants.get_mut(label) {
            r.add(rec);
        } else if tenants.len() < max_tenants {
            tenants.entry(label.to_string()).or_default().add(rec);
        }
        // The open interval grows with every new tenant and question: the budget is
        // checked every so many requests, not only when the next interval opens.
        self.adds += 1;
        if self.adds >= FIT_EVERY {
            self.adds = 0;
            self.fit();
        }
    }

    /// Takes the prefetcher's totals: what they grew by since the last sample counts in the
    /// interval holding `at_ms` (the first sample only sets the base).
    pub fn sample_prefetch(&mut self, totals: PrefetchCounts, at_ms: u64) {
        let Some(base) = self.prefetch_base.replace(totals) else {
            return;
        };
        let grown = totals.since(&base);
        if grown == PrefetchCounts::default() {
            return;
        }
        if let Some(slot) = self.slot(at_ms) {
            let p = &mut slot.data.all.prefetch;
            p.completed += grown.completed;
            p.hits += grown.hits;
            p.wasted += grown.wasted;
            slot.dirty = true;
        }
    }

    /// What the prefetcher's totals grew by since the last sample (not yet in an interval).
    pub fn prefetch_pending(&self, totals: PrefetchCounts) -> PrefetchCounts {
        self.prefetch_base
            .map_or_else(PrefetchCounts::default, |b| totals.since(&b))
    }

    /// The slot of the interval holding `t_ms`, opened when needed; `None` when older than
    /// the ring.
    fn slot(&mut self, t_ms: u64) -> Option<&mut Slot> {
        let start = self.start_of(t_ms);
        let newest = self.slots.back().map(|s| s.start_ms);
        if newest.is_none_or(|n| n < start) {
            self.open(start);
            return self.slots.back_mut();
        }
        let newest = newest.unwrap_or(start);
        if start + self.span_ms() <= newest {
            return None;
        }
        // An earlier interval (a request that ended just before a newer one opened).
        let at = match self.slots.binary_search_by_key(&start, |s| s.start_ms) {
            Ok(at) => at,
            Err(at) => {
                self.slots.insert(at, empty(start));
                self.fit();
                self.slots.iter().position(|s| s.start_ms == start)?
            }
        };
        self.slots.get_mut(at)
    }

    /// Opens the interval starting at `start` (after every held one).
    fn open(&mut self, start: u64) {
        if let Some(last) = self.slots.back_mut() {
            last.bytes = last.data.approx_bytes();
        }
        self.slots.push_back(empty(start));
        self.fit();
    }

    /// Drops intervals past the ring's span, then keeps the budget: question lists of the
    /// oldest intervals first (the open one's last), then the oldest intervals.
    fn fit(&mut self) {
        let newest = self.slots.back().map_or(0, |s| s.start_ms);
        let span = self.span_ms();
        while self
            .slots
            .front()
            .is_some_and(|s| s.start_ms + span <= newest)
            || self.slots.len() > self.bounds.intervals
        {
            self.slots.pop_front();
        }
        let n = self.slots.len();
        let mut total: u64 = self
            .slots
            .iter_mut()
            .enumerate()
            .map(|(i, s)| {
                // The open interval changes with each request: measured now.
                if i + 1 == n || s.bytes == 0 {
                    s.bytes = s.data.approx_bytes();
                }
                s.bytes
            })
            .sum();
        // Question lists first (the open interval's last), then the oldest closed intervals'
        // per-tenant rollups (the totals of every interval stay: a dashboard's day is still
        // whole; the open interval keeps its own, which later requests would refill from
        // zero).
        let phases: [(Shed, usize); 2] = [
            (Interval::drop_detail, n),
            (Interval::drop_tenants, n.saturating_sub(1)),
        ];
        for (drop, upto) in phases {
            let mut oldest = 0;
            while total > self.bounds.memory_bytes && oldest < upto {
                let s = &mut self.slots[oldest];
                if drop(&mut s.data) {
                    let before = s.bytes;
                    s.bytes = s.data.approx_bytes();
                    s.dirty = true;
                    total = total - before + s.bytes;
                }
                oldest += 1;
            }
        }
        while total > self.bounds.memory_bytes && self.slots.len() > 1 {
            if let Some(s) = self.slots.pop_front() {
                total -= s.bytes;
            }
        }
    }

    /// Copies of the intervals that ended by `now_ms` and changed since they were published
    /// (every changed one when `all`, the open one too), marked published.
    pub fn unpublished(&mut self, now_ms: u64, all: bool) -> Vec<(u64, Interval)> {
        let interval = self.bounds.interval_ms;
        self.slots
            .iter_mut()
            .filter(|s| s.dirty && (all || s.start_ms + interval <= now_ms))
            .map(|s| {
                s.dirty = false;
                (s.start_ms, s.data.clone())
            })
            .collect()
    }

    /// Copies of `tenant`'s rollups (`None`: all requests) of the intervals starting at
    /// `from_ms` up to `to_ms` (both interval starts), oldest first, with zeros for the
    /// intervals not held.
    pub fn window(&self, from_ms: u64, to_ms: u64, tenant: Option<&str>) -> Vec<(u64, Rollup)> {
        let mut out = Vec::new();
        let mut held = self.slots.iter().peekable();
        let mut start = from_ms;
        while start <= to_ms {
            while held.peek().is_some_and(|s| s.start_ms < start) {
                held.next();
            }
            let r = held
                .peek()
                .filter(|s| s.start_ms == start)
                .and_then(|s| s.data.of(tenant))
                .cloned()
                .unwrap_or_default();
            out.push((start, r));
            start += self.bounds.interval_ms;
        }
        out
    }

    /// Bytes the held intervals take, approximately.
    pub fn approx_bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.data.approx_bytes()).sum()
    }

    /// Intervals held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no interval is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

fn empty(start_ms: u64) -> Slot {
    Slot {
        start_ms,
        data: Interval::default(),
        dirty: false,
        bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(memory_bytes: u64) -> Bounds {
        Bounds {
            interval_ms: 1000,
            intervals: 10,
            memory_bytes,
            tenants: 2,
        }
    }

    fn rec(at_ms: u64, tenant: &str, question: &str) -> LogRecord {
        LogRecord {
            time_ms: at_ms,
            total_ms: 0.0,
            outcome: "miss",
            tenant: tenant.into(),
            question: Some(question.into()),
            ..Default::default()
        }
    }

    #[test]
    fn requests_count_in_the_interval_they_ended_in_with_tenants_apart() {
        let mut ring = Ring::new(bounds(u64::MAX));
        ring.add(&rec(10_100, "", "a"));
        ring.add(&rec(10_900, "acme", "b"));
        // Arrived in the first interval, ended in the third.
        let mut late = rec(10_500, "beta", "c");
        late.total_ms = 2_000.0;
        ring.add(&late);
        // A third tenant in one interval has no rollup of its own (bound 2), but counts in
        // the total.
        ring.add(&rec(12_100, "delta", "d"));
        ring.add(&rec(12_000, "gamma", "d"));
        let w = ring.window(10_000, 13_000, None);
        let counts: Vec<(u64, u64)> = w.iter().map(|(s, r)| (*s, r.requests)).collect();
        assert_eq!(counts, [(10_000, 2), (11_000, 0), (12_000, 3), (13_000, 0)]);
        let acme: Vec<u64> = ring
            .window(10_000, 12_000, Some("acme"))
            .iter()
            .map(|(_, r)| r.requests)
            .collect();
        assert_eq!(acme, [1, 0, 0]);
        assert_eq!(ring.window(12_000, 12_000, Some("gamma"))[0].1.requests, 0);
        assert_eq!(
            ring.window(10_000, 10_000, Some("anonymous"))[0].1.requests,
            1
        );
        // Published once each, the open interval only when asked.
        let closed = ring.unpublished(12_500, false);
        assert_eq!(closed.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [10_000]);
        assert!(ring.unpublished(12_500, false).is_empty());
        assert_eq!(ring.unpublished(12_500, true).len(), 1);
        // A late request marks its interval changed again.
        ring.add(&rec(10_950, "", "e"));
        assert_eq!(ring.unpublished(12_500, false).len(), 1);
    }

    #[test]
    fn the_ring_keeps_its_span_and_its_budget() {
        let mut ring = Ring::new(bounds(u64::MAX));
        for i in 0..100u64 {
            ring.add(&rec(i * 1000, "", "q"));
        }
        assert_eq!(ring.len(), 10);
        assert_eq!(ring.window(0, 0, None)[0].1.requests, 0, "dropped");
        // Too old for the ring: not counted.
        ring.add(&rec(5_000, "", "old"));
        assert_eq!(ring.window(5_000, 5_000, None)[0].1.requests, 0);

        // A budget that holds the counts but not every interval's questions.
        let long = "x".repeat(1000);
        let one = {
            let mut r = Ring::new(bounds(u64::MAX));
            for q in 0..50 {
                r.add(&rec(0, "", &format!("{q}{long}")));
            }
            r.approx_bytes()
        };
        let mut ring = Ring::new(bounds(one * 3));
        for i in 0..10u64 {
            for q in 0..50 {
                ring.add(&rec(i * 1000, "", &format!("{q}{long}")));
            }
        }
        ring.add(&rec(10_000, "", "last"));
        assert!(ring.approx_bytes() <= one * 3, "{}", ring.approx_bytes());
        let w = ring.window(1_000, 10_000, None);
        assert!(w.iter().all(|(_, r)| r.requests > 0), "counts stay");
        assert!(!w[0].1.has_detail(), "oldest questions went first");
        assert!(w[8].1.has_detail(), "the newest kept theirs");
    }

    /// Many tenants fill the budget with their counts alone: the oldest intervals give up
    /// their tenants' rollups before any interval goes, so the totals stay whole.
    #[test]
    fn tenants_rollups_go_before_any_interval() {
        let tenants = 40;
        let one = {
            let mut r = Ring::new(Bounds {
                tenants,
                ..bounds(u64::MAX)
            });
            for t in 0..tenants {
                r.add(&rec(0, &format!("t{t}"), ""));
            }
            r.approx_bytes()
        };
        let mut ring = Ring::new(Bounds {
            tenants,
            ..bounds(one * 4)
        });
        for i in 0..10u64 {
            for t in 0..tenants {
                ring.add(&rec(i * 1000, &format!("t{t}"), ""));
            }
        }
        // The budget is checked as the next interval opens.
        ring.add(&rec(10_000, "t0", ""));
        assert!(ring.approx_bytes() <= one * 4, "{}", ring.approx_bytes());
        let w = ring.window(1_000, 9_000, None);
        let totals: Vec<u64> = w.iter().map(|(_, r)| r.requests).collect();
        assert_eq!(totals, [tenants as u64; 9], "every interval's total stays");
        let t0: Vec<u64> = ring
            .window(1_000, 9_000, Some("t0"))
            .iter()
            .map(|(_, r)| r.requests)
            .collect();
        assert_eq!(t0[0], 0, "the oldest gave up its tenants");
        assert_eq!(t0[8], 1, "the newest kept them");
    }

    #[test]
    fn the_open_interval_keeps_to_the_budget_too() {
        // Many tenants and long distinct questions, all in one interval: without a check
        // before the next interval opens, some 30 MB of question lists.
        let mut ring = Ring::new(Bounds {
            tenants: 300,
            ..bounds(1 << 20)
        });
        ring.add(&rec(0, "", "an earlier interval"));
        let long = "y".repeat(2000);
        for i in 0..20_000u64 {
            ring.add(&rec(
                1000 + i % 1000,
                &format!("t{}", i % 300),
                &format!("{i}{long}"),
            ));
        }
        // The open interval gave up its question lists (its counts, about 2.5 KB a tenant,
        // fit), so the earlier interval stayed; questions since the last check are over.
        let held = ring.approx_bytes();
        let since_check = 2 * u64::from(FIT_EVERY) * 2100;
        assert!(held <= (1 << 20) + since_check, "{held}");
        assert_eq!(
            ring.window(0, 0, None)[0].1.requests,
            1,
            "the earlier interval stays"
        );
        assert_eq!(ring.window(1000, 1000, None)[0].1.requests, 20_000);
    }

    #[test]
    fn prefetch_samples_count_what_the_totals_grew_by() {
        let mut ring = Ring::new(bounds(u64::MAX));
        let totals = |n: u64| PrefetchCounts {
            completed: n,
            hits: n / 2,
            wasted: 1,
        };
        ring.sample_prefetch(totals(10), 500);
        assert!(ring.is_empty(), "the first sample sets the base");
        ring.sample_prefetch(totals(14), 1_500);
        assert_eq!(
            ring.prefetch_pending(totals(20)),
            totals(6).since(&totals(0))
        );
        let w = ring.window(1_000, 1_000, None);
        assert_eq!(
            w[0].1.prefetch,
            PrefetchCounts {
                completed: 4,
                hits: 2,
                wasted: 0
            }
        );
    }
}
