//! One KV block's record (S8), shared by the block pool, which owns the
//! records, and the prefix-cache index, which reads them to confirm hits.
//! Its own module so that neither of those two imports the other's.

use super::table::Plain;

/// Everything the pool knows about one block in one 32-byte record (two per
/// cache line): its place in the free queue, its reference count and what it
/// is cached as. Allocating a block (which evicts it), caching it, freeing it
/// and confirming a prefix hit on it each touch this one record.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    /// While `in_free`: the ticket of the block's live entry in the queue.
    pub(super) ticket: u64,
    pub(super) ref_cnt: u32,
    pub(super) in_free: bool,
    /// `hash` and `parent` are what the block holds (it is in the prefix cache).
    pub(super) cached: bool,
    pub(super) hash: u64,
    pub(super) parent: u64,
}

impl Block {
    pub(super) const UNUSED: Block = Block {
        ticket: 0,
        ref_cnt: 0,
        in_free: false,
        cached: false,
        hash: 0,
        parent: 0,
    };

    pub(super) fn cache_as(&mut self, hash: u64, parent: u64) {
        self.cached = true;
        self.hash = hash;
        self.parent = parent;
    }

    /// Forgets the content (the block is being reused).
    pub(super) fn evict(&mut self) {
        self.cached = false;
    }

    /// The hash the block is cached under, if it is cached.
    #[inline]
    pub fn cached_hash(&self) -> Option<u64> {
        self.cached.then_some(self.hash)
    }

    /// Cached as exactly this content: `hash` of `parent` + its tokens.
    #[inline]
    pub fn is_cached_as(&self, hash: u64, parent: u64) -> bool {
        self.cached && self.hash == hash && self.parent == parent
    }
}

// SAFETY: integers and bools (all-zero is `Block::UNUSED`); 8-byte alignment.
unsafe impl Plain for Block {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_record_is_a_half_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 32);
    }
}
