//! Learned similarity thresholds under an error bound.
//!
//! An operator sets `delta`, the largest share of semantic hits that may be wrong. Verdicts
//! on answers matched by meaning (feedback, and checks of near misses against the answer the
//! backend then gave) come with the similarity at which the candidate was found. [`Evidence`]
//! keeps them by similarity bin; [`Evidence::threshold`] picks the lowest threshold `t` such
//! that, among the verdicts at similarity `t` or more, the share of wrong ones is at most
//! `delta` with confidence: its Wilson upper bound, at a level split over every threshold the
//! rule could pick (a union bound), so the guarantee holds for the threshold picked, not only
//! for a threshold fixed in advance. Serving every candidate at or above `t` then keeps the
//! wrong share of those hits at most `delta` with probability about `1 - alpha`, as far as
//! future questions resemble the ones judged. What the level does not cover, stated plainly:
//! the threshold is recomputed as verdicts arrive (each recomputation is another look at the
//! data), Wilson's bound is an approximation in the tails, and verdicts of different sources
//! (feedback, near-miss and hit checks, each sampled at its own rate) are pooled as if they
//! were a sample of served hits. The level is a guide for tuning, not a certificate.
//!
//! - With little evidence the bound is wide and no threshold qualifies: the configured
//!   threshold stays, or is raised to the lowest similarity from which up the verdicts do
//!   not show more than `delta` wrong, by a small margin (`RAISE_Z`): wrong verdicts
//!   tighten at once, and the threshold comes back down as right verdicts outweigh them.
//!   Where not even identical vectors keep the bound, the threshold passes 1 and nothing is
//!   served by meaning (near misses, still checked, are what can bring it back).
//! - A configured threshold between two bin edges shares its bin with near misses under it:
//!   that bin's right verdicts do not vouch for it, its wrong ones count against it.
//! - With more right verdicts the bound narrows and the threshold may fall below the
//!   configured one, but never below a floor, and only down to similarities where verdicts
//!   exist: evidence above the configured threshold says nothing of the band below it, so
//!   the band a lower threshold opens must keep the bound on its own verdicts (and every
//!   verdict from there up with them). Many right verdicts on served hits never outweigh
//!   wrong ones under the threshold.
//!
//! The idea of learning thresholds online under a user-set error bound comes from vCache
//! (arXiv 2502.03771), which fits one curve per cached entry. Here the same estimator runs
//! per scope (a tenant's policy) and, where an entry has verdicts of its own, per entry,
//! with the scope's learned threshold as the entry's configured one (the server's
//! `bounds::Entries`); an entry reported wrong for a question also refuses that question's
//! neighbourhood on its own (the cache crate's refusals).

/// Similarity bins: 0.01 wide over [0, 1].
const BINS: usize = 100;

/// The margin of the raising side: a threshold is raised where the Wilson lower bound of the
/// wrong share at this many standard deviations (84 % one-sided) is over `delta`. Far less
/// than the loosening side's union-bounded level, on purpose: a raise in error costs hits,
/// never a wrong answer, and the margin is how far over `delta` the threshold may rest (a
/// distance that shrinks as verdicts accumulate). With none, every wrong verdict at a
/// threshold whose share is near `delta` would raise it; with the loosening side's level, it
/// rests well over `delta` (measured in docs/BENCHMARKS.md).
const RAISE_Z: f64 = 1.0;

/// Verdicts by similarity.
#[derive(Debug, Clone)]
pub struct Evidence {
    right: [f64; BINS + 1],
    wrong: [f64; BINS + 1],
}

impl Default for Evidence {
    fn default() -> Self {
        Evidence {
            right: [0.0; BINS + 1],
            wrong: [0.0; BINS + 1],
        }
    }
}

/// What [`Evidence::threshold`] decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    /// The threshold to serve at.
    pub threshold: f32,
    /// The verdicts at or above it.
    pub verdicts: f64,
    /// The share of wrong verdicts at or above it (0 without verdicts).
    pub wrong_observed: f64,
    /// The lower confidence bound of that share, at the level of `wrong_upper` (0 without
    /// verdicts).
    pub wrong_lower: f64,
    /// The upper confidence bound of that share (1 without verdicts).
    pub wrong_upper: f64,
    /// Whether the verdicts lowered it below the configured threshold.
    pub learned: bool,
}

/// The bin of `similarity` (0 to 100): what [`Evidence::bins`] names a bin by.
pub fn bin_of(similarity: f32) -> u8 {
    bin(similarity) as u8
}

fn bin(similarity: f32) -> usize {
    // With slack for f32 rounding, so 0.58 is bin 58, not 57.
    let s = f64::from(similarity.clamp(0.0, 1.0));
    ((s * BINS as f64 + 1e-4).floor() as usize).min(BINS)
}

fn edge(b: usize) -> f32 {
    b as f32 / BINS as f32
}

/// The first bin whose every similarity is at or above `threshold`: the bin of a threshold
/// between two edges also holds similarities under it (near misses, never served), which say
/// nothing of what was served.
fn bin_from(threshold: f32) -> usize {
    let b = bin(threshold);
    if edge(b) + 1e-6 < threshold {
        (b + 1).min(BINS)
    } else {
        b
    }
}

impl Evidence {
    /// Records a verdict on a candidate found at `similarity`.
    pub fn record(&mut self, similarity: f32, wrong: bool) {
        let b = bin(similarity);
        if wrong {
            self.wrong[b] += 1.0;
        } else {
            self.right[b] += 1.0;
        }
    }

    /// Verdicts recorded.
    pub fn total(&self) -> f64 {
        self.right.iter().sum::<f64>() + self.wrong.iter().sum::<f64>()
    }

    /// Halves every count (old verdicts weigh less; call it when the totals grow large).
    pub fn decay(&mut self) {
        for c in self.right.iter_mut().chain(self.wrong.iter_mut()) {
            *c /= 2.0;
        }
    }

    /// The threshold for `delta` at confidence `1 - alpha`: see the module. `configured` is
    /// the policy's threshold, `floor` the lowest it may learn.
    pub fn threshold(&self, delta: f64, alpha: f64, configured: f32, floor: f32) -> Learned {
        // One-sided level split over every bin the rule may pick.
        let z = normal_quantile(1.0 - alpha / (BINS as f64 + 1.0));
        let (floor_bin, configured_bin) = (bin(floor), bin(configured));
        // Where what was served at the configured threshold starts.
        let served_bin = bin_from(configured);
        let (mut n, mut w) = (0.0, 0.0);
        // The verdicts of the band a lower threshold would open: from the bin up to where
        // what was served starts.
        let (mut band_n, mut band_w) = (0.0, 0.0);
        // The lowest bin under the configured one (with verdicts of its own) whose verdicts
        // from there up, and those of the band it opens alone, show at most delta wrong, for
        // sure.
        let mut lowest_safe = None;
        // At or above the configured threshold: the lowest bin from which up the verdicts do
        // not show more than delta wrong by more than the raising margin (a bin without
        // verdicts from there up qualifies). See `RAISE_Z` for why that margin is small.
        let mut lowest_within = BINS + 1;
        for b in (0..=BINS).rev() {
            let here = self.right[b] + self.wrong[b];
            n += here;
            w += self.wrong[b];
            // The band under the configured threshold; of a threshold between two edges, its
            // own bin's wrong verdicts too (its right ones may be of hits it served).
            if b < configured_bin {
                band_n += here;
                band_w += self.wrong[b];
            } else if b == configured_bin && served_bin != configured_bin {
                band_n += self.wrong[b];
                band_w += self.wrong[b];
            }
            if b >= served_bin && wilson_lower(w, n, RAISE_Z) <= delta {
                lowest_within = b;
            }
            if here == 0.0 || b >= configured_bin || b < floor_bin {
                continue;
            }
            // Right verdicts on what was served say nothing of the band under it: however
            // many, they never vouch for its wrong ones.
            if wilson_upper(w, n, z) <= delta && wilson_upper(band_w, band_n, z) <= delta {
                lowest_safe = Some(b);
            }
        }
        // A configured threshold inside a bin: that bin's wrong verdicts may be of hits it
        // served, its right ones of near misses under it. Counted against it, not for it.
        let partial_holds = served_bin == configured_bin || {
            let (n, w) = self.at_least(served_bin);
            let extra = self.wrong[configured_bin];
            wilson_lower(w + extra, n + extra, RAISE_Z) <= delta
        };
        let chosen = if lowest_within == served_bin && partial_holds {
            // Verdicts only ever loosen the configured threshold (what they show above it
            // says nothing against the band between).
            lowest_safe.map_or(configured_bin, |b| b.min(configured_bin))
        } else if lowest_within == served_bin {
            // Only the partial bin's wrong verdicts break it: up to the next edge.
            served_bin
        } else {
            // Too loose as observed: up to where it is not, whatever lies below.
            lowest_within
        };
        // Past the last bin (even identical vectors are wrong too often): nothing is served
        // by meaning.
        let threshold = if chosen == configured_bin {
            configured
        } else {
            // Bins start on the hundredths: a floor between them keeps its own value.
            edge(chosen).max(floor)
        };
        let (n, w) = self.at_least(bin_from(threshold));
        Learned {
            threshold,
            verdicts: n,
            wrong_observed: if n > 0.0 { w / n } else { 0.0 },
            wrong_lower: wilson_lower(w, n, z),
            wrong_upper: wilson_upper(w, n, z),
            learned: chosen < configured_bin,
        }
    }

    /// Adds `other`'s verdicts (another replica's) to these.
    pub fn merge(&mut self, other: &Evidence) {
        for (a, b) in self.right.iter_mut().zip(other.right.iter()) {
            *a += b;
        }
        for (a, b) in self.wrong.iter_mut().zip(other.wrong.iter()) {
            *a += b;
        }
    }

    /// The bins holding verdicts, as (bin, right, wrong): the form replicas share.
    pub fn bins(&self) -> Vec<(u8, f64, f64)> {
        (0..=BINS)
            .filter(|&b| self.right[b] > 0.0 || self.wrong[b] > 0.0)
            .map(|b| (b as u8, self.right[b], self.wrong[b]))
            .collect()
    }

    /// Evidence from [`Evidence::bins`]; `None` when a bin is out of range or a count is not
    /// a finite number from 0 to `max_count` (what another replica sent is checked, never
    /// trusted).
    pub fn from_bins(bins: &[(u8, f64, f64)], max_count: f64) -> Option<Evidence> {
        let mut e = Evidence::default();
        let ok = |c: f64| c.is_finite() && (0.0..=max_count).contains(&c);
        for &(b, right, wrong) in bins {
            let b = usize::from(b);
            if b > BINS || !ok(right) || !ok(wrong) {
                return None;
            }
            e.right[b] += right;
            e.wrong[b] += wrong;
        }
        (e.total() <= max_count).then_some(e)
    }

    fn at_least(&self, from: usize) -> (f64, f64) {
        let n = (from..=BINS).map(|b| self.right[b] + self.wrong[b]).sum();
        let w = (from..=BINS).map(|b| self.wrong[b]).sum();
        (n, w)
    }
}

/// Wilson score upper bound of a proportion `w / n` at normal quantile `z`.
pub fn wilson_upper(w: f64, n: f64, z: f64) -> f64 {
    wilson(w, n, z, 1.0)
}

/// Wilson score lower bound.
pub fn wilson_lower(w: f64, n: f64, z: f64) -> f64 {
    wilson(w, n, z, -1.0)
}

fn wilson(w: f64, n: f64, z: f64, sign: f64) -> f64 {
    if n <= 0.0 {
        return if sign > 0.0 { 1.0 } else { 0.0 };
    }
    let p = w / n;
    let z2 = z * z;
    let centre = p + z2 / (2.0 * n);
    let spread = z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre + sign * spread) / (1.0 + z2 / n)).clamp(0.0, 1.0)
}

/// The standard normal quantile (Acklam's rational approximation, relative error < 1.2e-9).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let low = 0.02425;
    if p < low {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - low {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -normal_quantile(1.0 - p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_bounds_are_right() {
        assert!((normal_quantile(0.975) - 1.959964).abs() < 1e-5);
        assert!((normal_quantile(0.95) - 1.644854).abs() < 1e-5);
        assert!((normal_quantile(0.05) + 1.644854).abs() < 1e-5);
        // 0 wrong of 100 at 95 %: about 2.6 %.
        let u = wilson_upper(0.0, 100.0, 1.644854);
        assert!((u - 0.0263).abs() < 0.001, "{u}");
        assert_eq!(wilson_lower(0.0, 100.0, 1.644854), 0.0);
        assert!(wilson_lower(50.0, 100.0, 1.96) > 0.39);
    }

    #[test]
    fn bins_are_where_the_similarity_is_written() {
        assert_eq!(bin(0.58), 58);
        assert_eq!(bin(0.83), 83);
        assert_eq!(bin(0.999), 99);
        assert_eq!(bin(1.0), 100);
    }

    #[test]
    fn near_misses_under_a_threshold_between_edges_do_not_vouch_for_what_was_served() {
        // Configured 0.865: near misses at 0.862 share its bin with the hits served at
        // 0.868; every served hit was wrong, and the threshold must rise past them.
        let mut e = Evidence::default();
        for _ in 0..300 {
            e.record(0.862, false);
        }
        for _ in 0..3 {
            e.record(0.868, true);
            e.record(0.87, true);
        }
        let l = e.threshold(0.02, 0.05, 0.865, 0.7);
        assert!(l.threshold > 0.87, "{l:?}");
        assert_eq!(l.verdicts, 0.0, "{l:?}");
        // Wrong verdicts inside the threshold's own bin, none above: they may be of hits it
        // served, so they raise it to the next edge.
        let mut e = Evidence::default();
        for _ in 0..300 {
            e.record(0.862, false);
        }
        for _ in 0..30 {
            e.record(0.868, true);
        }
        let l = e.threshold(0.02, 0.05, 0.865, 0.7);
        assert!(l.threshold >= 0.87, "{l:?}");
        // Right verdicts there change nothing.
        let mut e = Evidence::default();
        for _ in 0..30 {
            e.record(0.868, false);
        }
        assert_eq!(e.threshold(0.02, 0.05, 0.865, 0.7).threshold, 0.865);
        // On an edge, nothing changes: the bin is the threshold's.
        assert_eq!(bin_from(0.86), 86);
        assert_eq!(bin_from(0.865), 87);
        assert_eq!(bin_from(1.0), BINS);
    }

    #[test]
    fn right_verdicts_above_the_configured_threshold_never_raise_it() {
        let mut e = Evidence::default();
        for _ in 0..600 {
            e.record(0.90, false);
        }
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert_eq!(l.threshold, 0.86, "{l:?}");
        assert!(!l.learned);
    }

    #[test]
    fn a_floor_between_bins_is_never_undercut() {
        let mut e = Evidence::default();
        for _ in 0..2000 {
            e.record(0.751, false);
        }
        // Every verdict is right: it loosens as far as it may, to the floor itself.
        let l = e.threshold(0.02, 0.05, 0.86, 0.755);
        assert!(l.learned, "{l:?}");
        assert_eq!(l.threshold, 0.755, "{l:?}");
    }

    #[test]
    fn shared_bins_round_trip_merge_and_are_checked() {
        let mut a = Evidence::default();
        a.record(0.80, false);
        a.record(0.80, true);
        a.record(0.95, false);
        let bins = a.bins();
        assert_eq!(bins, vec![(80, 1.0, 1.0), (95, 1.0, 0.0)]);
        let back = Evidence::from_bins(&bins, 1e6).unwrap();
        assert_eq!(back.bins(), bins);
        // Merged evidence decides as if one replica had seen it all.
        let mut b = Evidence::default();
        for _ in 0..20 {
            b.record(0.88, true);
        }
        let mut one = a.clone();
        for _ in 0..20 {
            one.record(0.88, true);
        }
        a.merge(&b);
        assert_eq!(a.bins(), one.bins());
        assert_eq!(
            a.threshold(0.05, 0.05, 0.86, 0.7),
            one.threshold(0.05, 0.05, 0.86, 0.7)
        );
        assert!(a.threshold(0.05, 0.05, 0.86, 0.7).threshold > 0.88);
        // Out of range, negative, not finite, too many: refused whole.
        assert!(Evidence::from_bins(&[(101, 1.0, 0.0)], 1e6).is_none());
        assert!(Evidence::from_bins(&[(50, -1.0, 0.0)], 1e6).is_none());
        assert!(Evidence::from_bins(&[(50, f64::NAN, 0.0)], 1e6).is_none());
        assert!(Evidence::from_bins(&[(50, 6.0, 0.0), (51, 6.0, 0.0)], 10.0).is_none());
    }

    #[test]
    fn without_evidence_the_configured_threshold_stays() {
        let e = Evidence::default();
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert_eq!(l.threshold, 0.86);
        assert!(!l.learned);
        assert_eq!(l.wrong_upper, 1.0);
    }

    #[test]
    fn wrong_verdicts_tighten_at_once() {
        let mut e = Evidence::default();
        for _ in 0..3 {
            e.record(0.905, true);
        }
        e.record(0.95, false);
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert!(l.threshold > 0.905, "{l:?}");
        assert!(!l.learned);
        // Above the wrong band, right verdicts only: still there, not lower.
        assert!(l.threshold <= 0.92, "{l:?}");
    }

    #[test]
    fn right_verdicts_loosen_down_to_where_they_were_seen() {
        let mut e = Evidence::default();
        // Many right verdicts from 0.80 up, one wrong among them.
        for i in 0..8000 {
            let s = 0.80 + (i % 20) as f32 * 0.01;
            e.record(s, false);
        }
        e.record(0.85, true);
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert!(l.learned, "{l:?}");
        assert!((l.threshold - 0.80).abs() < 1e-6, "{l:?}");
        assert!(l.wrong_upper <= 0.02);
        // Never below the floor, nor below the verdicts' band.
        let l = e.threshold(0.02, 0.05, 0.86, 0.83);
        assert!((l.threshold - 0.83).abs() < 1e-6, "{l:?}");
        // A stricter bound needs more: stays at or above where it holds.
        let strict = e.threshold(0.001, 0.05, 0.86, 0.7);
        assert!(
            strict.threshold >= l.threshold || !strict.learned,
            "{strict:?}"
        );
    }

    #[test]
    fn a_wrong_share_over_delta_tightens_before_it_is_certain() {
        // 0.87 up: 10 wrong of 200 (5 %, all at 0.87) against a bound of 2 %: over it by more
        // than the raising margin, not with the confidence of the loosening side (the band
        // where the threshold used to stay). It rises to 0.88, where none are wrong.
        let mut e = Evidence::default();
        for i in 0..200 {
            let s = 0.87 + (i % 10) as f32 * 0.01;
            e.record(s, i % 10 == 0 && i < 100);
        }
        let (delta, alpha) = (0.02, 0.05);
        let union = normal_quantile(1.0 - alpha / (BINS as f64 + 1.0));
        let (n, w) = e.at_least(bin(0.87));
        assert_eq!((n, w), (200.0, 10.0));
        assert!(wilson_lower(w, n, union) <= delta);
        let l = e.threshold(delta, alpha, 0.86, 0.7);
        assert!((l.threshold - 0.88).abs() < 1e-6, "{l:?}");
        assert!(!l.learned);
        // Right verdicts that outweigh the wrong ones bring it back down.
        for _ in 0..400 {
            e.record(0.87, false);
        }
        assert_eq!(e.threshold(delta, alpha, 0.86, 0.7).threshold, 0.86);
    }

    #[test]
    fn the_lowest_threshold_within_the_bound_is_taken_and_none_when_nothing_is() {
        // Wrong verdicts at the top (identical-looking questions meant differently) and a
        // clean band below: the threshold goes to where the share from there up is within
        // the bound, not above the highest wrong verdict.
        let mut e = Evidence::default();
        for i in 0..100 {
            e.record(0.90 + (i % 10) as f32 * 0.01, false);
        }
        e.record(0.99, true);
        for _ in 0..5 {
            e.record(0.87, true);
        }
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert!((l.threshold - 0.88).abs() < 1e-6, "{l:?}");
        // Where not even identical vectors keep the bound, nothing is served by meaning.
        let mut e = Evidence::default();
        e.record(1.0, true);
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert!(l.threshold > 1.0, "{l:?}");
    }

    /// Right verdicts on served hits above the configured threshold, however many, never
    /// vouch for a band under it whose own verdicts break the bound.
    #[test]
    fn right_verdicts_above_never_vouch_for_a_wrong_band_below() {
        let mut e = Evidence::default();
        for i in 0..100 {
            e.record(0.80, i < 30);
        }
        for _ in 0..20_000 {
            e.record(0.95, false);
        }
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert_eq!(l.threshold, 0.86, "{l:?}");
        assert!(!l.learned);
        // A clean band with enough verdicts of its own opens, whatever lies above.
        let mut e = Evidence::default();
        for _ in 0..1000 {
            e.record(0.83, false);
        }
        for _ in 0..20_000 {
            e.record(0.95, false);
        }
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert!((l.threshold - 0.83).abs() < 1e-6, "{l:?}");
        // A threshold between two edges: the right verdicts of hits it served in its own bin
        // do not vouch for the band under it either.
        let mut e = Evidence::default();
        for i in 0..100 {
            e.record(0.85, i < 30);
        }
        for _ in 0..20_000 {
            e.record(0.868, false);
        }
        let l = e.threshold(0.02, 0.05, 0.865, 0.7);
        assert_eq!(l.threshold, 0.865, "{l:?}");
        // Too few of its own: shut, though the verdicts from there up would pass.
        let mut e = Evidence::default();
        for _ in 0..50 {
            e.record(0.83, false);
        }
        for _ in 0..20_000 {
            e.record(0.95, false);
        }
        assert_eq!(e.threshold(0.02, 0.05, 0.86, 0.7).threshold, 0.86);
    }

    #[test]
    fn many_wrong_verdicts_in_a_band_keep_the_threshold_above_it() {
        let mut e = Evidence::default();
        for i in 0..1000 {
            e.record(0.90 + (i % 10) as f32 * 0.01, false);
        }
        for i in 0..300 {
            e.record(0.85 + (i % 5) as f32 * 0.01, i % 3 == 0);
        }
        let l = e.threshold(0.02, 0.05, 0.86, 0.7);
        assert!(l.threshold >= 0.89, "{l:?}");
        assert!(l.wrong_upper <= 0.02 || !l.learned);
    }
}
