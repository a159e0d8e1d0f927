//! The versioned JSON envelope an entry is stored in, and decoding a stored value: anything
//! but a current envelope of the expected entry, unexpired or within the retention of expired
//! entries, with a usable embedding is skipped (a miss, counted). Values over `max_value_bytes` are not even read (`shared.rs`).

use serde::{Deserialize, Serialize};

use super::shared::Shared;
use crate::entry::{now_ms, Entry, EntryId};

/// Version of the stored envelope; readers skip any other.
pub(super) const ENVELOPE_VERSION: u32 = 1;

#[derive(Serialize)]
pub(super) struct EnvelopeOut<'a> {
    pub(super) v: u32,
    pub(super) entry: &'a Entry,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    v: u32,
    entry: Entry,
}

impl Shared {
    /// Decodes a stored envelope; anything unexpected is skipped.
    pub(super) fn decode(&self, name: &str, id: EntryId, raw: &[u8]) -> Option<Entry> {
        match serde_json::from_slice::<EnvelopeIn>(raw) {
            Ok(env) if env.v != ENVELOPE_VERSION => {
                self.skip(name, "unknown envelope version");
                None
            }
            Ok(env) if env.entry.id != id => {
                self.skip(name, "entry id does not match its key");
                None
            }
            // Redis drops it at the same moment; clocks of replicas may differ slightly.
            Ok(env) if now_ms() >= self.kept_until(env.entry.expires_ms) => None,
            Ok(env)
                if env
                    .entry
                    .embedding
                    .as_ref()
                    .is_some_and(|v| v.is_empty() || !v.is_finite()) =>
            {
                self.skip(name, "embedding empty or not finite");
                None
            }
            Ok(env) => Some(env.entry),
            Err(_) => {
                self.skip(name, "not an entry envelope");
                None
            }
        }
    }
}
