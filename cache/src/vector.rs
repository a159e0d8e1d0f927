//! A stored embedding: its components as IEEE half floats, shared.
//!
//! Every stored entry with an embedding holds one, and the semantic index and the entry's
//! refusals share it rather than copy it: at 384 dimensions it is 768 bytes instead of 1,536.
//! A half float keeps 11 significant bits, so each component of a unit vector is within
//! 2⁻¹¹ of itself relatively; a similarity computed against one is within about 10⁻⁴ of the
//! full-precision one (the tests below bound it), well inside the 0.01 steps thresholds are
//! set and learned in.
//!
//! Queries stay `f32`: a similarity is the dot product of a fresh `f32` query with a stored
//! vector, converted in chunks (`half` uses the CPU's F16C conversions where the CPU has
//! them, checked at run time).
//!
//! On the wire (Redis, snapshots) a vector is a JSON array of numbers, as before, each written
//! in the fewest digits that read back as the same half float; an `f32` array stored before
//! reads as well.

use std::fmt;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Components converted at a time when computing a similarity (on the stack).
const CHUNK: usize = 64;

/// A stored embedding. Cloning shares it.
#[derive(Clone, PartialEq)]
pub struct Vector(Arc<[f16]>);

impl Vector {
    /// Rounds each component to the nearest half float.
    pub fn new(v: &[f32]) -> Self {
        let mut h = vec![f16::ZERO; v.len()];
        h.convert_from_f32_slice(v);
        Self(h.into())
    }

    /// [`Vector::new`], or `None` when a component is not finite as a half float (NaN, or
    /// beyond ±65,504): such a vector is never stored, since JSON has no number for it.
    pub fn finite(v: &[f32]) -> Option<Self> {
        Some(Self::new(v)).filter(Self::is_finite)
    }

    /// Components.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it has no components.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether every component is a finite number.
    pub fn is_finite(&self) -> bool {
        self.0.iter().all(|x| x.is_finite())
    }

    /// The components as `f32`.
    pub fn to_f32(&self) -> Vec<f32> {
        self.0.to_f32_vec()
    }

    /// Dot product with a full-precision vector (over the shorter of the two).
    pub fn dot(&self, query: &[f32]) -> f32 {
        let mut buf = [0f32; CHUNK];
        self.0
            .chunks(CHUNK)
            .zip(query.chunks(CHUNK))
            .map(|(h, q)| {
                let n = h.len().min(q.len());
                h[..n].convert_to_f32_slice(&mut buf[..n]);
                dot(&buf[..n], &q[..n])
            })
            .sum()
    }

    /// Dot product with another stored vector (over the shorter of the two).
    pub fn dot_vector(&self, other: &Vector) -> f32 {
        let (mut a, mut b) = ([0f32; CHUNK], [0f32; CHUNK]);
        self.0
            .chunks(CHUNK)
            .zip(other.0.chunks(CHUNK))
            .map(|(x, y)| {
                let n = x.len().min(y.len());
                x[..n].convert_to_f32_slice(&mut a[..n]);
                y[..n].convert_to_f32_slice(&mut b[..n]);
                dot(&a[..n], &b[..n])
            })
            .sum()
    }

    /// Cosine similarity with a full-precision vector (over the shorter of the two; 0 when
    /// either is zero), in one pass.
    pub fn cosine(&self, query: &[f32]) -> f32 {
        let mut buf = [0f32; CHUNK];
        let (mut ab, mut aa, mut bb) = (0f32, 0f32, 0f32);
        for (h, q) in self.0.chunks(CHUNK).zip(query.chunks(CHUNK)) {
            let n = h.len().min(q.len());
            h[..n].convert_to_f32_slice(&mut buf[..n]);
            for (x, y) in buf[..n].iter().zip(&q[..n]) {
                ab += x * y;
                aa += x * x;
                bb += y * y;
            }
        }
        let n = (aa * bb).sqrt();
        if n == 0.0 {
            0.0
        } else {
            ab / n
        }
    }

    /// Bytes its one allocation takes: the `Arc`'s two counts and the components.
    pub fn heap_bytes(&self) -> usize {
        Self::bytes_for(self.len())
    }

    /// Bytes one vector of `dim` components allocates.
    pub const fn bytes_for(dim: usize) -> usize {
        2 * std::mem::size_of::<usize>() + dim * std::mem::size_of::<f16>()
    }

    /// How many handles share this one's allocation.
    pub fn handles(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Whether two handles share one allocation.
    pub fn ptr_eq(a: &Vector, b: &Vector) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

/// Lanes summed apart in [`dot`]: one running sum is a chain of dependent additions the
/// compiler may not reorder (floating point), so it runs one product at a time; sixteen
/// independent sums compile to vector instructions.
const LANES: usize = 16;

/// Dot product of two `f32` slices (over the shorter of the two), summed in [`LANES`] lanes
/// so that it compiles to vector instructions.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let (xs, ys) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = xs
        .remainder()
        .iter()
        .zip(ys.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in xs.zip(ys) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

impl From<&[f32]> for Vector {
    fn from(v: &[f32]) -> Self {
        Self::new(v)
    }
}

impl From<Vec<f32>> for Vector {
    fn from(v: Vec<f32>) -> Self {
        Self::new(&v)
    }
}

impl From<&Arc<[f32]>> for Vector {
    fn from(v: &Arc<[f32]>) -> Self {
        Self::new(v)
    }
}

impl fmt::Debug for Vector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|x| x.to_f32()))
            .finish()
    }
}

impl Serialize for Vector {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let table = shortest_table();
        s.collect_seq(self.0.iter().map(|x| table[usize::from(x.to_bits())]))
    }
}

/// For each half float (by its bits), the `f32` with the fewest significant digits that rounds
/// back to it: JSON writes each component in as few characters as the half float needs
/// (`0.01233` where its exact value prints as `0.012329102`): a fifth or more fewer bytes per
/// stored vector (the tests below check it). Built once (65,536 values, 256 KiB) on the first
/// write.
fn shortest_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Box<[f32]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| {
                let h = f16::from_bits(bits);
                let x = h.to_f32();
                if !x.is_finite() || x == 0.0 {
                    return x;
                }
                // Five significant digits always tell two half floats apart.
                (1..=5)
                    .filter_map(|digits| format!("{x:.*e}", digits - 1).parse::<f32>().ok())
                    .find(|y| f16::from_f32(*y).to_bits() == bits)
                    .unwrap_or(x)
            })
            .collect()
    })
}

/// The largest squared length a stored vector may have: a unit vector's, with room for the
/// rounding of its components to half floats.
const MAX_SQUARED_NORM: f32 = 1.01;

impl<'de> Deserialize<'de> for Vector {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // What Redis or a snapshot holds is checked as what is stored: a component beyond a
        // half float's range would make every similarity with it infinite (served for any
        // question) or NaN (sorting before every real candidate).
        // Nor may it be longer than a unit vector (the embedder's are normalised): one of
        // finite but large components would reach any threshold with any question. A
        // shorter one only lowers its similarities.
        let v = Vec::<f32>::deserialize(d)?;
        let v = Self::finite(&v).ok_or_else(|| {
            serde::de::Error::custom("a vector component is not a finite half float")
        })?;
        let squared: f32 = v.to_f32().iter().map(|x| x * x).sum();
        if squared > MAX_SQUARED_NORM {
            return Err(serde::de::Error::custom(
                "a vector is longer than a unit vector",
            ));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit vector of `dim` pseudo-random components.
    fn unit(dim: usize, mut seed: u64) -> Vec<f32> {
        let v: Vec<f32> = (0..dim)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % 20_000) as f32 / 10_000.0 - 1.0
            })
            .collect();
        let n = dot(&v, &v).sqrt();
        v.iter().map(|x| x / n).collect()
    }

    #[test]
    fn similarities_stay_within_a_ten_thousandth_of_full_precision() {
        let mut worst = 0f32;
        for i in 0..200u64 {
            let (a, b) = (unit(384, 2 * i + 1), unit(384, 2 * i + 2));
            // Pull b towards a for similarities across the range, near 1 included.
            let t = i as f32 / 200.0;
            let mix: Vec<f32> = a
                .iter()
                .zip(&b)
                .map(|(x, y)| t * x + (1.0 - t) * y)
                .collect();
            let n = dot(&mix, &mix).sqrt();
            let mix: Vec<f32> = mix.iter().map(|x| x / n).collect();
            let exact = dot(&a, &mix);
            worst = worst.max((Vector::new(&mix).dot(&a) - exact).abs());
            worst = worst.max((Vector::new(&mix).dot_vector(&Vector::new(&a)) - exact).abs());
        }
        assert!(worst < 1e-4, "off by {worst}");
        let a = unit(384, 7);
        assert!((Vector::new(&a).dot(&a) - 1.0).abs() < 1e-4);
        let twice: Vec<f32> = a.iter().map(|x| 2.0 * x).collect();
        assert!((Vector::new(&a).cosine(&twice) - 1.0).abs() < 1e-4);
        assert_eq!(Vector::new(&a).cosine(&vec![0.0; 384]), 0.0);
    }

    #[test]
    fn it_takes_two_bytes_a_component_and_travels_as_numbers() {
        let v = Vector::new(&unit(384, 3));
        assert_eq!(v.heap_bytes(), 16 + 768);
        let json = serde_json::to_string(&v).unwrap();
        let back: Vector = serde_json::from_str(&json).unwrap();
        assert_eq!(back, v, "a stored vector survives its wire form exactly");
        let plain: Vec<f32> = serde_json::from_str(&json).unwrap();
        assert_eq!(plain.len(), 384);
        // Each component in as few digits as tell it apart: shorter than its exact value's.
        let exact = serde_json::to_string(&v.to_f32()).unwrap();
        assert!(
            json.len() * 5 < exact.len() * 4,
            "{} bytes, {} written exactly",
            json.len(),
            exact.len()
        );
        // Too large for a half float: not finite, so it is not stored, and readers refuse it.
        assert!(!Vector::new(&[1.0e6, 0.0]).is_finite());
        assert!(Vector::finite(&[1.0e6, 0.0]).is_none());
        assert!(Vector::finite(&[f32::NAN, 0.0]).is_none());
        assert!(Vector::finite(&[0.5, -0.25]).is_some());
    }

    #[test]
    fn a_stored_vector_beyond_half_floats_is_refused_on_read() {
        // Read from Redis or a snapshot: refused, as it is never written.
        assert!(serde_json::from_str::<Vector>("[70000, 0]").is_err());
        assert!(serde_json::from_str::<Vector>("[-1e9, 0.5]").is_err());
        let v: Vector = serde_json::from_str("[0.5, -0.25]").unwrap();
        assert_eq!(v.len(), 2);
        // Finite but longer than a unit vector: it would pass any threshold.
        assert!(serde_json::from_str::<Vector>("[60000, 0]").is_err());
        assert!(serde_json::from_str::<Vector>("[0.8, 0.8]").is_err());
        let unit: Vector = serde_json::from_str("[0.6, 0.8]").unwrap();
        assert_eq!(unit.len(), 2);
    }

    #[test]
    fn every_half_float_survives_its_shortest_form() {
        let table = shortest_table();
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            // Not finite: never stored (`Vector::finite`).
            if !h.is_finite() {
                continue;
            }
            let y = table[usize::from(bits)];
            // Through JSON text, as a reader sees it.
            let back: f32 = serde_json::from_str(&serde_json::to_string(&y).unwrap()).unwrap();
            assert_eq!(f16::from_f32(back), h, "bits {bits:#06x}: {y}");
        }
    }

    #[test]
    fn dot_products_cover_lengths_that_are_not_whole_chunks() {
        let a: Vec<f32> = (0..100).map(|i| i as f32 / 100.0).collect();
        let exact = dot(&a, &a);
        assert!((Vector::new(&a).dot(&a) - exact).abs() / exact < 1e-3);
        assert!((Vector::new(&a).dot_vector(&Vector::new(&a)) - exact).abs() / exact < 1e-3);
        // Different lengths: over the shorter.
        assert!((Vector::new(&a[..10]).dot(&a) - dot(&a[..10], &a[..10])).abs() < 1e-3);
    }
}
