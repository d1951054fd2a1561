//! The paged KV block pool (S8): reference counts, a doubly linked free
//! queue that doubles as the LRU of cached blocks, and lazy eviction.
//!
//! Block 0 is the null block and is never handed out. Free blocks sit in one
//! queue; allocation pops from the front and evicts a cached block only then.
//! Freed blocks without a hash go to the front (reused first), cached ones to
//! the back (evicted last).

use super::prefix_cache::PrefixCache;

const NIL: u32 = u32::MAX;

#[derive(Debug)]
pub struct BlockPool {
    num_blocks: usize,
    ref_cnt: Vec<u32>,
    /// `Some(hash)` while the block is in the prefix cache.
    hash: Vec<Option<u64>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    pub cache: PrefixCache,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = BlockPool {
            num_blocks,
            ref_cnt: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            in_free: vec![false; num_blocks],
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
        self.ref_cnt[block as usize]
    }

    pub fn block_hash(&self, block: u32) -> Option<u64> {
        self.hash[block as usize]
    }

    /// Pops `n` blocks from the front, evicting any cached content they hold.
    /// The caller has checked `n <= num_free_blocks()`.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<u32>) {
        debug_assert!(n <= self.num_free);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                self.cache.remove(b, h);
            }
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
    }

    /// A prefix hit takes its blocks: free ones leave the free queue.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.ref_cnt[b as usize] == 0 && b != 0 {
                self.unlink(b);
            }
            self.ref_cnt[b as usize] += 1;
        }
    }

    /// Releases blocks given in the order to free them (a request's tail
    /// first). Uncached blocks that drop to zero go to the front keeping that
    /// order; cached ones go to the back, also in that order.
    pub fn free_blocks(&mut self, ordered: impl Iterator<Item = u32>, scratch: &mut Vec<u32>) {
        scratch.clear();
        for b in ordered {
            let rc = &mut self.ref_cnt[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc -= 1;
            if *rc == 0 && b != 0 {
                if self.hash[b as usize].is_some() {
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
        debug_assert!(self.hash[block as usize].is_none());
        self.hash[block as usize] = Some(hash);
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
            b = self.next[b as usize];
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
            let free = self.in_free[b];
            let referenced = self.ref_cnt[b] > 0;
            if free == referenced {
                return Err(format!(
                    "block {b}: in_free={free} ref_cnt={}",
                    self.ref_cnt[b]
                ));
            }
        }
        Ok(())
    }

    fn unlink(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.in_free[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_free[i] = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(!self.in_free[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.in_free[i] = true;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(!self.in_free[i]);
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.in_free[i] = true;
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
