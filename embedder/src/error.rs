//! Errors of the embedder crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running an embedder.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The ONNX Runtime shared library is not where the configuration says.
    #[error("ONNX Runtime library not found at {}", path.display())]
    RuntimeMissing {
        /// The configured path.
        path: PathBuf,
    },
    /// The ONNX Runtime library exists but could not be loaded (wrong file, wrong version).
    #[error("could not load ONNX Runtime from {}: {message}", path.display())]
    RuntimeLoad {
        /// The configured path.
        path: PathBuf,
        /// What the loader said.
        message: String,
    },
    /// A file the model needs is missing or unreadable.
    #[error("model file {} is missing or unreadable: {message}", path.display())]
    ModelFile {
        /// The file that could not be read.
        path: PathBuf,
        /// What the file system said.
        message: String,
    },
    /// The model files were read but the model could not be built from them.
    #[error("could not load the embedding model from {}: {message}", path.display())]
    ModelLoad {
        /// The model folder.
        path: PathBuf,
        /// What fastembed or ONNX Runtime said.
        message: String,
    },
    /// The configuration is unusable (for example `max_batch = 0`).
    #[error("invalid embedder configuration: {0}")]
    Config(String),
    /// Running the model failed.
    #[error("embedding failed: {0}")]
    Inference(String),
    /// The queue of texts waiting for the model stayed full for the configured wait
    /// (`queue_texts`, `queue_bytes`, `queue_wait_ms`): the caller should retry later.
    #[error("the embedder is overloaded; retry in {retry_after_secs} s")]
    Overloaded {
        /// Seconds a caller should wait before retrying.
        retry_after_secs: u64,
    },
    /// The batching thread is gone (it panicked or the embedder is shutting down).
    #[error("the embedding worker has stopped")]
    Closed,
}

impl EmbedError {
    /// A short, fixed label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            EmbedError::RuntimeMissing { .. } => "runtime_missing",
            EmbedError::RuntimeLoad { .. } => "runtime_load",
            EmbedError::ModelFile { .. } => "model_file",
            EmbedError::ModelLoad { .. } => "model_load",
            EmbedError::Config(_) => "config",
            EmbedError::Inference(_) => "inference",
            EmbedError::Overloaded { .. } => "overloaded",
            EmbedError::Closed => "closed",
        }
    }
}
