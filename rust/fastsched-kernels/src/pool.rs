//! A small persistent thread pool for splitting one kernel call into tasks.
//!
//! A decode step makes ~200 kernel calls of tens of microseconds each, so spawning threads
//! per call (tens of µs each) is out. Workers spin briefly on a generation counter after
//! each job and then sleep on a condvar, so they neither burn a core between steps nor
//! fight torch's own OpenMP threads for long; the calling thread always takes tasks too,
//! so a pool of `threads − 1` workers uses `threads` cores and a one-thread pool has none.
//!
//! A task that panics does not take its thread down with it (which left the caller waiting
//! for a task that would never be done): the panic is caught, the job's other tasks finish,
//! and the panic is resumed on the caller once none of them runs any more, so that it
//! reaches the caller as any panic of its own would (PyO3 turns it into a Python
//! `PanicException` at the binding).

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// `generation << 32 | next task index`: a task is claimed by a compare-exchange, so a
    /// worker that wakes late can never claim a task of a newer job as one of an older one.
    state: AtomicU64,
    tasks: AtomicUsize,
    done: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    /// The first panic of the running job's tasks, resumed on the caller by `Pool::run`.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleep: Mutex<u32>,
    wake: Condvar,
    stop: AtomicUsize,
}

// SAFETY: `job` is written only by the caller of `Pool::run` before it publishes a new
// generation (Release) and read by workers after they observe it (Acquire); `run` does not
// return before every task of the job is done, so the pointee outlives every use.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// Iterations a worker spins on the generation counter before it goes to sleep.
const SPIN: u32 = 20_000;

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    busy: Mutex<()>,
}

impl Pool {
    /// A pool using `threads` cores: `threads − 1` workers plus the caller.
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            tasks: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panic: Mutex::new(None),
            sleep: Mutex::new(0),
            wake: Condvar::new(),
            stop: AtomicUsize::new(0),
        });
        let workers = (1..threads.max(1))
            .map(|_| {
                let s = Arc::clone(&shared);
                std::thread::spawn(move || worker(&s))
            })
            .collect();
        Pool {
            shared,
            workers,
            busy: Mutex::new(()),
        }
    }

    /// Cores a call uses (the caller included).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0..tasks)` across the pool and returns when all are done. A call made while
    /// another thread's call is running runs its tasks on the calling thread alone. A task
    /// that panics: the others still run, then the first panic is resumed here, with every
    /// worker back to waiting (the pool serves the next call as before).
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        let guard = match self.busy.try_lock() {
            Ok(g) if !self.workers.is_empty() && tasks > 1 => g,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let s = &*self.shared;
        // SAFETY: the lifetime is erased only for the duration of this call (see `Shared`).
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        unsafe { *s.job.get() = Some(job) };
        s.tasks.store(tasks, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        let generation = (s.state.load(Ordering::Relaxed) >> 32) + 1;
        s.state.store(generation << 32, Ordering::Release);
        if *s.sleep.lock().unwrap() > 0 {
            s.wake.notify_all();
        }
        take_tasks(s, generation);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < tasks {
            spins += 1;
            if spins < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(guard);
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }
}

/// Claims and runs tasks of `generation` until none is left (or a newer job started).
fn take_tasks(s: &Shared, generation: u64) {
    loop {
        let state = s.state.load(Ordering::Acquire);
        let tasks = s.tasks.load(Ordering::Relaxed) as u64;
        let index = state & 0xffff_ffff;
        if state >> 32 != generation || index >= tasks {
            return;
        }
        if s.state
            .compare_exchange_weak(state, state + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        // SAFETY: a claimed task of the current generation keeps its job alive (see `Shared`).
        let job = unsafe { (*s.job.get()).unwrap() };
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index as usize) })) {
            s.panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(payload);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let generation = loop {
            if s.stop.load(Ordering::Relaxed) != 0 {
                return;
            }
            let g = s.state.load(Ordering::Acquire) >> 32;
            if g != seen {
                break g;
            }
            spins += 1;
            if spins < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut sleepers = s.sleep.lock().unwrap();
            *sleepers += 1;
            while s.state.load(Ordering::Acquire) >> 32 == seen
                && s.stop.load(Ordering::Relaxed) == 0
            {
                sleepers = s.wake.wait(sleepers).unwrap();
            }
            *sleepers -= 1;
            spins = 0;
        };
        seen = generation;
        take_tasks(s, generation);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(1, Ordering::Relaxed);
        {
            let _g = self.shared.sleep.lock().unwrap();
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_per_call() {
        for threads in [1, 2, 4] {
            let pool = Pool::new(threads);
            for tasks in [0, 1, 3, 17, 64] {
                let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..50 {
                    pool.run(tasks, &|i| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(
                    counts.iter().all(|c| c.load(Ordering::Relaxed) == 50),
                    "threads {threads} tasks {tasks}"
                );
            }
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_others_and_the_pool_serves_on() {
        for threads in [1, 2, 4] {
            let pool = Pool::new(threads);
            for round in 0..20 {
                let ran = AtomicUsize::new(0);
                let caught = catch_unwind(AssertUnwindSafe(|| {
                    pool.run(16, &|i| {
                        if i % 5 == round % 5 {
                            panic!("task {i} failed");
                        }
                        ran.fetch_add(1, Ordering::Relaxed);
                    })
                }));
                let message = caught.expect_err("the panic reaches the caller, no hang");
                let text = message
                    .downcast_ref::<String>()
                    .expect("panic!'s formatted message");
                assert!(
                    text.starts_with("task ") && text.ends_with(" failed"),
                    "{text}"
                );
                if threads > 1 {
                    // Every task that does not panic ran before `run` returned.
                    assert!(
                        ran.load(Ordering::Relaxed) >= 12,
                        "threads {threads} round {round}"
                    );
                }
                let counts: Vec<AtomicUsize> = (0..16).map(|_| AtomicUsize::new(0)).collect();
                pool.run(16, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "threads {threads}"
                );
            }
        }
    }
}
