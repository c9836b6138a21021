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
    form_batch_or_stop(config, requests, pool, carried, idle, None, None)
}

/// Looks at each request as it is taken into a batch: gives it back to be batched,
/// or keeps it (having answered it) to leave it out. A dynamic batcher formed on
/// the instances' turns leaves out requests whose client went away.
pub type Screen<R> = Box<dyn Fn(Request<R>) -> Option<Request<R>> + Send + Sync>;

/// [`form_batch`], also ending (`None`, nothing taken) when a message or the
/// disconnection of `stop` comes while it waits for a first request, and leaving
/// out the requests `screen` keeps.
fn form_batch_or_stop<R>(
    config: &BatcherConfig,
    requests: &Receiver<Request<R>>,
    pool: &Arc<Pool<BufferSet>>,
    carried: &mut Option<Request<R>>,
    idle: &mut dyn Idle,
    stop: Option<&Receiver<()>>,
    screen: Option<&Screen<R>>,
) -> Option<Batch<R>> {
    let batch_size = config.batch_size.max(1);
    let pass = |request: Request<R>| match screen {
        Some(screen) => screen(request),
        None => Some(request),
    };
    let (first, mut batch) = loop {
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
        let buffers = pool.acquire();
        // Screened once its buffer set is secured: a client that leaves while the
        // request waits for one is still seen. One left out gives the set back.
        if let Some(first) = pass(first) {
            break (
                first,
                Batch::new(buffers, config.inputs, batch_size.min(256)),
            );
        }
    };
    let deadline = first.arrived + config.timeout;
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
                if let Some(request) = pass(request) {
                    batch.push(request)
                }
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

/// A hard or soft batcher, or a plain dynamic one, without a thread of its own:
/// the instance threads that share it take turns forming batches, each for itself
/// ([`BatchFormer::next_batch`]). One batch is in formation at a time, as with
/// one batcher thread, so the policy and the order of requests are the same; what
/// goes away is the hand-off of each batch to an instance thread (a wake-up per
/// batch) and the batcher thread itself. A group with `batchers` = N has N formers,
/// instance `i` taking its turns on former `i % N`.
pub struct BatchFormer<R> {
    config: BatcherConfig,
    requests: Receiver<Request<R>>,
    pool: Arc<Pool<BufferSet>>,
    /// What leaves out requests as they are taken ([`Screen`]).
    screen: Option<Screen<R>>,
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
            screen: None,
            turn: Mutex::new(None),
        }
    }

    /// This former, leaving out the requests `screen` keeps as it takes them.
    pub fn with_screen(self, screen: Screen<R>) -> BatchFormer<R> {
        BatchFormer {
            screen: Some(screen),
            ..self
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
            self.screen.as_ref(),
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
mod tests;
