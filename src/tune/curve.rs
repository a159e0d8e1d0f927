//! The threshold curve: at each threshold from 0.70 to 0.99, how much is served and how much
//! of it is wrong, from measured similarities and gate verdicts. Pure: the pairs and the log
//! each turn their material into samples, and everything below is arithmetic.

/// The thresholds of the curve: 0.70 to 0.99 in steps of 0.01 (each computed from its
/// hundredths, so 0.80 is the `f32` nearest 0.8, as a configured `threshold = 0.8` reads).
pub fn thresholds() -> impl Iterator<Item = f32> {
    (70..=99).map(|i| i as f32 / 100.0)
}

/// One threshold of the curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Served at or above this similarity.
    pub threshold: f32,
    /// What the hit rate is a share of: same-answer pairs, or requests with a similarity.
    pub eligible: usize,
    /// Of those, the ones served at this threshold.
    pub hits: usize,
    /// Everything served at this threshold (pairs of either label; in the log, `hits`).
    pub served: usize,
    /// Served ones whose rightness is known: every pair, the log's hits with a verdict.
    pub judged: usize,
    /// Of the judged, the wrong ones.
    pub wrong: usize,
}

impl Point {
    /// `hits / eligible`; `None` with nothing eligible.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.eligible > 0).then(|| self.hits as f64 / self.eligible as f64)
    }

    /// `wrong / judged`; `None` when nothing served here was judged (no evidence).
    pub fn wrong_share(&self) -> Option<f64> {
        (self.judged > 0).then(|| self.wrong as f64 / self.judged as f64)
    }

    /// A 95 % upper bound on the wrong share (Wilson score interval): what the estimate is
    /// worth on few judged answers.
    pub fn wrong_share_upper(&self) -> Option<f64> {
        let n = self.judged as f64;
        let p = self.wrong_share()?;
        let z = 1.96_f64;
        let centre = p + z * z / (2.0 * n);
        let spread = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt();
        Some(((centre + spread) / (1.0 + z * z / n)).min(1.0))
    }
}

/// One labelled pair as measured: the similarity of its two sides, whether the gate passes
/// the stored side for the asked one, and whether one answer serves both.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairSample {
    /// Cosine similarity of the two sides' embeddings.
    pub similarity: f32,
    /// The false-hit gate passes it.
    pub gate: bool,
    /// Labelled the same answer.
    pub same: bool,
}

/// The curve of labelled pairs, with the gate applied or not: a pair is served when its
/// similarity reaches the threshold (and, with `gate`, the gate passes it); the hit rate is the
/// share of same-answer pairs served, the wrong share that of served pairs labelled different.
pub fn pairs_curve(samples: &[PairSample], gate: bool) -> Vec<Point> {
    let eligible = samples.iter().filter(|s| s.same).count();
    thresholds()
        .map(|t| {
            let served = samples
                .iter()
                .filter(|s| s.similarity >= t && (s.gate || !gate));
            let (mut hits, mut wrong, mut n) = (0, 0, 0);
            for s in served {
                n += 1;
                if s.same {
                    hits += 1;
                } else {
                    wrong += 1;
                }
            }
            Point {
                threshold: t,
                eligible,
                hits,
                served: n,
                judged: n,
                wrong,
            }
        })
        .collect()
}

/// One request of the log that had a semantic candidate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSample {
    /// Similarity of its best candidate.
    pub similarity: f32,
    /// The gate passed that candidate (or was not asked: below the threshold it was served
    /// at, the gate does not run, and it is counted as passing).
    pub gate: bool,
    /// It was served a semantic hit.
    pub served: bool,
    /// The threshold it was looked up under (`None`: the semantic tier was off for it).
    pub threshold: Option<f32>,
    /// The verdict on the answer it was served: `Some(true)` wrong, `Some(false)` right.
    pub wrong: Option<bool>,
}

/// The curve of logged traffic: at each threshold, the share of requests with a candidate
/// whose best one reaches it and passes the gate (hit rate), and the share of wrong verdicts
/// among the judged hits really served at or above it. A threshold has evidence only where
/// every such candidate was served: below the lowest similarity served, or at or below a
/// candidate that its threshold kept back (a stricter rule's, or another tenant's, so nobody
/// could judge it), `judged` is 0. A candidate that reached its threshold and still was not
/// served (reported wrong for the question, too old, evicted) keeps no evidence back: no
/// threshold would have served it.
pub fn log_curve(samples: &[LogSample]) -> Vec<Point> {
    let lowest_served = samples
        .iter()
        .filter(|s| s.served)
        .map(|s| s.similarity)
        .min_by(f32::total_cmp);
    let highest_kept_back = samples
        .iter()
        .filter(|s| {
            !s.served
                && s.gate
                && s.threshold
                    .is_none_or(|t| s.similarity < t || s.similarity.is_nan())
        })
        .map(|s| s.similarity)
        .max_by(f32::total_cmp);
    thresholds()
        .map(|t| {
            let hits = samples
                .iter()
                .filter(|s| s.similarity >= t && s.gate)
                .count();
            let evidence = lowest_served.is_some_and(|low| t >= low)
                && highest_kept_back.is_none_or(|kept| t > kept);
            let judged: Vec<bool> = samples
                .iter()
                .filter(|s| evidence && s.served && s.similarity >= t)
                .filter_map(|s| s.wrong)
                .collect();
            Point {
                threshold: t,
                eligible: samples.len(),
                hits,
                served: hits,
                judged: judged.len(),
                wrong: judged.iter().filter(|w| **w).count(),
            }
        })
        .collect()
}

/// The lowest threshold whose wrong share is known and at most `target`.
pub fn choose(points: &[Point], target: f64) -> Option<Point> {
    choose_by(points, target, Point::wrong_share)
}

/// [`choose`] on the 95 % upper bound of the wrong share rather than its estimate: the
/// lowest threshold the judged answers show within `target` with that confidence (a few
/// judged answers without a wrong one no longer make a loose threshold look safe).
pub fn choose_by_upper_bound(points: &[Point], target: f64) -> Option<Point> {
    choose_by(points, target, Point::wrong_share_upper)
}

fn choose_by(
    points: &[Point],
    target: f64,
    share: impl Fn(&Point) -> Option<f64>,
) -> Option<Point> {
    points
        .iter()
        .find(|p| share(p).is_some_and(|w| w <= target))
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(points: &[Point], t: f32) -> Point {
        *points
            .iter()
            .find(|p| (p.threshold - t).abs() < 1e-6)
            .expect("a point at t")
    }

    #[test]
    fn no_evidence_where_candidates_were_kept_back_by_a_stricter_threshold() {
        let sample = |similarity, threshold, served, wrong| LogSample {
            similarity,
            gate: true,
            served,
            threshold: Some(threshold),
            wrong,
        };
        // One scope served 0.81 (right); a stricter one served 0.97 fifty times (right) and
        // kept fifty candidates at 0.85 back, unjudged.
        let mut samples = vec![sample(0.81, 0.8, true, Some(false))];
        samples.extend((0..50).map(|_| sample(0.97, 0.95, true, Some(false))));
        samples.extend((0..50).map(|_| sample(0.85, 0.95, false, None)));
        // Candidates that reached their threshold and were not served for another reason
        // (reported wrong for the question, too old) keep nothing back.
        samples.extend((0..5).map(|_| sample(0.96, 0.95, false, None)));
        let points = log_curve(&samples);
        assert_eq!(at(&points, 0.81).judged, 0, "0.85 was never judged");
        assert_eq!(at(&points, 0.85).judged, 0);
        assert_eq!(at(&points, 0.86).judged, 50);
        let chosen = choose(&points, 0.02).unwrap().threshold;
        assert!((chosen - 0.86).abs() < 1e-6, "{chosen}");
        // Without its threshold (the tier off for it) a candidate is taken as kept back.
        let off = LogSample {
            threshold: None,
            ..sample(0.9, 0.0, false, None)
        };
        samples.push(off);
        assert_eq!(at(&log_curve(&samples), 0.90).judged, 0);
        assert_eq!(at(&log_curve(&samples), 0.91).judged, 50);
    }

    #[test]
    fn thresholds_run_from_070_to_099() {
        let t: Vec<f32> = thresholds().collect();
        assert_eq!(t.len(), 30);
        assert_eq!((t[0], t[29]), (0.7, 0.99));
        assert_eq!(t[10], 0.8);
    }

    #[test]
    fn pairs_curve_counts_hits_and_wrong_served() {
        let s = |similarity, gate, same| PairSample {
            similarity,
            gate,
            same,
        };
        let samples = [
            s(0.95, true, true),
            s(0.91, true, true),
            s(0.85, true, true),
            s(0.75, true, true),
            s(0.92, false, false), // a trap the gate catches
            s(0.88, true, false),  // a trap it lets through
            s(0.72, true, false),
            s(0.60, true, true), // never served
        ];
        let plain = pairs_curve(&samples, false);
        let gated = pairs_curve(&samples, true);
        assert_eq!(plain.len(), 30);

        // 0.70: every pair but the last is served.
        let p = at(&plain, 0.70);
        assert_eq!((p.eligible, p.hits, p.served, p.wrong), (5, 4, 7, 3));
        assert_eq!(p.hit_rate(), Some(0.8));
        assert_eq!(p.wrong_share(), Some(3.0 / 7.0));
        let g = at(&gated, 0.70);
        assert_eq!((g.hits, g.served, g.wrong), (4, 6, 2));

        // 0.86: the 0.85 and 0.75 true pairs and the 0.72 trap drop out.
        let p = at(&plain, 0.86);
        assert_eq!((p.hits, p.served, p.wrong), (2, 4, 2));
        let g = at(&gated, 0.86);
        assert_eq!((g.hits, g.served, g.wrong), (2, 3, 1));
        assert_eq!(g.hit_rate(), Some(0.4));

        // 0.89: only true pairs are left with the gate; the trap at 0.92 without it.
        let g = at(&gated, 0.89);
        assert_eq!((g.hits, g.served, g.wrong), (2, 2, 0));
        assert_eq!(at(&plain, 0.89).wrong, 1);

        // Above 0.95 nothing is served: no wrong share at all.
        let g = at(&gated, 0.96);
        assert_eq!((g.served, g.wrong_share()), (0, None));

        // Wrong ≤ 0 with the gate: first at 0.89; without it only at 0.93.
        assert_eq!(choose(&gated, 0.0).map(|p| p.threshold), Some(0.89));
        assert_eq!(choose(&plain, 0.0).map(|p| p.threshold), Some(0.93));
        // A looser target is met lower: 1 wrong of 5 at 0.73 with the gate, 2 of 6 below.
        assert_eq!(choose(&gated, 0.25).map(|p| p.threshold), Some(0.73));
        assert_eq!(choose(&gated, 0.34).map(|p| p.threshold), Some(0.70));
        // Nothing meets a target when every threshold serves a wrong pair or nothing.
        let traps = [s(0.99, true, false), s(0.995, true, true)];
        assert_eq!(choose(&pairs_curve(&traps, true), 0.02), None);
    }

    #[test]
    fn log_curve_has_no_verdicts_below_the_lowest_served() {
        let s = |similarity, gate, served, wrong| LogSample {
            similarity,
            gate,
            served,
            threshold: Some(0.90),
            wrong,
        };
        let samples = [
            s(0.97, true, true, Some(false)),
            s(0.93, true, true, Some(true)),
            s(0.91, true, true, None),
            s(0.90, true, true, Some(false)),
            s(0.88, false, false, None), // gate rejected: not a hit
            s(0.80, true, false, None),  // below the threshold served at
            s(0.50, true, false, None),
        ];
        let c = log_curve(&samples);
        let p = at(&c, 0.90);
        assert_eq!((p.eligible, p.hits, p.judged, p.wrong), (7, 4, 3, 1));
        assert_eq!(p.wrong_share(), Some(1.0 / 3.0));
        let p = at(&c, 0.95);
        assert_eq!((p.hits, p.judged, p.wrong), (1, 1, 0));
        // Below 0.90 the hit rate grows but nothing served there was judged.
        let p = at(&c, 0.80);
        assert_eq!((p.hits, p.judged, p.wrong_share()), (5, 0, None));
        assert_eq!(p.hit_rate(), Some(5.0 / 7.0));
        let p = at(&c, 0.89);
        assert_eq!((p.hits, p.judged), (4, 0));
        assert_eq!(choose(&c, 0.34).map(|p| p.threshold), Some(0.90));
        assert_eq!(choose(&c, 0.0).map(|p| p.threshold), Some(0.94));
        assert_eq!(choose(&log_curve(&[]), 0.5), None);
    }

    /// On the upper bound, thirty judged answers without a wrong one are not enough for a
    /// 2 % target; three thousand are.
    #[test]
    fn choosing_on_the_upper_bound_asks_for_evidence() {
        let point = |threshold, judged| Point {
            threshold,
            eligible: judged,
            hits: judged,
            served: judged,
            judged,
            wrong: 0,
        };
        let few = [point(0.80, 30), point(0.90, 3000)];
        assert_eq!(choose(&few, 0.02).map(|p| p.threshold), Some(0.80));
        assert_eq!(
            choose_by_upper_bound(&few, 0.02).map(|p| p.threshold),
            Some(0.90)
        );
        assert_eq!(choose_by_upper_bound(&few[..1], 0.02), None);
    }

    #[test]
    fn the_upper_bound_shrinks_with_evidence() {
        let p = |judged, wrong| Point {
            threshold: 0.9,
            eligible: judged,
            hits: judged,
            served: judged,
            judged,
            wrong,
        };
        let few = p(10, 0).wrong_share_upper().unwrap();
        let many = p(1000, 0).wrong_share_upper().unwrap();
        assert!(few > 0.2 && many < 0.005, "{few} {many}");
        let u = p(100, 2).wrong_share_upper().unwrap();
        assert!(u > 0.02 && u < 0.08, "{u}");
        assert_eq!(p(0, 0).wrong_share_upper(), None);
    }
}
