//! The most frequent keys of a stream in bounded memory: Space-Saving (Metwally, Agrawal and
//! El Abbadi, 2005) with [`K`] = 50 counters, written here (no maintained crate offers a
//! mergeable one with per-key data).
//!
//! Each counter holds a key, its count and the count's possible excess (`error`). A key seen
//! again adds one to its counter; a new key takes a free counter, or else replaces the key of
//! the smallest counter and inherits its count plus one (the excess is that inherited count).
//! So a count is never below the key's true count, and at most `error` above it; every key
//! seen more than `n / K` times out of `n` is held. Merging two summaries adds the counts of
//! keys held by both; a key held by one only is credited the other's smallest count when the
//! other is full (it may have been dropped there with that many), then the `K` largest are
//! kept (Agarwal et al., "Mergeable summaries", 2012). Summaries that never filled (fewer than
//! `K` distinct keys) are exact, and so is their merge while it holds at most `K` keys.

use serde::{Deserialize, Serialize};

/// Counters per summary.
pub const K: usize = 50;

/// What a counter keeps besides its count, merged when the same key is counted again.
pub trait Detail: Clone {
    /// Takes in the detail of another occurrence (or another summary's counter) of the key.
    fn absorb(&mut self, other: &Self);
}

/// One counter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Counter<Key, D> {
    /// The key counted.
    pub key: Key,
    /// Its count (never below the true count).
    pub count: u64,
    /// How much of `count` may come from keys it replaced.
    pub error: u64,
    /// What is kept of its occurrences.
    pub detail: D,
}

/// A Space-Saving summary of at most [`K`] counters.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TopK<Key, D> {
    counters: Vec<Counter<Key, D>>,
}

/// Equal when they hold the same counters, in whatever order.
impl<Key: Ord + Clone + PartialEq, D: Detail + PartialEq> PartialEq for TopK<Key, D> {
    fn eq(&self, other: &Self) -> bool {
        self.sorted() == other.sorted()
    }
}

impl<Key, D> Default for TopK<Key, D> {
    fn default() -> Self {
        TopK {
            counters: Vec::new(),
        }
    }
}

impl<Key: Ord + Clone, D: Detail> TopK<Key, D> {
    /// Counts one occurrence of `key`.
    pub fn add(&mut self, key: Key, detail: D) {
        if let Some(c) = self.counters.iter_mut().find(|c| c.key == key) {
            c.count += 1;
            c.detail.absorb(&detail);
            return;
        }
        if self.counters.len() < K {
            self.counters.push(Counter {
                key,
                count: 1,
                error: 0,
                detail,
            });
            return;
        }
        let Some(min) = self.min_index() else { return };
        let c = &mut self.counters[min];
        *c = Counter {
            key,
            count: c.count + 1,
            error: c.count,
            detail,
        };
    }

    /// Index of the smallest counter (the first of equal ones).
    fn min_index(&self) -> Option<usize> {
        self.counters
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| c.count)
            .map(|(i, _)| i)
    }

    /// What a key absent from this summary may have had: its smallest count when full.
    fn floor(&self) -> u64 {
        if self.counters.len() < K {
            0
        } else {
            self.counters.iter().map(|c| c.count).min().unwrap_or(0)
        }
    }

    /// Merges another summary into this one (see the module header).
    pub fn merge(&mut self, other: &TopK<Key, D>) {
        let (mine, theirs) = (self.floor(), other.floor());
        for c in &mut self.counters {
            match other.counters.iter().find(|o| o.key == c.key) {
                Some(o) => {
                    c.count = c.count.saturating_add(o.count);
                    c.error = c.error.saturating_add(o.error);
                    c.detail.absorb(&o.detail);
                }
                None => {
                    c.count = c.count.saturating_add(theirs);
                    c.error = c.error.saturating_add(theirs);
                }
            }
        }
        for o in &other.counters {
            if !self.counters.iter().any(|c| c.key == o.key) {
                let mut c = o.clone();
                c.count = c.count.saturating_add(mine);
                c.error = c.error.saturating_add(mine);
                self.counters.push(c);
            }
        }
        self.bound();
    }

    /// Keeps the [`K`] largest counters (ties by key, so merges are deterministic).
    pub fn bound(&mut self) {
        if self.counters.len() > K {
            self.sort();
            self.counters.truncate(K);
        }
    }

    fn sort(&mut self) {
        self.counters
            .sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
    }

    /// The counters, largest count first.
    pub fn sorted(&self) -> Vec<&Counter<Key, D>> {
        let mut v: Vec<_> = self.counters.iter().collect();
        v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        v
    }

    /// The counters, in no order.
    pub fn counters(&self) -> &[Counter<Key, D>] {
        &self.counters
    }

    /// The counters, to change their keys or details in place (cutting texts).
    pub fn counters_mut(&mut self) -> &mut [Counter<Key, D>] {
        &mut self.counters
    }

    /// Drops every counter.
    pub fn clear(&mut self) {
        self.counters = Vec::new();
    }

    /// Whether no key was counted (or the counters were dropped).
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Default)]
    struct Max(u32);

    impl Detail for Max {
        fn absorb(&mut self, other: &Self) {
            self.0 = self.0.max(other.0);
        }
    }

    #[test]
    fn a_dominant_key_is_found_among_many_distinct_ones() {
        let mut t = TopK::<String, Max>::default();
        for i in 0..100_000u32 {
            if i % 10 == 0 {
                t.add("dominant".to_string(), Max(i));
            } else {
                t.add(format!("q{i}"), Max(0));
            }
        }
        assert!(t.counters().len() <= K);
        let top = t.sorted()[0];
        assert_eq!(top.key, "dominant");
        // Never below the truth, at most `error` above it.
        assert!(top.count >= 10_000 && top.count - top.error <= 10_000);
        assert_eq!(top.detail, Max(99_990));
    }

    #[test]
    fn merging_summaries_that_never_filled_is_exact() {
        let keys: Vec<String> = (0..200).map(|i| format!("k{}", i % 40)).collect();
        let (mut a, mut b, mut all) = (
            TopK::<String, Max>::default(),
            TopK::default(),
            TopK::default(),
        );
        for (i, k) in keys.iter().enumerate() {
            let d = Max(i as u32);
            all.add(k.clone(), d.clone());
            if i % 3 == 0 {
                a.add(k.clone(), d);
            } else {
                b.add(k.clone(), d);
            }
        }
        a.merge(&b);
        let counts = |t: &TopK<String, Max>| {
            t.sorted()
                .iter()
                .map(|c| (c.key.clone(), c.count, c.detail.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(counts(&a), counts(&all));
    }

    #[test]
    fn a_merge_of_full_summaries_keeps_the_heavy_keys_and_the_bound() {
        let mut parts: Vec<TopK<String, Max>> = Vec::new();
        let mut truth = std::collections::HashMap::<String, u64>::new();
        for p in 0..4 {
            let mut t = TopK::default();
            for i in 0..5_000u32 {
                let k = if i % 4 == 0 {
                    format!("hot{}", i % 3)
                } else {
                    format!("p{p}-{i}")
                };
                *truth.entry(k.clone()).or_default() += 1;
                t.add(k, Max(0));
            }
            parts.push(t);
        }
        let mut merged = TopK::default();
        for t in &parts {
            merged.merge(t);
        }
        assert!(merged.counters().len() <= K);
        let top: Vec<&str> = merged.sorted()[..3]
            .iter()
            .map(|c| c.key.as_str())
            .collect();
        assert_eq!(top, ["hot0", "hot1", "hot2"]);
        for c in merged.sorted() {
            let t = truth[&c.key];
            assert!(c.count >= t && c.count - c.error <= t, "{c:?} vs {t}");
        }
    }
}
