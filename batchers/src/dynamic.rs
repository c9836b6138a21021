//! Triton's dynamic batching policy as a pure queue: every decision takes `now`, so
//! each rule is tested with a fake clock and the batcher thread only supplies time.
//!
//! - Requests wait in one FIFO queue per priority level (1 is the highest); levels
//!   are served strictly in order, and requests whose timeout passed with the DELAY
//!   action come after every other request.
//! - A batch is the longest run of queued requests, in that order, that fits
//!   `max_batch_size` rows, `max_batch_bytes` and (unless ragged) one shape.
//! - It is sent at once when it is full (or can no longer grow), or when it reaches a
//!   preferred size (the largest one it reaches: chosen greedily), or when the oldest
//!   request has waited `max_queue_delay`, or when waiting longer would make one of
//!   its requests miss its deadline given the current compute-time estimate.
//! - A request whose deadline passes while queued is taken out at that moment:
//!   answered (REJECT) or moved behind the others (DELAY). It never reaches a worker
//!   after its REJECT deadline.
//! - The batcher thread ([`run_dynamic_batcher`]) sends a batch only when an
//!   instance asks for one ([`pull`]): while every instance is busy the queue
//!   grows, and the instance that frees up gets everything queued, as Triton's.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::request::Request;

pub mod pull;
pub use pull::Pulls;

/// What happens to a request whose queue timeout expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutAction {
    /// Answer it with a timeout error.
    Reject,
    /// Keep it, behind every request that has not timed out.
    Delay,
}

/// The queue policy of one priority level.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicy {
    /// Requests queued at this level before new ones are refused (0: no limit
    /// beyond the group's queue).
    pub max_queue_size: usize,
    /// Timeout from arrival (none: wait forever).
    pub default_timeout: Option<Duration>,
    /// Whether a request's own `timeout` may replace the default (only shorter).
    pub allow_timeout_override: bool,
    pub timeout_action: TimeoutAction,
}

impl Default for QueuePolicy {
    fn default() -> Self {
        QueuePolicy {
            max_queue_size: 0,
            default_timeout: None,
            allow_timeout_override: true,
            timeout_action: TimeoutAction::Reject,
        }
    }
}

/// The dynamic batcher's settings (Triton's `dynamic_batching`).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicConfig {
    /// Most rows per batch.
    pub max_batch_size: usize,
    /// Batch sizes (rows) worth sending at once, ascending.
    pub preferred_batch_sizes: Vec<usize>,
    /// How long the oldest request may wait for a fuller batch.
    pub max_queue_delay: Duration,
    /// Most input bytes per batch (a cost limit besides rows).
    pub max_batch_bytes: Option<usize>,
    /// Priority levels (1 highest); at least 1.
    pub priority_levels: usize,
    /// Level of requests that name none.
    pub default_priority_level: usize,
    /// Queue policy per level (index 0 is level 1); missing levels use the last.
    pub policies: Vec<QueuePolicy>,
    /// Whether requests of different non-batch shapes may share a batch.
    pub allow_ragged: bool,
    /// Answers leave in the order their batches were formed (kept by the host, not
    /// the queue).
    pub preserve_ordering: bool,
}

impl DynamicConfig {
    /// A config with one level and no preferred sizes.
    pub fn new(max_batch_size: usize, max_queue_delay: Duration) -> DynamicConfig {
        DynamicConfig {
            max_batch_size,
            preferred_batch_sizes: Vec::new(),
            max_queue_delay,
            max_batch_bytes: None,
            priority_levels: 1,
            default_priority_level: 1,
            policies: vec![QueuePolicy::default()],
            allow_ragged: false,
            preserve_ordering: false,
        }
    }

    /// Whether nothing in this config needs a scheduler thread: no delay, no
    /// preferred sizes, no byte limit, one level and no queue policy that can end a
    /// request's place (a timeout, a level's own bound), and no answers held in
    /// order. Then a batch is what is queued when an instance is free, up to
    /// `max_batch_size` rows of one shape: what an instance forming its own batch
    /// does ([`crate::BatchFormer`]), with the requests whose client went away
    /// left out.
    pub fn is_plain(&self) -> bool {
        self.max_queue_delay.is_zero()
            && self.preferred_batch_sizes.is_empty()
            && self.max_batch_bytes.is_none()
            && self.priority_levels <= 1
            && !self.preserve_ordering
            && self.policies.iter().all(|p| {
                p.max_queue_size == 0 && p.default_timeout.is_none() && !p.allow_timeout_override
            })
    }

    /// The level a request naming `priority` queues at (`None` or 0: the default);
    /// `None` when that is not one of the levels.
    pub fn level(&self, priority: Option<u32>) -> Option<usize> {
        let level = match priority {
            None | Some(0) => self.default_priority_level,
            Some(p) => p as usize,
        };
        (1..=self.priority_levels).contains(&level).then_some(level)
    }

    fn policy(&self, level: usize) -> &QueuePolicy {
        static DEFAULT: std::sync::OnceLock<QueuePolicy> = std::sync::OnceLock::new();
        self.policies
            .get(level.saturating_sub(1))
            .or(self.policies.last())
            .unwrap_or_else(|| DEFAULT.get_or_init(QueuePolicy::default))
    }
}

/// Why a request left the queue without being batched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Its level's queue was full.
    QueueFull,
    /// Its priority is not a level of this model.
    BadPriority,
    /// Its timeout passed while queued (REJECT).
    Timeout,
    /// Its client went away.
    Cancelled,
}

/// What the queue wants next.
#[derive(Debug)]
pub enum Poll<R> {
    /// Send these requests as one batch now.
    Batch(Vec<Request<R>>),
    /// Nothing to send before this instant (or before a new request, if `None`).
    Wait(Option<Instant>),
}

struct Queued<R> {
    request: Request<R>,
    deadline: Option<Instant>,
    bytes: usize,
}

/// The dynamic batcher's queue.
pub struct DynamicQueue<R> {
    config: DynamicConfig,
    /// One FIFO per level, then (last) the delayed requests.
    levels: Vec<VecDeque<Queued<R>>>,
    /// Expected run time of a batch, for deadline-aware sending.
    compute_estimate: Duration,
}

impl<R> DynamicQueue<R> {
    /// An empty queue.
    pub fn new(config: DynamicConfig) -> DynamicQueue<R> {
        let levels = (0..=config.priority_levels.max(1))
            .map(|_| VecDeque::new())
            .collect();
        DynamicQueue {
            config,
            levels,
            compute_estimate: Duration::ZERO,
        }
    }

    /// The settings.
    pub fn config(&self) -> &DynamicConfig {
        &self.config
    }

    /// Requests queued.
    pub fn len(&self) -> usize {
        self.levels.iter().map(VecDeque::len).sum()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.levels.iter().all(VecDeque::is_empty)
    }

    /// Updates the expected batch run time (the batcher feeds it measurements).
    pub fn set_compute_estimate(&mut self, estimate: Duration) {
        self.compute_estimate = estimate;
    }

    /// Queues `request` at its priority level (`request.priority`, or the default),
    /// with its deadline from the level's policy and the request's own timeout.
    // A refused request goes back whole, so its host can answer it: the large `Err`
    // is the request itself, moved, not a copy or an allocation.
    #[allow(clippy::result_large_err)]
    pub fn admit(
        &mut self,
        request: Request<R>,
        _now: Instant,
    ) -> Result<(), (Request<R>, Rejection)> {
        let Some(level) = self.config.level(request.priority) else {
            return Err((request, Rejection::BadPriority));
        };
        let policy = self.config.policy(level);
        let queue = &self.levels[level - 1];
        if policy.max_queue_size > 0 && queue.len() >= policy.max_queue_size {
            return Err((request, Rejection::QueueFull));
        }
        let timeout = match (policy.default_timeout, request.timeout) {
            (default, Some(own)) if policy.allow_timeout_override => {
                Some(default.map_or(own, |d| d.min(own)))
            }
            (default, _) => default,
        };
        let deadline = timeout.map(|t| request.arrived + t);
        let bytes = request.inputs.iter().map(|t| t.data.len()).sum();
        self.levels[level - 1].push_back(Queued {
            request,
            deadline,
            bytes,
        });
        Ok(())
    }

    /// Takes out every request whose deadline has passed: REJECT ones are returned,
    /// DELAY ones move behind all others (and keep no deadline).
    pub fn expire(&mut self, now: Instant) -> Vec<Request<R>> {
        let mut rejected = Vec::new();
        let delayed_index = self.levels.len() - 1;
        for level in 0..delayed_index {
            let action = self.config.policy(level + 1).timeout_action;
            let queue = std::mem::take(&mut self.levels[level]);
            for mut q in queue {
                match q.deadline {
                    Some(d) if d <= now => match action {
                        TimeoutAction::Reject => rejected.push(q.request),
                        TimeoutAction::Delay => {
                            q.deadline = None;
                            self.levels[delayed_index].push_back(q);
                        }
                    },
                    _ => self.levels[level].push_back(q),
                }
            }
        }
        rejected
    }

    /// Takes out every request whose client is gone.
    pub fn cancel(&mut self, is_cancelled: impl Fn(&R) -> bool) -> Vec<Request<R>> {
        let mut cancelled = Vec::new();
        for queue in &mut self.levels {
            if !queue.iter().any(|q| is_cancelled(&q.request.reply)) {
                continue;
            }
            let all = std::mem::take(queue);
            for q in all {
                if is_cancelled(&q.request.reply) {
                    cancelled.push(q.request);
                } else {
                    queue.push_back(q);
                }
            }
        }
        cancelled
    }

    /// Decides what to do at `now` (call [`DynamicQueue::expire`] first).
    pub fn poll(&mut self, now: Instant) -> Poll<R> {
        let max_rows = self.config.max_batch_size.max(1);
        let mut count = 0usize;
        let mut rows = 0usize;
        let mut bytes = 0usize;
        let mut preferred = 0usize; // requests in the largest preferred-size prefix
        let mut full = false;
        let mut oldest: Option<Instant> = None;
        let mut urgent = false;
        let mut first_shapes: Option<Vec<kiln_worker_sdk::Shape>> = None;
        'scan: for queue in &self.levels {
            for q in queue {
                let r = &q.request;
                let fits_rows = rows + r.rows <= max_rows;
                let fits_bytes = self
                    .config
                    .max_batch_bytes
                    .is_none_or(|max| count == 0 || bytes + q.bytes <= max);
                let fits_shape = self.config.allow_ragged
                    || first_shapes.as_ref().is_none_or(|shapes| {
                        shapes
                            .iter()
                            .zip(&r.inputs)
                            .all(|(a, b)| a.inner() == b.shape.inner())
                    });
                if count > 0 && !(fits_rows && fits_bytes && fits_shape) {
                    full = true;
                    break 'scan;
                }
                if first_shapes.is_none() {
                    first_shapes = Some(r.inputs.iter().map(|t| t.shape).collect());
                }
                count += 1;
                rows += r.rows;
                bytes += q.bytes;
                oldest = Some(oldest.map_or(r.arrived, |o: Instant| o.min(r.arrived)));
                if q.deadline.is_some_and(|d| d <= now + self.compute_estimate) {
                    urgent = true;
                }
                if self.config.preferred_batch_sizes.contains(&rows) {
                    preferred = count;
                }
                if rows >= max_rows {
                    full = true;
                    break 'scan;
                }
            }
        }
        let Some(oldest) = oldest else {
            return Poll::Wait(None);
        };
        let take = if full || urgent {
            count
        } else if preferred > 0 {
            preferred
        } else if oldest + self.config.max_queue_delay <= now {
            count
        } else {
            // Wait for more, until the delay runs out or a deadline needs sending.
            let mut until = oldest + self.config.max_queue_delay;
            for q in self.levels.iter().flatten() {
                if let Some(d) = q.deadline {
                    until = until.min(d.checked_sub(self.compute_estimate).unwrap_or(d));
                }
            }
            return Poll::Wait(Some(until.max(now)));
        };
        let mut batch = Vec::with_capacity(take);
        for queue in &mut self.levels {
            while batch.len() < take {
                match queue.pop_front() {
                    Some(q) => batch.push(q.request),
                    None => break,
                }
            }
        }
        Poll::Batch(batch)
    }

    /// The earliest instant at which some queued request times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.levels
            .iter()
            .flatten()
            .filter_map(|q| q.deadline)
            .min()
    }
}

#[cfg(test)]
mod tests;

/// What the dynamic batcher needs from its host: how to answer requests that leave
/// the queue unbatched, whether a client is gone, and how long batches take.
pub trait DynamicHost<R>: Send {
    /// `request` leaves without being batched.
    fn rejected(&self, request: Request<R>, why: Rejection);
    /// Whether the client waiting on `reply` went away.
    fn is_cancelled(&self, reply: &R) -> bool;
    /// The current estimate of one batch's run time.
    fn compute_estimate(&self) -> Duration;
}

/// How often a waiting batcher looks for cancelled requests when nothing else wakes it.
const CANCEL_CHECK: Duration = Duration::from_millis(50);

/// Runs a dynamic batcher until `requests` is disconnected and every request taken
/// has been batched or answered. One thread per group: the queue's order and
/// priorities are one scheduler's. A batch goes out when an instance has asked for
/// one (`pulls`), or once the queue has closed. While every instance is busy the
/// thread sleeps until one asks (with no queue policy that needs arrivals seen at
/// once: then one wake-up per batch, not per request).
pub fn run_dynamic_batcher<R>(
    config: DynamicConfig,
    inputs: usize,
    requests: crossbeam_channel::Receiver<Request<R>>,
    pool: std::sync::Arc<kiln_buffers::Pool<kiln_buffers::BufferSet>>,
    (batches, pulls): (
        crossbeam_channel::Sender<crate::batch::Batch<R>>,
        std::sync::Arc<Pulls>,
    ),
    host: impl DynamicHost<R>,
) {
    // Whether a request's place in the queue can end before it is batched (a
    // timeout, a full level): then requests are taken in as they come even while
    // every instance is busy, so those end on time.
    let watch = config
        .policies
        .iter()
        .any(|p| p.max_queue_size > 0 || p.default_timeout.is_some() || p.allow_timeout_override);
    let mut queue = DynamicQueue::new(config);
    let mut open = true;
    // Batches formed so far: each batch's number in formation order.
    let mut formed = 0u64;
    // A buffer set is secured before requests leave the queue, so requests keep
    // timing out (and being cancelled) while every set is in flight.
    let mut spare = None;
    loop {
        let now = Instant::now();
        // Until the channel is empty, or closed (an unload: seen here too, as the
        // thread may wait on the instances rather than on the channel).
        loop {
            match requests.try_recv() {
                Ok(request) => {
                    if let Err((request, why)) = queue.admit(request, now) {
                        host.rejected(request, why);
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => break,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if open {
            for request in queue.expire(now) {
                host.rejected(request, Rejection::Timeout);
            }
        }
        for request in queue.cancel(|reply| host.is_cancelled(reply)) {
            host.rejected(request, Rejection::Cancelled);
        }
        queue.set_compute_estimate(host.compute_estimate());
        let wake = queue
            .next_deadline()
            .unwrap_or(now + CANCEL_CHECK)
            .min(now + CANCEL_CHECK);
        if queue.is_empty() {
            if !open {
                return;
            }
            open = receive(&mut queue, &requests, wake, &host);
            continue;
        }
        // Every instance busy: the batch grows until one frees up (once the queue
        // is closed, everything left is sent, asked for or not).
        if open && !pulls.asked() {
            open = pull::wait_for_ask(&pulls, &mut queue, &requests, wake, &host, watch);
            continue;
        }
        if spare.is_none() {
            spare = pool.try_acquire();
            if spare.is_none() {
                spare = pool.acquire_timeout(wake.saturating_duration_since(now));
                continue;
            }
        }
        // Once the queue is closed (unload), everything left is sent without waiting.
        let decision_time = if open {
            now
        } else {
            now + Duration::from_secs(86_400)
        };
        match queue.poll(decision_time) {
            Poll::Batch(taken) => {
                let Some(set) = spare.take() else { continue };
                let mut batch = crate::batch::Batch::new(set, inputs, taken.len());
                batch.order = formed;
                formed += 1;
                batch.push_all(taken);
                pulls.answer();
                if batches.send(batch).is_err() {
                    return;
                }
            }
            Poll::Wait(until) => {
                let wake = until.map_or(wake, |u| u.min(wake));
                open = receive(&mut queue, &requests, wake, &host) && open;
            }
        }
    }
}

/// Waits until `wake` for one request and admits it; `false` once the queue closed.
fn receive<R>(
    queue: &mut DynamicQueue<R>,
    requests: &crossbeam_channel::Receiver<Request<R>>,
    wake: Instant,
    host: &impl DynamicHost<R>,
) -> bool {
    match requests.recv_deadline(wake) {
        Ok(request) => {
            admit(queue, request, host);
            true
        }
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => true,
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => false,
    }
}

/// Queues `request`, or answers it when the queue refuses it.
fn admit<R>(queue: &mut DynamicQueue<R>, request: Request<R>, host: &impl DynamicHost<R>) {
    if let Err((request, why)) = queue.admit(request, Instant::now()) {
        host.rejected(request, why);
    }
}

#[cfg(test)]
mod thread_tests;
