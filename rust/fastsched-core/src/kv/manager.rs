//! Per-request view of the block pool: prefix lookups, slot allocation with
//! the full-sequence admission gate (S10), caching of full blocks, freeing.

use super::block_pool::BlockPool;
use crate::request::{Handle, Request};

#[inline]
fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// A prefix-cache hit found at admission.
#[derive(Debug, Default, Clone)]
pub struct CacheHit {
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
}

/// Lookup counters for metrics. Lookups by preempted requests (mostly hits on
/// their own old blocks) are kept apart so the hit rate describes new traffic.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub requests: u64,
    pub queries: u64,
    pub hits: u64,
    pub preempted_requests: u64,
    pub preempted_queries: u64,
    pub preempted_hits: u64,
}

/// How `allocate_slots` is asked to size an allocation.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocRequest {
    /// The request's `num_computed_tokens` (before any prefix hit).
    pub num_computed_tokens: usize,
    pub num_new_tokens: usize,
    pub num_lookahead_tokens: usize,
    /// S10: also require the whole current sequence to fit.
    pub full_sequence_must_fit: bool,
    /// Blocks that must stay free after this allocation (watermark).
    pub reserve_blocks: usize,
    /// Do not cache the blocks now: the caller calls `cache_blocks` later
    /// (an asynchronous load that has not landed, or a batch at the end of
    /// the running phase).
    pub delay_cache: bool,
}

/// How many blocks one request holds and how many of them (from the start)
/// are registered in the prefix cache: all that the per-step check of a
/// running request reads (see `fits_in_held_blocks`). Kept apart from the
/// block lists, 8 bytes per request, so that checking a whole running batch
/// reads a few kilobytes instead of a cache line per request. Block counts
/// fit in `u32` because block ids do.
#[derive(Debug, Default, Clone, Copy)]
struct BlockCounts {
    /// Always `lists[handle].len()`.
    num_blocks: u32,
    num_cached: u32,
}

#[derive(Debug)]
pub struct KvCacheManager {
    pub pool: BlockPool,
    block_size: usize,
    max_model_len: usize,
    enable_caching: bool,
    /// By handle: the blocks each request holds, in order.
    lists: Vec<Vec<u32>>,
    /// By handle: their counts.
    counts: Vec<BlockCounts>,
    pub stats: PrefixCacheStats,
    scratch: Vec<u32>,
    /// When set, every block `cache_blocks` registers, with its hash: the
    /// full blocks a KV connector may save.
    recorded: Option<Vec<(u32, u64)>>,
}

impl KvCacheManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
        enable_caching: bool,
    ) -> Self {
        KvCacheManager {
            pool: BlockPool::new(num_blocks, block_size),
            block_size,
            max_model_len,
            enable_caching,
            lists: Vec::new(),
            counts: Vec::new(),
            stats: PrefixCacheStats::default(),
            scratch: Vec::new(),
            recorded: None,
        }
    }

    /// Starts (or stops) recording the blocks `cache_blocks` registers.
    pub fn record_cached_blocks(&mut self, on: bool) {
        self.recorded = on.then(Vec::new);
    }

    /// The blocks registered since the last call, with their hashes.
    pub fn take_recorded(&mut self) -> Vec<(u32, u64)> {
        self.recorded
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// `cache_blocks` without recording: blocks whose KV came from the
    /// connector's store, which has them already.
    pub fn cache_blocks_unrecorded(&mut self, req: &Request, num_tokens: usize) {
        let recorded = self.recorded.take();
        self.cache_blocks(req, num_tokens);
        self.recorded = recorded;
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn blocks(&self, handle: Handle) -> &[u32] {
        self.lists
            .get(handle as usize)
            .map_or(&[], |blocks| blocks.as_slice())
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Blocks a sequence of `num_tokens` tokens occupies.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        cdiv(num_tokens, self.block_size)
    }

    fn ensure_slot(&mut self, handle: Handle) {
        let i = handle as usize;
        if i >= self.lists.len() {
            self.lists.resize_with(i + 1, Vec::new);
            self.counts.resize(i + 1, BlockCounts::default());
        }
    }

    /// S8: the longest run of cached blocks from the start of the request,
    /// capped at `num_tokens - 1` tokens so the last token is always computed.
    pub fn get_computed_blocks(&mut self, req: &Request) -> CacheHit {
        if !self.enable_caching {
            return CacheHit::default();
        }
        let max_blocks = (req.num_tokens() - 1) / self.block_size;
        let mut hit = CacheHit::default();
        let mut parent = req.hash_root;
        for i in 0..max_blocks.min(req.block_hashes.len()) {
            let tokens = &req.token_ids[i * self.block_size..(i + 1) * self.block_size];
            let h = req.block_hashes[i];
            match self.pool.get_cached_block(h, parent, tokens) {
                Some(b) => hit.blocks.push(b),
                None => break,
            }
            parent = h;
        }
        hit.num_tokens = hit.blocks.len() * self.block_size;
        let s = &mut self.stats;
        if req.num_preemptions > 0 {
            s.preempted_requests += 1;
            s.preempted_queries += req.num_tokens() as u64;
            s.preempted_hits += hit.num_tokens as u64;
        } else {
            s.requests += 1;
            s.queries += req.num_tokens() as u64;
            s.hits += hit.num_tokens as u64;
        }
        hit
    }

    /// Blocks a hit would take out of the free queue (cached but unreferenced).
    fn num_evictable(&self, hit_blocks: &[u32]) -> usize {
        hit_blocks
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count()
    }

    /// Whether a running request's allocation (no prefix hit, no
    /// full-sequence gate) is already covered by the blocks it holds and
    /// completes no block to cache, so that `allocate_slots` would change
    /// nothing: true in most steps. Decided from the request's block counts
    /// alone (`num_tokens` is its current length), without divisions.
    #[inline]
    pub fn fits_in_held_blocks(
        &self,
        handle: Handle,
        alloc: &AllocRequest,
        num_tokens: usize,
    ) -> bool {
        let c = self.counts[handle as usize];
        let need = (alloc.num_computed_tokens + alloc.num_new_tokens + alloc.num_lookahead_tokens)
            .min(self.max_model_len);
        // Tokens whose blocks must be cached (all full ones among them);
        // compared as token counts to keep divisions out of this path.
        let to_cache = (alloc.num_computed_tokens + alloc.num_new_tokens).min(num_tokens);
        need <= c.num_blocks as usize * self.block_size
            && (!self.enable_caching
                || alloc.delay_cache
                || to_cache < (c.num_cached as usize + 1) * self.block_size)
            && alloc.reserve_blocks <= self.pool.num_free_blocks()
    }

    /// Loads the block counts of these requests (see `fits_in_held_blocks`)
    /// in a loop short enough for their cache misses to overlap. Only a
    /// performance hint.
    pub fn warm_block_counts(&self, handles: &[Handle]) {
        let mut sink = 0u32;
        for &h in handles {
            if let Some(c) = self.counts.get(h as usize) {
                sink ^= c.num_blocks;
            }
        }
        std::hint::black_box(sink);
    }

    /// Allocates the slots for `num_new_tokens` more tokens (after any prefix
    /// hit), or returns `None` and changes nothing when the pool is short.
    /// Returns the number of blocks newly taken from the free queue; their
    /// ids are appended to `new_blocks_out`.
    #[inline]
    pub fn allocate_slots(
        &mut self,
        req: &Request,
        alloc: AllocRequest,
        hit: Option<&CacheHit>,
        new_blocks_out: &mut Vec<u32>,
    ) -> Option<usize> {
        if hit.is_none()
            && !alloc.full_sequence_must_fit
            && self.fits_in_held_blocks(req.handle, &alloc, req.num_tokens())
        {
            // This test is inlined into the caller; the rest is not.
            return Some(0);
        }
        self.allocate_new_slots(req, alloc, hit, new_blocks_out)
    }

    /// The general case of `allocate_slots`, kept out of line so that the
    /// test above stays small where it is inlined.
    #[inline(never)]
    fn allocate_new_slots(
        &mut self,
        req: &Request,
        alloc: AllocRequest,
        hit: Option<&CacheHit>,
        new_blocks_out: &mut Vec<u32>,
    ) -> Option<usize> {
        let hit_blocks: &[u32] = hit.map_or(&[], |h| h.blocks.as_slice());
        let hit_tokens = hit.map_or(0, |h| h.num_tokens);
        self.ensure_slot(req.handle);
        let h = req.handle as usize;
        let held = self.lists[h].len();
        let num_computed = alloc.num_computed_tokens + hit_tokens;
        let need_slots = (num_computed + alloc.num_new_tokens + alloc.num_lookahead_tokens)
            .min(self.max_model_len);
        let evictable = self.num_evictable(hit_blocks);
        let free = self.pool.num_free_blocks();
        let blocks_needed = |tokens: usize| {
            (cdiv(tokens, self.block_size) + evictable).saturating_sub(hit_blocks.len() + held)
        };
        if alloc.full_sequence_must_fit {
            let full = req.num_tokens().min(self.max_model_len);
            if blocks_needed(full) + alloc.reserve_blocks > free {
                return None;
            }
        }
        if blocks_needed(need_slots) + alloc.reserve_blocks > free {
            return None;
        }
        if !hit_blocks.is_empty() {
            self.pool.touch(hit_blocks);
            self.lists[h].extend_from_slice(hit_blocks);
            self.counts[h].num_cached = hit_blocks.len() as u32;
        }
        let blocks = &mut self.lists[h];
        let want = cdiv(need_slots, self.block_size).saturating_sub(blocks.len());
        let start = new_blocks_out.len();
        self.pool.get_new_blocks(want, new_blocks_out);
        blocks.extend_from_slice(&new_blocks_out[start..]);
        self.counts[h].num_blocks = blocks.len() as u32;
        if self.enable_caching && !alloc.delay_cache {
            self.cache_blocks(
                req,
                (num_computed + alloc.num_new_tokens).min(req.num_tokens()),
            );
        }
        Some(want)
    }

    /// Whether `cache_blocks(req, num_tokens)` would register any block.
    #[inline]
    pub fn has_blocks_to_cache(&self, handle: Handle, num_tokens: usize) -> bool {
        self.enable_caching
            && num_tokens
                >= (self.counts[handle as usize].num_cached as usize + 1) * self.block_size
    }

    /// Loads what `cache_blocks` will touch for each `(request, num_tokens)`,
    /// all at once (see `BlockPool::warm_for_caching`).
    pub fn warm_for_caching<'a>(&self, batch: impl Iterator<Item = (&'a Request, usize)>) {
        for (req, num_tokens) in batch {
            let h = req.handle as usize;
            let num_cached = self.counts[h].num_cached as usize;
            let num_full = num_tokens / self.block_size;
            if num_cached < num_full {
                self.pool.warm_for_caching(
                    &self.lists[h][num_cached..num_full],
                    &req.block_hashes[num_cached..num_full],
                );
            }
        }
    }

    /// Registers every full block among the first `num_tokens` tokens.
    pub fn cache_blocks(&mut self, req: &Request, num_tokens: usize) {
        if !self.enable_caching {
            return;
        }
        let h = req.handle as usize;
        let num_full = num_tokens / self.block_size;
        let start = self.counts[h].num_cached as usize;
        if start >= num_full {
            return;
        }
        let bs = self.block_size;
        let blocks = &self.lists[h];
        if num_full - start > 1 {
            self.pool
                .warm_for_caching(&blocks[start..num_full], &req.block_hashes[start..num_full]);
        }
        for (i, &block) in blocks.iter().enumerate().take(num_full).skip(start) {
            let parent = if i == 0 {
                req.hash_root
            } else {
                req.block_hashes[i - 1]
            };
            self.pool.cache_block(
                block,
                req.block_hashes[i],
                parent,
                &req.token_ids[i * bs..(i + 1) * bs],
            );
            if let Some(recorded) = self.recorded.as_mut() {
                recorded.push((block, req.block_hashes[i]));
            }
        }
        self.counts[h].num_cached = num_full as u32;
    }

    /// Frees a request's blocks tail first (S8).
    pub fn free(&mut self, handle: Handle) {
        let i = handle as usize;
        let Some(blocks) = self.lists.get_mut(i) else {
            return;
        };
        self.pool
            .free_blocks(blocks.iter().rev().copied(), &mut self.scratch);
        // Keep the allocation for the next request that reuses this handle.
        blocks.clear();
        self.counts[i] = BlockCounts::default();
    }

    /// Sum of blocks held by requests (for the S16 accounting check).
    pub fn num_held_blocks(&self) -> usize {
        self.lists.iter().map(Vec::len).sum()
    }

    /// S16: the pool's accounting, and every request's block counts match
    /// its block list.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        for (h, (blocks, c)) in self.lists.iter().zip(&self.counts).enumerate() {
            if c.num_blocks as usize != blocks.len() || c.num_cached > c.num_blocks {
                return Err(format!(
                    "handle {h} holds {} blocks but its counts say {} ({} cached)",
                    blocks.len(),
                    c.num_blocks,
                    c.num_cached
                ));
            }
        }
        Ok(())
    }
}
