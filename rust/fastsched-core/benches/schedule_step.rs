//! Cost of one scheduling step in pure Rust: the workload of
//! `bench/scheduler_bench.py` without the Python binding, so the two
//! figures together say how much the boundary costs.
//!
//! `--running` requests in flight plus 256 queued; prompts of uniform length
//! in [256, 768] with random token ids, outputs of uniform length in
//! [64, 192] (as `max_tokens`, no EOS); a finished request is replaced at
//! once. Each step times `schedule()` and `update_from_tokens()` (one
//! optional token per scheduled request, as the binding's
//! `update_from_tokens` passes them); everything else (which requests
//! sample, adding requests) is not timed. A plain `Instant` loop, no harness: run with
//! `cargo bench -p fastsched-core` (256, 1024 and 4096 running) or
//! `cargo bench -p fastsched-core -- 1024` for chosen sizes;
//! `FASTSCHED_BENCH_STEPS` overrides the number of measured steps (default
//! 1000, after 200 warm-up steps).

use std::time::Instant;

use fastsched_core::{NewRequest, Scheduler, SchedulerConfig};

const VOCAB_SIZE: u64 = 32_000;

/// xorshift64*: enough randomness for a trace, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi` (modulo bias is irrelevant here).
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
}

struct Workload {
    running: usize,
    waiting: usize,
    prompt_len: usize,
    output_len: usize,
    block_size: usize,
    max_num_batched_tokens: usize,
    warmup: usize,
    steps: usize,
}

struct Trace {
    sched: Scheduler,
    rng: Rng,
    /// Each handle's current token count (prompt + outputs), by handle.
    num_tokens: Vec<usize>,
    next_id: u64,
    prompt: (usize, usize),
    output: (usize, usize),
}

impl Trace {
    fn add(&mut self, count: usize) {
        for _ in 0..count {
            let plen = self.rng.range(self.prompt.0, self.prompt.1);
            let olen = self.rng.range(self.output.0, self.output.1);
            let prompt = (0..plen)
                .map(|_| (self.rng.next_u64() % VOCAB_SIZE) as u32)
                .collect();
            let id = format!("r{}", self.next_id);
            self.next_id += 1;
            let h = self
                .sched
                .add_request(NewRequest::new(id, prompt, olen))
                .expect("valid request") as usize;
            if h >= self.num_tokens.len() {
                self.num_tokens.resize(h + 1, 0);
            }
            self.num_tokens[h] = plen;
        }
    }
}

struct Summary {
    step_us: Vec<f64>,
    schedule_us: Vec<f64>,
    update_us: Vec<f64>,
    mean_reqs: f64,
    mean_tokens: f64,
    preemptions: u64,
}

fn run(w: &Workload) -> Summary {
    let prompt = ((w.prompt_len / 2).max(1), (3 * w.prompt_len / 2).max(1));
    let output = ((w.output_len / 2).max(1), (3 * w.output_len / 2).max(1));
    let longest = prompt.1 + output.1;
    let cfg = SchedulerConfig {
        max_num_seqs: w.running,
        max_num_batched_tokens: w.max_num_batched_tokens,
        max_model_len: longest + 1,
        block_size: w.block_size,
        num_gpu_blocks: (w.running + w.waiting) * longest.div_ceil(w.block_size) + 1,
        ..Default::default()
    };
    let mut trace = Trace {
        sched: Scheduler::new(cfg).expect("valid config"),
        rng: Rng::new(0),
        num_tokens: Vec::new(),
        next_id: 0,
        prompt,
        output,
    };
    trace.add(w.running + w.waiting);

    let mut s = Summary {
        step_us: Vec::with_capacity(w.steps),
        schedule_us: Vec::with_capacity(w.steps),
        update_us: Vec::with_capacity(w.steps),
        mean_reqs: 0.0,
        mean_tokens: 0.0,
        preemptions: 0,
    };
    let mut tokens: Vec<Option<u32>> = Vec::new();
    for step in 0..w.warmup + w.steps {
        if step == w.warmup {
            s.preemptions = trace.sched.stats().num_preemptions_total;
        }
        let t0 = Instant::now();
        let out = trace.sched.schedule();
        let t1 = Instant::now();
        tokens.clear();
        for i in 0..out.req_handles.len() {
            let h = out.req_handles[i] as usize;
            let computed = (out.num_computed_tokens[i] + out.num_scheduled_tokens[i]) as usize;
            let done = computed >= trace.num_tokens[h];
            tokens.push(done.then(|| (trace.rng.next_u64() % VOCAB_SIZE) as u32));
        }
        let t2 = Instant::now();
        let eo = trace
            .sched
            .update_from_tokens(&tokens)
            .expect("aligned output");
        let t3 = Instant::now();
        let mut finished = 0;
        for (i, &h) in eo.handles.iter().enumerate() {
            trace.num_tokens[h as usize] +=
                (eo.token_offsets[i + 1] - eo.token_offsets[i]) as usize;
            finished += usize::from(eo.finish_reasons[i] != 0);
        }
        trace.add(finished);
        if step >= w.warmup {
            let sched = (t1 - t0).as_secs_f64() * 1e6;
            let update = (t3 - t2).as_secs_f64() * 1e6;
            s.schedule_us.push(sched);
            s.update_us.push(update);
            s.step_us.push(sched + update);
            s.mean_reqs += out.req_handles.len() as f64;
            s.mean_tokens += out.total_num_scheduled_tokens as f64;
        }
    }
    s.mean_reqs /= w.steps as f64;
    s.mean_tokens /= w.steps as f64;
    s.preemptions = trace.sched.stats().num_preemptions_total - s.preemptions;
    s
}

/// Nearest-rank percentile of an unsorted sample.
fn percentile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn main() {
    let steps = std::env::var("FASTSCHED_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    println!(
        "schedule_step: pure-Rust schedule() + update_from_tokens(), {steps} steps after 200 warm-up, \
         waiting 256, prompt 256-768, output 64-192, 8192-token budget, ample KV blocks"
    );
    println!(
        "{:>8} {:>8} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10} {:>12} {:>12}",
        "running",
        "waiting",
        "median_us",
        "p90_us",
        "p99_us",
        "sched_p50",
        "update_p50",
        "steps/s",
        "mean_reqs",
        "mean_tokens"
    );
    // cargo passes `--bench`; numeric arguments pick the running sizes.
    let mut sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if sizes.is_empty() {
        sizes = vec![256, 1024, 4096];
    }
    for running in sizes {
        let w = Workload {
            running,
            waiting: 256,
            prompt_len: 512,
            output_len: 128,
            block_size: 16,
            max_num_batched_tokens: running.max(8192),
            warmup: 200,
            steps,
        };
        let s = run(&w);
        let total_s: f64 = s.step_us.iter().sum::<f64>() / 1e6;
        println!(
            "{:>8} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>12.1} {:>12.1} {:>10.0} {:>12.1} {:>12.1}{}",
            w.running,
            w.waiting,
            percentile(&s.step_us, 50.0),
            percentile(&s.step_us, 90.0),
            percentile(&s.step_us, 99.0),
            percentile(&s.schedule_us, 50.0),
            percentile(&s.update_us, 50.0),
            w.steps as f64 / total_s,
            s.mean_reqs,
            s.mean_tokens,
            if s.preemptions > 0 {
                format!("  ({} preemptions)", s.preemptions)
            } else {
                String::new()
            },
        );
    }
}
