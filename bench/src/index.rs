//! `reprise-bench index`: the semantic index alone, at scale: the memory it adds per entry and
//! how soon a bulk load (a replica's rebuild, a snapshot) can be searched.
//!
//! Synthetic unit vectors (384 dimensions by default) are made first and held, as the cache's
//! entries hold their embeddings; the process's resident memory is read before and after, so
//! what the index adds on top of the vectors is measured apart from the vectors themselves.
//! Then one bulk load (`SemanticIndex::insert_many`, what `Store::load` calls), timed until it
//! returns (the index answers searches from then on), then `SemanticIndex::maintain` (what
//! builds the graphs a bulk load left to the background), timed until every big partition has
//! its graph. Last, recall@k of the index against an exact scan on the same queries; with
//! `--tune-searches`, the same queries through the server's own path (every graph search
//! checked by maintenance, partitions widened where they miss) and recall@1 at the widths
//! that reaches.
//!
//! Progress goes to stderr, results to stdout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use reprise_cache::semantic::{
    graph_distances_on_this_thread, IndexConfig, IndexItem, PartitionKey, SemanticIndex,
    RECALL_MAX_PENDING,
};
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
    /// Search widths (`ef`) whose recall is measured side by side on the same graphs, besides
    /// the one the index chooses for each partition's size.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 128, 256, 512])]
    ef: Vec<usize>,
    /// Vectors with this many effective dimensions (random in a subspace, plus a little noise
    /// in every direction) instead of random in all of them: sentence embeddings sit near a
    /// subspace of few dimensions, random vectors are a graph's worst case.
    #[arg(long)]
    intrinsic_dim: Option<usize>,
    /// A text file, one text per line: its distinct lines' embeddings (the configured
    /// embedder) are the vectors, as many as `--entries` at most.
    #[arg(long)]
    texts: Option<std::path::PathBuf>,
    /// Configuration whose `[semantic]` section loads the embedder for `--texts` and whose
    /// `[semantic.index]` is the index's (`--hnsw-m` over it).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Searches played through the server's path after the recall check, every one checked
    /// by maintenance against an exact scan (`recall_check_every` 1; `recall_target` and
    /// `ef_search_max` as configured), so partitions whose searches miss are widened; then
    /// recall@1 at the widths reached. 0: none.
    #[arg(long, default_value_t = 0)]
    tune_searches: usize,
}

/// Runs the index benchmark (CPU work, off the async workers).
pub async fn run(a: IndexArgs) -> anyhow::Result<()> {
    let embedded = match &a.texts {
        Some(path) => Some(embed_texts(&a, path).await?),
        None => None,
    };
    tokio::task::spawn_blocking(move || measure(&a, embedded)).await?
}

/// The embeddings of `path`'s distinct lines, `a.entries` at most, with progress.
async fn embed_texts(a: &IndexArgs, path: &std::path::Path) -> anyhow::Result<Vec<Vector>> {
    use reprise_embedder::{Embedder, FastEmbedder};
    let raw = std::fs::read_to_string(path)?;
    let mut seen = std::collections::HashSet::new();
    let texts: Vec<String> = raw
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && seen.insert(*l))
        .take(a.entries)
        .map(str::to_owned)
        .collect();
    anyhow::ensure!(!texts.is_empty(), "no text in {}", path.display());
    let mut config = crate::common::Config::load(a.config.as_deref())?;
    config.semantic.enabled = true;
    let cfg = crate::common::embedder_config(&config);
    eprintln!("loading the embedder");
    let embedder = tokio::task::spawn_blocking(move || FastEmbedder::load(cfg)).await??;
    let t = Instant::now();
    let mut out = Vec::with_capacity(texts.len());
    for chunk in texts.chunks(256) {
        for v in embedder.embed_many(chunk).await? {
            out.push(Vector::new(&v));
        }
        eprintln!(
            "  {} of {} texts embedded ({:.0} s)",
            out.len(),
            texts.len(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(out)
}

/// A unit vector of `dim` components near a subspace of `basis.len()` dimensions: a random
/// combination of the basis plus noise of a tenth of its length in every direction.
fn near_subspace(rng: &mut SplitMix, basis: &[Vec<f32>], dim: usize) -> Vector {
    let mut v = vec![0f32; dim];
    for b in basis {
        let c = rng.unit();
        v.iter_mut().zip(b).for_each(|(x, y)| *x += c * y);
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    let noise = rng.vector(dim).to_f32();
    v.iter_mut()
        .zip(&noise)
        .for_each(|(x, e)| *x = *x / norm + 0.1 * e);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
    v.into()
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

fn measure(a: &IndexArgs, embedded: Option<Vec<Vector>>) -> anyhow::Result<()> {
    let n = embedded.as_ref().map_or(a.entries, Vec::len);
    let dim = embedded
        .as_ref()
        .and_then(|e| e.first())
        .map_or(a.dim, Vector::len);
    let parts = a.partitions.max(1);
    let partitions: Vec<PartitionKey> = (0..parts)
        .map(|p| *blake3::hash(format!("bench partition {p}").as_bytes()).as_bytes())
        .collect();
    println!("== reprise bench index ==");
    let defaults = match &a.config {
        Some(path) => crate::common::Config::load(Some(path))?.semantic.index,
        None => IndexConfig::default(),
    };
    let cfg = IndexConfig {
        hnsw_m: a.hnsw_m.unwrap_or(defaults.hnsw_m),
        recall_check_every: if a.tune_searches > 0 {
            1
        } else {
            defaults.recall_check_every
        },
        ..defaults
    };
    let kind = match (&a.texts, a.intrinsic_dim) {
        (Some(p), _) => format!("embeddings of the texts of {}", p.display()),
        (None, Some(d)) => format!("random near a {d}-dim subspace"),
        (None, None) => "random".to_owned(),
    };
    println!(
        "{n} entries, {dim}-dim vectors ({kind}), {parts} partitions, hnsw_m {}, ef_search {}",
        cfg.hnsw_m, cfg.ef_search
    );

    let (rss0, _) = rss();
    let heap0 = heap_in_use();
    eprintln!("making {n} vectors");
    let mut rng = SplitMix(0x1DE5);
    let basis: Vec<Vec<f32>> = (0..a.intrinsic_dim.unwrap_or(0))
        .map(|_| rng.vector(dim).to_f32())
        .collect();
    let vectors: Vec<Vector> = match embedded {
        Some(v) => v,
        None => {
            let mut vectors = Vec::with_capacity(n);
            for i in 0..n {
                vectors.push(if basis.is_empty() {
                    rng.vector(dim)
                } else {
                    near_subspace(&mut rng, &basis, dim)
                });
                if (i + 1) % 100_000 == 0 {
                    eprintln!("  {} made", i + 1);
                }
            }
            vectors
        }
    };
    let (rss1, _) = rss();
    let items: Vec<IndexItem> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| (partitions[i % parts], EntryId(i as u128), v.clone()))
        .collect();

    let cfg_ef = cfg.ef_search;
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

    // Recall against an exact scan of the same partition, on vectors near stored ones (each
    // query's own source is its nearest neighbour, as a paraphrase's stored wording is), at
    // the width the index chooses and at each width asked for.
    eprintln!("recall on {} queries", a.queries);
    let mut queries: Vec<(usize, Vec<f32>, Vec<usize>)> = Vec::with_capacity(a.queries);
    let mut scanning = Duration::ZERO;
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
        let scan = Instant::now();
        let mut exact: Vec<(f32, usize)> = (p..n)
            .step_by(parts)
            .map(|j| (vectors[j].dot(&q), j))
            .collect();
        scanning += scan.elapsed();
        exact.sort_by(|a, b| b.0.total_cmp(&a.0));
        let top: Vec<usize> = exact.iter().take(a.k).map(|(_, j)| *j).collect();
        queries.push((p, q, top));
    }
    let widths: Vec<Option<usize>> = std::iter::once(None)
        .chain(a.ef.iter().map(|&e| Some(e)))
        .collect();
    let mut recalls = Vec::with_capacity(widths.len());
    for &ef in &widths {
        let (mut found, mut wanted, mut first) = (0usize, 0usize, 0usize);
        let distances = graph_distances_on_this_thread();
        let t = Instant::now();
        for (p, q, top) in &queries {
            let got = index.search_wide(&partitions[*p], q, a.k, ef);
            wanted += top.len();
            found += top
                .iter()
                .filter(|j| got.iter().any(|c| c.id == EntryId(**j as u128)))
                .count();
            if let (Some(best), Some(g)) = (top.first(), got.first()) {
                first += usize::from(g.id == EntryId(*best as u128));
            }
        }
        let micros = t.elapsed().as_secs_f64() * 1e6 / queries.len().max(1) as f64;
        let distances =
            (graph_distances_on_this_thread() - distances) / queries.len().max(1) as u64;
        recalls.push((ef, found, wanted, first, micros, distances));
    }
    let tuned = (a.tune_searches > 0).then(|| tune(a, &index, &partitions, &queries));

    let per = |bytes: u64| bytes as f64 / n as f64;
    if a.texts.is_some() {
        // Embedded before the first reading (beside the embedder's own memory).
        println!(
            "vectors held by the entries: not measured apart ({} bytes of half floats each)",
            dim * 2
        );
    } else {
        println!(
            "vectors held by the entries: {:.1} MiB ({:.0} bytes/entry; {} bytes of half floats)",
            mib(rss1.saturating_sub(rss0)),
            per(rss1.saturating_sub(rss0)),
            dim * 2
        );
    }
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
    let per_partition = n / parts;
    println!(
        "exact scan of a partition ({per_partition} vectors): {:.0} µs a search",
        scanning.as_secs_f64() * 1e6 / queries.len().max(1) as f64
    );
    for (ef, found, wanted, first, micros, distances) in recalls {
        let width = match ef {
            Some(e) => format!("ef {e}"),
            None => format!("ef {} (the configured one)", cfg_ef),
        };
        println!(
            "{width}: recall@1 {:.3}, recall@{} {:.3} ({found} of {wanted}) against an exact \
             scan; {micros:.0} µs and {distances} distances a search",
            first as f64 / queries.len().max(1) as f64,
            a.k,
            found as f64 / wanted.max(1) as f64
        );
    }
    if let Some(t) = tuned {
        println!(
            "in service: {} searches checked by maintenance, {} missed the nearest; {} \
             widenings; widest ef {} (configured {cfg_ef}); recall@1 at the widths reached \
             {:.3} ({:.0} µs a search)",
            t.checked,
            t.missed,
            t.widened,
            index.widest_search(),
            t.recall_at_1,
            t.micros
        );
    }
    Ok(())
}

/// What [`tune`] measured.
struct Tuned {
    checked: usize,
    missed: usize,
    widened: usize,
    recall_at_1: f64,
    micros: f64,
}

/// Plays `--tune-searches` searches of `queries` through the server's path (the partition's
/// own width, each search sampled), running maintenance after each batch the samples' room
/// holds, as the server's background task does; then recall@1 at the widths reached.
fn tune(
    a: &IndexArgs,
    index: &SemanticIndex,
    partitions: &[PartitionKey],
    queries: &[(usize, Vec<f32>, Vec<usize>)],
) -> Tuned {
    eprintln!("{} searches checked in service", a.tune_searches);
    let mut t = Tuned {
        checked: 0,
        missed: 0,
        widened: 0,
        recall_at_1: 0.0,
        micros: 0.0,
    };
    // The recall rows above searched at the configured width through the same path: their
    // samples are checked first, and counted.
    let r = index.maintain();
    t.checked += r.recall_checked;
    t.missed += r.recall_missed;
    t.widened += r.widened;
    let mut played = 0;
    for (p, q, _) in queries.iter().cycle().take(a.tune_searches) {
        index.search(&partitions[*p], q, a.k);
        played += 1;
        if played % RECALL_MAX_PENDING == 0 || played == a.tune_searches {
            let r = index.maintain();
            t.checked += r.recall_checked;
            t.missed += r.recall_missed;
            t.widened += r.widened;
            if r.widened > 0 {
                eprintln!(
                    "  after {played} searches: widest ef {}",
                    index.widest_search()
                );
            }
        }
    }
    let started = Instant::now();
    let first = queries
        .iter()
        .filter(|(p, q, top)| {
            let got = index.search_wide(&partitions[*p], q, 1, None);
            matches!((top.first(), got.first()), (Some(best), Some(g)) if g.id == EntryId(*best as u128))
        })
        .count();
    t.micros = started.elapsed().as_secs_f64() * 1e6 / queries.len().max(1) as f64;
    t.recall_at_1 = first as f64 / queries.len().max(1) as f64;
    t
}
