//! CPU-bound work of the request path that must not run on the async workers: the false-hit
//! gate on a candidate (and the words it swaps), the split of a prompt at the embedder's
//! window, llama.cpp's tokenization of a long input. Each is linear in bounded text, but a
//! bounded text is still tens of kilobytes (megabytes for a raw prompt), and work on an
//! async worker delays every request that worker serves, `/healthz` included.
//!
//! The work runs on tokio's blocking pool, at most [`CpuPool::threads`] jobs at a time. The
//! bound matters: the blocking pool grows to hundreds of threads, so a flood of long prompts
//! would otherwise start a thread each and share the cores among all of them. Jobs beyond
//! the bound wait for a permit without holding a thread, in arrival order (tokio's semaphore
//! is fair).

use std::sync::Arc;

use tokio::sync::Semaphore;

/// A bound on the request path's CPU-bound jobs (see the module header). Clones share it.
#[derive(Clone)]
pub struct CpuPool {
    permits: Arc<Semaphore>,
    threads: usize,
}

impl CpuPool {
    /// A pool running at most `threads` jobs at a time (at least one).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        CpuPool {
            permits: Arc::new(Semaphore::new(threads)),
            threads,
        }
    }

    /// The process's pool of one job per core, shared by whoever asks (the request path,
    /// the llama backend's tokenizer): the jobs never need more, and the async workers keep
    /// their share of the cores as any other thread does.
    pub fn per_core() -> Self {
        static SHARED: std::sync::OnceLock<CpuPool> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| Self::new(std::thread::available_parallelism().map_or(1, |n| n.get())))
            .clone()
    }

    /// The most jobs that run at once.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job` off the async workers once a permit is free, and returns its result. A
    /// panic in `job` resumes in the caller.
    pub async fn run<T, F>(&self, job: F) -> T
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        // The semaphore is never closed.
        let permit = self.permits.clone().acquire_owned().await.expect("open");
        let done = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job()
        })
        .await;
        match done {
            Ok(v) => v,
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                // Only a runtime shutting down cancels a blocking job before it starts.
                Err(e) => panic!("a CPU job did not run: {e}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::CpuPool;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_at_most_its_threads_at_once() {
        let pool = Arc::new(CpuPool::new(2));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs = (0..16).map(|i| {
            let (pool, running, most) = (pool.clone(), running.clone(), most.clone());
            tokio::spawn(async move {
                pool.run(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    // Long enough for the other jobs to be queued meanwhile.
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    running.fetch_sub(1, Ordering::SeqCst);
                    i * 2
                })
                .await
            })
        });
        let results = futures::future::join_all(jobs).await;
        let sum: usize = results.into_iter().map(Result::unwrap).sum();
        assert_eq!(sum, (0..16).map(|i| i * 2).sum::<usize>());
        assert!(most.load(Ordering::SeqCst) <= 2);
    }

    #[tokio::test]
    async fn a_panic_reaches_the_caller() {
        let pool = Arc::new(CpuPool::new(1));
        let p = pool.clone();
        let failed = tokio::spawn(async move { p.run(|| panic!("job failed")).await }).await;
        assert!(failed.unwrap_err().is_panic());
        // The permit came back.
        assert_eq!(pool.run(|| 7).await, 7);
    }
}
