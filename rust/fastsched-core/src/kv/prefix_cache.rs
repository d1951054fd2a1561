//! Prefix-cache index (S8): chained block hashes, confirmed against tokens.
//!
//! A block's hash covers its parent's hash and its own token ids, so equal
//! hashes mean equal prefixes up to that block. Several blocks may hold the
//! same content (an exact duplicate prompt recomputes its capped last block);
//! lookups return the earliest-inserted one still cached.

use sha2::{Digest, Sha256};

use super::block::Block;
use super::table::{Plain, Table};
use crate::config::HashAlgo;

/// Hashes one full block of token ids, chained to its parent block's hash.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
    /// `block_size - 1` when the block size is a power of two (see `ends_block`).
    mask: Option<usize>,
    algo: HashAlgo,
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
        BlockHasher::with_algo(block_size, HashAlgo::Builtin)
    }

    pub fn with_algo(block_size: usize, algo: HashAlgo) -> Self {
        BlockHasher {
            block_size,
            mask: block_size.is_power_of_two().then(|| block_size - 1),
            algo,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether a sequence of `num_tokens` tokens ends on a block boundary.
    /// Block sizes are powers of two in practice: a mask keeps a division
    /// off the per-token path.
    #[inline]
    pub fn ends_block(&self, num_tokens: usize) -> bool {
        match self.mask {
            Some(mask) => num_tokens & mask == 0,
            None => num_tokens % self.block_size == 0,
        }
    }

    /// The parent value of a request's first block: distinct per LoRA
    /// adapter and per cache salt (vLLM's `cache_salt`), so that neither
    /// adapters nor tenants with different salts ever share cached KV.
    /// Without a salt, `builtin` gives the root it always gave.
    pub fn root(&self, lora_id: Option<u32>, cache_salt: Option<&str>) -> u64 {
        let lora = lora_id.map_or(0, |id| u64::from(id) + 1);
        match self.algo {
            HashAlgo::Builtin => {
                let root = mix(ROOT_SEED ^ lora);
                match cache_salt {
                    None => root,
                    Some(salt) => mix(root ^ hash_bytes(salt.as_bytes())),
                }
            }
            HashAlgo::Sha256 => {
                let mut d = Sha256::new();
                d.update(b"fastsched-root");
                d.update(lora.to_le_bytes());
                if let Some(salt) = cache_salt {
                    d.update((salt.len() as u64).to_le_bytes());
                    d.update(salt.as_bytes());
                }
                first_word(d)
            }
        }
    }

    /// The chained hashes of the full blocks of `tokens` (a partial last
    /// block has none), from the root of this adapter and salt: what a
    /// request with these tokens gets (`Request::update_block_hashes`).
    pub fn prompt_hashes(
        &self,
        tokens: &[u32],
        lora_id: Option<u32>,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        let mut parent = self.root(lora_id, cache_salt);
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                parent = self.hash_block(parent, block);
                parent
            })
            .collect()
    }

    /// `builtin`: four tokens per multiply (a folded 64x64->128 multiply, as
    /// in the wy family of hashes): blocks are hashed on every admission and
    /// every block a decode fills, so this is on the hot path. `sha256`: the
    /// first 8 bytes of SHA-256 over the parent and the tokens (little-endian),
    /// for when hashes must be hard to forge (blocks shared through a store).
    pub fn hash_block(&self, parent: u64, tokens: &[u32]) -> u64 {
        if self.algo == HashAlgo::Sha256 {
            let mut d = Sha256::new();
            d.update(parent.to_le_bytes());
            d.update((tokens.len() as u64).to_le_bytes());
            for &t in tokens {
                d.update(t.to_le_bytes());
            }
            return first_word(d);
        }
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

/// The first 8 bytes of a SHA-256 digest, little-endian.
fn first_word(d: Sha256) -> u64 {
    let digest = d.finalize();
    let mut word = [0u8; 8];
    word.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(word)
}

/// A salt's bytes folded eight at a time (`builtin` roots; not on a hot path).
fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = mix(ROOT_SEED ^ (bytes.len() as u64).wrapping_mul(MUL));
    for chunk in bytes.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = fold(h ^ K1, u64::from_le_bytes(word) ^ K2);
    }
    mix(h)
}

const K1: u64 = 0xa076_1d64_78bd_642f;
const K2: u64 = 0xe703_7ed1_a0b4_28db;

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// Index values: a block id, or (high bit set) an index into the overflow
/// lists used when several blocks share a hash. One block per hash is the
/// norm, so a slot stays 16 bytes.
const MANY: u32 = 1 << 31;
/// An unused slot (block ids and overflow indices stay far below it).
const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    hash: u64,
    value: u32,
}

// SAFETY: integers (and padding); 8-byte alignment.
unsafe impl Plain for Slot {}

const EMPTY_SLOT: Slot = Slot {
    hash: 0,
    value: EMPTY,
};

/// hash -> cached block ids in insertion order, plus what each cached block
/// holds so a hit can be confirmed against the request's tokens. What a block
/// is cached as (hash and parent) lives in the pool's per-block records,
/// which every method here reads through `blocks`.
///
/// The index is an open-addressing table with linear probing whose slots
/// hold the key next to the value: an insert or a lookup touches one cache
/// line in the common case. (A general-purpose map keeps control bytes apart
/// from its buckets: two lines, and on a table this size both tend to be
/// misses, since the model's work evicts it between steps.) Keys are
/// already well-mixed hashes, so their low bits pick the slot.
///
/// Eviction is lazy: an evicted block only loses its mark in the pool, and
/// index entries pointing at it are dropped when that hash is next inserted,
/// or in a sweep once the table is half full. A block's lifetime thus costs
/// one index operation, not two.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    /// Mapped for huge pages when large, as are `tokens` (see `Table`).
    slots: Table<Slot>,
    /// Occupied slots.
    len: usize,
    overflow: Vec<Vec<u32>>,
    free_overflow: Vec<u32>,
    /// The live entries during a sweep (kept to reuse the allocation).
    sweep_scratch: Vec<Slot>,
    /// Per block: its token ids (valid while it is cached), from `tokens_start`.
    tokens: Table<u32>,
    /// Where block 0's tokens start in `tokens`: chosen so that every
    /// block's tokens start on a 64-byte boundary whenever a block's tokens
    /// fill whole cache lines (block size a multiple of 16), so caching a
    /// block writes one line, not two.
    tokens_start: usize,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        // At most one live key per block: sweeping at half full leaves at
        // most a quarter of the slots used, so sweeps are rare and probes short.
        let num_slots = (4 * num_blocks).next_power_of_two().max(8);
        const LINE: usize = 64 / std::mem::size_of::<u32>();
        let tokens = Table::new(num_blocks * block_size + LINE, 0);
        // The allocation never moves (the table never grows), so an offset
        // computed from its address once stays aligned.
        let misalignment = (tokens.as_ptr() as usize % 64) / std::mem::size_of::<u32>();
        let tokens_start = (LINE - misalignment) % LINE;
        PrefixCache {
            block_size,
            slots: Table::new(num_slots, EMPTY_SLOT),
            len: 0,
            overflow: Vec::new(),
            free_overflow: Vec::new(),
            sweep_scratch: Vec::new(),
            tokens,
            tokens_start,
        }
    }

    /// The token ids a block holds (meaningful while it is cached).
    pub fn block_tokens(&self, block: u32) -> &[u32] {
        &self.tokens[self.tokens_of(block)]
    }

    #[inline]
    fn tokens_of(&self, block: u32) -> std::ops::Range<usize> {
        let start = self.tokens_start + block as usize * self.block_size;
        start..start + self.block_size
    }

    /// The slot holding `hash`, or the empty slot where it would go.
    #[inline]
    fn probe(&self, hash: u64) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = hash as usize & mask;
        loop {
            let slot = &self.slots[i];
            if slot.value == EMPTY || slot.hash == hash {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    /// Reads the lines `insert(_, block, hash, _)` will touch (see
    /// `BlockPool::warm_for_caching`).
    #[inline]
    pub fn warm(&self, block: u32, hash: u64) -> u64 {
        let home = hash as usize & (self.slots.len() - 1);
        self.slots[home].hash ^ u64::from(self.tokens[self.tokens_of(block).start])
    }

    /// Indexes `block`, whose record in `blocks` already says it is cached
    /// as `hash`, and keeps a copy of its tokens.
    pub fn insert(&mut self, blocks: &[Block], block: u32, hash: u64, tokens: &[u32]) {
        debug_assert_eq!(blocks[block as usize].cached_hash(), Some(hash));
        let range = self.tokens_of(block);
        copy_block(&mut self.tokens[range], tokens);
        let mut i = self.probe(hash);
        if self.slots[i].value == EMPTY && 2 * (self.len + 1) > self.slots.len() {
            self.sweep(blocks);
            i = self.probe(hash);
        }
        let live = |x: u32| x != block && blocks[x as usize].cached_hash() == Some(hash);
        let slot = &mut self.slots[i];
        let v = slot.value;
        if v == EMPTY {
            *slot = Slot { hash, value: block };
            self.len += 1;
        } else if v & MANY == 0 {
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
                slot.value = idx | MANY;
            } else {
                slot.value = block;
            }
        } else {
            let list = &mut self.overflow[(v & !MANY) as usize];
            list.retain(|&x| live(x));
            list.push(block);
        }
    }

    /// The earliest-inserted cached block with this hash whose content really
    /// is `parent` + `tokens`.
    pub fn get(&self, blocks: &[Block], hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        let matches = |b: u32| {
            blocks[b as usize].is_cached_as(hash, parent)
                && block_eq(&self.tokens[self.tokens_of(b)], tokens)
        };
        let v = self.slots[self.probe(hash)].value;
        if v == EMPTY {
            None
        } else if v & MANY == 0 {
            matches(v).then_some(v)
        } else {
            self.overflow[(v & !MANY) as usize]
                .iter()
                .copied()
                .find(|&b| matches(b))
        }
    }

    /// Rebuilds the table with only the live entries (in place: a fresh
    /// table this size would cost page faults on every sweep).
    fn sweep(&mut self, blocks: &[Block]) {
        let live = |x: u32, hash: u64| blocks[x as usize].cached_hash() == Some(hash);
        let mut kept = std::mem::take(&mut self.sweep_scratch);
        kept.clear();
        for &Slot { hash, mut value } in self.slots.iter() {
            if value == EMPTY {
                continue;
            }
            if value & MANY == 0 {
                if !live(value, hash) {
                    continue;
                }
            } else {
                let idx = value & !MANY;
                let list = &mut self.overflow[idx as usize];
                list.retain(|&x| live(x, hash));
                match list.len() {
                    0 => {
                        self.free_overflow.push(idx);
                        continue;
                    }
                    1 => {
                        value = list[0];
                        self.free_overflow.push(idx);
                    }
                    _ => {}
                }
            }
            kept.push(Slot { hash, value });
        }
        self.slots.fill(EMPTY_SLOT);
        self.len = kept.len();
        for &slot in &kept {
            let i = self.probe(slot.hash);
            self.slots[i] = slot;
        }
        self.sweep_scratch = kept;
    }
}

/// The usual block size: blocks of this many tokens are copied and compared
/// as fixed-size arrays, which compile to a few vector instructions inline
/// instead of a call to `memcpy` or `bcmp` per block.
const USUAL_BLOCK_SIZE: usize = 16;

#[inline]
fn copy_block(dst: &mut [u32], src: &[u32]) {
    if dst.len() == USUAL_BLOCK_SIZE && src.len() == USUAL_BLOCK_SIZE {
        dst[..USUAL_BLOCK_SIZE].copy_from_slice(&src[..USUAL_BLOCK_SIZE]);
    } else {
        dst.copy_from_slice(src);
    }
}

#[inline]
fn block_eq(a: &[u32], b: &[u32]) -> bool {
    if a.len() == USUAL_BLOCK_SIZE && b.len() == USUAL_BLOCK_SIZE {
        a[..USUAL_BLOCK_SIZE] == b[..USUAL_BLOCK_SIZE]
    } else {
        a == b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s8_hash_is_chained_on_parent() {
        for algo in [HashAlgo::Builtin, HashAlgo::Sha256] {
            let h = BlockHasher::with_algo(2, algo);
            let root = h.root(None, None);
            let a = h.hash_block(root, &[1, 2]);
            assert_eq!(a, h.hash_block(root, &[1, 2]));
            assert_ne!(h.hash_block(a, &[3, 4]), h.hash_block(root, &[3, 4]));
            assert_ne!(h.root(Some(1), None), root);
        }
    }

    #[test]
    fn s8_cache_salt_separates_roots() {
        for algo in [HashAlgo::Builtin, HashAlgo::Sha256] {
            let h = BlockHasher::with_algo(2, algo);
            let plain = h.root(None, None);
            let a = h.root(None, Some("tenant-a"));
            assert_ne!(a, plain);
            assert_ne!(a, h.root(None, Some("tenant-b")));
            assert_eq!(a, h.root(None, Some("tenant-a")));
            assert_ne!(a, h.root(Some(1), Some("tenant-a")));
            // An empty salt is a salt: it is not the unsalted root.
            assert_ne!(h.root(None, Some("")), plain);
        }
    }

    #[test]
    fn builtin_root_without_salt_is_unchanged() {
        // Decision digests and replays hash with the default algorithm.
        let h = BlockHasher::new(2);
        assert_eq!(h.root(None, None), mix(ROOT_SEED));
        assert_eq!(h.root(Some(4), None), mix(ROOT_SEED ^ 5));
    }

    #[test]
    fn sha256_hashes_differ_from_builtin_and_are_sha256() {
        let b = BlockHasher::new(2);
        let s = BlockHasher::with_algo(2, HashAlgo::Sha256);
        assert_ne!(b.hash_block(7, &[1, 2]), s.hash_block(7, &[1, 2]));
        let mut d = Sha256::new();
        d.update(7u64.to_le_bytes());
        d.update(2u64.to_le_bytes());
        d.update(1u32.to_le_bytes());
        d.update(2u32.to_le_bytes());
        assert_eq!(s.hash_block(7, &[1, 2]), first_word(d));
    }

    /// The index with the pool's per-block records, driven as the pool does.
    struct Fixture {
        c: PrefixCache,
        blocks: Vec<Block>,
    }

    impl Fixture {
        fn new(num_blocks: usize, block_size: usize) -> Self {
            Fixture {
                c: PrefixCache::new(num_blocks, block_size),
                blocks: vec![Block::UNUSED; num_blocks],
            }
        }
        fn insert(&mut self, block: u32, hash: u64, parent: u64, tokens: &[u32]) {
            self.blocks[block as usize].cache_as(hash, parent);
            self.c.insert(&self.blocks, block, hash, tokens);
        }
        fn evict(&mut self, block: u32) {
            self.blocks[block as usize].evict();
        }
        fn get(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
            self.c.get(&self.blocks, hash, parent, tokens)
        }
        fn is_empty(&self) -> bool {
            self.blocks.iter().all(|b| b.cached_hash().is_none())
        }
    }

    #[test]
    fn s8_lookup_confirms_tokens_so_a_forged_hash_misses() {
        let mut c = Fixture::new(4, 2);
        c.insert(1, 42, 7, &[1, 2]);
        assert_eq!(c.get(42, 7, &[1, 2]), Some(1));
        assert_eq!(c.get(42, 7, &[1, 3]), None, "same hash, other tokens");
        assert_eq!(c.get(42, 8, &[1, 2]), None, "same hash, other parent");
    }

    #[test]
    fn s8_duplicates_resolve_to_earliest_inserted_still_cached() {
        let mut c = Fixture::new(4, 2);
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
        let mut c = Fixture::new(2, 1);
        for round in 0..50u64 {
            c.insert(1, 100 + round, 0, &[round as u32]);
            c.evict(1);
        }
        assert!(
            c.c.len <= c.c.slots.len() / 2,
            "sweeps keep stale entries bounded: {}",
            c.c.len
        );
        assert_eq!(c.get(149, 0, &[49]), None);
    }

    #[test]
    fn s8_block_tokens_start_on_a_cache_line_when_they_fill_lines() {
        let c = PrefixCache::new(8, 16);
        for b in 0..8 {
            let start = &c.tokens[c.tokens_of(b)][0] as *const u32 as usize;
            assert_eq!(start % 64, 0, "block {b}");
        }
    }
}
