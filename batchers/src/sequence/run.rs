//! The sequence batcher's thread: admits requests, hears back from instances, and
//! sends each batch to the instance its sequences are pinned to.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{never, select, Receiver, Sender};
use kiln_buffers::{BufferSet, Pool};

use super::scheduler::{SequencePoll, SequenceRejection, SequenceScheduler};
use super::SequenceConfig;
use crate::batch::Batch;
use crate::request::Request;

/// What instances (and the group) tell the sequence batcher.
pub enum SequenceEvent<R> {
    /// A worker instance joined; its batches go to `batches`. `index` is the instance
    /// number it reports completions under (0, 1, … in the order they join).
    Instance {
        index: usize,
        batches: Sender<Batch<R>>,
    },
    /// Instance `instance` finished a batch: each sequence's new state, or `None`
    /// when the batch failed (the state stays as it was).
    Done {
        instance: usize,
        sequences: Vec<(u64, Option<Vec<Bytes>>)>,
    },
}

/// What the sequence batcher needs from its host.
pub trait SequenceHost<R>: Send {
    /// `request` leaves without being batched.
    fn rejected(&self, request: Request<R>, why: SequenceRejection);
    /// Whether the client waiting on `reply` went away.
    fn is_cancelled(&self, reply: &R) -> bool;
    /// Live and backlogged sequences now (for gauges).
    fn sequences(&self, _live: usize, _backlog: usize) {}
}

/// How often the batcher looks for cancelled requests and idle sequences when nothing
/// else wakes it.
const CHECK: Duration = Duration::from_millis(50);

/// Runs a sequence batcher until `requests` is disconnected and every request taken
/// has run or been answered. One thread per group.
pub fn run_sequence_batcher<R>(
    config: SequenceConfig,
    inputs: usize,
    requests: Receiver<Request<R>>,
    events: Receiver<SequenceEvent<R>>,
    pool: Arc<Pool<BufferSet>>,
    host: impl SequenceHost<R>,
) {
    let mut scheduler = SequenceScheduler::new(config);
    let mut outlets: Vec<Option<Sender<Batch<R>>>> = Vec::new();
    let (closed_requests, closed_events) = (never(), never());
    let (mut requests_open, mut events_open) = (true, true);
    let mut spare = None;
    loop {
        let now = Instant::now();
        if events_open {
            for event in events.try_iter() {
                handle(&mut scheduler, &mut outlets, event, now);
            }
        }
        if requests_open {
            for request in requests.try_iter() {
                if let Err((request, why)) = scheduler.admit(request, now) {
                    host.rejected(request, why);
                }
            }
        }
        scheduler.expire(now);
        for request in scheduler.cancel(now, |reply| host.is_cancelled(reply)) {
            host.rejected(request, SequenceRejection::Cancelled);
        }
        host.sequences(scheduler.live(), scheduler.backlogged());
        if !requests_open && scheduler.is_drained() {
            return;
        }
        let mut wake = scheduler
            .next_deadline()
            .unwrap_or(now + CHECK)
            .min(now + CHECK);
        if scheduler.queued() > 0 && spare.is_none() {
            spare = pool.try_acquire();
        }
        let poll = if spare.is_some() {
            scheduler.poll(now)
        } else {
            SequencePoll::Wait(None)
        };
        match poll {
            SequencePoll::Batch {
                instance,
                requests: taken,
            } => {
                let Some(set) = spare.take() else { continue };
                let mut batch = Batch::new(set, inputs, taken.len());
                let handles: Vec<u64> = taken
                    .iter()
                    .filter_map(|r| r.sequence.as_ref().map(|f| f.handle))
                    .collect();
                batch.push_all(taken);
                let sent = match outlets.get(instance).and_then(Option::as_ref) {
                    Some(tx) => tx.send(batch).is_ok(),
                    None => false,
                };
                if !sent {
                    // The instance is gone: its batch (and replies) were dropped.
                    let failed = handles.into_iter().map(|h| (h, None)).collect();
                    scheduler.complete(instance, failed, Instant::now());
                }
            }
            SequencePoll::Wait(until) => {
                if let Some(until) = until {
                    wake = wake.min(until);
                }
                if scheduler.queued() > 0 && spare.is_none() {
                    // Every buffer set is in flight: wait for one, a bounded while.
                    spare = pool.acquire_timeout(wake.saturating_duration_since(now));
                    continue;
                }
                let timeout = wake.saturating_duration_since(Instant::now());
                let request_rx = if requests_open {
                    &requests
                } else {
                    &closed_requests
                };
                let event_rx = if events_open { &events } else { &closed_events };
                select! {
                    recv(request_rx) -> message => match message {
                        Ok(request) => {
                            if let Err((request, why)) = scheduler.admit(request, Instant::now()) {
                                host.rejected(request, why);
                            }
                        }
                        Err(_) => {
                            requests_open = false;
                            scheduler.close(Instant::now());
                        }
                    },
                    recv(event_rx) -> message => match message {
                        Ok(event) => handle(&mut scheduler, &mut outlets, event, Instant::now()),
                        Err(_) => events_open = false,
                    },
                    default(timeout) => {}
                }
            }
        }
    }
}

fn handle<R>(
    scheduler: &mut SequenceScheduler<R>,
    outlets: &mut Vec<Option<Sender<Batch<R>>>>,
    event: SequenceEvent<R>,
    now: Instant,
) {
    match event {
        SequenceEvent::Instance { index, batches } => {
            while outlets.len() <= index {
                outlets.push(None);
                scheduler.add_instance(now);
            }
            if let Some(slot) = outlets.get_mut(index) {
                *slot = Some(batches);
            }
        }
        SequenceEvent::Done {
            instance,
            sequences,
        } => scheduler.complete(instance, sequences, now),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Strategy;
    use super::*;
    use crossbeam_channel::{bounded, unbounded};
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Host {
        rejected: Arc<Mutex<Vec<(u32, SequenceRejection)>>>,
    }

    impl SequenceHost<u32> for Host {
        fn rejected(&self, request: Request<u32>, why: SequenceRejection) {
            self.rejected.lock().unwrap().push((request.reply, why));
        }
        fn is_cancelled(&self, _reply: &u32) -> bool {
            false
        }
    }

    fn req(id: u64, tag: u32, start: bool, end: bool) -> Request<u32> {
        super::super::test_request(id, tag, (start, end), Instant::now())
    }

    /// A counter model with two instances: each sequence's state counts its requests.
    /// Every run's state input must be the previous run's output for that sequence,
    /// whatever instance and batch it lands in.
    #[test]
    fn state_flows_through_instances_and_unload_drains() {
        let mut config = super::super::test_config(Strategy::Oldest, 4);
        config.max_idle = Duration::from_secs(10);
        config.max_sequences = 16;
        let (tx, rx) = bounded(256);
        let (etx, erx) = unbounded();
        let pool = Pool::new(4, || BufferSet::with_capacities(&[64, 64], &[64]));
        let host = Host::default();
        let h = host.clone();
        let batcher = std::thread::spawn(move || run_sequence_batcher(config, 2, rx, erx, pool, h));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut workers = Vec::new();
        for index in 0..2 {
            let (btx, brx) = unbounded::<Batch<u32>>();
            etx.send(SequenceEvent::Instance {
                index,
                batches: btx,
            })
            .unwrap();
            let (etx, seen) = (etx.clone(), Arc::clone(&seen));
            workers.push(std::thread::spawn(move || {
                for batch in brx.iter() {
                    let states: Vec<u32> = batch.buffers.inputs[1]
                        .as_slice()
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    let mut done = Vec::new();
                    for (member, state) in batch.members.iter().zip(&states) {
                        seen.lock().unwrap().push((member.reply, *state));
                        let next = Bytes::copy_from_slice(&(state + 1).to_le_bytes());
                        done.push((member.sequence.unwrap(), Some(vec![next])));
                    }
                    etx.send(SequenceEvent::Done {
                        instance: index,
                        sequences: done,
                    })
                    .unwrap();
                }
            }));
        }
        // Sequence s sends tags s*100 + k, k = 0..5; each waits for nothing (all
        // queued at once): the batcher alone keeps them in order.
        for k in 0..5u32 {
            for s in 1..=6u64 {
                tx.send(req(s, s as u32 * 100 + k, k == 0, k == 4)).unwrap();
            }
        }
        // A request for a sequence that ended is refused.
        std::thread::sleep(Duration::from_millis(200));
        tx.send(req(1, 999, false, false)).unwrap();
        drop(tx);
        batcher.join().unwrap();
        drop(etx);
        for w in workers {
            w.join().unwrap();
        }
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 30);
        for &(tag, state) in seen.iter() {
            assert_eq!(state, tag % 100, "request {tag} saw state {state}");
        }
        assert_eq!(
            *host.rejected.lock().unwrap(),
            vec![(999, SequenceRejection::NotActive { expired: false })]
        );
    }
}
