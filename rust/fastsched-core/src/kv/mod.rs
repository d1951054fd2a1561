//! KV cache: block pool, prefix cache, and the per-request manager the
//! scheduler talks to.

pub mod block;
pub mod block_pool;
pub mod manager;
pub mod prefix_cache;
mod table;

pub use block::Block;
pub use block_pool::{BlockPool, KvEvents};
pub use manager::{CacheHit, KvCacheManager, PrefixCacheStats};
pub use prefix_cache::BlockHasher;
