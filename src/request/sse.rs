//! Generation events as server-sent events (kept out of the `stream!` macro so rustfmt and
//! the compiler's diagnostics reach it).

use axum::response::sse::Event;
use reprise_backend::{BackendError, GenEvent};

use crate::bookkeeping::Bookkeeping;
use crate::error::ApiError;
use crate::openai::Renderer;

/// Turns generation events into SSE events (kept out of the `stream!` macro so rustfmt and
/// the compiler's diagnostics reach it).
pub struct SseState {
    renderer: Renderer,
    include_usage: bool,
    sent_role: bool,
    /// The stream is over (finished or failed).
    pub done: bool,
}

impl SseState {
    pub fn new(renderer: Renderer, include_usage: bool) -> Self {
        SseState {
            renderer,
            include_usage,
            sent_role: false,
            done: false,
        }
    }

    fn json(v: serde_json::Value) -> Event {
        Event::default().data(v.to_string())
    }

    /// A chunk before the usage chunk: with `stream_options.include_usage`, every such chunk
    /// carries `"usage": null` (OpenAI's shape: clients may read the field on each).
    fn chunk(&self, mut v: serde_json::Value) -> Event {
        if let (true, Some(o)) = (self.include_usage, v.as_object_mut()) {
            o.insert("usage".into(), serde_json::Value::Null);
        }
        Self::json(v)
    }

    /// The SSE events for one generation event; a finish ends with `[DONE]` (whether or not
    /// any text came before it: an empty answer is a complete one).
    pub fn push(&mut self, ev: Result<GenEvent, BackendError>) -> Vec<Event> {
        let mut out = Vec::new();
        if !self.sent_role {
            self.sent_role = true;
            if let Some(role) = self.renderer.role_chunk() {
                out.push(self.chunk(role));
            }
        }
        match ev {
            Ok(GenEvent::Delta(d)) => out.push(self.chunk(self.renderer.delta_chunk(&d))),
            Ok(GenEvent::Finish { reason, usage }) => {
                out.push(self.chunk(self.renderer.finish_chunk(reason)));
                if self.include_usage {
                    out.push(Self::json(self.renderer.usage_chunk(usage)));
                }
                out.push(Event::default().data("[DONE]"));
                self.done = true;
            }
            Err(e) => {
                // After the 200 the error travels in-band, then the stream ends (no [DONE]).
                out.push(Self::json(ApiError::Backend(e).body()));
                self.done = true;
            }
        }
        out
    }

    /// Handles the next subscriber item, including the end of the stream.
    pub fn push_next(
        &mut self,
        next: Option<Result<GenEvent, BackendError>>,
        book: &mut Bookkeeping,
    ) -> Vec<Event> {
        match next {
            Some(Ok(ev)) => self.push(Ok(ev)),
            Some(Err(e)) => {
                book.failed(e.kind());
                self.push(Err(e))
            }
            None => {
                self.done = true;
                Vec::new()
            }
        }
    }
}
