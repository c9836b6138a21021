//! The sequence batcher on its instances' turns: no thread of its own. An instance
//! that is free takes what has arrived into the scheduler and forms its own batch
//! ([`SequenceFormer::next_batch`]); the instance that ran a batch folds its states
//! back in ([`SequenceFormer::complete`]). So a batch is not handed from a batcher
//! thread to an instance (a wake-up per batch), and a request that completes a
//! batch (the last live sequence's next chunk) wakes the instance that runs it.
//!
//! Requests are taken into the scheduler by whichever instance looks next: while
//! every instance is running a batch they stay in the group's queue, in order, and
//! one the scheduler refuses (a sequence that is not active, no place for a new
//! one) is answered then, within one batch's run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, Select, Sender, TryRecvError};
use kiln_buffers::{BufferSet, Pool};
use parking_lot::Mutex;

use super::scheduler::{SequencePoll, SequenceRejection, SequenceScheduler};
use super::SequenceConfig;
use crate::batch::Batch;
use crate::batcher::{Idle, IDLE_LINGER};
use crate::request::Request;

/// What the sequence batcher needs from its host.
pub trait SequenceHost<R>: Send + Sync {
    /// `request` leaves without being batched.
    fn rejected(&self, request: Request<R>, why: SequenceRejection);
    /// Whether the client waiting on `reply` went away.
    fn is_cancelled(&self, reply: &R) -> bool;
    /// Live and backlogged sequences now (for gauges).
    fn sequences(&self, _live: usize, _backlog: usize) {}
}

/// How long a waiting instance goes without looking for cancelled requests and
/// idle sequences.
const CHECK: Duration = Duration::from_millis(50);

/// A stateful group's sequence batcher, shared by its instances.
pub struct SequenceFormer<R> {
    requests: Receiver<Request<R>>,
    pool: Arc<Pool<BufferSet>>,
    inputs: usize,
    host: Box<dyn SequenceHost<R>>,
    shared: Mutex<Shared<R>>,
}

/// What the instances share under the lock.
struct Shared<R> {
    scheduler: SequenceScheduler<R>,
    /// Each instance's bell, rung when a batch may be due for it (or the group is
    /// draining) while it waits; one ring is kept until it looks.
    bells: Vec<Sender<()>>,
    /// Whether the group's request queue is still open.
    open: bool,
}

/// One instance's place at a [`SequenceFormer`].
pub struct SequenceTurn {
    /// The instance's number in the scheduler (the order instances joined).
    pub index: usize,
    bell: Receiver<()>,
}

impl<R> SequenceFormer<R> {
    /// A sequence batcher over a group's request queue and buffer pool, for a worker
    /// with `inputs` inputs; instances join with [`SequenceFormer::join`].
    pub fn new(
        config: SequenceConfig,
        inputs: usize,
        requests: Receiver<Request<R>>,
        pool: Arc<Pool<BufferSet>>,
        host: Box<dyn SequenceHost<R>>,
    ) -> SequenceFormer<R> {
        SequenceFormer {
            requests,
            pool,
            inputs,
            host,
            shared: Mutex::new(Shared {
                scheduler: SequenceScheduler::new(config),
                bells: Vec::new(),
                open: true,
            }),
        }
    }

    /// Adds an instance; backlogged sequences may move to it (it looks at them in
    /// its first [`SequenceFormer::next_batch`]).
    pub fn join(&self) -> SequenceTurn {
        let (ring, bell) = bounded(1);
        let mut shared = self.shared.lock();
        let index = shared.scheduler.add_instance(Instant::now());
        shared.bells.push(ring);
        SequenceTurn { index, bell }
    }

    /// The next batch for `turn`'s instance, formed when one is due; `idle` is told
    /// when the instance is about to wait. `None` once the request queue is closed
    /// and every request taken has run or been answered.
    pub fn next_batch(&self, turn: &SequenceTurn, idle: &mut dyn Idle) -> Option<Batch<R>> {
        // What a wait waits for: a request in the group's queue (until it closes),
        // this instance's bell. Requests are only received under the lock
        // (`take_in`), so they enter the scheduler in the queue's order whichever
        // instance looks.
        let mut select = Select::new();
        let mut queue = Some(select.recv(&self.requests));
        select.recv(&turn.bell);
        loop {
            let now = Instant::now();
            let mut shared = self.shared.lock();
            self.take_in(&mut shared, turn.index, now);
            if !shared.open && shared.scheduler.is_drained() {
                return None;
            }
            let until = match shared.scheduler.poll_instance(turn.index, now) {
                SequencePoll::Batch { requests, .. } => {
                    drop(shared);
                    return Some(self.batch(requests));
                }
                SequencePoll::Wait(until) => until,
            };
            let next = shared.scheduler.next_deadline();
            let open = shared.open;
            drop(shared);
            let wake = [until, next]
                .into_iter()
                .flatten()
                .fold(now + CHECK, Instant::min);
            // Holding answers' outputs: let them go if nothing comes for a while.
            let linger = idle.idle();
            let wait_until = if linger {
                wake.min(now + IDLE_LINGER)
            } else {
                wake
            };
            if let Some(queue) = queue.take_if(|_| !open) {
                // Closed, it would always be ready.
                select.remove(queue);
            }
            let woken = select.ready_timeout(wait_until.saturating_duration_since(Instant::now()));
            // This instance looks now: a ring so far is answered.
            let _ = turn.bell.try_recv();
            if woken.is_err() && linger && Instant::now() >= now + IDLE_LINGER {
                idle.lingered();
            }
        }
    }

    /// Instance `index` finished a batch: each sequence's new state, or `None` when
    /// the batch failed (the state stays as it was).
    pub fn complete(&self, index: usize, sequences: Vec<(u64, Option<Vec<Bytes>>)>) {
        let now = Instant::now();
        let mut shared = self.shared.lock();
        shared.scheduler.complete(index, sequences, now);
        // Freed places may have taken backlogged sequences in elsewhere, and a
        // draining group's other instances wait for this batch to end.
        let all = !shared.open;
        ring_others(&shared, index, now, all);
    }

    /// A batch of `requests` (their worker inputs assembled) in a buffer set. It
    /// waits while every set is in flight (a `max_buffers` below the instances):
    /// the requests are this instance's to run either way.
    fn batch(&self, requests: Vec<Request<R>>) -> Batch<R> {
        let set = self.pool.acquire();
        let mut batch = Batch::new(set, self.inputs, requests.len());
        batch.push_all(requests);
        batch
    }

    /// Takes what has arrived into the scheduler, frees idle sequences, answers
    /// cancelled requests and tells the instances waiting that batches are due.
    fn take_in(&self, shared: &mut Shared<R>, index: usize, now: Instant) {
        if shared.open {
            loop {
                match self.requests.try_recv() {
                    Ok(request) => {
                        if let Err((request, why)) = shared.scheduler.admit(request, now) {
                            self.host.rejected(request, why);
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        // The group is unloading: idle sequences are freed, the
                        // others run out, and every instance looks again.
                        shared.open = false;
                        shared.scheduler.close(now);
                        ring_others(shared, index, now, true);
                        break;
                    }
                }
            }
        }
        let scheduler = &mut shared.scheduler;
        scheduler.expire(now);
        for request in scheduler.cancel(now, |reply| self.host.is_cancelled(reply)) {
            self.host.rejected(request, SequenceRejection::Cancelled);
        }
        self.host
            .sequences(scheduler.live(), scheduler.backlogged());
        ring_others(shared, index, now, false);
    }
}

/// Rings each instance but `index` that has a batch due now, or every one (`all`).
fn ring_others<R>(shared: &Shared<R>, index: usize, now: Instant, all: bool) {
    for (other, ring) in shared.bells.iter().enumerate() {
        if other != index && (all || shared.scheduler.is_due(other, now)) {
            let _ = ring.try_send(());
        }
    }
}

#[cfg(test)]
mod tests;
