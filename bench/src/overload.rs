//! `reprise-bench overload`: open-loop arrivals (Poisson) at multiples of the backend's
//! measured capacity, through two reprise servers side by side, one with `[degrade]` off
//! and one with it on, and reports interactive latency (P50/P95/P99 of the first token and
//! of the whole answer), the share of answers degraded by kind, 429s and wrong hits.
//!
//! The questions come from the session file: for each intent one wording is asked during a
//! warm-up (it is cached and teaches the prediction the backend's service time); then the
//! arrivals mix exact repeats of those wordings, paraphrases (the other wordings of the same
//! intents) and new questions (wordings of the other intents with an order number, so no two
//! are the same question: the false-hit gate refuses different numbers). The load multiple is
//! of new questions: they alone arrive at that multiple of the capacity; repeats and
//! paraphrases come on top in their shares. The scripted backend has `--slots` decode slots;
//! its answers start `You asked: <question>`, so a hit whose question belongs to another
//! intent is a wrong hit.
//!
//! Open loop: requests are sent at their arrival times whatever the answers do, so a backend
//! that falls behind builds a queue, as it would in production.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::Backend;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::common::{
    load_embedder, naming_reply, percentile, sse_data, sse_text, start_routed, BackendConfig,
    BackendKind, Config, DegradeStep, RouteConfig, Server,
};

/// Options of `reprise-bench overload`.
#[derive(Debug, Clone, Args)]
pub struct OverloadArgs {
    /// Session file (JSON lines: `session_id`, `turns` of `intent` and `text`).
    #[arg(long)]
    sessions: PathBuf,
    /// Decode slots of the scripted backend (its capacity).
    #[arg(long, default_value_t = 2)]
    slots: usize,
    /// Scripted backend: delay per generated token, milliseconds.
    #[arg(long, default_value_t = 10)]
    token_delay_ms: u64,
    /// Scripted backend: words of padding after the `You asked:` line (answer length).
    #[arg(long, default_value_t = 40)]
    reply_words: usize,
    /// Load multiples of the measured capacity (of new questions).
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,2,4")]
    loads: Vec<f64>,
    /// Seconds of arrivals per load.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Exact repeats per new question.
    #[arg(long, default_value_t = 0.5)]
    repeats: f64,
    /// Paraphrases per new question.
    #[arg(long, default_value_t = 0.5)]
    paraphrases: f64,
    /// The SLO (first token and whole answer), seconds; default: three service times.
    #[arg(long)]
    slo_secs: Option<f64>,
    /// The degrading side also has a fallback backend (scripted, unlimited slots, a quarter
    /// of the token delay) on its route.
    #[arg(long)]
    fallback: bool,
    /// Seed of the arrival times and the mix.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as JSON here as well.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct Session {
    turns: Vec<Turn>,
}

#[derive(Debug, Deserialize)]
struct Turn {
    intent: String,
    text: String,
}

/// One load's results: the multiple, and each side's requests (degrade off, on).
type LoadRun = (f64, [Vec<(Kind, Outcome)>; 2]);

/// What kind of question an arrival asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Repeat,
    Paraphrase,
    New,
}

/// One request's fate.
#[derive(Debug, Clone)]
struct Outcome {
    status: u16,
    degraded: Option<String>,
    wrong: bool,
    ttft: f64,
    total: f64,
}

/// The questions, by what they are for.
struct Questions {
    seeded: Vec<(String, String)>,
    paraphrases: Vec<(String, String)>,
    fresh: Vec<(String, String)>,
}

fn questions(path: &PathBuf) -> anyhow::Result<Questions> {
    let text = std::fs::read_to_string(path)?;
    let mut wordings: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let s: Session = serde_json::from_str(line)?;
        for t in s.turns {
            match wordings.iter_mut().find(|(i, _)| *i == t.intent) {
                Some((_, w)) if !w.contains(&t.text) => w.push(t.text),
                Some(_) => {}
                None => wordings.push((t.intent, vec![t.text])),
            }
        }
    }
    anyhow::ensure!(wordings.len() >= 4, "too few intents in {}", path.display());
    let (mut seeded, mut paraphrases, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
    for (n, (intent, w)) in wordings.into_iter().enumerate() {
        // Every third intent is never warmed: its wordings are the new questions.
        if n % 3 == 2 {
            fresh.extend(w.into_iter().map(|t| (intent.clone(), t)));
        } else {
            let mut w = w.into_iter();
            seeded.extend(w.next().map(|t| (intent.clone(), t)));
            paraphrases.extend(w.map(|t| (intent.clone(), t)));
        }
    }
    Ok(Questions {
        seeded,
        paraphrases,
        fresh,
    })
}

/// A deterministic draw in [0, 1).
fn unit(seed: u64, n: u64, salt: u64) -> f64 {
    let h = blake3::hash(&[seed.to_le_bytes(), n.to_le_bytes(), salt.to_le_bytes()].concat());
    let v = u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"));
    (v >> 11) as f64 / (1u64 << 53) as f64
}

/// One side: a server with the scripted primary (and, degrading with `--fallback`, a
/// fallback on its route).
async fn side(
    a: &OverloadArgs,
    script: &ScriptConfig,
    degrade: bool,
    slo: f64,
) -> anyhow::Result<Server> {
    let mut c = Config::default();
    c.semantic.enabled = true;
    c.slo.ttft_secs = slo;
    c.slo.total_secs = slo;
    c.backend.max_queue = 100_000;
    let table = |name: &str| BackendConfig {
        name: name.into(),
        kind: BackendKind::Fake,
        max_queue: 100_000,
        ..BackendConfig::default()
    };
    c.backends = vec![table("main")];
    let primary = ScriptedBackend::new(ScriptConfig {
        max_queue: Some(100_000),
        ..script.clone()
    });
    let mut backends: Vec<(&str, Arc<dyn Backend>)> = vec![("main", Arc::new(primary))];
    c.degrade.enabled = degrade;
    c.degrade.order = vec![DegradeStep::LooseThreshold, DegradeStep::Stale];
    if degrade && a.fallback {
        c.backends.push(table("light"));
        c.routes = vec![RouteConfig {
            model: Some("fake".into()),
            backend: "main".into(),
            fallback: Some("light".into()),
            ..RouteConfig::default()
        }];
        let light = ScriptedBackend::new(ScriptConfig {
            model: "light".into(),
            first_token_delay: script.first_token_delay / 4,
            token_delay: script.token_delay / 4,
            slots: None,
            max_queue: None,
            ..script.clone()
        });
        backends.push(("light", Arc::new(light)));
        c.degrade.order.push(DegradeStep::Fallback);
    }
    c.degrade.order.push(DegradeStep::Refuse);
    c.validate()?;
    let embedder = load_embedder(&c).await?;
    start_routed(c, backends, embedder).await
}

/// Sends one streamed question and reads its answer to the end.
async fn ask(
    client: &reqwest::Client,
    url: &str,
    text: &str,
    intent_of: &HashMap<String, String>,
    intent: &str,
) -> Outcome {
    let body =
        json!({"model": "fake", "messages": [{"role": "user", "content": text}], "stream": true});
    let t = Instant::now();
    let failed = |status| Outcome {
        status,
        degraded: None,
        wrong: false,
        ttft: f64::NAN,
        total: f64::NAN,
    };
    let r = match client.post(url).json(&body).send().await {
        Ok(r) => r,
        Err(_) => return failed(0),
    };
    let status = r.status().as_u16();
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (cache, degraded) = (
        header("x-reprise-cache").unwrap_or_default(),
        header("x-reprise-degraded"),
    );
    if status != 200 {
        let _ = r.bytes().await;
        return failed(status);
    }
    let mut stream = r.bytes_stream();
    let (mut body, mut ttft) = (Vec::new(), None);
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { return failed(0) };
        ttft.get_or_insert_with(|| t.elapsed().as_secs_f64());
        body.extend_from_slice(&chunk);
    }
    let data = sse_data(&String::from_utf8_lossy(&body));
    if !data.iter().any(|d| d == "[DONE]") {
        return failed(0);
    }
    let answer = sse_text(&data);
    let asked = answer
        .strip_prefix("You asked: ")
        .and_then(|s| s.split('\n').next())
        .unwrap_or("");
    let hit = matches!(cache.as_str(), "exact" | "semantic" | "stale");
    let wrong = hit && wrong_answer(asked, text, intent_of, intent);
    Outcome {
        status,
        degraded,
        wrong,
        ttft: ttft.unwrap_or(f64::NAN),
        total: t.elapsed().as_secs_f64(),
    }
}

/// A new question's text without its order number.
fn strip_order(text: &str) -> &str {
    text.rsplit_once(" (order ").map_or(text, |(q, _)| q)
}

/// A new question's order number (`None` for the others).
fn order_of(text: &str) -> Option<&str> {
    text.rsplit_once(" (order ").map(|(_, n)| n)
}

/// Whether the answer to `answered` is wrong for `asked` (of `intent`): another intent, or
/// another order's question (a new question with its order number is a question of its own:
/// the answer about order 12 does not answer about order 15).
fn wrong_answer(
    answered: &str,
    asked: &str,
    intent_of: &HashMap<String, String>,
    intent: &str,
) -> bool {
    intent_of.get(strip_order(answered)).map(String::as_str) != Some(intent)
        || order_of(answered) != order_of(asked)
}

/// Runs the benchmark.
pub async fn run(a: OverloadArgs) -> anyhow::Result<()> {
    let q = questions(&a.sessions)?;
    let mut intent_of = HashMap::new();
    for (i, t) in q.seeded.iter().chain(&q.paraphrases).chain(&q.fresh) {
        intent_of.insert(t.clone(), i.clone());
    }
    let intent_of = Arc::new(intent_of);
    let script = ScriptConfig {
        model: "fake".into(),
        reply: naming_reply(a.reply_words),
        first_token_delay: Duration::from_millis(a.token_delay_ms * 5),
        token_delay: Duration::from_millis(a.token_delay_ms),
        slots: Some(a.slots.max(1)),
        ..ScriptConfig::default()
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(300))
        .build()?;

    // The capacity, measured: `slots` clients asking new questions back to back.
    // (Not degrading: the SLO is not read; the largest one allowed.)
    let probe = side(&a, &script, false, reprise::config::MAX_SLO_SECS).await?;
    let (t, mut n) = (Instant::now(), 0u64);
    let window = Duration::from_secs(5);
    let mut k = 0u64;
    while t.elapsed() < window {
        let batch: Vec<_> = (0..a.slots)
            .map(|_| {
                k += 1;
                let (intent, text) = &q.fresh[(k as usize) % q.fresh.len()];
                let text = format!("{text} (order {k})");
                let (client, url, io, intent) = (
                    client.clone(),
                    probe.chat_url(),
                    intent_of.clone(),
                    intent.clone(),
                );
                tokio::spawn(async move { ask(&client, &url, &text, &io, &intent).await })
            })
            .collect();
        for b in batch {
            n += u64::from(b.await?.status == 200);
        }
    }
    let capacity = n as f64 / t.elapsed().as_secs_f64();
    let service = a.slots as f64 / capacity;
    let slo = a.slo_secs.unwrap_or(3.0 * service);
    drop(probe);
    eprintln!(
        "capacity {capacity:.2} new questions/s ({} slots, {:.0} ms per answer); SLO {slo:.2} s",
        a.slots,
        service * 1e3
    );

    let mut report = Vec::new();
    for &load in &a.loads {
        let mut sides = Vec::new();
        for degrade in [false, true] {
            let server = side(&a, &script, degrade, slo).await?;
            // Warm-up: every seeded wording cached, the service time learned; at most
            // `slots` at a time, so none is answered by a fallback (which is not stored).
            for chunk in q.seeded.chunks(a.slots.max(1)) {
                let warm: Vec<_> = chunk
                    .iter()
                    .map(|(i, t)| {
                        let (client, url, io, i, t) = (
                            client.clone(),
                            server.chat_url(),
                            intent_of.clone(),
                            i.clone(),
                            t.clone(),
                        );
                        tokio::spawn(async move { ask(&client, &url, &t, &io, &i).await })
                    })
                    .collect();
                for w in warm {
                    w.await?;
                }
            }
            sides.push(server);
        }
        // The same arrivals on both sides at once.
        let rate = load * capacity * (1.0 + a.repeats + a.paraphrases);
        let mut arrivals = Vec::new();
        let (mut at, mut i) = (0.0f64, 0u64);
        while at < a.seconds as f64 {
            at += -(1.0 - unit(a.seed, i, 1)).ln() / rate;
            let pick = unit(a.seed, i, 2) * (1.0 + a.repeats + a.paraphrases);
            let (kind, (intent, text)) = if pick < 1.0 {
                let (intent, text) = &q.fresh[(unit(a.seed, i, 3) * q.fresh.len() as f64) as usize];
                (Kind::New, (intent.clone(), format!("{text} (order {i})")))
            } else if pick < 1.0 + a.repeats {
                (
                    Kind::Repeat,
                    q.seeded[(unit(a.seed, i, 3) * q.seeded.len() as f64) as usize].clone(),
                )
            } else {
                (
                    Kind::Paraphrase,
                    q.paraphrases[(unit(a.seed, i, 3) * q.paraphrases.len() as f64) as usize]
                        .clone(),
                )
            };
            arrivals.push((at, kind, intent, text));
            i += 1;
        }
        eprintln!(
            "load {load}x: {} arrivals over {} s per side",
            arrivals.len(),
            a.seconds
        );
        let start = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for (at, kind, intent, text) in arrivals {
            tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
            for (s, server) in sides.iter().enumerate() {
                let (client, url, io, intent, text) = (
                    client.clone(),
                    server.chat_url(),
                    intent_of.clone(),
                    intent.clone(),
                    text.clone(),
                );
                tasks.push((
                    s,
                    kind,
                    tokio::spawn(async move { ask(&client, &url, &text, &io, &intent).await }),
                ));
            }
        }
        let mut results: [Vec<(Kind, Outcome)>; 2] = [Vec::new(), Vec::new()];
        for (s, kind, t) in tasks {
            results[s].push((kind, t.await?));
        }
        report.push((load, results));
    }
    print_report(&a, capacity, slo, &report);
    if let Some(path) = &a.json {
        std::fs::write(
            path,
            serde_json::to_vec_pretty(&json_report(capacity, slo, &report))?,
        )?;
    }
    Ok(())
}

/// Figures of one side at one load.
struct Figures {
    n: usize,
    answered: usize,
    refused: usize,
    errors: usize,
    wrong: usize,
    /// Answered whole within the SLO: the share of all requests (refused ones included)
    /// the SLO was kept for. The percentiles are over answered requests only, so a side
    /// that refuses its slow requests looks fast there; this figure does not.
    within_slo: usize,
    degraded: Vec<(String, usize)>,
    total: [f64; 3],
    ttft: [f64; 3],
}

fn figures(results: &[(Kind, Outcome)], slo: f64) -> Figures {
    let ok: Vec<&Outcome> = results
        .iter()
        .map(|(_, o)| o)
        .filter(|o| o.status == 200)
        .collect();
    let mut degraded: Vec<(String, usize)> = Vec::new();
    for d in ok.iter().filter_map(|o| o.degraded.clone()) {
        match degraded.iter_mut().find(|(k, _)| *k == d) {
            Some((_, n)) => *n += 1,
            None => degraded.push((d, 1)),
        }
    }
    let totals: Vec<f64> = ok.iter().map(|o| o.total).collect();
    let ttfts: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let pcts = |v: &[f64]| [50.0, 95.0, 99.0].map(|p| percentile(v, p));
    Figures {
        n: results.len(),
        answered: ok.len(),
        refused: results.iter().filter(|(_, o)| o.status == 429).count(),
        errors: results
            .iter()
            .filter(|(_, o)| o.status != 200 && o.status != 429)
            .count(),
        wrong: ok.iter().filter(|o| o.wrong).count(),
        within_slo: ok.iter().filter(|o| o.total <= slo).count(),
        degraded,
        total: pcts(&totals),
        ttft: pcts(&ttfts),
    }
}

fn print_report(a: &OverloadArgs, capacity: f64, slo: f64, report: &[LoadRun]) {
    println!("== reprise bench overload ==");
    println!(
        "scripted backend, {} slots, capacity {capacity:.2} new questions/s, SLO {slo:.2} s; {} s of arrivals per load; per new question {} repeats and {} paraphrases{}",
        a.slots,
        a.seconds,
        a.repeats,
        a.paraphrases,
        if a.fallback { "; the degrading side has a fallback backend" } else { "" }
    );
    println!("| load | side | requests | 429 | errors | degraded (share of answers) | wrong hits | answered within SLO (of requests) | total P50 / P95 / P99 s (answered) | TTFT P50 / P95 / P99 s (answered) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (load, sides) in report {
        let f = [figures(&sides[0], slo), figures(&sides[1], slo)];
        for (name, f) in ["off", "on"].iter().zip(&f) {
            let degraded: Vec<String> = f
                .degraded
                .iter()
                .map(|(k, n)| format!("{k} {:.1} %", 100.0 * *n as f64 / f.answered.max(1) as f64))
                .collect();
            println!(
                "| {load}x | degrade {name} | {} | {} | {} | {} | {} | {:.1} % | {:.2} / {:.2} / {:.2} | {:.2} / {:.2} / {:.2} |",
                f.n,
                f.refused,
                f.errors,
                if degraded.is_empty() { "-".to_string() } else { degraded.join(", ") },
                f.wrong,
                100.0 * f.within_slo as f64 / f.n.max(1) as f64,
                f.total[0], f.total[1], f.total[2],
                f.ttft[0], f.ttft[1], f.ttft[2],
            );
        }
        let share: usize = f[1].degraded.iter().map(|(_, n)| n).sum();
        println!(
            "| {load}x | on / off | | | | {:.1} % degraded | | {:.2}x | P95 {:.3}x | P95 {:.3}x |",
            100.0 * share as f64 / f[1].answered.max(1) as f64,
            f[1].within_slo as f64 / f[0].within_slo.max(1) as f64,
            f[1].total[1] / f[0].total[1],
            f[1].ttft[1] / f[0].ttft[1],
        );
    }
    println!("goal at 2x: P95 total on/off <= 0.3x, <= 15 % of answers degraded, no more wrong hits than the gate's measured rate");
    println!("(percentiles are over answered requests: read them beside the 429s and the share answered within the SLO)");
}

fn json_report(capacity: f64, slo: f64, report: &[LoadRun]) -> Value {
    let figures = |r: &[(Kind, Outcome)]| figures(r, slo);
    let loads: Vec<Value> = report
        .iter()
        .map(|(load, sides)| {
            let side = |f: Figures| {
                json!({"requests": f.n, "answered": f.answered, "refused": f.refused, "errors": f.errors,
                       "wrong_hits": f.wrong, "within_slo": f.within_slo, "degraded": f.degraded.into_iter().collect::<HashMap<_, _>>(),
                       "total_p50_p95_p99": f.total, "ttft_p50_p95_p99": f.ttft})
            };
            json!({"load": load, "off": side(figures(&sides[0])), "on": side(figures(&sides[1]))})
        })
        .collect();
    json!({"capacity_per_s": capacity, "slo_secs": slo, "loads": loads})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_deterministic_and_in_range() {
        for i in 0..1000 {
            let u = unit(7, i, 1);
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u, unit(7, i, 1));
        }
        assert_ne!(unit(7, 1, 1), unit(8, 1, 1));
    }

    #[test]
    fn order_numbers_come_off() {
        assert_eq!(strip_order("How do I crop? (order 12)"), "How do I crop?");
        assert_eq!(strip_order("How do I crop?"), "How do I crop?");
    }

    /// Refused requests leave the percentiles but count against the share answered within
    /// the SLO.
    #[test]
    fn refusals_count_against_the_slo_share() {
        let answered = |total| Outcome {
            status: 200,
            degraded: None,
            wrong: false,
            ttft: total / 2.0,
            total,
        };
        let refused = Outcome {
            status: 429,
            total: f64::NAN,
            ttft: f64::NAN,
            ..answered(0.0)
        };
        let results: Vec<(Kind, Outcome)> = [answered(0.5), answered(1.0), answered(5.0)]
            .into_iter()
            .chain([refused.clone(), refused])
            .map(|o| (Kind::New, o))
            .collect();
        let f = figures(&results, 2.0);
        assert_eq!((f.n, f.answered, f.refused), (5, 3, 2));
        assert_eq!(f.within_slo, 2);
        assert!(f.total[1] > 1.0, "over the answered: {:?}", f.total);
    }

    #[test]
    fn another_orders_answer_is_wrong() {
        let intent_of = HashMap::from([
            ("How do I crop?".to_string(), "crop".to_string()),
            ("How can I crop a photo?".to_string(), "crop".to_string()),
            ("How do I rotate?".to_string(), "rotate".to_string()),
        ]);
        let wrong = |answered, asked, intent| wrong_answer(answered, asked, &intent_of, intent);
        assert!(!wrong(
            "How do I crop? (order 15)",
            "How do I crop? (order 15)",
            "crop"
        ));
        assert!(wrong(
            "How do I crop? (order 12)",
            "How do I crop? (order 15)",
            "crop"
        ));
        assert!(!wrong("How do I crop?", "How can I crop a photo?", "crop"));
        assert!(wrong("How do I rotate?", "How can I crop a photo?", "crop"));
        assert!(wrong(
            "How do I crop? (order 12)",
            "How can I crop a photo?",
            "crop"
        ));
    }
}
