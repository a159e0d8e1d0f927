//! Builders shared by the unit tests.

use reprise_backend::{ChatMessage, GenRequest, Input, Priority, SamplingParams};

/// An interactive chat request for model `m` with default sampling.
pub fn chat(msgs: &[(&str, &str)]) -> GenRequest {
    GenRequest {
        model: "m".into(),
        input: Input::Chat(msgs.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()),
        params: SamplingParams::default(),
        priority: Priority::Interactive,
        extra: Default::default(),
        backend: None,
    }
}

/// An observation of `request` answered by a live entry (id 1, namespace `n`) asked as
/// `prompt`; `entry` changes the entry before it is shared.
pub fn observation(
    request: GenRequest,
    prompt: &str,
    entry: impl FnOnce(&mut reprise_cache::Entry),
) -> crate::observe::Observation {
    let mut e = reprise_cache::Entry {
        id: reprise_cache::EntryId(1),
        namespace: "n".into(),
        model: "m".into(),
        text: "an answer".into(),
        finish_reason: "stop".into(),
        prompt_tokens: 1,
        completion_tokens: 1,
        prompt: prompt.into(),
        partition: [0; 32],
        embedding: None,
        embedder: None,
        origin: Default::default(),
        tags: Vec::new(),
        refusals: Vec::new(),
        created_ms: 1,
        expires_ms: u64::MAX,
        gen_ms: 0,
    };
    entry(&mut e);
    crate::observe::Observation {
        namespace: "n".into(),
        endpoint: crate::openai::Endpoint::Chat,
        request,
        session: None,
        prev_entry: None,
        entry: std::sync::Arc::new(e),
        may_store: true,
        generated: false,
    }
}
