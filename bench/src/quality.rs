//! `reprise-bench quality`: semantic hit quality on labelled pairs, measured the way a cache
//! sees traffic.
//!
//! Every side A is stored through the real HTTP path (`Cache-Control: no-cache`, so each A
//! gets its own entry); then every side B is asked with `Cache-Control: only-if-cached`, so a
//! miss neither calls the backend nor stores B. The scripted backend answers with the prompt
//! itself, so the body of a hit names the A it came from. A hit is correct when it was served
//! from the very same text or from a text the file labels the same as the question (its own A
//! when the pair is labelled the same, or another pair's side with such a label); any other hit
//! is wrong — including hits from texts whose relation to the question is unknown.
//!
//! Two passes: the curve (threshold near 0, gate off, top-1: every B is answered by its best
//! candidate; each threshold and the gate are then applied to that candidate), and the
//! configured policy measured exactly as served.
//!
//! `--pairwise` measures each pair on its own instead: pair i's A is stored and its B asked in
//! namespace `pair-i`, so B can only hit its own A and every hit is judged by the pair's own
//! label (other pairs' unlabelled texts play no part).
//!
//! Files of multi-turn cases (`{history_a, history_b, same_answer, category}`) are measured
//! by [`multiturn`]: decisions right by category, in the same cache view.
//!
//! `--online` ([`online`]) measures the learned thresholds (`semantic.delta`) instead: the
//! pairs as a stream of traffic, verdicts from the labels, each bound side by side with the
//! static policy.

mod multiturn;
mod online;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use serde_json::{json, Value};

pub use reprise::tune::pairs::{load_pairs, Pair};

use crate::common::{
    in_tuning_half, load_embedder, start_app, BackendKind, Config, Failure, Failures, Server,
    NAMESPACE_HEADER,
};

/// Options of `reprise-bench quality`.
#[derive(Debug, Args)]
pub struct QualityArgs {
    /// Labelled pairs: a JSON list of {origin, similar} (all true), or JSON lines of
    /// {text_a, text_b, label} or {a, b, same_answer, category}; or multi-turn cases, JSON
    /// lines of {history_a, history_b, same_answer, category} (decisions by category).
    #[arg(long, required = true)]
    pairs: Vec<PathBuf>,
    /// Configuration whose `[semantic]` policy is measured (threshold, gate, top_k, model).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Use at most this many pairs per file (0 = all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Concurrent requests while loading and asking.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Each pair in a namespace of its own: B can only hit its own A (judged by the pair's
    /// label alone) instead of every stored A.
    #[arg(long)]
    pairwise: bool,
    /// Measure the learned thresholds (`semantic.delta`) instead: the pairs as a stream of
    /// traffic with verdicts from the labels, each delta side by side with the static policy.
    #[arg(long)]
    online: bool,
    /// With --online: seed of the stream's order and of the scripted replies.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// With --online: share of semantic hits given a verdict (`POST /v1/feedback`).
    #[arg(long, default_value_t = 0.1)]
    feedback_share: f64,
    /// With --online: the bounds measured (`semantic.delta`), each on its own server.
    #[arg(long, value_delimiter = ',', default_value = "0.01,0.02,0.05")]
    deltas: Vec<f64>,
    /// Split each file's pairs in two halves by a hash of the pair and `--seed` (a fixed
    /// split): a tuning half, on which the threshold meeting each `--target-wrong` is chosen,
    /// and a held-out half, on which that threshold is then reported. Each half is its own
    /// cache (its own stored prompts).
    #[arg(long)]
    holdout: bool,
    /// With --holdout: wrong shares among served hits (with the gate) to choose a threshold
    /// for on the tuning half.
    #[arg(long, value_delimiter = ',', default_value = "0.02,0.05,0.10")]
    target_wrong: Vec<f64>,
}

/// What asking one B returned.
#[derive(Debug, Clone)]
struct Answer {
    /// The A text the hit was served from, if any.
    served: Option<String>,
    similarity: f32,
    /// The request failed (or, for a B, the store of its A did): neither served nor not
    /// served, left out of every figure and counted apart.
    failed: Option<Failure>,
}

async fn start(config: Config) -> anyhow::Result<Server> {
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig {
        reply: "{prompt}".into(),
        ..ScriptConfig::default()
    }));
    let embedder = load_embedder(&config).await?;
    start_app(config, backend, embedder).await
}

/// Asks every text (in the namespace beside it, when given); returns the answers in order.
async fn ask_all(
    client: &reqwest::Client,
    url: &str,
    texts: Vec<(String, Option<String>)>,
    cache_control: &'static str,
    concurrency: usize,
) -> Vec<Answer> {
    let results = futures::stream::iter(texts.into_iter().map(|(t, ns)| {
        let client = client.clone();
        let url = url.to_string();
        async move {
            let body = json!({"model": "fake", "max_tokens": 4096, "messages": [{"role": "user", "content": t}]});
            let mut req = client.post(&url).header("cache-control", cache_control);
            if let Some(ns) = ns {
                req = req.header(NAMESPACE_HEADER, ns);
            }
            let Ok(r) = req.json(&body).send().await else {
                return Answer { served: None, similarity: f32::NAN, failed: Some(Failure::Transport) };
            };
            // Only an `only-if-cached` miss may answer 504; any other failure status is a
            // failed request, not a miss.
            let status = r.status();
            if !(status.is_success()
                || (cache_control == "only-if-cached" && status == reqwest::StatusCode::GATEWAY_TIMEOUT))
            {
                let _ = r.bytes().await;
                return Answer { served: None, similarity: f32::NAN, failed: Some(Failure::Status) };
            }
            let outcome = r.headers().get("x-reprise-cache").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
            let similarity = r
                .headers()
                .get("x-reprise-similarity")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(if outcome == "exact" { 1.0 } else { f32::NAN });
            let Ok(body) = r.bytes().await else {
                return Answer { served: None, similarity: f32::NAN, failed: Some(Failure::Transport) };
            };
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let served = matches!(outcome.as_str(), "exact" | "semantic")
                .then(|| body.pointer("/choices/0/message/content").and_then(Value::as_str).map(str::to_string))
                .flatten();
            Answer { served, similarity, failed: None }
        }
    }))
    .buffered(concurrency)
    .collect::<Vec<_>>()
    .await;
    results
}

/// Stores every A, asks every B (all in one namespace, or each pair in its own with
/// `pairwise`); returns the answers in pair order.
async fn cache_view(
    config: Config,
    pairs: &[Pair],
    concurrency: usize,
    pairwise: bool,
) -> anyhow::Result<Vec<Answer>> {
    let server = start(config).await?;
    let client = reqwest::Client::new();
    let url = server.chat_url();
    let ns = |i: usize| pairwise.then(|| format!("pair-{i}"));
    let a_texts: Vec<(String, Option<String>)> = if pairwise {
        pairs
            .iter()
            .enumerate()
            .map(|(i, p)| (p.a.clone(), ns(i)))
            .collect()
    } else {
        let mut seen = std::collections::HashSet::new();
        pairs
            .iter()
            .filter(|p| seen.insert(p.a.clone()))
            .map(|p| (p.a.clone(), None))
            .collect()
    };
    eprintln!("  storing {} prompts", a_texts.len());
    let stores = ask_all(&client, &url, a_texts.clone(), "no-cache", concurrency).await;
    let mut store_failed = Failures::default();
    let mut unstored = std::collections::HashMap::new();
    for (a, r) in a_texts.into_iter().zip(&stores) {
        if let Some(f) = r.failed {
            store_failed.count(f);
            unstored.insert(a, f);
        }
    }
    eprintln!("  asking {} prompts", pairs.len());
    let mut answers = ask_all(
        &client,
        &url,
        pairs
            .iter()
            .enumerate()
            .map(|(i, p)| (p.b.clone(), ns(i)))
            .collect(),
        "only-if-cached",
        concurrency,
    )
    .await;
    let mut ask_failed = Failures::default();
    for (i, (p, ans)) in pairs.iter().zip(&mut answers).enumerate() {
        if let Some(f) = ans.failed {
            ask_failed.count(f);
        } else if let Some(f) = unstored.get(&(p.a.clone(), ns(i))) {
            // Its A was never stored: whatever B got says nothing about the cache.
            ans.failed = Some(*f);
        }
    }
    let left_out = answers.iter().filter(|a| a.failed.is_some()).count();
    println!(
        "  requests: stores {store_failed}, asks {ask_failed}; {left_out} pairs left out of the figures below"
    );
    Ok(answers)
}

/// Counts at one operating point.
#[derive(Debug, Default, Clone, Copy)]
struct Point {
    true_pairs: usize,
    true_hits: usize,
    served: usize,
    wrong: usize,
    false_pairs: usize,
    false_served: usize,
}

/// Which questions one answer serves: identical texts, and every pair labelled the same
/// (in either order). A hit from another pair's A is correct only when the labels say so.
struct Equivalence(std::collections::HashSet<(String, String)>);

impl Equivalence {
    fn new(pairs: &[Pair]) -> Self {
        let mut set = std::collections::HashSet::new();
        for p in pairs.iter().filter(|p| p.same) {
            set.insert((p.a.clone(), p.b.clone()));
            set.insert((p.b.clone(), p.a.clone()));
        }
        Equivalence(set)
    }

    fn serves(&self, served: &str, asked: &str) -> bool {
        served == asked || self.0.contains(&(served.to_string(), asked.to_string()))
    }
}

impl Point {
    fn add(&mut self, eq: &Equivalence, p: &Pair, served: Option<&str>) {
        let correct = served.is_some_and(|s| eq.serves(s, &p.b));
        if p.same {
            self.true_pairs += 1;
            self.true_hits += usize::from(correct);
        } else {
            self.false_pairs += 1;
            self.false_served += usize::from(served.is_some() && !correct);
        }
        if served.is_some() {
            self.served += 1;
            self.wrong += usize::from(!correct);
        }
    }

    fn line(&self) -> String {
        let pct = |a: usize, b: usize| {
            if b == 0 {
                f64::NAN
            } else {
                100.0 * a as f64 / b as f64
            }
        };
        format!(
            "hit rate on true pairs {:5.1} %  | wrong among served {:5.1} %  | false pairs served {:5.1} %  (served {})",
            pct(self.true_hits, self.true_pairs),
            pct(self.wrong, self.served),
            pct(self.false_served, self.false_pairs),
            self.served
        )
    }
}

/// Runs the quality benchmark.
pub async fn run(a: QualityArgs) -> anyhow::Result<()> {
    if a.online {
        return online::run(a).await;
    }
    let mut config = Config::load(a.config.as_deref())?;
    config.semantic.enabled = true;
    config.cache.enabled = true;
    config.backend.kind = BackendKind::Fake;
    for path in &a.pairs {
        if multiturn::is_multiturn(path) {
            multiturn::run(&config, path, a.concurrency).await?;
            continue;
        }
        let mut pairs = load_pairs(path)?;
        if a.limit > 0 {
            pairs.truncate(a.limit);
        }
        println!(
            "== reprise bench quality: {} ({} pairs, {}) ==",
            path.display(),
            pairs.len(),
            if a.pairwise {
                "pair-wise: each pair in its own namespace"
            } else {
                "cache view: every A stored together"
            }
        );

        if a.holdout {
            holdout(&a, &config, &pairs).await?;
            continue;
        }
        eprintln!("curve pass (best candidate of every question)");
        let eq = Equivalence::new(&pairs);
        let (answers, gate_ok) = best_candidates(&a, &config, &pairs).await?;
        println!("threshold | without gate | with gate");
        let mut t = 0.70f32;
        while t <= 0.981 {
            let (mut plain, mut gated) = (Point::default(), Point::default());
            for ((p, ans), ok) in pairs.iter().zip(&answers).zip(&gate_ok) {
                if ans.failed.is_some() {
                    continue;
                }
                let served = ans.served.as_deref().filter(|_| ans.similarity >= t);
                plain.add(&eq, p, served);
                gated.add(&eq, p, served.filter(|_| *ok));
            }
            println!("{t:.2} | {} \n     | {}", plain.line(), gated.line());
            t += 0.02;
        }

        eprintln!(
            "policy pass (threshold {}, gate {}, top_k {})",
            config.semantic.threshold, config.semantic.gate, config.semantic.top_k
        );
        let answers = cache_view(config.clone(), &pairs, a.concurrency, a.pairwise).await?;
        let mut total = Point::default();
        let mut by_cat: BTreeMap<String, Point> = BTreeMap::new();
        for (p, ans) in pairs.iter().zip(&answers) {
            if ans.failed.is_some() {
                continue;
            }
            total.add(&eq, p, ans.served.as_deref());
            by_cat
                .entry(p.category.clone())
                .or_default()
                .add(&eq, p, ans.served.as_deref());
        }
        println!(
            "configured policy (threshold {:.2}, gate {}): {}",
            config.semantic.threshold,
            if config.semantic.gate { "on" } else { "off" },
            total.line()
        );
        if by_cat.len() > 1 {
            for (cat, p) in &by_cat {
                println!("  {cat:<12} {}", p.line());
            }
        }
    }
    Ok(())
}

/// The best candidate of every question of `pairs` (threshold near 0, gate off, top-1) and
/// whether the gate passes it: the curve's raw material.
async fn best_candidates(
    a: &QualityArgs,
    config: &Config,
    pairs: &[Pair],
) -> anyhow::Result<(Vec<Answer>, Vec<bool>)> {
    let mut curve_cfg = config.clone();
    curve_cfg.semantic.threshold = 1e-6;
    curve_cfg.semantic.gate = false;
    curve_cfg.semantic.top_k = 1;
    let answers = cache_view(curve_cfg, pairs, a.concurrency, a.pairwise).await?;
    let gate_ok = pairs
        .iter()
        .zip(&answers)
        .map(|(p, ans)| {
            ans.served
                .as_deref()
                .is_none_or(|s| reprise_policies::gate(&p.b, s).is_pass())
        })
        .collect();
    Ok((answers, gate_ok))
}

/// The counts at threshold `t` with the gate.
fn gated_point(pairs: &[Pair], answers: &[Answer], gate_ok: &[bool], t: f32) -> Point {
    let eq = Equivalence::new(pairs);
    let mut gated = Point::default();
    for ((p, ans), ok) in pairs.iter().zip(answers).zip(gate_ok) {
        if ans.failed.is_some() {
            continue;
        }
        let served = ans.served.as_deref().filter(|_| ans.similarity >= t && *ok);
        gated.add(&eq, p, served);
    }
    gated
}

/// `--holdout`: the curve (with the gate) on the tuning and held-out halves side by side,
/// then, for each target wrong share, the lowest threshold meeting it on the tuning half and
/// what that threshold does on the held-out half. This is how a default threshold is chosen
/// without reporting the data it was chosen on.
async fn holdout(a: &QualityArgs, config: &Config, pairs: &[Pair]) -> anyhow::Result<()> {
    let (tune, held): (Vec<Pair>, Vec<Pair>) = pairs
        .iter()
        .cloned()
        .partition(|p| in_tuning_half(a.seed, &[&p.a, &p.b]));
    println!(
        "split (seed {}): {} tuning pairs, {} held-out pairs",
        a.seed,
        tune.len(),
        held.len()
    );
    eprintln!("curve pass, tuning half");
    let (tune_ans, tune_gate) = best_candidates(a, config, &tune).await?;
    eprintln!("curve pass, held-out half");
    let (held_ans, held_gate) = best_candidates(a, config, &held).await?;
    println!("threshold | tuning half (gate on) | held-out half (gate on)");
    let thresholds: Vec<f32> = (70..=98).map(|i| i as f32 / 100.0).collect();
    for &t in thresholds.iter().step_by(2) {
        let tp = gated_point(&tune, &tune_ans, &tune_gate, t);
        let hp = gated_point(&held, &held_ans, &held_gate, t);
        println!("{t:.2} | {}\n     | {}", tp.line(), hp.line());
    }
    for &target in &a.target_wrong {
        let chosen = thresholds.iter().copied().find(|&t| {
            let p = gated_point(&tune, &tune_ans, &tune_gate, t);
            p.served > 0 && (p.wrong as f64) <= target * p.served as f64
        });
        match chosen {
            Some(t) => {
                let tp = gated_point(&tune, &tune_ans, &tune_gate, t);
                let hp = gated_point(&held, &held_ans, &held_gate, t);
                println!(
                    "target wrong ≤ {:.0} %: threshold {t:.2} chosen on the tuning half\n  tuning:   {}\n  held-out: {}",
                    target * 100.0,
                    tp.line(),
                    hp.line()
                );
            }
            None => println!(
                "target wrong ≤ {:.0} %: no threshold up to 0.98 meets it on the tuning half",
                target * 100.0
            ),
        }
    }
    Ok(())
}
