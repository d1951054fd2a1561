//! The paged KV block pool (S8): reference counts, a free queue that
//! doubles as the LRU of cached blocks, and lazy eviction.
//!
//! Block 0 is the null block and is never handed out. Free blocks sit in one
//! queue; allocation pops from the front and evicts a cached block only then.
//! Freed blocks without a hash go to the front (reused first), cached ones to
//! the back (evicted last).

use std::collections::VecDeque;

use super::block::Block;
use super::prefix_cache::PrefixCache;
use super::table::Table;

/// An entry of the free queue; live only while the block is free and still
/// holds this ticket.
#[derive(Debug, Clone, Copy)]
struct FreeEntry {
    block: u32,
    ticket: u64,
}

/// The free queue is a deque of block ids rather than a linked list through
/// the block records: popping `n` blocks reads the deque in order and each
/// block's record independently, where a list would chase one cold record
/// to find the next. Taking a block out of the middle (a prefix hit on a
/// free cached block) only clears its `in_free` flag; its entry goes stale,
/// is skipped when popped, and stale entries are compacted away once they
/// could outnumber the live ones. Tickets are unique per push, so a stale
/// entry never comes back to life when its block is freed again.
#[derive(Debug)]
pub struct BlockPool {
    num_blocks: usize,
    /// By block id; mapped for huge pages when large (see `Table`).
    blocks: Table<Block>,
    free: VecDeque<FreeEntry>,
    num_free: usize,
    next_ticket: u64,
    cache: PrefixCache,
    /// When set, the hashes cached and evicted since the last take: what a
    /// data-parallel frontend needs to route by prefix (`KvEvents`).
    events: Option<KvEvents>,
}

/// Block hashes that entered and left the prefix cache, in order. A hash held
/// by several blocks (duplicates) is reported once per block.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KvEvents {
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
}

impl KvEvents {
    pub fn is_empty(&self) -> bool {
        self.stored.is_empty() && self.removed.is_empty()
    }
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = BlockPool {
            num_blocks,
            blocks: Table::new(num_blocks, Block::UNUSED),
            free: VecDeque::with_capacity(num_blocks),
            num_free: 0,
            next_ticket: 1,
            cache: PrefixCache::new(num_blocks, block_size),
            events: None,
        };
        for b in 1..num_blocks as u32 {
            pool.push_back(b);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Starts (or stops) recording `KvEvents`.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(KvEvents::default);
    }

    /// The events since the last call (empty when not recording).
    pub fn take_events(&mut self) -> KvEvents {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    #[inline]
    fn note_removed(events: &mut Option<KvEvents>, block: &Block) {
        if let (Some(events), Some(hash)) = (events.as_mut(), block.cached_hash()) {
            events.removed.push(hash);
        }
    }

    /// Free blocks, evictable cached ones included, the null block excluded.
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    pub fn num_usable_blocks(&self) -> usize {
        self.num_blocks - 1
    }

    /// Fraction of usable blocks held by requests.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_usable_blocks() as f64
    }

    pub fn ref_cnt(&self, block: u32) -> u32 {
        self.blocks[block as usize].ref_cnt
    }

    pub fn block_hash(&self, block: u32) -> Option<u64> {
        self.blocks[block as usize].cached_hash()
    }

    /// Pops `n` blocks from the front, evicting any cached content they hold
    /// (lazily: the index entry goes stale). The caller has checked
    /// `n <= num_free_blocks()`.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<u32>) {
        debug_assert!(n <= self.num_free);
        if n > 1 {
            // As in `warm_for_caching`: the records of the blocks about to be
            // popped, loaded together rather than one pop at a time.
            let mut sink = 0u64;
            for e in self.free.iter().take(n) {
                sink ^= self.blocks[e.block as usize].ticket;
            }
            std::hint::black_box(sink);
        }
        for _ in 0..n {
            let b = self.pop_front();
            let block = &mut self.blocks[b as usize];
            Self::note_removed(&mut self.events, block);
            block.evict();
            block.ref_cnt = 1;
            out.push(b);
        }
    }

    /// Forgets every block's cached content (new weights make it stale):
    /// index entries go stale as on eviction, and blocks in use keep their
    /// KV but are never a prefix hit again.
    pub fn reset_prefix_cache(&mut self) {
        for block in self.blocks.iter_mut() {
            Self::note_removed(&mut self.events, block);
            block.evict();
        }
    }

    /// A prefix hit takes its blocks: free ones leave the free queue.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let block = &mut self.blocks[b as usize];
            if block.ref_cnt == 0 && b != 0 {
                debug_assert!(block.in_free);
                block.in_free = false; // its queue entry is now stale
                self.num_free -= 1;
            }
            block.ref_cnt += 1;
        }
        if self.free.len() > 2 * self.num_free + 64 {
            self.compact();
        }
    }

    /// Releases blocks given in the order to free them (a request's tail
    /// first). Uncached blocks that drop to zero go to the front keeping that
    /// order; cached ones go to the back, also in that order.
    pub fn free_blocks(
        &mut self,
        ordered: impl Iterator<Item = u32> + Clone,
        scratch: &mut Vec<u32>,
    ) {
        scratch.clear();
        // As in `warm_for_caching`: the records (cold: a request's blocks were
        // taken from all over the pool) loaded together, not one per turn.
        let mut sink = 0u64;
        for b in ordered.clone() {
            sink ^= self.blocks[b as usize].ticket;
        }
        std::hint::black_box(sink);
        for b in ordered {
            let block = &mut self.blocks[b as usize];
            debug_assert!(block.ref_cnt > 0, "double free of block {b}");
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 && b != 0 {
                if block.cached {
                    self.push_back(b);
                } else {
                    scratch.push(b);
                }
            }
        }
        for &b in scratch.iter().rev() {
            self.push_front(b);
        }
    }

    /// Loads what caching `blocks` (with these hashes) will write, in a loop
    /// short enough for the CPU to have all those cache misses in flight at
    /// once; `cache_block` then finds the lines in cache instead of paying
    /// the misses one after another. Only a performance hint.
    pub fn warm_for_caching(&self, blocks: &[u32], hashes: &[u64]) {
        let mut sink = 0u64;
        for (&b, &hash) in blocks.iter().zip(hashes) {
            sink ^= self.blocks[b as usize].hash ^ self.cache.warm(b, hash);
        }
        std::hint::black_box(sink);
    }

    /// Registers a full block's content in the prefix cache.
    pub fn cache_block(&mut self, block: u32, hash: u64, parent: u64, tokens: &[u32]) {
        let record = &mut self.blocks[block as usize];
        debug_assert!(!record.cached, "block {block} is already cached");
        record.cache_as(hash, parent);
        self.cache.insert(&self.blocks, block, hash, tokens);
        if let Some(events) = self.events.as_mut() {
            events.stored.push(hash);
        }
    }

    /// What a cached block holds: its parent's hash and its token ids (a KV
    /// connector stores them with the block's KV); None when not cached.
    pub fn cached_content(&self, block: u32) -> Option<(u64, &[u32])> {
        let record = self.blocks.get(block as usize)?;
        record
            .cached
            .then(|| (record.parent, self.cache.block_tokens(block)))
    }

    /// A cached block whose content is `parent` + `tokens`, if any.
    pub fn get_cached_block(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        self.cache.get(&self.blocks, hash, parent, tokens)
    }

    /// Free queue from front to back (tests and diagnostics).
    pub fn free_queue(&self) -> Vec<u32> {
        self.free
            .iter()
            .filter(|e| self.is_live(e))
            .map(|e| e.block)
            .collect()
    }

    /// S16 accounting: every usable block is either free or referenced,
    /// never both, and the free count matches the queue.
    pub fn check_invariants(&self) -> Result<(), String> {
        let queue = self.free_queue();
        if queue.len() != self.num_free {
            return Err(format!(
                "free queue holds {} blocks, counter says {}",
                queue.len(),
                self.num_free
            ));
        }
        for b in 1..self.num_blocks {
            let block = self.blocks[b];
            if block.in_free == (block.ref_cnt > 0) {
                return Err(format!(
                    "block {b}: in_free={} ref_cnt={}",
                    block.in_free, block.ref_cnt
                ));
            }
        }
        Ok(())
    }

    #[inline]
    fn is_live(&self, e: &FreeEntry) -> bool {
        let block = &self.blocks[e.block as usize];
        block.in_free && block.ticket == e.ticket
    }

    fn pop_front(&mut self) -> u32 {
        loop {
            let e = self.free.pop_front().expect("the caller checked num_free");
            if self.is_live(&e) {
                self.blocks[e.block as usize].in_free = false;
                self.num_free -= 1;
                return e.block;
            }
        }
    }

    /// Drops the stale entries.
    fn compact(&mut self) {
        let blocks = &self.blocks;
        self.free.retain(|e| {
            let block = &blocks[e.block as usize];
            block.in_free && block.ticket == e.ticket
        });
    }

    fn new_entry(&mut self, b: u32) -> FreeEntry {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let block = &mut self.blocks[b as usize];
        debug_assert!(!block.in_free);
        block.in_free = true;
        block.ticket = ticket;
        self.num_free += 1;
        FreeEntry { block: b, ticket }
    }

    fn push_back(&mut self, b: u32) {
        let e = self.new_entry(b);
        self.free.push_back(e);
    }

    fn push_front(&mut self, b: u32) {
        let e = self.new_entry(b);
        self.free.push_front(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s8_events_report_cached_blocks_then_their_eviction_on_reuse_and_reset() {
        let mut pool = BlockPool::new(4, 2);
        pool.record_events(true);
        let mut got = Vec::new();
        pool.get_new_blocks(3, &mut got);
        pool.cache_block(1, 11, 0, &[1, 2]);
        pool.cache_block(2, 12, 11, &[3, 4]);
        let mut scratch = Vec::new();
        pool.free_blocks(got.iter().rev().copied(), &mut scratch);
        let events = pool.take_events();
        assert_eq!((events.stored, events.removed), (vec![11, 12], vec![]));
        // Free queue: 3 (uncached, front), then 2, 1 (cached, tail first):
        // two more blocks evict 12 and keep 11.
        got.clear();
        pool.get_new_blocks(2, &mut got);
        assert_eq!(pool.take_events().removed, vec![12]);
        pool.reset_prefix_cache();
        assert_eq!(pool.take_events().removed, vec![11]);
        assert!(pool.take_events().is_empty());
    }

    #[test]
    fn s8_no_events_are_kept_unless_recording() {
        let mut pool = BlockPool::new(3, 2);
        let mut got = Vec::new();
        pool.get_new_blocks(1, &mut got);
        pool.cache_block(1, 11, 0, &[1, 2]);
        assert!(pool.take_events().is_empty());
    }

    #[test]
    fn s8_pool_starts_with_all_but_the_null_block_free_in_id_order() {
        let pool = BlockPool::new(5, 2);
        assert_eq!(pool.free_queue(), vec![1, 2, 3, 4]);
        assert_eq!(pool.num_free_blocks(), 4);
    }

    #[test]
    fn s8_free_puts_uncached_at_front_and_cached_at_back_tail_first() {
        let mut pool = BlockPool::new(8, 2);
        let mut got = Vec::new();
        pool.get_new_blocks(4, &mut got);
        assert_eq!(got, vec![1, 2, 3, 4]);
        pool.cache_block(1, 11, 0, &[1, 2]);
        pool.cache_block(2, 12, 11, &[3, 4]);
        let mut scratch = Vec::new();
        pool.free_blocks(got.iter().rev().copied(), &mut scratch);
        // uncached 4,3 to the front (tail first), cached 2,1 to the back.
        assert_eq!(pool.free_queue(), vec![4, 3, 5, 6, 7, 2, 1]);
    }

    #[test]
    fn s8_allocation_evicts_cached_blocks_lazily_and_touch_revives_them() {
        let mut pool = BlockPool::new(3, 1);
        let mut got = Vec::new();
        pool.get_new_blocks(2, &mut got);
        pool.cache_block(1, 11, 0, &[7]);
        pool.free_blocks([1u32, 2].into_iter(), &mut Vec::new());
        assert_eq!(pool.free_queue(), vec![2, 1]);
        assert_eq!(
            pool.get_cached_block(11, 0, &[7]),
            Some(1),
            "free but still cached"
        );
        pool.touch(&[1]);
        assert_eq!(pool.ref_cnt(1), 1);
        assert_eq!(pool.free_queue(), vec![2]);
        pool.free_blocks([1u32].into_iter(), &mut Vec::new());
        let mut more = Vec::new();
        pool.get_new_blocks(2, &mut more);
        assert_eq!(more, vec![2, 1]);
        assert_eq!(pool.get_cached_block(11, 0, &[7]), None, "evicted on reuse");
        assert_eq!(pool.block_hash(1), None);
    }

    #[test]
    fn s16_usage_counts_held_blocks_only() {
        let mut pool = BlockPool::new(5, 1);
        assert_eq!(pool.usage(), 0.0);
        pool.get_new_blocks(2, &mut Vec::new());
        assert!((pool.usage() - 0.5).abs() < 1e-12);
    }
}
