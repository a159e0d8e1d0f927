//! The local embedder: all-MiniLM-L6-v2 on ONNX Runtime (through fastembed), with
//! micro-batching by length, a bounded queue and an LRU of recent texts bounded by bytes.
//!
//! Request path: `embed` looks the text up in the LRU; on a miss it takes room in the bounded
//! queue (waiting at most `queue_wait_ms`, else [`EmbedError::Overloaded`]), hands the text to
//! the batching thread and awaits a oneshot reply. The batching thread takes the queued texts
//! as one round (waiting up to `batch_wait_us` for a full call), sorts them by token length and
//! runs the model on groups of similar lengths within `batch_tokens` (see `batch.rs`), then
//! answers every waiter. While a round runs, new texts queue up and form the next round, so N
//! concurrent callers cost a few model calls, none padded far beyond its own texts.
//!
//! The model reads at most `max_tokens` tokens of a text; [`Embedder::window`] tells where
//! that ends (see `window.rs`), on the caller's thread: it only tokenizes a bounded start.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use fastembed::{
    InitOptionsUserDefined, Pooling, TextEmbedding, TokenizerFiles, UserDefinedEmbeddingModel,
};
use tokio::sync::{oneshot, Semaphore};

use crate::batch::{Counters, Job, Limits, Room, Worker};
use crate::memory::CallMemory;
use crate::window::Window;
use crate::{EmbedError, Embedder, EmbedderConfig};

/// Counters of the local embedder, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmbedderStats {
    /// Model calls run.
    pub batches: u64,
    /// Rounds of queued texts taken together, each run as one or more model calls (one per
    /// group of similar lengths).
    pub rounds: u64,
    /// Texts that went through the model.
    pub texts_embedded: u64,
    /// Tokens of those texts (special tokens included, as far as the model reads).
    pub tokens: u64,
    /// Tokens the model computed for them, padding included (texts × longest, per call).
    pub padded_tokens: u64,
    /// Requests answered by the LRU without touching the model.
    pub cache_hits: u64,
    /// Requests that missed the LRU.
    pub cache_misses: u64,
    /// Requests refused because the queue stayed full ([`EmbedError::Overloaded`]).
    pub refused: u64,
}

/// The caller's end of a reply.
type Pending = oneshot::Receiver<Result<Arc<[f32]>, EmbedError>>;

/// Recent vectors by (scope, text).
type TextCache = moka::sync::Cache<(String, String), Arc<[f32]>>;

/// What one cache entry weighs besides its texts and vector: the key's two `String` headers,
/// the `Arc` and its counts, and moka's own bookkeeping per item (280–340 bytes measured
/// with a counting allocator for the memory tier's caches, plus malloc's headers: `reprise_cache::ITEM_OVERHEAD`).
const ENTRY_OVERHEAD_BYTES: usize = 400 + 2 * std::mem::size_of::<String>() + 16;

/// The weight of one cache entry, in bytes.
fn entry_bytes(key: &(String, String), vector: &Arc<[f32]>) -> u32 {
    let bytes = key.0.len() + key.1.len() + std::mem::size_of_val::<[f32]>(vector);
    u32::try_from(bytes + ENTRY_OVERHEAD_BYTES).unwrap_or(u32::MAX)
}

/// Room in the queue of texts waiting for the model: texts, and bytes of text.
struct Queue {
    texts: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    /// The half of `texts` and of `bytes` that work nobody waits on may hold at once
    /// ([`Embedder::embed_many_spare`]): taken besides the queue room, so such work leaves
    /// clients half the queue however many callers ask at once.
    spare_texts: Arc<Semaphore>,
    spare_bytes: Arc<Semaphore>,
    /// Permits of `texts`.
    texts_total: usize,
    /// Permits of `bytes` (what one text takes at most).
    bytes_total: usize,
    wait: Duration,
}

impl Queue {
    /// Whether at least half of the queue (texts and bytes) is free.
    fn half_free(&self) -> bool {
        self.texts.available_permits() * 2 >= self.texts_total
            && self.bytes.available_permits() * 2 >= self.bytes_total
    }
}

/// all-MiniLM-L6-v2 (384 dimensions) run locally, with micro-batching and an LRU.
///
/// Cheap to share behind an `Arc`; dropping the last handle stops the batching thread once
/// the queued texts are answered.
pub struct FastEmbedder {
    jobs: mpsc::Sender<Job>,
    queue: Queue,
    /// Recent vectors by (scope, text): a scope never reuses another scope's entries.
    cache: Option<TextCache>,
    counters: Arc<Counters>,
    dim: usize,
    /// Where the model stops reading a text.
    window: Window,
    /// Digest of the model files and the settings that change a vector.
    fingerprint: [u8; 32],
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
        // The model's special tokens ([CLS] and [SEP]) are among the tokens it reads: at
        // fewer than three it reads nothing of a text.
        if cfg.max_tokens < 3 {
            return Err(EmbedError::Config("max_tokens must be at least 3".into()));
        }
        if cfg.batch_tokens == 0 {
            return Err(EmbedError::Config("batch_tokens must be at least 1".into()));
        }
        if cfg.queue_texts == 0 || cfg.queue_bytes == 0 {
            return Err(EmbedError::Config(
                "queue_texts and queue_bytes must be at least 1".into(),
            ));
        }
        let started = Instant::now();
        load_runtime(&cfg.onnx_runtime)?;
        // The working-memory budget must hold one text of the longest length (it runs alone
        // whatever the budget): checked before the model is loaded.
        let memory = CallMemory::of(&read_file(&cfg.model_dir, "config.json")?).map_err(|e| {
            EmbedError::ModelFile {
                path: cfg.model_dir.join("config.json"),
                message: e,
            }
        })?;
        let one = memory.per_text(cfg.max_tokens);
        if u64::try_from(one).map_or(true, |one| one > cfg.memory_bytes) {
            return Err(EmbedError::Config(format!(
                "the embedder's working memory (`semantic.embedder_memory_bytes`) must hold one \
                 text of {} tokens: at least {one} bytes for this model",
                cfg.max_tokens
            )));
        }
        let (mut model, fingerprint) = load_model(&cfg)?;

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
        if window.tokens() == 0 {
            return Err(EmbedError::Config(format!(
                "max_tokens ({}) leaves no token of a text to read beside the model's own",
                cfg.max_tokens
            )));
        }
        let counters = Arc::new(Counters::default());
        let (jobs, queue) = mpsc::channel();
        let worker = Worker {
            lengths: Worker::length_tokenizer(&model),
            model,
            queue,
            limits: Limits {
                max_batch: cfg.max_batch,
                batch_tokens: cfg.batch_tokens,
                memory_bytes: usize::try_from(cfg.memory_bytes).unwrap_or(usize::MAX),
                memory,
            },
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

        let cache = (cfg.cache_bytes > 0).then(|| {
            // Least recently used goes first: a text is most often embedded again soon
            // (a retry, a feedback verdict re-embedding its question), and moka's default
            // (frequency-based admission) would turn a new text away from a full cache.
            moka::sync::Cache::builder()
                .weigher(entry_bytes)
                .max_capacity(cfg.cache_bytes)
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .build()
        });
        let (texts_total, bytes_total) = (
            cfg.queue_texts.min(Semaphore::MAX_PERMITS),
            cfg.queue_bytes.min(Semaphore::MAX_PERMITS),
        );
        let queue = Queue {
            texts: Arc::new(Semaphore::new(texts_total)),
            bytes: Arc::new(Semaphore::new(bytes_total)),
            spare_texts: Arc::new(Semaphore::new(texts_total / 2)),
            spare_bytes: Arc::new(Semaphore::new(bytes_total / 2)),
            bytes_total,
            texts_total,
            wait: Duration::from_millis(cfg.queue_wait_ms),
        };
        tracing::info!(
            model_dir = %cfg.model_dir.display(),
            dim,
            max_tokens = cfg.max_tokens,
            memory_bytes = cfg.memory_bytes,
            window_tokens = window.tokens(),
            threads = cfg.threads,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "embedding model loaded"
        );
        Ok(FastEmbedder {
            jobs,
            queue,
            cache,
            counters,
            dim,
            window,
            fingerprint,
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
        let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
        EmbedderStats {
            batches: load(&c.batches),
            rounds: load(&c.rounds),
            texts_embedded: load(&c.texts_embedded),
            tokens: load(&c.tokens),
            padded_tokens: load(&c.padded_tokens),
            cache_hits: load(&c.cache_hits),
            cache_misses: load(&c.cache_misses),
            refused: load(&c.refused),
        }
    }

    /// Texts in the queue now (waiting for, or in, a round).
    pub fn queued(&self) -> usize {
        self.queue.texts_total - self.queue.texts.available_permits()
    }

    /// Entries and weighed bytes held by the text cache, once its pending evictions have run.
    pub fn cache_usage(&self) -> (u64, u64) {
        match &self.cache {
            Some(cache) => {
                cache.run_pending_tasks();
                (cache.entry_count(), cache.weighted_size())
            }
            None => (0, 0),
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

    /// Queues a text for the batching thread once the queue has room for it (waiting until
    /// `deadline` at most: a caller's texts share one wait of `queue_wait_ms`); the receiver
    /// yields its vector. `spare`: work nobody waits on, which also takes room in the
    /// spare half of the queue, without waiting.
    async fn submit(
        &self,
        text: &str,
        deadline: tokio::time::Instant,
        spare: bool,
    ) -> Result<Pending, EmbedError> {
        let q = &self.queue;
        let text = crate::window::model_start(text);
        // A text longer than the whole byte budget takes all of it (and waits for an empty
        // queue) rather than never fitting.
        let bytes = u32::try_from(text.len().clamp(1, q.bytes_total)).unwrap_or(u32::MAX);
        let spare = match spare {
            false => None,
            true => {
                let texts = Arc::clone(&q.spare_texts).try_acquire_owned();
                let half = u32::try_from(q.bytes_total / 2).unwrap_or(u32::MAX);
                let bytes = Arc::clone(&q.spare_bytes).try_acquire_many_owned(bytes.min(half));
                match (texts, bytes) {
                    (Ok(t), Ok(b)) => Some((t, b)),
                    _ => {
                        self.counters.refused.fetch_add(1, Ordering::Relaxed);
                        return Err(EmbedError::Overloaded {
                            retry_after_secs: 1,
                        });
                    }
                }
            }
        };
        let room = async {
            let texts = Arc::clone(&q.texts).acquire_owned().await;
            let bytes = Arc::clone(&q.bytes).acquire_many_owned(bytes).await;
            (texts, bytes)
        };
        let (texts, bytes) = match tokio::time::timeout_at(deadline, room).await {
            Ok((Ok(texts), Ok(bytes))) => (texts, bytes),
            // The semaphores are never closed.
            Ok(_) => return Err(EmbedError::Closed),
            Err(_) => {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                return Err(EmbedError::Overloaded {
                    retry_after_secs: 1,
                });
            }
        };
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Job {
                text: text.to_owned(),
                reply,
                room: Room {
                    _texts: texts,
                    _bytes: bytes,
                    _spare: spare,
                },
            })
            .map_err(|_| EmbedError::Closed)?;
        Ok(rx)
    }

    /// Embeds `texts`, every miss submitted before any is awaited (so they can share
    /// batches), waiting for queue room until `deadline` at most (`spare`: see
    /// [`FastEmbedder::submit`]). Refused midway, the texts already queued are dropped with
    /// their receivers, and the batching thread skips them.
    async fn embed_many_by(
        &self,
        scope: &str,
        texts: &[String],
        deadline: tokio::time::Instant,
        spare: bool,
    ) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        let mut pending = Vec::with_capacity(texts.len());
        for text in texts {
            match self.cached(scope, text) {
                Some(v) => pending.push(Ok(v)),
                None => pending.push(Err(self.submit(text, deadline, spare).await?)),
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
        let rx = self
            .submit(text, tokio::time::Instant::now() + self.queue.wait, false)
            .await?;
        let v = rx.await.map_err(|_| EmbedError::Closed)??;
        self.remember(scope, text, &v);
        Ok(v)
    }

    async fn embed_many_in(
        &self,
        scope: &str,
        texts: &[String],
    ) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        let deadline = tokio::time::Instant::now() + self.queue.wait;
        self.embed_many_by(scope, texts, deadline, false).await
    }

    async fn embed_many_spare(
        &self,
        scope: &str,
        texts: &[String],
    ) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        // Only a busy queue asks whether every text is cached (each probe copies its key).
        let all_cached = || {
            self.cache.as_ref().is_some_and(|c| {
                texts
                    .iter()
                    .all(|t| c.contains_key(&(scope.to_owned(), t.to_owned())))
            })
        };
        if !self.queue.half_free() && !all_cached() {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            return Err(EmbedError::Overloaded {
                retry_after_secs: 1,
            });
        }
        self.embed_many_by(scope, texts, tokio::time::Instant::now(), true)
            .await
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Tokenizes at most the first 16 KiB of `text` (see `window.rs`): CPU work that grows
    /// with the text up to that bound, for the caller to keep off its async workers.
    fn reading(&self, text: &str) -> crate::Reading {
        self.window.read(text)
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

/// The model, and its fingerprint: a digest of every file it was built from, the pooling and
/// the truncation.
fn load_model(cfg: &EmbedderConfig) -> Result<(TextEmbedding, [u8; 32]), EmbedError> {
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
    let mut h = blake3::Hasher::new_derive_key("reprise embedder fingerprint v1");
    for bytes in [
        &tokenizer_files.tokenizer_file,
        &tokenizer_files.config_file,
        &tokenizer_files.special_tokens_map_file,
        &tokenizer_files.tokenizer_config_file,
        &onnx,
    ] {
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.update(b"mean");
    h.update(&(cfg.max_tokens as u64).to_le_bytes());
    let fingerprint = *h.finalize().as_bytes();
    let model = UserDefinedEmbeddingModel::new(onnx, tokenizer_files).with_pooling(Pooling::Mean);
    // fastembed replaces the tokenizer's own padding and truncation (the shipped
    // tokenizer.json pads every input to 128) with batch-longest padding and truncation at
    // `max_length`, so a lone short text is not padded at all.
    let options = InitOptionsUserDefined::new()
        .with_max_length(cfg.max_tokens)
        .with_intra_threads(cfg.threads.max(1));
    let model = TextEmbedding::try_new_from_user_defined(model, options).map_err(|e| {
        EmbedError::ModelLoad {
            path: dir.clone(),
            message: e.to_string(),
        }
    })?;
    Ok((model, fingerprint))
}
