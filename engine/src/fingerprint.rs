//! Chunk fingerprints: 128 bits that tell whether two copies of a chunk hold the same bytes.
//!
//! possum proves an image equal to the job at T0 by content: the fingerprint of every chunk it
//! saved (taken of the bytes copied, so a write racing the copy shows) must equal the chunk's
//! fingerprint at T0 (taken on the device while the job was held). The function is built to run
//! at memory bandwidth on a GPU and with wide multiplies on a CPU, and every implementation (this
//! one, the host backend's, the CUDA kernel in `cuda/kernels/fingerprint.cu`) computes the same
//! bits.
//!
//! # Definition
//! The bytes are zero-padded to a multiple of 8 and read as pairs of little-endian `u32`
//! words `(a_j, b_j)`, `j = 0, 1, ...`. With position keys `k_c(j) = j * M_c + A_c` (wrapping
//! `u32` arithmetic, [`KEYS`]), two lanes of wrapping `u64` sums:
//!
//! ```text
//! lo = Σ (a_j + k_0(j)) * (b_j + k_1(j))      (u32 adds, u32 x u32 -> u64 product)
//! hi = Σ (a_j + k_2(j)) * (b_j + k_3(j))
//! ```
//!
//! and the fingerprint is `[lo ^ len, hi ^ len.rotate_left(32)]` (`len` in bytes). This is the NH
//! hash of UMAC with keys derived from the position: a change of one word by `δ` changes a lane by
//! `δ` times a non-zero factor in at least one lane (the two lanes' factors cannot both be zero),
//! and never wraps to zero; a lane is a sum, so a GPU computes it in any order. It is a check
//! against accidents (a write possum did not foresee), not against an adversary who knows the
//! keys: images are authenticated separately where that matters (migration's keyed MAC).

use serde::{Deserialize, Serialize};

/// The position keys `(M_c, A_c)` of the four factors (odd multipliers, distinct offsets).
pub const KEYS: [(u32, u32); 4] = [
    (0x9E37_79B1, 0x7F4A_7C15),
    (0x85EB_CA77, 0x1656_67B1),
    (0xC2B2_AE3D, 0x27D4_EB2F),
    (0x1656_67B1, 0x9E37_79B9),
];

/// A chunk's fingerprint.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Fingerprint(pub [u64; 2]);

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}{:016x}", self.0[1], self.0[0])
    }
}

impl Fingerprint {
    /// The fingerprint of a chunk of `len` bytes whose lanes' sums are `lo` and `hi` (what the
    /// device kernel returns).
    pub fn from_sums(lo: u64, hi: u64, len: u64) -> Fingerprint {
        Fingerprint([lo ^ len, hi ^ len.rotate_left(32)])
    }
}

/// The lanes' sums of `bytes`, whose first pair has index `first_pair` (so a chunk can be summed
/// in pieces: the sums of its pieces add up).
///
/// On an x86-64 CPU with AVX2 the same loop is compiled for it ([`sums_avx2`]): its wide
/// multiplies take four pairs at a time, about three times the baseline's speed (16-19 against
/// 5-6 GB/s a core on the development machine), and a writer checks each chunk it copies this way.
pub fn sums(bytes: &[u8], first_pair: u64) -> (u64, u64) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: `sums_avx2` needs nothing but AVX2, which this CPU has (checked just above).
        #[allow(unsafe_code)]
        return unsafe { sums_avx2(bytes, first_pair) };
    }
    sums_any(bytes, first_pair)
}

/// [`sums_any`] compiled for AVX2. Only for a CPU that has it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sums_avx2(bytes: &[u8], first_pair: u64) -> (u64, u64) {
    sums_any(bytes, first_pair)
}

/// The sums, for any CPU (inlined into [`sums_avx2`], where the compiler vectorizes it).
#[inline(always)]
fn sums_any(bytes: &[u8], first_pair: u64) -> (u64, u64) {
    let (mut lo, mut hi) = (0u64, 0u64);
    let mut j = first_pair as u32;
    let mut pairs = bytes.chunks_exact(8);
    for p in &mut pairs {
        let (l, h) = pair(p, j);
        lo = lo.wrapping_add(l);
        hi = hi.wrapping_add(h);
        j = j.wrapping_add(1);
    }
    let rest = pairs.remainder();
    if !rest.is_empty() {
        let mut p = [0u8; 8];
        p[..rest.len()].copy_from_slice(rest);
        let (l, h) = pair(&p, j);
        lo = lo.wrapping_add(l);
        hi = hi.wrapping_add(h);
    }
    (lo, hi)
}

#[inline(always)]
fn pair(p: &[u8], j: u32) -> (u64, u64) {
    let a = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
    let b = u32::from_le_bytes([p[4], p[5], p[6], p[7]]);
    let k = |c: usize| j.wrapping_mul(KEYS[c].0).wrapping_add(KEYS[c].1);
    let lo = u64::from(a.wrapping_add(k(0))) * u64::from(b.wrapping_add(k(1)));
    let hi = u64::from(a.wrapping_add(k(2))) * u64::from(b.wrapping_add(k(3)));
    (lo, hi)
}

/// The fingerprint of `bytes`.
pub fn of(bytes: &[u8]) -> Fingerprint {
    let (lo, hi) = sums(bytes, 0);
    Fingerprint::from_sums(lo, hi, bytes.len() as u64)
}

/// The fingerprints of `bytes` cut into chunks of `chunk` bytes (the last one shorter).
pub fn of_chunks(bytes: &[u8], chunk: usize) -> Vec<Fingerprint> {
    bytes.chunks(chunk.max(1)).map(of).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_pin_the_definition() {
        // The CUDA kernel's check compares against these bits: a change here is a format change.
        assert_eq!(of(&[]), Fingerprint([0, 0]));
        let mut v = Vec::new();
        for i in 0..1000u32 {
            v.extend_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
        }
        let (lo, hi) = sums(&v, 0);
        assert_eq!(
            (lo, hi),
            (13_331_409_359_518_974_148, 12_599_444_614_477_953_344)
        );
        assert_eq!(of(&v).to_string(), "aeda37bf452ab940b902ae2dfd724f64");
        // A change of one byte anywhere changes the fingerprint.
        for pos in [0usize, 1, 7, 8, 1999, 3999] {
            let mut w = v.clone();
            w[pos] ^= 0x40;
            assert_ne!(of(&w), of(&v), "byte {pos}");
        }
        // Sums of pieces add up to the whole's.
        let (l1, h1) = sums(&v[..1600], 0);
        let (l2, h2) = sums(&v[1600..], 200);
        assert_eq!((l1.wrapping_add(l2), h1.wrapping_add(h2)), (lo, hi));
    }

    #[test]
    fn the_cpus_own_loop_gives_the_same_sums() {
        // On a CPU with AVX2 `sums` runs the loop compiled for it: the same bits, whatever the
        // length and the first pair's index (which wraps as a u32).
        let v: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        for len in [
            0usize, 1, 7, 8, 9, 31, 32, 33, 255, 4096, 4099, 65_537, 70_000,
        ] {
            for first in [0u64, 1, 5, u64::from(u32::MAX) - 3, 1 << 33] {
                assert_eq!(
                    sums(&v[..len], first),
                    sums_any(&v[..len], first),
                    "{len} {first}"
                );
            }
        }
    }

    #[test]
    fn length_and_padding_are_part_of_it() {
        assert_ne!(of(&[0u8; 8]), of(&[0u8; 16]));
        assert_ne!(of(&[1u8]), of(&[1u8, 0]));
        assert_ne!(of(&[0u8; 4096]), of(&[0u8; 4095]));
    }

    #[test]
    fn swapped_words_and_moved_pairs_differ() {
        let mut v = vec![0u8; 64];
        v[0] = 1;
        let mut w = vec![0u8; 64];
        w[4] = 1;
        assert_ne!(of(&v), of(&w));
        let mut x = vec![0u8; 64];
        x[8] = 1;
        assert_ne!(of(&v), of(&x));
    }

    proptest::proptest! {
        #[test]
        fn one_changed_word_always_shows(len in 8usize..4096, pos in 0usize..4096, d in 1u32..) {
            let mut v: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
            let before = of(&v);
            let at = (pos % len) & !3;
            if at + 4 <= len {
                let w = u32::from_le_bytes(v[at..at + 4].try_into().unwrap()).wrapping_add(d);
                v[at..at + 4].copy_from_slice(&w.to_le_bytes());
                proptest::prop_assert_ne!(of(&v), before);
            }
        }
    }
}
