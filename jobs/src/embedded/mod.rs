//! The embedded store (`--jobs file:PATH`, the default): one redb database,
//! `PATH/jobs.redb`.
//!
//! Why redb: it is pure Rust (no C build beside the workspace), and each write
//! transaction commits with `Durability::Immediate`: the data pages and then the
//! new root are written and `fsync`'d (`File::sync_data`) before `commit`
//! returns, with checksummed roots, so a crash at any moment (kill -9, power)
//! leaves the last committed transaction, whole. Every operation below is one
//! transaction, so a job is never half moved between states. See
//! `docs/jobs.md`.
//!
//! Tables: `jobs` (id → the record, JSON), `requests` (id → the request, until the
//! job ends), `results` (id → the response), `queue` ((priority, id) → ()),
//! `running` (id → ()), `finished` ((finished ms, id) → (), for expiry), `meta`
//! (the next id and the count of each state).
//!
//! One process owns the store (redb locks the file): at open, every job left
//! `running` by a process that died goes back to the queue (at-least-once).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::RwLock;

use redb::{Database, ReadableTable, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};

mod txn;

use crate::queue::{
    epoch_ms, new_secret, public_id, secret_matches, split_id, CancelResult, ClaimedJob, Job,
    JobId, JobQueue, JobState, JobsError, ListFilter, NewJob, Outcome, Page, Result, StateCounts,
};

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
const REQUESTS: TableDefinition<u64, &[u8]> = TableDefinition::new("requests");
const RESULTS: TableDefinition<u64, &[u8]> = TableDefinition::new("results");
const QUEUE: TableDefinition<(u8, u64), ()> = TableDefinition::new("queue");
const RUNNING: TableDefinition<u64, ()> = TableDefinition::new("running");
const FINISHED: TableDefinition<(u64, u64), ()> = TableDefinition::new("finished");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

const NEXT_ID: &str = "next_id";
/// A listing reads at most this many records per page (a filter matching few
/// jobs returns a short page with a cursor, rather than scanning the store):
/// one page's work is bounded like the page itself.
pub const MAX_SCAN: usize = 5_000;

/// A job's record in `jobs`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    model: String,
    state: JobState,
    priority: u8,
    submitted_ms: u64,
    #[serde(default)]
    finished_ms: Option<u64>,
    #[serde(default)]
    attempts: u32,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    consumer: Option<String>,
    #[serde(default)]
    claimed_ms: Option<u64>,
    /// 128 random bits, hex: the public id is `ID-SECRET` (none: a job stored
    /// before ids had secrets).
    #[serde(default)]
    secret: Option<String>,
    /// Done: the length of its response in `results`, so that a read reserves
    /// it before loading it (none: stored before it was kept; then the length
    /// is known once loaded).
    #[serde(default)]
    response_len: Option<u64>,
}

impl Record {
    fn job(&self, id: u64, response: Option<Vec<u8>>) -> Job {
        Job {
            id: public_id(&id.to_string(), self.secret.as_deref()),
            model: self.model.clone(),
            state: self.state,
            priority: self.priority,
            submitted_ms: self.submitted_ms,
            finished_ms: self.finished_ms,
            attempts: self.attempts,
            response,
            error: self.error.clone(),
        }
    }
}

/// The embedded job store.
pub struct EmbeddedQueue {
    path: PathBuf,
    /// The database; opened again after an I/O error (see
    /// [`EmbeddedQueue::db`]); `None` while a reopen failed.
    db: RwLock<Option<Arc<Database>>>,
    /// [`IO_FAULTS`] when this store last checked its database.
    seen: AtomicU64,
}

/// I/O errors any embedded store has met: a store whose count is behind checks
/// whether its database needs opening again ([`EmbeddedQueue::db`]).
static IO_FAULTS: AtomicU64 = AtomicU64::new(0);

fn store<E: std::fmt::Display>(e: E) -> JobsError {
    let text = e.to_string();
    // redb's `StorageError::Io` and `PreviousIo` (both say "I/O error").
    if text.contains("I/O error") {
        IO_FAULTS.fetch_add(1, Ordering::AcqRel);
    }
    JobsError::Store(text)
}

fn encode(record: &Record) -> Result<Vec<u8>> {
    serde_json::to_vec(record).map_err(store)
}

fn decode(bytes: &[u8]) -> Result<Record> {
    serde_json::from_slice(bytes)
        .map_err(|e| JobsError::Store(format!("a damaged job record: {e}")))
}

fn count_key(state: JobState) -> &'static str {
    state.as_str()
}

/// The numeric id of a job id (`None`: not one of this store's). The
/// dispatcher's ids are the number alone; a client's carry the secret too,
/// checked by [`owned`].
fn parse_id(id: &JobId) -> Option<u64> {
    split_id(id).map(|(seq, _)| seq)
}

/// Whether the client's `id` carries `record`'s secret.
fn owned(id: &JobId, record: &Record) -> bool {
    split_id(id).is_some_and(|(_, given)| secret_matches(given, record.secret.as_deref()))
}

/// Moves the count of `from` to `to` (either `None`: a job arriving or leaving).
fn recount(
    txn: &WriteTransaction,
    from: Option<JobState>,
    to: Option<JobState>,
    n: u64,
) -> Result<()> {
    let mut meta = txn.open_table(META).map_err(store)?;
    if let Some(from) = from {
        let c = meta
            .get(count_key(from))
            .map_err(store)?
            .map_or(0, |v| v.value());
        meta.insert(count_key(from), c.saturating_sub(n))
            .map_err(store)?;
    }
    if let Some(to) = to {
        let c = meta
            .get(count_key(to))
            .map_err(store)?
            .map_or(0, |v| v.value());
        meta.insert(count_key(to), c + n).map_err(store)?;
    }
    Ok(())
}

impl EmbeddedQueue {
    /// Opens (creating when missing) the store in the folder `dir`, and puts every
    /// job a previous process left running back in the queue.
    pub fn open(dir: &Path) -> Result<EmbeddedQueue> {
        std::fs::create_dir_all(dir).map_err(|e| {
            JobsError::Config(format!(
                "cannot create the jobs folder {}: {e}",
                dir.display()
            ))
        })?;
        let path = dir.join("jobs.redb");
        let db = Database::create(&path).map_err(|e| {
            JobsError::Config(format!("cannot open the job store {}: {e}", path.display()))
        })?;
        let queue = EmbeddedQueue {
            path,
            db: RwLock::new(Some(Arc::new(db))),
            seen: AtomicU64::new(IO_FAULTS.load(Ordering::Acquire)),
        };
        queue.init()?;
        let back = queue.requeue_running(|_| true)?;
        if back > 0 {
            spdlog::warn!(
                "jobs: {back} job(s) left running by a previous process are queued again"
            );
        }
        Ok(queue)
    }

    /// The database. After an I/O error (a full disk during a commit) redb
    /// refuses every later transaction ("Previous I/O error occurred") until the
    /// database is opened again. So when an I/O error was seen since the last
    /// check, the store probes its database and, when poisoned, opens the file
    /// again: the file holds the last committed transaction (redb's checksummed
    /// roots), so nothing accepted is lost, and the store works again as soon as
    /// the fault clears. A reopen that fails (the disk still full, a transaction
    /// still running on the old handle) answers this call's error and is tried
    /// again on the next. The check costs one atomic load per call.
    fn db(&self) -> Result<Arc<Database>> {
        let faults = IO_FAULTS.load(Ordering::Acquire);
        if faults == self.seen.load(Ordering::Acquire) {
            if let Some(db) = self.db.read().as_ref() {
                return Ok(db.clone());
            }
        }
        let mut slot = self.db.write();
        if let Some(db) = slot.as_ref() {
            match db.begin_write() {
                Err(redb::TransactionError::Storage(redb::StorageError::PreviousIo)) => {}
                _ => {
                    self.seen.store(faults, Ordering::Release);
                    return Ok(db.clone());
                }
            }
        }
        // redb allows one open `Database` per file: the poisoned one goes first.
        // A call already running on it (a metrics read, the dispatcher) holds
        // the file's lock until it ends; new calls wait on `slot` meanwhile.
        *slot = None;
        let mut tries = 0;
        let db = loop {
            match Database::create(&self.path) {
                Ok(db) => break Arc::new(db),
                Err(redb::DatabaseError::DatabaseAlreadyOpen) if tries < 40 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(25));
                }
                Err(e) => return Err(store(e)),
            }
        };
        *slot = Some(db.clone());
        self.seen.store(faults, Ordering::Release);
        spdlog::warn!("jobs: the store had an I/O error; it is open again");
        Ok(db)
    }

    /// Runs `f` in one write transaction and commits it (fsync'd) when it succeeds;
    /// an error drops the transaction: nothing of it stays.
    fn write<T>(&self, f: impl FnOnce(&WriteTransaction) -> Result<T>) -> Result<T> {
        let txn = self.db()?.begin_write().map_err(store)?;
        let out = f(&txn)?;
        txn.commit().map_err(store)?;
        Ok(out)
    }

    /// Whether no job is queued (a read transaction: nothing to commit).
    fn nothing_queued(&self) -> Result<bool> {
        let txn = self.db()?.begin_read().map_err(store)?;
        let queue = txn.open_table(QUEUE).map_err(store)?;
        let empty = queue.first().map_err(store)?.is_none();
        Ok(empty)
    }

    fn init(&self) -> Result<()> {
        let txn = self.db()?.begin_write().map_err(store)?;
        txn.open_table(JOBS).map_err(store)?;
        txn.open_table(REQUESTS).map_err(store)?;
        txn.open_table(RESULTS).map_err(store)?;
        txn.open_table(QUEUE).map_err(store)?;
        txn.open_table(RUNNING).map_err(store)?;
        txn.open_table(FINISHED).map_err(store)?;
        txn.open_table(META).map_err(store)?;
        txn.commit().map_err(store)
    }

    /// Running jobs whose record `pick` chooses go back to the queue.
    fn requeue_running(&self, pick: impl Fn(&Record) -> bool) -> Result<u64> {
        self.write(|txn| {
            let ids: Vec<u64> = txn
                .open_table(RUNNING)
                .map_err(store)?
                .iter()
                .map_err(store)?
                .map(|e| e.map(|(k, _)| k.value()).map_err(store))
                .collect::<Result<_>>()?;
            txn::requeue_in(txn, ids, pick, false)
        })
    }
}

impl JobQueue for EmbeddedQueue {
    fn enqueue(&self, input: &mut dyn Iterator<Item = Result<NewJob>>) -> Result<Vec<JobId>> {
        let txn = self.db()?.begin_write().map_err(store)?;
        let mut ids = Vec::new();
        {
            let mut meta = txn.open_table(META).map_err(store)?;
            let mut next = meta.get(NEXT_ID).map_err(store)?.map_or(1, |v| v.value());
            let mut jobs = txn.open_table(JOBS).map_err(store)?;
            let mut requests = txn.open_table(REQUESTS).map_err(store)?;
            let mut queue = txn.open_table(QUEUE).map_err(store)?;
            let now = epoch_ms(SystemTime::now());
            for job in input {
                // An error drops `txn` uncommitted: nothing of the batch stays.
                let job = job?;
                let id = next;
                next += 1;
                let record = Record {
                    model: job.model,
                    state: JobState::Queued,
                    priority: job.priority,
                    submitted_ms: now,
                    finished_ms: None,
                    attempts: 0,
                    error: None,
                    consumer: None,
                    claimed_ms: None,
                    secret: Some(new_secret()?),
                    response_len: None,
                };
                jobs.insert(id, encode(&record)?.as_slice())
                    .map_err(store)?;
                requests.insert(id, job.request.as_slice()).map_err(store)?;
                queue.insert((record.priority, id), ()).map_err(store)?;
                ids.push(public_id(&id.to_string(), record.secret.as_deref()));
            }
            meta.insert(NEXT_ID, next).map_err(store)?;
        }
        recount(&txn, None, Some(JobState::Queued), ids.len() as u64)?;
        // Durability::Immediate (redb's default): fsync'd when commit returns.
        txn.commit().map_err(store)?;
        Ok(ids)
    }

    fn claim(&self, consumer: &str, max: usize) -> Result<Vec<ClaimedJob>> {
        if max == 0 || self.nothing_queued()? {
            return Ok(Vec::new());
        }
        self.write(|txn| txn::claim_in(txn, consumer, max))
    }

    fn release(&self, ids: &[JobId]) -> Result<()> {
        self.write(|txn| txn::release_in(txn, ids))
    }

    fn complete(&self, results: &[(JobId, Outcome)]) -> Result<()> {
        self.write(|txn| txn::complete_in(txn, results))
    }

    fn settle_and_claim(
        &self,
        results: &[(JobId, Outcome)],
        released: &[JobId],
        consumer: &str,
        max: usize,
    ) -> Result<Vec<ClaimedJob>> {
        // Nothing to store: a claim alone, which writes nothing when nothing is
        // queued (an idle dispatcher polling an empty queue leaves the disk alone).
        if results.is_empty() && released.is_empty() {
            return self.claim(consumer, max);
        }
        // One transaction, one fsync, for the whole round.
        self.write(|txn| {
            txn::complete_in(txn, results)?;
            txn::release_in(txn, released)?;
            txn::claim_in(txn, consumer, max)
        })
    }

    fn cancel(&self, public: &JobId) -> Result<CancelResult> {
        let Some(id) = parse_id(public) else {
            return Ok(CancelResult::NotFound);
        };
        let txn = self.db()?.begin_write().map_err(store)?;
        let Some(record) = txn::record(&txn, id)?.filter(|r| owned(public, r)) else {
            return Ok(CancelResult::NotFound);
        };
        if record.state != JobState::Queued {
            return Ok(CancelResult::NotQueued(record.state));
        }
        txn::finish(&txn, id, record, JobState::Cancelled, None)?;
        txn.commit().map_err(store)?;
        Ok(CancelResult::Cancelled)
    }

    fn get_admitted(
        &self,
        public: &JobId,
        admit: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Option<Job>> {
        let Some(id) = parse_id(public) else {
            return Ok(None);
        };
        let txn = self.db()?.begin_read().map_err(store)?;
        let jobs = txn.open_table(JOBS).map_err(store)?;
        let Some(record) = txn::read_record(&jobs, id)?.filter(|r| owned(public, r)) else {
            return Ok(None);
        };
        let response = match record.state {
            JobState::Done => {
                let known = record.response_len.map(|n| n as usize);
                if let Some(len) = known {
                    admit(len)?;
                }
                let results = txn.open_table(RESULTS).map_err(store)?;
                let value = results.get(id).map_err(store)?;
                if let (None, Some(value)) = (known, &value) {
                    admit(value.value().len())?;
                }
                value.map(|v| v.value().to_vec())
            }
            _ => None,
        };
        Ok(Some(record.job(id, response)))
    }

    fn list(&self, filter: &ListFilter, after: Option<&str>, limit: usize) -> Result<Page> {
        let start = match after {
            None => 0,
            Some(cursor) => split_id(&JobId(cursor.to_owned()))
                .map(|(seq, _)| seq)
                .ok_or(())
                .map_err(|_| JobsError::Invalid(format!("bad page cursor `{cursor}`")))?
                .saturating_add(1),
        };
        let txn = self.db()?.begin_read().map_err(store)?;
        let table = txn.open_table(JOBS).map_err(store)?;
        let mut jobs = Vec::new();
        let mut last = None;
        let mut more = false;
        for (scanned, entry) in table.range(start..).map_err(store)?.enumerate() {
            if jobs.len() >= limit || scanned >= MAX_SCAN {
                more = true;
                break;
            }
            let (k, v) = entry.map_err(store)?;
            let id = k.value();
            let record = decode(v.value())?;
            last = Some(id);
            let wanted = filter.model.as_ref().is_none_or(|m| *m == record.model)
                && filter.state.is_none_or(|s| s == record.state);
            if wanted {
                jobs.push(record.job(id, None));
            }
        }
        Ok(Page {
            jobs,
            next: if more {
                last.map(|id| id.to_string())
            } else {
                None
            },
        })
    }

    fn expire(&self, before: SystemTime) -> Result<u64> {
        let cutoff = epoch_ms(before);
        let txn = self.db()?.begin_write().map_err(store)?;
        let mut removed = StateCounts::default();
        {
            let mut finished = txn.open_table(FINISHED).map_err(store)?;
            let mut jobs = txn.open_table(JOBS).map_err(store)?;
            let mut results = txn.open_table(RESULTS).map_err(store)?;
            let old: Vec<(u64, u64)> = finished
                .range(..(cutoff, 0))
                .map_err(store)?
                .map(|e| e.map(|(k, _)| k.value()).map_err(store))
                .collect::<Result<_>>()?;
            for key in old {
                finished.remove(key).map_err(store)?;
                let id = key.1;
                results.remove(id).map_err(store)?;
                let gone = jobs.remove(id).map_err(store)?;
                if let Some(record) = gone.map(|v| decode(v.value())).transpose()? {
                    match record.state {
                        JobState::Done => removed.done += 1,
                        JobState::Failed => removed.failed += 1,
                        JobState::Cancelled => removed.cancelled += 1,
                        _ => {}
                    }
                }
            }
        }
        for state in [JobState::Done, JobState::Failed, JobState::Cancelled] {
            recount(&txn, Some(state), None, removed.get(state))?;
        }
        txn.commit().map_err(store)?;
        Ok(removed.done + removed.failed + removed.cancelled)
    }

    fn reclaim(&self, consumer: &str, idle: Duration) -> Result<u64> {
        let cutoff = epoch_ms(SystemTime::now()).saturating_sub(idle.as_millis() as u64);
        self.requeue_running(|r| {
            r.consumer.as_deref() != Some(consumer) && r.claimed_ms.is_none_or(|at| at <= cutoff)
        })
    }

    fn counts(&self) -> Result<StateCounts> {
        let txn = self.db()?.begin_read().map_err(store)?;
        let meta = txn.open_table(META).map_err(store)?;
        let get = |s: JobState| -> Result<u64> {
            Ok(meta
                .get(count_key(s))
                .map_err(store)?
                .map_or(0, |v| v.value()))
        };
        Ok(StateCounts {
            queued: get(JobState::Queued)?,
            running: get(JobState::Running)?,
            done: get(JobState::Done)?,
            failed: get(JobState::Failed)?,
            cancelled: get(JobState::Cancelled)?,
        })
    }
}
