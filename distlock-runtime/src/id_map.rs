//! Maps keyed by numbers this process hands out itself (hold ids, runtime ids), which need
//! no protection against chosen keys: hashed with one multiplication instead of SipHash, as
//! they are looked up on the path of every lock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` keyed by an id this process made.
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Spreads a 64-bit id over the hash (Fibonacci hashing); other input is folded in bytewise.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_and_stay_apart() {
        let mut map: IdMap<u64, u64> = IdMap::default();
        for id in 0..10_000 {
            map.insert(id, id * 2);
        }
        assert_eq!(map.len(), 10_000);
        assert!((0..10_000).all(|id| map.get(&id) == Some(&(id * 2))));
        let top_bits: std::collections::HashSet<u64> = (0..128u64)
            .map(|id| {
                let mut hasher = IdHasher::default();
                hasher.write_u64(id);
                hasher.finish() >> 57
            })
            .collect();
        assert!(
            top_bits.len() > 64,
            "ids share their top bits: {}",
            top_bits.len()
        );
    }

    #[test]
    fn other_key_types_spread_too() {
        let distinct = |hashes: Vec<u64>| {
            hashes
                .into_iter()
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        let hash = |write: &dyn Fn(&mut IdHasher)| {
            let mut hasher = IdHasher::default();
            write(&mut hasher);
            hasher.finish()
        };
        let small: Vec<u64> = (0..1000usize)
            .map(|n| hash(&|h| h.write_usize(n)))
            .collect();
        assert_eq!(distinct(small), 1000);
        let words: Vec<u64> = (0..1000u32).map(|n| hash(&|h| h.write_u32(n))).collect();
        assert_eq!(distinct(words), 1000);
        let bytes: Vec<u64> = (0..1000u32)
            .map(|n| hash(&|h| h.write(&n.to_le_bytes())))
            .collect();
        assert_eq!(distinct(bytes), 1000);
    }
}
