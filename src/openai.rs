//! OpenAI wire types: the request bodies reprise accepts and the response bodies and stream
//! chunks it renders.
//!
//! Requests keep every field they do not interpret in `extra`: those fields are part of the
//! cache key (so an unknown field can only make two requests different, never the same) and
//! are passed through to upstream backends verbatim. The exceptions are the fields that name
//! the caller or what the upstream keeps, never what is answered
//! ([`crate::key::UNKEYED_FIELDS`]: `safety_identifier`, `prompt_cache_key`, `metadata`,
//! `store`): passed through, left out of the key like `user`.

use reprise_backend::{FinishReason, Usage};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with token usage before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// A message's `content`: a string or a list of typed parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts; only `text` parts are supported.
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
    /// The part's other fields (a gateway's `cache_control`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One input chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The content; may be null on assistant messages that only carry tool calls.
    #[serde(default)]
    pub content: Option<Content>,
    /// Optional participant name.
    #[serde(default)]
    pub name: Option<String>,
    /// Fields not interpreted here (tool calls and the like).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Upper bound on generated tokens (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Upper bound on generated tokens.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// End-user id; links consecutive prompts of one session, never part of the cache key.
    #[serde(default)]
    pub user: Option<String>,
    /// Everything else.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `prompt` of a completions request.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A single prompt.
    One(String),
    /// A list of prompts; one is cached, several go upstream.
    Many(Vec<String>),
    /// Token ids (one prompt, or several): only an upstream with the same tokenizer can read
    /// them, so they go upstream.
    Tokens(TokenPrompt),
}

/// A prompt given as token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenPrompt {
    /// One prompt.
    One(Vec<u32>),
    /// Several prompts.
    Many(Vec<Vec<u32>>),
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name.
    pub model: String,
    /// The raw prompt.
    pub prompt: Prompt,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Upper bound on generated tokens.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// End-user id; never part of the cache key.
    #[serde(default)]
    pub user: Option<String>,
    /// Everything else.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The first path segment under `/v1/` of the OpenAI API's other endpoints, which
/// `backend.passthrough` may open to an upstream (WebSocket endpoints cannot pass).
pub const API_ROOTS: &[&str] = &[
    "assistants",
    "audio",
    "batches",
    "containers",
    "conversations",
    "embeddings",
    "evals",
    "files",
    "fine_tuning",
    "images",
    "models",
    "moderations",
    "responses",
    "threads",
    "uploads",
    "vector_stores",
];

/// Which endpoint a request came in on; decides the response shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

impl Endpoint {
    /// Stable tag used in cache keys and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
        }
    }
}

/// Renders answers in the shape of one endpoint: a whole JSON body or stream chunks.
#[derive(Debug, Clone)]
pub struct Renderer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

/// A whole (non-streaming) response body ([`Renderer::full`]).
#[derive(Debug, Serialize)]
pub struct Full<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [FullChoice<'a>; 1],
    usage: UsageOut,
}

/// The one choice of a [`Full`] body: a chat message, or a completion's text.
#[derive(Debug, Serialize)]
struct FullChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    /// Always `null`.
    logprobs: (),
    finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

/// `usage` object.
#[derive(Debug, Serialize)]
struct UsageOut {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
}

impl From<Usage> for UsageOut {
    fn from(u: Usage) -> Self {
        UsageOut {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.total_tokens(),
        }
    }
}

impl Renderer {
    /// A renderer for one response with a fresh id.
    pub fn new(endpoint: Endpoint, model: &str) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        Renderer {
            endpoint,
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: model.to_string(),
        }
    }

    /// The response's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The same response (id, time), naming another model: the one that answered.
    pub fn with_model(self, model: &str) -> Self {
        Renderer {
            model: model.to_string(),
            ..self
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// The whole (non-streaming) response body: typed, serialised as it is written (no
    /// JSON tree is built on the way, which the exact-hit path would pay for).
    pub fn full<'a>(&'a self, text: &'a str, finish: FinishReason, usage: Usage) -> Full<'a> {
        let (message, text) = match self.endpoint {
            Endpoint::Chat => (
                Some(Message {
                    role: "assistant",
                    content: text,
                }),
                None,
            ),
            Endpoint::Completion => (None, Some(text)),
        };
        Full {
            id: &self.id,
            object: self.object(false),
            created: self.created,
            model: &self.model,
            choices: [FullChoice {
                index: 0,
                message,
                text,
                logprobs: (),
                finish_reason: finish.as_str(),
            }],
            usage: UsageOut::from(usage),
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The first chunk of a chat stream (announces the assistant role); `None` for completions.
    pub fn role_chunk(&self) -> Option<Value> {
        match self.endpoint {
            Endpoint::Chat => Some(self.chunk(json!({
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            }))),
            Endpoint::Completion => None,
        }
    }

    /// A chunk carrying new text.
    pub fn delta_chunk(&self, text: &str) -> Value {
        match self.endpoint {
            Endpoint::Chat => self.chunk(json!({
                "index": 0,
                "delta": {"content": text},
                "logprobs": null,
                "finish_reason": null,
            })),
            Endpoint::Completion => self.chunk(json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": null,
            })),
        }
    }

    /// The chunk that carries the finish reason.
    pub fn finish_chunk(&self, finish: FinishReason) -> Value {
        match self.endpoint {
            Endpoint::Chat => self.chunk(json!({
                "index": 0,
                "delta": {},
                "logprobs": null,
                "finish_reason": finish.as_str(),
            })),
            Endpoint::Completion => self.chunk(json!({
                "index": 0,
                "text": "",
                "logprobs": null,
                "finish_reason": finish.as_str(),
            })),
        }
    }

    /// The usage chunk sent when `stream_options.include_usage` is set (empty `choices`).
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": UsageOut::from(usage),
        })
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat_with_parts_and_extra() {
        let r: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "response_format": {"type": "json_object"},
            "stop": "x"
        }))
        .unwrap();
        assert!(r.extra.contains_key("response_format"));
        assert_eq!(r.stop.unwrap().into_vec(), vec!["x".to_string()]);
    }

    #[test]
    fn renders_chat_shapes() {
        let r = Renderer::new(Endpoint::Chat, "m");
        let full = r.full(
            "hello",
            FinishReason::Stop,
            Usage {
                prompt_tokens: 3,
                completion_tokens: 1,
            },
        );
        let full = serde_json::to_value(full).unwrap();
        assert_eq!(
            full["choices"][0],
            json!({"index": 0, "message": {"role": "assistant", "content": "hello"},
                   "logprobs": null, "finish_reason": "stop"})
        );
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["content"], "hello");
        assert_eq!(full["usage"]["total_tokens"], 4);
        let c = Renderer::new(Endpoint::Completion, "m");
        let full =
            serde_json::to_value(c.full("hi", FinishReason::Length, Usage::default())).unwrap();
        assert_eq!(
            full["choices"][0],
            json!({"index": 0, "text": "hi", "logprobs": null, "finish_reason": "length"})
        );
        assert_eq!(full["object"], "text_completion");
        assert_eq!(full["model"], "m");
        assert_eq!(r.delta_chunk("he")["choices"][0]["delta"]["content"], "he");
        assert!(r.usage_chunk(Usage::default())["choices"]
            .as_array()
            .unwrap()
            .is_empty());
    }
}
