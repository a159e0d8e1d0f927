//! Shared helpers of the embedder tests: where the real model files are.

use std::path::PathBuf;

use reprise_embedder::EmbedderConfig;

/// The models folder: `REPRISE_MODELS_DIR`, else `models/` at the workspace root.
pub fn models_dir() -> PathBuf {
    std::env::var_os("REPRISE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models")))
}

/// The default configuration pointed at the real files.
pub fn config() -> EmbedderConfig {
    let dir = models_dir();
    EmbedderConfig {
        model_dir: dir.join("all-MiniLM-L6-v2"),
        onnx_runtime: dir.join("libonnxruntime.so"),
        ..EmbedderConfig::default()
    }
}
