//! kiln-jobs: offline jobs, fed to the workers only from spare capacity.
//!
//! - [`queue`]: the backend abstraction ([`JobQueue`]) and its semantics
//!   (durable acceptance, at-least-once execution, exactly-once visible result);
//! - [`embedded`]: the default backend, a redb database in a local folder;
//! - [`redis_streams`]: Redis Streams, one queue shared by several servers;
//! - [`backend`]: `--jobs URL`, which backend;
//! - [`budget`]: the dispatch budget `D = 1 − (F_sys + F_q + B)` and the
//!   [`DispatchTarget`] it reads;
//! - [`local`]: the local server as a target (its own gauges, in process);
//! - [`remote`]: a KServe v2 server over HTTP as a target (its `/metrics`,
//!   read with [`prom_text`]);
//! - [`dispatcher`]: the thread that claims jobs within the budget, runs them on
//!   the target and stores their results;
//! - [`metrics`]: `kiln_dispatch_*` and `kiln_jobs`;
//! - [`split`], [`spool`]: a submission read as it arrives, held until stored.
//!
//! See `docs/jobs.md`.

pub mod backend;
pub mod budget;
pub mod dispatcher;
pub mod embedded;
pub mod local;
pub mod metrics;
pub mod prom_text;
pub mod queue;
pub mod redis_streams;
pub mod remote;
pub mod split;
pub mod spool;

pub use backend::BackendUrl;
pub use budget::{BudgetConfig, DispatchBudget, DispatchTarget, Dispatched, Reading};
pub use dispatcher::{Dispatcher, DispatcherConfig};
pub use metrics::DispatchMetrics;
pub use queue::{
    CancelResult, ClaimedJob, Job, JobId, JobQueue, JobState, JobsError, ListFilter, NewJob,
    Outcome, Page, StateCounts,
};
