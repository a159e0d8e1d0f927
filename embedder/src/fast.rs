//! The local embedder: all-MiniLM-L6-v2 on ONNX Runtime (through fastembed), with
//! micro-batching and an LRU of recent texts.
//!
//! Request path: `embed` looks the text up in the LRU; on a miss it hands the text to the
//! batching thread and awaits a oneshot reply. The batching thread takes the first queued
//! text, keeps collecting for up to `batch_wait_us` or until `max_batch` texts, runs the
//! model once for all of them and answers every waiter. While a batch runs, new texts queue
//! up and form the next batch, so N concurrent callers cost about one model call.
//!
//! The model reads at most `max_tokens` tokens of a text; [`Embedder::window`] tells where
//! that ends (see `window.rs`), on the caller's thread: it only tokenizes a bounded start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use fastembed::{
    InitOptionsUserDefined, Pooling, TextEmbedding, TokenizerFiles, UserDefinedEmbeddingModel,
};
use tokio::sync::oneshot;

use crate::window::Window;
use crate::{EmbedError, Embedder, EmbedderConfig};

/// Counters of the local embedder, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmbedderStats {
    /// Model calls run (one per batch).
    pub batches: u64,
    /// Texts that went through the model.
    pub texts_embedded: u64,
    /// Requests answered by the LRU without touching the model.
    pub cache_hits: u64,
    /// Requests that missed the LRU.
    pub cache_misses: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    texts_embedded: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
}

/// Where the batching thread sends one text's vector.
type Reply = oneshot::Sender<Result<Arc<[f32]>, EmbedError>>;

/// The caller's end of a [`Reply`].
type Pending = oneshot::Receiver<Result<Arc<[f32]>, EmbedError>>;

/// One text waiting for its vector.
struct Job {
    text: String,
    reply: Reply,
}

/// Recent vectors by (scope, text).
type TextCache = moka::sync::Cache<(String, String), Arc<[f32]>>;

/// all-MiniLM-L6-v2 (384 dimensions) run locally, with micro-batching and an LRU.
///
/// Cheap to share behind an `Arc`; dropping the last handle stops the batching thread once
/// the queued texts are answered.
pub struct FastEmbedder {
    jobs: mpsc::Sender<Job>,
    /// Recent vectors by (scope, text): a scope never reuses another scope's entries.
    cache: Option<TextCache>,
    counters: Arc<Counters>,
    dim: usize,
    /// Where the model stops reading a text.
    window: Window,
}

impl std::fmt::Debug for FastEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastEmbedder")
            .field("dim", &self.dim)
            .field("stats", &self.stats())
            .finish()
    }
}

impl FastEmbedder {
    /// Loads ONNX Runtime and the model, and starts the batching thread.
    ///
    /// Blocking (a few hundred milliseconds): call it at start-up or from a blocking task.
    /// Needs no async runtime. A missing library or model file is an error naming the path.
    pub fn load(cfg: EmbedderConfig) -> Result<FastEmbedder, EmbedError> {
        if cfg.max_batch == 0 {
            return Err(EmbedError::Config("max_batch must be at least 1".into()));
        }
        if cfg.max_tokens == 0 {
            return Err(EmbedError::Config("max_tokens must be at least 1".into()));
        }
        let started = Instant::now();
        load_runtime(&cfg.onnx_runtime)?;
        let mut model = load_model(&cfg)?;

        // One probe call tells the dimension and warms the session up, so the first real
        // request does not pay for ONNX Runtime's lazy initialisation.
        let probe = model
            .embed(["dimension probe"], None)
            .map_err(|e| EmbedError::ModelLoad {
                path: cfg.model_dir.clone(),
                message: e.to_string(),
            })?;
        let dim = probe.first().map_or(0, Vec::len);
        if dim == 0 {
            return Err(EmbedError::ModelLoad {
                path: cfg.model_dir.clone(),
                message: "the model returned an empty embedding".into(),
            });
        }

        let window = Window::of(&model, cfg.max_tokens);
        let counters = Arc::new(Counters::default());
        let (jobs, queue) = mpsc::channel();
        let worker = Worker {
            model,
            queue,
            max_batch: cfg.max_batch,
            wait: Duration::from_micros(cfg.batch_wait_us),
            counters: Arc::clone(&counters),
        };
        // A dedicated OS thread owns the model: ONNX Runtime calls block for milliseconds,
        // one session runs one batch at a time, and `TextEmbedding::embed` needs `&mut`.
        // Owning it on one thread needs no lock, no async runtime at load time, and keeps
        // the work off tokio's blocking pool (which other blocking tasks share).
        std::thread::Builder::new()
            .name("reprise-embedder".into())
            .spawn(move || worker.run())
            .map_err(|e| EmbedError::ModelLoad {
                path: cfg.model_dir.clone(),
                message: format!("could not start the embedding thread: {e}"),
            })?;

        let cache = (cfg.cache_entries > 0).then(|| {
            moka::sync::Cache::builder()
                .max_capacity(cfg.cache_entries)
                .build()
        });
        tracing::info!(
            model_dir = %cfg.model_dir.display(),
            dim,
            max_tokens = cfg.max_tokens,
            window_tokens = window.tokens(),
            threads = cfg.threads,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "embedding model loaded"
        );
        Ok(FastEmbedder {
            jobs,
            cache,
            counters,
            dim,
            window,
        })
    }

    /// How many tokens of a text's own the model reads (its maximum less the special tokens
    /// it adds): the rest of a text does not change its vector.
    pub fn max_tokens(&self) -> usize {
        self.window.tokens()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EmbedderStats {
        let c = &self.counters;
        EmbedderStats {
            batches: c.batches.load(Ordering::Relaxed),
            texts_embedded: c.texts_embedded.load(Ordering::Relaxed),
            cache_hits: c.cache_hits.load(Ordering::Relaxed),
            cache_misses: c.cache_misses.load(Ordering::Relaxed),
        }
    }

    fn cached(&self, scope: &str, text: &str) -> Option<Arc<[f32]>> {
        let hit = self
            .cache
            .as_ref()?
            .get(&(scope.to_owned(), text.to_owned()));
        let counter = if hit.is_some() {
            &self.counters.cache_hits
        } else {
            &self.counters.cache_misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Queues a text for the batching thread; the receiver yields its vector.
    fn submit(&self, text: &str) -> Result<Pending, EmbedError> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Job {
                text: text.to_owned(),
                reply,
            })
            .map_err(|_| EmbedError::Closed)?;
        Ok(rx)
    }

    fn remember(&self, scope: &str, text: &str, vector: &Arc<[f32]>) {
        if let Some(cache) = &self.cache {
            cache.insert((scope.to_owned(), text.to_owned()), Arc::clone(vector));
        }
    }
}

#[async_trait]
impl Embedder for FastEmbedder {
    async fn embed(&self, text: &str) -> Result<Arc<[f32]>, EmbedError> {
        self.embed_in("", text).await
    }

    async fn embed_many(&self, texts: &[String]) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        self.embed_many_in("", texts).await
    }

    async fn embed_in(&self, scope: &str, text: &str) -> Result<Arc<[f32]>, EmbedError> {
        if let Some(v) = self.cached(scope, text) {
            return Ok(v);
        }
        let rx = self.submit(text)?;
        let v = rx.await.map_err(|_| EmbedError::Closed)??;
        self.remember(scope, text, &v);
        Ok(v)
    }

    async fn embed_many_in(
        &self,
        scope: &str,
        texts: &[String],
    ) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        // Submit every miss before awaiting any, so they can share batches.
        let mut pending = Vec::with_capacity(texts.len());
        for text in texts {
            match self.cached(scope, text) {
                Some(v) => pending.push(Ok(v)),
                None => pending.push(Err(self.submit(text)?)),
            }
        }
        let mut out = Vec::with_capacity(texts.len());
        for (text, p) in texts.iter().zip(pending) {
            let v = match p {
                Ok(v) => v,
                Err(rx) => {
                    let v = rx.await.map_err(|_| EmbedError::Closed)??;
                    self.remember(scope, text, &v);
                    v
                }
            };
            out.push(v);
        }
        Ok(out)
    }

    fn dim(&self) -> usize {
        self.dim
    }

    /// Tokenizes at most the first 16 KiB of `text` (see `window.rs`): CPU work that grows
    /// with the text up to that bound, for the caller to keep off its async workers.
    fn window(&self, text: &str) -> usize {
        self.window.end(text)
    }
}

/// Loads the ONNX Runtime library once per process.
///
/// ort keeps the first library it loaded for the life of the process; later calls succeed
/// without loading anything.
fn load_runtime(path: &Path) -> Result<(), EmbedError> {
    // Checked first so the error names the configured path plainly; ort would also fail,
    // but with a dlopen message.
    if !path.is_file() {
        return Err(EmbedError::RuntimeMissing {
            path: path.to_path_buf(),
        });
    }
    // The returned builder would configure a global environment; fastembed's sessions use
    // ort's default one, so it is dropped unused.
    let _builder = ort::init_from(path).map_err(|e| EmbedError::RuntimeLoad {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(())
}

fn read_file(dir: &Path, name: &str) -> Result<Vec<u8>, EmbedError> {
    let path: PathBuf = dir.join(name);
    std::fs::read(&path).map_err(|e| EmbedError::ModelFile {
        path,
        message: e.to_string(),
    })
}

fn load_model(cfg: &EmbedderConfig) -> Result<TextEmbedding, EmbedError> {
    let dir = &cfg.model_dir;
    if !dir.is_dir() {
        return Err(EmbedError::ModelFile {
            path: dir.clone(),
            message: "no such directory".into(),
        });
    }
    let tokenizer_files = TokenizerFiles {
        tokenizer_file: read_file(dir, "tokenizer.json")?,
        config_file: read_file(dir, "config.json")?,
        special_tokens_map_file: read_file(dir, "special_tokens_map.json")?,
        tokenizer_config_file: read_file(dir, "tokenizer_config.json")?,
    };
    let onnx = read_file(dir, "model.onnx")?;
    let model = UserDefinedEmbeddingModel::new(onnx, tokenizer_files).with_pooling(Pooling::Mean);
    // fastembed replaces the tokenizer's own padding and truncation (the shipped
    // tokenizer.json pads every input to 128) with batch-longest padding and truncation at
    // `max_length`, so a lone short text is not padded at all.
    let options = InitOptionsUserDefined::new()
        .with_max_length(cfg.max_tokens)
        .with_intra_threads(cfg.threads.max(1));
    TextEmbedding::try_new_from_user_defined(model, options).map_err(|e| EmbedError::ModelLoad {
        path: dir.clone(),
        message: e.to_string(),
    })
}

/// The batching thread's state.
struct Worker {
    model: TextEmbedding,
    queue: mpsc::Receiver<Job>,
    max_batch: usize,
    wait: Duration,
    counters: Arc<Counters>,
}

impl Worker {
    fn run(mut self) {
        // `recv` fails once every sender is dropped: the embedder is gone.
        while let Ok(first) = self.queue.recv() {
            let mut batch = vec![first];
            let deadline = Instant::now() + self.wait;
            while batch.len() < self.max_batch {
                // Take whatever is already queued without waiting, then wait out the window.
                match self.queue.try_recv() {
                    Ok(job) => {
                        batch.push(job);
                        continue;
                    }
                    Err(mpsc::TryRecvError::Disconnected) => break,
                    Err(mpsc::TryRecvError::Empty) => {}
                }
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                match self.queue.recv_timeout(deadline - now) {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            self.run_batch(batch);
        }
        tracing::debug!("embedding thread stopped");
    }

    fn run_batch(&mut self, batch: Vec<Job>) {
        // Several callers may wait on the same text: embed it once.
        let mut unique: Vec<&str> = Vec::with_capacity(batch.len());
        let mut slot_of: HashMap<&str, usize> = HashMap::with_capacity(batch.len());
        let slots: Vec<usize> = batch
            .iter()
            .map(|job| {
                *slot_of.entry(job.text.as_str()).or_insert_with(|| {
                    unique.push(job.text.as_str());
                    unique.len() - 1
                })
            })
            .collect();
        let count = unique.len();
        let result = self.model.embed(&unique, Some(count));
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters
            .texts_embedded
            .fetch_add(count as u64, Ordering::Relaxed);
        let vectors: Result<Vec<Arc<[f32]>>, EmbedError> = match result {
            Ok(vectors) if vectors.len() == count => {
                Ok(vectors.into_iter().map(Arc::from).collect())
            }
            Ok(vectors) => Err(EmbedError::Inference(format!(
                "the model returned {} vectors for {count} texts",
                vectors.len()
            ))),
            Err(e) => {
                tracing::warn!(error = %e, texts = count, "embedding batch failed");
                Err(EmbedError::Inference(e.to_string()))
            }
        };
        for (job, slot) in batch.into_iter().zip(slots) {
            let answer = match &vectors {
                Ok(v) => Ok(Arc::clone(&v[slot])),
                Err(e) => Err(EmbedError::Inference(e.to_string())),
            };
            // The caller may have given up waiting; nothing to do then.
            let _ = job.reply.send(answer);
        }
    }
}
