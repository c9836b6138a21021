//! The queue-backend abstraction: what every job store (the embedded one,
//! [`crate::embedded`], and Redis Streams) gives the HTTP API and the dispatcher.
//!
//! # Semantics every backend keeps
//!
//! - **Durable acceptance.** [`JobQueue::enqueue`] returns only once the jobs are
//!   stored durably (the embedded store: committed and fsync'd; Redis: written
//!   with the server's own persistence). All or none: an error from the input,
//!   or from the store, leaves none of the batch behind.
//! - **At-least-once execution.** A job is *claimed* ([`JobQueue::claim`]:
//!   `queued → running`, owned by one consumer). A consumer that dies leaves its
//!   claimed jobs `running`; [`JobQueue::reclaim`] puts them back in the queue
//!   (the embedded store: every running job when the store is opened again;
//!   Redis: pending entries idle past a timeout, `XAUTOCLAIM`). So a job may run
//!   more than once.
//! - **Exactly-once visible result.** [`JobQueue::complete`] writes a job's result
//!   idempotently, by job id: the first result stored wins, a later one for the
//!   same id (a second execution) is dropped, and only then is the job
//!   acknowledged (taken off the queue's pending list). What [`JobQueue::get`] and
//!   [`JobQueue::list`] show is one state and, when finished, one result per job.
//! - **Cancellation** is for queued jobs only: a running one is left to finish.
//! - **Expiry.** Finished jobs (done, failed, cancelled) are removed by
//!   [`JobQueue::expire`] once they finished before a given time.
//!
//! Every method may block (disk, network): call them from a thread that may
//! block (the dispatcher's own thread, `tokio::task::spawn_blocking`), never on an
//! async I/O thread. Implementations are `Send + Sync`, shared as
//! `Arc<dyn JobQueue>`.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A job's id: opaque text the backend chooses (unique within its store).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub String);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Done,
    Failed,
    Cancelled,
}

impl JobState {
    /// Every state, in the order of a job's life.
    pub const ALL: [JobState; 5] = [
        JobState::Queued,
        JobState::Running,
        JobState::Done,
        JobState::Failed,
        JobState::Cancelled,
    ];

    /// The name the API and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Parses [`JobState::as_str`]'s names.
    pub fn parse(name: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// Done, failed or cancelled: nothing more happens to it but expiry.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }
}

/// The lowest and highest job priority: 1 runs first, as Triton's priority
/// levels; every job, whatever its priority, runs below every realtime request.
pub const PRIORITY_HIGHEST: u8 = 1;
/// The lowest job priority.
pub const PRIORITY_LOWEST: u8 = 9;
/// The priority of a job submitted without one.
pub const PRIORITY_DEFAULT: u8 = 5;

/// A job to store: the model it is for, its KServe v2 request (JSON, as
/// submitted, validated against the model) and its priority among jobs.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    pub model: String,
    pub priority: u8,
    /// The KServe v2 inference request, JSON.
    pub request: Vec<u8>,
}

/// A job a consumer claimed: what it needs to run it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedJob {
    pub id: JobId,
    pub model: String,
    pub priority: u8,
    pub request: Vec<u8>,
}

/// How a job's run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The KServe v2 response, JSON.
    Done(Vec<u8>),
    /// Why it failed (the server's error message).
    Failed(String),
}

/// A job as the API shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub id: JobId,
    pub model: String,
    pub state: JobState,
    pub priority: u8,
    /// When it was accepted, ms since the Unix epoch.
    pub submitted_ms: u64,
    /// When it finished (done, failed, cancelled), ms since the Unix epoch.
    pub finished_ms: Option<u64>,
    /// How many times it was claimed to run (a release, which puts a job back
    /// unrun, takes its claim back; a reclaim after a crash does not).
    pub attempts: u32,
    /// Done: the KServe v2 response, JSON (only from [`JobQueue::get`]; a listing
    /// leaves it out).
    pub response: Option<Vec<u8>>,
    /// Failed: why.
    pub error: Option<String>,
}

/// Which jobs a listing shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListFilter {
    pub model: Option<String>,
    pub state: Option<JobState>,
}

/// One page of a listing, in submission order.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub jobs: Vec<Job>,
    /// Pass as `after` for the next page; `None`: this was the last.
    pub next: Option<String>,
}

/// What [`JobQueue::cancel`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelResult {
    /// It was queued and is now cancelled.
    Cancelled,
    /// It was not queued (running or finished): left as it is, in this state.
    NotQueued(JobState),
    /// No such job.
    NotFound,
}

/// Jobs in each state (the `kiln_jobs` gauge).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCounts {
    pub queued: u64,
    pub running: u64,
    pub done: u64,
    pub failed: u64,
    pub cancelled: u64,
}

impl StateCounts {
    /// The count of `state`.
    pub fn get(&self, state: JobState) -> u64 {
        match state {
            JobState::Queued => self.queued,
            JobState::Running => self.running,
            JobState::Done => self.done,
            JobState::Failed => self.failed,
            JobState::Cancelled => self.cancelled,
        }
    }
}

/// A store's errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobsError {
    /// What the caller gave is wrong (a bad job in a submission, a bad cursor):
    /// HTTP 400. Nothing was stored.
    #[error("{0}")]
    Invalid(String),
    /// The store cannot be reached or failed (disk, network): HTTP 503.
    #[error("job store: {0}")]
    Store(String),
    /// The store holds its quota (`--jobs-max-stored`): HTTP 429 at once.
    #[error("{0}")]
    Full(String),
    /// The backend the URL names is not built into this binary, or the URL is
    /// not understood.
    #[error("{0}")]
    Config(String),
}

/// The store's result type.
pub type Result<T, E = JobsError> = std::result::Result<T, E>;

/// A queue of jobs and the store of their results. See the module's doc for the
/// guarantees every implementation keeps.
pub trait JobQueue: Send + Sync {
    /// Stores every job of `jobs`, in order, durably, and returns their ids in the
    /// same order. `jobs` is pulled as the submission is read (it may block); an
    /// `Err` from it (a bad request) aborts: nothing of the batch is stored and
    /// that error is returned.
    fn enqueue(&self, jobs: &mut dyn Iterator<Item = Result<NewJob>>) -> Result<Vec<JobId>>;

    /// Claims up to `max` queued jobs for `consumer`, highest priority first and,
    /// within one priority, in submission order: each becomes `running`, owned by
    /// `consumer`, with its attempts counted. With `max` 0, or nothing queued,
    /// it writes nothing (the dispatcher polls an empty queue with it).
    fn claim(&self, consumer: &str, max: usize) -> Result<Vec<ClaimedJob>>;

    /// Puts claimed jobs back in the queue without a result (the target was
    /// overloaded or unreachable: they were not run). A job no longer running is
    /// left as it is.
    fn release(&self, ids: &[JobId]) -> Result<()>;

    /// Stores each job's result, idempotently by id: a job already finished keeps
    /// its first result (and a cancelled one stays cancelled); then acknowledges
    /// the job. Unknown ids (expired) are skipped. On an error the caller keeps
    /// the results and calls again.
    fn complete(&self, results: &[(JobId, Outcome)]) -> Result<()>;

    /// One round of the dispatcher: [`JobQueue::complete`] `results`,
    /// [`JobQueue::release`] `released`, then [`JobQueue::claim`] up to `max`.
    /// A backend that can do all three at once (the embedded store: one
    /// transaction, one fsync) overrides it; the effect must be the same. On an
    /// error the caller keeps `results` and `released` and calls again.
    fn settle_and_claim(
        &self,
        results: &[(JobId, Outcome)],
        released: &[JobId],
        consumer: &str,
        max: usize,
    ) -> Result<Vec<ClaimedJob>> {
        if !results.is_empty() {
            self.complete(results)?;
        }
        if !released.is_empty() {
            self.release(released)?;
        }
        self.claim(consumer, max)
    }

    /// Cancels a queued job.
    fn cancel(&self, id: &JobId) -> Result<CancelResult>;

    /// The job, with its response when done: `admit` is told the response's
    /// length before it is read (the HTTP route reserves it from the
    /// client-bytes budget there); its error ends the call, nothing read.
    fn get_admitted(
        &self,
        id: &JobId,
        admit: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Option<Job>>;

    /// The job, with its response when done, whatever its size.
    fn get(&self, id: &JobId) -> Result<Option<Job>> {
        self.get_admitted(id, &mut |_| Ok(()))
    }

    /// Up to `limit` jobs matching `filter`, in submission order, after the
    /// cursor `after` (a previous page's `next`; `None`: from the first).
    fn list(&self, filter: &ListFilter, after: Option<&str>, limit: usize) -> Result<Page>;

    /// Removes finished jobs (done, failed, cancelled) that finished before
    /// `before`; returns how many.
    fn expire(&self, before: SystemTime) -> Result<u64>;

    /// Puts back in the queue the jobs claimed by consumers other than `consumer`
    /// that have been running for at least `idle` (their consumer is taken for
    /// dead); returns how many. The next [`JobQueue::claim`] of any consumer may
    /// take them. The embedded store, which one process owns, also does this for
    /// every running job when it is opened.
    fn reclaim(&self, consumer: &str, idle: Duration) -> Result<u64>;

    /// Jobs in each state.
    fn counts(&self) -> Result<StateCounts>;
}

/// A job's secret: 128 random bits from the operating system, as 32 hex digits.
/// A job's public id is `SEQ-SECRET` ([`public_id`]): knowing it is the right to
/// read or cancel the job, and it cannot be guessed from another job's id.
pub fn new_secret() -> Result<String> {
    let mut bits = [0u8; 16];
    getrandom::fill(&mut bits)
        .map_err(|e| JobsError::Store(format!("no random bits for a job id: {e}")))?;
    Ok(bits.iter().map(|b| format!("{b:02x}")).collect())
}

/// The id a client sees: the store's sequence number and the job's secret
/// (`None`: a job stored before ids had secrets, shown as its number).
pub fn public_id(seq: &str, secret: Option<&str>) -> JobId {
    match secret {
        Some(secret) => JobId(format!("{seq}-{secret}")),
        None => JobId(seq.to_owned()),
    }
}

/// Splits an id into its sequence number and secret (`SEQ` alone: the
/// dispatcher's own ids, or a job without a secret).
pub fn split_id(id: &JobId) -> Option<(u64, Option<&str>)> {
    let (seq, secret) = match id.0.split_once('-') {
        Some((seq, secret)) => (seq, Some(secret)),
        None => (id.0.as_str(), None),
    };
    if seq.is_empty() || seq.len() > 20 || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((seq.parse().ok()?, secret))
}

/// Whether a client's id names a job whose secret is `stored`: the secret must
/// match (compared in constant time); a job without one takes its number alone.
pub fn secret_matches(given: Option<&str>, stored: Option<&str>) -> bool {
    match (given, stored) {
        (_, None) => given.is_none(),
        (None, Some(_)) => false,
        (Some(a), Some(b)) => {
            a.len() == b.len()
                && a.bytes()
                    .zip(b.bytes())
                    .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                    == 0
        }
    }
}

/// Milliseconds since the Unix epoch of `t` (0 before it).
pub fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
