//! What a shared upstream account says about the other tenants, taken out of the answers a
//! tenant sees. With tenants, every tenant's forwarded and passed-through requests go to one
//! upstream account, so the account's own figures describe them all: its rate-limit headers
//! (dropped), the body of its 429 (OpenAI's names the limit and how much of it is used:
//! replaced by reprise's own error), its processing time, and the prompt tokens its prompt
//! cache already held (`cached_tokens`: a prefix another tenant sent lately is cached, so
//! the figure would tell a tenant whether anyone sent a given prompt; set to 0). Without
//! tenants the upstream's answer passes as it is.

use axum::body::Bytes;
use futures::StreamExt;
use reprise_backend::{ByteStream, Forwarded};

use crate::error::ApiError;

/// The most bytes held back at the end of what was received (a field cut by a chunk's end,
/// whose number may go on in the next): more whitespace than this after the field is not
/// JSON an upstream writes, and is let through.
const MAX_HELD: usize = 4096;

const FIELD: &[u8] = b"\"cached_tokens\"";

/// The upstream's answer as a tenant may see it (`tenants`: whether tenants are configured).
pub(super) fn for_the_caller(mut answer: Forwarded, tenants: bool) -> Forwarded {
    if !tenants {
        return answer;
    }
    answer.headers.retain(|(name, _)| {
        !name.starts_with("x-ratelimit-") && name.as_str() != "openai-processing-ms"
    });
    let media = answer
        .headers
        .iter()
        .find(|(n, _)| n.as_str() == "content-type")
        .map(|(_, v)| v.to_ascii_lowercase())
        .unwrap_or_default();
    if answer.status == 429 {
        let retry_after_secs = answer
            .headers
            .iter()
            .find(|(n, _)| n.as_str() == "retry-after")
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(1);
        let body = ApiError::Overloaded { retry_after_secs }.body().to_string();
        answer.headers.retain(|(n, _)| n.as_str() != "content-type");
        answer
            .headers
            .push(("content-type".into(), "application/json".into()));
        answer.body = Box::pin(futures::stream::once(async move { Ok(Bytes::from(body)) }));
    } else if media.starts_with("text/event-stream") || media.starts_with("application/json") {
        answer.body = without_cached_tokens(answer.body);
    }
    answer
}

/// A JSON or event-stream body, each `cached_tokens` set to 0 as it passes: what comes is
/// sent at once but for a field that a chunk's end may have cut (held until its number
/// ends, at most [`MAX_HELD`] bytes).
fn without_cached_tokens(mut body: ByteStream) -> ByteStream {
    Box::pin(async_stream::stream! {
        let mut pending: Vec<u8> = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    yield Err(e);
                    return;
                }
            };
            pending.extend_from_slice(&chunk);
            pending = zero_cached_tokens(pending);
            let end = safe_end(&pending);
            if end > 0 {
                let rest = pending.split_off(end);
                yield Ok(Bytes::from(std::mem::replace(&mut pending, rest)));
            }
        }
        if !pending.is_empty() {
            yield Ok(Bytes::from(pending));
        }
    })
}

/// How much of `text` (its `cached_tokens` zeroed) can be sent: all but a field name the end
/// may have cut, or a field whose number may go on.
fn safe_end(text: &[u8]) -> usize {
    // The longest end of `text` that starts the field's name.
    let cut = (1..FIELD.len())
        .rev()
        .find(|&n| text.ends_with(&FIELD[..n]))
        .unwrap_or(0);
    let mut end = text.len() - cut;
    let last = (0..=text.len().saturating_sub(FIELD.len()))
        .rev()
        .take(MAX_HELD + FIELD.len())
        .find(|&i| text[i..].starts_with(FIELD));
    if let Some(i) = last {
        let after = &text[i + FIELD.len()..];
        if after
            .iter()
            .all(|b| b.is_ascii_whitespace() || *b == b':' || b.is_ascii_digit())
        {
            end = end.min(i);
        }
    }
    end
}

/// `text` with the number after each `"cached_tokens":` replaced by 0 (JSON stays JSON:
/// a number for a number), in one pass.
fn zero_cached_tokens(text: Vec<u8>) -> Vec<u8> {
    let skip_space = |mut i: usize| {
        while text.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
            i += 1;
        }
        i
    };
    let mut out: Option<Vec<u8>> = None;
    // `text[copied..]` is not yet in `out`.
    let (mut at, mut copied) = (0, 0);
    while let Some(found) = text[at..].windows(FIELD.len()).position(|w| w == FIELD) {
        let colon = skip_space(at + found + FIELD.len());
        if text.get(colon) != Some(&b':') {
            at = colon.min(text.len());
            continue;
        }
        let number = skip_space(colon + 1);
        let digits = text[number..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits > 0 && !(digits == 1 && text[number] == b'0') {
            let o = out.get_or_insert_with(|| Vec::with_capacity(text.len()));
            o.extend_from_slice(&text[copied..number]);
            o.push(b'0');
            copied = number + digits;
        }
        at = (number + digits).min(text.len());
    }
    match out {
        None => text,
        Some(mut o) => {
            o.extend_from_slice(&text[copied..]);
            o
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_become_zero_and_the_rest_stays() {
        let cases = [
            (
                r#"{"usage":{"prompt_tokens":2048,"prompt_tokens_details":{"cached_tokens":1920}}}"#,
                r#"{"usage":{"prompt_tokens":2048,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            ),
            (
                "{\n  \"cached_tokens\" : 64,\n  \"audio_tokens\": 3\n}",
                "{\n  \"cached_tokens\" : 0,\n  \"audio_tokens\": 3\n}",
            ),
            (r#"{"cached_tokens":null}"#, r#"{"cached_tokens":null}"#),
            (
                r#"{"content":"the word \"cached_tokens\" in text"}"#,
                r#"{"content":"the word \"cached_tokens\" in text"}"#,
            ),
            (r#"{"cached_tokens":0}"#, r#"{"cached_tokens":0}"#),
            // Cut right after the field, or its colon: nothing to change yet.
            (r#"{"cached_tokens""#, r#"{"cached_tokens""#),
            (r#"{"cached_tokens": "#, r#"{"cached_tokens": "#),
            (
                r#"[{"cached_tokens":12},{"cached_tokens":345}]"#,
                r#"[{"cached_tokens":0},{"cached_tokens":0}]"#,
            ),
        ];
        for (given, expected) in cases {
            let got = zero_cached_tokens(given.as_bytes().to_vec());
            assert_eq!(String::from_utf8(got).unwrap(), expected);
        }
    }

    fn answer(status: u16, media: &str, chunks: Vec<&'static str>) -> Forwarded {
        Forwarded {
            status,
            headers: vec![
                ("content-type".into(), media.into()),
                ("x-ratelimit-remaining-tokens".into(), "196".into()),
                ("openai-processing-ms".into(), "812".into()),
                ("retry-after".into(), "7".into()),
                ("x-request-id".into(), "req_1".into()),
            ],
            body: Box::pin(futures::stream::iter(
                chunks.into_iter().map(|c| Ok(Bytes::from(c))),
            )),
        }
    }

    async fn text(a: Forwarded) -> String {
        let parts: Vec<Bytes> = a.body.map(Result::unwrap).collect().await;
        String::from_utf8(parts.concat()).unwrap()
    }

    /// With tenants, the account's figures are gone, cut across chunks or not; without,
    /// the answer is the upstream's.
    #[tokio::test]
    async fn a_tenant_sees_nothing_of_the_shared_account() {
        let stream = vec![
            "data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_",
            "tokens\":10",
            "24}}}\n\ndata: [DONE]\n\n",
        ];
        let a = for_the_caller(answer(200, "text/event-stream", stream.clone()), true);
        let names: Vec<&str> = a.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "retry-after", "x-request-id"]);
        assert_eq!(
            text(a).await,
            "data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n"
        );
        let json = vec![
            "{\"usage\": {\"prompt_tokens_details\": {\"cached",
            "_tokens\": 512}}}",
        ];
        let a = for_the_caller(
            answer(200, "application/json; charset=utf-8", json.clone()),
            true,
        );
        assert_eq!(
            text(a).await,
            "{\"usage\": {\"prompt_tokens_details\": {\"cached_tokens\": 0}}}"
        );
        let limit = vec![
            r#"{"error":{"message":"Rate limit reached for org-X: Limit 30000, Used 29804"}}"#,
        ];
        let a = for_the_caller(answer(429, "application/json", limit.clone()), true);
        assert!(a.headers.contains(&("retry-after".into(), "7".into())));
        let body = text(a).await;
        assert!(!body.contains("29804") && !body.contains("org-X"), "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "overloaded");

        // No tenants: as the upstream sent it.
        let a = for_the_caller(answer(200, "text/event-stream", stream.clone()), false);
        assert_eq!(a.headers.len(), 5);
        assert_eq!(text(a).await, stream.concat());
        let a = for_the_caller(answer(429, "application/json", limit.clone()), false);
        assert_eq!(text(a).await, limit.concat());
    }
}
