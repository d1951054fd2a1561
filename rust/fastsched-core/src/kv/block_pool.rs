//! The paged KV block pool (S8): reference counts, a doubly linked free
//! queue that doubles as the LRU of cached blocks, and lazy eviction.
//!
//! Block 0 is the null block and is never handed out. Free blocks sit in one
//! queue; allocation pops from the front and evicts a cached block only then.
//! Freed blocks without a hash go to the front (reused first), cached ones to
//! the back (evicted last).

use super::prefix_cache::PrefixCache;

const NIL: u32 = u32::MAX;

/// Everything the free queue and reference counting touch for one block,
/// in one place: a block operation costs one cache line, not four.
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    ref_cnt: u32,
    in_free: bool,
}

#[derive(Debug)]
pub struct BlockPool {
    num_blocks: usize,
    links: Vec<Link>,
    head: u32,
    tail: u32,
    num_free: usize,
    pub cache: PrefixCache,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = BlockPool {
            num_blocks,
            links: vec![
                Link {
                    prev: NIL,
                    next: NIL,
                    ref_cnt: 0,
                    in_free: false
                };
                num_blocks
            ],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cache: PrefixCache::new(num_blocks, block_size),
        };
        for b in 1..num_blocks as u32 {
            pool.push_back(b);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
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
        self.links[block as usize].ref_cnt
    }

    pub fn block_hash(&self, block: u32) -> Option<u64> {
        self.cache.hash_of(block)
    }

    /// Pops `n` blocks from the front, evicting any cached content they hold.
    /// The caller has checked `n <= num_free_blocks()`.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<u32>) {
        debug_assert!(n <= self.num_free);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            self.cache.evict(b);
            self.links[b as usize].ref_cnt = 1;
            out.push(b);
        }
    }

    /// A prefix hit takes its blocks: free ones leave the free queue.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.links[b as usize].ref_cnt == 0 && b != 0 {
                self.unlink(b);
            }
            self.links[b as usize].ref_cnt += 1;
        }
    }

    /// Releases blocks given in the order to free them (a request's tail
    /// first). Uncached blocks that drop to zero go to the front keeping that
    /// order; cached ones go to the back, also in that order.
    pub fn free_blocks(&mut self, ordered: impl Iterator<Item = u32>, scratch: &mut Vec<u32>) {
        scratch.clear();
        for b in ordered {
            let rc = &mut self.links[b as usize].ref_cnt;
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc -= 1;
            if *rc == 0 && b != 0 {
                if self.cache.hash_of(b).is_some() {
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

    /// Registers a full block's content in the prefix cache.
    pub fn cache_block(&mut self, block: u32, hash: u64, parent: u64, tokens: &[u32]) {
        self.cache.insert(block, hash, parent, tokens);
    }

    /// A cached block whose content is `parent` + `tokens`, if any.
    pub fn get_cached_block(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        self.cache.get(hash, parent, tokens)
    }

    /// Free queue from front to back (tests and diagnostics).
    pub fn free_queue(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.head;
        while b != NIL {
            out.push(b);
            b = self.links[b as usize].next;
        }
        out
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
            let link = self.links[b];
            if link.in_free == (link.ref_cnt > 0) {
                return Err(format!(
                    "block {b}: in_free={} ref_cnt={}",
                    link.in_free, link.ref_cnt
                ));
            }
        }
        Ok(())
    }

    fn unlink(&mut self, b: u32) {
        let Link { prev, next, .. } = self.links[b as usize];
        debug_assert!(self.links[b as usize].in_free);
        if prev == NIL {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        let link = &mut self.links[b as usize];
        link.prev = NIL;
        link.next = NIL;
        link.in_free = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        debug_assert!(!self.links[b as usize].in_free);
        let tail = self.tail;
        let link = &mut self.links[b as usize];
        link.prev = tail;
        link.next = NIL;
        link.in_free = true;
        if tail == NIL {
            self.head = b;
        } else {
            self.links[tail as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        debug_assert!(!self.links[b as usize].in_free);
        let head = self.head;
        let link = &mut self.links[b as usize];
        link.next = head;
        link.prev = NIL;
        link.in_free = true;
        if head == NIL {
            self.tail = b;
        } else {
            self.links[head as usize].prev = b;
        }
        self.head = b;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
