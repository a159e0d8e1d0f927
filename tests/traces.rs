//! Traces over real TCP: the server exports by OTLP/HTTP to an in-process receiver, which
//! decodes the protobuf as a collector would. Slow requests are always traced, with their
//! stages as children of the `request` span; the others by `tracing.sample_share`.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use reprise::Config;
use reprise_backend::fake::ScriptConfig;

/// What the receiver got: the spans, and the `service.name` of each batch.
#[derive(Clone, Default)]
struct Received {
    spans: Arc<Mutex<Vec<Span>>>,
    services: Arc<Mutex<Vec<String>>>,
}

impl Received {
    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    fn named(&self, name: &str) -> Vec<Span> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }
}

async fn accept(State(got): State<Received>, body: Bytes) -> Vec<u8> {
    let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
    for rs in req.resource_spans {
        let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
        if let Some(name) = text(&attrs, "service.name") {
            got.services.lock().unwrap().push(name);
        }
        for ss in rs.scope_spans {
            got.spans.lock().unwrap().extend(ss.spans);
        }
    }
    // An empty ExportTraceServiceResponse: everything accepted.
    Vec::new()
}

/// An OTLP/HTTP receiver on a free loopback port: its base URL and what it got.
async fn receiver() -> (String, Received) {
    let got = Received::default();
    let app = Router::new()
        .route("/v1/traces", post(accept))
        .with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), got)
}

fn text(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

/// Traced to `endpoint`; requests slower than `slow_secs` are always traced (generous, so a
/// busy machine does not make a fast request slow).
fn traced(endpoint: &str, sample_share: f64, slow_secs: f64) -> Config {
    let mut c = test_config();
    c.tracing.otlp_endpoint = Some(endpoint.to_string());
    c.tracing.sample_share = sample_share;
    c.tracing.service_name = "reprise-test".into();
    c.slo.total_secs = slow_secs;
    c
}

#[tokio::test]
async fn a_slow_request_is_traced_with_its_stages_and_ids() {
    let (endpoint, got) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut config = traced(&endpoint, 0.0, 0.5);
    config.semantic.enabled = true;
    config.log.request_log = Some(log.clone());
    let script = ScriptConfig {
        first_token_delay: Duration::from_millis(700),
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    let parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{parent_trace}-{parent_span}-01");
    let body = chat_body("Why is the sky blue at noon?");
    let r = app
        .chat(
            &body,
            &[("x-request-id", "slow-1"), ("traceparent", &traceparent)],
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    r.bytes().await.unwrap();
    // The exact hit that follows is fast: not traced at a share of 0.
    let r = app.chat(&body, &[("x-request-id", "fast-1")]).await;
    assert_eq!(cache_status(&r), "exact");
    r.bytes().await.unwrap();

    let traces = app.state.traces.as_ref().expect("tracing is on");
    traces.flush().await;
    let roots = got.named("request");
    assert_eq!(roots.len(), 1, "only the slow request: {roots:?}");
    let root = &roots[0];
    assert_eq!(
        text(&root.attributes, "reprise.request_id").unwrap(),
        "slow-1"
    );
    assert_eq!(text(&root.attributes, "reprise.outcome").unwrap(), "miss");
    assert_eq!(text(&root.attributes, "reprise.traced").unwrap(), "slow");
    assert_eq!(
        text(&root.attributes, "gen_ai.request.model").unwrap(),
        "fake"
    );
    // The caller's span is the parent.
    assert_eq!(hex(&root.trace_id), parent_trace);
    assert_eq!(hex(&root.parent_span_id), parent_span);
    let took = root.end_time_unix_nano - root.start_time_unix_nano;
    assert!(took >= 700_000_000, "{took} ns");

    // The stages, children of the root, in order and within it.
    let children: HashMap<String, Span> = got
        .spans()
        .into_iter()
        .filter(|s| s.parent_span_id == root.span_id)
        .map(|s| (s.name.clone(), s))
        .collect();
    let order = ["exact_lookup", "embed", "search", "backend_first_token"];
    for name in order {
        let s = children
            .get(name)
            .unwrap_or_else(|| panic!("no {name} span"));
        assert_eq!(s.trace_id, root.trace_id);
        assert!(
            s.start_time_unix_nano >= root.start_time_unix_nano,
            "{name}"
        );
        assert!(s.end_time_unix_nano <= root.end_time_unix_nano, "{name}");
    }
    for pair in order.windows(2) {
        assert!(
            children[pair[0]].end_time_unix_nano <= children[pair[1]].start_time_unix_nano,
            "{pair:?}"
        );
    }
    let wait = &children["backend_first_token"];
    assert!(wait.end_time_unix_nano - wait.start_time_unix_nano >= 600_000_000);
    assert_eq!(got.services.lock().unwrap()[0], "reprise-test");

    // The request log names the trace of the traced request only.
    let line_of = |id: &str| {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["request_id"] == id)
    };
    let lines = eventually(Duration::from_secs(10), || {
        line_of("slow-1").is_some() && line_of("fast-1").is_some()
    })
    .await;
    assert!(lines, "both requests logged");
    assert_eq!(line_of("slow-1").unwrap()["trace_id"], parent_trace);
    assert!(line_of("fast-1").unwrap().get("trace_id").is_none());
    app.shutdown().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Sends `n` fast requests (distinct misses) and returns what was exported after a flush.
async fn fast_requests(sample_share: f64, n: usize) -> Vec<Span> {
    let (endpoint, got) = receiver().await;
    let (app, _backend) = spawn_fake(
        traced(&endpoint, sample_share, 2.0),
        ScriptConfig::default(),
    )
    .await;
    for i in 0..n {
        let id = format!("fast-{i}");
        let r = app
            .chat(
                &chat_body(&format!("question {i}")),
                &[("x-request-id", &id)],
            )
            .await;
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    app.shutdown().await;
    got.named("request")
}

#[tokio::test]
async fn fast_requests_follow_the_sample_share() {
    assert!(fast_requests(0.0, 5).await.is_empty());
    let all = fast_requests(1.0, 5).await;
    let mut ids: Vec<_> = all
        .iter()
        .map(|s| text(&s.attributes, "reprise.request_id").unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["fast-0", "fast-1", "fast-2", "fast-3", "fast-4"]);
    for s in &all {
        assert_eq!(text(&s.attributes, "reprise.traced").unwrap(), "share");
    }
}
