//! The Redis Streams backend (`--jobs redis://HOST:PORT/DB`): several kiln servers
//! share one queue.
//!
//! - **Streams and one consumer group.** Each priority (1..9) has a stream
//!   (`kiln:jobs:stream:PRIO`) whose entries carry a job's id only; the request,
//!   state and result live in the job's hash (`kiln:jobs:job:ID`), so a large
//!   request does not sit in the stream. Every replica reads the streams through
//!   one consumer group (`kiln`), as a consumer of its own name
//!   (`--jobs-consumer`), so each entry goes to one replica.
//! - **Claim and acknowledgement** run as Lua scripts ([`scripts`]): reading
//!   entries (`XREADGROUP`) and marking their jobs `running` is one atomic step;
//!   storing a result and `XACK`ing its entry is another, so an entry is
//!   acknowledged only once its result is stored, and a result is stored once per
//!   job id (a second run's is dropped): exactly one visible result.
//! - **A dead consumer's jobs.** Entries pending (read, not acknowledged) for
//!   longer than the claim timeout are taken over by a live replica with
//!   `XAUTOCLAIM` ([`JobQueue::reclaim`]) and their jobs queued again. A live
//!   replica keeps its own entries fresh (`XCLAIM … JUSTID` on the jobs it is
//!   running, at each reclaim round), so only a dead or stalled one loses them.
//! - **Submission** in bounded steps ([`submit`]): staged in chunks where no
//!   reader looks, committed by one O(1) script call, then published in chunks.
//! - **Durability.** [`JobQueue::enqueue`] returns once Redis has answered the
//!   commit that accepts the jobs; what that answer means on disk is
//!   Redis's own setting: `appendonly yes` with `appendfsync always` (fsync'd
//!   before the answer), `everysec` (up to a second lost if Redis's host
//!   crashes), RDB snapshots only (minutes). See `docs/jobs.md`.

mod conn;
mod scripts;
mod submit;

pub use submit::CHUNK_JOBS;

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use redis::Value;

use conn::{store, Pool, Script};

use crate::queue::{
    epoch_ms, public_id, secret_matches, split_id, CancelResult, ClaimedJob, Job, JobId, JobQueue,
    JobState, JobsError, ListFilter, NewJob, Outcome, Page, Result, StateCounts, PRIORITY_HIGHEST,
    PRIORITY_LOWEST,
};

/// Every key's prefix.
const PREFIX: &str = "kiln:jobs:";
/// The consumer group every replica reads through.
const GROUP: &str = "kiln";
/// Jobs released, completed or kept fresh per round trip.
const CHUNK: usize = 512;
/// A job hash's fields but its request and response (what [`job_of`] reads).
const JOB_FIELDS: [&str; 8] = [
    "model",
    "state",
    "priority",
    "submitted_ms",
    "finished_ms",
    "attempts",
    "error",
    "secret",
];
/// A listing reads at most this many jobs per page (as the embedded store).
const MAX_SCAN: usize = crate::embedded::MAX_SCAN;
/// The Redis job store: a small pool of connections and the loaded scripts.
pub struct RedisQueue {
    pool: Pool,
    claim: Script,
    release: Script,
    reclaim: Script,
    finish: Script,
    cancel: Script,
    expire: Script,
    stage: Script,
    commit: Script,
    publish: Script,
    abort: Script,
    drop_staged: Script,
    /// The stream entries this process runs (job → (priority, entry)), kept fresh
    /// at each reclaim round so that no other replica takes them.
    running: Mutex<HashMap<JobId, (u8, String)>>,
    /// When this process opened the store (ms): jobs its consumer name claimed
    /// before are a previous process's, taken back by [`JobQueue::reclaim`].
    since: u64,
}

impl RedisQueue {
    /// Connects to `url`, creates the streams and the consumer group when
    /// missing, and loads the scripts.
    pub fn open(url: &str) -> Result<RedisQueue> {
        let pool = Pool::open(url)?;
        let mut con = pool.take()?;
        for prio in PRIORITY_HIGHEST..=PRIORITY_LOWEST {
            let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(stream_key(prio))
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query(&mut con);
            match created {
                Ok(_) => {}
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => return Err(store(e)),
            }
        }
        let mut load = |source: String| Script::load(source, &mut con);
        let queue = RedisQueue {
            claim: load(scripts::CLAIM.to_owned())?,
            release: load(scripts::release())?,
            reclaim: load(scripts::reclaim())?,
            finish: load(scripts::FINISH.to_owned())?,
            cancel: load(scripts::CANCEL.to_owned())?,
            expire: load(scripts::EXPIRE.to_owned())?,
            stage: load(scripts::STAGE.to_owned())?,
            commit: load(scripts::COMMIT.to_owned())?,
            publish: load(scripts::PUBLISH.to_owned())?,
            abort: load(scripts::ABORT.to_owned())?,
            drop_staged: load(scripts::DROP.to_owned())?,
            pool,
            running: Mutex::new(HashMap::new()),
            since: epoch_ms(SystemTime::now()),
        };
        queue.pool.put(con);
        Ok(queue)
    }

    /// Resets the idle time of the entries this process runs (`XCLAIM … JUSTID`).
    fn keep_fresh(&self, consumer: &str) -> Result<()> {
        let mut by_stream: HashMap<u8, Vec<String>> = HashMap::new();
        for (prio, entry) in self.running.lock().values() {
            by_stream.entry(*prio).or_default().push(entry.clone());
        }
        for (prio, entries) in by_stream {
            for entries in entries.chunks(CHUNK) {
                self.pool.with(|con| {
                    redis::cmd("XCLAIM")
                        .arg(stream_key(prio))
                        .arg(GROUP)
                        .arg(consumer)
                        .arg(0)
                        .arg(entries)
                        .arg("JUSTID")
                        .query::<Value>(con)
                })?;
            }
        }
        Ok(())
    }
}

fn job_key(id: &str) -> String {
    format!("{PREFIX}job:{id}")
}

fn stream_key(prio: u8) -> String {
    format!("{PREFIX}stream:{prio}")
}

/// A job id of this store (a decimal number and, from a client, its secret):
/// the number as Redis keys take it, and the secret.
fn valid_id(id: &JobId) -> Option<(String, &str)> {
    split_id(id).map(|(seq, secret)| (seq.to_string(), secret.unwrap_or("")))
}

impl JobQueue for RedisQueue {
    fn enqueue(&self, input: &mut dyn Iterator<Item = Result<NewJob>>) -> Result<Vec<JobId>> {
        self.submit(input)
    }

    fn claim(&self, consumer: &str, max: usize) -> Result<Vec<ClaimedJob>> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let now = epoch_ms(SystemTime::now()).to_string();
        let max = max.to_string();
        let flat: Vec<Vec<u8>> = self.pool.eval(
            &self.claim,
            &[consumer.as_bytes(), max.as_bytes(), now.as_bytes()],
        )?;
        let mut claimed: Vec<ClaimedJob> = Vec::with_capacity(flat.len() / 4);
        for job in flat.chunks_exact(4) {
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            let priority = text(&job[2]).parse().unwrap_or(PRIORITY_LOWEST);
            claimed.push(ClaimedJob {
                id: JobId(text(&job[0])),
                model: text(&job[1]),
                priority,
                request: job[3].clone(),
            });
        }
        if !claimed.is_empty() {
            // The entry ids, to keep them fresh while they run, and the secrets,
            // so that a claimed job carries the id its submitter got.
            let fields: Vec<(Option<String>, Option<String>)> = self.pool.with(|con| {
                let mut pipe = redis::pipe();
                for job in &claimed {
                    pipe.cmd("HMGET")
                        .arg(job_key(&job.id.0))
                        .arg("entry")
                        .arg("secret");
                }
                pipe.query(con)
            })?;
            let mut running = self.running.lock();
            for (job, (entry, secret)) in claimed.iter_mut().zip(fields) {
                job.id = public_id(&job.id.0, secret.as_deref());
                if let Some(entry) = entry {
                    running.insert(job.id.clone(), (job.priority, entry));
                }
            }
        }
        Ok(claimed)
    }

    fn release(&self, ids: &[JobId]) -> Result<()> {
        for ids in ids.chunks(CHUNK) {
            let seqs: Vec<String> = ids.iter().filter_map(|id| Some(valid_id(id)?.0)).collect();
            let args: Vec<&[u8]> = seqs.iter().map(|s| s.as_bytes()).collect();
            self.pool.eval::<i64>(&self.release, &args)?;
            let mut running = self.running.lock();
            for id in ids {
                running.remove(id);
            }
        }
        Ok(())
    }

    fn complete(&self, results: &[(JobId, Outcome)]) -> Result<()> {
        let now = epoch_ms(SystemTime::now()).to_string();
        for results in results.chunks(CHUNK) {
            let valid: Vec<(String, &Outcome)> = results
                .iter()
                .filter_map(|(id, outcome)| Some((valid_id(id)?.0, outcome)))
                .collect();
            let mut args: Vec<&[u8]> = vec![now.as_bytes()];
            for (seq, outcome) in &valid {
                let (state, value): (&[u8], &[u8]) = match outcome {
                    Outcome::Done(response) => (b"done", response),
                    Outcome::Failed(error) => (b"failed", error.as_bytes()),
                };
                args.extend([seq.as_bytes(), state, value]);
            }
            self.pool.eval::<i64>(&self.finish, &args)?;
            let mut running = self.running.lock();
            for (id, _) in results {
                running.remove(id);
            }
        }
        Ok(())
    }

    fn cancel(&self, id: &JobId) -> Result<CancelResult> {
        let Some((seq, secret)) = valid_id(id) else {
            return Ok(CancelResult::NotFound);
        };
        let now = epoch_ms(SystemTime::now()).to_string();
        let before: Option<String> = self.pool.eval(
            &self.cancel,
            &[seq.as_bytes(), now.as_bytes(), secret.as_bytes()],
        )?;
        Ok(match before.as_deref().map(JobState::parse) {
            None => CancelResult::NotFound,
            Some(Some(JobState::Queued)) => CancelResult::Cancelled,
            Some(Some(state)) => CancelResult::NotQueued(state),
            Some(None) => return Err(store("a job with an unknown state")),
        })
    }

    fn get_admitted(
        &self,
        id: &JobId,
        admit: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Option<Job>> {
        let Some((seq, given)) = valid_id(id) else {
            return Ok(None);
        };
        let key = job_key(&seq);
        // The small fields and the response's length first (not `HGETALL`: a
        // queued job's request, a done one's response, are read only if asked).
        let (values, len): (Vec<Option<Vec<u8>>>, usize) = self.pool.with(|con| {
            redis::pipe()
                .cmd("HMGET")
                .arg(&key)
                .arg(&JOB_FIELDS[..])
                .cmd("HSTRLEN")
                .arg(&key)
                .arg("response")
                .query(con)
        })?;
        let fields: HashMap<String, Vec<u8>> = JOB_FIELDS
            .iter()
            .zip(values)
            .filter_map(|(k, v)| Some(((*k).to_owned(), v?)))
            .collect();
        let stored = fields.get("secret").map(|s| String::from_utf8_lossy(s));
        let given = Some(given).filter(|g| !g.is_empty());
        if !secret_matches(given, stored.as_deref()) {
            return Ok(None);
        }
        let Some(mut job) = job_of(&seq, &fields)? else {
            return Ok(None);
        };
        if job.state == JobState::Done {
            admit(len)?;
            // A done job's response does not change; gone: expired meanwhile.
            let response: Option<Vec<u8>> = self
                .pool
                .with(|con| redis::cmd("HGET").arg(&key).arg("response").query(con))?;
            let Some(response) = response else {
                return Ok(None);
            };
            job.response = Some(response);
        }
        Ok(Some(job))
    }

    fn list(&self, filter: &ListFilter, after: Option<&str>, limit: usize) -> Result<Page> {
        let start = match after {
            None => "-inf".to_owned(),
            Some(cursor) => match split_id(&JobId(cursor.to_owned())) {
                Some((n, _)) => format!("({n}"),
                None => return Err(JobsError::Invalid(format!("bad page cursor `{cursor}`"))),
            },
        };
        let mut jobs = Vec::new();
        let mut scanned = 0;
        let mut cursor = start;
        let mut last = None;
        loop {
            let batch = (limit - jobs.len()).clamp(1, 1000);
            let ids: Vec<String> = self.pool.with(|con| {
                redis::cmd("ZRANGEBYSCORE")
                    .arg(format!("{PREFIX}index"))
                    .arg(&cursor)
                    .arg("+inf")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(batch)
                    .query(con)
            })?;
            if ids.is_empty() {
                return Ok(Page { jobs, next: None });
            }
            let records: Vec<HashMap<String, Vec<u8>>> = self.pool.with(|con| {
                let mut pipe = redis::pipe();
                for id in &ids {
                    pipe.cmd("HGETALL").arg(job_key(id));
                }
                pipe.query(con)
            })?;
            for (id, mut fields) in ids.iter().zip(records) {
                if jobs.len() >= limit || scanned >= MAX_SCAN {
                    return Ok(Page { jobs, next: last });
                }
                scanned += 1;
                last = Some(id.clone());
                fields.remove("request");
                fields.remove("response");
                let Some(job) = job_of(id, &fields)? else {
                    continue;
                };
                let wanted = filter.model.as_ref().is_none_or(|m| *m == job.model)
                    && filter.state.is_none_or(|s| s == job.state);
                if wanted {
                    jobs.push(job);
                }
            }
            cursor = format!("({}", ids.last().map_or("0", |s| s.as_str()));
            if ids.len() < batch && jobs.len() < limit {
                return Ok(Page { jobs, next: None });
            }
        }
    }

    fn expire(&self, before: SystemTime) -> Result<u64> {
        let cutoff = epoch_ms(before).to_string();
        let mut total = 0;
        loop {
            let n: u64 = self
                .pool
                .eval(&self.expire, &[cutoff.as_bytes(), b"1000"])?;
            total += n;
            if n < 1000 {
                return Ok(total);
            }
        }
    }

    fn reclaim(&self, consumer: &str, idle: Duration) -> Result<u64> {
        self.keep_fresh(consumer)?;
        self.tidy(idle)?;
        let idle_ms = idle.as_millis().to_string();
        let since = self.since.to_string();
        let mut moved = 0;
        for prio in PRIORITY_HIGHEST..=PRIORITY_LOWEST {
            let prio = prio.to_string();
            let mut cursor = "0-0".to_owned();
            // Bounded: 50 rounds of 200 entries per priority per call.
            for _ in 0..50 {
                let (next, n): (String, u64) = self.pool.eval(
                    &self.reclaim,
                    &[
                        consumer.as_bytes(),
                        idle_ms.as_bytes(),
                        prio.as_bytes(),
                        cursor.as_bytes(),
                        since.as_bytes(),
                    ],
                )?;
                moved += n;
                if next == "0-0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(moved)
    }

    fn counts(&self) -> Result<StateCounts> {
        let c: Vec<Option<i64>> = self.pool.with(|con| {
            redis::cmd("HMGET")
                .arg(format!("{PREFIX}counts"))
                .arg(&["queued", "running", "done", "failed", "cancelled"])
                .query(con)
        })?;
        let at = |i: usize| c.get(i).copied().flatten().unwrap_or(0).max(0) as u64;
        Ok(StateCounts {
            queued: at(0),
            running: at(1),
            done: at(2),
            failed: at(3),
            cancelled: at(4),
        })
    }
}

/// The job of a hash's fields (`None`: no such job, or one staged and not yet
/// visible).
fn job_of(id: &str, fields: &HashMap<String, Vec<u8>>) -> Result<Option<Job>> {
    let text = |k: &str| {
        fields
            .get(k)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let number = |k: &str| text(k).and_then(|v| v.parse::<u64>().ok());
    let (Some(model), Some(state)) = (text("model"), text("state")) else {
        return Ok(None);
    };
    let state = JobState::parse(&state)
        .ok_or_else(|| store(format!("job {id} has an unknown state `{state}`")))?;
    let secret = text("secret");
    Ok(Some(Job {
        id: public_id(id, secret.as_deref()),
        model,
        state,
        priority: number("priority").map_or(PRIORITY_LOWEST, |p| p as u8),
        submitted_ms: number("submitted_ms").unwrap_or(0),
        finished_ms: number("finished_ms"),
        attempts: number("attempts").unwrap_or(0) as u32,
        response: None,
        error: text("error"),
    }))
}
