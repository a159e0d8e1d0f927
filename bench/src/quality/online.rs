//! `reprise-bench quality --online`: the learned thresholds (`semantic.delta`) measured on
//! labelled pairs sent as a stream of traffic, side by side with the static policy.
//!
//! The stream: every pair's A and B in one random order (`--seed`) in which each A comes
//! before its B (the 2n asks shuffled; a pair's first ask is its A). A is asked with
//! `Cache-Control: no-cache`, so it is generated and stored, never matched; B is asked as
//! plain traffic, so it may be a hit, and a miss is generated, stored and (under a bound, when
//! sampled) checked as a near miss. Requests go one at a time: the order is the experiment.
//!
//! The backend answers paraphrases alike: each text gets a scripted reply (a rule keyed on the
//! text), a pair labelled the same gives its A and B one reply, and every other text a reply
//! of its own. Replies are random words of the data's own vocabulary, so different replies are
//! far apart for the embedder: the server's near-miss check (answer similarity ≥
//! `answer_threshold`) then says "same answer" exactly when the candidate is its pair's A and
//! the pair is a duplicate, which is the labels' verdict. The run prints the largest
//! similarity between different replies it measured, to show that holds.
//!
//! A semantic hit on B is correct only when served the answer of B's own A and the pair is
//! labelled the same (the cache view of the data's README): hits from any other entry are
//! wrong, even where the labels say nothing. On `--feedback-share` of the semantic hits (every
//! n-th, so the share is exact) the harness sends `POST /v1/feedback` with that verdict.
//!
//! Sides, each on a fresh server: the static policy (delta 0), each delta of `--deltas`, and
//! the static policy with its threshold at `semantic.min_threshold`, whose hits and their
//! similarities give the static curve: the hits a static threshold `t` would have served are
//! (nearly: served hits are not stored as entries of their own, and more verdicts refuse
//! more) those found at similarity `t` or more. Every side gets the same feedback. Measured
//! after a warm-up of the first half of the stream.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_embedder::Embedder;
use serde_json::{json, Value};

use super::{load_pairs, Pair, QualityArgs};
use crate::common::{
    learned_threshold, load_embedder, start_app, BackendKind, Config, Learned, Server,
    CACHE_HEADER, SIMILARITY_HEADER,
};

/// Words in one scripted reply.
const REPLY_WORDS: usize = 12;
/// Replies compared pairwise for the check that different answers are far apart.
const REPLIES_CHECKED: usize = 200;

/// A small deterministic generator (SplitMix64): one seed, one sequence, on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Which side of its pair an ask sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// Stored (`no-cache`).
    A,
    /// Asked as plain traffic.
    B,
}

/// The stream: `(pair, turn)` for the 2 × `pairs` asks, in a random order of `seed` in which
/// every pair's A comes before its B.
fn stream(pairs: usize, seed: u64) -> Vec<(usize, Turn)> {
    let mut asks: Vec<usize> = (0..pairs).flat_map(|i| [i, i]).collect();
    Rng(seed).shuffle(&mut asks);
    let mut asked = vec![false; pairs];
    asks.into_iter()
        .map(|i| {
            let turn = if std::mem::replace(&mut asked[i], true) {
                Turn::B
            } else {
                Turn::A
            };
            (i, turn)
        })
        .collect()
}

/// The scripted answers: one reply per text, shared by the two sides of a pair labelled the
/// same. A text in several pairs keeps the reply of its first.
struct Answers {
    /// Text → its answer.
    of_text: HashMap<String, usize>,
    /// Answer → reply text.
    replies: Vec<String>,
    /// Reply text → answer.
    by_reply: HashMap<String, usize>,
}

impl Answers {
    fn new(pairs: &[Pair], seed: u64) -> Answers {
        let mut vocabulary: Vec<String> = pairs
            .iter()
            .flat_map(|p| [&p.a, &p.b])
            .flat_map(|t| t.split(|c: char| !c.is_ascii_alphabetic()))
            .filter(|w| w.len() >= 4)
            .map(str::to_ascii_lowercase)
            .collect();
        vocabulary.sort();
        vocabulary.dedup();
        let mut rng = Rng(seed ^ 0xA5A5_A5A5);
        let mut answers = Answers {
            of_text: HashMap::new(),
            replies: Vec::new(),
            by_reply: HashMap::new(),
        };
        let mut new_reply = |answers: &mut Answers| loop {
            let words: Vec<&str> = (0..REPLY_WORDS)
                .map(|_| vocabulary[rng.below(vocabulary.len())].as_str())
                .collect();
            let reply = words.join(" ");
            if !answers.by_reply.contains_key(&reply) {
                let id = answers.replies.len();
                answers.by_reply.insert(reply.clone(), id);
                answers.replies.push(reply);
                return id;
            }
        };
        for p in pairs {
            let a = match answers.of_text.get(&p.a) {
                Some(&id) => id,
                None => {
                    let id = new_reply(&mut answers);
                    answers.of_text.insert(p.a.clone(), id);
                    id
                }
            };
            if !answers.of_text.contains_key(&p.b) {
                let id = if p.same { a } else { new_reply(&mut answers) };
                answers.of_text.insert(p.b.clone(), id);
            }
        }
        answers
    }

    /// The backend's rules, longest text first: a rule fires when its text occurs in the
    /// prompt, and only the prompt itself can be the longest text occurring in it.
    fn rules(&self) -> Vec<(String, String)> {
        let mut rules: Vec<(String, String)> = self
            .of_text
            .iter()
            .map(|(text, &id)| (text.clone(), self.replies[id].clone()))
            .collect();
        rules.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        rules
    }

    /// Whether the answer `reply` (a wrong hit's) is that of a question whose text shares at
    /// least [`NEAR_DUPLICATE`] of its words with `pair`'s own A: the same question, or the
    /// same passage, in another pair, which the protocol gives another reply.
    fn near_duplicate(&self, pair: &Pair, reply: &str) -> bool {
        let Some(served) = self.by_reply.get(reply) else {
            return false;
        };
        // The pair's own A (a hit on a pair labelled different) is the plain false hit.
        if self.of_text.get(&pair.a) == Some(served) {
            return false;
        }
        let own = words(&pair.a);
        self.of_text
            .iter()
            .filter(|(_, id)| *id == served)
            .any(|(text, _)| jaccard(&own, &words(text)) >= NEAR_DUPLICATE)
    }

    /// Whether a hit serving `reply` to the B of `pair` is correct: the answer of its own A,
    /// in a pair labelled the same.
    fn correct(&self, pair: &Pair, reply: &str) -> bool {
        let served = self.by_reply.get(reply);
        pair.same && served.is_some() && served == self.of_text.get(&pair.a)
    }
}

/// The share of words (Jaccard, lower-cased) from which two texts count as near-duplicates.
const NEAR_DUPLICATE: f64 = 0.7;

/// The lower-cased words of `text`.
fn words(text: &str) -> HashSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Words in both over words in either.
fn jaccard(a: &HashSet<String>, b: &HashSet<String>) -> f64 {
    let union = a.union(b).count();
    match union {
        0 => 1.0,
        n => a.intersection(b).count() as f64 / n as f64,
    }
}

/// Exact share sampling: every n-th of a `share` (the server samples near misses alike).
struct Sampler {
    seen: u64,
    share: f64,
}

impl Sampler {
    fn next(&mut self) -> bool {
        let n = self.seen as f64;
        self.seen += 1;
        ((n + 1.0) * self.share).floor() > (n * self.share).floor()
    }
}

/// What the B of one pair got.
#[derive(Debug, Clone, Copy)]
struct Record {
    /// Its position in the stream.
    pos: usize,
    /// Whether its pair is labelled the same.
    same: bool,
    /// For a semantic hit: the similarity it was served at and whether it was correct.
    hit: Option<(f32, bool)>,
    /// A wrong hit that served a near-duplicate of the pair's own A ([`NEAR_DUPLICATE`]).
    near_duplicate: bool,
    /// Whether it was an exact hit (its text was stored already).
    exact: bool,
}

/// Counts over some of a side's records.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Tally {
    true_pairs: usize,
    served: usize,
    wrong: usize,
    true_hits: usize,
}

impl Tally {
    /// The records' semantic hits found at `min_similarity` or more.
    fn of<'a>(records: impl IntoIterator<Item = &'a Record>, min_similarity: f32) -> Tally {
        let mut t = Tally::default();
        for r in records {
            t.true_pairs += usize::from(r.same);
            if let Some((_, correct)) = r.hit.filter(|(sim, _)| *sim >= min_similarity) {
                t.served += 1;
                t.wrong += usize::from(!correct);
                t.true_hits += usize::from(correct);
            }
        }
        t
    }

    fn wrong_share(&self) -> f64 {
        share(self.wrong, self.served)
    }

    fn hit_rate(&self) -> f64 {
        share(self.true_hits, self.true_pairs)
    }
}

fn share(a: usize, b: usize) -> f64 {
    if b == 0 {
        f64::NAN
    } else {
        a as f64 / b as f64
    }
}

/// The static threshold with the most true hits among those whose wrong share is at most
/// `wrong_share` (`curve`: tallies by threshold).
fn best_static(curve: &[(f32, Tally)], wrong_share: f64) -> Option<(f32, Tally)> {
    curve
        .iter()
        .filter(|(_, t)| t.served > 0 && t.wrong_share() <= wrong_share + 1e-12)
        .max_by(|a, b| a.1.true_hits.cmp(&b.1.true_hits).then(b.0.total_cmp(&a.0)))
        .copied()
}

/// One side: a policy on its own server.
struct Side {
    label: String,
    delta: f64,
    threshold: f32,
}

/// What one side measured.
struct Measured {
    records: Vec<Record>,
    /// The threshold served at after each quarter of the stream (delta > 0).
    quarters: Vec<Learned>,
    feedback_right: usize,
    feedback_wrong: usize,
    /// Verdicts the server took from its near-miss checks: right, wrong.
    near_misses: (f64, f64),
    /// Verdicts the server took from its checks of hits (`semantic.verify_hits`): right, wrong.
    checked: (f64, f64),
    /// Verdicts each entry with any holds of its own (thresholds per entry).
    entry_verdicts: Vec<f64>,
}

/// The verdicts of `source` (`near_miss`, `verified`) the process has counted so far (right,
/// wrong). The metrics recorder is one per process: a side's own are the difference over its
/// run.
async fn verdicts_of(server: &Server, source: &str) -> (f64, f64) {
    let text = server.metrics_text().await;
    let count = |verdict: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with("reprise_semantic_verdicts_total{"))
            .filter(|l| {
                l.contains(&format!("source=\"{source}\""))
                    && l.contains(&format!("verdict=\"{verdict}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (count("right"), count("wrong"))
}

/// One answer of the server.
struct Reply {
    outcome: String,
    similarity: Option<f32>,
    id: String,
    content: String,
}

/// Asks `text` as a chat completion, with `cache_control` when given.
async fn ask(server: &Server, text: &str, cache_control: Option<&str>) -> anyhow::Result<Reply> {
    let body =
        json!({"model": "fake", "max_tokens": 64, "messages": [{"role": "user", "content": text}]});
    let mut req = server.client.post(server.chat_url()).json(&body);
    if let Some(cc) = cache_control {
        req = req.header("cache-control", cc);
    }
    let r = req.send().await?;
    let header = |name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let outcome = header(CACHE_HEADER).unwrap_or_default();
    let similarity = header(SIMILARITY_HEADER).and_then(|s| s.parse().ok());
    let status = r.status();
    let body: Value = r.json().await?;
    anyhow::ensure!(status.is_success(), "{status}: {body}");
    let s = |p: &str| {
        body.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    Ok(Reply {
        outcome,
        similarity,
        id: s("/id"),
        content: s("/choices/0/message/content"),
    })
}

/// Sends the stream `order` through a fresh server under `side`'s policy.
async fn run_side(
    side: &Side,
    base: &Config,
    embedder: &Arc<dyn Embedder>,
    pairs: &[Pair],
    answers: &Answers,
    order: &[(usize, Turn)],
    feedback_share: f64,
) -> anyhow::Result<Measured> {
    let mut config = base.clone();
    config.semantic.delta = side.delta;
    config.semantic.threshold = side.threshold;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig {
        rules: answers.rules(),
        ..ScriptConfig::default()
    }));
    let server = start_app(config, backend, Some(embedder.clone())).await?;
    let mut sampler = Sampler {
        seen: 0,
        share: feedback_share,
    };
    let mut m = Measured {
        records: Vec::with_capacity(pairs.len()),
        quarters: Vec::new(),
        feedback_right: 0,
        feedback_wrong: 0,
        near_misses: (0.0, 0.0),
        checked: (0.0, 0.0),
        entry_verdicts: Vec::new(),
    };
    let before = verdicts_of(&server, "near_miss").await;
    let checked_before = verdicts_of(&server, "verified").await;
    let quarter_ends: Vec<usize> = (1..=4).map(|q| q * order.len() / 4).collect();
    let tenth = order.len().div_ceil(10).max(1);
    for (pos, &(i, turn)) in order.iter().enumerate() {
        let pair = &pairs[i];
        match turn {
            Turn::A => {
                ask(&server, &pair.a, Some("no-cache")).await?;
            }
            Turn::B => {
                let reply = ask(&server, &pair.b, None).await?;
                let mut record = Record {
                    pos,
                    same: pair.same,
                    hit: None,
                    near_duplicate: false,
                    exact: reply.outcome == "exact",
                };
                if reply.outcome == "semantic" {
                    let correct = answers.correct(pair, &reply.content);
                    let similarity = reply
                        .similarity
                        .ok_or_else(|| anyhow::anyhow!("a semantic hit without its similarity"))?;
                    record.hit = Some((similarity, correct));
                    record.near_duplicate =
                        !correct && answers.near_duplicate(pair, &reply.content);
                    if sampler.next() {
                        let verdict = if correct { "right" } else { "wrong" };
                        let body = json!({"id": reply.id, "verdict": verdict});
                        let r = server.post("/v1/feedback", &body).await;
                        anyhow::ensure!(r.status().is_success(), "feedback: {}", r.status());
                        if correct {
                            m.feedback_right += 1;
                        } else {
                            m.feedback_wrong += 1;
                        }
                    }
                }
                m.records.push(record);
            }
        }
        let done = pos + 1;
        if side.delta > 0.0 && quarter_ends.contains(&done) && m.quarters.len() < 4 {
            m.quarters
                .push(learned_threshold(&server.state, side.delta));
        }
        if done % tenth == 0 {
            let t = Tally::of(&m.records, 0.0);
            let threshold = if side.delta > 0.0 {
                learned_threshold(&server.state, side.delta).threshold
            } else {
                side.threshold
            };
            eprintln!(
                "  {}: {done}/{} asks, {} semantic hits, {:.1} % wrong, threshold {threshold:.2}",
                side.label,
                order.len(),
                t.served,
                100.0 * t.wrong_share(),
            );
        }
    }
    // Near misses still being checked count towards the final threshold.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    if let Some(last) = m.quarters.last_mut() {
        *last = learned_threshold(&server.state, side.delta);
    }
    let after = verdicts_of(&server, "near_miss").await;
    m.near_misses = (after.0 - before.0, after.1 - before.1);
    let after = verdicts_of(&server, "verified").await;
    m.checked = (after.0 - checked_before.0, after.1 - checked_before.1);
    m.entry_verdicts = server.state.bounds.entry_verdicts();
    Ok(m)
}

/// The largest similarity between two different replies among the first [`REPLIES_CHECKED`].
async fn largest_reply_similarity(
    embedder: &Arc<dyn Embedder>,
    answers: &Answers,
) -> anyhow::Result<f32> {
    let texts: Vec<String> = answers
        .replies
        .iter()
        .take(REPLIES_CHECKED)
        .cloned()
        .collect();
    let v = embedder.embed_many(&texts).await?;
    let mut largest = f32::MIN;
    for i in 0..v.len() {
        for j in i + 1..v.len() {
            largest = largest.max(reprise_embedder::cosine(&v[i], &v[j]));
        }
    }
    Ok(largest)
}

fn pct(x: f64) -> String {
    if x.is_nan() {
        "–".into()
    } else {
        format!("{:.1} %", 100.0 * x)
    }
}

fn ratio(a: usize, b: usize) -> String {
    if b == 0 {
        "–".into()
    } else {
        format!("{:.2}×", a as f64 / b as f64)
    }
}

/// Runs `quality --online`.
pub async fn run(a: QualityArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.pairwise,
        "--online measures the cache view; drop --pairwise"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&a.feedback_share),
        "--feedback-share must be in [0, 1]"
    );
    let mut config = Config::load(a.config.as_deref())?;
    config.semantic.enabled = true;
    config.cache.enabled = true;
    config.backend.kind = BackendKind::Fake;
    let embedder = load_embedder(&config)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the semantic tier has no embedder"))?;
    let configured = config.semantic.threshold;
    let floor = config.semantic.min_threshold;
    let mut sides = vec![Side {
        label: format!("static {configured:.2}"),
        delta: 0.0,
        threshold: configured,
    }];
    for &delta in &a.deltas {
        anyhow::ensure!(delta > 0.0 && delta < 0.5, "--deltas must be in (0, 0.5)");
        sides.push(Side {
            label: format!("δ {} %", (delta * 1000.0).round() / 10.0),
            delta,
            threshold: configured,
        });
    }
    sides.push(Side {
        label: format!("static {floor:.2} (curve)"),
        delta: 0.0,
        threshold: floor,
    });

    for path in &a.pairs {
        let mut pairs = load_pairs(path)?;
        pairs.retain(|p| !p.a.trim().is_empty() && !p.b.trim().is_empty());
        if a.limit > 0 {
            pairs.truncate(a.limit);
        }
        let order = stream(pairs.len(), a.seed);
        let answers = Answers::new(&pairs, a.seed);
        let true_pairs = pairs.iter().filter(|p| p.same).count();
        println!(
            "== reprise bench quality --online: {} ({} pairs, {true_pairs} labelled the same; seed {}, feedback on {} of semantic hits) ==",
            path.display(),
            pairs.len(),
            a.seed,
            pct(a.feedback_share),
        );
        println!(
            "semantic: threshold {configured:.2}, min_threshold {floor:.2}, gate {}, top_k {}, verify_near_misses {}, verify_hits {}, answer_threshold {:.2}",
            if config.semantic.gate { "on" } else { "off" },
            config.semantic.top_k,
            config.semantic.verify_near_misses,
            config.semantic.verify_hits,
            config.semantic.answer_threshold,
        );
        let largest = largest_reply_similarity(&embedder, &answers).await?;
        println!(
            "scripted replies: {} distinct; largest similarity between two different ones (first {}): {largest:.2}",
            answers.replies.len(),
            answers.replies.len().min(REPLIES_CHECKED),
        );
        let mut measured = Vec::new();
        for side in &sides {
            eprintln!("side {} ({} asks)", side.label, order.len());
            measured.push(
                run_side(
                    side,
                    &config,
                    &embedder,
                    &pairs,
                    &answers,
                    &order,
                    a.feedback_share,
                )
                .await?,
            );
        }
        report(&sides, &measured, order.len(), floor);
    }
    Ok(())
}

/// Prints the tables: `sides` as run (the static policy first, the curve side last), over a
/// stream of `asks`.
fn report(sides: &[Side], measured: &[Measured], asks: usize, floor: f32) {
    let warmup = asks / 2;
    let learning = &sides[1..sides.len() - 1];
    let after = |m: &Measured| -> Vec<Record> {
        m.records
            .iter()
            .filter(|r| r.pos >= warmup)
            .copied()
            .collect()
    };
    let curve_records = after(measured.last().expect("the curve side"));
    let mut curve = Vec::new();
    let steps = ((1.0 - floor) / 0.01).round() as usize;
    for step in 0..=steps {
        let t = floor + 0.01 * step as f32;
        curve.push((t, Tally::of(&curve_records, t - 1e-4)));
    }
    let statik = Tally::of(&after(&measured[0]), 0.0);

    println!();
    println!("After a warm-up of the first half of the stream ({warmup} asks):");
    println!();
    println!("| side | semantic hits (all) | wrong (all) | semantic hits after warm-up | wrong after warm-up | true-pair hit rate after warm-up | true hits after warm-up | final threshold (verdicts ≥ it, upper bound) | × static | × best static at ≤ wrong share |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (side, m) in sides.iter().zip(measured).take(sides.len() - 1) {
        let all = Tally::of(&m.records, 0.0);
        let late = Tally::of(&after(m), 0.0);
        let threshold = match m.quarters.last() {
            Some(l) if side.delta > 0.0 => format!(
                "{:.2} ({:.0}, {})",
                l.threshold,
                l.verdicts,
                pct(l.wrong_upper)
            ),
            _ => format!("{:.2} (fixed)", side.threshold),
        };
        let best = best_static(&curve, late.wrong_share()).map_or("–".into(), |(t, b)| {
            format!(
                "{} (at {t:.2}: {} hits)",
                ratio(late.true_hits, b.true_hits),
                b.true_hits
            )
        });
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {threshold} | {} | {best} |",
            side.label,
            all.served,
            pct(all.wrong_share()),
            late.served,
            pct(late.wrong_share()),
            pct(late.hit_rate()),
            late.true_hits,
            ratio(late.true_hits, statik.true_hits),
        );
    }

    println!();
    println!(
        "Wrong hits after warm-up that served a near-duplicate of the question's own A (at \
         least {:.0} % of words shared: the same question or passage in another pair, given \
         another reply by the protocol):",
        100.0 * NEAR_DUPLICATE
    );
    println!();
    for (side, m) in sides.iter().zip(measured) {
        let wrong: Vec<Record> = after(m)
            .into_iter()
            .filter(|r| r.hit.is_some_and(|(_, correct)| !correct))
            .collect();
        let near = wrong.iter().filter(|r| r.near_duplicate).count();
        println!(
            "- {}: {near} of {} ({})",
            side.label,
            wrong.len(),
            pct(share(near, wrong.len()))
        );
    }

    println!();
    println!("By quarter of the stream (semantic hits, wrong among them, true-pair hit rate, threshold at the quarter's end):");
    println!();
    println!("| side | 1st | 2nd | 3rd | 4th | exact hits | feedback right / wrong | near misses checked right / wrong | hits checked right / wrong |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (side, m) in sides.iter().zip(measured) {
        let mut cells = Vec::new();
        for q in 0..4 {
            let (lo, hi) = (q * asks / 4, (q + 1) * asks / 4);
            let t = Tally::of(m.records.iter().filter(|r| r.pos >= lo && r.pos < hi), 0.0);
            let threshold = match m.quarters.get(q) {
                Some(l) if side.delta > 0.0 => l.threshold,
                _ => side.threshold,
            };
            cells.push(format!(
                "{}, {}, {}, {threshold:.2}",
                t.served,
                pct(t.wrong_share()),
                pct(t.hit_rate())
            ));
        }
        println!(
            "| {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} / {} |",
            side.label,
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            m.records.iter().filter(|r| r.exact).count(),
            m.feedback_right,
            m.feedback_wrong,
            m.near_misses.0,
            m.near_misses.1,
            m.checked.0,
            m.checked.1,
        );
    }

    println!();
    println!("Thresholds per entry (verdicts naming an entry, of every source):");
    println!();
    for (side, m) in sides.iter().zip(measured).filter(|(s, _)| s.delta > 0.0) {
        let v = &m.entry_verdicts;
        // What certifying a band takes with no wrong verdict in it (see the bound module).
        let needed = (10.8 / side.delta).ceil();
        println!(
            "- {}: {} entries with verdicts of their own, {} with 2 or more, at most {} on one; {} with the ≈ {needed} a band under the scope's threshold needs",
            side.label,
            v.len(),
            v.iter().filter(|&&n| n >= 2.0).count(),
            v.iter().copied().fold(0.0, f64::max),
            v.iter().filter(|&&n| n >= needed).count(),
        );
    }
    println!();
    println!("Static curve after warm-up (the curve side's hits at similarity ≥ t):");
    println!();
    println!("| t | semantic hits | wrong | true-pair hit rate | true hits |");
    println!("|---|---|---|---|---|");
    for (t, c) in curve.iter().step_by(2) {
        println!(
            "| {t:.2} | {} | {} | {} | {} |",
            c.served,
            pct(c.wrong_share()),
            pct(c.hit_rate()),
            c.true_hits
        );
    }

    println!();
    for (side, m) in learning.iter().zip(&measured[1..]) {
        let late = Tally::of(&after(m), 0.0);
        let gap = 100.0 * (late.wrong_share() - side.delta);
        let best = best_static(&curve, late.wrong_share());
        let r = best.map(|(_, b)| share(late.true_hits, b.true_hits));
        println!(
            "goal at {}: wrong after warm-up {} ({gap:+.1} points from δ: {}); true hits {} the best static threshold's at ≤ that wrong share ({})",
            side.label,
            pct(late.wrong_share()),
            if gap.abs() <= 1.0 { "within 1 point" } else { "not within 1 point" },
            r.map_or("–".into(), |r| format!("{r:.2}×")),
            if r.is_some_and(|r| r >= 1.3) { "≥ 1.3×" } else { "not ≥ 1.3×" },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(a: &str, b: &str, same: bool) -> Pair {
        Pair {
            a: a.into(),
            b: b.into(),
            same,
            category: String::new(),
        }
    }

    #[test]
    fn the_stream_asks_every_a_before_its_b() {
        let order = stream(50, 7);
        assert_eq!(order.len(), 100);
        for i in 0..50 {
            let at: Vec<_> = order
                .iter()
                .filter(|(p, _)| *p == i)
                .map(|(_, t)| *t)
                .collect();
            assert_eq!(at, [Turn::A, Turn::B]);
        }
        assert_eq!(order, stream(50, 7), "one seed, one order");
        assert_ne!(order, stream(50, 8));
        // Interleaved, not all A's first.
        let first_b = order.iter().position(|(_, t)| *t == Turn::B).unwrap();
        assert!(first_b < 50);
    }

    #[test]
    fn a_hit_is_correct_only_with_its_own_a_in_a_pair_labelled_the_same() {
        let pairs = [
            pair(
                "how do I reset my password",
                "how can I reset my password",
                true,
            ),
            pair(
                "is the shop open on sunday",
                "is the shop closed on sunday",
                false,
            ),
            pair(
                "what is the capital of france",
                "which city is france's capital",
                true,
            ),
        ];
        let answers = Answers::new(&pairs, 1);
        let reply = |t: &str| answers.replies[answers.of_text[t]].clone();
        assert_eq!(
            reply(&pairs[0].a),
            reply(&pairs[0].b),
            "duplicates share a reply"
        );
        assert_ne!(reply(&pairs[1].a), reply(&pairs[1].b));
        assert_eq!(answers.replies.len(), 4);
        assert!(answers.correct(&pairs[0], &reply(&pairs[0].a)));
        assert!(
            !answers.correct(&pairs[1], &reply(&pairs[1].a)),
            "labelled different"
        );
        assert!(
            !answers.correct(&pairs[0], &reply(&pairs[2].a)),
            "another pair's entry"
        );
        assert!(!answers.correct(&pairs[0], "not a scripted reply"));
        // The backend's rules give every text its reply, the longest text first.
        let rules = answers.rules();
        assert_eq!(rules.len(), 6);
        assert!(rules.windows(2).all(|w| w[0].0.len() >= w[1].0.len()));
    }

    /// A wrong hit is told apart when it served another pair's copy of the same passage.
    #[test]
    fn wrong_hits_on_a_near_duplicate_of_the_own_question_are_told_apart() {
        let pairs = [
            pair(
                "Set the seed to make the shuffle of the dataset reproducible.",
                "A fixed seed makes the dataset shuffle reproducible.",
                true,
            ),
            pair(
                "Set the seed to make the shuffle of your dataset reproducible.",
                "Fixing the seed gives a reproducible dataset shuffle.",
                true,
            ),
            pair(
                "Streaming reads a dataset without downloading it.",
                "A streamed dataset is read without a download.",
                true,
            ),
        ];
        let answers = Answers::new(&pairs, 1);
        let reply = |t: &str| answers.replies[answers.of_text[t]].clone();
        assert!(!answers.correct(&pairs[0], &reply(&pairs[1].a)));
        assert!(answers.near_duplicate(&pairs[0], &reply(&pairs[1].a)));
        assert!(!answers.near_duplicate(&pairs[0], &reply(&pairs[2].a)));
        assert!(!answers.near_duplicate(&pairs[0], "not a scripted reply"));
        // A hit on its own A, in a pair labelled different, is no near-duplicate.
        let apart = pair(&pairs[0].a, "Shuffle the dataset without a seed.", false);
        let answers = Answers::new(std::slice::from_ref(&apart), 1);
        let own = answers.replies[answers.of_text[&apart.a]].clone();
        assert!(!answers.correct(&apart, &own));
        assert!(!answers.near_duplicate(&apart, &own));
    }

    #[test]
    fn feedback_goes_to_an_exact_share_of_hits() {
        let mut s = Sampler {
            seen: 0,
            share: 0.1,
        };
        let picked: Vec<usize> = (0..100).filter(|_| s.next()).collect();
        assert_eq!(picked.len(), 10);
        assert_eq!(picked[0], 9);
    }

    #[test]
    fn the_best_static_threshold_keeps_to_the_wrong_share() {
        let t = |served, wrong, true_hits| Tally {
            true_pairs: 100,
            served,
            wrong,
            true_hits,
        };
        let curve = [
            (0.80, t(100, 20, 80)),
            (0.85, t(60, 6, 54)),
            (0.90, t(30, 1, 29)),
            (0.95, t(0, 0, 0)),
        ];
        assert_eq!(best_static(&curve, 0.10).map(|c| c.0), Some(0.85));
        assert_eq!(best_static(&curve, 0.05).map(|c| c.0), Some(0.90));
        assert_eq!(best_static(&curve, 0.0), None);
    }
}
