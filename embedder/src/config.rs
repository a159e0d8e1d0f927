//! Configuration of the local embedder.

use std::path::PathBuf;

use serde::Deserialize;

/// Where the embedding model and ONNX Runtime live, and how requests are batched and cached.
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
    /// How long (microseconds) the batcher waits for more texts after the first one arrives
    /// before running the model. Adds at most this much latency to a lone request. The
    /// default 0 batches naturally: texts that arrive while the model runs form the next batch.
    pub batch_wait_us: u64,
    /// Entries of the text → vector LRU in front of the model (0 disables it).
    pub cache_entries: u64,
    /// Longer inputs are truncated to this many tokens (the model was trained on 256).
    pub max_tokens: usize,
    /// ONNX Runtime intra-op threads for one model call.
    pub threads: usize,
}

impl Default for EmbedderConfig {
    fn default() -> Self {
        EmbedderConfig {
            model_dir: PathBuf::from("models/all-MiniLM-L6-v2"),
            onnx_runtime: PathBuf::from("models/libonnxruntime.so"),
            max_batch: 32,
            batch_wait_us: 0,
            cache_entries: 10_000,
            max_tokens: 256,
            threads: 1,
        }
    }
}
