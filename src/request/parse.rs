//! Step 1 of the request path: the body becomes a [`GenRequest`] (serde +
//! serde_path_to_error, so a bad field is named in the OpenAI error's `param`), or, when it
//! asks for more than one text answer (decided in [`reprise_policies::cacheable`]), a
//! [`Forward`] that only an upstream can answer.

use reprise_backend::{ChatMessage, GenRequest, Input, Priority, SamplingParams};
use reprise_policies::cacheable::{self, MessageShape, PromptShape, Uncacheable};

use crate::error::ApiError;
use crate::forward::Forward;
use crate::openai::{ChatCompletionRequest, CompletionRequest, Content, Endpoint, Prompt};

/// A parsed request.
pub struct Parsed {
    /// What the backend would be asked.
    pub req: GenRequest,
    /// Answer as SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// The OpenAI `user` field.
    pub user: Option<String>,
}

/// What [`parse`] makes of a body.
pub enum Request {
    /// Answered from the cache, or generated and stored.
    Cacheable(Parsed),
    /// Asks for more than a cached text answer can give; goes upstream as it came.
    Forward(Forward),
}

/// The first field of a chat request that needs the upstream.
fn chat_forward_field(r: &ChatCompletionRequest) -> Option<Uncacheable> {
    let shapes = r.messages.iter().map(|m| MessageShape {
        role: &m.role,
        extra: &m.extra,
        non_text_parts: matches!(&m.content, Some(Content::Parts(p)) if p.iter().any(|p| p.kind != "text")),
    });
    cacheable::chat(&r.extra, r.n, shapes)
}

/// The first field of a completions request that needs the upstream.
fn completion_forward_field(r: &CompletionRequest) -> Option<Uncacheable> {
    let prompt = match &r.prompt {
        Prompt::One(_) => PromptShape::One,
        Prompt::Many(v) => PromptShape::Many(v.len()),
        Prompt::Tokens(_) => PromptShape::Tokens,
    };
    cacheable::completion(&r.extra, r.n, prompt)
}

/// The fields both endpoints' requests share, as (the backend request, stream, include
/// usage, user, n). A macro because the two request types are separate wire types.
macro_rules! shared_fields {
    ($r:ident, $input:expr, $max_tokens:expr, $named:expr) => {{
        let params = SamplingParams {
            max_tokens: $max_tokens,
            max_completion_tokens_named: $named,
            // Known once routed (see `request::serve`).
            max_tokens_is_default: false,
            temperature: $r.temperature,
            top_p: $r.top_p,
            seed: $r.seed,
            stop: $r.stop.map(|s| s.into_vec()).unwrap_or_default(),
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
        };
        let req = GenRequest {
            model: $r.model,
            input: $input,
            params,
            priority: Priority::Interactive,
            extra: $r.extra,
            backend: None,
        };
        let include_usage = $r.stream_options.is_some_and(|o| o.include_usage);
        (
            req,
            $r.stream.unwrap_or(false),
            include_usage,
            $r.user,
            $r.n,
        )
    }};
}

/// Longest stop string accepted: the generation checks each against the text it holds back
/// on every token.
pub const MAX_STOP_BYTES: usize = 1024;

/// Messages a chat request may hold.
pub const MAX_MESSAGES: usize = 4096;

/// Content parts one message may hold.
pub const MAX_CONTENT_PARTS: usize = 1024;

/// Parses and validates a request body. A request that asks for more than a text answer
/// (tools, several choices, images, log-probabilities) is only checked for the fields reprise
/// itself reads; the upstream validates the rest.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Request, ApiError> {
    fn de<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
        let de = &mut serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                return ApiError::invalid(format!("the body is not valid JSON: {inner}"), None);
            }
            let param = (path != ".").then_some(path);
            ApiError::InvalidRequest {
                message: format!("invalid request: {inner}"),
                param,
            }
        })
    }
    let (req, stream, include_usage, user, n) = match endpoint {
        Endpoint::Chat => {
            let r: ChatCompletionRequest = de(body)?;
            check_model(&r.model)?;
            no_other_bound(&r.extra)?;
            at_least_one(r.max_tokens, "max_tokens")?;
            at_least_one(r.max_completion_tokens, "max_completion_tokens")?;
            if r.messages.is_empty() {
                return Err(ApiError::invalid(
                    "`messages` must not be empty",
                    Some("messages"),
                ));
            }
            // Each message is copied several times on its way (the key, the generation
            // request, the prefetcher's observation, an upstream body): a body of a few
            // megabytes of tiny messages must not become hundreds of megabytes.
            if r.messages.len() > MAX_MESSAGES {
                return Err(ApiError::invalid(
                    format!("`messages` may hold at most {MAX_MESSAGES} messages"),
                    Some("messages"),
                ));
            }
            if let Some(i) = r.messages.iter().position(
                |m| matches!(&m.content, Some(Content::Parts(p)) if p.len() > MAX_CONTENT_PARTS),
            ) {
                return Err(ApiError::invalid(
                    format!("a message's `content` may hold at most {MAX_CONTENT_PARTS} parts"),
                    Some(&format!("messages[{i}].content")),
                ));
            }
            if let Some(found) = chat_forward_field(&r) {
                // Both fields go upstream as they are: the larger is what may be spent.
                let max_tokens = r.max_completion_tokens.max(r.max_tokens);
                return Ok(Request::Forward(Forward::new(
                    r.model, r.stream, found, max_tokens, r.n,
                )));
            }
            let mut msgs = Vec::with_capacity(r.messages.len());
            for (i, m) in r.messages.into_iter().enumerate() {
                if !matches!(
                    m.role.as_str(),
                    "system" | "developer" | "user" | "assistant" | "tool"
                ) {
                    return Err(ApiError::invalid(
                        format!("unknown role `{}`", m.role),
                        Some(&format!("messages[{i}].role")),
                    ));
                }
                // Parts with fields of their own (`cache_control`, ...), as given: they
                // reach upstreams as they came and key the answer.
                let mut given_parts = None;
                let content = match m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t,
                    Some(Content::Parts(parts)) => {
                        if parts.iter().any(|p| p.extra.values().any(is_present)) {
                            given_parts = Some(parts_as_given(&parts));
                        }
                        let mut text = String::new();
                        for p in parts {
                            // Other part types went to `Forward` above.
                            match p.text {
                                Some(t) => text.push_str(&t),
                                None => {
                                    return Err(ApiError::invalid(
                                        "a `text` content part needs a `text` string",
                                        Some(&format!("messages[{i}].content")),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                // Fields read nowhere here still key the answer and go upstream (a
                // continuation's `prefix`, a model's own reasoning): two messages that differ
                // in one are different requests.
                let mut extra = m.extra;
                // (Names with a NUL are reprise's own, such as `GIVEN_PARTS`.)
                if extra.keys().any(|k| k.contains('\0')) {
                    return Err(ApiError::invalid(
                        "message field names must not contain NUL characters",
                        Some(&format!("messages[{i}]")),
                    ));
                }
                extra.retain(|_, v| is_present(v));
                if let Some(parts) = given_parts {
                    extra.insert(reprise_backend::GIVEN_PARTS.into(), parts);
                }
                msgs.push(ChatMessage {
                    role: m.role,
                    content,
                    name: m.name,
                    extra,
                });
            }
            let named = r.max_completion_tokens.is_some();
            let max_tokens = r.max_completion_tokens.or(r.max_tokens);
            shared_fields!(r, Input::Chat(msgs), max_tokens, named)
        }
        Endpoint::Completion => {
            let r: CompletionRequest = de(body)?;
            check_model(&r.model)?;
            no_other_bound(&r.extra)?;
            at_least_one(r.max_tokens, "max_tokens")?;
            if let Some(found) = completion_forward_field(&r) {
                let answers = completion_answers(&r)?;
                return Ok(Request::Forward(Forward::new(
                    r.model,
                    r.stream,
                    found,
                    r.max_tokens,
                    Some(answers),
                )));
            }
            let prompt = match r.prompt {
                Prompt::One(p) => p,
                Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
                Prompt::Many(_) | Prompt::Tokens(_) => {
                    return Err(ApiError::invalid(
                        "`prompt` must not be empty",
                        Some("prompt"),
                    ))
                }
            };
            shared_fields!(r, Input::Prompt(prompt), r.max_tokens, false)
        }
    };
    // `n > 1` went to `Forward` above.
    if n == Some(0) {
        return Err(ApiError::invalid("`n` must be at least 1", Some("n")));
    }
    let p = &req.params;
    if p.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return Err(ApiError::invalid(
            "`temperature` must be between 0 and 2",
            Some("temperature"),
        ));
    }
    if p.top_p.is_some_and(|t| !(t > 0.0 && t <= 1.0)) {
        return Err(ApiError::invalid(
            "`top_p` must be in (0, 1]",
            Some("top_p"),
        ));
    }
    if p.stop.len() > 4
        || p.stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(
            format!("`stop` takes up to 4 non-empty strings of at most {MAX_STOP_BYTES} bytes"),
            Some("stop"),
        ));
    }
    for (name, v) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if v.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
            return Err(ApiError::invalid(
                format!("`{name}` must be between -2 and 2"),
                Some(name),
            ));
        }
    }
    Ok(Request::Cacheable(Parsed {
        req,
        stream,
        include_usage,
        user,
    }))
}

/// How many answers a completions request asks the upstream to generate: `max(n, best_of)`
/// for each of its prompts. A `best_of` that is not a positive whole number is refused (an
/// upstream that reads `3.0` or `"20"` as a count would generate what was never charged).
fn completion_answers(r: &CompletionRequest) -> Result<u32, ApiError> {
    let best_of = match r.extra.get("best_of") {
        None | Some(serde_json::Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .filter(|&b| b >= 1)
            .map(|b| u32::try_from(b).unwrap_or(u32::MAX))
            .ok_or_else(|| {
                ApiError::invalid("`best_of` must be a positive whole number", Some("best_of"))
            })?,
    };
    let prompts = match &r.prompt {
        Prompt::Many(v) => v.len(),
        Prompt::Tokens(crate::openai::TokenPrompt::Many(v)) => v.len(),
        _ => 1,
    };
    let per_prompt = r.n.unwrap_or(1).max(best_of).max(1);
    Ok(per_prompt.saturating_mul(u32::try_from(prompts.max(1)).unwrap_or(u32::MAX)))
}

/// Whether a message or part field says anything: a null or an empty value is an absent
/// field (clients echo `"annotations": []`, `"refusal": null` back with an answer).
fn is_present(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => false,
        serde_json::Value::String(s) => !s.is_empty(),
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

/// Text parts as the client gave them, absent fields left out.
fn parts_as_given(parts: &[crate::openai::ContentPart]) -> serde_json::Value {
    let parts = parts.iter().map(|p| {
        let mut part = serde_json::Map::new();
        part.insert("type".into(), p.kind.clone().into());
        if let Some(text) = &p.text {
            part.insert("text".into(), text.clone().into());
        }
        part.extend(
            p.extra
                .iter()
                .filter(|(_, v)| is_present(v))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        serde_json::Value::Object(part)
    });
    serde_json::Value::Array(parts.collect())
}

/// Longest model name taken (OpenAI's are a few dozen bytes): a name is a cache key part, a
/// log field and a response field, so a megabyte of it is refused rather than carried.
pub const MAX_MODEL_BYTES: usize = 256;

fn check_model(model: &str) -> Result<(), ApiError> {
    if model.len() > MAX_MODEL_BYTES {
        return Err(ApiError::invalid(
            format!("`model` may be at most {MAX_MODEL_BYTES} bytes"),
            Some("model"),
        ));
    }
    Ok(())
}

/// Fields some upstream servers read as the bound on the answer's length in place of
/// `max_tokens` (llama.cpp's `n_predict`, TGI's `max_new_tokens`, Ollama's `num_predict`, the
/// Responses API's `max_output_tokens`). Passed on, one would outrun the cap and the budget
/// reprise keeps with `max_tokens`. (vLLM's `min_tokens` and `ignore_eos` stay within
/// `max_tokens`, and pass.)
const OTHER_BOUNDS: [&str; 4] = [
    "n_predict",
    "max_new_tokens",
    "num_predict",
    "max_output_tokens",
];

/// Refuses a request that bounds its answer otherwise than with `max_tokens` or
/// `max_completion_tokens` ([`OTHER_BOUNDS`]; `null` bounds nothing).
fn no_other_bound(extra: &serde_json::Map<String, serde_json::Value>) -> Result<(), ApiError> {
    let given = |f: &&&str| extra.get(**f).is_some_and(|v| !v.is_null());
    match OTHER_BOUNDS.iter().find(given) {
        Some(field) => Err(ApiError::invalid(
            format!("`{field}` is not taken: bound the answer with `max_tokens`"),
            Some(field),
        )),
        None => Ok(()),
    }
}

/// A token bound, when given, must be at least 1 (an upstream may read 0 as no bound, and it
/// would be charged nothing).
fn at_least_one(bound: Option<u32>, field: &str) -> Result<(), ApiError> {
    match bound {
        Some(0) => Err(ApiError::invalid(
            format!("`{field}` must be at least 1"),
            Some(field),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn classify(endpoint: Endpoint, body: Value) -> Result<Option<(String, &'static str)>, String> {
        match parse(endpoint, body.to_string().as_bytes()) {
            Ok(Request::Cacheable(_)) => Ok(None),
            Ok(Request::Forward(f)) => Ok(Some((f.param, f.field))),
            Err(e) => Err(e.to_string()),
        }
    }

    fn chat_with(field: &str, value: Value) -> Value {
        let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        b[field] = value;
        b
    }

    /// Messages and a message's content parts are counted, forwarded requests' too.
    #[test]
    fn messages_and_parts_are_counted() {
        let msgs = |n: usize| {
            let m = json!({"role": "user", "content": "hi"});
            json!({"model": "m", "messages": vec![m; n]})
        };
        assert_eq!(classify(Endpoint::Chat, msgs(MAX_MESSAGES)), Ok(None));
        let err = classify(Endpoint::Chat, msgs(MAX_MESSAGES + 1)).unwrap_err();
        assert!(err.contains("at most 4096 messages"), "{err}");
        let mut forwarded = msgs(MAX_MESSAGES + 1);
        forwarded["tools"] = json!([{"type": "function"}]);
        assert!(
            classify(Endpoint::Chat, forwarded).is_err(),
            "forwarded too"
        );
        let parts = |n: usize| {
            let part = json!({"type": "text", "text": "a"});
            let m = json!({"role": "user", "content": vec![part; n]});
            json!({"model": "m", "messages": [m]})
        };
        assert_eq!(classify(Endpoint::Chat, parts(MAX_CONTENT_PARTS)), Ok(None));
        let err = classify(Endpoint::Chat, parts(MAX_CONTENT_PARTS + 1)).unwrap_err();
        assert!(err.contains("parts"), "{err}");
    }

    #[test]
    fn a_model_name_is_bounded() {
        let named = |n: usize| json!({"model": "m".repeat(n), "prompt": "hi"});
        assert_eq!(
            classify(Endpoint::Completion, named(MAX_MODEL_BYTES)),
            Ok(None)
        );
        let err = classify(Endpoint::Completion, named(MAX_MODEL_BYTES + 1)).unwrap_err();
        assert!(err.contains("model"), "{err}");
        let mut chat = chat_with("tools", json!([{"type": "function"}]));
        chat["model"] = "m".repeat(100_000).into();
        assert!(classify(Endpoint::Chat, chat).is_err(), "forwarded too");
    }

    /// The answer is bounded by `max_tokens` (or `max_completion_tokens`) only: another
    /// server's own bound is refused, forwarded or not, and a bound of 0 too.
    #[test]
    fn the_answer_is_bounded_by_max_tokens_only() {
        // Null bounds nothing; vLLM's own fields stay within `max_tokens`.
        for (field, value) in [("n_predict", json!(null)), ("ignore_eos", json!(true))] {
            assert_eq!(classify(Endpoint::Chat, chat_with(field, value)), Ok(None));
        }
        for field in OTHER_BOUNDS {
            let refused = |r: Result<_, String>| r.is_err_and(|e| e.contains(field));
            assert!(refused(classify(
                Endpoint::Chat,
                chat_with(field, json!(-1))
            )));
            let mut forwarded = chat_with("tools", json!([{"type": "function"}]));
            forwarded[field] = json!(true);
            assert!(refused(classify(Endpoint::Chat, forwarded)), "{field}");
            let completion = json!({"model": "m", "prompt": "hi", field: 9});
            assert!(refused(classify(Endpoint::Completion, completion)));
        }
        for field in ["max_tokens", "max_completion_tokens"] {
            let mut forwarded = chat_with("tools", json!([{"type": "function"}]));
            forwarded[field] = json!(0);
            let err = classify(Endpoint::Chat, forwarded).unwrap_err();
            assert!(err.contains(field), "{err}");
            let err = classify(Endpoint::Chat, chat_with(field, json!(0))).unwrap_err();
            assert!(err.contains(field), "{err}");
        }
        let mut completion = json!({"model": "m", "prompt": "hi", "max_tokens": 0});
        completion["logprobs"] = json!(2);
        assert!(classify(Endpoint::Completion, completion).is_err());
    }

    #[test]
    fn only_fields_that_ask_for_more_than_text_forward() {
        let forward = |param: &str, field: &'static str| Ok(Some((param.to_string(), field)));
        let chat = |f: &str, v: Value| classify(Endpoint::Chat, chat_with(f, v));
        assert_eq!(
            chat("tools", json!([{"type": "function"}])),
            forward("tools", "tools")
        );
        assert_eq!(chat("tools", json!([])), Ok(None));
        assert_eq!(
            chat("tool_choice", json!("none")),
            forward("tool_choice", "tool_choice")
        );
        assert_eq!(chat("logprobs", json!(false)), Ok(None));
        assert_eq!(
            chat("logprobs", json!(true)),
            forward("logprobs", "logprobs")
        );
        assert_eq!(chat("modalities", json!(["text"])), Ok(None));
        assert_eq!(
            chat("modalities", json!(["text", "audio"])),
            forward("modalities", "modalities")
        );
        assert_eq!(chat("n", json!(1)), Ok(None));
        assert_eq!(chat("n", json!(2)), forward("n", "n"));
        assert!(chat("n", json!(0)).is_err());
        assert_eq!(
            chat("response_format", json!({"type": "json_object"})),
            Ok(None)
        );

        let msgs = |m: Value| classify(Endpoint::Chat, json!({"model": "m", "messages": m}));
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": "a"}, {"role": "function", "name": "f", "content": "1"}])
            ),
            forward("messages[1].role", "messages.role")
        );
        assert_eq!(
            msgs(json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}])),
            forward("messages[0].tool_calls", "messages.tool_calls")
        );
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
            ),
            forward("messages[0].content", "messages.content")
        );
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
            ),
            Ok(None)
        );
        assert!(msgs(json!([{"role": "user", "content": [{"type": "text"}]}])).is_err());

        let completion = |f: &str, v: Value| {
            let mut b = json!({"model": "m", "prompt": "1, 2,"});
            b[f] = v;
            classify(Endpoint::Completion, b)
        };
        assert_eq!(completion("best_of", json!(1)), Ok(None));
        assert_eq!(
            completion("best_of", json!(3)),
            forward("best_of", "best_of")
        );
        assert_eq!(completion("echo", json!(true)), forward("echo", "echo"));
        assert_eq!(
            completion("logprobs", json!(0)),
            forward("logprobs", "logprobs")
        );
        assert_eq!(completion("prompt", json!(["a"])), Ok(None));
        assert_eq!(
            completion("prompt", json!(["a", "b"])),
            forward("prompt", "prompt")
        );
        assert!(completion("prompt", json!([])).is_err());
        assert_eq!(
            completion("prompt", json!([1, 2, 3])),
            forward("prompt", "prompt")
        );
        assert_eq!(
            completion("prompt", json!([[1, 2], [3]])),
            forward("prompt", "prompt")
        );
        assert!(completion("prompt", json!({"text": "a"})).is_err());
    }

    #[test]
    fn a_participant_name_is_kept() {
        let body =
            json!({"model": "m", "messages": [{"role": "user", "name": "alice", "content": "hi"}]});
        let Ok(Request::Cacheable(p)) = parse(Endpoint::Chat, body.to_string().as_bytes()) else {
            panic!("a named message is cacheable");
        };
        let Input::Chat(msgs) = &p.req.input else {
            panic!("chat input");
        };
        assert_eq!(msgs[0].name.as_deref(), Some("alice"));
    }

    /// A message's other fields key the answer (a continuation's `prefix` is another
    /// request), in any order; a null one is an absent one; a question carrying one is not
    /// matched by meaning; an upstream gets them as they came.
    #[test]
    fn a_messages_other_fields_key_the_answer_and_go_upstream() {
        let key = |last: Value| {
            let body = json!({"model": "m", "messages": [
                {"role": "user", "content": "Write a haiku"},
                last,
            ]});
            let Ok(Request::Cacheable(p)) = parse(Endpoint::Chat, body.to_string().as_bytes())
            else {
                panic!("cacheable: {body}");
            };
            let k = crate::key::exact_key("ns", Endpoint::Chat, &p.req);
            (k, p.req)
        };
        let (plain, _) = key(json!({"role": "assistant", "content": "Autumn"}));
        let (prefixed, req) =
            key(json!({"role": "assistant", "content": "Autumn", "prefix": true}));
        let (null, _) = key(json!({"role": "assistant", "content": "Autumn", "prefix": null}));
        let (empty, _) = key(
            json!({"role": "assistant", "content": "Autumn", "annotations": [], "refusal": ""}),
        );
        assert_ne!(plain, prefixed, "a continuation is another request");
        assert_eq!(plain, null, "a null field is absent");
        assert_eq!(plain, empty, "an empty field is absent");
        let (a, _) = key(json!({"role": "assistant", "content": "x", "p": 1, "q": 2}));
        let (b, _) = key(json!({"role": "assistant", "content": "x", "q": 2, "p": 1}));
        assert_eq!(a, b, "the fields' order does not matter");
        let Input::Chat(msgs) = &req.input else {
            panic!("chat input");
        };
        let sent = serde_json::to_value(&msgs[1]).unwrap();
        assert_eq!(
            sent,
            json!({"role": "assistant", "content": "Autumn", "prefix": true})
        );
        let (_, asked) =
            key(json!({"role": "user", "content": "More", "cache_control": {"type": "ephemeral"}}));
        let Input::Chat(msgs) = &asked.input else {
            panic!("chat input");
        };
        assert!(
            crate::key::split_conversation(msgs).is_none(),
            "a question with other fields is matched exactly only"
        );
        // Text parts with fields of their own key the answer and are kept as given.
        let part = |extra: Value| {
            let mut p = json!({"type": "text", "text": "Autumn"});
            p.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            json!({"role": "assistant", "content": [p]})
        };
        let (in_parts, _) = key(part(json!({})));
        assert_eq!(in_parts, plain, "plain parts are their text");
        let (null_part, _) = key(part(json!({"cache_control": null})));
        assert_eq!(in_parts, null_part, "a null part field is absent");
        let (marked, req) = key(part(json!({"cache_control": {"type": "ephemeral"}})));
        assert_ne!(marked, plain);
        let Input::Chat(msgs) = &req.input else {
            panic!("chat input");
        };
        assert_eq!(msgs[1].content, "Autumn");
        assert_eq!(
            msgs[1].extra[reprise_backend::GIVEN_PARTS],
            json!([{"type": "text", "text": "Autumn", "cache_control": {"type": "ephemeral"}}])
        );
        assert!(!msgs[1].is_plain());
        // The name reprise keeps them under is not a client's to send.
        let mut forged = json!({"role": "user", "content": "x"});
        forged[reprise_backend::GIVEN_PARTS] = json!("y");
        let body = json!({"model": "m", "messages": [forged]});
        assert!(parse(Endpoint::Chat, body.to_string().as_bytes()).is_err());

        let (_, plain_question) = key(json!({"role": "user", "content": "More"}));
        let Input::Chat(msgs) = &plain_question.input else {
            panic!("chat input");
        };
        assert!(crate::key::split_conversation(msgs).is_some());
    }

    #[test]
    fn forwards_count_every_answer_and_the_larger_max_tokens() {
        let forward = |endpoint, body: Value| match parse(endpoint, body.to_string().as_bytes()) {
            Ok(Request::Forward(f)) => (f.answers, f.max_tokens),
            _ => panic!("not forwarded: {body}"),
        };
        let prompt = |p: Value, extra: Value| {
            let mut b = json!({"model": "m", "prompt": p, "max_tokens": 10});
            b.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            b
        };
        assert_eq!(
            forward(
                Endpoint::Completion,
                prompt(json!(["a", "b", "c"]), json!({"n": 2}))
            ),
            (6, Some(10))
        );
        assert_eq!(
            forward(
                Endpoint::Completion,
                prompt(json!("a"), json!({"best_of": 4, "n": 2}))
            ),
            (4, Some(10))
        );
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_completion_tokens": 5, "max_tokens": 900});
        assert_eq!(forward(Endpoint::Chat, chat), (1, Some(900)));
        // A count that is not a whole number is refused, not charged as one answer.
        for best_of in [json!(20.0), json!("20"), json!(0), json!(-3)] {
            let body = prompt(json!("a"), json!({"best_of": best_of}));
            let refused = parse(Endpoint::Completion, body.to_string().as_bytes());
            assert!(refused.is_err(), "{body}");
        }
    }
}
