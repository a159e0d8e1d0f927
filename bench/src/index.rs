//! `reprise-bench index`: the semantic index alone, at scale: the memory it adds per entry and
//! how soon a bulk load (a replica's rebuild, a snapshot) can be searched.
//!
//! Synthetic unit vectors (384 dimensions by default) are made first and held, as the cache's
//! entries hold their embeddings; the process's resident memory is read before and after, so
//! what the index adds on top of the vectors is measured apart from the vectors themselves.
//! Then one bulk load (`SemanticIndex::insert_many`, what `Store::load` calls), timed until it
//! returns (the index answers searches from then on), then `SemanticIndex::maintain` (what
//! builds the graphs a bulk load left to the background), timed until every big partition has
//! its graph. Last, recall@k of the index against an exact scan on the same queries.
//!
//! Progress goes to stderr, results to stdout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use reprise_cache::semantic::{IndexConfig, IndexItem, PartitionKey, SemanticIndex};
use reprise_cache::{EntryId, Vector};

use crate::common::{heap_in_use, mib, rss};
use crate::redis::SplitMix;

/// Options of `reprise-bench index`.
#[derive(Debug, Args)]
pub struct IndexArgs {
    /// Entries (vectors) loaded.
    #[arg(long, default_value_t = 100_000)]
    entries: usize,
    /// Partitions they are spread over (round robin).
    #[arg(long, default_value_t = 16)]
    partitions: usize,
    /// Components per vector.
    #[arg(long, default_value_t = 384)]
    dim: usize,
    /// Queries for the recall check.
    #[arg(long, default_value_t = 200)]
    queries: usize,
    /// Neighbours per query in the recall check.
    #[arg(long, default_value_t = 10)]
    k: usize,
    /// The graphs' links per point (`IndexConfig::hnsw_m`; the index's default when not given).
    #[arg(long)]
    hnsw_m: Option<usize>,
}

/// Runs the index benchmark (CPU work, off the async workers).
pub async fn run(a: IndexArgs) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || measure(&a)).await?
}

/// Prints `what` with the elapsed time every 5 s until the returned guard is dropped.
fn progress(what: &'static str, index: Arc<SemanticIndex>) -> impl Drop {
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let t = Instant::now();
    std::thread::spawn(move || {
        let mut next = Duration::from_secs(5);
        while !flag.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
            if t.elapsed() >= next {
                eprintln!(
                    "  {what}: {:.0} s, {} vectors indexed",
                    t.elapsed().as_secs_f64(),
                    index.len()
                );
                next += Duration::from_secs(5);
            }
        }
    });
    Stop(stop)
}

fn measure(a: &IndexArgs) -> anyhow::Result<()> {
    let n = a.entries;
    let dim = a.dim;
    let parts = a.partitions.max(1);
    let partitions: Vec<PartitionKey> = (0..parts)
        .map(|p| *blake3::hash(format!("bench partition {p}").as_bytes()).as_bytes())
        .collect();
    println!("== reprise bench index ==");
    println!(
        "{n} entries, {dim}-dim vectors, {parts} partitions, hnsw_m {}",
        a.hnsw_m.unwrap_or(IndexConfig::default().hnsw_m)
    );

    let (rss0, _) = rss();
    let heap0 = heap_in_use();
    eprintln!("making {n} vectors");
    let mut rng = SplitMix(0x1DE5);
    let mut vectors: Vec<Vector> = Vec::with_capacity(n);
    for i in 0..n {
        vectors.push(rng.vector(dim));
        if (i + 1) % 100_000 == 0 {
            eprintln!("  {} made", i + 1);
        }
    }
    let (rss1, _) = rss();
    let items: Vec<IndexItem> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| (partitions[i % parts], EntryId(i as u128), v.clone()))
        .collect();

    let defaults = IndexConfig::default();
    let cfg = IndexConfig {
        hnsw_m: a.hnsw_m.unwrap_or(defaults.hnsw_m),
        ..defaults
    };
    let index = Arc::new(SemanticIndex::new(dim, cfg));
    eprintln!("bulk load (insert_many)");
    let t = Instant::now();
    {
        let _p = progress("bulk load", index.clone());
        index.insert_many(items);
    }
    let searchable_s = t.elapsed().as_secs_f64();
    let (rss2, _) = rss();
    eprintln!("graphs (maintain)");
    let report = {
        let _p = progress("graphs", index.clone());
        index.maintain()
    };
    let graphs_s = t.elapsed().as_secs_f64();
    let (rss3, hwm) = rss();
    // What the server's maintenance does after building graphs: hand malloc's free pages back.
    reprise::tasks::release_free_memory();
    let (rss4, _) = rss();
    let heap = heap_in_use();
    anyhow::ensure!(index.len() == n, "{} of {n} indexed", index.len());

    // Recall against an exact scan of the same partition, on vectors near stored ones.
    eprintln!("recall@{} on {} queries", a.k, a.queries);
    let mut found = 0usize;
    let mut wanted = 0usize;
    for _ in 0..a.queries {
        let i = (rng.next() % n as u64) as usize;
        let p = i % parts;
        let mut q: Vec<f32> = vectors[i]
            .to_f32()
            .iter()
            .map(|x| x + 0.05 * rng.unit())
            .collect();
        let norm = q.iter().map(|x| x * x).sum::<f32>().sqrt();
        q.iter_mut().for_each(|x| *x /= norm);
        let mut exact: Vec<(f32, usize)> = (p..n)
            .step_by(parts)
            .map(|j| (vectors[j].dot(&q), j))
            .collect();
        exact.sort_by(|a, b| b.0.total_cmp(&a.0));
        let got = index.search(&partitions[p], &q, a.k);
        wanted += a.k.min(exact.len());
        found += exact
            .iter()
            .take(a.k)
            .filter(|(_, j)| got.iter().any(|c| c.id == EntryId(*j as u128)))
            .count();
    }

    let per = |bytes: u64| bytes as f64 / n as f64;
    println!(
        "vectors held by the entries: {:.1} MiB ({:.0} bytes/entry; {} bytes of half floats)",
        mib(rss1.saturating_sub(rss0)),
        per(rss1.saturating_sub(rss0)),
        dim * 2
    );
    println!(
        "bulk load: searchable after {searchable_s:.2} s; every graph built after {graphs_s:.2} s \
         ({} partitions rebuilt by maintain)",
        report.rebuilt
    );
    println!(
        "index memory: {:.1} MiB after the bulk load, {:.1} MiB with graphs: {:.0} bytes/entry \
         on top of the vectors ({:.0} bytes/entry with them; peak RSS {:.1} MiB)",
        mib(rss2.saturating_sub(rss1)),
        mib(rss3.saturating_sub(rss1)),
        per(rss3.saturating_sub(rss1)),
        per(rss3.saturating_sub(rss1) + rss1.saturating_sub(rss0)),
        mib(hwm)
    );
    println!(
        "after handing free pages back (malloc_trim, as maintenance does): index {:.0} \
         bytes/entry on top of the vectors, {:.0} bytes/entry with them; malloc's live heap \
         {:.1} MiB ({:.0} bytes/entry, vectors and index)",
        per(rss4.saturating_sub(rss1)),
        per(rss4.saturating_sub(rss0)),
        mib(heap),
        per(heap.saturating_sub(heap0)),
    );
    println!(
        "recall@{} against an exact scan: {:.3} ({found} of {wanted})",
        a.k,
        found as f64 / wanted.max(1) as f64
    );
    Ok(())
}
