//! The one "kernel" of the synthetic workloads: mixes the buffers an operation reads into the ones
//! it writes. Every output word depends on its old value, its index, the salt and the inputs, so any
//! lost, stale or reordered write changes the final state.

/// Applies the kernel: `outs[j][i] = mix(outs[j][i], i, j, salt, ins[..][i mod len])`, on 64-bit
/// little-endian words. Buffer lengths must be multiples of 8.
pub fn apply(salt: u64, ins: &[&[u8]], outs: &mut [&mut [u8]]) {
    for (j, out) in outs.iter_mut().enumerate() {
        let js = salt ^ (j as u64).wrapping_mul(0xd6e8_feb8_6659_fd93);
        for (i, w) in out.chunks_exact_mut(8).enumerate() {
            let mut x = u64::from_le_bytes(w.try_into().expect("8 bytes"))
                ^ js
                ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            for r in ins {
                let words = r.len() / 8;
                if words > 0 {
                    let k = (i % words) * 8;
                    let v = u64::from_le_bytes(r[k..k + 8].try_into().expect("8 bytes"));
                    x = x.rotate_left(13) ^ v.wrapping_mul(0xbf58_476d_1ce4_e5b9);
                }
            }
            x = (x ^ (x >> 29)).wrapping_mul(0x94d0_49bb_1331_11eb);
            w.copy_from_slice(&(x ^ (x >> 32)).to_le_bytes());
        }
    }
}

/// Deterministic initial contents of buffer `idx` of `len` bytes under `seed`.
pub fn initial(seed: u64, idx: usize, len: u64) -> Vec<u8> {
    let mut rng = crate::rng::Rng::new(seed ^ (idx as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut v = vec![0u8; usize::try_from(len).expect("fits")];
    for w in v.chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    v
}

/// A 64-bit FNV-1a digest of some buffers, for printing and comparing states.
pub fn digest<'a>(bufs: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bufs {
        for w in b.chunks(8) {
            let mut x = [0u8; 8];
            x[..w.len()].copy_from_slice(w);
            h = (h ^ u64::from_le_bytes(x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = (h ^ b.len() as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_depends_on_inputs_and_salt() {
        let a = initial(1, 0, 64);
        let mut o1 = initial(1, 1, 64);
        let mut o2 = o1.clone();
        apply(7, &[&a], &mut [&mut o1]);
        apply(8, &[&a], &mut [&mut o2]);
        assert_ne!(o1, o2);
        let mut o3 = initial(1, 1, 64);
        let mut b = a.clone();
        b[0] ^= 1;
        apply(7, &[&b], &mut [&mut o3]);
        assert_ne!(o1, o3);
    }
}
