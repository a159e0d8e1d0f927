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
//! On the wire (Redis, snapshots) a vector is a JSON array of numbers, as before.

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

    /// Euclidean norm.
    pub fn norm(&self) -> f32 {
        self.dot_vector(self).sqrt()
    }

    /// Bytes its one allocation takes: the `Arc`'s two counts and the components.
    pub fn heap_bytes(&self) -> usize {
        2 * std::mem::size_of::<usize>() + std::mem::size_of_val::<[f16]>(&self.0)
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

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
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
        s.collect_seq(self.0.iter().map(|x| x.to_f32()))
    }
}

impl<'de> Deserialize<'de> for Vector {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<f32>::deserialize(d).map(Self::from)
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
        assert!((Vector::new(&a).norm() - 1.0).abs() < 1e-4);
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
        // Too large for a half float: not finite, so readers can refuse it.
        assert!(!Vector::new(&[1.0e6, 0.0]).is_finite());
        assert!(Vector::new(&[0.5, -0.25]).is_finite());
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
