//! Fences: a namespace, tag or filtered delete wins over the answers that were on their way
//! when it ran (generated before it, stored or installed after).

use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::entry::{now_ms, Entry};

/// How long a namespace or tag delete fences out answers that were being generated when it
/// happened ([`Store::fence_namespace`]): longer than any generation runs by default
/// (`server.request_timeout_secs`, 300 s).
pub const FENCE_TTL: Duration = Duration::from_secs(900);
/// Namespaces, and tags, fenced at once at most.
const FENCES_MAX: u64 = 10_000;
/// Filtered deletes fenced at once at most (the admin API runs two at a time at most, the
/// global admin's and one of the tenants'; the oldest go first).
const FILTERS_MAX: usize = 256;

/// What a filtered delete selects ([`Store::fence_where`]).
pub type DeleteFilter = Arc<dyn Fn(&Entry) -> bool + Send + Sync>;

/// The namespaces and tags deleted within [`FENCE_TTL`], with when.
#[derive(Clone)]
pub(super) struct Fences {
    namespaces: moka::sync::Cache<String, u64>,
    tags: moka::sync::Cache<String, u64>,
    /// Tags deleted within the namespaces that start with a prefix (one tenant's), by tag:
    /// the prefixes and when.
    scoped_tags: moka::sync::Cache<String, Arc<Vec<(String, u64)>>>,
    /// Filtered deletes within [`FENCE_TTL`]: when, and what each selects. Read on every
    /// store and promotion, written by rare operator requests.
    filters: Arc<arc_swap::ArcSwap<Vec<(u64, DeleteFilter)>>>,
}

impl Default for Fences {
    fn default() -> Self {
        Fences {
            namespaces: fence_cache(),
            tags: fence_cache(),
            scoped_tags: fence_cache(),
            filters: Arc::default(),
        }
    }
}

/// A bounded cache of fences lasting [`FENCE_TTL`]; the oldest go first (a newcomer, never
/// read, is never turned away).
fn fence_cache<V: Clone + Send + Sync + 'static>() -> moka::sync::Cache<String, V> {
    moka::sync::Cache::builder()
        .eviction_policy(moka::policy::EvictionPolicy::lru())
        .max_capacity(FENCES_MAX)
        .time_to_live(FENCE_TTL)
        .build()
}

impl Store {
    /// Fences namespace `namespace` from now: answers whose generation started before are
    /// not stored or installed (see [`FENCE_TTL`]). Deleting a namespace does it; a replica
    /// does it on another's delete event.
    pub fn fence_namespace(&self, namespace: &str) {
        self.fences
            .namespaces
            .insert(namespace.to_string(), now_ms());
    }

    /// [`Store::fence_namespace`] for a tag.
    pub fn fence_tag(&self, tag: &str) {
        self.fences.tags.insert(tag.to_string(), now_ms());
    }

    /// [`Store::fence_tag`] within the namespaces that start with `prefix` (a tenant's tag
    /// delete: another tenant's answers with the tag are not held back).
    pub fn fence_tag_within(&self, prefix: &str, tag: &str) {
        let now = now_ms();
        self.fences
            .scoped_tags
            .entry(tag.to_string())
            .and_upsert_with(|held| {
                let mut fences: Vec<(String, u64)> = held
                    .map(|e| e.into_value().as_ref().clone())
                    .unwrap_or_default();
                fences.retain(|(p, _)| p != prefix);
                fences.push((prefix.to_string(), now));
                Arc::new(fences)
            });
    }

    /// [`Store::fence_namespace`] for a filtered delete (`DELETE /admin/entries`): answers
    /// `filter` selects whose generation started before now.
    pub fn fence_where(&self, filter: DeleteFilter) {
        let now = now_ms();
        let ttl = FENCE_TTL.as_millis() as u64;
        self.fences.filters.rcu(|held| {
            let mut kept: Vec<(u64, DeleteFilter)> = held
                .iter()
                .filter(|(at, _)| now.saturating_sub(*at) < ttl)
                .cloned()
                .collect();
            if kept.len() >= FILTERS_MAX {
                kept.drain(..=kept.len() - FILTERS_MAX);
            }
            kept.push((now, filter.clone()));
            kept
        });
    }

    /// Whether `entry`'s generation started before a delete of its namespace, of one of its
    /// tags, or by a filter that selects it: the delete must win over an answer that was on
    /// its way.
    pub(super) fn fenced(&self, entry: &Entry) -> bool {
        let started = entry.created_ms.saturating_sub(u64::from(entry.gen_ms));
        // Strictly after: at millisecond resolution, a question asked right after a delete
        // may start in the delete's own millisecond, and its answer is a new one.
        let after = |at: Option<u64>| at.is_some_and(|at| at > started);
        let scoped = |tag: &str| {
            self.fences.scoped_tags.get(tag).is_some_and(|fences| {
                fences
                    .iter()
                    .any(|(prefix, at)| entry.namespace.starts_with(prefix) && after(Some(*at)))
            })
        };
        let filtered = || {
            let filters = self.fences.filters.load();
            if filters.is_empty() {
                return false;
            }
            let (ttl, now) = (FENCE_TTL.as_millis() as u64, now_ms());
            filters.iter().any(|(at, selects)| {
                now.saturating_sub(*at) < ttl && after(Some(*at)) && selects(entry)
            })
        };
        after(self.fences.namespaces.get(entry.namespace.as_str()))
            || entry
                .tags
                .iter()
                .any(|t| after(self.fences.tags.get(t.as_str())) || scoped(t))
            || filtered()
    }
}
