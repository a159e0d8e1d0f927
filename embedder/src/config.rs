//! Configuration of the local embedder.

use std::path::PathBuf;

use serde::Deserialize;

/// Where the embedding model and ONNX Runtime live, and how requests are queued, batched and
/// cached.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EmbedderConfig {
    /// Folder holding `model.onnx`, `tokenizer.json`, `config.json`,
    /// `special_tokens_map.json` and `tokenizer_config.json`.
    pub model_dir: PathBuf,
    /// Path of the ONNX Runtime shared library (`libonnxruntime.so`, version >= 1.24).
    pub onnx_runtime: PathBuf,
    /// Most texts embedded in one model call.
    pub max_batch: usize,
    /// Most tokens one model call computes, padding included: every text of a call is padded
    /// to the longest of the call, so a call costs (texts × longest) tokens. Queued texts are
    /// sorted by length and cut into calls within this budget (a text longer than the budget
    /// runs alone), so a short text never pays for a long one.
    pub batch_tokens: usize,
    /// Most bytes of ONNX Runtime working memory one model call may take, as estimated from
    /// the model's shape (about 40 MB for a text of 256 tokens with all-MiniLM-L6-v2, growing
    /// with the square of the length): long texts are embedded fewer at a time. The runtime
    /// keeps the largest call's working memory for the life of the process, so this bounds
    /// what the embedder adds to the resident memory beyond the model. Must hold one text of
    /// `max_tokens`.
    pub memory_bytes: u64,
    /// How long (microseconds) the batcher waits for more texts after the first one arrives
    /// before running the model. Adds at most this much latency to a lone request. The
    /// default 0 batches naturally: texts that arrive while the model runs form the next batch.
    pub batch_wait_us: u64,
    /// Bytes of the text → vector LRU in front of the model, each entry weighed as its key
    /// (scope and text), its vector and a fixed overhead (0 disables it).
    pub cache_bytes: u64,
    /// Longer inputs are truncated to this many tokens (the model was trained on 256).
    pub max_tokens: usize,
    /// ONNX Runtime intra-op threads for one model call.
    pub threads: usize,
    /// Most texts waiting for the model (queued or being embedded).
    pub queue_texts: usize,
    /// Most bytes of text waiting for the model (a longer text counts as the whole queue).
    pub queue_bytes: usize,
    /// How long (milliseconds) a caller waits for room in a full queue before the embedder
    /// answers [`crate::EmbedError::Overloaded`] (0: at once).
    pub queue_wait_ms: u64,
}

impl Default for EmbedderConfig {
    fn default() -> Self {
        EmbedderConfig {
            model_dir: PathBuf::from("models/all-MiniLM-L6-v2"),
            onnx_runtime: PathBuf::from("models/libonnxruntime.so"),
            max_batch: 32,
            batch_tokens: 4096,
            memory_bytes: 128 << 20,
            batch_wait_us: 0,
            cache_bytes: 16 * 1024 * 1024,
            max_tokens: 256,
            threads: 1,
            queue_texts: 256,
            queue_bytes: 4 * 1024 * 1024,
            queue_wait_ms: 500,
        }
    }
}
