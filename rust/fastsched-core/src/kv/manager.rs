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
    pub num_new_tokens: usize,
    pub num_lookahead_tokens: usize,
    /// S10: also require the whole current sequence to fit.
    pub full_sequence_must_fit: bool,
    /// Blocks that must stay free after this allocation (watermark).
    pub reserve_blocks: usize,
    /// The KV is being loaded asynchronously: cache the blocks once it lands.
    pub delay_cache: bool,
}

#[derive(Debug)]
pub struct KvCacheManager {
    pub pool: BlockPool,
    block_size: usize,
    max_model_len: usize,
    enable_caching: bool,
    req_blocks: Vec<Vec<u32>>,
    num_cached_blocks: Vec<usize>,
    pub stats: PrefixCacheStats,
    scratch: Vec<u32>,
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
            req_blocks: Vec::new(),
            num_cached_blocks: Vec::new(),
            stats: PrefixCacheStats::default(),
            scratch: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn blocks(&self, handle: Handle) -> &[u32] {
        self.req_blocks
            .get(handle as usize)
            .map_or(&[], |v| v.as_slice())
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
        if i >= self.req_blocks.len() {
            self.req_blocks.resize_with(i + 1, Vec::new);
            self.num_cached_blocks.resize(i + 1, 0);
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

    /// Allocates the slots for `num_new_tokens` more tokens (after any prefix
    /// hit), or returns `None` and changes nothing when the pool is short.
    /// Returns the number of blocks newly taken from the free queue.
    pub fn allocate_slots(
        &mut self,
        req: &Request,
        alloc: AllocRequest,
        hit: Option<&CacheHit>,
        new_blocks_out: &mut Vec<u32>,
    ) -> Option<usize> {
        if hit.is_none() && !alloc.full_sequence_must_fit {
            // A running request: most steps need no new block and fill none.
            let h = req.handle as usize;
            let held = self.req_blocks[h].len();
            let need =
                (req.num_computed_tokens + alloc.num_new_tokens + alloc.num_lookahead_tokens)
                    .min(self.max_model_len);
            let full = (req.num_computed_tokens + alloc.num_new_tokens).min(req.num_tokens())
                / self.block_size;
            if need <= held * self.block_size
                && (!self.enable_caching || full <= self.num_cached_blocks[h])
                && alloc.reserve_blocks <= self.pool.num_free_blocks()
            {
                return Some(0);
            }
        }
        let hit_blocks: &[u32] = hit.map_or(&[], |h| h.blocks.as_slice());
        let hit_tokens = hit.map_or(0, |h| h.num_tokens);
        self.ensure_slot(req.handle);
        let held = self.req_blocks[req.handle as usize].len();
        let num_computed = req.num_computed_tokens + hit_tokens;
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
            self.req_blocks[req.handle as usize].extend_from_slice(hit_blocks);
            self.num_cached_blocks[req.handle as usize] = hit_blocks.len();
        }
        let blocks = &mut self.req_blocks[req.handle as usize];
        let want = cdiv(need_slots, self.block_size).saturating_sub(blocks.len());
        let start = new_blocks_out.len();
        self.pool.get_new_blocks(want, new_blocks_out);
        blocks.extend_from_slice(&new_blocks_out[start..]);
        if self.enable_caching && !alloc.delay_cache {
            self.cache_blocks(
                req,
                (num_computed + alloc.num_new_tokens).min(req.num_tokens()),
            );
        }
        Some(want)
    }

    /// Registers every full block among the first `num_tokens` tokens.
    pub fn cache_blocks(&mut self, req: &Request, num_tokens: usize) {
        if !self.enable_caching {
            return;
        }
        let h = req.handle as usize;
        let num_full = num_tokens / self.block_size;
        let start = self.num_cached_blocks[h];
        if start >= num_full {
            return;
        }
        let bs = self.block_size;
        for i in start..num_full {
            let block = self.req_blocks[h][i];
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
        }
        self.num_cached_blocks[h] = num_full;
    }

    /// Frees a request's blocks tail first (S8).
    pub fn free(&mut self, handle: Handle) {
        let i = handle as usize;
        if i >= self.req_blocks.len() {
            return;
        }
        let blocks = std::mem::take(&mut self.req_blocks[i]);
        self.pool
            .free_blocks(blocks.iter().rev().copied(), &mut self.scratch);
        self.num_cached_blocks[i] = 0;
        // Keep the allocation for the next request that reuses this handle.
        let mut blocks = blocks;
        blocks.clear();
        self.req_blocks[i] = blocks;
    }

    /// Sum of blocks held by requests (for the S16 accounting check).
    pub fn num_held_blocks(&self) -> usize {
        self.req_blocks.iter().map(Vec::len).sum()
    }
}
