//! `reprise-bench proxy`: exact-hit throughput against a plain axum handler returning the
//! same bytes (the ceiling), and the added time to first token of a miss against calling the
//! upstream directly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::common::{
    read_answer, start_app, start_configured, BackendKind, Config, Failure, Samples, Server,
    TenantConfig,
};

/// Options of `reprise-bench proxy`.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Concurrent client connections.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seconds per measured round.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Alternating rounds per side.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Misses measured for time to first token, per side.
    #[arg(long, default_value_t = 300)]
    misses: usize,
    /// Tenants configured on a third side, with `[auth] required` (0: no such side); its
    /// clients use the keys of the first `concurrency` tenants in turn.
    #[arg(long, default_value_t = 100)]
    tenants: usize,
    /// Write the results as JSON here as well.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Closed-loop load: `concurrency` clients POST `body` to `url` for `seconds`; client `i`
/// sends `Authorization: Bearer keys[i % len]` when `keys` is not empty.
async fn load(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    concurrency: usize,
    seconds: f64,
    keys: &[String],
) -> Samples {
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            let client = client.clone();
            let url = url.to_string();
            let body = body.to_string();
            let key = (!keys.is_empty()).then(|| format!("Bearer {}", keys[i % keys.len()]));
            tokio::spawn(async move {
                let mut s = Samples::default();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let mut req = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body.clone());
                    if let Some(k) = &key {
                        req = req.header("authorization", k);
                    }
                    match read_answer(req.send().await).await {
                        Ok(_) => s.lat.push(t.elapsed().as_secs_f64()),
                        Err(f) => s.failed.count(f),
                    }
                }
                s
            })
        })
        .collect();
    let mut s = Samples::default();
    for t in tasks {
        s.merge(t.await.unwrap_or_default());
    }
    s.wall = start.elapsed().as_secs_f64();
    s
}

/// Serves `router` on a free loopback port, with `axum::serve` or (`limits`) reprise's own
/// listener.
async fn serve_router(
    router: axum::Router,
    limits: Option<reprise::listen::ConnectionLimits>,
) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = match limits {
            None => axum::serve(listener, router).await,
            Some(limits) => {
                let never = tokio_util::sync::CancellationToken::new();
                reprise::listen::serve(listener, router, limits, never).await
            }
        };
    });
    Ok(addr)
}

/// A reprise over the scripted backend, in this process.
async fn fake_reprise(mut config: Config) -> anyhow::Result<Server> {
    config.backend.kind = BackendKind::Fake;
    config.semantic.enabled = false;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    start_app(config, backend, None).await
}

/// Time to first byte of an SSE body for `n` distinct prompts.
async fn ttft(client: &reqwest::Client, url: &str, model: &str, tag: &str, n: usize) -> Samples {
    let mut s = Samples::default();
    let start = Instant::now();
    for i in 0..n {
        let body = json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": format!("bench {tag} question number {i}")}]});
        let t = Instant::now();
        let r = match client.post(url).json(&body).send().await {
            Ok(r) if r.status().is_success() => r,
            failed => {
                // The body of a failed answer is read, so the connection can be reused.
                let f = read_answer(failed).await.err().unwrap_or(Failure::Status);
                s.failed.count(f);
                continue;
            }
        };
        let mut stream = r.bytes_stream();
        let first = match stream.next().await {
            Some(Ok(_)) => t.elapsed().as_secs_f64(),
            _ => {
                s.failed.count(Failure::Transport);
                continue;
            }
        };
        // Timed only when the whole stream arrived.
        let mut broke = false;
        while let Some(chunk) = stream.next().await {
            broke |= chunk.is_err();
        }
        if broke {
            s.failed.count(Failure::Transport);
        } else {
            s.lat.push(first);
        }
    }
    s.wall = start.elapsed().as_secs_f64();
    s
}

fn ms(x: f64) -> String {
    format!("{:.3} ms", x * 1000.0)
}

/// Runs the proxy benchmark.
pub async fn run(a: ProxyArgs) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(a.concurrency * 2)
        .tcp_nodelay(true)
        .build()?;
    // The candidate: reprise with one warm entry.
    let reprise = fake_reprise(Config::default()).await?;
    let url = reprise.chat_url();
    let body = json!({"model": "fake", "messages": [{"role": "user", "content": "What is the capital of France?"}]});
    let warm = client.post(&url).json(&body).send().await?;
    let hit_bytes = warm.bytes().await?;
    let check = client.post(&url).json(&body).send().await?;
    anyhow::ensure!(
        check
            .headers()
            .get("x-reprise-cache")
            .and_then(|v| v.to_str().ok())
            == Some("exact"),
        "the warm request did not become an exact hit"
    );
    // The same without the stats ring (`[stats] enabled = false`): what the ring costs a hit.
    let mut no_stats_cfg = Config::default();
    no_stats_cfg.stats.enabled = false;
    let no_stats = fake_reprise(no_stats_cfg).await?;
    let no_stats_url = no_stats.chat_url();
    for _ in 0..2 {
        client
            .post(&no_stats_url)
            .json(&body)
            .send()
            .await?
            .bytes()
            .await?;
    }
    // The ceiling: a plain axum handler returning the same bytes; and the same handler on
    // reprise's listener (its header timeout and connection cap), which reprise serves on.
    let bytes = hit_bytes.clone();
    let plain = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move |_body: axum::body::Bytes| {
            let bytes = bytes.clone();
            async move { ([("content-type", "application/json")], bytes) }
        }),
    );
    let ceiling = serve_router(plain.clone(), None).await?;
    let ceiling_url = format!("http://{ceiling}/v1/chat/completions");
    let limits = reprise::listen::ConnectionLimits::of(&Config::default().server);
    let listened = serve_router(plain, Some(limits)).await?;
    let listened_url = format!("http://{listened}/v1/chat/completions");

    eprintln!(
        "exact-hit throughput: {} rounds x {:.1} s per side, {} connections",
        a.rounds, a.seconds, a.concurrency
    );
    // The same with tenants: every request carries a key that names one of them.
    let keys: Vec<String> = (0..a.tenants)
        .take(a.concurrency.max(1))
        .map(|i| format!("sk-bench-{i}"))
        .collect();
    let with_auth = if a.tenants > 0 {
        let mut c = Config::default();
        c.auth.required = true;
        c.tenants = (0..a.tenants)
            .map(|i| TenantConfig::with_key(&format!("tenant-{i}"), &format!("sk-bench-{i}")))
            .collect();
        let server = fake_reprise(c).await?;
        for k in &keys {
            for _ in 0..2 {
                let r = client
                    .post(server.chat_url())
                    .bearer_auth(k)
                    .json(&body)
                    .send()
                    .await?;
                r.bytes().await?;
            }
        }
        Some(server)
    } else {
        None
    };
    let mut hit = Samples::default();
    let mut base = Samples::default();
    let mut auth_hit = Samples::default();
    let mut unrecorded = Samples::default();
    let mut on_listener = Samples::default();
    for round in 0..a.rounds {
        base.merge(load(&client, &ceiling_url, &body, a.concurrency, a.seconds, &[]).await);
        let u = &listened_url;
        on_listener.merge(load(&client, u, &body, a.concurrency, a.seconds, &[]).await);
        hit.merge(load(&client, &url, &body, a.concurrency, a.seconds, &[]).await);
        let u = &no_stats_url;
        unrecorded.merge(load(&client, u, &body, a.concurrency, a.seconds, &[]).await);
        if let Some(s) = &with_auth {
            let u = s.chat_url();
            auth_hit.merge(load(&client, &u, &body, a.concurrency, a.seconds, &keys).await);
        }
        eprintln!("  round {}/{} done", round + 1, a.rounds);
    }

    // Added time to first token on a miss: reprise (openai backend) → scripted upstream,
    // against calling the same upstream directly.
    let mut up_cfg = Config::default();
    up_cfg.cache.enabled = false;
    let upstream = fake_reprise(up_cfg).await?;
    let mut proxy_cfg = Config::default();
    proxy_cfg.backend.kind = BackendKind::Openai;
    proxy_cfg.backend.base_url = Some(upstream.base_url());
    proxy_cfg.semantic.enabled = false;
    let proxy = start_configured(proxy_cfg).await?;
    eprintln!(
        "miss time to first token: {} distinct prompts per side",
        a.misses
    );
    let mut direct = Samples::default();
    let mut via = Samples::default();
    let per_round = (a.misses / a.rounds.max(1)).max(1);
    for round in 0..a.rounds {
        let tag = format!("r{round}");
        direct.merge(ttft(&client, &upstream.chat_url(), "fake", &tag, per_round).await);
        via.merge(ttft(&client, &proxy.chat_url(), "fake", &tag, per_round).await);
    }

    let ratio = hit.throughput() / base.throughput();
    println!("== reprise bench proxy ==");
    println!("req/s and percentiles count only requests that succeeded; failures per side:");
    println!(
        "  exact hit {}; ceiling {}; with keys {}; stats off {}; miss direct {}; miss via reprise {}",
        hit.failed, base.failed, auth_hit.failed, unrecorded.failed, direct.failed, via.failed
    );
    println!(
        "exact hit        {:>10.0} req/s  p50 {}  p99 {}",
        hit.throughput(),
        ms(hit.pct(50.0)),
        ms(hit.pct(99.0))
    );
    println!(
        "ceiling (axum)   {:>10.0} req/s  p50 {}  p99 {}",
        base.throughput(),
        ms(base.pct(50.0)),
        ms(base.pct(99.0))
    );
    println!("throughput ratio exact/ceiling: {ratio:.2}x  (goal >= 0.70x)");
    let listener_ratio = on_listener.throughput() / base.throughput();
    println!(
        "ceiling on reprise's listener {:>10.0} req/s  p50 {}  p99 {}",
        on_listener.throughput(),
        ms(on_listener.pct(50.0)),
        ms(on_listener.pct(99.0))
    );
    println!("throughput ratio reprise's listener/axum::serve: {listener_ratio:.2}x");
    let stats_ratio = hit.throughput() / unrecorded.throughput();
    println!(
        "exact hit, stats ring off {:>10.0} req/s  p50 {}  p99 {}",
        unrecorded.throughput(),
        ms(unrecorded.pct(50.0)),
        ms(unrecorded.pct(99.0))
    );
    println!("throughput ratio with stats/without: {stats_ratio:.2}x  (goal >= 0.95x)");
    let auth_ratio = (a.tenants > 0).then(|| auth_hit.throughput() / hit.throughput());
    if let Some(r) = auth_ratio {
        println!(
            "exact hit, {} tenants, keys required {:>10.0} req/s  p50 {}  p99 {}",
            a.tenants,
            auth_hit.throughput(),
            ms(auth_hit.pct(50.0)),
            ms(auth_hit.pct(99.0))
        );
        println!(
            "throughput ratio with keys/without: {r:.2}x  (goal >= 0.95x); with keys/ceiling: {:.2}x",
            auth_hit.throughput() / base.throughput()
        );
    }
    let added50 = via.pct(50.0) - direct.pct(50.0);
    let added99 = via.pct(99.0) - direct.pct(99.0);
    println!(
        "miss TTFT direct p50 {}  p99 {}",
        ms(direct.pct(50.0)),
        ms(direct.pct(99.0))
    );
    println!(
        "miss TTFT via    p50 {}  p99 {}",
        ms(via.pct(50.0)),
        ms(via.pct(99.0))
    );
    println!(
        "added TTFT p50 {}  p99 {}  (goal p50 <= 1 ms); ratio via/direct p50 {:.2}x",
        ms(added50),
        ms(added99),
        via.pct(50.0) / direct.pct(50.0)
    );
    if let Some(path) = a.json {
        let out = json!({
            "exact_rps": hit.throughput(), "ceiling_rps": base.throughput(), "ratio": ratio,
            "exact_p50_s": hit.pct(50.0), "exact_p99_s": hit.pct(99.0),
            "ceiling_p50_s": base.pct(50.0), "ceiling_p99_s": base.pct(99.0),
            "ttft_direct_p50_s": direct.pct(50.0), "ttft_via_p50_s": via.pct(50.0),
            "ttft_added_p50_s": added50, "ttft_added_p99_s": added99,
            "tenants": a.tenants, "auth_rps": auth_hit.throughput(), "auth_ratio": auth_ratio,
            "no_stats_rps": unrecorded.throughput(), "stats_ratio": stats_ratio,
            "listener_rps": on_listener.throughput(), "listener_ratio": listener_ratio,
            "failed": {
                "exact": hit.failed.json(), "ceiling": base.failed.json(),
                "auth": auth_hit.failed.json(), "no_stats": unrecorded.failed.json(),
                "listener": on_listener.failed.json(),
                "ttft_direct": direct.failed.json(),
                "ttft_via": via.failed.json(),
            },
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}
