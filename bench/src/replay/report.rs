//! What `reprise-bench replay` prints: each side's summary (hit rates, latency, prefetch spent
//! and unused, the prefetch side's question clusters) and the ratios between the sides.

use super::*;

/// Summary of one side.
#[derive(Debug, Clone, Default)]
struct Summary {
    turns: usize,
    exact: usize,
    semantic: usize,
    prefetch: usize,
    misses: usize,
    errors: usize,
    false_hits: usize,
    p50: f64,
    p95: f64,
    ttft50: f64,
    ttft95: f64,
    by_depth: Vec<(usize, usize, usize)>,
    spent: PrefetchStats,
    whole: PrefetchStats,
}

impl Summary {
    fn hits(&self) -> usize {
        self.exact + self.semantic + self.prefetch
    }

    /// Turns answered (the shares are over these: a failed turn is neither a hit nor a
    /// miss).
    fn answered(&self) -> usize {
        self.turns - self.errors
    }

    /// `n` turns as a share of those answered.
    fn share(&self, n: usize) -> f64 {
        n as f64 / self.answered().max(1) as f64
    }

    fn hit_rate(&self) -> f64 {
        self.share(self.hits())
    }

    /// Correct hits only (a false hit served the wrong answer).
    fn correct_rate(&self) -> f64 {
        self.share(self.hits() - self.false_hits)
    }

    /// Prefetches generated in the measured part less the turns a prefetch served there
    /// (entries prefetched in the warm-up included), over those generated: the waste as the
    /// reference ceiling also counts it. Not "never used" per entry: a warm-up entry's use
    /// offsets a measured one's waste (the prefetcher's counts do not say which entry served).
    fn unused_share(&self) -> f64 {
        let made = self.spent.completed;
        if made == 0 {
            return 0.0;
        }
        made.saturating_sub(self.spent.hits) as f64 / made as f64
    }
}

fn delta(end: &PrefetchStats, start: &PrefetchStats) -> PrefetchStats {
    PrefetchStats {
        predictions: end.predictions - start.predictions,
        queued: end.queued - start.queued,
        started: end.started - start.started,
        completed: end.completed - start.completed,
        skipped: end.skipped - start.skipped,
        cancelled: end.cancelled - start.cancelled,
        preempted: end.preempted - start.preempted,
        hits: end.hits - start.hits,
        wasted: end.wasted - start.wasted,
        tokens: end.tokens - start.tokens,
        backend_seconds: end.backend_seconds - start.backend_seconds,
        ..*end
    }
}

fn summarise(side: &Side) -> Summary {
    let results = side.results.lock().clone();
    let mut s = Summary {
        turns: results.len(),
        ..Summary::default()
    };
    for r in &results {
        match r.served {
            Served::Exact => s.exact += 1,
            Served::Semantic => s.semantic += 1,
            Served::Prefetch => s.prefetch += 1,
            Served::Miss => s.misses += 1,
            Served::Error => s.errors += 1,
        }
        s.false_hits += usize::from(r.false_hit);
        if r.served == Served::Error {
            continue;
        }
        let d = r.depth;
        if s.by_depth.len() < d {
            s.by_depth.resize(d, (0, 0, 0));
        }
        s.by_depth[d - 1].0 += 1;
        s.by_depth[d - 1].1 += usize::from(r.served.is_hit());
        s.by_depth[d - 1].2 += usize::from(r.served == Served::Prefetch);
    }
    let ok: Vec<&TurnResult> = results
        .iter()
        .filter(|r| r.served != Served::Error)
        .collect();
    let lat: Vec<f64> = ok.iter().map(|r| r.total_s).collect();
    let ttft: Vec<f64> = ok
        .iter()
        .map(|r| r.ttft_s)
        .filter(|t| t.is_finite())
        .collect();
    s.p50 = percentile(&lat, 50.0);
    s.p95 = percentile(&lat, 95.0);
    s.ttft50 = percentile(&ttft, 50.0);
    s.ttft95 = percentile(&ttft, 95.0);
    if let Some(p) = prefetcher(&side.server.state) {
        let end = p.stats();
        let start = side.at_measure.lock().unwrap_or_default();
        s.spent = delta(&end, &start);
        s.whole = end;
    }
    s
}

pub(super) fn pct(x: f64) -> String {
    format!("{:5.1} %", x * 100.0)
}

fn ms(x: f64) -> String {
    format!("{:7.1} ms", x * 1000.0)
}

/// How the prefetch side's question clusters split by intent: clusters, wordings clustered,
/// and clusters whose wordings belong to more than one intent (each such wording can be
/// served another intent's prefetched answer).
fn cluster_purity(
    side: &Side,
    intent_of: &HashMap<String, String>,
) -> Option<(usize, usize, usize)> {
    let p = prefetcher(&side.server.state)?;
    let clusters = p.clusters(DEFAULT_NAMESPACE);
    let wordings = clusters.iter().map(Vec::len).sum();
    let mixed = clusters
        .iter()
        .filter(|c| {
            let mut intents: Vec<&String> = c.iter().filter_map(|w| intent_of.get(w)).collect();
            intents.sort();
            intents.dedup();
            intents.len() > 1
        })
        .count();
    Some((clusters.len(), wordings, mixed))
}

pub(super) fn report(
    a: &ReplayArgs,
    sides: &[Arc<Side>],
    intent_of: &HashMap<String, String>,
    sessions: &[Session],
) -> anyhow::Result<()> {
    let sums: Vec<Summary> = sides.iter().map(|s| summarise(s)).collect();
    println!("== reprise bench replay ==");
    println!(
        "measured: {} turns per side (sessions {}..), multi-turn conversations; backend slots {}; sides {}",
        sums[0].turns,
        a.warmup,
        a.backend_slots
            .map_or_else(|| "unlimited".to_string(), |n| n.to_string()),
        if a.sequential { "one after the other" } else { "at once" }
    );
    for (side, s) in sides.iter().zip(&sums) {
        println!("-- {} --", side.name);
        println!(
            "hit rate {}  (exact {}, semantic {}, prefetch {})  misses {}  errors {}",
            pct(s.hit_rate()),
            pct(s.share(s.exact)),
            pct(s.share(s.semantic)),
            pct(s.share(s.prefetch)),
            s.misses,
            s.errors
        );
        if a.backend == ReplayBackend::Scripted {
            println!(
                "false hits {} ({} of hits); correct-hit rate {}",
                s.false_hits,
                pct(s.false_hits as f64 / s.hits().max(1) as f64),
                pct(s.correct_rate())
            );
        } else {
            println!("false hits not judged (a real model's answers do not name their question)");
        }
        println!(
            "latency p50 {}  p95 {}   TTFT p50 {}  p95 {}",
            ms(s.p50),
            ms(s.p95),
            ms(s.ttft50),
            ms(s.ttft95)
        );
        let depth: Vec<String> = s
            .by_depth
            .iter()
            .enumerate()
            .map(|(i, (n, h, p))| {
                format!(
                    "{}:{}{}",
                    i + 1,
                    pct(*h as f64 / (*n).max(1) as f64).trim(),
                    if *p > 0 {
                        format!(" ({} pf)", pct(*p as f64 / (*n).max(1) as f64).trim())
                    } else {
                        String::new()
                    }
                )
            })
            .collect();
        println!("hit rate by turn depth: {}", depth.join("  "));
        if prefetcher(&side.server.state).is_some() {
            let p = &s.spent;
            println!(
                "prefetch (measured part): {} predicted, {} queued, {} started, {} generated, {} already cached, {} cancelled ({} preempted); {:.1} backend s, {} tokens; {} used, unused {}",
                p.predictions, p.queued, p.started, p.completed, p.skipped, p.cancelled, p.preempted,
                p.backend_seconds, p.tokens, p.hits, pct(s.unused_share())
            );
            let w = &s.whole;
            println!(
                "prefetch (whole run): {} generated, {} used, {:.1} backend s, {} tokens, {} observations dropped",
                w.completed, w.hits, w.backend_seconds, w.tokens, w.observations_dropped
            );
            if let Some((n, words, mixed)) = cluster_purity(side, intent_of) {
                println!("question clusters: {n} holding {words} wordings; {mixed} mix intents");
            }
        }
    }
    let (off, on) = (&sums[0], &sums[1]);
    let hit_ratio = on.correct_rate() / off.correct_rate().max(1e-9);
    let p95_ratio = on.p95 / off.p95;
    let ttft_ratio = on.ttft95 / off.ttft95;
    println!("-- ratios (on / off) --");
    println!("correct-hit rate {hit_ratio:.2}x  (goal >= 1.5x)");
    println!("latency p95 {p95_ratio:.3}x  (goal <= 1.05x);  TTFT p95 {ttft_ratio:.3}x");
    println!(
        "prefetch unused (measured part: generated less served, over generated) {}  (goal <= 50 %)",
        pct(on.unused_share())
    );
    let ceiling = print_ceiling(a, sessions)?;
    if let Some(path) = &a.json {
        let side = |s: &Summary| {
            json!({"turns": s.turns, "hit_rate": s.hit_rate(), "correct_hit_rate": s.correct_rate(),
                   "exact": s.exact, "semantic": s.semantic, "prefetch": s.prefetch,
                   "misses": s.misses, "errors": s.errors, "false_hits": s.false_hits,
                   "p50_s": s.p50, "p95_s": s.p95, "ttft_p50_s": s.ttft50, "ttft_p95_s": s.ttft95,
                   "by_depth": s.by_depth.iter().map(|(n, h, p)| json!({"turns": n, "hits": h, "prefetch": p})).collect::<Vec<_>>(),
                   "prefetch_generated": s.spent.completed, "prefetch_used": s.spent.hits,
                   "prefetch_preempted": s.spent.preempted,
                   "prefetch_backend_s": s.spent.backend_seconds, "prefetch_tokens": s.spent.tokens,
                   "prefetch_unused_share": s.unused_share()})
        };
        let out = json!({"backend": format!("{:?}", a.backend).to_lowercase(),
                         "backend_slots": a.backend_slots, "sequential": a.sequential,
                         "token_delay_ms": a.token_delay_ms,
                         "off": side(off), "on": side(on), "hit_ratio": hit_ratio,
                         "p95_ratio": p95_ratio, "ttft_p95_ratio": ttft_ratio,
                         "ceiling": ceiling.map(|c| json!({"histories": "as_worded", "off": c.off, "on": c.on, "unused": c.unused,
                                                          "never_used": c.never_used}))});
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares are over the turns answered: a failed turn is neither a hit nor a miss.
    #[test]
    fn shares_leave_failed_turns_out() {
        let s = Summary {
            turns: 3,
            exact: 1,
            misses: 1,
            errors: 1,
            ..Summary::default()
        };
        assert_eq!(s.hit_rate(), 0.5);
        assert_eq!(s.correct_rate(), 0.5);
    }
}
