//! Scheduler configuration (docs/design.md §3) and its start-up validation.

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Fcfs,
    Priority,
}

impl std::str::FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            other => Err(Error::InvalidConfig(format!(
                "policy ({other:?}) must be \"fcfs\" or \"priority\""
            ))),
        }
    }
}

/// How prefix-cache block hashes are computed (vLLM's
/// `--prefix-caching-hash-algo`). Hashes are 64 bits either way, and a cache
/// hit is confirmed against the block's tokens and parent in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashAlgo {
    /// A fast non-cryptographic hash: enough for one engine's own cache.
    #[default]
    Builtin,
    /// The first 8 bytes of SHA-256: hashes that a client cannot steer into
    /// a collision, for blocks shared across engines through a KV store.
    Sha256,
}

impl HashAlgo {
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Builtin => "builtin",
            HashAlgo::Sha256 => "sha256",
        }
    }
}

impl std::str::FromStr for HashAlgo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "builtin" => Ok(HashAlgo::Builtin),
            "sha256" => Ok(HashAlgo::Sha256),
            other => Err(Error::InvalidConfig(format!(
                "prefix_caching_hash_algo ({other:?}) must be \"builtin\" or \"sha256\""
            ))),
        }
    }
}

/// Every knob of the per-step decision. `None` fields take their documented
/// default in [`SchedulerConfig::resolved`].
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_active_seqs: Option<usize>,
    pub max_num_batched_tokens: usize,
    pub max_num_scheduled_tokens: Option<usize>,
    pub max_model_len: usize,
    pub long_prefill_token_threshold: usize,
    pub long_prefill_token_threshold_adaptive: bool,
    pub prefill_schedule_interval: usize,
    pub enable_chunked_prefill: bool,
    pub policy: Policy,
    pub max_loras: usize,
    /// `k`: draft tokens a running request may carry into a step for
    /// verification (speculative decoding; 0 = off).
    pub num_speculative_tokens: usize,
    /// KV slots reserved past a request's scheduled tokens, and input-budget
    /// slots kept free when admitting, for a drafter that writes KV for its
    /// proposals (vLLM's `num_lookahead_tokens`: `k` for EAGLE or a draft
    /// model). 0 for drafters that do not (n-gram, or drafts supplied by the
    /// caller), as in vLLM.
    pub num_lookahead_tokens: usize,
    pub block_size: usize,
    /// Blocks in the pool *including* the reserved null block 0.
    pub num_gpu_blocks: usize,
    pub enable_prefix_caching: bool,
    pub prefix_caching_hash_algo: HashAlgo,
    pub scheduler_reserve_full_isl: bool,
    pub watermark: f64,
    /// Priority preemption (opt-in): a strictly more urgent waiting request
    /// displaces the worst running one when the active set is full.
    pub priority_preemption: bool,
    /// A running request already preempted this many times is never a
    /// victim of priority preemption.
    pub max_preemptions_per_request: u32,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_active_seqs: None,
            max_num_batched_tokens: 8192,
            max_num_scheduled_tokens: None,
            max_model_len: 8192,
            long_prefill_token_threshold: 0,
            long_prefill_token_threshold_adaptive: false,
            prefill_schedule_interval: 1,
            enable_chunked_prefill: true,
            policy: Policy::Fcfs,
            max_loras: 0,
            num_speculative_tokens: 0,
            num_lookahead_tokens: 0,
            block_size: 16,
            num_gpu_blocks: 4096,
            enable_prefix_caching: true,
            prefix_caching_hash_algo: HashAlgo::Builtin,
            scheduler_reserve_full_isl: true,
            watermark: 0.0,
            priority_preemption: false,
            max_preemptions_per_request: 3,
        }
    }
}

impl SchedulerConfig {
    pub fn max_num_active_seqs(&self) -> usize {
        self.max_num_active_seqs.unwrap_or(self.max_num_seqs)
    }

    pub fn max_num_scheduled_tokens(&self) -> usize {
        self.max_num_scheduled_tokens
            .unwrap_or(self.max_num_batched_tokens)
    }

    /// Usable blocks: the pool minus the null block.
    pub fn num_usable_blocks(&self) -> usize {
        self.num_gpu_blocks.saturating_sub(1)
    }

    /// Fails fast with a message naming both values of a broken relation.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs (0) must be at least 1".into());
        }
        if let Some(active) = self.max_num_active_seqs {
            if active == 0 {
                return bad("max_num_active_seqs (0) must be at least 1".into());
            }
            if active > self.max_num_seqs {
                return bad(format!(
                    "max_num_active_seqs ({active}) cannot be greater than max_num_seqs ({})",
                    self.max_num_seqs
                ));
            }
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return bad(format!(
                "max_num_batched_tokens ({}) must be greater than or equal to max_num_seqs ({})",
                self.max_num_batched_tokens, self.max_num_seqs
            ));
        }
        if let Some(sched) = self.max_num_scheduled_tokens {
            if sched < self.max_num_batched_tokens {
                return bad(format!(
                    "max_num_scheduled_tokens ({sched}) must be greater than or equal to max_num_batched_tokens ({})",
                    self.max_num_batched_tokens
                ));
            }
        }
        if self.max_model_len == 0 {
            return bad("max_model_len (0) must be at least 1".into());
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return bad(format!(
                "max_num_batched_tokens ({}) must be greater than or equal to max_model_len ({}) when chunked prefill is disabled",
                self.max_num_batched_tokens, self.max_model_len
            ));
        }
        if self.prefill_schedule_interval == 0 {
            return bad("prefill_schedule_interval (0) must be at least 1".into());
        }
        if self.block_size == 0 {
            return bad("block_size (0) must be at least 1".into());
        }
        if self.num_gpu_blocks < 2 {
            return bad(format!(
                "num_gpu_blocks ({}) must be at least 2 (block 0 is reserved as the null block)",
                self.num_gpu_blocks
            ));
        }
        if self.num_gpu_blocks > u32::MAX as usize {
            return bad(format!(
                "num_gpu_blocks ({}) must be at most {}",
                self.num_gpu_blocks,
                u32::MAX
            ));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return bad(format!("watermark ({}) must be in [0, 1)", self.watermark));
        }
        if self.num_speculative_tokens >= self.max_num_batched_tokens {
            return bad(format!(
                "num_speculative_tokens ({}) must be smaller than max_num_batched_tokens ({})",
                self.num_speculative_tokens, self.max_num_batched_tokens
            ));
        }
        if self.num_lookahead_tokens >= self.max_num_batched_tokens {
            return bad(format!(
                "num_lookahead_tokens ({}) must be smaller than max_num_batched_tokens ({})",
                self.num_lookahead_tokens, self.max_num_batched_tokens
            ));
        }
        if self.priority_preemption && self.policy != Policy::Priority {
            return bad(format!(
                "priority_preemption (true) requires policy \"priority\", got policy ({:?})",
                match self.policy {
                    Policy::Fcfs => "fcfs",
                    Policy::Priority => "priority",
                }
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(cfg: SchedulerConfig) -> String {
        match cfg.validate() {
            Err(Error::InvalidConfig(m)) => m,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn config_default_is_valid() {
        SchedulerConfig::default().validate().unwrap();
    }

    #[test]
    fn config_active_seqs_above_slots_names_both_values() {
        let m = msg(SchedulerConfig {
            max_num_active_seqs: Some(300),
            ..Default::default()
        });
        assert_eq!(
            m,
            "max_num_active_seqs (300) cannot be greater than max_num_seqs (256)"
        );
    }

    #[test]
    fn config_budget_below_slots_names_both_values() {
        let m = msg(SchedulerConfig {
            max_num_batched_tokens: 128,
            ..Default::default()
        });
        assert_eq!(
            m,
            "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)"
        );
    }

    #[test]
    fn config_without_chunking_budget_must_cover_model_len() {
        let m = msg(SchedulerConfig {
            enable_chunked_prefill: false,
            max_num_batched_tokens: 4096,
            max_model_len: 8192,
            ..Default::default()
        });
        assert!(m.contains("4096") && m.contains("8192"), "{m}");
    }

    #[test]
    fn config_rejects_tiny_pool_and_bad_watermark_and_policy() {
        assert!(msg(SchedulerConfig {
            num_gpu_blocks: 1,
            ..Default::default()
        })
        .contains("num_gpu_blocks (1)"));
        assert!(msg(SchedulerConfig {
            watermark: 1.5,
            ..Default::default()
        })
        .contains("watermark (1.5)"));
        assert!("lifo".parse::<Policy>().is_err());
    }
}
