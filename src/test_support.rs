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
