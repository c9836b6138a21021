use super::*;
use crate::request::Tensor;
use bytes::Bytes;
use kiln_worker_sdk::{DataType, Shape};
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Host {
    rejected: Arc<Mutex<Vec<(u32, Rejection)>>>,
    cancelled: Arc<Mutex<Vec<u32>>>,
}

impl DynamicHost<u32> for Host {
    fn rejected(&self, request: Request<u32>, why: Rejection) {
        self.rejected.lock().unwrap().push((request.reply, why));
    }
    fn is_cancelled(&self, reply: &u32) -> bool {
        self.cancelled.lock().unwrap().contains(reply)
    }
    fn compute_estimate(&self) -> Duration {
        Duration::ZERO
    }
}

fn req(id: u32) -> Request<u32> {
    let shape = Shape::new(&[1, 1]).unwrap();
    Request {
        inputs: vec![Tensor {
            dtype: DataType::Uint32,
            shape,
            data: Bytes::from(id.to_le_bytes().to_vec()),
        }],
        rows: 1,
        params: Vec::new(),
        arrived: Instant::now(),
        priority: None,
        timeout: None,
        sequence: None,
        ticket: None,
        reply: id,
    }
}

#[test]
fn a_queued_request_times_out_at_its_deadline_while_the_worker_is_busy() {
    let (tx, rx) = crossbeam_channel::unbounded();
    let (btx, brx) = crossbeam_channel::unbounded();
    // One buffer set, held below: the batcher cannot form any batch.
    let pool =
        kiln_buffers::Pool::new(1, || kiln_buffers::BufferSet::with_capacities(&[64], &[64]));
    let mut config = DynamicConfig::new(4, Duration::ZERO);
    config.policies = vec![QueuePolicy {
        default_timeout: Some(Duration::from_millis(30)),
        ..QueuePolicy::default()
    }];
    let host = Host::default();
    let (p, h) = (Arc::clone(&pool), host.clone());
    let pulls = Arc::new(Pulls::default());
    let outlet = (btx, Arc::clone(&pulls));
    let thread = std::thread::spawn(move || run_dynamic_batcher(config, 1, rx, p, outlet, h));
    pulls.ask();
    tx.send(req(1)).unwrap();
    let first = brx.recv_timeout(Duration::from_secs(5)).unwrap(); // holds the only set
    pulls.ask(); // the instance is free again, but the set is not
    tx.send(req(2)).unwrap();
    tx.send(req(3)).unwrap();
    // No set is free: 2 and 3 stay queued and must be rejected at their deadline
    // although the worker never frees the set.
    let deadline = Instant::now() + Duration::from_secs(5);
    while host.rejected.lock().unwrap().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(first);
    drop(tx);
    let later: Vec<u32> = brx
        .iter()
        .flat_map(|b| b.members.into_iter().map(|m| m.reply))
        .collect();
    thread.join().unwrap();
    let rejected = host.rejected.lock().unwrap().clone();
    assert_eq!(
        rejected,
        vec![(2, Rejection::Timeout), (3, Rejection::Timeout)]
    );
    assert!(
        later.is_empty(),
        "a timed-out request reached a batch: {later:?}"
    );
}

#[test]
fn places_in_the_queue_bound_are_given_back_when_batched_or_rejected() {
    let admission = crate::Admission::new(3);
    let (tx, rx) = crossbeam_channel::unbounded();
    let (btx, brx) = crossbeam_channel::unbounded();
    let pool =
        kiln_buffers::Pool::new(4, || kiln_buffers::BufferSet::with_capacities(&[64], &[64]));
    let host = Host::default();
    host.cancelled.lock().unwrap().push(2);
    for id in 1..=3 {
        let mut r = req(id);
        r.ticket = Some(admission.try_admit().unwrap());
        tx.send(r).unwrap();
    }
    assert!(
        admission.try_admit().is_none(),
        "the bound counts the channel"
    );
    let config = DynamicConfig::new(8, Duration::from_secs(3600));
    let (p, h) = (Arc::clone(&pool), host.clone());
    drop(tx);
    // Closed: everything goes, asked for or not.
    run_dynamic_batcher(config, 1, rx, p, (btx, Arc::default()), h);
    // The batch is still in flight: its requests hold no place any more, nor
    // does the cancelled one.
    let batches: Vec<_> = brx.try_iter().collect();
    assert_eq!(batches.iter().map(|b| b.len()).sum::<usize>(), 2);
    assert_eq!(admission.queued(), 0);
}

#[test]
fn cancelled_requests_never_reach_a_batch_and_unload_drains_the_rest() {
    let (tx, rx) = crossbeam_channel::unbounded();
    let (btx, brx) = crossbeam_channel::unbounded();
    let pool =
        kiln_buffers::Pool::new(4, || kiln_buffers::BufferSet::with_capacities(&[64], &[64]));
    let host = Host::default();
    host.cancelled.lock().unwrap().push(2);
    // A long delay: nothing is sent until the queue closes.
    let config = DynamicConfig::new(8, Duration::from_secs(3600));
    let (p, h) = (Arc::clone(&pool), host.clone());
    for id in 1..=3 {
        tx.send(req(id)).unwrap();
    }
    let pulls = Arc::new(Pulls::default());
    pulls.ask();
    let outlet = (btx, Arc::clone(&pulls));
    let thread = std::thread::spawn(move || run_dynamic_batcher(config, 1, rx, p, outlet, h));
    std::thread::sleep(Duration::from_millis(20));
    assert!(brx.try_recv().is_err(), "sent before its delay");
    drop(tx);
    thread.join().unwrap();
    let sent: Vec<u32> = brx
        .iter()
        .flat_map(|b| b.members.into_iter().map(|m| m.reply))
        .collect();
    assert_eq!(sent, vec![1, 3]);
    assert_eq!(
        host.rejected.lock().unwrap().clone(),
        vec![(2, Rejection::Cancelled)]
    );
}

/// Waits (at most 5 s) until the batcher has taken everything sent on `tx`.
fn taken(tx: &crossbeam_channel::Sender<Request<u32>>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !tx.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(tx.is_empty(), "the batcher never took the requests");
}

/// #30: Triton's dynamic batcher forms a batch from everything queued when an
/// instance frees up. Requests that come while the only instance runs a batch
/// (each taken into the batcher's queue before the next is sent) leave together
/// when it asks again, not as batches of one formed ahead of it while buffer sets
/// were free (the pool has the 3 sets of a one-instance group).
#[test]
fn requests_queued_while_the_instance_is_busy_leave_as_one_batch() {
    let (tx, rx) = crossbeam_channel::unbounded();
    let (btx, brx) = crossbeam_channel::unbounded();
    let pool =
        kiln_buffers::Pool::new(3, || kiln_buffers::BufferSet::with_capacities(&[64], &[64]));
    let pulls = Arc::new(Pulls::default());
    let (p, h, outlet) = (
        Arc::clone(&pool),
        Host::default(),
        (btx, Arc::clone(&pulls)),
    );
    let config = DynamicConfig::new(8, Duration::ZERO);
    let thread = std::thread::spawn(move || run_dynamic_batcher(config, 1, rx, p, outlet, h));
    // The instance waits: a lone request goes at once.
    pulls.ask();
    tx.send(req(1)).unwrap();
    let first = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(first.len(), 1);
    // It runs `first`; five requests come, one after another.
    for id in 2..=6 {
        tx.send(req(id)).unwrap();
        taken(&tx);
    }
    assert!(
        brx.try_recv().is_err(),
        "a batch was formed while the instance was busy"
    );
    drop(first);
    pulls.ask();
    let second = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    let ids: Vec<u32> = second.members.into_iter().map(|m| m.reply).collect();
    assert_eq!(ids, vec![2, 3, 4, 5, 6], "one batch of everything queued");
    drop(tx);
    thread.join().unwrap();
    assert!(brx.try_recv().is_err());
}
