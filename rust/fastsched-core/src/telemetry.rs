//! Gate telemetry: why each step's waiting-phase scan stopped and why
//! waiting requests were skipped. Plain counters indexed by the enums, so
//! recording is one add, never an allocation.

/// Why the waiting-phase scan of a `schedule()` stopped, or why it did not
/// run (`Preempted`, and `Paused`/`NoWaiting` under PAUSED_ALL). Exactly one
/// per `schedule()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScanStop {
    /// S6: `running + sessions waiting for input ≥ max_num_active_seqs`.
    ActiveSeqs = 0,
    /// S1: the token budget (or the input budget) is spent, or (without
    /// chunked prefill) the next prompt is larger than what is left of it.
    TokenBudget = 1,
    /// S10: the next request's KV does not fit.
    KvBlocks = 2,
    /// S1/Difference 9: what is left of the input budget is only the
    /// reserved draft slots.
    DraftSlots = 3,
    /// S13: requests wait, but the pause state forbids taking them.
    Paused = 4,
    /// S12: the next request carries prefill work in a deferred step.
    PrefillInterval = 5,
    /// Nothing (left) to take: both queues empty, or every remaining
    /// request was skipped (see [`SkipReason`]).
    NoWaiting = 6,
    /// S5: the step preempted, so the waiting phase did not run.
    Preempted = 7,
}

impl ScanStop {
    pub const COUNT: usize = 8;
    /// Every gate, in index order.
    pub const ALL: [ScanStop; Self::COUNT] = [
        ScanStop::ActiveSeqs,
        ScanStop::TokenBudget,
        ScanStop::KvBlocks,
        ScanStop::DraftSlots,
        ScanStop::Paused,
        ScanStop::PrefillInterval,
        ScanStop::NoWaiting,
        ScanStop::Preempted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ScanStop::ActiveSeqs => "active_seqs",
            ScanStop::TokenBudget => "token_budget",
            ScanStop::KvBlocks => "kv_blocks",
            ScanStop::DraftSlots => "draft_slots",
            ScanStop::Paused => "paused",
            ScanStop::PrefillInterval => "prefill_interval",
            ScanStop::NoWaiting => "no_waiting",
            ScanStop::Preempted => "preempted",
        }
    }
}

/// Why the waiting phase skipped a request (S7: skip, don't stop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// Its adapter would exceed `max_loras` in this step.
    LoraSlots = 0,
    /// Its remote KV load is not done.
    RemoteKv = 1,
    /// An output of an earlier step is still in flight (async scheduling).
    StaleOutput = 2,
}

impl SkipReason {
    pub const COUNT: usize = 3;
    /// Every reason, in index order.
    pub const ALL: [SkipReason; Self::COUNT] = [
        SkipReason::LoraSlots,
        SkipReason::RemoteKv,
        SkipReason::StaleOutput,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::LoraSlots => "lora_slots",
            SkipReason::RemoteKv => "remote_kv",
            SkipReason::StaleOutput => "stale_output",
        }
    }
}

/// The scheduler's gate counters, since it was created.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GateCounters {
    /// Indexed by `ScanStop as usize`; sums to the number of `schedule()` calls.
    pub scan_stops_total: [u64; ScanStop::COUNT],
    /// Indexed by `SkipReason as usize`; one per skipped request per step.
    pub skips_total: [u64; SkipReason::COUNT],
    /// The stop of the latest `schedule()`; `None` before the first.
    pub last_scan_stop: Option<ScanStop>,
}

impl GateCounters {
    #[inline]
    pub(crate) fn record_stop(&mut self, stop: ScanStop) {
        self.scan_stops_total[stop as usize] += 1;
        self.last_scan_stop = Some(stop);
    }

    #[inline]
    pub(crate) fn record_skip(&mut self, reason: SkipReason) {
        self.skips_total[reason as usize] += 1;
    }

    pub fn scan_stops(&self, stop: ScanStop) -> u64 {
        self.scan_stops_total[stop as usize]
    }

    pub fn skips(&self, reason: SkipReason) -> u64 {
        self.skips_total[reason as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_names_are_unique_and_all_lists_follow_the_indexes() {
        for (i, g) in ScanStop::ALL.iter().enumerate() {
            assert_eq!(*g as usize, i);
        }
        for (i, r) in SkipReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        let mut names: Vec<_> = ScanStop::ALL.iter().map(|g| g.as_str()).collect();
        names.extend(SkipReason::ALL.iter().map(|r| r.as_str()));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
