//! OpenTelemetry traces of client requests, exported by OTLP/HTTP (protobuf) when
//! `[tracing] otlp_endpoint` is set.
//!
//! **Tail sampling, decided when the request is done.** Whether a request is traced depends
//! on how long it took, known only at its end: a request slower than `slo.total_secs` is
//! always traced, the others with probability `tracing.sample_share`. So no span exists while
//! the request runs: [`Traces::finished`] is handed the finished request (its log record,
//! from the bookkeeping's drop) and, when it keeps the request, builds the spans after the
//! fact with explicit start and end times: a root `request` span and, laid out end to end
//! from the request's start, `exact_lookup`, `embed`, `search` and `backend_first_token` (the
//! stages the request went through; the steps between them take microseconds). Requests
//! that are not kept cost one random draw.
//!
//! An incoming W3C `traceparent` is honoured: the `request` span is its child (the caller's
//! sampled flag does not decide; the rule above does).
//!
//! Export never slows the request path: ended spans go into the batch processor's bounded
//! queue (`tracing.queue_spans`; when full, new spans are dropped) and are sent by its own
//! thread. That thread is outside the async runtime, so the HTTP client ([`RuntimeClient`])
//! runs each request on the server's runtime (reqwest, as everywhere else). On shutdown what
//! is queued is sent within the shutdown deadline ([`Traces::shutdown`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{HeaderExtractor, HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;

use crate::config::{traces_url, Config};
use crate::reqlog::LogRecord;

/// The tracer of a server with `[tracing] otlp_endpoint`.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    sample_share: f64,
    slow_ms: f64,
    /// Set by [`Traces::shutdown`]: requests that end later (past the shutdown deadline) are
    /// not traced.
    stopped: AtomicBool,
}

/// Why a request was traced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Slower than `slo.total_secs`.
    Slow,
    /// Drawn within `tracing.sample_share`.
    Share,
}

impl Kept {
    fn as_str(self) -> &'static str {
        match self {
            Kept::Slow => "slow",
            Kept::Share => "share",
        }
    }
}

impl Traces {
    /// The tracer `config` asks for (`None` without `tracing.otlp_endpoint`). Must be called
    /// on the server's runtime, which the exporter's HTTP requests run on.
    pub fn start(config: &Config) -> anyhow::Result<Option<Traces>> {
        let t = &config.tracing;
        let Some(endpoint) = &t.otlp_endpoint else {
            return Ok(None);
        };
        let timeout = Duration::from_secs_f64(t.export_timeout_secs);
        let client = RuntimeClient {
            client: reqwest::Client::builder().timeout(timeout).build()?,
            runtime: tokio::runtime::Handle::try_current()
                .map_err(|_| anyhow::anyhow!("traces are exported on the async runtime"))?,
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(traces_url(endpoint))
            .with_timeout(timeout)
            .build()?;
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(t.queue_spans)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(
                BatchSpanProcessor::builder(exporter)
                    .with_batch_config(batch)
                    .build(),
            )
            // The decision is taken before any span exists ([`Traces::keep`]); a span that
            // is built is exported, whatever its parent's sampled flag says.
            .with_sampler(Sampler::AlwaysOn)
            .with_resource(
                Resource::builder()
                    .with_service_name(t.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("reprise");
        Ok(Some(Traces {
            provider,
            tracer,
            sample_share: t.sample_share,
            slow_ms: config.slo.total_secs * 1000.0,
            stopped: AtomicBool::new(false),
        }))
    }

    /// Whether a request that took `total_ms` is traced, and why.
    pub fn keep(&self, total_ms: f64) -> Option<Kept> {
        if total_ms > self.slow_ms {
            Some(Kept::Slow)
        } else if self.sample_share > 0.0 && rand::random::<f64>() < self.sample_share {
            Some(Kept::Share)
        } else {
            None
        }
    }

    /// The finished request `rec` (ended now): traced or not ([`Traces::keep`]); when it is,
    /// its spans are built and queued for export, and its trace id returned.
    pub fn finished(&self, rec: &LogRecord) -> Option<String> {
        if self.stopped.load(Ordering::Relaxed) {
            return None;
        }
        let kept = self.keep(rec.total_ms)?;
        let end = SystemTime::now();
        let start = end
            .checked_sub(ms(rec.total_ms))
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let parent = match &rec.trace_parent {
            Some(sc) => Context::new().with_remote_span_context(sc.clone()),
            None => Context::new(),
        };
        let mut root = self
            .tracer
            .span_builder("request")
            .with_kind(SpanKind::Server)
            .with_start_time(start)
            .with_attributes(attributes(rec, kept))
            .start_with_context(&self.tracer, &parent);
        if let Some(kind) = rec.error {
            root.set_status(Status::error(kind));
        }
        let trace_id = root.span_context().trace_id().to_string();
        let cx = parent.with_span(root);
        for stage in stages(rec) {
            self.tracer
                .span_builder(stage.name)
                .with_kind(SpanKind::Internal)
                .with_start_time(start + stage.from)
                .start_with_context(&self.tracer, &cx)
                .end_with_timestamp(start + stage.to);
        }
        cx.span().end_with_timestamp(end);
        Some(trace_id)
    }

    /// Sends what is queued (tests; blocking work runs off the async workers).
    pub async fn flush(&self) {
        let provider = self.provider.clone();
        let flushed = tokio::task::spawn_blocking(move || provider.force_flush()).await;
        if let Ok(Err(e)) = flushed {
            tracing::warn!(error = %e, "traces not flushed");
        }
    }

    /// Sends what is queued, within `grace`, and stops the exporter.
    pub async fn shutdown(&self, grace: Duration) {
        self.stopped.store(true, Ordering::Relaxed);
        let provider = self.provider.clone();
        let stopped =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(grace)).await;
        match stopped {
            Ok(Ok(())) => tracing::info!("traces flushed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "traces not flushed"),
            Err(e) => tracing::warn!(error = %e, "traces not flushed"),
        }
    }
}

/// The caller's span, from a W3C `traceparent` header (`None` without a valid one).
pub fn parent(headers: &http::HeaderMap) -> Option<SpanContext> {
    if !headers.contains_key("traceparent") {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

fn ms(ms: f64) -> Duration {
    Duration::try_from_secs_f64(ms / 1000.0).unwrap_or_default()
}

/// The `request` span's attributes.
fn attributes(rec: &LogRecord, kept: Kept) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("reprise.request_id", rec.request_id.clone()),
        KeyValue::new("http.route", rec.endpoint),
        KeyValue::new("reprise.outcome", rec.outcome),
        KeyValue::new("reprise.traced", kept.as_str()),
    ];
    if !rec.tenant.is_empty() {
        a.push(KeyValue::new("reprise.tenant", rec.tenant.clone()));
    }
    if !rec.model.is_empty() {
        a.push(KeyValue::new("gen_ai.request.model", rec.model.clone()));
    }
    if let Some(sim) = rec.similarity {
        a.push(KeyValue::new("reprise.similarity", f64::from(sim)));
    }
    if let Some(gate) = rec.gate {
        a.push(KeyValue::new("reprise.gate", gate));
    }
    if let Some(id) = &rec.entry_id {
        a.push(KeyValue::new("reprise.entry_id", id.clone()));
    }
    if let Some(kind) = rec.error {
        a.push(KeyValue::new("error.type", kind));
    }
    a
}

/// A stage span: its name and where it lies from the request's start.
#[derive(Debug, PartialEq)]
struct Stage {
    name: &'static str,
    from: Duration,
    to: Duration,
}

/// The stages `rec` went through, end to end from the request's start and within its total:
/// the lookups (exact, embedding, index search) in order, then the wait for the backend's
/// first token, which ends when the first token came.
fn stages(rec: &LogRecord) -> Vec<Stage> {
    let total = rec.total_ms;
    let mut out = Vec::new();
    let mut at = 0.0_f64;
    for (name, took) in [
        ("exact_lookup", rec.exact_ms),
        ("embed", rec.embed_ms),
        ("search", rec.search_ms),
    ] {
        if let Some(took) = took {
            let to = (at + took).min(total);
            out.push(Stage {
                name,
                from: ms(at),
                to: ms(to),
            });
            at = to;
        }
    }
    if let Some(first) = rec.backend_ms {
        let to = first.min(total);
        out.push(Stage {
            name: "backend_first_token",
            from: ms(at.min(to)),
            to: ms(to),
        });
    }
    out
}

/// The exporter's HTTP client: reqwest, run on the server's runtime. The batch processor
/// exports from a thread of its own, outside the runtime, so each request is spawned onto it.
#[derive(Debug)]
struct RuntimeClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

/// Most bytes read of a collector's answer (it is a small status message).
const MAX_ANSWER_BYTES: usize = 1 << 20;

#[async_trait::async_trait]
impl HttpClient for RuntimeClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        self.runtime
            .spawn(send(self.client.clone(), request))
            .await?
    }
}

async fn send(
    client: reqwest::Client,
    request: http::Request<Bytes>,
) -> Result<http::Response<Bytes>, HttpError> {
    let mut response = client.execute(request.try_into()?).await?;
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err("the collector's answer is too large".into());
        }
        body.extend_from_slice(&chunk);
    }
    let mut answer = http::Response::new(Bytes::from(body));
    *answer.status_mut() = response.status();
    *answer.headers_mut() = std::mem::take(response.headers_mut());
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> LogRecord {
        LogRecord {
            total_ms: 100.0,
            ..Default::default()
        }
    }

    #[test]
    fn stages_are_laid_out_end_to_end_within_the_request() {
        let mut rec = record();
        rec.exact_ms = Some(1.0);
        rec.embed_ms = Some(4.0);
        rec.search_ms = Some(2.0);
        rec.backend_ms = Some(60.0);
        let s = stages(&rec);
        let names: Vec<_> = s.iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            ["exact_lookup", "embed", "search", "backend_first_token"]
        );
        assert_eq!(s[0].from, Duration::ZERO);
        assert_eq!(s[1].from, s[0].to);
        assert_eq!(s[2].from, s[1].to);
        assert_eq!(s[3].from, s[2].to);
        assert_eq!(s[3].to, ms(60.0));
        // A stage recorded longer than the request is cut at its end.
        rec.backend_ms = Some(500.0);
        assert_eq!(stages(&rec)[3].to, ms(100.0));
        // An exact hit has one stage.
        let mut hit = record();
        hit.exact_ms = Some(0.2);
        assert_eq!(
            stages(&hit),
            [Stage {
                name: "exact_lookup",
                from: Duration::ZERO,
                to: ms(0.2)
            }]
        );
    }

    #[test]
    fn a_traceparent_names_the_parent_and_a_bad_one_is_ignored() {
        let mut h = http::HeaderMap::new();
        assert!(parent(&h).is_none());
        h.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let sc = parent(&h).unwrap();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(sc.is_remote());
        h.insert("traceparent", "00-not-a-trace-01".parse().unwrap());
        assert!(parent(&h).is_none());
    }

    #[tokio::test]
    async fn slow_requests_are_always_kept_and_the_share_decides_the_rest() {
        let mut c = crate::Config::default();
        c.tracing.otlp_endpoint = Some("http://127.0.0.1:9".into());
        c.slo.total_secs = 1.0;
        c.tracing.sample_share = 0.0;
        let t = Traces::start(&c).unwrap().unwrap();
        assert_eq!(t.keep(1500.0), Some(Kept::Slow));
        assert_eq!(t.keep(900.0), None);
        let all = Traces {
            sample_share: 1.0,
            ..t
        };
        assert_eq!(all.keep(900.0), Some(Kept::Share));
        all.shutdown(Duration::from_secs(1)).await;
    }
}
