//! The embedded store's operations inside one write transaction: the trait's
//! methods commit one each, and a dispatcher round commits several at once
//! ([`crate::JobQueue::settle_and_claim`]).

use std::collections::HashSet;
use std::time::SystemTime;

use redb::{ReadableTable, WriteTransaction};

use super::{
    decode, encode, parse_id, recount, store, Record, FINISHED, JOBS, QUEUE, REQUESTS, RESULTS,
    RUNNING,
};
use crate::queue::{epoch_ms, public_id, ClaimedJob, JobId, JobState, Outcome, Result};

pub(super) fn record(txn: &WriteTransaction, id: u64) -> Result<Option<Record>> {
    read_record(&txn.open_table(JOBS).map_err(store)?, id)
}

/// The record of `id` in the `jobs` table (open for reading or writing).
pub(super) fn read_record(
    jobs: &impl ReadableTable<u64, &'static [u8]>,
    id: u64,
) -> Result<Option<Record>> {
    jobs.get(id)
        .map_err(store)?
        .map(|v| decode(v.value()))
        .transpose()
}

/// Ends a job (`record` in its current state) as `to`, in `txn`.
pub(super) fn finish(
    txn: &WriteTransaction,
    id: u64,
    mut record: Record,
    to: JobState,
    error: Option<String>,
) -> Result<()> {
    let from = record.state;
    match from {
        JobState::Queued => {
            txn.open_table(QUEUE)
                .map_err(store)?
                .remove((record.priority, id))
                .map_err(store)?;
        }
        JobState::Running => {
            txn.open_table(RUNNING)
                .map_err(store)?
                .remove(id)
                .map_err(store)?;
        }
        _ => {}
    }
    let now = epoch_ms(SystemTime::now());
    record.state = to;
    record.finished_ms = Some(now);
    record.error = error;
    record.consumer = None;
    txn.open_table(JOBS)
        .map_err(store)?
        .insert(id, encode(&record)?.as_slice())
        .map_err(store)?;
    txn.open_table(REQUESTS)
        .map_err(store)?
        .remove(id)
        .map_err(store)?;
    txn.open_table(FINISHED)
        .map_err(store)?
        .insert((now, id), ())
        .map_err(store)?;
    recount(txn, Some(from), Some(to), 1)
}

pub(super) fn claim_in(
    txn: &WriteTransaction,
    consumer: &str,
    max: usize,
) -> Result<Vec<ClaimedJob>> {
    if max == 0 {
        return Ok(Vec::new());
    }
    let mut claimed = Vec::new();
    {
        let mut queue = txn.open_table(QUEUE).map_err(store)?;
        let mut jobs = txn.open_table(JOBS).map_err(store)?;
        let mut running = txn.open_table(RUNNING).map_err(store)?;
        let requests = txn.open_table(REQUESTS).map_err(store)?;
        let now = epoch_ms(SystemTime::now());
        while claimed.len() < max {
            let Some((key, _)) = queue.pop_first().map_err(store)? else {
                break;
            };
            let (_, id) = key.value();
            drop(key);
            let Some(mut record) = read_record(&jobs, id)? else {
                continue;
            };
            let request = requests
                .get(id)
                .map_err(store)?
                .map(|v| v.value().to_vec())
                .unwrap_or_default();
            record.state = JobState::Running;
            record.attempts += 1;
            record.consumer = Some(consumer.to_string());
            record.claimed_ms = Some(now);
            jobs.insert(id, encode(&record)?.as_slice())
                .map_err(store)?;
            running.insert(id, ()).map_err(store)?;
            claimed.push(ClaimedJob {
                id: public_id(&id.to_string(), record.secret.as_deref()),
                model: record.model,
                priority: record.priority,
                request,
            });
        }
    }
    recount(
        txn,
        Some(JobState::Queued),
        Some(JobState::Running),
        claimed.len() as u64,
    )?;
    Ok(claimed)
}

pub(super) fn release_in(txn: &WriteTransaction, ids: &[JobId]) -> Result<()> {
    let wanted: HashSet<u64> = ids.iter().filter_map(parse_id).collect();
    // Not run: the claim's attempt is taken back.
    requeue_in(txn, wanted, |_| true, true).map(|_| ())
}

/// Puts the running jobs among `ids` whose record `pick` chooses back in the
/// queue (`undo_attempt`: their last claim does not count); returns how many.
pub(super) fn requeue_in(
    txn: &WriteTransaction,
    ids: impl IntoIterator<Item = u64>,
    pick: impl Fn(&Record) -> bool,
    undo_attempt: bool,
) -> Result<u64> {
    let mut moved = 0;
    {
        let mut jobs = txn.open_table(JOBS).map_err(store)?;
        let mut running = txn.open_table(RUNNING).map_err(store)?;
        let mut queue = txn.open_table(QUEUE).map_err(store)?;
        for id in ids {
            if running.get(id).map_err(store)?.is_none() {
                continue;
            }
            let Some(mut record) = read_record(&jobs, id)? else {
                running.remove(id).map_err(store)?;
                continue;
            };
            if !pick(&record) {
                continue;
            }
            running.remove(id).map_err(store)?;
            record.state = JobState::Queued;
            if undo_attempt {
                record.attempts = record.attempts.saturating_sub(1);
            }
            record.consumer = None;
            record.claimed_ms = None;
            jobs.insert(id, encode(&record)?.as_slice())
                .map_err(store)?;
            queue.insert((record.priority, id), ()).map_err(store)?;
            moved += 1;
        }
    }
    recount(txn, Some(JobState::Running), Some(JobState::Queued), moved)?;
    Ok(moved)
}

pub(super) fn complete_in(txn: &WriteTransaction, results: &[(JobId, Outcome)]) -> Result<()> {
    if results.is_empty() {
        return Ok(());
    }
    for (id, outcome) in results {
        let Some(id) = parse_id(id) else { continue };
        let Some(mut record) = record(txn, id)? else {
            continue;
        };
        // The first result stored wins: a second run's is dropped.
        if record.state.is_finished() {
            continue;
        }
        match outcome {
            Outcome::Done(response) => {
                txn.open_table(RESULTS)
                    .map_err(store)?
                    .insert(id, response.as_slice())
                    .map_err(store)?;
                record.response_len = Some(response.len() as u64);
                finish(txn, id, record, JobState::Done, None)?;
            }
            Outcome::Failed(error) => {
                finish(txn, id, record, JobState::Failed, Some(error.clone()))?;
            }
        }
    }
    Ok(())
}
