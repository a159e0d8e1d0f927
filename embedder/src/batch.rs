//! The batching thread: takes the queued texts as one *round*, sorts them by token length and
//! embeds them in model calls of similar lengths within a token budget.
//!
//! ONNX Runtime pads every text of a call to the longest of the call, so a call costs about
//! (texts × longest) tokens of compute. A round of mixed lengths run as one call makes each
//! short text pay for the longest; sorted and cut into groups, each call pads only to the
//! longest of its group. Where to cut is chosen to minimise the round's estimated cost, a
//! fixed cost per call ([`CALL_COST_TOKENS`]) plus its padded tokens, under three limits: at
//! most `max_batch` texts, `batch_tokens` padded tokens and `memory_bytes` of estimated
//! working memory ([`CallMemory`]) per call (a single text over a limit runs alone; the
//! memory budget holds one text of the longest length, checked at load). Each waiter gets the vector of its own text whatever group it ran
//! in; several waiters on one text share one embedding.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use fastembed::TextEmbedding;
use tokenizers::Tokenizer;
use tokio::sync::{oneshot, OwnedSemaphorePermit};

use crate::memory::CallMemory;
use crate::window::SCAN_BYTES;
use crate::EmbedError;

/// The estimated fixed cost of one model call, in tokens of compute: splitting a group pays
/// off when it saves more padding than this.
pub(crate) const CALL_COST_TOKENS: usize = 32;

/// Where the batching thread sends one text's vector.
pub(crate) type Reply = oneshot::Sender<Result<Arc<[f32]>, EmbedError>>;

/// One text waiting for its vector, holding its place in the bounded queue until answered.
pub(crate) struct Job {
    pub(crate) text: String,
    pub(crate) reply: Reply,
    /// The queue room this text takes, given back once it is embedded.
    pub(crate) room: Room,
}

/// Room in the queue: one text and its bytes, and for work nobody waits on, the same in the
/// share of the queue such work may hold. Held for its drop, which gives the room back.
pub(crate) struct Room {
    pub(crate) _texts: OwnedSemaphorePermit,
    pub(crate) _bytes: OwnedSemaphorePermit,
    pub(crate) _spare: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
}

/// Counters shared by the embedder and its thread.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) batches: AtomicU64,
    pub(crate) rounds: AtomicU64,
    pub(crate) texts_embedded: AtomicU64,
    pub(crate) tokens: AtomicU64,
    pub(crate) padded_tokens: AtomicU64,
    pub(crate) cache_hits: AtomicU64,
    pub(crate) cache_misses: AtomicU64,
    pub(crate) refused: AtomicU64,
}

/// The batching thread's state.
pub(crate) struct Worker {
    pub(crate) model: TextEmbedding,
    /// The model's tokenizer, truncating where the model does and never padding: how many
    /// tokens each text takes.
    pub(crate) lengths: Tokenizer,
    pub(crate) queue: mpsc::Receiver<Job>,
    pub(crate) limits: Limits,
    pub(crate) wait: Duration,
    pub(crate) counters: Arc<Counters>,
}

impl Worker {
    /// A tokenizer for [`Worker::lengths`]: `model`'s, without padding.
    pub(crate) fn length_tokenizer(model: &TextEmbedding) -> Tokenizer {
        let mut t = model.tokenizer.clone();
        t.with_padding(None);
        t
    }

    pub(crate) fn run(mut self) {
        // A round takes what is queued, up to a few model calls' worth, so sorting has
        // something to sort while no text waits behind more than a bounded round.
        let round_cap = self.limits.max_batch.saturating_mul(4);
        // `recv` fails once every sender is dropped: the embedder is gone.
        while let Ok(first) = self.queue.recv() {
            let mut round = vec![first];
            let deadline = Instant::now() + self.wait;
            while round.len() < round_cap {
                // Take whatever is already queued without waiting; wait out the window only
                // while the round is short of one full call.
                match self.queue.try_recv() {
                    Ok(job) => {
                        round.push(job);
                        continue;
                    }
                    Err(mpsc::TryRecvError::Disconnected) => break,
                    Err(mpsc::TryRecvError::Empty) => {}
                }
                let now = Instant::now();
                if now >= deadline || round.len() >= self.limits.max_batch {
                    break;
                }
                match self.queue.recv_timeout(deadline - now) {
                    Ok(job) => round.push(job),
                    Err(_) => break,
                }
            }
            self.run_round(round);
        }
        tracing::debug!("embedding thread stopped");
    }

    /// Tokens the model reads of `text`, its special tokens included. Only a bounded start
    /// is counted: a text longer than that counts as the longest the model reads (its start
    /// may hold few tokens, a run of whitespace say, while the model reads on to its
    /// truncation), as does a text the tokenizer refuses.
    fn length(&self, text: &str) -> usize {
        let longest = self
            .lengths
            .get_truncation()
            .map_or(self.limits.batch_tokens, |t| t.max_length)
            .max(1);
        if text.len() > SCAN_BYTES[1] {
            return longest;
        }
        match self.lengths.encode_fast(text, true) {
            Ok(e) => e.len().max(1),
            Err(_) => longest,
        }
    }

    fn run_round(&mut self, round: Vec<Job>) {
        // A caller that gave up waiting (its request ended, or a text of the same call was
        // refused) wants nothing: its text is not embedded, and its room is freed now.
        let round: Vec<Job> = round.into_iter().filter(|j| !j.reply.is_closed()).collect();
        if round.is_empty() {
            return;
        }
        self.counters.rounds.fetch_add(1, Ordering::Relaxed);
        // Several callers may wait on the same text: embed it once.
        let mut unique: Vec<String> = Vec::with_capacity(round.len());
        let mut waiting: Vec<Vec<Job>> = Vec::with_capacity(round.len());
        let mut slot_of: HashMap<String, usize> = HashMap::with_capacity(round.len());
        for mut job in round {
            let text = std::mem::take(&mut job.text);
            match slot_of.get(&text) {
                Some(&i) => waiting[i].push(job),
                None => {
                    slot_of.insert(text.clone(), unique.len());
                    unique.push(text);
                    waiting.push(vec![job]);
                }
            }
        }
        drop(slot_of);
        // Shortest first, so every group is a run of similar lengths.
        let mut order: Vec<(usize, usize)> = unique
            .iter()
            .enumerate()
            .map(|(i, t)| (self.length(t), i))
            .collect();
        order.sort_unstable();
        let lengths: Vec<usize> = order.iter().map(|&(len, _)| len).collect();
        let mut start = 0;
        for end in groups(&lengths, &self.limits) {
            let members = &order[start..end];
            // A round runs several calls: a group whose callers all gave up since it began
            // is not embedded.
            let wanted = members
                .iter()
                .any(|&(_, i)| waiting[i].iter().any(|j| !j.reply.is_closed()));
            if !wanted {
                for &(_, i) in members {
                    waiting[i].clear();
                }
                start = end;
                continue;
            }
            let texts: Vec<&str> = members.iter().map(|&(_, i)| unique[i].as_str()).collect();
            // A panic in the runtime or the tokenizer fails this call, not the thread: the
            // semantic tier would otherwise be gone until a restart.
            let lengths_of = &lengths[start..end];
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.embed(&texts, lengths_of)
            }))
            .unwrap_or_else(|_| Err("the embedding call panicked".into()));
            // Each group's callers are answered as soon as it ran: a short text does not
            // wait for the longer groups of its round, nor holds its queue room meanwhile.
            for (k, &(_, i)) in members.iter().enumerate() {
                for job in waiting[i].drain(..) {
                    let answer = match &result {
                        Ok(v) => Ok(Arc::clone(&v[k])),
                        Err(e) => Err(EmbedError::Inference(e.clone())),
                    };
                    answer_job(job, answer);
                }
            }
            start = end;
        }
        for job in waiting.into_iter().flatten() {
            answer_job(
                job,
                Err(EmbedError::Inference("text left out of every batch".into())),
            );
        }
    }

    /// One model call for `texts` (of `lengths` tokens).
    fn embed(&mut self, texts: &[&str], lengths: &[usize]) -> Result<Vec<Arc<[f32]>>, String> {
        let count = texts.len();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let c = &self.counters;
        c.batches.fetch_add(1, Ordering::Relaxed);
        c.texts_embedded.fetch_add(count as u64, Ordering::Relaxed);
        c.tokens
            .fetch_add(lengths.iter().sum::<usize>() as u64, Ordering::Relaxed);
        c.padded_tokens
            .fetch_add((count * longest) as u64, Ordering::Relaxed);
        match self.model.embed(texts, Some(count)) {
            Ok(vectors) if vectors.len() == count => {
                Ok(vectors.into_iter().map(Arc::from).collect())
            }
            Ok(vectors) => Err(format!(
                "the model returned {} vectors for {count} texts",
                vectors.len()
            )),
            Err(e) => {
                tracing::warn!(error = %e, texts = count, "embedding batch failed");
                Err(e.to_string())
            }
        }
    }
}

/// Answers one caller. Its room in the queue is freed first, for the next text, before the
/// caller hears of it (a caller that asks again at once must find the room; freed after the
/// answer, a descheduled worker thread held it while the request finished).
fn answer_job(job: Job, answer: Result<Arc<[f32]>, EmbedError>) {
    let Job { reply, room, .. } = job;
    drop(room);
    // The caller may have given up waiting; nothing to do then.
    let _ = reply.send(answer);
}

/// What one model call may hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Texts.
    pub(crate) max_batch: usize,
    /// Padded tokens (texts × longest).
    pub(crate) batch_tokens: usize,
    /// Estimated working memory, in bytes.
    pub(crate) memory_bytes: usize,
    /// The estimate.
    pub(crate) memory: CallMemory,
}

/// Where to cut `lengths` (sorted, shortest first) into model calls: the end of each group,
/// the last one `lengths.len()`. Minimises the sum over groups of [`CALL_COST_TOKENS`] plus
/// (size × longest), each group within `limits` (or a single text).
pub(crate) fn groups(lengths: &[usize], limits: &Limits) -> Vec<usize> {
    let n = lengths.len();
    // best[j]: the least cost of the first j texts, and where its last group starts.
    let mut best: Vec<(usize, usize)> = vec![(0, 0); n + 1];
    for j in 1..=n {
        let longest = lengths[j - 1];
        best[j] = (usize::MAX, j - 1);
        for i in (j.saturating_sub(limits.max_batch.max(1))..j).rev() {
            let size = j - i;
            let padded = size.saturating_mul(longest);
            let over = padded > limits.batch_tokens
                || limits.memory.call(size, longest) > limits.memory_bytes;
            if size > 1 && over {
                // Longer groups ending at j only pad more.
                break;
            }
            let cost = best[i].0.saturating_add(CALL_COST_TOKENS + padded);
            if cost < best[j].0 {
                best[j] = (cost, i);
            }
        }
    }
    let mut ends = Vec::new();
    let mut j = n;
    while j > 0 {
        ends.push(j);
        j = best[j].1;
    }
    ends.reverse();
    ends
}

#[cfg(test)]
mod tests {
    use super::{groups, Limits};
    use crate::memory::CallMemory;

    const MINILM: &[u8] = br#"{"hidden_size": 384, "num_attention_heads": 12}"#;

    /// The groups' sizes, with no memory bound.
    fn sizes(lengths: &[usize], max_batch: usize, budget: usize) -> Vec<usize> {
        within(lengths, max_batch, budget, usize::MAX)
    }

    /// The groups' sizes within `memory_bytes` of working memory per call.
    fn within(
        lengths: &[usize],
        max_batch: usize,
        budget: usize,
        memory_bytes: usize,
    ) -> Vec<usize> {
        let limits = Limits {
            max_batch,
            batch_tokens: budget,
            memory_bytes,
            memory: CallMemory::of(MINILM).unwrap(),
        };
        let mut start = 0;
        groups(lengths, &limits)
            .into_iter()
            .map(|end| {
                let size = end - start;
                start = end;
                size
            })
            .collect()
    }

    #[test]
    fn similar_lengths_share_one_call() {
        assert_eq!(sizes(&[10; 16], 32, 4096), vec![16]);
        assert_eq!(sizes(&[], 32, 4096), Vec::<usize>::new());
    }

    #[test]
    fn short_and_long_texts_are_split() {
        let mut lengths = vec![12; 8];
        lengths.extend([250; 8]);
        assert_eq!(sizes(&lengths, 32, 4096), vec![8, 8]);
    }

    #[test]
    fn limits_hold() {
        // 40 texts of 100 tokens: at most 32 per call, at most 1000 padded tokens per call.
        for s in sizes(&[100; 40], 32, 1000) {
            assert!(s <= 10, "{s}");
        }
        assert!(sizes(&[10; 40], 32, 100_000).iter().all(|&s| s <= 32));
        // A text longer than the budget runs alone.
        assert_eq!(sizes(&[5, 300], 32, 256), vec![1, 1]);
    }

    #[test]
    fn calls_stay_within_the_memory_budget() {
        let memory = CallMemory::of(MINILM).unwrap();
        let budget = 128 << 20;
        // 16 texts of 256 tokens fit the token budget (4096) in one call, about 600 MiB of
        // working memory: cut to calls of at most three.
        let long = within(&[256; 16], 32, 4096, budget);
        assert!(long.len() > 1, "{long:?}");
        for s in &long {
            assert!(memory.call(*s, 256) <= budget, "{s} texts");
        }
        assert_eq!(long.iter().sum::<usize>(), 16);
        // Short texts are not cut by it: 32 of 12 tokens are about 23 MiB.
        assert_eq!(within(&[12; 32], 32, 4096, budget), vec![32]);
        // One text over the budget still runs, alone.
        assert_eq!(within(&[256, 256], 32, 4096, 1), vec![1, 1]);
    }
}
