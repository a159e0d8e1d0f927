//! The bare llama.cpp baseline of `reprise-bench llama`: a plain single-sequence greedy decode
//! loop over the same model, context and threads as the backend, without the engine, queue or
//! channels.
//!
//! [`BareDecoder`] keeps its model and context loaded across runs (one thread owns them), so
//! the baseline can be warmed up and measured as the backend is: loaded once, a warm-up run,
//! then measured runs. [`bare_decode_benchmark`] is one cold run (load, decode, unload).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;

use super::{context_params, load_model, LlamaConfig, LoadError};

/// Result of one bare decode run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BareStats {
    /// Prompt tokens decoded.
    pub prompt_tokens: u32,
    /// Tokens generated (fewer than asked if the model ended the text).
    pub generated_tokens: u32,
    /// Time to load the model and create the context (once per [`BareDecoder`]: the same
    /// value for each of its runs).
    pub load_time: Duration,
    /// Time from the start of the prefill to the first sampled token.
    pub time_to_first_token: Duration,
    /// Decode rate after the first token (0 when fewer than two tokens were generated).
    pub tokens_per_second: f64,
}

/// One run asked of the decoder thread, and where its result goes.
type RunRequest = (String, u32, mpsc::Sender<Result<BareStats, LoadError>>);

/// A bare decode loop whose model and context stay loaded between runs. Each run starts from
/// an empty KV cache, as a new request does in the backend. Runs are blocking and one at a
/// time; dropping the decoder unloads the model.
pub struct BareDecoder {
    path: std::path::PathBuf,
    requests: Option<mpsc::Sender<RunRequest>>,
    thread: Option<JoinHandle<()>>,
    load_time: Duration,
}

impl BareDecoder {
    /// Loads the model and one single-sequence context of `cfg` on a thread of its own.
    /// Blocking.
    pub fn load(cfg: &LlamaConfig) -> Result<BareDecoder, LoadError> {
        let (requests, inbox) = mpsc::channel::<RunRequest>();
        let (loaded_tx, loaded) = mpsc::channel::<Result<Duration, LoadError>>();
        let path = cfg.model.clone();
        let failed = |reason: String| LoadError::Runtime {
            path: path.clone(),
            reason,
        };
        let cfg = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("bare-decoder".into())
            .spawn(move || {
                let started = Instant::now();
                let (runtime, model, _) = match load_model(&cfg) {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = loaded_tx.send(Err(e));
                        return;
                    }
                };
                let mut ctx = match model.new_context(runtime, context_params(&cfg, 1)) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = loaded_tx.send(Err(runtime_error(
                            &cfg,
                            format!("cannot create a context: {e}"),
                        )));
                        return;
                    }
                };
                let load_time = started.elapsed();
                let _ = loaded_tx.send(Ok(load_time));
                while let Ok((prompt, n_tokens, reply)) = inbox.recv() {
                    ctx.clear_kv_cache();
                    let run = decode(&cfg, &model, &mut ctx, &prompt, n_tokens)
                        .map(|s| BareStats { load_time, ..s });
                    let _ = reply.send(run);
                }
            })
            .map_err(|e| failed(format!("cannot start the decoder thread: {e}")))?;
        let load_time = match loaded.recv() {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(failed("the decoder thread ended while loading".into()));
            }
        };
        Ok(BareDecoder {
            path,
            requests: Some(requests),
            thread: Some(thread),
            load_time,
        })
    }

    /// Time the model load and context creation took.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// Decodes `prompt` (raw, no chat template) and then up to `n_tokens` greedy tokens, from
    /// an empty KV cache. Blocking.
    pub fn run(&self, prompt: &str, n_tokens: u32) -> Result<BareStats, LoadError> {
        let gone = || LoadError::Runtime {
            path: self.path.clone(),
            reason: "the decoder thread ended".into(),
        };
        let (reply, result) = mpsc::channel();
        self.requests
            .as_ref()
            .ok_or_else(gone)?
            .send((prompt.to_string(), n_tokens, reply))
            .map_err(|_| gone())?;
        result.recv().map_err(|_| gone())?
    }
}

impl Drop for BareDecoder {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop; it unloads the model as it returns.
        self.requests.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn runtime_error(cfg: &LlamaConfig, reason: String) -> LoadError {
    LoadError::Runtime {
        path: cfg.model.clone(),
        reason,
    }
}

/// Runs `prompt` (raw, no chat template) through a plain single-sequence greedy decode loop
/// with the same model, context and threads as `cfg`, loaded for this one run (cold: no
/// warm-up). Blocking. [`BareDecoder`] keeps the model loaded between runs.
pub fn bare_decode_benchmark(
    cfg: &LlamaConfig,
    prompt: &str,
    n_tokens: u32,
) -> Result<BareStats, LoadError> {
    BareDecoder::load(cfg)?.run(prompt, n_tokens)
}

/// One greedy decode of `prompt` plus up to `n_tokens` tokens in `ctx`, whose KV cache is
/// empty.
fn decode(
    cfg: &LlamaConfig,
    model: &LlamaModel,
    ctx: &mut LlamaContext<'_>,
    prompt: &str,
    n_tokens: u32,
) -> Result<BareStats, LoadError> {
    let failure = |reason: String| runtime_error(cfg, reason);
    let vocab = model.vocab();
    let tokens = vocab.tokenize(prompt.as_bytes(), true, true);
    if tokens.is_empty() || tokens.len() as u32 + n_tokens > ctx.n_ctx() {
        return Err(failure(format!(
            "prompt of {} tokens plus {n_tokens} generated does not fit the context of {}",
            tokens.len(),
            ctx.n_ctx()
        )));
    }
    let n_batch = ctx.n_batch() as usize;
    let mut batch = LlamaBatch::new(n_batch.max(1), 1);
    let mut sampler = LlamaSampler::greedy();

    let prefill_start = Instant::now();
    for (chunk_no, chunk) in tokens.chunks(n_batch).enumerate() {
        batch.clear();
        let base = chunk_no * n_batch;
        for (i, &token) in chunk.iter().enumerate() {
            let pos = base + i;
            batch
                .add(token, pos as i32, &[0], pos + 1 == tokens.len())
                .map_err(|e| failure(e.to_string()))?;
        }
        ctx.decode(&mut batch).map_err(|e| failure(e.to_string()))?;
    }
    let mut idx = batch.n_tokens() - 1;
    let mut pos = tokens.len() as i32;
    let mut generated = 0u32;
    let mut first = None;
    let mut last = prefill_start;
    while generated < n_tokens {
        let token = sampler.sample(ctx, idx);
        let now = Instant::now();
        first.get_or_insert(now);
        last = now;
        if vocab.is_eog(token) {
            break;
        }
        generated += 1;
        if generated == n_tokens {
            break;
        }
        batch.clear();
        batch
            .add(token, pos, &[0], true)
            .map_err(|e| failure(e.to_string()))?;
        ctx.decode(&mut batch).map_err(|e| failure(e.to_string()))?;
        pos += 1;
        idx = 0;
    }
    let first = first.unwrap_or(last);
    let decode_secs = last.duration_since(first).as_secs_f64();
    Ok(BareStats {
        prompt_tokens: tokens.len() as u32,
        generated_tokens: generated,
        load_time: Duration::ZERO,
        time_to_first_token: first.duration_since(prefill_start),
        tokens_per_second: if generated > 1 && decode_secs > 0.0 {
            f64::from(generated - 1) / decode_secs
        } else {
            0.0
        },
    })
}
