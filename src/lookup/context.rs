//! Resolving a conversation's context, turn by turn.
//!
//! An earlier exchange that reprise itself answered stands for the entry that answered it
//! (found through the exchange's turn link), otherwise for the hash of its raw text. So two
//! users who phrased turn 1 differently but were served the same entry share turn-2 hits,
//! while "How old is he?" after two different people never matches.

use std::collections::HashSet;

use reprise_cache::{Digest, EntryId};

use crate::key::{self, Conversation, KeyHasher};
use crate::lookup::plan::turn_key;
use crate::state::AppState;
use reprise_backend::ChatMessage;

/// Messages (the answer included) an exchange may have for its question to be judged
/// standalone against it.
const MAX_EXCHANGE_MESSAGES: usize = 4;
/// Bytes of each recent message compared with a standalone question (the embedder reads
/// about this much: 256 tokens).
const MAX_RECENT_BYTES: usize = super::equivalence::MAX_FORM_BYTES;

/// A conversation's resolved context.
pub struct Context {
    /// The context of this turn (to link this turn's answer for the next turn).
    pub turn: Digest,
    /// The context of this turn by the raw text of every earlier exchange (the answer is
    /// linked under it too, so that the next turn with this very history finds it at once).
    pub raw: Digest,
    /// The turn context plus any messages pending before the query (they are not matched by
    /// meaning, so they must match exactly).
    pub partition: Digest,
    /// Digest of this turn's query messages.
    pub query: Digest,
    /// The entry that answered the previous exchange, when reprise served it.
    pub prev_entry: Option<EntryId>,
}

/// Resolves a conversation's context: the preamble, then each earlier exchange.
///
/// Each answer is linked under its turn's resolved context and under its raw history (see
/// [`Context::raw`]). Resolving reads first the raw links of every looked-up exchange, in
/// one round (memory, then what memory lacks from Redis at once,
/// [`reprise_cache::Store::find_many`]): the last one found settles the context up to it,
/// since an exchange answered by an entry stands for everything before it. The exchanges
/// after it are read by their resolved links, in rounds: each round computes their links from
/// what memory holds (an exchange memory lacks taken as raw text) and asks Redis for those
/// memory lacked at once; when Redis holds one, the exchanges after it are computed again in
/// the next round. A conversation that went through reprise costs one round; one whose
/// exchanges were matched by meaning on other replicas, one more per such exchange (each
/// then promoted into memory), never one per turn.
///
/// Only the first `max_turns` exchanges are looked up; later ones join the context by their
/// raw text, so a turn's context never depends on how long the conversation grew and links
/// written earlier are found the same way.
///
/// `conv` is the conversation as context equivalence rewrote it (each earlier message in
/// its canonical form), `shown_as` the messages as the client sent them (split only when the
/// lookup below needs them).
/// The context is resolved from `conv`. The entry that answered the last exchange
/// ([`Context::prev_entry`], what prefetch learns follow-ups from) is looked up by the
/// exchange as shown when `conv` did not find it: an answer is linked under the question
/// and answer it was given for, so an exchange whose answer (or question) was rewritten to
/// another's form is not found under the rewritten text.
pub async fn resolve(
    state: &AppState,
    namespace: &str,
    model: &str,
    conv: &Conversation<'_>,
    shown_as: &[ChatMessage],
    max_turns: usize,
) -> Context {
    let n = conv.turns.len();
    let resolved = n.min(max_turns);
    let queries: Vec<Digest> = conv
        .turns
        .iter()
        .map(|(msgs, _)| key::messages_digest("query", msgs))
        .collect();
    // An answer shown under a name (an assistant message's `name`) or with other fields is
    // not an entry's answer as given: they reach the model and can change the next answer.
    // Such an exchange joins the context by its raw text, name and fields included, never
    // through a turn link.
    let named = |k: usize| !conv.turns[k].1.is_plain();
    // A link counts only when its entry's answer is the one this history shows: a renewal
    // (refresh-ahead, stale-while-revalidate) takes the keys of the entry it replaces, links
    // made for the old answer's text among them, and the two answers' conversations must
    // not become one context.
    let shown = |k: usize, e: &reprise_cache::Entry| e.text == conv.turns[k].1.content;
    let raw = |ctx: &Digest, k: usize| {
        let mut h = KeyHasher::new("ctx-raw");
        h.digest(ctx)
            .digest(&queries[k])
            .str(&conv.turns[k].1.content);
        if let Some(name) = &conv.turns[k].1.name {
            h.str("\0name").str(name);
        }
        h.extras(&conv.turns[k].1.extra);
        h.finish()
    };
    let by_entry = |id: EntryId| {
        let mut h = KeyHasher::new("ctx-entry");
        h.str(&id.to_string());
        h.finish()
    };
    let link = |ctx: &Digest, k: usize| {
        turn_key(namespace, model, ctx, &queries[k], &conv.turns[k].1.content)
    };
    // The raw contexts: before exchange k, by the raw text of exchanges 0..k.
    let mut raws = Vec::with_capacity(n + 1);
    raws.push(key::messages_digest("preamble", &conv.preamble));
    for k in 0..n {
        let next = raw(&raws[k], k);
        raws.push(next);
    }

    // Round one: the raw links; the last one found settles the context up to it.
    let raw_links: Vec<Digest> = (0..resolved).map(|k| link(&raws[k], k)).collect();
    let found: Vec<Option<_>> = match raw_links.is_empty() {
        true => Vec::new(),
        false => state.store.find_many(&raw_links, |_| true).await,
    };
    let found = found
        .into_iter()
        .enumerate()
        .map(|(k, e)| e.filter(|e| !named(k) && shown(k, e)));
    let mut absent: HashSet<Digest> = HashSet::new();
    let mut ctx = raws[0];
    let mut prev_entry = None;
    let mut from = 0;
    for (k, entry) in found.enumerate() {
        match entry {
            Some(e) => {
                ctx = by_entry(e.id);
                prev_entry = Some(e.id);
                from = k + 1;
            }
            None => {
                absent.insert(raw_links[k]);
            }
        }
    }

    // The exchanges after it, by their resolved links, in rounds. Turns before `from` are
    // settled; `ctx` is the context after them.
    while from < resolved {
        // One pass from memory: an exchange memory lacks is taken as raw text for now.
        let mut c = ctx;
        let mut lacked = Vec::new();
        let mut pass = Vec::with_capacity(resolved - from);
        for k in from..resolved {
            let l = link(&c, k);
            let entry = match absent.contains(&l) || named(k) {
                true => None,
                false => state.store.get_by_key(&l).await.filter(|e| shown(k, e)),
            };
            match entry {
                Some(entry) => {
                    c = by_entry(entry.id);
                    pass.push((c, Some(entry.id)));
                }
                None => {
                    c = raw(&c, k);
                    if !absent.contains(&l) && !named(k) {
                        lacked.push((k, l));
                    }
                    pass.push((c, None));
                }
            }
        }
        // Redis, for every link memory lacked at once (another replica may have written
        // it); the first it holds changes the exchanges after it.
        let keys: Vec<Digest> = lacked.iter().map(|(_, l)| *l).collect();
        let found = match keys.is_empty() {
            true => Vec::new(),
            false => state.store.find_many(&keys, |_| true).await,
        };
        let mut first = None;
        for ((k, l), entry) in lacked.iter().zip(found) {
            match entry.filter(|e| shown(*k, e)) {
                Some(e) => {
                    first = Some((*k, e.id));
                    break;
                }
                None => {
                    absent.insert(*l);
                }
            }
        }
        let settled = first.map_or(resolved, |(k, _)| k);
        for (c, id) in &pass[..settled - from] {
            ctx = *c;
            prev_entry = *id;
        }
        from = settled;
        if let Some((k, id)) = first {
            ctx = by_entry(id);
            prev_entry = Some(id);
            from = k + 1;
        }
    }
    if prev_entry.is_none() && resolved == n && n > 0 {
        prev_entry = answered_as_shown(state, namespace, model, conv, shown_as, &raws[n - 1]).await;
    }
    // Exchanges beyond the cap: by their raw text.
    for k in resolved..n {
        ctx = raw(&ctx, k);
        prev_entry = None;
    }
    let mut query_msgs = conv.pending.clone();
    query_msgs.push(conv.last);
    let query = key::messages_digest("query", &query_msgs);
    Context {
        turn: ctx,
        raw: raws[n],
        partition: with_pending(&ctx, &conv.pending),
        query,
        prev_entry,
    }
}

/// The entry that answered `conv`'s last exchange as `shown_as` shows it, when context
/// equivalence rewrote that exchange: found by its raw link (the context before it by the
/// raw text of the exchanges before, `raw_before`, which every answer stored or served for
/// that history is linked under) with the question and answer as shown. One lookup, only
/// for a rewritten exchange the resolution did not find.
async fn answered_as_shown(
    state: &AppState,
    namespace: &str,
    model: &str,
    conv: &Conversation<'_>,
    shown_as: &[ChatMessage],
    raw_before: &Digest,
) -> Option<EntryId> {
    let shown_as = key::split_conversation(shown_as)?;
    let ((q, a), (shown_q, shown_a)) = (conv.turns.last()?, shown_as.turns.last()?);
    let rewritten = a.content != shown_a.content
        || q.len() != shown_q.len()
        || q.iter().zip(shown_q).any(|(x, y)| x.content != y.content);
    if !rewritten || conv.turns.len() != shown_as.turns.len() || !shown_a.is_plain() {
        return None;
    }
    let query = key::messages_digest("query", shown_q);
    let link = turn_key(namespace, model, raw_before, &query, &shown_a.content);
    let found = state.store.find_many(&[link], |_| true).await;
    found
        .into_iter()
        .flatten()
        .find(|e| e.text == shown_a.content)
        .map(|e| e.id)
}

/// A turn's context with the messages pending before its query.
fn with_pending(ctx: &Digest, pending: &[&ChatMessage]) -> Digest {
    let mut h = KeyHasher::new("ctx-pending");
    h.digest(ctx);
    for m in pending {
        h.message(m);
    }
    h.finish()
}

/// What a standalone last question is matched in, when `conv` may be read as one (see
/// [`reprise_policies::standalone`]): the context of the same question asked with the
/// system prompt alone, and the texts of the last two exchanges, which the question must be
/// unrelated to in meaning. `None` when the question refers back (`refers_back`, from
/// [`reprise_policies::standalone::refers_back`]), a message is pending before it, an
/// earlier message is not the user's (a system or developer message within the
/// conversation, or an assistant message that answers no question), an earlier user message
/// was not a plain question, or one of the last two exchanges has more
/// than [`MAX_EXCHANGE_MESSAGES`] messages (its answer included).
pub fn standalone(conv: &Conversation<'_>, refers_back: bool) -> Option<(Digest, Vec<String>)> {
    use reprise_policies::standalone::conversation_is_plain;
    if conv.turns.is_empty() || !conv.pending.is_empty() || refers_back {
        return None;
    }
    let asked = || conv.turns.iter().flat_map(|(msgs, _)| msgs.iter());
    // A system, developer or tool message within the conversation may shape what follows;
    // so may an assistant message that answers nothing (a greeting the client seeded, "I
    // answer in French"), which is a standing instruction in the assistant's voice.
    if asked().any(|m| m.role != "user") || conv.turns.iter().any(|(msgs, _)| msgs.is_empty()) {
        return None;
    }
    if !conversation_is_plain(asked().map(|m| m.content.as_str())) {
        return None;
    }
    let last = &conv.turns[conv.turns.len().saturating_sub(2)..];
    // Each is embedded: a bounded few, each cut where the embedder stops reading anyway. An
    // exchange of many messages is not judged (read as referring back: no match across
    // contexts, never a wrong one).
    if last
        .iter()
        .any(|(msgs, _)| msgs.len() + 1 > MAX_EXCHANGE_MESSAGES)
    {
        return None;
    }
    let recent = last
        .iter()
        .flat_map(|(msgs, answer)| msgs.iter().chain([answer]))
        .filter(|m| !m.content.is_empty())
        .map(|m| {
            let text = &m.content;
            text[..text.floor_char_boundary(MAX_RECENT_BYTES)].to_string()
        })
        .collect();
    let alone = key::messages_digest("preamble", &conv.preamble);
    Some((with_pending(&alone, &[]), recent))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::split_conversation;

    fn messages(turns: &[(&[&str], &str)], last: &str) -> Vec<ChatMessage> {
        let mut msgs = Vec::new();
        for (asked, answer) in turns {
            msgs.extend(asked.iter().map(|q| ChatMessage::new("user", *q)));
            msgs.push(ChatMessage::new("assistant", *answer));
        }
        msgs.push(ChatMessage::new("user", last));
        msgs
    }

    /// What a standalone question is compared with stays bounded: texts are cut where the
    /// embedder stops reading, and an exchange of many messages is not judged at all.
    #[test]
    fn recent_texts_compared_with_a_standalone_question_are_bounded() {
        let long = "Tell me about the tides and the moon. ".repeat(1000);
        let msgs = messages(
            &[(&["What is the capital of France?"], &long)],
            "How do volcanoes form?",
        );
        let conv = split_conversation(&msgs).unwrap();
        let (_, recent) = standalone(&conv, false).expect("standalone");
        assert_eq!(recent.len(), 2);
        assert!(recent.iter().all(|t| t.len() <= MAX_RECENT_BYTES));
        assert!(recent[1].len() > MAX_RECENT_BYTES - 64, "cut, not dropped");

        let flood: Vec<String> = (0..5000).map(|i| format!("Why is {i} odd?")).collect();
        let asked: Vec<&str> = flood.iter().map(String::as_str).collect();
        let msgs = messages(&[(&asked, "Because.")], "How do volcanoes form?");
        let conv = split_conversation(&msgs).unwrap();
        assert!(standalone(&conv, false).is_none());
        // A few messages in an exchange are still judged.
        let msgs = messages(
            &[(
                &[
                    "Which city is the largest in France?",
                    "What is the capital of France?",
                ],
                "Paris.",
            )],
            "How do volcanoes form?",
        );
        let conv = split_conversation(&msgs).unwrap();
        assert_eq!(standalone(&conv, false).map(|(_, r)| r.len()), Some(3));
        // At the bound: four messages with the answer are judged, five are not.
        let asked = ["Is it far?", "Is it cold?", "Is it big?", "Is it old?"];
        let msgs = messages(&[(&asked[..3], "Yes.")], "How do volcanoes form?");
        let conv = split_conversation(&msgs).unwrap();
        assert_eq!(standalone(&conv, false).map(|(_, r)| r.len()), Some(4));
        let msgs = messages(&[(&asked, "Yes.")], "How do volcanoes form?");
        let conv = split_conversation(&msgs).unwrap();
        assert!(standalone(&conv, false).is_none());
    }

    /// An assistant message that answers nothing (a seeded greeting that sets the
    /// language) is read as a standing instruction: the question keeps its context.
    #[test]
    fn a_seeded_assistant_message_keeps_the_context() {
        let msgs = vec![
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("assistant", "Bonjour ! Je réponds en français."),
            ChatMessage::new("user", "What is the capital of Australia?"),
        ];
        let conv = split_conversation(&msgs).unwrap();
        assert!(standalone(&conv, false).is_none());
    }

    /// A system message within the conversation may set how later questions are answered:
    /// the last question is then matched in its own context only.
    #[test]
    fn a_system_message_within_the_conversation_keeps_the_context() {
        let plain = messages(
            &[(&["What is the capital of France?"], "Paris.")],
            "How do volcanoes form?",
        );
        assert!(standalone(&split_conversation(&plain).unwrap(), false).is_some());
        let mut msgs = plain.clone();
        msgs.insert(
            1,
            ChatMessage::new("system", "Answer in French from now on."),
        );
        let conv = split_conversation(&msgs).unwrap();
        assert!(standalone(&conv, false).is_none());
    }
}
