//! The dashboard (`GET /dashboard`) in a real browser: headless Chromium, driven over the
//! DevTools protocol, opens the page; its script polls `/admin/stats` and draws; the test
//! reads what was drawn (each chart's `[data-series]` groups carry their values in
//! `data-values`) and compares it with the data.
//!
//! Chromium is Debian's `chromium` (scripts/setup.sh installs it); `CHROME` names another
//! binary. Without one the browser tests fail, never skip.
//!
//! Two sources of data: a fixture server (the dashboard's routes beside a fixed
//! `/admin/stats`) checks the drawing against known numbers, with no server logic; the live
//! test sends traffic through reprise and checks the page against reprise's own
//! `/admin/stats`.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Query;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use chromiumoxide::cdp::browser_protocol::log::{
    EnableParams as LogEnable, EventEntryAdded, LogEntryLevel, LogEntrySource,
};
use chromiumoxide::cdp::js_protocol::runtime::{
    ConsoleApiCalledType, EventConsoleApiCalled, EventExceptionThrown,
};
use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

// ---- the browser -------------------------------------------------------------------------

/// The Chromium to drive: `CHROME`, else `chromium` or `chromium-browser` on `PATH`.
fn chrome() -> PathBuf {
    if let Some(path) = std::env::var_os("CHROME").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "no Chromium for the dashboard's browser tests: run scripts/setup.sh (it installs \
         Debian's chromium) or set CHROME to a Chrome or Chromium binary"
    );
}

/// A headless Chromium with a profile of its own, killed when dropped.
struct Browser {
    browser: chromiumoxide::Browser,
    handler: tokio::task::JoinHandle<()>,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn launch() -> Browser {
        let profile = tempfile::tempdir().expect("a profile directory");
        let config = chromiumoxide::BrowserConfig::builder()
            .chrome_executable(chrome())
            .no_sandbox()
            .user_data_dir(profile.path())
            .arg("--disable-gpu")
            // Chromium starts slowly beside other builds.
            .launch_timeout(Duration::from_secs(60))
            .build()
            .expect("browser config");
        let (browser, mut events) = chromiumoxide::Browser::launch(config)
            .await
            .expect("Chromium starts (run scripts/setup.sh)");
        let handler = tokio::spawn(async move { while events.next().await.is_some() {} });
        Browser {
            browser,
            handler,
            _profile: profile,
        }
    }

    /// A new tab that records console errors, exceptions and error log entries, at `url`.
    async fn open(&self, url: &str) -> Page {
        let page = self
            .browser
            .new_page("about:blank")
            .await
            .expect("a new tab");
        let problems = Arc::new(Mutex::new(Problems::default()));
        page.execute(LogEnable::default())
            .await
            .expect("Log.enable");
        let mut console = page
            .event_listener::<EventConsoleApiCalled>()
            .await
            .unwrap();
        let mut exceptions = page.event_listener::<EventExceptionThrown>().await.unwrap();
        let mut log = page.event_listener::<EventEntryAdded>().await.unwrap();
        let p = problems.clone();
        tokio::spawn(async move {
            while let Some(e) = console.next().await {
                if matches!(
                    e.r#type,
                    ConsoleApiCalledType::Error | ConsoleApiCalledType::Assert
                ) {
                    let args: Vec<String> = e
                        .args
                        .iter()
                        .map(|a| match &a.value {
                            Some(v) => v.to_string(),
                            None => a.description.clone().unwrap_or_default(),
                        })
                        .collect();
                    p.lock().unwrap().console.push(args.join(" "));
                }
            }
        });
        let p = problems.clone();
        tokio::spawn(async move {
            while let Some(e) = exceptions.next().await {
                let d = &e.exception_details;
                let what = d.exception.as_ref().and_then(|x| x.description.clone());
                p.lock().unwrap().exceptions.push(format!(
                    "{} {}",
                    d.text,
                    what.unwrap_or_default()
                ));
            }
        });
        let p = problems.clone();
        tokio::spawn(async move {
            while let Some(e) = log.next().await {
                if e.entry.level == LogEntryLevel::Error {
                    let network = e.entry.source == LogEntrySource::Network;
                    p.lock().unwrap().log.push((network, e.entry.text.clone()));
                }
            }
        });
        page.goto(url).await.expect("the page loads");
        Page { page, problems }
    }

    async fn close(mut self) {
        let _ = self.browser.close().await;
        let _ = self.browser.wait().await;
        self.handler.abort();
    }
}

/// What went wrong in a tab, as the DevTools protocol reported it.
#[derive(Default, Debug, Clone)]
struct Problems {
    /// `console.error` / `console.assert` calls.
    console: Vec<String>,
    /// Uncaught exceptions and unhandled rejections.
    exceptions: Vec<String>,
    /// Error log entries (CSP violations, failed loads): (from the network?, text).
    log: Vec<(bool, String)>,
}

struct Page {
    page: chromiumoxide::Page,
    problems: Arc<Mutex<Problems>>,
}

/// Everything the page drew, as a JSON string (see `drawn` below).
const READ_DRAWN: &str = r#"JSON.stringify((() => {
  const values = (id) => Object.fromEntries([...document.querySelectorAll(`#${id} [data-series]`)]
    .map((g) => [g.dataset.series, JSON.parse(g.dataset.values)]));
  const titles = (id) => Object.fromEntries([...document.querySelectorAll(`#${id} [data-series]`)]
    .map((g) => [g.dataset.series, g.querySelector(':scope > title').textContent]));
  const figure = (list, field) => {
    const dd = document.querySelector(`#${list} dd[data-field="${field}"]`);
    return dd.dataset.value === undefined ? undefined : JSON.parse(dd.dataset.value);
  };
  const rows = (id) => [...document.querySelectorAll(`#${id} tbody tr`)]
    .filter((tr) => !tr.querySelector('td.empty'))
    .map((tr) => [...tr.cells].map((td) => td.textContent));
  const charts = ['chart-hit-rate', 'chart-outcomes', 'chart-latency', 'chart-ttft',
    'chart-savings', 'chart-prefetch', 'chart-gate'];
  return {
    state: document.body.dataset.state,
    status: document.getElementById('status').textContent,
    hash: location.hash,
    title: document.title,
    charts: Object.fromEntries(charts.map((id) => [id, values(id)])),
    titles: Object.fromEntries(charts.map((id) => [id, titles(id)])),
    times: Object.fromEntries(charts.map((id) => {
      const times = document.getElementById(id).dataset.times;
      return [id, times === undefined ? null : JSON.parse(times)];
    })),
    series_drawn: document.querySelectorAll('svg.chart [data-series]').length,
    requests: figure('totals', 'requests'),
    hit_rate: figure('totals', 'hit-rate'),
    exact_share: figure('totals', 'exact-share'),
    cost: document.querySelector('#savings dd[data-field="cost"]').textContent,
    backend_seconds: figure('savings', 'backend-seconds'),
    prefetch: ['completed', 'hits', 'wasted'].map((f) => figure('prefetch', f)),
    tenants: rows('table-tenants'),
    missed: rows('table-missed'),
    pairs: rows('table-pairs'),
    images: document.querySelectorAll('main img').length,
  };
})())"#;

impl Page {
    async fn eval(&self, expression: &str) -> Value {
        let text: String = self
            .page
            .evaluate(expression)
            .await
            .expect("evaluates")
            .into_value()
            .expect("a string");
        serde_json::from_str(&text).expect("JSON")
    }

    /// Waits until the page has drawn or failed (`<body data-state>` leaves "loading"), then
    /// reads what it shows.
    async fn settled(&self) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let state = self
                .eval("JSON.stringify(document.body.dataset.state)")
                .await;
            if state != "loading" {
                return self.eval(READ_DRAWN).await;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the page never drew or failed: {:?}",
                self.problems()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn problems(&self) -> Problems {
        self.problems.lock().unwrap().clone()
    }

    /// No console error, no exception, no error log entry (but failed requests with the
    /// statuses in `allowed`, which the browser logs itself).
    async fn assert_clean(&self, allowed: &[u16]) {
        // Events arrive on their own channels: give late ones a moment.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let p = self.problems();
        assert!(p.console.is_empty(), "console errors: {:?}", p.console);
        assert!(p.exceptions.is_empty(), "exceptions: {:?}", p.exceptions);
        let unexpected: Vec<_> = p
            .log
            .iter()
            .filter(|(network, text)| {
                !(*network && allowed.iter().any(|s| text.contains(&format!("{s}"))))
            })
            .collect();
        assert!(unexpected.is_empty(), "error log entries: {unexpected:?}");
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// `drawn` equals `want` value by value (numbers within rounding, nulls as nulls).
fn assert_series(drawn: &Value, want: &[Option<f64>], what: &str) {
    let drawn: Vec<Option<f64>> = drawn
        .as_array()
        .unwrap_or_else(|| panic!("{what}: not drawn"))
        .iter()
        .map(Value::as_f64)
        .collect();
    assert_eq!(drawn.len(), want.len(), "{what}: {drawn:?} vs {want:?}");
    for (d, w) in drawn.iter().zip(want) {
        let same = match (d, w) {
            (Some(d), Some(w)) => close(*d, *w),
            (None, None) => true,
            _ => false,
        };
        assert!(same, "{what}: drew {drawn:?}, the data says {want:?}");
    }
}

// ---- the fixture: fixed numbers, no server logic --------------------------------------

const FIXTURE_TOKEN: &str = "fixture-token";
const T0: u64 = 1_700_000_000_000;
/// Server text shaped like markup: it must stay text.
const MARKUP_QUESTION: &str = r#"<img src=x onerror="document.title='pwned'">"#;

fn latency(p50: Option<f64>, p95: Option<f64>, p99: Option<f64>, count: u64) -> Value {
    json!({"p50": p50, "p95": p95, "p99": p99, "count": count})
}

fn empty_latency() -> Value {
    latency(None, None, None, 0)
}

/// Three one-minute intervals: 4 requests, none, 6 requests.
fn fixture_stats() -> Value {
    let first = json!({
        "start_ms": T0, "requests": 4,
        "by_outcome": {"exact": 1, "semantic": 1, "prefetch": 0, "miss": 2, "bypass": 0, "error": 0},
        "by_tier": {"memory": 1, "redis": 0, "semantic": 1, "prefetch": 0},
        "by_tenant": {"acme": {"requests": 4, "hits": 2}},
        "latency": {"hit": latency(Some(0.002), Some(0.004), Some(0.005), 2),
                    "miss": latency(Some(0.8), Some(1.2), Some(1.3), 2)},
        "ttft": {"hit": latency(Some(0.001), Some(0.002), Some(0.003), 2),
                 "miss": latency(Some(0.3), Some(0.5), Some(0.6), 2)},
        "saved": {"prompt_tokens": 120, "completion_tokens": 300, "backend_seconds": 1.6, "cost": 0.0042},
        "prefetch": {"completed": 2, "hits": 1, "wasted": 0}
    });
    let quiet = json!({
        "start_ms": T0 + 60_000, "requests": 0,
        "by_outcome": {"exact": 0, "semantic": 0, "prefetch": 0, "miss": 0, "bypass": 0, "error": 0},
        "by_tier": {"memory": 0, "redis": 0, "semantic": 0, "prefetch": 0},
        "by_tenant": {},
        "latency": {"hit": empty_latency(), "miss": empty_latency()},
        "ttft": {"hit": empty_latency(), "miss": empty_latency()},
        "saved": {"prompt_tokens": 0, "completion_tokens": 0, "backend_seconds": 0.0, "cost": 0.0},
        "prefetch": {"completed": 0, "hits": 0, "wasted": 0}
    });
    let last = json!({
        "start_ms": T0 + 120_000, "requests": 6,
        "by_outcome": {"exact": 2, "semantic": 0, "prefetch": 1, "miss": 2, "bypass": 0, "error": 1},
        "by_tier": {"memory": 1, "redis": 1, "semantic": 0, "prefetch": 1},
        "by_tenant": {"acme": {"requests": 2, "hits": 1}, "beta": {"requests": 4, "hits": 2}},
        "latency": {"hit": latency(Some(0.003), Some(0.006), Some(0.007), 3),
                    "miss": latency(Some(0.9), Some(2.8), Some(3.1), 2)},
        "ttft": {"hit": latency(Some(0.001), Some(0.002), Some(0.002), 3),
                 "miss": latency(Some(0.35), Some(0.7), Some(0.8), 2)},
        "saved": {"prompt_tokens": 200, "completion_tokens": 450, "backend_seconds": 2.4, "cost": 0.0066},
        "prefetch": {"completed": 1, "hits": 1, "wasted": 1}
    });
    let totals = json!({
        "requests": 10,
        "by_outcome": {"exact": 3, "semantic": 1, "prefetch": 1, "miss": 4, "bypass": 0, "error": 1},
        "by_tier": {"memory": 2, "redis": 1, "semantic": 1, "prefetch": 1},
        "by_tenant": {"acme": {"requests": 6, "hits": 3}, "beta": {"requests": 4, "hits": 2}},
        "latency": {"hit": latency(Some(0.0025), Some(0.006), Some(0.007), 5),
                    "miss": latency(Some(0.85), Some(2.8), Some(3.1), 4)},
        "ttft": {"hit": latency(Some(0.001), Some(0.002), Some(0.003), 5),
                 "miss": latency(Some(0.32), Some(0.7), Some(0.8), 4)},
        "saved": {"prompt_tokens": 320, "completion_tokens": 750, "backend_seconds": 4.0, "cost": 0.0108},
        "prefetch": {"completed": 3, "hits": 2, "wasted": 1}
    });
    json!({
        "now_ms": T0 + 170_000, "interval_secs": 60, "replicas": 2, "tenant": null,
        "slo": {"total_secs": 2.5, "ttft_secs": 0.5}, "currency": "USD",
        "series": [first, quiet, last],
        "totals": totals,
        "top_missed": [
            {"question": "What is the capital of France?", "count": 3, "best_similarity": 0.71},
            {"question": MARKUP_QUESTION, "count": 1, "best_similarity": null}
        ],
        "top_pairs": [
            {"question": "How do I reset my password?", "matched": "How can I reset my password?",
             "similarity": 0.93, "count": 5, "entry_id": "6f1c2a"}
        ],
        "gate_rejections": {"negation": 3, "number": 1}
    })
}

/// The dashboard's routes beside a fixed `/admin/stats` that wants [`FIXTURE_TOKEN`] (401
/// otherwise, as reprise answers); records each request's `minutes`.
async fn fixture_server() -> (String, Arc<Mutex<Vec<String>>>) {
    let asked = Arc::new(Mutex::new(Vec::new()));
    let seen = asked.clone();
    let stats = move |headers: HeaderMap,
                      query: Query<std::collections::HashMap<String, String>>| {
        let seen = seen.clone();
        async move {
            seen.lock()
                .unwrap()
                .push(query.get("minutes").cloned().unwrap_or_default());
            let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
            if auth != Some(&format!("Bearer {FIXTURE_TOKEN}")) {
                let body = json!({"error": {"message": "missing or wrong admin token",
                    "type": "invalid_request_error", "param": null, "code": "unauthorized"}});
                return (StatusCode::UNAUTHORIZED, Json(body)).into_response();
            }
            Json(fixture_stats()).into_response()
        }
    };
    let app: Router = reprise::dashboard::routes().route("/admin/stats", get(stats));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), asked)
}

/// The page draws the fixture's numbers: shares, percentiles with the SLO, savings, prefetch,
/// tables, gate reasons; markup in a question stays text; the token leaves the address bar.
#[tokio::test]
async fn the_dashboard_draws_known_numbers() {
    let (base, asked) = fixture_server().await;
    let browser = Browser::launch().await;
    let page = browser
        .open(&format!("{base}/dashboard#token={FIXTURE_TOKEN}"))
        .await;
    let d = page.settled().await;
    assert_eq!(d["state"], "drawn", "status: {}", d["status"]);
    assert_eq!(d["hash"], "", "the token is taken out of the address bar");
    assert_eq!(
        asked.lock().unwrap().first().map(String::as_str),
        Some("60")
    );

    // Totals.
    assert_eq!(d["requests"], 10);
    assert!(close(d["hit_rate"].as_f64().unwrap(), 0.5));
    assert!(close(d["exact_share"].as_f64().unwrap(), 0.3));

    // Hit rate by tier: hits of the tier over requests; nothing for the quiet minute.
    let hit = &d["charts"]["chart-hit-rate"];
    let sixth = Some(1.0 / 6.0);
    assert_series(&hit["memory"], &[Some(0.25), None, sixth], "memory");
    assert_series(&hit["redis"], &[Some(0.0), None, sixth], "redis");
    assert_series(&hit["semantic"], &[Some(0.25), None, Some(0.0)], "semantic");
    assert_series(&hit["prefetch"], &[Some(0.0), None, sixth], "prefetch");
    let title = d["titles"]["chart-hit-rate"]["memory"].as_str().unwrap();
    assert!(
        title.contains("25.0 %") && title.contains("16.7 %"),
        "{title}"
    );

    let outcomes = &d["charts"]["chart-outcomes"];
    assert_series(
        &outcomes["exact"],
        &[Some(1.0), Some(0.0), Some(2.0)],
        "exact",
    );
    assert_series(
        &outcomes["error"],
        &[Some(0.0), Some(0.0), Some(1.0)],
        "error",
    );

    // Latency and TTFT: the percentiles as given, gaps as gaps, the SLO line.
    let lat = &d["charts"]["chart-latency"];
    assert_series(
        &lat["hit-p95"],
        &[Some(0.004), None, Some(0.006)],
        "hit p95",
    );
    assert_series(&lat["miss-p99"], &[Some(1.3), None, Some(3.1)], "miss p99");
    assert_series(&lat["slo"], &[Some(2.5)], "latency SLO");
    let slo_title = d["titles"]["chart-latency"]["slo"].as_str().unwrap();
    assert!(slo_title.contains("2.50 s"), "{slo_title}");
    let ttft = &d["charts"]["chart-ttft"];
    assert_series(
        &ttft["miss-p50"],
        &[Some(0.3), None, Some(0.35)],
        "ttft miss p50",
    );
    assert_series(&ttft["slo"], &[Some(0.5)], "ttft SLO");

    // Savings and prefetch.
    assert!(close(d["backend_seconds"].as_f64().unwrap(), 4.0));
    let cost = d["cost"].as_str().unwrap();
    assert!(cost.contains("0.0108") && cost.contains('$'), "{cost}");
    let saved = &d["charts"]["chart-savings"];
    assert_series(
        &saved["prompt"],
        &[Some(120.0), Some(0.0), Some(200.0)],
        "prompt",
    );
    assert_eq!(d["prefetch"], json!([3, 2, 1]));
    let pf = &d["charts"]["chart-prefetch"];
    assert_series(&pf["wasted"], &[Some(0.0), Some(0.0), Some(1.0)], "wasted");

    // Gate rejections, largest first.
    assert_eq!(
        d["charts"]["chart-gate"],
        json!({"negation": [3], "number": [1]})
    );

    // Tables.
    assert_eq!(
        d["tenants"],
        json!([["acme", "6", "3", "50.0 %"], ["beta", "4", "2", "50.0 %"]])
    );
    assert_eq!(
        d["missed"],
        json!([
            ["What is the capital of France?", "3", "0.710"],
            [MARKUP_QUESTION, "1", "–"]
        ])
    );
    assert_eq!(d["images"], 0, "markup in a question is not parsed");
    assert_ne!(d["title"], "pwned");
    assert_eq!(
        d["pairs"],
        json!([[
            "How do I reset my password?",
            "How can I reset my password?",
            "0.930",
            "5",
            "6f1c2a"
        ]])
    );
    page.assert_clean(&[]).await;
    browser.close().await;
}

/// Without a token the page asks for one; with a wrong one it says so and draws nothing,
/// without an error in the console.
#[tokio::test]
async fn a_wrong_or_missing_token_shows_an_error_and_draws_nothing() {
    let (base, asked) = fixture_server().await;
    let browser = Browser::launch().await;

    let page = browser.open(&format!("{base}/dashboard")).await;
    let d = page.settled().await;
    assert_eq!(d["state"], "no-token");
    assert!(d["status"].as_str().unwrap().contains("token"), "{d}");
    assert_eq!(d["series_drawn"], 0);
    assert!(
        asked.lock().unwrap().is_empty(),
        "nothing asked without a token"
    );
    page.assert_clean(&[]).await;

    let page = browser
        .open(&format!("{base}/dashboard#token=not-the-token"))
        .await;
    let d = page.settled().await;
    assert_eq!(d["state"], "error");
    assert!(d["status"].as_str().unwrap().contains("401"), "{d}");
    assert_eq!(d["series_drawn"], 0, "nothing drawn: {d}");
    assert_eq!(d["requests"], Value::Null);
    assert_eq!(d["missed"], json!([]));
    assert_eq!(d["tenants"], json!([]));
    page.assert_clean(&[401]).await;
    browser.close().await;
}

/// The values drawn for `series` of `chart` and what `value` reads from `stats` for the same
/// intervals (matched by their start: a minute may turn between the page's read and the
/// test's, so either read may hold an interval the other lacks).
fn matching(
    drawn: &Value,
    stats: &Value,
    chart: &str,
    series: &str,
    value: impl Fn(&Value) -> Option<f64>,
) -> (Value, Vec<Option<f64>>) {
    let times = drawn["times"][chart].as_array().expect("the chart's times");
    let values = drawn["charts"][chart][series].as_array().expect("drawn");
    let data = stats["series"].as_array().unwrap();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (t, v) in times.iter().zip(values) {
        if let Some(s) = data.iter().find(|s| &s["start_ms"] == t) {
            got.push(v.clone());
            want.push(value(s));
        }
    }
    assert!(
        got.len() + 1 >= times.len(),
        "intervals drawn match the data"
    );
    (Value::Array(got), want)
}

// ---- reprise itself ----------------------------------------------------------------------

const LIVE_TOKEN_VAR: &str = "REPRISE_TEST_DASHBOARD_ADMIN_TOKEN";
const LIVE_TOKEN: &str = "d4shboard";

async fn live_server() -> (TestApp, reprise_backend::fake::ScriptedBackend) {
    // The variable name is unique to this file, so no other test reads or writes it.
    std::env::set_var(LIVE_TOKEN_VAR, LIVE_TOKEN);
    let mut config = test_config();
    config.server.admin_token_env = Some(LIVE_TOKEN_VAR.into());
    spawn_fake(config, Default::default()).await
}

/// A server that keeps less than the page's default window (an hour) still draws: the
/// window is all it keeps, and the page says so.
#[tokio::test]
async fn a_ring_shorter_than_the_default_window_still_draws() {
    std::env::set_var(LIVE_TOKEN_VAR, LIVE_TOKEN);
    let mut config = test_config();
    config.server.admin_token_env = Some(LIVE_TOKEN_VAR.into());
    config.stats.interval_secs = 10;
    config.stats.intervals = 180;
    let (app, _backend) = spawn_fake(config, Default::default()).await;
    let r = app
        .chat(&chat_body("What is the capital of France?"), &[])
        .await;
    r.text().await.unwrap();
    let browser = Browser::launch().await;
    let page = browser
        .open(&app.url(&format!("/dashboard#token={LIVE_TOKEN}")))
        .await;
    let d = page.settled().await;
    assert_eq!(d["state"], "drawn", "status: {}", d["status"]);
    assert_eq!(d["requests"], 1);
    let status = d["status"].as_str().unwrap_or_default();
    assert!(status.contains("all that is kept (30 min)"), "{status}");
    page.assert_clean(&[]).await;
    browser.close().await;
}

/// The page and its assets: their types, the CSP on each, no token needed.
#[tokio::test]
async fn the_dashboard_is_served_with_its_types_and_a_strict_csp() {
    let (app, _backend) = live_server().await;
    for (path, kind) in [
        ("/dashboard", "text/html; charset=utf-8"),
        ("/dashboard/app.js", "text/javascript; charset=utf-8"),
        ("/dashboard/app.css", "text/css; charset=utf-8"),
        ("/dashboard/icon.svg", "image/svg+xml"),
    ] {
        let r = app.get(path).await;
        assert_eq!(r.status(), 200, "{path}");
        let header = |name: &str| {
            r.headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default()
        };
        assert_eq!(header("content-type"), kind, "{path}");
        assert_eq!(header("content-security-policy"), reprise::dashboard::CSP);
        assert_eq!(header("x-content-type-options"), "nosniff");
    }
    let csp = reprise::dashboard::CSP;
    assert!(csp.contains("default-src 'self'") && csp.contains("script-src 'self'"));
    assert!(!csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"));
    let page = app.get("/dashboard").await.text().await.unwrap();
    assert!(page.contains(r#"id="chart-hit-rate""#) && page.contains(r#"id="chart-latency""#));
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "no CDN"
    );
}

/// With `server.admin_listen` the dashboard is served there, beside the API it reads, and not
/// on the API's listener.
#[tokio::test]
async fn with_an_admin_listener_the_dashboard_lives_there() {
    let mut config = test_config();
    config.backend.kind = reprise::config::BackendKind::Fake;
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (api_addr, admin_addr) = (api.local_addr().unwrap(), admin.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(reprise::run_with(api, Some(admin), config, async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    let get = |addr: std::net::SocketAddr| client.get(format!("http://{addr}/dashboard")).send();
    let up = eventually_async(Duration::from_secs(10), || async {
        get(admin_addr).await.is_ok_and(|r| r.status() == 200)
    });
    assert!(up.await, "the admin listener serves the dashboard");
    let ready = eventually_async(Duration::from_secs(10), || async {
        let r = client.get(format!("http://{api_addr}/readyz")).send().await;
        r.is_ok_and(|r| r.status() == 200)
    });
    assert!(ready.await, "the API came up");
    assert_eq!(get(api_addr).await.unwrap().status(), 404);
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// reprise's own numbers: traffic of misses and exact hits, then the page against
/// `GET /admin/stats` as the test reads it.
#[tokio::test]
async fn the_dashboard_draws_reprises_own_stats() {
    let (app, backend) = live_server().await;
    let asked = [
        "What is the capital of France?",
        "How tall is Mount Everest?",
        "Who wrote Hamlet?",
        "What is the capital of France?",
        "What is the capital of France?",
        "How tall is Mount Everest?",
    ];
    for (i, q) in asked.iter().enumerate() {
        let r = app.chat(&chat_body(q), &[]).await;
        let want = if i < 3 { "miss" } else { "exact" };
        assert_eq!(cache_status(&r), want, "{q}");
        r.text().await.unwrap();
    }
    assert_eq!(backend.calls(), 3, "three misses reached the backend");

    let browser = Browser::launch().await;
    let page = browser
        .open(&app.url(&format!("/dashboard#token={LIVE_TOKEN}")))
        .await;
    let d = page.settled().await;
    assert_eq!(d["state"], "drawn", "status: {}", d["status"]);

    // The data as the test reads it; no traffic since, so totals are settled. Intervals are
    // matched by their start, in case a minute turned between the two reads.
    let stats: Value = app
        .client
        .get(app.url("/admin/stats?minutes=60"))
        .bearer_auth(LIVE_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let totals = &stats["totals"];
    assert_eq!(totals["requests"], 6);
    assert_eq!(d["requests"], totals["requests"]);
    let exact = totals["by_outcome"]["exact"].as_f64().unwrap();
    assert!(close(d["exact_share"].as_f64().unwrap(), exact / 6.0));

    let hit_rate = |s: &Value, tier: &str| {
        let n = s["requests"].as_f64().unwrap();
        (n > 0.0).then(|| s["by_tier"][tier].as_f64().unwrap() / n)
    };
    for tier in ["memory", "redis", "semantic", "prefetch"] {
        let (drawn, want) = matching(&d, &stats, "chart-hit-rate", tier, |s| hit_rate(s, tier));
        assert_series(&drawn, &want, tier);
    }
    for side in ["hit", "miss"] {
        for p in ["p50", "p95", "p99"] {
            let name = format!("{side}-{p}");
            let (drawn, want) = matching(&d, &stats, "chart-latency", &name, |s| {
                s["latency"][side][p].as_f64()
            });
            assert_series(&drawn, &want, &name);
        }
    }
    let slo = stats["slo"]["total_secs"].as_f64();
    assert_series(&d["charts"]["chart-latency"]["slo"], &[slo], "SLO");
    let hit_p50 = &d["charts"]["chart-latency"]["hit-p50"];
    assert!(hit_p50.as_array().unwrap().iter().any(Value::is_number));

    let missed: Vec<&str> = d["missed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row[0].as_str().unwrap())
        .collect();
    assert!(missed.contains(&"Who wrote Hamlet?"), "{missed:?}");
    page.assert_clean(&[]).await;

    let page = browser
        .open(&app.url("/dashboard#token=not-the-token"))
        .await;
    let d = page.settled().await;
    assert_eq!(d["state"], "error");
    assert!(d["status"].as_str().unwrap().contains("401"), "{d}");
    assert_eq!(d["series_drawn"], 0);
    page.assert_clean(&[401]).await;
    browser.close().await;
}
