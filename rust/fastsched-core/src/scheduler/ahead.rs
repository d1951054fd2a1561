//! What the engine asks before scheduling a step ahead (async scheduling):
//! whether any request will still run once the steps in flight land.

use super::{PauseState, Scheduler};

impl Scheduler {
    /// Whether scheduling another step now can give a request a token that
    /// is not dropped: a waiting request the pause state (S13) lets in, or a
    /// running one that the tokens in flight (its output placeholders) do not
    /// take to `max_tokens` or `max_model_len` (S17). False means the next
    /// step would be a forward pass for requests that have all ended by then;
    /// a request that ends by EOS or a stop token is only known once its
    /// token lands, so it counts as running on.
    pub fn runs_after_in_flight(&self) -> bool {
        let waiting = match self.pause {
            PauseState::Unpaused => !self.waiting.is_empty() || !self.kv_holding.is_empty(),
            PauseState::PausedNew => !self.kv_holding.is_empty(),
            PauseState::PausedAll => return false,
        };
        let max_model_len = self.cfg.max_model_len;
        waiting
            || self.running.iter().any(|&h| {
                let slot = &self.requests[h as usize];
                let r = slot.req.as_ref().expect("running handle is live");
                let in_flight = slot.progress.num_output_placeholders as usize;
                if slot.progress.prefill_only {
                    // S20: it runs on while prompt tokens are left to schedule.
                    return slot.progress.num_computed_tokens < r.num_tokens();
                }
                r.num_output_tokens + in_flight < r.max_tokens
                    && r.num_tokens() + in_flight < max_model_len
            })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::SchedulerConfig;
    use crate::output::ModelRunnerOutput;
    use crate::request::NewRequest;
    use crate::scheduler::{PauseState, Scheduler};

    fn sched(max_model_len: usize) -> Scheduler {
        let cfg = SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            max_model_len,
            block_size: 4,
            num_gpu_blocks: 33,
            ..Default::default()
        };
        let mut s = Scheduler::new(cfg).expect("valid test config");
        s.set_async_scheduling(true);
        s
    }

    #[test]
    fn s17_a_request_whose_last_token_is_in_flight_does_not_run_after() {
        let mut s = sched(256);
        s.add_request(NewRequest::new("r", vec![3, 4, 5], 2))
            .unwrap();
        assert!(s.runs_after_in_flight(), "waiting");
        let o0 = s.schedule(); // prefill: samples token 1 (a placeholder)
        assert_eq!(o0.req_handles.len(), 1);
        assert!(s.runs_after_in_flight(), "token 2 is still to come");
        s.schedule(); // decode: samples token 2, the last one
        assert!(
            !s.runs_after_in_flight(),
            "both tokens in flight: max_tokens reached"
        );
        s.update_from_output(&ModelRunnerOutput::from_tokens(&[Some(9)]))
            .unwrap();
        assert!(!s.runs_after_in_flight());
    }

    #[test]
    fn s17_max_model_len_ends_a_request_too() {
        let mut s = sched(5);
        s.add_request(NewRequest::new("r", vec![3, 4, 5, 6], 100))
            .unwrap();
        s.schedule(); // 4 prompt tokens + 1 placeholder = max_model_len
        assert!(!s.runs_after_in_flight());
    }

    #[test]
    fn s13_paused_all_runs_nothing_and_paused_new_admits_nobody() {
        let mut s = sched(256);
        s.add_request(NewRequest::new("r", vec![3, 4, 5], 2))
            .unwrap();
        s.set_pause_state(PauseState::PausedNew);
        assert!(
            !s.runs_after_in_flight(),
            "a new request waits under paused_new"
        );
        s.set_pause_state(PauseState::Unpaused);
        s.schedule();
        s.set_pause_state(PauseState::PausedAll);
        assert!(!s.runs_after_in_flight());
    }
}
