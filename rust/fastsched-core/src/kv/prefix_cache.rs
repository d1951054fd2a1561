//! Prefix-cache index (S8): chained block hashes, confirmed against tokens.
//!
//! A block's hash covers its parent's hash and its own token ids, so equal
//! hashes mean equal prefixes up to that block. Several blocks may hold the
//! same content (an exact duplicate prompt recomputes its capped last block);
//! lookups return the earliest-inserted one still cached.

use std::collections::hash_map::Entry;
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

    /// Four tokens per multiply (a folded 64x64->128 multiply, as in the wy
    /// family of hashes): blocks are hashed on every admission and every
    /// block a decode fills, so this is on the hot path.
    pub fn hash_block(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = mix(parent ^ (tokens.len() as u64).wrapping_mul(MUL));
        let mut quads = tokens.chunks_exact(4);
        for q in &mut quads {
            let a = u64::from(q[0]) | (u64::from(q[1]) << 32);
            let b = u64::from(q[2]) | (u64::from(q[3]) << 32);
            h = fold(a ^ h ^ K1, b ^ K2);
        }
        for (i, &t) in quads.remainder().iter().enumerate() {
            h = fold(h ^ K1, u64::from(t) ^ K2 ^ (i as u64 + 1));
        }
        mix(h)
    }
}

const K1: u64 = 0xa076_1d64_78bd_642f;
const K2: u64 = 0xe703_7ed1_a0b4_28db;

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
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

/// Map values: a block id, or (high bit set) an index into the overflow
/// lists used when several blocks share a hash. One block per hash is the
/// norm, so an entry stays 16 bytes.
const MANY: u32 = 1 << 31;

/// hash -> cached block ids in insertion order, plus what each cached block
/// holds so a hit can be confirmed against the request's tokens.
///
/// Eviction is lazy: an evicted block only loses its `hash_of` mark, and
/// map entries pointing at it are dropped when that hash is next inserted,
/// or in a sweep once stale entries could outnumber the pool. A block's
/// lifetime thus costs one map operation, not two.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    map: HashMap<u64, u32, IdentityBuild>,
    overflow: Vec<Vec<u32>>,
    free_overflow: Vec<u32>,
    /// Per block: the hash it is cached under (if cached) and its parent's.
    meta: Vec<CacheMeta>,
    /// Per block: its token ids (valid while it is cached).
    tokens: Vec<u32>,
}

#[derive(Debug, Clone, Copy, Default)]
struct CacheMeta {
    hash: Option<u64>,
    parent: u64,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut map = HashMap::default();
        map.reserve(num_blocks);
        PrefixCache {
            block_size,
            map,
            overflow: Vec::new(),
            free_overflow: Vec::new(),
            meta: vec![CacheMeta::default(); num_blocks],
            tokens: vec![0; num_blocks * block_size],
        }
    }

    pub fn hash_of(&self, block: u32) -> Option<u64> {
        self.meta[block as usize].hash
    }

    pub fn insert(&mut self, block: u32, hash: u64, parent: u64, tokens: &[u32]) {
        let b = block as usize;
        debug_assert!(
            self.meta[b].hash.is_none(),
            "block {block} is already cached"
        );
        self.meta[b] = CacheMeta {
            hash: Some(hash),
            parent,
        };
        self.tokens[b * self.block_size..(b + 1) * self.block_size].copy_from_slice(tokens);
        if self.map.len() >= 2 * self.meta.len() {
            self.sweep();
        }
        let meta = &self.meta;
        let live = |x: u32| x != block && meta[x as usize].hash == Some(hash);
        match self.map.entry(hash) {
            Entry::Vacant(e) => {
                e.insert(block);
            }
            Entry::Occupied(mut e) => {
                let v = *e.get();
                if v & MANY == 0 {
                    if live(v) {
                        let list = vec![v, block];
                        let idx = match self.free_overflow.pop() {
                            Some(i) => {
                                self.overflow[i as usize] = list;
                                i
                            }
                            None => {
                                self.overflow.push(list);
                                (self.overflow.len() - 1) as u32
                            }
                        };
                        e.insert(idx | MANY);
                    } else {
                        e.insert(block);
                    }
                } else {
                    let list = &mut self.overflow[(v & !MANY) as usize];
                    list.retain(|&x| live(x));
                    list.push(block);
                }
            }
        }
    }

    /// Drops a block from the cache (its map entry goes stale).
    pub fn evict(&mut self, block: u32) {
        self.meta[block as usize].hash = None;
    }

    /// The earliest-inserted cached block with this hash whose content really
    /// is `parent` + `tokens`.
    pub fn get(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        let bs = self.block_size;
        let matches = |b: u32| {
            let i = b as usize;
            self.meta[i].hash == Some(hash)
                && self.meta[i].parent == parent
                && &self.tokens[i * bs..(i + 1) * bs] == tokens
        };
        let v = *self.map.get(&hash)?;
        if v & MANY == 0 {
            matches(v).then_some(v)
        } else {
            self.overflow[(v & !MANY) as usize]
                .iter()
                .copied()
                .find(|&b| matches(b))
        }
    }

    /// Removes every stale entry.
    fn sweep(&mut self) {
        let (meta, overflow, free_overflow) =
            (&self.meta, &mut self.overflow, &mut self.free_overflow);
        self.map.retain(|&hash, v| {
            if *v & MANY == 0 {
                return meta[*v as usize].hash == Some(hash);
            }
            let idx = *v & !MANY;
            let list = &mut overflow[idx as usize];
            list.retain(|&x| meta[x as usize].hash == Some(hash));
            match list.len() {
                0 => {
                    free_overflow.push(idx);
                    false
                }
                1 => {
                    *v = list[0];
                    free_overflow.push(idx);
                    true
                }
                _ => true,
            }
        });
    }

    /// Distinct hashes currently cached.
    pub fn len(&self) -> usize {
        self.meta
            .iter()
            .filter_map(|m| m.hash)
            .collect::<std::collections::HashSet<_>>()
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.meta.iter().all(|m| m.hash.is_none())
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
        c.evict(3);
        assert_eq!(c.get(42, 7, &[1, 2]), Some(1));
        c.insert(3, 42, 7, &[1, 2]);
        assert_eq!(c.get(42, 7, &[1, 2]), Some(1), "re-inserted goes last");
        c.evict(1);
        c.evict(3);
        assert!(c.is_empty());
        assert_eq!(c.get(42, 7, &[1, 2]), None);
    }

    #[test]
    fn s8_stale_entries_are_swept_and_never_returned() {
        let mut c = PrefixCache::new(2, 1);
        for round in 0..50u64 {
            c.insert(1, 100 + round, 0, &[round as u32]);
            c.evict(1);
        }
        assert!(
            c.map.len() <= 4,
            "sweeps keep stale entries bounded: {}",
            c.map.len()
        );
        assert_eq!(c.get(149, 0, &[49]), None);
    }
}
