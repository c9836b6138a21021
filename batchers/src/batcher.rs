//! The batcher loop: one thread of a group's batcher group.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use kiln_buffers::{BufferSet, Pool};
use kiln_worker_sdk::BatcherKind;
use parking_lot::Mutex;

use crate::batch::Batch;
use crate::request::Request;

/// How a batcher forms batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatcherConfig {
    pub kind: BatcherKind,
    /// Most rows per batch (hard: exactly this many).
    pub batch_size: usize,
    /// Soft batcher: how long after the first request's arrival a partial batch waits.
    pub timeout: Duration,
    /// Soft batcher with no timeout: whether a batch gathers while the callers fall
    /// behind ([`gather_target`]).
    pub gather: bool,
    /// Whether requests with different non-batch dimensions may share a batch.
    pub allow_ragged: bool,
    /// Number of inputs the worker declares.
    pub inputs: usize,
}

/// Runs one batcher until `requests` is disconnected and drained. Every request
/// taken is put in a batch; every batch formed is sent to `batches` (a send fails
/// only when no worker is left, and then the batch, with its replies, is dropped).
pub fn run_batcher<R>(
    config: BatcherConfig,
    requests: Receiver<Request<R>>,
    pool: Arc<Pool<BufferSet>>,
    batches: Sender<Batch<R>>,
) {
    let mut carried: Option<Request<R>> = None;
    while let Some(batch) = form_batch(&config, &requests, &pool, &mut carried, &mut ()) {
        if batches.send(batch).is_err() {
            return;
        }
    }
}

/// Forms the next batch from `requests` by `config`'s policy: waits for a first
/// request (`carried`, the request a previous batch could not take, comes first),
/// lets more gather when a soft batcher with no timeout found it waiting while its
/// callers fall behind ([`gather_target`]), then waits for a buffer set from `pool`
/// and adds requests while they fit until the policy fires. `None` once `requests` is disconnected and drained; a request that
/// does not fit is left in `carried` for the next batch. `idle` is told when no
/// request is ready (see [`Idle`]).
pub fn form_batch<R>(
    config: &BatcherConfig,
    requests: &Receiver<Request<R>>,
    pool: &Arc<Pool<BufferSet>>,
    carried: &mut Option<Request<R>>,
    idle: &mut dyn Idle,
) -> Option<Batch<R>> {
    form_batch_or_stop(config, requests, pool, carried, idle, None)
}

/// [`form_batch`], also ending (`None`, nothing taken) when a message or the
/// disconnection of `stop` comes while it waits for a first request.
fn form_batch_or_stop<R>(
    config: &BatcherConfig,
    requests: &Receiver<Request<R>>,
    pool: &Arc<Pool<BufferSet>>,
    carried: &mut Option<Request<R>>,
    idle: &mut dyn Idle,
    stop: Option<&Receiver<()>>,
) -> Option<Batch<R>> {
    let batch_size = config.batch_size.max(1);
    // Busy: a request was waiting already (none had to be waited for).
    let (first, busy) = match carried.take() {
        Some(request) => (request, true),
        None => match requests.try_recv() {
            Ok(request) => (request, true),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => (wait_for_first_or_stop(requests, idle, stop)?, false),
        },
    };
    if busy && config.gather && config.kind == BatcherKind::Soft && config.timeout.is_zero() {
        if let Some(target) = gather_target(idle.held(2 * batch_size), batch_size) {
            gather(requests, target);
        }
    }
    let deadline = first.arrived + config.timeout;
    let mut batch = Batch::new(pool.acquire(), config.inputs, batch_size.min(256));
    batch.push(first);
    while batch.rows < batch_size {
        let next = match requests.try_recv() {
            Ok(request) => Ok(request),
            Err(_) => match config.kind {
                BatcherKind::Hard => {
                    // Waiting with places held could leave the bound full and the
                    // batch never filled.
                    batch.release_places();
                    requests.recv().map_err(|_| RecvTimeoutError::Disconnected)
                }
                // The dynamic and sequence batchers have their own loops; given to
                // this one, they behave as soft.
                BatcherKind::Soft | BatcherKind::Dynamic | BatcherKind::Sequence => {
                    batch.release_places();
                    recv_until(requests, deadline)
                }
            },
        };
        match next {
            Ok(request) if batch.accepts(&request, batch_size, config.allow_ragged) => {
                batch.push(request)
            }
            Ok(request) => {
                *carried = Some(request);
                break;
            }
            Err(_) => break,
        }
    }
    batch.release_places();
    Some(batch)
}

/// A hard or soft batcher without a thread of its own: the instance threads that
/// share it take turns forming batches, each for itself
/// ([`BatchFormer::next_batch`]). One batch is in formation at a time, as with
/// one batcher thread, so the policy and the order of requests are the same; what
/// goes away is the hand-off of each batch to an instance thread (a wake-up per
/// batch) and the batcher thread itself. A group with `batchers` = N has N formers,
/// instance `i` taking its turns on former `i % N`.
pub struct BatchFormer<R> {
    config: BatcherConfig,
    requests: Receiver<Request<R>>,
    pool: Arc<Pool<BufferSet>>,
    /// The turn to form a batch, with the request a previous batch could not take.
    turn: Mutex<Option<Request<R>>>,
}

impl<R> BatchFormer<R> {
    /// A former over a group's request queue and buffer pool.
    pub fn new(
        config: BatcherConfig,
        requests: Receiver<Request<R>>,
        pool: Arc<Pool<BufferSet>>,
    ) -> BatchFormer<R> {
        BatchFormer {
            config,
            requests,
            pool,
            turn: Mutex::new(None),
        }
    }

    /// Waits for the turn, then forms a batch ([`form_batch`]) for the caller to run;
    /// `idle` is told when no request is ready. `None` once the request queue is
    /// disconnected and drained, or when the caller is to stop: a message on `stop`
    /// found with the turn taken and no request carried (so a former whose every
    /// instance stopped holds no request), or coming while it waits for a first
    /// request.
    pub fn next_batch(&self, idle: &mut dyn Idle, stop: Option<&Receiver<()>>) -> Option<Batch<R>> {
        // Waiting for another instance to finish forming is waiting for work too.
        let mut carried = match self.turn.try_lock() {
            Some(turn) => turn,
            None if idle.idle() => self.turn.try_lock_for(IDLE_LINGER).unwrap_or_else(|| {
                idle.lingered();
                self.turn.lock()
            }),
            None => self.turn.lock(),
        };
        if carried.is_none() && stop.is_some_and(|stop| stop.try_recv().is_ok()) {
            return None;
        }
        form_batch_or_stop(
            &self.config,
            &self.requests,
            &self.pool,
            &mut carried,
            idle,
            stop,
        )
    }
}

/// What a thread that waits for work does meanwhile with what it holds (an
/// instance thread frees its batches' outputs there, see kiln-core's `reply`).
pub trait Idle {
    /// Nothing is ready and the thread is about to wait; returns whether it still
    /// holds something to let go of should the wait last [`IDLE_LINGER`].
    fn idle(&mut self) -> bool;

    /// The thread waited [`IDLE_LINGER`] and nothing came.
    fn lingered(&mut self);

    /// How many of the answers this thread gave their callers still hold (counted
    /// up to `enough`): many means the callers, not this thread, are what limits
    /// throughput (see [`gather_target`]).
    fn held(&mut self, enough: usize) -> usize;
}

/// How long a thread that still holds something ([`Idle::idle`]) waits for work
/// before [`Idle::lingered`].
pub const IDLE_LINGER: Duration = Duration::from_millis(10);

/// Holds nothing.
impl Idle for () {
    fn idle(&mut self) -> bool {
        false
    }

    fn lingered(&mut self) {}

    fn held(&mut self, _: usize) -> usize {
        0
    }
}

/// Answers held by callers from which a soft batcher with no timeout, finding
/// requests already waiting, gathers a larger batch ([`gather_target`]).
pub const GATHER_FROM_HELD: usize = 16;

/// How often a gathering batcher looks at the queue, and how long without a new
/// request ends the gathering.
pub const GATHER_GAP: Duration = Duration::from_micros(5);

/// The longest a batch is gathered.
pub const GATHER_MOST: Duration = Duration::from_micros(60);

/// How many requests a soft batcher with no timeout waits to have queued before it
/// forms a batch, given that callers still hold `held` of its answers; `None`:
/// it takes what is queued at once.
///
/// When the callers hold many answers they have not got to yet, they are what
/// limits throughput: a batch of the requests that happen to be queued (two or
/// three, as each is answered nearly as soon as it arrives) costs them a batch's
/// worth of work per few requests. So the batcher lets half as many as they hold
/// gather first (at most a batch): they keep the other half to work on meanwhile,
/// and the batches grow until the callers no longer fall behind. With callers that
/// keep up (few answers held) nothing waits, so a lone request or light load sees
/// no added delay.
pub fn gather_target(held: usize, batch_size: usize) -> Option<usize> {
    (held >= GATHER_FROM_HELD).then(|| (held / 2).min(batch_size))
}

/// Lets requests gather until `target` are queued (counting the one already taken),
/// no request came for [`GATHER_GAP`], or [`GATHER_MOST`] has passed. The queue's
/// length is looked at once per gap only: the callers write its counters, and
/// reading them more often would make each of their sends wait for the line.
fn gather<T>(requests: &Receiver<T>, target: usize) {
    let start = Instant::now();
    let mut queued = requests.len() + 1;
    let mut looked = start;
    while queued < target {
        std::thread::yield_now();
        let now = Instant::now();
        if now.duration_since(start) >= GATHER_MOST {
            return;
        }
        if now.duration_since(looked) < GATHER_GAP {
            continue;
        }
        looked = now;
        let now_queued = requests.len() + 1;
        if now_queued == queued {
            return;
        }
        queued = now_queued;
    }
}

/// The next item of `rx`, telling `idle` first when none is ready at once; `None`
/// once `rx` is disconnected and drained.
pub fn wait_for_first<T>(rx: &Receiver<T>, idle: &mut dyn Idle) -> Option<T> {
    wait_for_first_or_stop(rx, idle, None)
}

/// How often a thread waiting for work with a `stop` channel looks at it while
/// nothing comes: a scaled-down instance that waits leaves within this.
///
/// Not `select!` over both channels: that parked and woke the waiting instance
/// about four times as often under load (release, HTTP echo at 32 clients, 6 s:
/// 29.9k voluntary switches of the worker thread against 7.3k, and about 12 %
/// fewer requests a second in `scripts/bench-ab`), because a select registers
/// with both channels and parks where a plain receive spins a while first. An
/// idle instance pays one wake-up per `LEAVE_POLL` instead; none per request.
pub const LEAVE_POLL: Duration = Duration::from_millis(100);

/// [`wait_for_first`], also ending (`None`) when a message comes on `stop`, or
/// `stop` is disconnected, while it waits (seen within [`LEAVE_POLL`]): a worker
/// instance told to leave (a group scaled down) stops waiting for work. Only the
/// wait itself watches `stop`; an item ready at once is taken as before.
pub fn wait_for_first_or_stop<T>(
    rx: &Receiver<T>,
    idle: &mut dyn Idle,
    stop: Option<&Receiver<()>>,
) -> Option<T> {
    match rx.try_recv() {
        Ok(item) => return Some(item),
        Err(TryRecvError::Disconnected) => return None,
        Err(TryRecvError::Empty) => {}
    }
    if idle.idle() {
        match rx.recv_timeout(IDLE_LINGER) {
            Ok(item) => return Some(item),
            Err(RecvTimeoutError::Disconnected) => return None,
            Err(RecvTimeoutError::Timeout) => idle.lingered(),
        }
    }
    let Some(stop) = stop else {
        return rx.recv().ok();
    };
    loop {
        // A message, or the sender gone with the group: leave.
        if !matches!(stop.try_recv(), Err(TryRecvError::Empty)) {
            return None;
        }
        match rx.recv_timeout(LEAVE_POLL) {
            Ok(item) => return Some(item),
            Err(RecvTimeoutError::Disconnected) => return None,
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

fn recv_until<T>(rx: &Receiver<T>, deadline: Instant) -> Result<T, RecvTimeoutError> {
    if Instant::now() >= deadline {
        return Err(RecvTimeoutError::Timeout);
    }
    rx.recv_deadline(deadline)
}

#[cfg(test)]
mod tests {
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

    fn config(
        kind: BatcherKind,
        batch_size: usize,
        timeout_ms: u64,
        ragged: bool,
    ) -> BatcherConfig {
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
        let handle = std::thread::spawn(move || {
            run_batcher(config(BatcherKind::Soft, 1, 0, false), rx, p, btx)
        });
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
}
