use super::*;
use bytes::Bytes;
use crossbeam_channel::{bounded, unbounded};
use kiln_worker_sdk::{DataType, Shape};

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use crate::request::Tensor;

fn request(id: u32, dims: &[i64]) -> Request<u32> {
    let shape = Shape::new(dims).unwrap();
    let data: Vec<u8> = (0..shape.element_count() as u32)
        .flat_map(|v| (v + id * 1000).to_le_bytes())
        .collect();
    Request {
        inputs: vec![Tensor {
            dtype: DataType::Uint32,
            shape,
            data: Bytes::from(data),
        }],
        rows: shape.rows(),
        params: Vec::new(),
        arrived: Instant::now(),
        priority: None,
        timeout: None,
        sequence: None,
        ticket: None,
        reply: id,
    }
}

fn config(kind: BatcherKind, batch_size: usize, timeout_ms: u64, ragged: bool) -> BatcherConfig {
    BatcherConfig {
        kind,
        batch_size,
        timeout: Duration::from_millis(timeout_ms),
        gather: true,
        allow_ragged: ragged,
        inputs: 1,
    }
}

/// Sends `reqs`, closes the queue, runs one batcher to the end and returns the
/// batches as (reply ids, rows, input bytes).
fn batch_all(cfg: BatcherConfig, reqs: Vec<Request<u32>>) -> Vec<(Vec<u32>, usize, Vec<u8>)> {
    let (tx, rx) = unbounded();
    let (btx, brx) = unbounded();
    for r in reqs {
        tx.send(r).unwrap();
    }
    drop(tx);
    let pool = Pool::new(64, || BufferSet::with_capacities(&[64], &[64]));
    run_batcher(cfg, rx, pool, btx);
    brx.iter()
        .map(|b| {
            (
                b.members.iter().map(|m| m.reply).collect(),
                b.rows,
                b.buffers.inputs[0].as_slice().to_vec(),
            )
        })
        .collect()
}

#[test]
fn full_batches_in_order() {
    let reqs = (0..8).map(|i| request(i, &[1, 2])).collect();
    let out = batch_all(config(BatcherKind::Soft, 4, 1000, false), reqs);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].0, vec![0, 1, 2, 3]);
    assert_eq!(out[1].0, vec![4, 5, 6, 7]);
    // Each request's tensor lies back to back, in order.
    let words: Vec<u32> = bytemuck_words(&out[1].2);
    assert_eq!(words, vec![4000, 4001, 5000, 5001, 6000, 6001, 7000, 7001]);
}

fn bytemuck_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn soft_sends_partial_batch_on_timeout() {
    let (tx, rx) = unbounded();
    let (btx, brx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let cfg = config(BatcherKind::Soft, 8, 30, false);
    let handle = std::thread::spawn(move || run_batcher(cfg, rx, pool, btx));
    let sent = Instant::now();
    tx.send(request(1, &[1, 1])).unwrap();
    tx.send(request(2, &[1, 1])).unwrap();
    let batch = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    let waited = sent.elapsed();
    assert_eq!(
        batch.members.iter().map(|m| m.reply).collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert!(waited >= Duration::from_millis(30), "sent after {waited:?}");
    drop(tx);
    handle.join().unwrap();
}

#[test]
fn hard_waits_for_a_full_batch() {
    let (tx, rx) = unbounded();
    let (btx, brx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let cfg = config(BatcherKind::Hard, 3, 0, false);
    let handle = std::thread::spawn(move || run_batcher(cfg, rx, pool, btx));
    tx.send(request(1, &[1, 1])).unwrap();
    tx.send(request(2, &[1, 1])).unwrap();
    assert!(brx.recv_timeout(Duration::from_millis(50)).is_err());
    tx.send(request(3, &[1, 1])).unwrap();
    let batch = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(batch.rows, 3);
    // On shutdown a partial hard batch is still sent: nothing accepted is lost.
    tx.send(request(4, &[1, 1])).unwrap();
    drop(tx);
    handle.join().unwrap();
    assert_eq!(brx.recv().unwrap().members[0].reply, 4);
}

#[test]
fn multi_row_request_counts_its_rows_and_is_not_split() {
    let reqs = vec![
        request(0, &[3, 1]),
        request(1, &[2, 1]),
        request(2, &[1, 1]),
    ];
    let out = batch_all(config(BatcherKind::Soft, 4, 0, false), reqs);
    // 3 rows, then 2 would make 5 > 4: the 2-row request starts the next batch.
    assert_eq!(
        out.iter().map(|b| (b.0.clone(), b.1)).collect::<Vec<_>>(),
        vec![(vec![0], 3), (vec![1, 2], 3)]
    );
}

#[test]
fn mismatched_shapes_split_unless_ragged() {
    let reqs = || {
        vec![
            request(0, &[1, 2]),
            request(1, &[1, 3]),
            request(2, &[1, 3]),
        ]
    };
    let strict = batch_all(config(BatcherKind::Soft, 8, 0, false), reqs());
    assert_eq!(
        strict.iter().map(|b| b.0.clone()).collect::<Vec<_>>(),
        vec![vec![0], vec![1, 2]]
    );
    let ragged = batch_all(config(BatcherKind::Soft, 8, 0, true), reqs());
    assert_eq!(ragged.len(), 1);
    assert_eq!(ragged[0].2.len(), (2 + 3 + 3) * 4);
}

#[test]
fn instances_sharing_a_former_form_one_batch_at_a_time() {
    // Hard, 3 rows: two "instances" take turns; however they interleave, the
    // requests are batched in order, three by three, never split between them.
    let (tx, rx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let former = Arc::new(BatchFormer::new(
        config(BatcherKind::Hard, 3, 0, false),
        rx,
        pool,
    ));
    let instances: Vec<_> = (0..2)
        .map(|_| {
            let former = Arc::clone(&former);
            std::thread::spawn(move || {
                let mut ran = Vec::new();
                while let Some(batch) = former.next_batch(&mut (), None) {
                    ran.push(batch.members.iter().map(|m| m.reply).collect::<Vec<_>>());
                }
                ran
            })
        })
        .collect();
    for i in 0..7 {
        tx.send(request(i, &[1, 1])).unwrap();
    }
    // Closed: the partial last batch is still formed, then both instances end.
    drop(tx);
    let mut batches: Vec<Vec<u32>> = instances
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    batches.sort();
    assert_eq!(batches, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
}

#[test]
fn former_carries_a_misfit_into_the_next_batch() {
    let (tx, rx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let former = BatchFormer::new(config(BatcherKind::Soft, 8, 0, false), rx, pool);
    for (i, dims) in [[1, 2], [1, 3], [1, 3]].iter().enumerate() {
        tx.send(request(i as u32, dims)).unwrap();
    }
    drop(tx);
    let ids = |b: Batch<u32>| b.members.iter().map(|m| m.reply).collect::<Vec<_>>();
    assert_eq!(former.next_batch(&mut (), None).map(ids), Some(vec![0]));
    assert_eq!(former.next_batch(&mut (), None).map(ids), Some(vec![1, 2]));
    assert!(former.next_batch(&mut (), None).is_none());
}

#[test]
fn a_screen_leaves_requests_out_of_the_batch_and_gives_their_set_back() {
    let (tx, rx) = unbounded();
    // One set: the first request left out must give it back for the batch.
    let pool = Pool::new(1, || BufferSet::with_capacities(&[64], &[64]));
    let left_out = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&left_out);
    let former = BatchFormer::new(config(BatcherKind::Dynamic, 8, 0, false), rx, pool).with_screen(
        Box::new(move |r: Request<u32>| {
            if r.reply % 2 == 1 {
                seen.lock().unwrap().push(r.reply);
                return None;
            }
            Some(r)
        }),
    );
    for id in 1..=5 {
        tx.send(request(id, &[1, 2])).unwrap();
    }
    drop(tx);
    let ids = |b: Batch<u32>| b.members.iter().map(|m| m.reply).collect::<Vec<_>>();
    assert_eq!(former.next_batch(&mut (), None).map(ids), Some(vec![2, 4]));
    assert!(former.next_batch(&mut (), None).is_none());
    assert_eq!(*left_out.lock().unwrap(), [1, 3, 5]);
}

#[test]
fn a_stop_ends_the_wait_and_is_seen_between_batches() {
    let (tx, rx) = unbounded();
    let (stop_tx, stop_rx) = unbounded::<()>();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let former = Arc::new(BatchFormer::new(
        config(BatcherKind::Soft, 1, 0, false),
        rx,
        pool,
    ));
    // Waiting for a first request: the stop ends the wait, nothing taken.
    let waiting = {
        let (former, stop) = (Arc::clone(&former), stop_rx.clone());
        std::thread::spawn(move || former.next_batch(&mut (), Some(&stop)).is_none())
    };
    while former.turn.try_lock().is_some() {
        std::thread::yield_now();
    }
    stop_tx.send(()).unwrap();
    assert!(waiting.join().unwrap());
    // A request ready and a stop too: the stop is seen first (between batches),
    // and the request is left for the next caller.
    tx.send(request(0, &[1, 1])).unwrap();
    stop_tx.send(()).unwrap();
    assert!(former.next_batch(&mut (), Some(&stop_rx)).is_none());
    let ids = |b: Batch<u32>| b.members.iter().map(|m| m.reply).collect::<Vec<_>>();
    assert_eq!(
        former.next_batch(&mut (), Some(&stop_rx)).map(ids),
        Some(vec![0])
    );
    // Without a stop, an item ready at once or later is taken as before.
    let (items, items_rx) = unbounded();
    items.send(5u32).unwrap();
    assert_eq!(
        wait_for_first_or_stop(&items_rx, &mut (), Some(&stop_rx)),
        Some(5)
    );
    drop(stop_tx);
    // A stop channel disconnected (its group gone) stops the wait too.
    assert_eq!(
        wait_for_first_or_stop(&items_rx, &mut (), Some(&stop_rx)),
        None
    );
}

/// An idle hook a test watches from outside: counts what it is told, and holds
/// something (once told to) until it has lingered.
#[derive(Clone, Default)]
struct Watched(Arc<Seen>);

#[derive(Default)]
struct Seen {
    idle: AtomicUsize,
    lingered: AtomicUsize,
    holds: AtomicBool,
}

impl Watched {
    /// Times it was told it is idle, and told it lingered.
    fn told(&self) -> (usize, usize) {
        (self.0.idle.load(SeqCst), self.0.lingered.load(SeqCst))
    }

    fn hold(&self) {
        self.0.holds.store(true, SeqCst);
    }

    /// Waits (up to 10 s) until it has been told `(idle, lingered)` at least.
    fn wait_told(&self, idle: usize, lingered: usize) {
        let from = Instant::now();
        while {
            let (i, l) = self.told();
            (i < idle || l < lingered) && from.elapsed() < Duration::from_secs(10)
        } {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends `item` on `tx` from another thread once told `told` (see
    /// [`Watched::wait_told`]); the thread gives `tx` back.
    fn send_when_told<T: Send + 'static>(
        &self,
        (idle, lingered): (usize, usize),
        tx: crossbeam_channel::Sender<T>,
        item: T,
    ) -> std::thread::JoinHandle<crossbeam_channel::Sender<T>> {
        let hook = self.clone();
        std::thread::spawn(move || {
            hook.wait_told(idle, lingered);
            tx.send(item).unwrap_or_else(|_| panic!("receiver gone"));
            tx
        })
    }
}

impl Idle for Watched {
    fn idle(&mut self) -> bool {
        self.0.idle.fetch_add(1, SeqCst);
        self.0.holds.load(SeqCst)
    }

    fn lingered(&mut self) {
        self.0.lingered.fetch_add(1, SeqCst);
        self.0.holds.store(false, SeqCst);
    }

    fn held(&mut self, _: usize) -> usize {
        0
    }
}

/// Callers that hold `.0` answers; `.1` counts the times they were asked.
struct Holding(usize, usize);

impl Idle for Holding {
    fn idle(&mut self) -> bool {
        false
    }

    fn lingered(&mut self) {}

    fn held(&mut self, enough: usize) -> usize {
        self.1 += 1;
        self.0.min(enough)
    }
}

#[test]
fn a_hard_batch_larger_than_the_queue_bound_still_fills() {
    // The former gives its members' places back before it waits for more: with
    // them held, the bound (2) would stay full and the batch (4) never fill.
    let admission = crate::Admission::new(2);
    let (tx, rx) = unbounded();
    let pool = Pool::new(2, || BufferSet::with_capacities(&[64], &[64]));
    let sender = {
        let admission = Arc::clone(&admission);
        std::thread::spawn(move || {
            for id in 0..4 {
                let from = Instant::now();
                let ticket = loop {
                    match admission.try_admit() {
                        Some(ticket) => break ticket,
                        None if from.elapsed() < Duration::from_secs(10) => {
                            std::thread::sleep(Duration::from_millis(1))
                        }
                        None => panic!("request {id} was never admitted"),
                    }
                };
                let mut r = request(id, &[1, 1]);
                r.ticket = Some(ticket);
                tx.send(r).unwrap();
            }
        })
    };
    let config = config(BatcherKind::Hard, 4, 0, false);
    let batch = form_batch(&config, &rx, &pool, &mut None, &mut ()).unwrap();
    sender.join().unwrap();
    assert_eq!(batch.len(), 4);
    assert_eq!(admission.queued(), 0, "every place given back");
}

#[test]
fn a_batcher_that_may_not_gather_never_asks() {
    let (tx, rx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let mut config = config(BatcherKind::Soft, 8, 0, false);
    let mut callers = Holding(100, 0);
    for gather in [false, true] {
        config.gather = gather;
        for i in 0..3 {
            tx.send(request(i, &[1, 1])).unwrap();
        }
        let batch = form_batch(&config, &rx, &pool, &mut None, &mut callers).unwrap();
        assert_eq!(batch.len(), 3);
        assert_eq!(callers.1, usize::from(gather), "gather = {gather}");
    }
}

#[test]
fn batches_gather_only_while_callers_fall_behind() {
    assert_eq!(gather_target(0, 64), None);
    assert_eq!(gather_target(GATHER_FROM_HELD - 1, 64), None);
    assert_eq!(
        gather_target(GATHER_FROM_HELD, 64),
        Some(GATHER_FROM_HELD / 2)
    );
    assert_eq!(gather_target(100, 64), Some(50));
    assert_eq!(gather_target(1000, 64), Some(64));
}

#[test]
fn a_gathering_batch_takes_what_came_and_stops_when_nothing_more_does() {
    let (tx, rx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let config = config(BatcherKind::Soft, 8, 0, false);
    let ids = |b: Batch<u32>| b.members.iter().map(|m| m.reply).collect::<Vec<_>>();
    for i in 0..3 {
        tx.send(request(i, &[1, 1])).unwrap();
    }
    // Callers far behind: the batch would gather 8, but no more come.
    let mut carried = None;
    let batch = form_batch(&config, &rx, &pool, &mut carried, &mut Holding(100, 0));
    assert_eq!(batch.map(ids), Some(vec![0, 1, 2]));
    // Enough queued already: taken at once, the rest left for the next batch.
    for i in 3..12 {
        tx.send(request(i, &[1, 1])).unwrap();
    }
    let batch = form_batch(&config, &rx, &pool, &mut carried, &mut Holding(100, 0));
    assert_eq!(batch.map(ids), Some((3..11).collect()));
    // Callers keeping up: what is queued goes at once.
    let batch = form_batch(&config, &rx, &pool, &mut carried, &mut Holding(2, 0));
    assert_eq!(batch.map(ids), Some(vec![11]));
    drop(tx);
    assert!(form_batch(&config, &rx, &pool, &mut carried, &mut Holding(100, 0)).is_none());
}

#[test]
fn the_idle_hook_hears_only_of_waits() {
    let (tx, rx) = unbounded();
    let hook = Watched::default();
    tx.send(1).unwrap();
    assert_eq!(wait_for_first(&rx, &mut hook.clone()), Some(1));
    assert_eq!(hook.told(), (0, 0), "a request was ready");
    // Nothing held: no lingering, the wait is for the next request alone.
    let sender = hook.send_when_told((1, 0), tx, 2);
    assert_eq!(wait_for_first(&rx, &mut hook.clone()), Some(2));
    assert_eq!(hook.told(), (1, 0));
    // Disconnected and drained: nothing to wait for.
    drop(sender.join().unwrap());
    assert_eq!(wait_for_first(&rx, &mut hook.clone()), None);
    assert_eq!(hook.told(), (1, 0));
    // Something held and nothing comes: let go after the linger, then wait on.
    let (tx, rx) = unbounded();
    hook.hold();
    let sender = hook.send_when_told((2, 1), tx, 3);
    assert_eq!(wait_for_first(&rx, &mut hook.clone()), Some(3));
    assert_eq!(hook.told(), (2, 1));
    sender.join().unwrap();
}

#[test]
fn an_instance_waiting_for_the_turn_is_idle_too() {
    let (tx, rx) = unbounded();
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64], &[64]));
    let former = Arc::new(BatchFormer::new(
        config(BatcherKind::Soft, 1, 0, false),
        rx,
        pool,
    ));
    // One instance takes the turn and waits for a request.
    let first = {
        let former = Arc::clone(&former);
        std::thread::spawn(move || former.next_batch(&mut (), None).map(|b| b.members[0].reply))
    };
    while former.turn.try_lock().is_some() {
        std::thread::yield_now();
    }
    // The other, waiting for the turn with something held, lets go of it.
    let hook = Watched::default();
    hook.hold();
    let second = {
        let (former, mut hook) = (Arc::clone(&former), hook.clone());
        std::thread::spawn(move || {
            former
                .next_batch(&mut hook, None)
                .map(|b| b.members[0].reply)
        })
    };
    hook.wait_told(1, 1);
    tx.send(request(0, &[1, 1])).unwrap();
    tx.send(request(1, &[1, 1])).unwrap();
    assert_eq!(first.join().unwrap(), Some(0));
    assert_eq!(second.join().unwrap(), Some(1));
    assert_eq!(hook.told().1, 1);
}

#[test]
fn a_batch_keeps_small_inputs_for_the_answer_and_lets_large_ones_go() {
    let pool = Pool::new(1, || BufferSet::with_capacities(&[64], &[64]));
    let mut batch = Batch::new(pool.acquire(), 1, 2);
    batch.push(request(0, &[1, 16]));
    let large = (crate::KEEP_INPUTS_UP_TO / 4 + 1) as i64;
    batch.push(request(1, &[1, large]));
    assert_eq!(batch.members[0].inputs.len(), 1);
    assert!(batch.members[1].inputs.is_empty());
    // Copied in either way.
    assert_eq!(batch.buffers.inputs[0].len(), 4 * (16 + large as usize));
}

#[test]
fn pool_bounds_batches_in_flight() {
    let (tx, rx) = bounded(64);
    let (btx, brx) = unbounded();
    let pool = Pool::new(2, || BufferSet::with_capacities(&[64], &[64]));
    let p = Arc::clone(&pool);
    let handle =
        std::thread::spawn(move || run_batcher(config(BatcherKind::Soft, 1, 0, false), rx, p, btx));
    for i in 0..5 {
        tx.send(request(i, &[1, 1])).unwrap();
    }
    let first = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    let second = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    // Both sets are out: the batcher blocks until one comes back.
    assert!(brx.recv_timeout(Duration::from_millis(50)).is_err());
    assert_eq!(pool.in_use(), 2);
    drop(first);
    let third = brx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(third.members[0].reply, 2);
    drop((second, third));
    drop(tx);
    let rest: Vec<_> = brx.iter().map(|b| b.members[0].reply).collect();
    assert_eq!(rest, vec![3, 4]);
    handle.join().unwrap();
}
