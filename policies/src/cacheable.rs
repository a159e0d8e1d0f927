//! What is cacheable: whether a request asks for more than a cached text answer can give.
//!
//! The cache stores one text answer per prompt. A request that asks for tool calls,
//! log-probabilities, audio, several choices or several prompts, or that carries a tool or
//! audio conversation, needs the upstream; the first field that does so is reported as an
//! [`Uncacheable`] and the request is forwarded as it came. Requests that merely pass
//! options through (e.g. `response_format`) stay cacheable.
//!
//! The inputs are neutral shapes of the request (its unknown fields as JSON, `n`, each
//! message's role, unknown fields and whether its content has non-text parts), so this
//! module does not depend on the proxy's request types.

use serde_json::{Map, Value};

/// Chat request fields whose answer is more than text: tool calls, log-probabilities, audio.
const CHAT_FIELDS: &[&str] = &[
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "logprobs",
    "top_logprobs",
    "audio",
    "modalities",
    "web_search_options",
];

/// Message fields of tool and audio conversations, which the cache's text-only messages
/// cannot carry, with their metric labels.
const MESSAGE_FIELDS: &[(&str, &str)] = &[
    ("tool_calls", "messages.tool_calls"),
    ("tool_call_id", "messages.tool_call_id"),
    ("function_call", "messages.function_call"),
    ("audio", "messages.audio"),
];

/// Completions request fields whose answer is more than one text.
const COMPLETION_FIELDS: &[&str] = &["best_of", "logprobs", "echo", "suffix"];

/// The field of a request that needs the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uncacheable {
    /// The field as a path: `tools`, `messages[2].tool_calls`, `messages[1].role`, `n`.
    pub param: String,
    /// The same field without indices, for the metric label: `tools`, `messages.tool_calls`.
    pub field: &'static str,
}

impl Uncacheable {
    fn new(param: impl Into<String>, field: &'static str) -> Self {
        Uncacheable {
            param: param.into(),
            field,
        }
    }
}

/// What classification needs of one chat message.
#[derive(Debug, Clone, Copy)]
pub struct MessageShape<'a> {
    /// The message's role (`user`, `tool`, ...).
    pub role: &'a str,
    /// The message's fields besides role, content and name.
    pub extra: &'a Map<String, Value>,
    /// The content is a list of parts and one of them is not `text`.
    pub non_text_parts: bool,
}

/// What classification needs of a completions prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptShape {
    /// A single prompt string.
    One,
    /// A list of prompt strings, with its length (one is cacheable, several are not).
    Many(usize),
    /// Token ids: only an upstream with the same tokenizer can read them.
    Tokens,
}

/// Whether a field's value asks for something: not null, `false`, `[]`, `""`, a
/// `modalities` of text only or a `best_of` of 1.
fn asks_for(field: &str, v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => false,
        Value::Array(a) if field == "modalities" => a.iter().any(|m| m.as_str() != Some("text")),
        Value::Array(a) => !a.is_empty(),
        Value::String(s) => !s.is_empty(),
        Value::Number(n) if field == "best_of" => n.as_u64() != Some(1),
        _ => true,
    }
}

/// The first of `fields` that a request asks for, else `n > 1`.
fn top_level(
    fields: &[&'static str],
    extra: &Map<String, Value>,
    n: Option<u32>,
) -> Option<Uncacheable> {
    if let Some(f) = fields
        .iter()
        .find(|f| extra.get(**f).is_some_and(|v| asks_for(f, v)))
    {
        return Some(Uncacheable::new(*f, f));
    }
    n.is_some_and(|n| n > 1).then(|| Uncacheable::new("n", "n"))
}

/// The first field of a chat request that needs the upstream, or `None` when a cached text
/// answer will do.
///
/// Checked in order: the top-level fields (`tools`, `logprobs`, `modalities`, ...), then
/// `n > 1`, then each message in turn: a `tool` or `function` role, a tool or audio field,
/// content with non-text parts. `extra` holds the request's fields besides the ones the
/// proxy reads itself.
pub fn chat<'a>(
    extra: &Map<String, Value>,
    n: Option<u32>,
    messages: impl IntoIterator<Item = MessageShape<'a>>,
) -> Option<Uncacheable> {
    if let Some(found) = top_level(CHAT_FIELDS, extra, n) {
        return Some(found);
    }
    for (i, m) in messages.into_iter().enumerate() {
        if matches!(m.role, "tool" | "function") {
            return Some(Uncacheable::new(
                format!("messages[{i}].role"),
                "messages.role",
            ));
        }
        if let Some((f, label)) = MESSAGE_FIELDS
            .iter()
            .find(|(f, _)| m.extra.get(*f).is_some_and(|v| asks_for(f, v)))
        {
            return Some(Uncacheable::new(format!("messages[{i}].{f}"), label));
        }
        if m.non_text_parts {
            return Some(Uncacheable::new(
                format!("messages[{i}].content"),
                "messages.content",
            ));
        }
    }
    None
}

/// The first field of a completions request that needs the upstream, or `None` when a
/// cached text answer will do.
///
/// Checked in order: the top-level fields (`best_of` above 1, `logprobs`, `echo`,
/// `suffix`), then `n > 1`, then the prompt: several prompts or token ids.
pub fn completion(
    extra: &Map<String, Value>,
    n: Option<u32>,
    prompt: PromptShape,
) -> Option<Uncacheable> {
    top_level(COMPLETION_FIELDS, extra, n).or_else(|| match prompt {
        PromptShape::Many(len) if len > 1 => Some(Uncacheable::new("prompt", "prompt")),
        PromptShape::Tokens => Some(Uncacheable::new("prompt", "prompt")),
        PromptShape::One | PromptShape::Many(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("an object"),
        }
    }

    fn forward(param: &str, field: &'static str) -> Option<Uncacheable> {
        Some(Uncacheable::new(param, field))
    }

    /// A chat request of one plain user message with `field: value` at the top level.
    fn chat_with(field: &str, value: Value) -> Option<Uncacheable> {
        let extra = map(json!({ field: value }));
        let none = Map::new();
        chat(&extra, None, [user(&none)])
    }

    fn user(extra: &Map<String, Value>) -> MessageShape<'_> {
        MessageShape {
            role: "user",
            extra,
            non_text_parts: false,
        }
    }

    fn completion_with(field: &str, value: Value) -> Option<Uncacheable> {
        completion(&map(json!({ field: value })), None, PromptShape::One)
    }

    #[test]
    fn chat_fields_that_ask_for_more_than_text() {
        assert_eq!(
            chat_with("tools", json!([{"type": "function"}])),
            forward("tools", "tools")
        );
        assert_eq!(chat_with("tools", json!([])), None);
        assert_eq!(
            chat_with("tool_choice", json!("none")),
            forward("tool_choice", "tool_choice")
        );
        assert_eq!(chat_with("tool_choice", json!("")), None);
        assert_eq!(chat_with("logprobs", json!(false)), None);
        assert_eq!(chat_with("logprobs", json!(null)), None);
        assert_eq!(
            chat_with("logprobs", json!(true)),
            forward("logprobs", "logprobs")
        );
        assert_eq!(chat_with("modalities", json!(["text"])), None);
        assert_eq!(
            chat_with("modalities", json!(["text", "audio"])),
            forward("modalities", "modalities")
        );
        assert_eq!(
            chat_with("audio", json!({"voice": "alloy"})),
            forward("audio", "audio")
        );
        assert_eq!(
            chat_with("response_format", json!({"type": "json_object"})),
            None
        );
    }

    #[test]
    fn several_choices_need_the_upstream() {
        let none = Map::new();
        assert_eq!(chat(&none, None, [user(&none)]), None);
        assert_eq!(chat(&none, Some(1), [user(&none)]), None);
        assert_eq!(chat(&none, Some(2), [user(&none)]), forward("n", "n"));
        assert_eq!(
            completion(&none, Some(2), PromptShape::One),
            forward("n", "n")
        );
        // A field is reported before `n`.
        let tools = map(json!({"tools": [{}]}));
        assert_eq!(
            chat(&tools, Some(2), [user(&none)]),
            forward("tools", "tools")
        );
    }

    #[test]
    fn messages_of_tool_and_audio_conversations() {
        let none = Map::new();
        let msg = |role, extra, non_text_parts| MessageShape {
            role,
            extra,
            non_text_parts,
        };
        assert_eq!(
            chat(
                &none,
                None,
                [msg("user", &none, false), msg("function", &none, false)]
            ),
            forward("messages[1].role", "messages.role")
        );
        assert_eq!(
            chat(&none, None, [msg("tool", &none, false)]),
            forward("messages[0].role", "messages.role")
        );
        let calls = map(json!({"content": null, "tool_calls": [{"id": "c"}]}));
        assert_eq!(
            chat(&none, None, [msg("assistant", &calls, false)]),
            forward("messages[0].tool_calls", "messages.tool_calls")
        );
        let audio = map(json!({"audio": {"id": "a"}}));
        assert_eq!(
            chat(
                &none,
                None,
                [
                    msg("user", &none, false),
                    msg("user", &none, false),
                    msg("assistant", &audio, false)
                ]
            ),
            forward("messages[2].audio", "messages.audio")
        );
        let empty_calls = map(json!({"tool_calls": []}));
        assert_eq!(
            chat(&none, None, [msg("assistant", &empty_calls, false)]),
            None
        );
        assert_eq!(
            chat(&none, None, [msg("user", &none, true)]),
            forward("messages[0].content", "messages.content")
        );
        // Within a message: the role first, then its fields, then its content.
        assert_eq!(
            chat(&none, None, [msg("tool", &calls, true)]),
            forward("messages[0].role", "messages.role")
        );
        assert_eq!(
            chat(&none, None, [msg("assistant", &calls, true)]),
            forward("messages[0].tool_calls", "messages.tool_calls")
        );
        // The first message that needs the upstream is reported.
        assert_eq!(
            chat(
                &none,
                None,
                [msg("user", &none, true), msg("tool", &none, false)]
            ),
            forward("messages[0].content", "messages.content")
        );
    }

    #[test]
    fn completion_fields_and_prompts() {
        assert_eq!(completion_with("best_of", json!(1)), None);
        assert_eq!(
            completion_with("best_of", json!(3)),
            forward("best_of", "best_of")
        );
        assert_eq!(
            completion_with("echo", json!(true)),
            forward("echo", "echo")
        );
        assert_eq!(
            completion_with("logprobs", json!(0)),
            forward("logprobs", "logprobs")
        );
        assert_eq!(completion_with("suffix", json!("")), None);
        assert_eq!(
            completion_with("suffix", json!("end")),
            forward("suffix", "suffix")
        );
        let none = Map::new();
        assert_eq!(completion(&none, None, PromptShape::One), None);
        assert_eq!(completion(&none, None, PromptShape::Many(1)), None);
        assert_eq!(
            completion(&none, None, PromptShape::Many(2)),
            forward("prompt", "prompt")
        );
        assert_eq!(
            completion(&none, None, PromptShape::Tokens),
            forward("prompt", "prompt")
        );
        // An empty list is not classified here (the caller rejects it).
        assert_eq!(completion(&none, None, PromptShape::Many(0)), None);
        // Fields and `n` come before the prompt.
        assert_eq!(
            completion(&none, Some(3), PromptShape::Tokens),
            forward("n", "n")
        );
    }
}
