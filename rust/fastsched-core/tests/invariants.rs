//! S16: property tests over random traces of adds, aborts, outputs, pauses,
//! streaming input and remote KV loads. The invariants are checked after
//! every step, and every trace must drain completely once arrivals stop.

use fastsched_core::connector::{KvLoad, TestConnector};
use fastsched_core::{
    Handle, ModelRunnerOutput, NewRequest, PauseState, Policy, ScanStop, Scheduler,
    SchedulerConfig, StreamInput,
};
use proptest::prelude::*;

const STEPS_PER_CASE: usize = 200;
const CASES: u32 = 64; // 64 x 200 = 12,800 checked steps, plus the drains

/// xorshift64*: the trace's events derive from one seed, so a failing case
/// reproduces from the config and seed proptest prints.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone)]
struct Knobs {
    cfg: SchedulerConfig,
    connector: bool,
    streaming: bool,
    pauses: bool,
    seed: u64,
}

fn knobs() -> impl Strategy<Value = Knobs> {
    (
        (
            1usize..=12,
            0usize..=12,
            prop::sample::select(vec![4usize, 8, 16]),
        ),
        (
            0usize..=3,
            any::<bool>(),
            prop::sample::select(vec![1usize, 1, 3]),
        ),
        (any::<bool>(), any::<bool>(), any::<bool>(), 0usize..=2),
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<u64>()),
        (1usize..=6, any::<bool>(), 0usize..=2, any::<bool>()),
    )
        .prop_map(
            |(
                (max_num_seqs, active_cut, block_size),
                (threshold_sel, adaptive, interval),
                (chunked, priority, caching, loras),
                (connector, streaming, pauses, seed),
                (pool_factor, full_isl, spec, lookahead),
            )| {
                let max_model_len = 96;
                let budget = if chunked {
                    16 + 8 * max_num_seqs
                } else {
                    max_model_len + 8
                };
                // From half a full-length request (prompts that never fit are
                // ignored, sequences that outgrow it end) to three of them.
                let num_blocks = (pool_factor * max_model_len / 2).div_ceil(block_size) + 1;
                let cfg = SchedulerConfig {
                    max_num_seqs,
                    max_num_active_seqs: Some(
                        (max_num_seqs - active_cut.min(max_num_seqs - 1)).max(1),
                    ),
                    max_num_batched_tokens: budget.max(max_num_seqs),
                    max_model_len,
                    long_prefill_token_threshold: [0, 8, 24, 40][threshold_sel],
                    long_prefill_token_threshold_adaptive: adaptive,
                    prefill_schedule_interval: interval,
                    enable_chunked_prefill: chunked,
                    policy: if priority {
                        Policy::Priority
                    } else {
                        Policy::Fcfs
                    },
                    max_loras: loras,
                    num_speculative_tokens: spec,
                    // An EAGLE-like drafter (KV and input slots for its
                    // drafts) or an n-gram one (none).
                    num_lookahead_tokens: if lookahead { spec } else { 0 },
                    block_size,
                    num_gpu_blocks: num_blocks,
                    enable_prefix_caching: caching,
                    scheduler_reserve_full_isl: full_isl,
                    // Opt-in priority preemption, on for half the priority runs.
                    priority_preemption: priority && (seed >> 1) & 1 == 1,
                    max_preemptions_per_request: 2,
                    ..Default::default()
                };
                Knobs {
                    cfg,
                    connector,
                    streaming,
                    pauses,
                    seed: seed | 1,
                }
            },
        )
}

struct Driver {
    s: Scheduler,
    rng: Rng,
    next_id: u64,
    ids: Vec<String>,
    sessions: Vec<String>,
    knobs: Knobs,
    /// Engine-driven connector (half the connector cases): loads the
    /// "engine" has not reported yet.
    engine_loads: Option<Vec<KvLoad>>,
}

impl Driver {
    fn new(knobs: Knobs) -> Self {
        let mut s = Scheduler::new(knobs.cfg.clone()).expect("generated configs are valid");
        let engine_connector = knobs.connector && (knobs.seed >> 2) & 1 == 1;
        if engine_connector {
            s.use_engine_connector();
        } else if knobs.connector {
            s.set_connector(Box::new(TestConnector::new(24, 2, knobs.cfg.block_size)));
        }
        Driver {
            s,
            rng: Rng(knobs.seed),
            next_id: 0,
            ids: Vec::new(),
            sessions: Vec::new(),
            knobs,
            engine_loads: engine_connector.then(Vec::new),
        }
    }

    fn add_random(&mut self) {
        let rng = &mut self.rng;
        let id = format!("r{}", self.next_id);
        self.next_id += 1;
        let prompt_len = 1 + rng.below(60) as usize;
        // Shared prefixes make prefix hits (and duplicate blocks) common.
        let family = rng.below(4) as u32;
        let prompt: Vec<u32> = (0..prompt_len as u32)
            .map(|i| {
                if i < 24 {
                    family * 1000 + i
                } else {
                    5000 + rng.below(500) as u32
                }
            })
            .collect();
        let mut req = NewRequest::new(id.clone(), prompt, 1 + rng.below(30) as usize);
        req.eos_token_id = Some(2);
        req.priority = rng.below(4) as i64;
        req.arrival_time = self.next_id as f64;
        if self.knobs.cfg.max_loras > 0 && rng.chance(50) {
            req.lora_id = Some(rng.below(4) as u32);
        }
        if rng.chance(10) {
            req.stop_token_ids = vec![3];
        }
        if self.knobs.streaming && rng.chance(15) {
            req.streaming = true;
            self.sessions.push(id.clone());
        }
        let h = self.s.add_request(req).expect("valid request");
        if self.engine_loads.is_some() && self.rng.chance(50) {
            let n = self.rng.below(prompt_len as u64 + 1) as usize;
            // An ignored prompt has already ended.
            let _ = self.s.set_external_tokens(h, n);
        }
        self.ids.push(id);
    }

    fn stream_events(&mut self) {
        for i in (0..self.sessions.len()).rev() {
            if !self.rng.chance(20) {
                continue;
            }
            let id = self.sessions[i].clone();
            if self.rng.chance(30) {
                self.sessions.swap_remove(i);
                let _ = self.s.close_stream(&id); // may already have ended (abort, max_model_len)
                continue;
            }
            let len = 1 + self.rng.below(8) as usize;
            let input = StreamInput {
                token_ids: (0..len as u32).map(|t| 7000 + t).collect(),
                max_tokens: 1 + self.rng.below(5) as usize,
                is_last: false,
            };
            if self.s.add_stream_input(&id, input).is_err() {
                self.sessions.swap_remove(i); // the session ended
            }
        }
    }

    /// One engine step with the S16 checks; returns whether it was idle.
    /// The engine's side of an engine-driven connector: reports some loads
    /// (whole, partial or failed) and checks what the scheduler hands out.
    fn engine_connector_events(&mut self) {
        let Some(mut loads) = self.engine_loads.take() else {
            return;
        };
        for load in self.s.take_kv_loads().unwrap() {
            let r = self.s.request(load.handle).unwrap();
            let table = self.s.blocks_of(load.handle);
            let end = load.first_block + load.block_ids.len();
            assert!(!load.block_ids.is_empty());
            assert_eq!(&table[load.first_block..end], &load.block_ids[..]);
            assert_eq!(
                &r.block_hashes[load.first_block..end],
                &load.block_hashes[..]
            );
            assert!(
                end * self.knobs.cfg.block_size < r.num_tokens(),
                "the last token is loaded"
            );
            loads.push(load);
        }
        let bs = self.knobs.cfg.block_size;
        let saved = self.s.take_cached_blocks();
        let mut unique = saved.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), saved.len(), "a block listed twice for saving");
        let mut i = 0;
        while i < loads.len() {
            if !self.rng.chance(40) {
                i += 1;
                continue;
            }
            let load = loads.swap_remove(i);
            let n = load.block_ids.len();
            let ok = if self.rng.chance(70) {
                n
            } else {
                self.rng.below(n as u64 + 1) as usize
            };
            let live = self
                .s
                .finish_kv_load(load.handle, load.load_id, ok)
                .unwrap();
            if live {
                let r = self.s.request(load.handle).unwrap();
                assert!(
                    r.num_loaded_tokens >= (load.first_block + ok) * bs,
                    "a finished load counts its loaded blocks"
                );
            }
        }
        self.engine_loads = Some(loads);
    }

    fn step(&mut self) -> bool {
        self.engine_connector_events();
        if !self.s.has_requests() {
            self.s.check_invariants().unwrap();
            return true;
        }
        let out = self.s.schedule();
        let stats = self.s.stats();
        assert_eq!(
            stats.gates.scan_stops_total.iter().sum::<u64>(),
            stats.num_steps,
            "exactly one scan stop per schedule()"
        );
        // S5's gate is recorded exactly when the running phase preempted; opt-in
        // priority preemption also preempts from the waiting phase, under another gate.
        let s5_stop = stats.gates.last_scan_stop == Some(ScanStop::Preempted);
        if self.s.config().priority_preemption {
            assert!(!s5_stop || !out.preempted.is_empty());
        } else {
            assert_eq!(s5_stop, !out.preempted.is_empty());
        }
        let cfg = self.s.config().clone();
        let total: u32 = out.num_scheduled_tokens.iter().sum();
        assert_eq!(total as usize, out.total_num_scheduled_tokens);
        assert!(out.total_num_scheduled_tokens <= cfg.max_num_scheduled_tokens());
        assert!(out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens);
        assert!(out.len() <= cfg.max_num_seqs);
        assert!(self.s.num_running() <= cfg.max_num_seqs);
        assert!(
            out.num_scheduled_tokens.iter().all(|&n| n > 0),
            "a zero count was scheduled"
        );
        let mut seen: Vec<Handle> = out.req_handles.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), out.len(), "a request scheduled twice");
        let k = cfg.num_speculative_tokens;
        let num_spec: u32 = out.num_spec_tokens.iter().sum();
        assert_eq!(out.spec_token_ids.len(), num_spec as usize);
        assert_eq!(out.skipped.len(), out.skip_reasons.len());
        assert!(
            out.skipped.iter().all(|h| !out.req_handles.contains(h)),
            "a skipped request was scheduled"
        );
        if cfg.max_loras > 0 {
            let mut loras: Vec<u32> = self
                .s
                .running()
                .iter()
                .filter_map(|&h| self.s.request(h).unwrap().lora_id)
                .collect();
            loras.sort_unstable();
            loras.dedup();
            assert!(
                loras.len() <= cfg.max_loras,
                "adapters {loras:?} in one batch"
            );
        }
        let mut sampled = vec![0u32];
        let mut sampled_ids = Vec::new();
        let mut drafts = vec![0u32];
        let mut draft_ids = Vec::new();
        for (i, &h) in out.req_handles.iter().enumerate() {
            let r = self.s.request(h).unwrap();
            let p = self.s.progress(h).unwrap();
            let spec = out.spec_token_ids_of(i);
            assert!(spec.len() < out.num_scheduled_tokens[i] as usize);
            if out.kinds[i] == 0 {
                assert!(spec.iter().all(|&t| t >= 0), "padding on a running row");
            } else if !spec.is_empty() {
                // S2: an admission padded to a uniform decode.
                assert_eq!((spec.len(), out.num_scheduled_tokens[i]), (k, k as u32 + 1));
                assert!(spec.iter().all(|&t| t == -1));
            }
            assert!(p.num_computed_tokens <= r.num_tokens() + spec.len());
            assert!(
                p.num_computed_tokens < cfg.max_model_len,
                "{} computed {} of {} tokens ({})",
                r.request_id,
                p.num_computed_tokens,
                r.num_tokens(),
                r.status.as_str()
            );
            assert!(!out.block_ids_of(i).is_empty() || out.kinds[i] == 0);
            if !p.is_prefill_chunk {
                // Some drafts accepted (never padding), then the model's own token.
                let real = spec.iter().take_while(|&&t| t >= 0).count() as u64;
                let accepted = self.rng.below(real + 1);
                for _ in 0..=accepted {
                    let t = match self.rng.below(100) {
                        0..=2 => 2, // EOS
                        3..=4 => 3, // a stop token for some
                        _ => 10 + self.rng.below(900) as u32,
                    };
                    sampled_ids.push(t);
                }
            }
            sampled.push(sampled_ids.len() as u32);
            if k > 0 {
                for _ in 0..self.rng.below(k as u64 + 1) {
                    draft_ids.push(10 + self.rng.below(900) as u32);
                }
            }
            drafts.push(draft_ids.len() as u32);
        }
        let mut mro = ModelRunnerOutput {
            sampled_offsets: sampled,
            sampled_token_ids: sampled_ids,
            ..Default::default()
        };
        // Drafts with the output, or after it (vLLM's post-step call).
        let after = k > 0 && self.rng.chance(50);
        if k > 0 && !after {
            mro.draft_offsets = drafts.clone();
            mro.draft_token_ids = draft_ids.clone();
        }
        self.s.update_from_output(&mro).unwrap();
        if after {
            self.s
                .update_draft_token_ids(&out.req_handles, &drafts, &draft_ids)
                .unwrap();
        }
        self.s.check_invariants().unwrap();
        false
    }

    fn run(&mut self) {
        for _ in 0..STEPS_PER_CASE {
            for _ in 0..self.rng.below(3) {
                self.add_random();
            }
            if !self.ids.is_empty() && self.rng.chance(8) {
                let i = self.rng.below(self.ids.len() as u64) as usize;
                let id = self.ids[i].clone();
                self.s.abort_request(&id);
            }
            if self.knobs.pauses && self.rng.chance(5) {
                let state = [
                    PauseState::Unpaused,
                    PauseState::PausedNew,
                    PauseState::PausedAll,
                ][self.rng.below(3) as usize];
                self.s.set_pause_state(state);
            }
            self.stream_events();
            self.step();
        }
        self.drain();
    }

    /// No arrivals, sessions closed, unpaused: everything must finish and
    /// every block must come back (cached blocks count as free).
    fn drain(&mut self) {
        self.s.set_pause_state(PauseState::Unpaused);
        self.sessions.clear();
        for id in &self.ids {
            let _ = self.s.close_stream(id); // only open sessions accept this
        }
        let mut steps = 0;
        while !self.step() {
            steps += 1;
            assert!(
                steps < 20_000,
                "requests still live after {steps} drain steps: {:?}",
                self.s.stats()
            );
        }
        assert_eq!(self.s.live_requests().count(), 0);
        assert_eq!(
            self.s.num_free_blocks(),
            self.knobs.cfg.num_gpu_blocks - 1,
            "blocks leaked"
        );
        assert_eq!(self.s.num_waiting_for_streaming_input(), 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    #[test]
    fn s16_invariants_hold_on_random_traces(knobs in knobs()) {
        Driver::new(knobs).run();
    }
}
