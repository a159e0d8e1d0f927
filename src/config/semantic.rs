//! `[semantic]`: the semantic tier (near-duplicates by meaning): thresholds, the gate, the
//! embedder and its queue, learned thresholds and checks, conversations (standalone
//! questions, context equivalence, follow-ups).

use std::path::PathBuf;

use reprise_cache::semantic::IndexConfig;
use serde::Deserialize;

use super::{invalid, ConfigError};

/// `[semantic]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SemanticConfig {
    /// Serve near-duplicates of earlier prompts.
    pub enabled: bool,
    /// Lowest cosine similarity a candidate needs to be served.
    pub threshold: f32,
    /// Candidates fetched from the index per lookup; the best one passing the gate is served.
    pub top_k: usize,
    /// Run the false-hit gate (negation, numbers, entities, direction, antonyms) before
    /// serving a candidate.
    pub gate: bool,
    /// Directory with the ONNX sentence-embedding model and its tokenizer files.
    pub model_dir: PathBuf,
    /// Path of the ONNX Runtime shared library.
    pub onnx_runtime: PathBuf,
    /// With the gate on: when a candidate differs from the prompt by a few substituted content
    /// words, the embedder compares those words, and a similarity below this rejects the
    /// candidate ("home" vs "car" insurance). 0 (the default) turns the check off: measured at
    /// 0.5 it cut fow-cache scope traps served from 13 % to 8 % but true hits from 52 % to 45 %
    /// (hf_docs 78 % to 51 %), since synonyms ("cancel"/"stop") are rejected too.
    pub substitution_threshold: f32,
    /// Match a conversation's last question across unrelated earlier conversations when it
    /// stands on its own: no word refers back (pronouns, "that", "the above", "again", a
    /// bare "the ..."), every earlier user message was a plain question (no statement or
    /// standing instruction), and it is unrelated in meaning to the last two exchanges
    /// (cosine below `standalone_max_related`). Such a question is stored and looked up as if
    /// asked with the system prompt alone. Off: only within its own context. Per rule:
    /// `standalone`.
    pub standalone: bool,
    /// The highest cosine similarity between a standalone-looking question and any message
    /// of the last two exchanges for it to count as unrelated to them.
    pub standalone_max_related: f32,
    /// Treat conversations whose system prompts and earlier messages (user and assistant)
    /// differ only by a paraphrase as one context: each such message (at most 2 KiB, read
    /// whole by the embedder) stands for the first one seen in its namespace and model that
    /// it paraphrases at `context_threshold` or more and passes the false-hit gate with.
    /// Off: contexts match exactly. Per rule: `context_equivalence`.
    pub context_equivalence: bool,
    /// Lowest cosine similarity served for a follow-up (a last message that refers back,
    /// matched only within its own or an equivalent context); at most `threshold`, which it
    /// is when absent (the default). Per rule: `followup_threshold`. Measured on the
    /// development cases: 0.80 serves twice the differently worded transforms of the same
    /// content, but the traps (as pairs) it would let through rise from 2.8 % to 6.9 %.
    pub followup_threshold: Option<f32>,
    /// The lowest cosine similarity at which two context messages are the same.
    pub context_threshold: f32,
    /// Bytes of canonical context messages kept per replica (text and embedding of each; 0
    /// keeps none, so nothing is found equivalent).
    pub context_forms_bytes: u64,
    /// Overrides per namespace and/or model (`[[semantic.rules]]`, first match wins):
    /// `namespace`, `model` select; `enabled`, `threshold`, `top_k`, `gate`, `standalone`,
    /// `context_equivalence`, `followup_threshold` override.
    pub rules: Vec<reprise_policies::semantic::Rule>,
    /// Longest the embedder waits to fill a batch, in microseconds. 0 (the default) batches
    /// naturally: prompts that arrive while the model runs form the next batch, and a lone
    /// prompt never waits.
    pub batch_wait_us: u64,
    /// Most prompts embedded in one batch.
    pub max_batch: usize,
    /// Most tokens one embedding batch computes, padding included (prompts × the longest):
    /// queued prompts are sorted by length and cut into batches within it, so a short prompt
    /// is not padded to a long one.
    pub embedder_batch_tokens: usize,
    /// Most bytes of ONNX Runtime working memory one embedding batch may take, estimated from
    /// the model's shape (about 40 MB per prompt of 256 tokens with all-MiniLM-L6-v2, growing
    /// with the square of the length): long prompts are embedded fewer at a time. The runtime
    /// keeps its largest batch's working memory, so this bounds what the embedder adds to
    /// the resident memory beyond the model. Must hold one prompt of 256 tokens.
    pub embedder_memory_bytes: u64,
    /// Bytes of prompt embeddings kept in the embedder's LRU (each entry weighed as its text,
    /// its vector and a fixed overhead; 0 turns it off).
    pub embedding_cache_bytes: u64,
    /// Most prompts waiting for the embedder.
    pub embedder_queue_texts: usize,
    /// Most bytes of prompts waiting for the embedder.
    pub embedder_queue_bytes: usize,
    /// How long a request waits for room in a full embedder queue, in milliseconds; then it
    /// is answered 429 with `Retry-After` (when the semantic tier had to be read to answer).
    pub embedder_queue_wait_ms: u64,
    /// ONNX Runtime threads per embedding batch. 2 measured best on 2 cores (semantic-hit
    /// p50 3.6 ms vs 5.8 ms with 1, and higher throughput at every concurrency).
    pub embedder_threads: usize,
    /// Seconds between index maintenance passes (rebuilding partitions full of tombstones).
    pub maintain_interval_secs: u64,
    /// The largest share of semantic hits that may be wrong (0: off). With it, the threshold
    /// is learned from verdicts (feedback, and near misses checked against the answer the
    /// backend then gave): the lowest one at which the wrong share is at most `delta` with
    /// 95 % confidence; with little evidence the configured threshold (raised where verdicts
    /// show it too loose). A tenant's `policy.delta` overrides it.
    pub delta: f64,
    /// The lowest threshold `delta` may learn.
    pub min_threshold: f32,
    /// The share of misses whose best candidate was under the threshold (but above
    /// `min_threshold`) that are checked: once the backend answered, the candidate's answer
    /// is judged against the new one by embedding similarity (no extra backend call).
    pub verify_near_misses: f64,
    /// Answers at least this similar are judged the same answer.
    pub answer_threshold: f32,
    /// The share of semantic hits checked in the background: the backend answers the
    /// question afresh (at background priority, on a spare slot within
    /// `prefetch.max_capacity_share`, or only while no client request is running where the
    /// backend does not tell its capacity; one at a time, within `verify_tokens_per_minute`;
    /// a check that does not fit is skipped, never queued) and a judge decides whether the
    /// cached answer serves it.
    pub verify_hits: f64,
    /// The judge: `similarity` (the two answers' embeddings, `answer_threshold`) or `prompt`
    /// (the backend is asked whether the cached answer serves the question as well as its
    /// fresh one; meant for capable upstream models).
    pub verify_judge: VerifyJudge,
    /// Tokens per minute the checks of hits may ask the backend for.
    pub verify_tokens_per_minute: u32,
    /// With Redis: seconds between publishing this replica's verdicts and reading the other
    /// replicas' (a threshold under `delta` is learned from all of them); 0: each replica
    /// learns from its own verdicts alone.
    pub evidence_sync_secs: u64,
    /// Bytes of verdicts kept per entry (under `delta`, an entry with verdicts of its own
    /// learns its own threshold from them; the least recently judged go first).
    pub entry_evidence_bytes: u64,
    /// `[semantic.index]`: the index of prompt vectors (exact scans, HNSW graphs).
    pub index: IndexConfig,
}

/// How a checked hit is judged (`semantic.verify_judge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum VerifyJudge {
    /// The embedding similarity of the cached and the fresh answer.
    #[default]
    Similarity,
    /// A judge prompt to the backend.
    Prompt,
}

impl Default for SemanticConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            threshold: 0.86,
            top_k: 4,
            gate: true,
            model_dir: PathBuf::from("models/all-MiniLM-L6-v2"),
            onnx_runtime: PathBuf::from("models/libonnxruntime.so"),
            rules: Vec::new(),
            substitution_threshold: 0.0,
            standalone: true,
            standalone_max_related: 0.25,
            context_equivalence: true,
            followup_threshold: None,
            context_threshold: 0.80,
            context_forms_bytes: 8 << 20,
            batch_wait_us: 0,
            max_batch: 32,
            embedder_batch_tokens: 4096,
            embedder_memory_bytes: 128 << 20,
            embedding_cache_bytes: 16 * 1024 * 1024,
            embedder_queue_texts: 256,
            embedder_queue_bytes: 4 * 1024 * 1024,
            embedder_queue_wait_ms: 500,
            embedder_threads: 2,
            maintain_interval_secs: 60,
            delta: 0.0,
            min_threshold: 0.7,
            verify_near_misses: 0.25,
            answer_threshold: 0.9,
            verify_hits: 0.0,
            verify_judge: VerifyJudge::Similarity,
            verify_tokens_per_minute: 20_000,
            evidence_sync_secs: 10,
            entry_evidence_bytes: 4 << 20,
            index: IndexConfig::default(),
        }
    }
}

impl SemanticConfig {
    /// Every `semantic.*` value in its range.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let sem = self;
        if !(0.0..0.5).contains(&sem.delta) {
            return Err(invalid("semantic.delta", "must be in [0, 0.5)"));
        }
        if !(sem.min_threshold > 0.0 && sem.min_threshold <= 1.0) {
            return Err(invalid("semantic.min_threshold", "must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&sem.verify_near_misses) {
            return Err(invalid("semantic.verify_near_misses", "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&sem.verify_hits) {
            return Err(invalid("semantic.verify_hits", "must be in [0, 1]"));
        }
        if sem.verify_hits > 0.0 && sem.verify_tokens_per_minute == 0 {
            return Err(invalid(
                "semantic.verify_tokens_per_minute",
                "must be positive when semantic.verify_hits is",
            ));
        }
        if !(0.0..=1.0).contains(&sem.substitution_threshold) {
            return Err(invalid(
                "semantic.substitution_threshold",
                "must be in [0, 1] (0: off)",
            ));
        }
        if !(sem.answer_threshold > 0.0 && sem.answer_threshold <= 1.0) {
            return Err(invalid("semantic.answer_threshold", "must be in (0, 1]"));
        }
        if sem
            .followup_threshold
            .is_some_and(|f| !(f > 0.0 && f <= 1.0))
        {
            return Err(invalid("semantic.followup_threshold", "must be in (0, 1]"));
        }
        if !(sem.context_threshold > 0.0 && sem.context_threshold <= 1.0) {
            return Err(invalid("semantic.context_threshold", "must be in (0, 1]"));
        }
        if !(-1.0..=1.0).contains(&sem.standalone_max_related) {
            return Err(invalid(
                "semantic.standalone_max_related",
                "must be in [-1, 1]",
            ));
        }
        let t = self.threshold;
        if t.is_nan() || t <= 0.0 || t > 1.0 {
            return Err(invalid("semantic.threshold", "must be in (0, 1]"));
        }
        super::check_rules(&self.rules, "semantic.rules", None)?;
        if self.max_batch == 0 {
            return Err(invalid("semantic.max_batch", "must be at least 1"));
        }
        if self.embedder_batch_tokens == 0 {
            return Err(invalid(
                "semantic.embedder_batch_tokens",
                "must be at least 1",
            ));
        }
        if self.embedder_memory_bytes == 0 {
            return Err(invalid(
                "semantic.embedder_memory_bytes",
                "must be at least 1",
            ));
        }
        if self.embedder_queue_texts == 0 {
            return Err(invalid(
                "semantic.embedder_queue_texts",
                "must be at least 1",
            ));
        }
        if self.embedder_queue_bytes == 0 {
            return Err(invalid(
                "semantic.embedder_queue_bytes",
                "must be at least 1",
            ));
        }
        if let Err((_, reason)) = reprise_policies::semantic::check_top_k(self.top_k) {
            return Err(invalid("semantic.top_k", reason));
        }
        check_index(&self.index)
    }
}

/// `[semantic.index]` within bounds: a scan's or a search's cost per lookup, a graph's links
/// per point (its memory) and a build's work stay bounded.
fn check_index(ix: &IndexConfig) -> Result<(), ConfigError> {
    let ranges = [
        (
            "semantic.index.exact_scan_max",
            ix.exact_scan_max,
            0,
            100_000,
        ),
        // The memory budget charges a graph's links as measured up to 32 links a point.
        ("semantic.index.hnsw_m", ix.hnsw_m, 2, 32),
        (
            "semantic.index.ef_construction",
            ix.ef_construction,
            1,
            2_048,
        ),
        ("semantic.index.ef_search", ix.ef_search, 1, 4_096),
        ("semantic.index.ef_search_max", ix.ef_search_max, 1, 4_096),
        (
            "semantic.index.recall_check_every",
            ix.recall_check_every as usize,
            0,
            1_000_000,
        ),
    ];
    for (key, value, lo, hi) in ranges {
        if !(lo..=hi).contains(&value) {
            return Err(invalid(key, format!("must be in [{lo}, {hi}]")));
        }
    }
    // Past 0.9 tombstones would outgrow what the memory budget charges for them (and a
    // search asks for ever more to find live ones); under 0.05 a large partition would be
    // rebuilt for every few removals.
    let r = ix.rebuild_tombstone_ratio;
    if !(0.05..=0.9).contains(&r) {
        return Err(invalid(
            "semantic.index.rebuild_tombstone_ratio",
            "must be in [0.05, 0.9]",
        ));
    }
    if ix.ef_search_max < ix.ef_search {
        return Err(invalid(
            "semantic.index.ef_search_max",
            "must be at least semantic.index.ef_search",
        ));
    }
    if !(0.0..=1.0).contains(&ix.recall_target) {
        return Err(invalid(
            "semantic.index.recall_target",
            "must be between 0 and 1 (0: never widen)",
        ));
    }
    Ok(())
}
