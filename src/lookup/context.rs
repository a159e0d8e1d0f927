//! Resolving a conversation's context, turn by turn.
//!
//! An earlier exchange that reprise itself answered stands for the entry that answered it
//! (found through the exchange's turn link), otherwise for the hash of its raw text. So two
//! users who phrased turn 1 differently but were served the same entry share turn-2 hits,
//! while "How old is he?" after two different people never matches.

use reprise_cache::{Digest, EntryId};

use crate::key::{self, Conversation, KeyHasher};
use crate::lookup::plan::turn_key;
use crate::state::AppState;

/// A conversation's resolved context.
pub struct Context {
    /// The context of this turn (to link this turn's answer for the next turn).
    pub turn: Digest,
    /// The turn context plus any messages pending before the query (they are not matched by
    /// meaning, so they must match exactly).
    pub partition: Digest,
    /// Digest of this turn's query messages.
    pub query: Digest,
    /// The entry that answered the previous exchange, when reprise served it.
    pub prev_entry: Option<EntryId>,
}

/// Resolves a conversation's context: the preamble, then each earlier exchange.
pub async fn resolve(
    state: &AppState,
    namespace: &str,
    model: &str,
    conv: &Conversation<'_>,
) -> Context {
    let mut ctx = key::messages_digest("preamble", &conv.preamble);
    let mut prev_entry = None;
    for (msgs, answer) in &conv.turns {
        let query = key::messages_digest("query", msgs);
        let link = turn_key(namespace, model, &ctx, &query, &answer.content);
        let mut h;
        // L2 too: the link may have been written by another replica.
        match state.store.find(&link, |_| true).await.0.fresh() {
            Some(entry) => {
                h = KeyHasher::new("ctx-entry");
                h.str(&entry.id.to_string());
                prev_entry = Some(entry.id);
            }
            None => {
                h = KeyHasher::new("ctx-raw");
                h.digest(&ctx).digest(&query).str(&answer.content);
                prev_entry = None;
            }
        }
        ctx = h.finish();
    }
    let mut query_msgs = conv.pending.clone();
    query_msgs.push(conv.last);
    let query = key::messages_digest("query", &query_msgs);
    let mut h = KeyHasher::new("ctx-pending");
    h.digest(&ctx);
    for m in &conv.pending {
        h.message(m);
    }
    Context {
        turn: ctx,
        partition: h.finish(),
        query,
        prev_entry,
    }
}
