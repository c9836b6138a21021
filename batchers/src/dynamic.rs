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

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::request::Request;

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
        let level = match request.priority {
            None | Some(0) => self.config.default_priority_level,
            Some(p) => p as usize,
        };
        if level == 0 || level > self.config.priority_levels {
            return Err((request, Rejection::BadPriority));
        }
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
mod tests {
    use super::*;
    use crate::request::Tensor;
    use bytes::Bytes;
    use kiln_worker_sdk::{DataType, Shape};

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    fn req(id: u32, rows: usize, arrived: Instant) -> Request<u32> {
        req_shaped(id, &[rows as i64, 2], arrived)
    }

    fn req_shaped(id: u32, dims: &[i64], arrived: Instant) -> Request<u32> {
        let shape = Shape::new(dims).unwrap();
        Request {
            inputs: vec![Tensor {
                dtype: DataType::Uint32,
                shape,
                data: Bytes::from(vec![0u8; shape.element_count() * 4]),
            }],
            rows: shape.rows(),
            params: Vec::new(),
            arrived,
            priority: None,
            timeout: None,
            sequence: None,
            ticket: None,
            reply: id,
        }
    }

    fn ids(poll: Poll<u32>) -> Vec<u32> {
        match poll {
            Poll::Batch(b) => b.into_iter().map(|r| r.reply).collect(),
            Poll::Wait(w) => panic!("expected a batch, got Wait({w:?})"),
        }
    }

    fn waits(poll: Poll<u32>) -> Option<Instant> {
        match poll {
            Poll::Wait(w) => w,
            Poll::Batch(b) => panic!(
                "expected to wait, got {:?}",
                b.iter().map(|r| r.reply).collect::<Vec<_>>()
            ),
        }
    }

    #[test]
    fn waits_until_the_delay_counted_from_the_oldest() {
        let t = Instant::now();
        let mut q = DynamicQueue::new(DynamicConfig::new(8, Duration::from_millis(10)));
        q.admit(req(1, 1, at(t, 0)), at(t, 0)).unwrap();
        q.admit(req(2, 1, at(t, 4)), at(t, 4)).unwrap();
        assert_eq!(
            waits(q.poll(at(t, 5))),
            Some(at(t, 10)),
            "from the oldest, not the newest"
        );
        assert_eq!(ids(q.poll(at(t, 10))), vec![1, 2]);
        assert_eq!(waits(q.poll(at(t, 11))), None);
    }

    #[test]
    fn a_full_batch_goes_at_once_and_zero_delay_sends_what_is_there() {
        let t = Instant::now();
        let mut q = DynamicQueue::new(DynamicConfig::new(4, Duration::from_secs(60)));
        for i in 0..5 {
            q.admit(req(i, 1, t), t).unwrap();
        }
        assert_eq!(ids(q.poll(t)), vec![0, 1, 2, 3]);
        let mut q = DynamicQueue::new(DynamicConfig::new(4, Duration::ZERO));
        q.admit(req(9, 1, t), t).unwrap();
        assert_eq!(ids(q.poll(t)), vec![9]);
    }

    #[test]
    fn preferred_sizes_are_chosen_greedily() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(16, Duration::from_secs(60));
        config.preferred_batch_sizes = vec![2, 4, 8];
        let mut q = DynamicQueue::new(config);
        for i in 0..5 {
            q.admit(req(i, 1, t), t).unwrap();
        }
        // 5 queued: the largest preferred size reachable is 4.
        assert_eq!(ids(q.poll(t)), vec![0, 1, 2, 3]);
        // 1 left: no preferred size, so it waits for the delay.
        assert!(waits(q.poll(t)).is_some());
        // Requests carrying rows: 3 + 1 = 4 rows is preferred; the 2-row request
        // alone would be 2 (also preferred) but 4 is larger.
        let mut config = DynamicConfig::new(16, Duration::from_secs(60));
        config.preferred_batch_sizes = vec![2, 4];
        let mut q = DynamicQueue::new(config);
        q.admit(req(0, 3, t), t).unwrap();
        q.admit(req(1, 1, t), t).unwrap();
        q.admit(req(2, 2, t), t).unwrap();
        assert_eq!(ids(q.poll(t)), vec![0, 1]);
    }

    #[test]
    fn rows_never_split_and_shapes_never_mix() {
        let t = Instant::now();
        let mut q = DynamicQueue::new(DynamicConfig::new(4, Duration::from_secs(60)));
        q.admit(req(0, 3, t), t).unwrap();
        q.admit(req(1, 2, t), t).unwrap();
        // 3 + 2 > 4: the batch cannot grow without splitting or reordering: send it.
        assert_eq!(ids(q.poll(t)), vec![0]);
        let mut q = DynamicQueue::new(DynamicConfig::new(8, Duration::from_secs(60)));
        q.admit(req_shaped(0, &[1, 2], t), t).unwrap();
        q.admit(req_shaped(1, &[1, 3], t), t).unwrap();
        assert_eq!(ids(q.poll(t)), vec![0]);
        assert_eq!(waits(q.poll(t)), Some(t + Duration::from_secs(60)));
    }

    #[test]
    fn max_batch_bytes_limits_the_batch() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(64, Duration::from_secs(60));
        config.max_batch_bytes = Some(20); // each request is 8 bytes
        let mut q = DynamicQueue::new(config);
        for i in 0..4 {
            q.admit(req(i, 1, t), t).unwrap();
        }
        assert_eq!(ids(q.poll(t)), vec![0, 1]);
    }

    #[test]
    fn strict_priority_across_levels_fifo_within() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(3, Duration::ZERO);
        config.priority_levels = 3;
        config.default_priority_level = 2;
        let mut q = DynamicQueue::new(config);
        let with = |id, p| {
            let mut r = req(id, 1, t);
            r.priority = p;
            r
        };
        q.admit(with(0, Some(3)), t).unwrap();
        q.admit(with(1, None), t).unwrap();
        q.admit(with(2, Some(1)), t).unwrap();
        q.admit(with(3, Some(3)), t).unwrap();
        q.admit(with(4, Some(1)), t).unwrap();
        assert_eq!(ids(q.poll(t)), vec![2, 4, 1]);
        assert_eq!(ids(q.poll(t)), vec![0, 3]);
        let (r, why) = q.admit(with(5, Some(4)), t).unwrap_err();
        assert_eq!((r.reply, why), (5, Rejection::BadPriority));
    }

    #[test]
    fn queue_full_per_level() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(8, Duration::from_secs(1));
        config.policies = vec![QueuePolicy {
            max_queue_size: 2,
            ..QueuePolicy::default()
        }];
        let mut q = DynamicQueue::new(config);
        q.admit(req(0, 1, t), t).unwrap();
        q.admit(req(1, 1, t), t).unwrap();
        assert_eq!(
            q.admit(req(2, 1, t), t).unwrap_err().1,
            Rejection::QueueFull
        );
    }

    #[test]
    fn timeouts_reject_or_delay_and_overrides_only_shorten() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(8, Duration::from_secs(60));
        config.priority_levels = 2;
        config.policies = vec![
            QueuePolicy {
                default_timeout: Some(Duration::from_millis(100)),
                timeout_action: TimeoutAction::Reject,
                ..QueuePolicy::default()
            },
            QueuePolicy {
                default_timeout: Some(Duration::from_millis(50)),
                timeout_action: TimeoutAction::Delay,
                ..QueuePolicy::default()
            },
        ];
        let mut q = DynamicQueue::new(config);
        let mut shorter = req(0, 1, t);
        shorter.timeout = Some(Duration::from_millis(20));
        let mut longer = req(1, 1, t);
        longer.timeout = Some(Duration::from_secs(10)); // may not lengthen: stays 100 ms
        let mut low = req(2, 1, t);
        low.priority = Some(2);
        q.admit(shorter, t).unwrap();
        q.admit(longer, t).unwrap();
        q.admit(low, t).unwrap();
        assert_eq!(q.next_deadline(), Some(at(t, 20)));
        assert_eq!(
            waits(q.poll(at(t, 1))),
            Some(at(t, 20)),
            "wakes for the deadline"
        );
        assert_eq!(
            q.expire(at(t, 20))
                .iter()
                .map(|r| r.reply)
                .collect::<Vec<_>>(),
            vec![0]
        );
        // At 50 ms the low-priority request is delayed, not rejected.
        assert!(q.expire(at(t, 50)).is_empty());
        assert_eq!(
            q.expire(at(t, 100))
                .iter()
                .map(|r| r.reply)
                .collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(q.len(), 1);
        assert_eq!(
            q.next_deadline(),
            None,
            "a delayed request has no deadline any more"
        );
    }

    #[test]
    fn delayed_requests_come_after_all_others() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(2, Duration::ZERO);
        config.policies = vec![QueuePolicy {
            default_timeout: Some(Duration::from_millis(10)),
            timeout_action: TimeoutAction::Delay,
            allow_timeout_override: false,
            ..QueuePolicy::default()
        }];
        let mut q = DynamicQueue::new(config);
        q.admit(req(0, 1, t), t).unwrap();
        assert!(q.expire(at(t, 10)).is_empty());
        q.admit(req(1, 1, at(t, 11)), at(t, 11)).unwrap();
        q.admit(req(2, 1, at(t, 11)), at(t, 11)).unwrap();
        assert_eq!(ids(q.poll(at(t, 11))), vec![1, 2]);
        assert_eq!(ids(q.poll(at(t, 11))), vec![0]);
    }

    #[test]
    fn cancelled_requests_leave_before_batching() {
        let t = Instant::now();
        let mut q = DynamicQueue::new(DynamicConfig::new(8, Duration::from_secs(60)));
        for i in 0..4 {
            q.admit(req(i, 1, t), t).unwrap();
        }
        let gone = q.cancel(|id| id % 2 == 1);
        assert_eq!(gone.iter().map(|r| r.reply).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(ids(q.poll(at(t, 60_000))), vec![0, 2]);
    }

    #[test]
    fn deadline_aware_sends_early() {
        let t = Instant::now();
        let mut config = DynamicConfig::new(8, Duration::from_millis(100));
        config.policies = vec![QueuePolicy {
            default_timeout: Some(Duration::from_millis(50)),
            ..QueuePolicy::default()
        }];
        let mut q = DynamicQueue::new(config);
        q.set_compute_estimate(Duration::from_millis(20));
        q.admit(req(0, 1, t), t).unwrap();
        // Deadline 50 ms, a batch takes ~20 ms: waiting past 30 ms would miss it.
        assert_eq!(waits(q.poll(at(t, 1))), Some(at(t, 30)));
        assert_eq!(ids(q.poll(at(t, 30))), vec![0]);
    }
}

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
/// priorities are one scheduler's.
pub fn run_dynamic_batcher<R>(
    config: DynamicConfig,
    inputs: usize,
    requests: crossbeam_channel::Receiver<Request<R>>,
    pool: std::sync::Arc<kiln_buffers::Pool<kiln_buffers::BufferSet>>,
    batches: crossbeam_channel::Sender<crate::batch::Batch<R>>,
    host: impl DynamicHost<R>,
) {
    let mut queue = DynamicQueue::new(config);
    let mut open = true;
    // Batches formed so far: each batch's number in formation order.
    let mut formed = 0u64;
    // A buffer set is secured before requests leave the queue, so requests keep
    // timing out (and being cancelled) while every set is in flight.
    let mut spare = None;
    loop {
        let now = Instant::now();
        for request in requests.try_iter() {
            if let Err((request, why)) = queue.admit(request, now) {
                host.rejected(request, why);
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
            if let Err((request, why)) = queue.admit(request, Instant::now()) {
                host.rejected(request, why);
            }
            true
        }
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => true,
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => false,
    }
}

#[cfg(test)]
mod thread_tests {
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
        let thread = std::thread::spawn(move || run_dynamic_batcher(config, 1, rx, p, btx, h));
        tx.send(req(1)).unwrap();
        let first = brx.recv_timeout(Duration::from_secs(5)).unwrap(); // holds the only set
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
        run_dynamic_batcher(config, 1, rx, p, btx, h);
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
        let thread = std::thread::spawn(move || run_dynamic_batcher(config, 1, rx, p, btx, h));
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
}
