//! Prefix-cache index (S8): chained block hashes, confirmed against tokens.
//!
//! A block's hash covers its parent's hash and its own token ids, so equal
//! hashes mean equal prefixes up to that block. Several blocks may hold the
//! same content (an exact duplicate prompt recomputes its capped last block);
//! lookups return the earliest-inserted one still cached.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes one full block of token ids, chained to its parent block's hash.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
}

const ROOT_SEED: u64 = 0x9e37_79b9_7f4a_7c15;
const MUL: u64 = 0xff51_afd7_ed55_8ccd;

#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(MUL);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

impl BlockHasher {
    pub fn new(block_size: usize) -> Self {
        BlockHasher { block_size }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The parent value of a request's first block: distinct per LoRA
    /// adapter, so adapters never share cached KV.
    pub fn root(lora_id: Option<u32>) -> u64 {
        mix(ROOT_SEED ^ lora_id.map_or(0, |id| u64::from(id) + 1))
    }

    pub fn hash_block(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = mix(parent ^ (tokens.len() as u64).wrapping_mul(MUL));
        let mut pairs = tokens.chunks_exact(2);
        for p in &mut pairs {
            let word = u64::from(p[0]) | (u64::from(p[1]) << 32);
            h = mix(h ^ word).rotate_left(17);
        }
        if let [last] = pairs.remainder() {
            h = mix(h ^ u64::from(*last) ^ (1 << 63));
        }
        h
    }
}

/// Keys are already well-mixed hashes: hashing them again is wasted work.
#[derive(Default)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type IdentityBuild = BuildHasherDefault<IdentityHasher>;

/// Blocks sharing one hash, in insertion order. One block is the norm, so it
/// is stored inline.
#[derive(Debug, Clone)]
enum Slot {
    One(u32),
    Many(Vec<u32>),
}

/// hash -> cached block ids, plus what each cached block holds so a hit can
/// be confirmed against the request's tokens.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    map: HashMap<u64, Slot, IdentityBuild>,
    /// Per block: its parent hash and token ids (valid while it is cached).
    parent: Vec<u64>,
    tokens: Vec<u32>,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        PrefixCache {
            block_size,
            map: HashMap::default(),
            parent: vec![0; num_blocks],
            tokens: vec![0; num_blocks * block_size],
        }
    }

    pub fn insert(&mut self, block: u32, hash: u64, parent: u64, tokens: &[u32]) {
        let b = block as usize;
        self.parent[b] = parent;
        self.tokens[b * self.block_size..(b + 1) * self.block_size].copy_from_slice(tokens);
        match self.map.get_mut(&hash) {
            None => {
                self.map.insert(hash, Slot::One(block));
            }
            Some(slot) => match slot {
                Slot::One(first) => *slot = Slot::Many(vec![*first, block]),
                Slot::Many(v) => v.push(block),
            },
        }
    }

    pub fn remove(&mut self, block: u32, hash: u64) {
        if let Some(slot) = self.map.get_mut(&hash) {
            match slot {
                Slot::One(b) if *b == block => {
                    self.map.remove(&hash);
                }
                Slot::One(_) => {}
                Slot::Many(v) => {
                    if let Some(i) = v.iter().position(|&b| b == block) {
                        v.remove(i);
                    }
                    if v.len() == 1 {
                        *slot = Slot::One(v[0]);
                    }
                }
            }
        }
    }

    /// The earliest-inserted cached block with this hash whose content really
    /// is `parent` + `tokens`.
    pub fn get(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        let matches = |b: u32| {
            let i = b as usize;
            self.parent[i] == parent
                && &self.tokens[i * self.block_size..(i + 1) * self.block_size] == tokens
        };
        match self.map.get(&hash)? {
            Slot::One(b) => matches(*b).then_some(*b),
            Slot::Many(v) => v.iter().copied().find(|&b| matches(b)),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s8_hash_is_chained_on_parent() {
        let h = BlockHasher::new(2);
        let root = BlockHasher::root(None);
        let a = h.hash_block(root, &[1, 2]);
        assert_eq!(a, h.hash_block(root, &[1, 2]));
        assert_ne!(h.hash_block(a, &[3, 4]), h.hash_block(root, &[3, 4]));
        assert_ne!(BlockHasher::root(Some(1)), root);
    }

    #[test]
    fn s8_lookup_confirms_tokens_so_a_forged_hash_misses() {
        let mut c = PrefixCache::new(4, 2);
        c.insert(1, 42, 7, &[1, 2]);
        assert_eq!(c.get(42, 7, &[1, 2]), Some(1));
        assert_eq!(c.get(42, 7, &[1, 3]), None, "same hash, other tokens");
        assert_eq!(c.get(42, 8, &[1, 2]), None, "same hash, other parent");
    }

    #[test]
    fn s8_duplicates_resolve_to_earliest_inserted_still_cached() {
        let mut c = PrefixCache::new(4, 2);
        c.insert(3, 42, 7, &[1, 2]);
        c.insert(1, 42, 7, &[1, 2]);
        assert_eq!(c.get(42, 7, &[1, 2]), Some(3));
        c.remove(3, 42);
        assert_eq!(c.get(42, 7, &[1, 2]), Some(1));
        c.remove(1, 42);
        assert!(c.is_empty());
    }
}
