//! Cache keys: blake3 digests over the canonical form of a request.
//!
//! Every field is written with a tag and a length prefix, so the encoding is prefix-free:
//! no two different requests can produce the same byte sequence. The key functions
//! destructure [`GenRequest`] and [`SamplingParams`], so adding a field to either is a
//! compile error here until someone decides whether it belongs in the key.

use reprise_backend::{ChatMessage, GenRequest, Input, SamplingParams};
use reprise_cache::Digest;

use crate::openai::Endpoint;

/// Incremental, prefix-free encoder over blake3.
pub struct KeyHasher(blake3::Hasher);

impl KeyHasher {
    /// A hasher for one kind of key (the domain separates exact keys from partitions etc.).
    pub fn new(domain: &str) -> Self {
        let mut h = KeyHasher(blake3::Hasher::new());
        h.bytes(b"reprise/v1");
        h.bytes(domain.as_bytes());
        h
    }

    /// Writes a length-prefixed byte string.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.update(&(b.len() as u64).to_le_bytes());
        self.0.update(b);
        self
    }

    /// Writes a string.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }

    /// Writes an optional value: a presence byte, then the value.
    fn opt<T>(&mut self, v: Option<T>, f: impl FnOnce(&mut Self, T)) -> &mut Self {
        match v {
            None => {
                self.0.update(&[0]);
            }
            Some(v) => {
                self.0.update(&[1]);
                f(self, v);
            }
        }
        self
    }

    fn f32(&mut self, v: Option<f32>) -> &mut Self {
        self.opt(v, |h, v| {
            h.0.update(&v.to_bits().to_le_bytes());
        })
    }

    fn u64(&mut self, v: Option<u64>) -> &mut Self {
        self.opt(v, |h, v| {
            h.0.update(&v.to_le_bytes());
        })
    }

    /// Writes a digest.
    pub fn digest(&mut self, d: &Digest) -> &mut Self {
        self.bytes(d)
    }

    /// The key.
    pub fn finish(&self) -> Digest {
        *self.0.finalize().as_bytes()
    }

    fn messages(&mut self, msgs: &[ChatMessage]) -> &mut Self {
        self.0.update(&(msgs.len() as u64).to_le_bytes());
        for m in msgs {
            self.message(m);
        }
        self
    }

    /// Writes one message. A name and other fields are marked by pseudo-roles no real role
    /// can equal, so messages without them keep the keys they always had.
    pub fn message(&mut self, m: &ChatMessage) -> &mut Self {
        let ChatMessage {
            role,
            content,
            name,
            extra,
        } = m;
        self.str(role).str(content);
        if let Some(name) = name {
            self.str("\0name").str(name);
        }
        self.extras(extra)
    }

    /// Writes a message's other fields, if any, after a pseudo-role; ordered by key, so the
    /// same fields are the same key whatever order they came in.
    pub fn extras(&mut self, extra: &serde_json::Map<String, serde_json::Value>) -> &mut Self {
        if !extra.is_empty() {
            self.str("\0extra")
                .str(&reprise_backend::canonical_json(extra));
        }
        self
    }

    /// Everything except the input: model, sampling parameters, pass-through fields.
    fn settings(
        &mut self,
        model: &str,
        params: &SamplingParams,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> &mut Self {
        let SamplingParams {
            max_tokens,
            temperature,
            top_p,
            seed,
            stop,
            presence_penalty,
            frequency_penalty,
            max_completion_tokens_named: _,
            max_tokens_is_default,
        } = params;
        self.str(model);
        // The backend's own default is keyed as no bound: the same answer.
        let max_tokens = max_tokens.filter(|_| !max_tokens_is_default);
        self.u64(max_tokens.map(u64::from));
        self.f32(*temperature);
        self.f32(*top_p);
        self.u64(*seed);
        self.0.update(&(stop.len() as u64).to_le_bytes());
        for s in stop {
            self.str(s);
        }
        self.f32(*presence_penalty);
        self.f32(*frequency_penalty);
        // Ordered by key, so this serialisation is canonical (and, without unkeyed fields,
        // the same as the whole map's).
        let keyed: std::collections::BTreeMap<&String, &serde_json::Value> = extra
            .iter()
            .filter(|(k, _)| !UNKEYED_FIELDS.contains(&k.as_str()))
            .collect();
        let extra = serde_json::to_string(&keyed).unwrap_or_default();
        self.str(&extra)
    }
}

/// Request fields that name the caller or what the upstream keeps, never what is answered:
/// passed through, left out of every key (like `user`), so they do not split the cache per
/// end user.
pub const UNKEYED_FIELDS: [&str; 4] =
    ["safety_identifier", "prompt_cache_key", "metadata", "store"];

/// The exact-tier key: namespace, endpoint and the whole request (not the stream flag, so
/// stream and non-stream requests share one entry; not the priority or the `user` field).
pub fn exact_key(namespace: &str, endpoint: Endpoint, req: &GenRequest) -> Digest {
    let GenRequest {
        model,
        input,
        params,
        priority: _,
        extra,
        backend: _,
    } = req;
    let mut h = KeyHasher::new("exact");
    h.str(namespace).str(endpoint.as_str());
    h.settings(model, params, extra);
    match input {
        Input::Chat(msgs) => h.str("chat").messages(msgs),
        Input::Prompt(p) => h.str("prompt").str(p),
    };
    h.finish()
}

/// The semantic partition: everything that must match exactly for a near-duplicate to be
/// served — namespace, endpoint, model, sampling parameters, pass-through fields, the
/// conversation context and `unread`, the end of the matched text that the embedder does not
/// read (see [`reprise_embedder::Embedder::window`]) — but not the text that is matched by
/// meaning — and `unknown`, the words within the matched text the embedder reads as no word
/// in particular ([`reprise_embedder::Reading::unknown`]). An empty `unread` and no unknown
/// words add nothing, so texts the embedder reads whole keep the partitions they always had.
pub fn partition_key(
    namespace: &str,
    endpoint: Endpoint,
    req: &GenRequest,
    context: &Digest,
    unread: &str,
    unknown: &[&str],
) -> Digest {
    let GenRequest {
        model,
        input: _,
        params,
        priority: _,
        extra,
        backend: _,
    } = req;
    let mut h = KeyHasher::new("partition");
    h.str(namespace).str(endpoint.as_str());
    h.settings(model, params, extra);
    h.digest(context);
    if !unread.is_empty() {
        // Text beyond the embedder's window would otherwise never tell two prompts apart.
        h.str("unread").str(unread);
    }
    if !unknown.is_empty() {
        // Words the vector cannot tell apart (🦄 from 🐉) must match as written.
        h.str("unknown").u64(Some(unknown.len() as u64));
        for w in unknown {
            h.str(w);
        }
    }
    h.finish()
}

/// A chat request split for semantic matching: the context turns and the last user message.
#[derive(Debug)]
pub struct Conversation<'a> {
    /// System/developer messages before the first turn.
    pub preamble: Vec<&'a ChatMessage>,
    /// Earlier turns: the messages up to each assistant answer, and that answer.
    pub turns: Vec<(Vec<&'a ChatMessage>, &'a ChatMessage)>,
    /// Messages after the last answer and before the query (e.g. a second user message).
    pub pending: Vec<&'a ChatMessage>,
    /// The last message, from the user: its content is the text matched by meaning.
    pub last: &'a ChatMessage,
}

/// Splits a chat for semantic matching; `None` when the last message is not a user message
/// (an assistant prefill is not a question to match by meaning) or carries a `name` or
/// other fields.
pub fn split_conversation(msgs: &[ChatMessage]) -> Option<Conversation<'_>> {
    let (last, rest) = msgs.split_last()?;
    // A named speaker's question is only matched exactly: the name is not part of the text
    // matched by meaning, and who asks can change the answer.
    if last.role != "user" || !last.is_plain() {
        return None;
    }
    let mut preamble = Vec::new();
    let mut turns = Vec::new();
    let mut cur: Vec<&ChatMessage> = Vec::new();
    for m in rest {
        if m.role == "assistant" {
            turns.push((std::mem::take(&mut cur), m));
        } else if turns.is_empty()
            && cur.is_empty()
            && (m.role == "system" || m.role == "developer")
        {
            preamble.push(m);
        } else {
            cur.push(m);
        }
    }
    Some(Conversation {
        preamble,
        turns,
        pending: cur,
        last,
    })
}

/// The digest of raw messages (used where no served entry stands for them).
pub fn messages_digest(domain: &str, msgs: &[&ChatMessage]) -> Digest {
    let mut h = KeyHasher::new(domain);
    h.0.update(&(msgs.len() as u64).to_le_bytes());
    for m in msgs {
        h.message(m);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::chat;
    use reprise_backend::Priority;

    /// Fields that name the caller split no key; a field the answer depends on does.
    #[test]
    fn caller_identifiers_split_no_key() {
        let base = chat(&[("user", "hi")]);
        let k = exact_key("ns", Endpoint::Chat, &base);
        for (field, value) in [
            ("safety_identifier", serde_json::json!("user-123")),
            ("prompt_cache_key", serde_json::json!("session-9")),
            ("metadata", serde_json::json!({"customer": "acme"})),
            ("store", serde_json::json!(true)),
        ] {
            let mut r = base.clone();
            r.extra.insert(field.into(), value);
            assert_eq!(k, exact_key("ns", Endpoint::Chat, &r), "{field}");
        }
        let mut r = base.clone();
        r.extra.insert(
            "response_format".into(),
            serde_json::json!({"type": "json_object"}),
        );
        assert_ne!(k, exact_key("ns", Endpoint::Chat, &r));
    }

    #[test]
    fn keys_differ_on_every_output_affecting_field() {
        let base = chat(&[("user", "hi")]);
        let k = exact_key("ns", Endpoint::Chat, &base);
        assert_eq!(k, exact_key("ns", Endpoint::Chat, &base.clone()));
        assert_ne!(k, exact_key("other", Endpoint::Chat, &base));
        let mut r = base.clone();
        r.params.temperature = Some(0.5);
        assert_ne!(k, exact_key("ns", Endpoint::Chat, &r));
        let mut r = base.clone();
        r.params.stop = vec!["x".into()];
        assert_ne!(k, exact_key("ns", Endpoint::Chat, &r));
        let mut r = base.clone();
        r.extra.insert(
            "response_format".into(),
            serde_json::json!({"type": "json_object"}),
        );
        assert_ne!(k, exact_key("ns", Endpoint::Chat, &r));
        let mut r = base.clone();
        r.priority = Priority::Background;
        assert_eq!(
            k,
            exact_key("ns", Endpoint::Chat, &r),
            "priority is not output"
        );
    }

    #[test]
    fn partitions_isolate_namespace_model_params_and_context() {
        let base = chat(&[("user", "hi")]);
        let ctx = [7; 32];
        let p = partition_key("ns", Endpoint::Chat, &base, &ctx, "", &[]);
        // The matched text itself is not part of the partition.
        let other_text = chat(&[("user", "hello there")]);
        assert_eq!(
            p,
            partition_key("ns", Endpoint::Chat, &other_text, &ctx, "", &[])
        );
        let mut m = base.clone();
        m.model = "other-model".into();
        assert_ne!(
            p,
            partition_key("ns", Endpoint::Chat, &m, &ctx, "", &[]),
            "model"
        );
        assert_ne!(
            p,
            partition_key("ns2", Endpoint::Chat, &base, &ctx, "", &[]),
            "namespace"
        );
        assert_ne!(
            p,
            partition_key("ns", Endpoint::Completion, &base, &ctx, "", &[]),
            "endpoint"
        );
        assert_ne!(
            p,
            partition_key("ns", Endpoint::Chat, &base, &[8; 32], "", &[]),
            "context"
        );
        let mut t = base.clone();
        t.params.max_tokens = Some(5);
        assert_ne!(
            p,
            partition_key("ns", Endpoint::Chat, &t, &ctx, "", &[]),
            "params"
        );
        // What the embedder does not read must match exactly.
        let unread = partition_key("ns", Endpoint::Chat, &base, &ctx, "the end", &[]);
        assert_ne!(p, unread, "unread text");
        assert_ne!(
            unread,
            partition_key("ns", Endpoint::Chat, &base, &ctx, "the end!", &[]),
            "unread text"
        );
        // So must the words it reads as unknown.
        let unknown = |w: &[&str]| partition_key("ns", Endpoint::Chat, &base, &ctx, "", w);
        assert_ne!(p, unknown(&["🦄"]), "an unknown word");
        assert_ne!(unknown(&["🦄"]), unknown(&["🐉"]), "another unknown word");
        assert_ne!(
            unknown(&["🦄", "🐉"]),
            unknown(&["🦄🐉"]),
            "two words, not one"
        );
        assert_eq!(unknown(&["🦄"]), unknown(&["🦄"]));
    }

    #[test]
    fn participant_names_are_part_of_the_key_and_only_matched_exactly() {
        let set_name = |r: &mut GenRequest, i: usize, name: &str| {
            if let Input::Chat(m) = &mut r.input {
                m[i].name = Some(name.into());
            }
        };
        let base = chat(&[("user", "What should I do next?")]);
        let k = exact_key("ns", Endpoint::Chat, &base);
        let (mut alice, mut bob) = (base.clone(), base.clone());
        set_name(&mut alice, 0, "alice");
        set_name(&mut bob, 0, "bob");
        let ka = exact_key("ns", Endpoint::Chat, &alice);
        assert_ne!(k, ka);
        assert_ne!(ka, exact_key("ns", Endpoint::Chat, &bob));
        // A name cannot pass for message text: with the same number of messages, a name
        // that reads like the next message's role and content is still a different key.
        let mut named = chat(&[("user", "hi"), ("user", "q")]);
        set_name(&mut named, 0, "assistant");
        let mut shifted = chat(&[("user", "hi"), ("assistant", "user")]);
        set_name(&mut shifted, 1, "q");
        assert_ne!(
            exact_key("ns", Endpoint::Chat, &named),
            exact_key("ns", Endpoint::Chat, &shifted)
        );
        // The asker's name keeps the question out of meaning matching; an earlier speaker's
        // name is part of the context.
        let Input::Chat(msgs) = &alice.input else {
            unreachable!()
        };
        assert!(split_conversation(msgs).is_none());
        let mut earlier = chat(&[("user", "hi"), ("assistant", "hello"), ("user", "and now?")]);
        let Input::Chat(msgs) = &earlier.input else {
            unreachable!()
        };
        let plain = messages_digest("ctx", &split_conversation(msgs).unwrap().turns[0].0);
        set_name(&mut earlier, 0, "alice");
        let Input::Chat(msgs) = &earlier.input else {
            unreachable!()
        };
        let conv = split_conversation(msgs).expect("the last message has no name");
        assert_ne!(plain, messages_digest("ctx", &conv.turns[0].0));
    }

    /// Keys outlive the process (Redis, snapshots): a change to the encoding of requests that
    /// do not use a new field must not turn every stored entry into a miss.
    #[test]
    fn keys_of_existing_requests_are_stable() {
        let req = chat(&[
            ("system", "Be brief."),
            ("user", "What is the capital of France?"),
        ]);
        let hex = |d: Digest| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(exact_key("default", Endpoint::Chat, &req)),
            "1df48bedf8fe7c774db580d5003647b3f5f1e7704f30a1c3aa8c53c3727fdcb0"
        );
        // Partitions too (entries carry theirs); a question the embedder reads whole has no
        // unread end.
        assert_eq!(
            hex(partition_key(
                "default",
                Endpoint::Chat,
                &req,
                &[7; 32],
                "",
                &[]
            )),
            "d534ea13f279da917014e3f99df3536f03af3dbbb2f77e5ea52d7827a84192e4"
        );
    }

    #[test]
    fn encoding_is_prefix_free() {
        let a = chat(&[("user", "ab"), ("user", "c")]);
        let b = chat(&[("user", "a"), ("user", "bc")]);
        assert_ne!(
            exact_key("ns", Endpoint::Chat, &a),
            exact_key("ns", Endpoint::Chat, &b)
        );
    }

    #[test]
    fn conversation_split() {
        let r = chat(&[
            ("system", "be brief"),
            ("user", "who is Ada?"),
            ("assistant", "A mathematician."),
            ("user", "how old is she?"),
        ]);
        let Input::Chat(msgs) = &r.input else {
            panic!()
        };
        let c = split_conversation(msgs).unwrap();
        assert_eq!(c.preamble.len(), 1);
        assert_eq!(c.turns.len(), 1);
        assert_eq!(c.last.content, "how old is she?");
        assert!(split_conversation(&msgs[..3]).is_none());
    }
}
