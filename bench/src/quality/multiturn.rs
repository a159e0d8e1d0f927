//! `reprise-bench quality` on multi-turn cases: JSON lines of `{id, history_a, history_b,
//! same_answer, category}`, each history an OpenAI message list ending with a user message.
//!
//! The cache view, as for pairs: every distinct history A is sent whole through the real HTTP
//! path (`Cache-Control: no-cache`, so it is generated and stored under its own entry), then
//! every history B is asked with `only-if-cached` (a miss neither calls the backend nor
//! stores). Each response names its entry (`x-reprise-entry`), so a hit is traced to the A it
//! was stored for. A case is decided right when B is served A's answer and the case says the
//! answer is the same, or B is not served and the case says it is not. A hit from any other
//! case's A is wrong whatever the labels say.
//!
//! Besides the decisions, the report counts the standalone calls of the text rules
//! (`reprise_policies::standalone::refers_back` on each B with earlier turns): in categories
//! whose follow-ups refer back, each such call is a false one.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use serde_json::{json, Value};

use crate::common::{load_embedder, start_app, Config, Failure, Failures};

/// One multi-turn case.
#[derive(Debug, Clone)]
pub struct Case {
    pub history_a: Vec<Value>,
    pub history_b: Vec<Value>,
    pub same: bool,
    pub category: String,
}

/// Whether `path` holds multi-turn cases (its first line has `history_a`).
pub fn is_multiturn(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| !l.trim().is_empty())
                .and_then(|l| serde_json::from_str::<Value>(l).ok())
        })
        .is_some_and(|v| v.get("history_a").is_some())
}

/// Reads the cases of `path`.
pub fn load(path: &Path) -> anyhow::Result<Vec<Case>> {
    let text = std::fs::read_to_string(path)?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), n + 1))?;
        let history = |k: &str| -> anyhow::Result<Vec<Value>> {
            let h = v[k]
                .as_array()
                .filter(|h| h.last().is_some_and(|m| m["role"] == "user"))
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}:{}: {k} must be a message list ending with a user message",
                        path.display(),
                        n + 1
                    )
                })?;
            Ok(h.clone())
        };
        out.push(Case {
            history_a: history("history_a")?,
            history_b: history("history_b")?,
            same: v["same_answer"].as_bool().unwrap_or(false),
            category: v["category"].as_str().unwrap_or("").to_string(),
        });
    }
    Ok(out)
}

/// What asking one history returned: the entry that answers it (stored or served), or the
/// failure.
type Reply = Result<Option<String>, Failure>;

async fn send(
    client: &reqwest::Client,
    url: &str,
    messages: &[Value],
    cache_control: &'static str,
) -> Reply {
    let body = json!({"model": "fake", "max_tokens": 4096, "messages": messages});
    let r = client
        .post(url)
        .header("cache-control", cache_control)
        .json(&body)
        .send()
        .await
        .map_err(|_| Failure::Transport)?;
    let status = r.status();
    let header = |k: &str| {
        r.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (outcome, entry) = (header("x-reprise-cache"), header("x-reprise-entry"));
    let _ = r.bytes().await.map_err(|_| Failure::Transport)?;
    if cache_control == "only-if-cached" && status == reqwest::StatusCode::GATEWAY_TIMEOUT {
        return Ok(None);
    }
    if !status.is_success() {
        return Err(Failure::Status);
    }
    match cache_control {
        // A store: the entry it was stored as.
        "no-cache" => entry.map(Some).ok_or(Failure::Status),
        // An ask: the entry that served it, if any.
        _ => Ok(entry.filter(|_| matches!(outcome.as_deref(), Some("exact" | "semantic")))),
    }
}

/// Decisions of one category (or all).
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    cases: usize,
    right: usize,
    /// Cases whose answer is the same, and those served their own A.
    same: usize,
    same_hit: usize,
    /// Cases whose answer differs, and those served anything.
    differ: usize,
    differ_served: usize,
    /// Any case served another case's A.
    foreign: usize,
    /// B has earlier turns and the text rules call its last message standalone.
    standalone_calls: usize,
    with_turns: usize,
}

fn pct(n: usize, d: usize) -> String {
    match d {
        0 => "   – ".into(),
        _ => format!("{:5.1} %", 100.0 * n as f64 / d as f64),
    }
}

impl Tally {
    fn line(&self) -> String {
        format!(
            "right {} ({}/{}) | same-answer hit {} | must-not-share served {} | from another case {} | standalone calls {}/{}",
            pct(self.right, self.cases),
            self.right,
            self.cases,
            pct(self.same_hit, self.same),
            pct(self.differ_served, self.differ),
            self.foreign,
            self.standalone_calls,
            self.with_turns,
        )
    }
}

/// The text of the last message of a history.
fn last_text(h: &[Value]) -> &str {
    h.last().and_then(|m| m["content"].as_str()).unwrap_or("")
}

/// Measures the configured policy on the cases of `path`.
pub async fn run(config: &Config, path: &Path, concurrency: usize) -> anyhow::Result<()> {
    let cases = load(path)?;
    println!(
        "== reprise bench quality: {} ({} multi-turn cases, cache view) ==",
        path.display(),
        cases.len()
    );
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig {
        reply: "{prompt}".into(),
        ..ScriptConfig::default()
    }));
    let embedder = load_embedder(config).await?;
    let server = start_app(config.clone(), backend, embedder).await?;
    let client = reqwest::Client::new();
    let url = server.chat_url();

    // Every distinct A, stored once; which cases it stands for.
    let mut distinct: Vec<&Vec<Value>> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut of_case = Vec::with_capacity(cases.len());
    for c in &cases {
        let k = serde_json::to_string(&c.history_a)?;
        let i = *index.entry(k).or_insert_with(|| {
            distinct.push(&c.history_a);
            distinct.len() - 1
        });
        of_case.push(i);
    }
    eprintln!("  storing {} conversations", distinct.len());
    let stored: Vec<Reply> = futures::stream::iter(distinct.iter().map(|h| {
        let (client, url) = (client.clone(), url.clone());
        async move { send(&client, &url, h, "no-cache").await }
    }))
    .buffered(concurrency)
    .collect()
    .await;
    eprintln!("  asking {} conversations", cases.len());
    let asked: Vec<Reply> = futures::stream::iter(cases.iter().map(|c| {
        let (client, url) = (client.clone(), url.clone());
        async move { send(&client, &url, &c.history_b, "only-if-cached").await }
    }))
    .buffered(concurrency)
    .collect()
    .await;

    let (mut store_failed, mut ask_failed) = (Failures::default(), Failures::default());
    let mut total = Tally::default();
    let mut by_cat: BTreeMap<&str, Tally> = BTreeMap::new();
    for (i, c) in cases.iter().enumerate() {
        let own = match &stored[of_case[i]] {
            Ok(Some(id)) => id,
            Ok(None) => continue,
            Err(f) => {
                store_failed.count(*f);
                continue;
            }
        };
        let served = match &asked[i] {
            Ok(s) => s.as_ref(),
            Err(f) => {
                ask_failed.count(*f);
                continue;
            }
        };
        let from_own = served == Some(own);
        let right = match c.same {
            true => from_own,
            false => served.is_none(),
        };
        let with_turns = c.history_b.iter().any(|m| m["role"] == "assistant");
        let alone =
            with_turns && !reprise_policies::standalone::refers_back(last_text(&c.history_b));
        for t in [&mut total, by_cat.entry(c.category.as_str()).or_default()] {
            t.cases += 1;
            t.right += right as usize;
            if c.same {
                t.same += 1;
                t.same_hit += from_own as usize;
            } else {
                t.differ += 1;
                t.differ_served += served.is_some() as usize;
            }
            t.foreign += (served.is_some() && !from_own) as usize;
            t.with_turns += with_turns as usize;
            t.standalone_calls += alone as usize;
        }
    }
    println!("  requests: stores {store_failed}, asks {ask_failed} (left out of the figures)");
    println!(
        "configured policy (threshold {:.2}, gate {}, standalone {}): {}",
        config.semantic.threshold,
        if config.semantic.gate { "on" } else { "off" },
        if config.semantic.standalone {
            "on"
        } else {
            "off"
        },
        total.line()
    );
    for (cat, t) in &by_cat {
        println!("  {cat:<24} {}", t.line());
    }
    Ok(())
}
