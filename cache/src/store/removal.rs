//! Removal: from this replica only (another replica's delete, a resync) or everywhere
//! (admin deletes by id, namespace, tag or filter).

use std::sync::Arc;

use super::Store;
use crate::entry::{Digest, Entry, EntryId};
use crate::redis::RedisError;

/// Entries asked about per round by [`Store::drop_absent`].
const RECONCILE_BATCH: usize = 500;

impl Store {
    /// Tombstones an entry's vector (it is never a semantic candidate again).
    pub fn tombstone(&self, id: EntryId) {
        if let Some(index) = &self.index {
            index.remove(id);
        }
    }

    /// Drops an entry from this replica (memory and index); Redis is not touched. The id is
    /// remembered for [`DELETED_TTL`](super::DELETED_TTL) so that no read that started earlier brings it back.
    pub async fn remove_local(&self, id: EntryId) {
        self.deleted.insert(id, ());
        self.memory.remove(id).await;
        self.tombstone(id);
    }

    /// Drops every entry of this replica that `pred` selects; returns how many.
    pub async fn remove_local_where(&self, pred: impl Fn(&Entry) -> bool) -> u64 {
        let mut n = 0;
        for e in self.memory.iter_entries() {
            if pred(&e) {
                self.remove_local(e.id).await;
                n += 1;
            }
        }
        n
    }

    /// Drops from this replica every entry Redis no longer holds (deleted by another replica
    /// in events this one missed); returns how many. Writes this replica queued before are
    /// applied first, so its own recent entries are found. Only a definite absence drops an
    /// entry: a Redis error ends the pass (`Err`, nothing more dropped).
    pub async fn drop_absent(&self) -> Result<u64, RedisError> {
        let Some(redis) = &self.redis else {
            return Ok(0);
        };
        let ids: Vec<EntryId> = self.memory.iter_entries().iter().map(|e| e.id).collect();
        redis.flush().await?;
        let mut dropped = 0;
        for chunk in ids.chunks(RECONCILE_BATCH) {
            let present = redis.exists_many(chunk).await?;
            for (id, present) in chunk.iter().zip(present) {
                if !present {
                    self.remove_local(*id).await;
                    dropped += 1;
                }
            }
        }
        Ok(dropped)
    }

    /// Writes every unexpired entry this replica holds, with its keys and tags, back to
    /// Redis (after Redis lost its data), a batch at a time (at most 256 entries and half the
    /// write queue's bytes), waiting for each so the queue's budget is not overrun; returns
    /// how many. A Redis error ends it (`Err`), and so does a write dropped on the way (the
    /// queue full even after a flush, or a write that failed; `Unavailable`): the caller
    /// tries the whole write-back again. Entries over `max_value_bytes`, which no replica
    /// would read, are left out.
    pub async fn reseed(&self) -> Result<u64, RedisError> {
        const BATCH: usize = 256;
        let Some(redis) = &self.redis else {
            return Ok(0);
        };
        let mut keys: std::collections::HashMap<EntryId, Vec<Digest>> = Default::default();
        for (k, id) in self.memory.iter_keys() {
            keys.entry(id).or_default().push(k);
        }
        let entries: Vec<Arc<Entry>> = self
            .memory
            .iter_entries()
            .into_iter()
            .filter(|e| !e.is_expired())
            .collect();
        let dropped_before = redis.health().dropped_writes;
        // Dropped writes this write-back expects: the entries too large, the first tries
        // that found the queue full.
        let mut expected = 0;
        let mut written = 0;
        let mut queued = 0;
        for e in &entries {
            if queued == BATCH || redis.queued_bytes() > redis.queue_budget() / 2 {
                redis.flush().await?;
                queued = 0;
            }
            if e.is_expired() {
                continue;
            }
            let keys = keys.get(&e.id).map_or(&[][..], Vec::as_slice);
            if !redis.put_with_tags(e, keys, &e.tags) {
                expected += 1;
                if !redis.fits(e) || e.is_expired() {
                    continue;
                }
                // The queue is full (others write too): once more after it drained.
                redis.flush().await?;
                queued = 0;
                if !redis.put_with_tags(e, keys, &e.tags) {
                    if e.is_expired() {
                        continue;
                    }
                    expected += 1;
                    if redis.queued_bytes() == 0 {
                        // Larger than the whole write queue (`write_queue_bytes` below this
                        // answer): it can never be written; the rest still is.
                        tracing::warn!(id = %e.id, "an entry larger than the Redis write queue was not written back");
                        continue;
                    }
                    return Err(RedisError::Unavailable);
                }
            }
            queued += 1;
            written += 1;
        }
        redis.flush().await?;
        if redis.health().dropped_writes > dropped_before + expected {
            // A write failed once taken from the queue (or another request's was dropped
            // meanwhile: the write-back is tried again all the same).
            return Err(RedisError::Unavailable);
        }
        Ok(written)
    }

    /// Deletes an entry everywhere (this replica, Redis and through it every replica).
    /// Returns whether any tier held it.
    pub async fn delete(&self, id: EntryId) -> Result<bool, RedisError> {
        let local = self.memory.get_kept(id).await.is_some();
        self.remove_local(id).await;
        let shared = match &self.redis {
            Some(r) => r.delete(id).await?,
            None => false,
        };
        Ok(local || shared)
    }

    /// Deletes every entry that `pred` selects, each everywhere (Redis and through it every
    /// replica); returns how many were deleted. Meant for rare operator requests: it scans
    /// every entry held here, then every entry Redis keeps (page by page), since this
    /// replica may not hold them all (evicted, left in Redis by a rebuild that stopped at
    /// the budget, an event missed).
    pub async fn delete_where(&self, pred: impl Fn(&Entry) -> bool) -> Result<u64, RedisError> {
        let mut n = 0;
        let mut done = std::collections::HashSet::new();
        for e in self.memory.iter_entries() {
            if pred(&e) {
                n += u64::from(self.delete(e.id).await?);
                done.insert(e.id);
            }
        }
        let Some(redis) = &self.redis else {
            return Ok(n);
        };
        // Page by page, while the scan waits (the ids matching are never all held at once);
        // a delete that fails drops the receiver, which stops the scan.
        let (pages, mut rx) = tokio::sync::mpsc::channel(4);
        let deleting = async move {
            let mut n = 0;
            while let Some(page) = rx.recv().await {
                let page: Vec<Entry> = page;
                for e in page.iter().filter(|e| !done.contains(&e.id) && pred(e)) {
                    n += u64::from(self.delete(e.id).await?);
                }
            }
            Ok::<u64, RedisError>(n)
        };
        let (scanned, deleted) = tokio::join!(redis.scan_pages(pages, |_| {}), deleting);
        let deleted = deleted?;
        scanned?;
        Ok(n + deleted)
    }

    /// Drops every entry of `namespace` from this replica and fences the namespace (another
    /// replica deleted it); returns how many were dropped.
    pub async fn remove_local_namespace(&self, namespace: &str) -> u64 {
        self.fence_namespace(namespace);
        self.remove_local_where(|e| e.namespace == namespace).await
    }

    /// Deletes every entry of `namespace` everywhere, and fences it against answers being
    /// generated meanwhile; returns how many the fuller tier held.
    pub async fn delete_namespace(&self, namespace: &str) -> Result<u64, RedisError> {
        let local = self.remove_local_namespace(namespace).await;
        let shared = match &self.redis {
            Some(r) => r.delete_namespace(namespace).await?,
            None => 0,
        };
        Ok(local.max(shared))
    }

    /// Drops every entry stored with `tag` from this replica and fences the tag (another
    /// replica deleted it: this one may hold answers with the tag whose puts never reached
    /// Redis, which that delete could not find); returns how many were dropped.
    pub async fn remove_local_tag(&self, tag: &str) -> u64 {
        self.fence_tag(tag);
        self.remove_local_where(|e| e.tags.iter().any(|t| t == tag))
            .await
    }

    /// [`Store::remove_local_tag`] within the namespaces that start with `prefix` (a tenant's
    /// tag delete, here or on another replica).
    pub async fn remove_local_tag_within(&self, prefix: &str, tag: &str) -> u64 {
        self.fence_tag_within(prefix, tag);
        self.remove_local_where(|e| {
            e.namespace.starts_with(prefix) && e.tags.iter().any(|t| t == tag)
        })
        .await
    }

    /// Deletes every entry stored with `tag` everywhere, and fences it against answers being
    /// generated meanwhile; returns how many the fuller tier held.
    pub async fn delete_tag(&self, tag: &str) -> Result<u64, RedisError> {
        let local = self.remove_local_tag(tag).await;
        let shared = match &self.redis {
            Some(r) => r.delete_tag(tag).await?,
            None => 0,
        };
        Ok(local.max(shared))
    }
}
