//! Reads of several keys in one round: a conversation's turn links are looked up together,
//! not one round trip per turn.

use super::metrics::Op;
use super::{RedisError, RedisTier};
use crate::entry::{Digest, Entry, EntryId};

impl RedisTier {
    /// The entries several exact keys (or aliases) point at, in the order of `keys`: two
    /// rounds whatever their number (the keys' ids, then those entries; each round's
    /// commands are sent together on the multiplexed connection). Any outage fails the
    /// whole read; a value that cannot be used reads as absent (skipped and counted).
    pub async fn get_many_by_key(&self, keys: &[Digest]) -> Result<Vec<Option<Entry>>, RedisError> {
        let names: Vec<(String, EntryId)> = keys
            .iter()
            .map(|k| (self.shared.keys.key(k), EntryId(0)))
            .collect();
        let raw_ids = self.shared.get_many(Op::GetByKey, &names).await?;
        let ids: Vec<Option<EntryId>> = raw_ids
            .iter()
            .zip(&names)
            .map(|(raw, (name, _))| {
                let raw = raw.as_ref()?;
                let id = std::str::from_utf8(raw).ok().and_then(|s| s.parse().ok());
                if id.is_none() {
                    self.shared.skip(name, "not an entry id");
                }
                id
            })
            .collect();
        let wanted: Vec<(String, EntryId)> = ids
            .iter()
            .flatten()
            .map(|&id| (self.shared.keys.entry(id), id))
            .collect();
        let values = self.shared.get_many(Op::GetByKey, &wanted).await?;
        let mut values = wanted.iter().zip(values);
        Ok(ids
            .iter()
            .map(|id| {
                id.and_then(|_| {
                    let ((name, id), raw) = values.next()?;
                    self.shared.decode(name, *id, &raw?)
                })
            })
            .collect())
    }
}
