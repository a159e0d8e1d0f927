//! Labelled pairs: the files `reprise tune --pairs` and `reprise-bench quality` read, and
//! their measurement with the configured embedder and the false-hit gate, as the request path
//! would see side B asked while side A is stored.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use reprise_embedder::Embedder;
use serde_json::Value;

use super::curve::PairSample;
use crate::cpu::CpuPool;
use crate::lookup::semantic::{meanings_apart, vet};

/// One labelled pair.
#[derive(Debug, Clone)]
pub struct Pair {
    /// Stored side.
    pub a: String,
    /// Asked side.
    pub b: String,
    /// Whether one answer serves both.
    pub same: bool,
    /// Trap category, when the file has one.
    pub category: String,
}

/// Reads any of the supported pair formats: a JSON list of `{origin, similar}` (all the same
/// answer), or JSON lines of `{text_a, text_b, label}` (label 1: the same) or
/// `{a, b, same_answer, category}`.
pub fn load_pairs(path: &Path) -> anyhow::Result<Vec<Pair>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let rows: Vec<Value> = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(v)) => v,
        _ => text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
    };
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    rows.iter()
        .map(|r| {
            if let (Some(a), Some(b)) = (s(r, "origin"), s(r, "similar")) {
                return Ok(Pair {
                    a,
                    b,
                    same: true,
                    category: "paraphrase".into(),
                });
            }
            if let (Some(a), Some(b)) = (s(r, "text_a"), s(r, "text_b")) {
                let same = r.get("label").and_then(Value::as_i64) == Some(1);
                return Ok(Pair {
                    a,
                    b,
                    same,
                    category: if same { "duplicate" } else { "different" }.into(),
                });
            }
            if let (Some(a), Some(b)) = (s(r, "a"), s(r, "b")) {
                let same = r
                    .get("same_answer")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                return Ok(Pair {
                    a,
                    b,
                    same,
                    category: s(r, "category").unwrap_or_default(),
                });
            }
            anyhow::bail!("unrecognised pair row in {}: {r}", path.display())
        })
        .collect()
}

/// Pairs embedded per round: small enough for the embedder's queue (its callers are refused
/// past `semantic.embedder_queue_texts`), large enough to fill its batches.
const ROUND_PAIRS: usize = 32;

/// Progress is reported every this many pairs.
const PROGRESS_EVERY: usize = 500;

/// Measures every pair as the request path would judge B asked while A is stored: both
/// embedded as the server embeds a question (what the embedder reads of it), their cosine
/// similarity, and the gate's verdict on A for B (the substitution check included when
/// `substitution_threshold` is above 0), run on a CPU pool as the request path runs it.
/// `progress(done, total)` is called after the round that passes each multiple of 500 pairs,
/// and at the end.
pub async fn measure(
    embedder: Arc<dyn Embedder>,
    substitution_threshold: f32,
    pairs: &[Pair],
    mut progress: impl FnMut(usize, usize),
) -> anyhow::Result<Vec<PairSample>> {
    let cpu = Arc::new(CpuPool::per_core());
    let mut vectors: HashMap<String, Arc<[f32]>> = HashMap::new();
    let mut out = Vec::with_capacity(pairs.len());
    for (round, chunk) in pairs.chunks(ROUND_PAIRS).enumerate() {
        // What the embedder reads of each side (tokenizing: CPU work, on the pool).
        let (reader, sides) = (embedder.clone(), chunk.to_vec());
        let read: Vec<(String, String)> = cpu
            .run(move || {
                sides
                    .iter()
                    .map(|p| {
                        (
                            reader.split(&p.a).0.to_owned(),
                            reader.split(&p.b).0.to_owned(),
                        )
                    })
                    .collect()
            })
            .await;
        let mut missing: Vec<String> = read
            .iter()
            .flat_map(|(a, b)| [a, b])
            .filter(|t| !vectors.contains_key(*t))
            .cloned()
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let embedded = embedder
            .embed_many(&missing)
            .await
            .map_err(|e| anyhow::anyhow!("embedding failed: {e}"))?;
        vectors.extend(missing.into_iter().zip(embedded));

        let jobs = read.into_iter().map(|(a, b)| {
            let cpu = cpu.clone();
            async move {
                let (query, candidate) = (reprise_policies::gate::capped(&b).to_owned(), a.clone());
                let verdict = cpu
                    .run(move || vet(&query, &candidate, substitution_threshold > 0.0))
                    .await;
                (a, b, verdict)
            }
        });
        for (a, b, (verdict, swapped)) in futures::future::join_all(jobs).await {
            let mut gate = verdict.is_pass();
            if let Some(words) = swapped {
                gate = !meanings_apart(embedder.as_ref(), "", substitution_threshold, words).await;
            }
            out.push((vectors[&a].clone(), vectors[&b].clone(), gate));
        }
        let done = (round * ROUND_PAIRS + chunk.len()).min(pairs.len());
        if done / PROGRESS_EVERY > (done - chunk.len()) / PROGRESS_EVERY || done == pairs.len() {
            progress(done, pairs.len());
        }
    }
    Ok(out
        .into_iter()
        .zip(pairs)
        .map(|((va, vb, gate), p)| PairSample {
            similarity: reprise_embedder::cosine(&va, &vb),
            gate,
            same: p.same,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_pair_format() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("list.json");
        std::fs::write(&list, r#"[{"origin": "a1", "similar": "b1"}]"#).unwrap();
        let lines = dir.path().join("lines.jsonl");
        std::fs::write(
            &lines,
            "{\"text_a\": \"a2\", \"text_b\": \"b2\", \"label\": 0}\n\n\
             {\"a\": \"a3\", \"b\": \"b3\", \"same_answer\": true, \"category\": \"negation\"}\n",
        )
        .unwrap();
        let p = load_pairs(&list).unwrap();
        assert_eq!(
            (p[0].a.as_str(), p[0].b.as_str(), p[0].same),
            ("a1", "b1", true)
        );
        let p = load_pairs(&lines).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].same, p[0].category.as_str()), (false, "different"));
        assert_eq!((p[1].same, p[1].category.as_str()), (true, "negation"));
        std::fs::write(&lines, "{\"q\": 1}\n").unwrap();
        assert!(load_pairs(&lines).is_err());
    }

    #[tokio::test]
    async fn measures_similarity_and_gate() {
        let embedder: Arc<dyn Embedder> = Arc::new(reprise_embedder::FakeEmbedder::new(64));
        let pair = |a: &str, b: &str, same| Pair {
            a: a.into(),
            b: b.into(),
            same,
            category: String::new(),
        };
        let pairs = [
            pair(
                "how do I reset my password",
                "how do I reset my password",
                true,
            ),
            pair(
                "is the shop open on sunday",
                "is the shop not open on sunday",
                false,
            ),
        ];
        let mut calls = Vec::new();
        let s = measure(embedder, 0.0, &pairs, |d, t| calls.push((d, t)))
            .await
            .unwrap();
        assert!((s[0].similarity - 1.0).abs() < 1e-5 && s[0].gate && s[0].same);
        // A negation: similar words, refused by the gate.
        assert!(s[1].similarity > 0.5 && !s[1].gate && !s[1].same);
        assert_eq!(calls, [(2, 2)]);
    }
}
