//! fastsched-core: the per-step scheduler of an LLM inference server, in the
//! style of vLLM V1, as a pure Rust library (no Python).
//!
//! - [`config`]: scheduler settings and validation (docs/design.md §3)
//! - [`request`]: request state and stop conditions (§4, S17)
//! - [`queue`]: FCFS and priority waiting queues (S14)
//! - [`kv`]: block pool, prefix cache, per-request KV manager (S8, S10)
//! - [`scheduler`]: `schedule()` and `update_from_output()` (S1–S18)
//! - [`output`]: the compact per-step arrays exchanged with the runner
//! - [`connector`]: pluggable KV sources (remote loads, S7)
//! - [`telemetry`]: why each step's waiting scan stopped, why requests were skipped
//! - [`admission`]: in-flight counters shared by frontend processes (A6)

pub mod admission;
pub mod config;
pub mod connector;
pub mod error;
pub mod kv;
pub mod output;
pub mod queue;
pub mod request;
pub mod scheduler;
pub mod telemetry;

pub use admission::SharedAdmissionStats;
pub use config::{HashAlgo, Policy, SchedulerConfig};
pub use error::{Error, Result};
pub use output::{EngineCoreOutputs, ModelRunnerOutput, ScheduledKind, SchedulerOutput};
pub use request::{
    FinishReason, Handle, NewRequest, Progress, Request, RequestStatus, StreamInput,
};
pub use scheduler::{PauseState, Scheduler, SchedulerStats};
pub use telemetry::{GateCounters, ScanStop, SkipReason};
