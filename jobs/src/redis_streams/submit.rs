//! A submission on Redis, in bounded steps (issue 27, finding 12: one
//! 300,000-job `MULTI/EXEC` held Redis, and every replica, for 3.3 s).
//!
//! 1. **Stage**, in chunks of at most [`CHUNK_JOBS`] jobs and [`CHUNK_BYTES`]
//!    bytes, one script call each (`STAGE`): the job hashes and their ids, listed
//!    under a token of the submission's (`sub:TOKEN`). Nothing reads them: they
//!    are in no stream, listing or count, and their ids are not yet given out.
//! 2. **Commit**: one O(1) script call (`COMMIT`) counts them queued and marks
//!    the submission to be published. This is the point of acceptance; the 202
//!    follows it.
//! 3. **Publish**, in chunks (`PUBLISH`): each job gets its place in the listing
//!    and its stream entry, so the dispatchers may claim it.
//!
//! A failure before the commit abandons the submission (`ABORT`, then `DROP` in
//! chunks deletes what was staged); one after it leaves the rest to publish. A
//! submitter that dies leaves its token with a lease no one renews: any
//! replica's [`RedisQueue::tidy`] (a reclaim round) then drops a staged
//! submission, or publishes a committed one: nothing staged is ever claimed,
//! nothing committed is lost.

use std::time::{Duration, SystemTime};

use super::{RedisQueue, PREFIX};
use crate::queue::{epoch_ms, new_secret, public_id, JobId, JobsError, NewJob, Result};

/// Most jobs one call stages or publishes: 2 commands a job in `STAGE`, 3 in
/// `PUBLISH`, so at most 750 commands a call. Redis runs ~3.7 µs a command
/// (issue 27: 900,000 in 3.3 s), so ~3 ms a call at most.
pub const CHUNK_JOBS: usize = 250;
/// Most request bytes one `STAGE` call carries (a chunk closes at the job that
/// passes it; a single job may be larger, up to the submission's own bound).
pub const CHUNK_BYTES: usize = 1 << 20;
/// A submitter renews its lease at each chunk; one not renewed for this long
/// (or for the claim timeout, if longer) is taken for dead. Three times a
/// Redis call's timeout: a live one renews well within it.
const MIN_LEASE: Duration = Duration::from_secs(30);
/// Most script calls one tidying round makes (each bounded as above).
const TIDY_CALLS: usize = 100;

/// The three sets a submission's token moves through.
const STAGING: &str = "staging";
const PUBLISHING: &str = "publishing";
const ABORTING: &str = "aborting";

/// One chunk being gathered: the script's arguments and the jobs' secrets.
struct Chunk {
    args: Vec<Vec<u8>>,
    secrets: Vec<String>,
    bytes: usize,
}

impl Chunk {
    fn new() -> Chunk {
        Chunk {
            args: Vec::new(),
            secrets: Vec::new(),
            bytes: 0,
        }
    }

    fn push(&mut self, job: NewJob) -> Result<()> {
        let secret = new_secret()?;
        self.bytes += job.request.len();
        self.args.push(job.model.into_bytes());
        self.args.push(job.priority.to_string().into_bytes());
        self.args.push(job.request);
        self.args.push(secret.clone().into_bytes());
        self.secrets.push(secret);
        Ok(())
    }

    fn full(&self) -> bool {
        self.secrets.len() >= CHUNK_JOBS || self.bytes >= CHUNK_BYTES
    }
}

impl RedisQueue {
    /// Stages, commits and publishes one submission (see the module's doc).
    pub(super) fn submit(
        &self,
        input: &mut dyn Iterator<Item = Result<NewJob>>,
    ) -> Result<Vec<JobId>> {
        let token = new_secret()?;
        let now = now_ms();
        let mut ids = Vec::new();
        let mut chunk = Chunk::new();
        let mut staged = false;
        let mut next = input.next();
        while let Some(job) = next {
            let job = match job {
                Ok(job) => job,
                Err(e) => return Err(self.abandon(&token, staged, e)),
            };
            if let Err(e) = chunk.push(job) {
                return Err(self.abandon(&token, staged, e));
            }
            next = input.next();
            if chunk.full() || next.is_none() {
                let done = std::mem::replace(&mut chunk, Chunk::new());
                match self.stage(&token, now, !staged, done) {
                    Ok(chunk_ids) => ids.extend(chunk_ids),
                    Err(e) => return Err(self.abandon(&token, true, e)),
                }
                staged = true;
            }
        }
        if ids.is_empty() {
            return Ok(ids);
        }
        let token_arg = token.as_bytes();
        let n: i64 = self
            .pool
            .eval(&self.commit, &[token_arg, now_ms().to_string().as_bytes()])
            .map_err(|e| self.abandon(&token, true, e))?;
        if n < 0 {
            return Err(self.abandon(
                &token,
                true,
                JobsError::Store(
                    "the submission was taken for abandoned while it was stored; nothing of it \
                     was accepted: submit it again"
                        .into(),
                ),
            ));
        }
        // Accepted. Publishing what is left is any replica's once the lease
        // lapses, should this call fail.
        if let Err(e) = self.drain(&self.publish, &token) {
            spdlog::warn!(
                "jobs: publishing a submission of {n} job(s) was cut ({e}); a reclaim round \
                 publishes the rest"
            );
        }
        Ok(ids)
    }

    /// Stages one chunk; answers the public ids of its jobs.
    fn stage(&self, token: &str, now: u64, new: bool, chunk: Chunk) -> Result<Vec<JobId>> {
        let now = now.to_string();
        let how: &[u8] = if new { b"new" } else { b"more" };
        let mut args: Vec<&[u8]> = vec![token.as_bytes(), now.as_bytes(), how];
        args.extend(chunk.args.iter().map(Vec::as_slice));
        let first: i64 = self.pool.eval(&self.stage, &args)?;
        let Ok(first) = u64::try_from(first) else {
            return Err(JobsError::Store(
                "the submission was taken for abandoned while it was stored".into(),
            ));
        };
        Ok(chunk
            .secrets
            .iter()
            .enumerate()
            .map(|(i, secret)| public_id(&(first + i as u64).to_string(), Some(secret)))
            .collect())
    }

    /// A submission that failed before its commit: abandoned and its staged jobs
    /// deleted (best effort: a janitor finishes what this leaves). Returns `e`.
    fn abandon(&self, token: &str, staged: bool, e: JobsError) -> JobsError {
        if staged {
            let now = now_ms().to_string();
            let aborted = self
                .pool
                .eval::<i64>(&self.abort, &[token.as_bytes(), now.as_bytes()]);
            if aborted.is_ok() {
                if let Err(e) = self.drain(&self.drop_staged, token) {
                    spdlog::warn!("jobs: deleting an abandoned submission was cut ({e})");
                }
            }
        }
        e
    }

    /// Runs `PUBLISH` or `DROP` on `token` until nothing is left.
    fn drain(&self, script: &super::conn::Script, token: &str) -> Result<()> {
        self.drain_at_most(script, token, usize::MAX).map(|_| ())
    }

    /// Runs `PUBLISH` or `DROP` on `token` until nothing is left, or
    /// `max_calls` calls; answers the calls made.
    fn drain_at_most(
        &self,
        script: &super::conn::Script,
        token: &str,
        max_calls: usize,
    ) -> Result<usize> {
        let max = CHUNK_JOBS.to_string();
        let mut calls = 0;
        while calls < max_calls {
            let now = now_ms().to_string();
            calls += 1;
            let left: i64 = self
                .pool
                .eval(script, &[token.as_bytes(), now.as_bytes(), max.as_bytes()])?;
            if left <= 0 {
                break;
            }
        }
        Ok(calls)
    }

    /// A reclaim round's share: submissions whose submitter stopped renewing
    /// its lease for `lease` (at least [`MIN_LEASE`]) are finished for it: a
    /// staged one abandoned and deleted, a committed one published. Bounded: at
    /// most [`TIDY_CALLS`] script calls a round; the rest waits for the next.
    pub(super) fn tidy(&self, lease: Duration) -> Result<()> {
        let cutoff = now_ms()
            .saturating_sub(lease.max(MIN_LEASE).as_millis() as u64)
            .to_string();
        let stale = |set: &str| -> Result<Vec<String>> {
            self.pool.with(|con| {
                redis::cmd("ZRANGEBYSCORE")
                    .arg(format!("{PREFIX}{set}"))
                    .arg("-inf")
                    .arg(&cutoff)
                    .arg("LIMIT")
                    .arg(0)
                    .arg(TIDY_CALLS)
                    .query(con)
            })
        };
        let now = now_ms().to_string();
        // Abandoned here, deleted here: the lapsed ones, then any other
        // replica's deletions that stopped half-way.
        let mut dropping = Vec::new();
        for token in stale(STAGING)? {
            let aborted: i64 = self
                .pool
                .eval(&self.abort, &[token.as_bytes(), now.as_bytes()])?;
            if aborted == 1 {
                dropping.push(token);
            }
        }
        dropping.extend(stale(ABORTING)?);
        let publishing = stale(PUBLISHING)?;
        let work = dropping
            .iter()
            .map(|t| (t, &self.drop_staged))
            .chain(publishing.iter().map(|t| (t, &self.publish)));
        let mut calls = 0;
        for (token, script) in work {
            if calls >= TIDY_CALLS {
                break;
            }
            calls += self.drain_at_most(script, token, TIDY_CALLS - calls)?;
        }
        Ok(())
    }
}

fn now_ms() -> u64 {
    epoch_ms(SystemTime::now())
}
