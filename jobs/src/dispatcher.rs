//! The dispatcher: one thread (`kiln-jobs`) that owns the budget, claims jobs
//! from the [`JobQueue`] while the budget has room, runs them on the
//! [`DispatchTarget`] and stores their results.
//!
//! Each round it reads the target, updates the [`DispatchBudget`] with its own jobs in
//! flight and starts claimed jobs while the budget has room. The store is called
//! on the blocking pool, one call at a time, so a commit (an fsync in the
//! embedded store, a round trip to Redis) never holds up dispatching: each call
//! stores the results and releases gathered since the last one and claims enough
//! jobs to keep one budget's worth ready beside the budget in flight (at most
//! [`MAX_CLAIM`]; [`JobQueue::settle_and_claim`]: one transaction, one fsync, in
//! the embedded store). While a call is under way the next one's results gather,
//! so a busy dispatcher commits many results at once. A claim that finds the queue
//! empty stops claiming for [`EMPTY_POLL`].
//!
//! An overload answer releases the job back to the queue and zeroes the budget
//! until the next reading; the target unavailable (no healthy instance, server
//! gone) releases it too, and nothing is started or claimed for
//! [`UNAVAILABLE_BACKOFF`]. Jobs claimed but not started go back to the queue
//! when the dispatcher stops, or when the budget stays 0 past half the reclaim
//! timeout (`reason="stale"`). At stop the jobs in flight get the server's exit
//! timeout; those cut then go back to the queue too (`reason="stopped"`). Every `ttl / 4` finished jobs older than the TTL
//! are removed; the state gauges are refreshed a few times a second (both in
//! the store calls).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Notify;
use tokio::task::{Id as TaskId, JoinHandle as TaskHandle, JoinSet};

use crate::budget::{BudgetConfig, DispatchBudget, DispatchTarget, Dispatched};
use crate::metrics::DispatchMetrics;
use crate::queue::{ClaimedJob, JobId, JobQueue, JobsError, Outcome, StateCounts};

/// Most jobs claimed in one round (one store transaction).
pub const MAX_CLAIM: usize = 256;

/// How long the dispatcher claims nothing after the target was unavailable.
pub const UNAVAILABLE_BACKOFF: Duration = Duration::from_millis(200);

/// How long the dispatcher claims nothing after a claim found the queue empty.
pub const EMPTY_POLL: Duration = Duration::from_millis(20);

/// How often the state gauges are refreshed from the store.
const COUNTS_EVERY: Duration = Duration::from_millis(200);

/// How long a dispatcher dropped without [`Dispatcher::stop`] waits for its jobs
/// in flight.
const DROP_WAIT: Duration = Duration::from_secs(5);

/// The stop request: the flag, the wake-up and how long (ms) the jobs in flight
/// get to finish.
#[derive(Default)]
struct Stop {
    flag: AtomicBool,
    wake: Notify,
    wait_ms: AtomicU64,
}

/// The dispatcher's settings.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    pub budget: BudgetConfig,
    /// How long finished jobs are kept (`--jobs-result-ttl`).
    pub result_ttl: Duration,
    /// How often the target is read when nothing ends sooner.
    pub tick: Duration,
    /// This process's name as a consumer of the queue.
    pub consumer: String,
    /// Claimed jobs of other consumers idle this long are taken back
    /// ([`JobQueue::reclaim`]; matters for a shared queue).
    pub reclaim_after: Duration,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            budget: BudgetConfig::default(),
            result_ttl: Duration::from_secs(24 * 3600),
            tick: Duration::from_millis(5),
            consumer: format!("kiln-{}", std::process::id()),
            reclaim_after: Duration::from_secs(300),
        }
    }
}

/// The running dispatcher; [`Dispatcher::stop`] ends it.
pub struct Dispatcher {
    stop: Arc<Stop>,
    thread: Option<JoinHandle<()>>,
}

impl Dispatcher {
    /// Starts the thread.
    pub fn start(
        queue: Arc<dyn JobQueue>,
        target: Arc<dyn DispatchTarget>,
        config: DispatcherConfig,
        metrics: DispatchMetrics,
    ) -> std::io::Result<Dispatcher> {
        let stop = Arc::new(Stop::default());
        let runtime = tokio::runtime::Builder::new_current_thread()
            // I/O too: a remote target scrapes and posts over HTTP.
            .enable_all()
            // The store calls' threads: below every serving thread, as this one.
            .on_thread_start(kiln_core::system::sched::background_thread)
            .build()?;
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-jobs".into())
            .spawn(move || {
                // Jobs are the lowest priority in the OS too: this thread decodes
                // them and encodes their results only on a core realtime leaves idle.
                kiln_core::system::sched::background_thread();
                let mut round = Rounds::new(queue, target, config, metrics);
                runtime.block_on(round.run(&flag));
            })?;
        Ok(Dispatcher {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops claiming, waits up to `wait` (the server's `--exit-timeout-secs`)
    /// for the jobs in flight, stores their results and ends the thread. What
    /// did not finish in time, and what was claimed but not started, goes back to
    /// the queue (`reason="stopped"`): nothing stays claimed by a stopped
    /// dispatcher.
    pub fn stop(mut self, wait: Duration) {
        self.halt(wait);
    }

    fn halt(&mut self, wait: Duration) {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        self.stop.wait_ms.store(wait_ms, Ordering::SeqCst);
        self.stop.flag.store(true, Ordering::SeqCst);
        self.stop.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.halt(DROP_WAIT);
    }
}

/// The dispatcher thread's state.
struct Rounds {
    queue: Arc<dyn JobQueue>,
    target: Arc<dyn DispatchTarget>,
    budget: DispatchBudget,
    metrics: DispatchMetrics,
    config: DispatcherConfig,
    in_flight: JoinSet<(JobId, Dispatched)>,
    /// The job each task in flight runs, to release it if it is cut at stop.
    running: HashMap<TaskId, JobId>,
    /// Claimed and not started yet, with when they were claimed.
    ready: VecDeque<(Instant, ClaimedJob)>,
    results: Vec<(JobId, Outcome)>,
    released: Vec<JobId>,
    /// The store call under way (one at a time, on the blocking pool).
    store: Option<TaskHandle<Stored>>,
    /// No claims before this (after the target was unavailable).
    backoff_until: Option<Instant>,
    /// No claims before this: the last claim found the queue empty.
    empty_until: Option<Instant>,
    counts_every: Every,
    expire_every: Every,
    reclaim_every: Every,
}

/// When a chore is due: once a `period`, from its first check or from a start.
struct Every {
    period: Duration,
    /// When it was last done (`None`: due at its first check).
    last: Option<Instant>,
}

impl Every {
    /// Due at the first check, then once a `period`.
    fn at_once(period: Duration) -> Every {
        Every { period, last: None }
    }

    /// Due a `period` after `start`, then once a `period`.
    fn after(period: Duration, start: Instant) -> Every {
        Every {
            period,
            last: Some(start),
        }
    }

    /// Whether the chore is due at `now` (if so it counts as done then).
    fn due(&mut self, now: Instant) -> bool {
        let due = self
            .last
            .is_none_or(|last| now.saturating_duration_since(last) >= self.period);
        if due {
            self.last = Some(now);
        }
        due
    }
}

/// What one store call was given and did.
struct Stored {
    /// The results and releases it was to store, given back when it failed.
    results: Vec<(JobId, Outcome)>,
    released: Vec<JobId>,
    asked: usize,
    claimed: Result<Vec<ClaimedJob>, JobsError>,
    counts: Option<StateCounts>,
}

/// The maintenance a store call does besides its round.
#[derive(Clone, Copy)]
struct Chores {
    counts: bool,
    expire_before: Option<SystemTime>,
    reclaim_idle: Option<Duration>,
}

impl Chores {
    /// Whether any chore is due.
    fn any(&self) -> bool {
        self.counts || self.expire_before.is_some() || self.reclaim_idle.is_some()
    }
}

impl Rounds {
    fn new(
        queue: Arc<dyn JobQueue>,
        target: Arc<dyn DispatchTarget>,
        config: DispatcherConfig,
        metrics: DispatchMetrics,
    ) -> Rounds {
        let expire_every =
            (config.result_ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(60));
        let reclaim_every = Every::after(config.reclaim_after / 4, Instant::now());
        Rounds {
            queue,
            target,
            budget: DispatchBudget::new(config.budget),
            metrics,
            config,
            in_flight: JoinSet::new(),
            running: HashMap::new(),
            ready: VecDeque::new(),
            results: Vec::new(),
            released: Vec::new(),
            store: None,
            backoff_until: None,
            empty_until: None,
            counts_every: Every::at_once(COUNTS_EVERY),
            expire_every: Every::at_once(expire_every),
            reclaim_every,
        }
    }

    async fn run(&mut self, stop: &Stop) {
        while !stop.flag.load(Ordering::SeqCst) {
            self.dispatch_round().await;
            tokio::select! {
                ended = self.in_flight.join_next_with_id(), if !self.in_flight.is_empty() => {
                    if let Some(ended) = ended {
                        self.ended(ended);
                    }
                }
                stored = async {
                    match self.store.as_mut() {
                        Some(store) => store.await,
                        None => std::future::pending().await,
                    }
                }, if self.store.is_some() => {
                    self.store = None;
                    self.stored(stored);
                }
                _ = tokio::time::sleep(self.config.tick) => {}
                _ = stop.wake.notified() => {}
            }
            while let Some(ended) = self.in_flight.try_join_next_with_id() {
                self.ended(ended);
            }
        }
        // Stopping: the store call under way ends, the jobs in flight get the
        // stop's wait, and what is cut then or was claimed but not started goes
        // back to the queue.
        if let Some(store) = self.store.take() {
            let stored = store.await;
            self.stored(stored);
        }
        let wait = Duration::from_millis(stop.wait_ms.load(Ordering::SeqCst));
        let deadline = tokio::time::sleep(wait);
        tokio::pin!(deadline);
        while !self.in_flight.is_empty() {
            tokio::select! {
                Some(ended) = self.in_flight.join_next_with_id() => self.ended(ended),
                _ = &mut deadline => break,
            }
        }
        self.in_flight.abort_all();
        while let Some(ended) = self.in_flight.join_next_with_id().await {
            self.ended(ended);
        }
        while let Some((_, job)) = self.ready.pop_front() {
            self.release(job.id, "stopped");
        }
        self.store_results();
    }

    /// Reads the target, updates the budget, starts claimed jobs while the budget
    /// has room, and starts a store call when there is something to store or
    /// claim and none is under way.
    async fn dispatch_round(&mut self) {
        let reading = self.target.read().await;
        let figures = self.budget.update(reading, self.in_flight.len());
        let now = Instant::now();
        let backing_off = self.backoff_until.is_some_and(|t| now < t);
        if !backing_off {
            while self.in_flight.len() < figures.budget {
                let Some((_, job)) = self.ready.pop_front() else {
                    break;
                };
                let id = job.id.clone();
                let run = self.target.dispatch(job);
                let task = self.in_flight.spawn({
                    let id = id.clone();
                    async move { (id, run.await) }
                });
                self.running.insert(task.id(), id);
                self.metrics.dispatched.inc();
            }
        }
        self.metrics.set_figures(&figures, self.in_flight.len());
        if self.store.is_none() {
            self.release_stale(figures.budget, now);
            self.start_store(figures.budget, backing_off, now);
        }
    }

    /// Claimed jobs that waited past half the reclaim timeout without a budget
    /// go back to the queue (another consumer would take them for a dead one's).
    fn release_stale(&mut self, budget: usize, now: Instant) {
        if budget > 0 {
            return;
        }
        let stale = self.config.reclaim_after / 2;
        while self
            .ready
            .front()
            .is_some_and(|(claimed, _)| now.duration_since(*claimed) >= stale)
        {
            if let Some((_, job)) = self.ready.pop_front() {
                self.release(job.id, "stale");
            }
        }
    }

    /// Starts a store call: the results and releases gathered, a claim that keeps
    /// up to one budget of jobs ready beside the budget in flight (at most
    /// [`MAX_CLAIM`]), and the chores that are due.
    fn start_store(&mut self, budget: usize, backing_off: bool, now: Instant) {
        let claiming = !backing_off && self.empty_until.is_none_or(|t| now >= t);
        let asked = if claiming {
            (2 * budget)
                .saturating_sub(self.in_flight.len() + self.ready.len())
                .min(MAX_CLAIM)
        } else {
            0
        };
        let chores = self.chores_due(now);
        if asked == 0 && self.results.is_empty() && self.released.is_empty() && !chores.any() {
            return;
        }
        let queue = Arc::clone(&self.queue);
        let consumer = self.config.consumer.clone();
        let results = std::mem::take(&mut self.results);
        let released = std::mem::take(&mut self.released);
        self.store = Some(tokio::task::spawn_blocking(move || {
            store_round(&*queue, &consumer, results, released, asked, chores)
        }));
    }

    /// Which chores are due now (and marks them done).
    fn chores_due(&mut self, now: Instant) -> Chores {
        Chores {
            counts: self.counts_every.due(now),
            expire_before: self
                .expire_every
                .due(now)
                .then(|| SystemTime::now() - self.config.result_ttl),
            reclaim_idle: self
                .reclaim_every
                .due(now)
                .then_some(self.config.reclaim_after),
        }
    }

    /// Takes in what a store call did: the jobs it claimed become ready; on an
    /// error its results and releases are kept for the next call.
    fn stored(&mut self, stored: Result<Stored, tokio::task::JoinError>) {
        let stored = match stored {
            Ok(stored) => stored,
            // The store call panicked: its results are lost to this process, and
            // their jobs stay running until reclaimed (at the next start).
            Err(e) => {
                spdlog::error!("jobs: a store call failed: {e}");
                return;
            }
        };
        if let Some(counts) = &stored.counts {
            self.metrics.set_counts(counts);
        }
        match stored.claimed {
            Ok(jobs) => {
                if jobs.len() < stored.asked {
                    self.empty_until = Some(Instant::now() + EMPTY_POLL);
                }
                let now = Instant::now();
                self.ready.extend(jobs.into_iter().map(|job| (now, job)));
            }
            Err(e) => {
                spdlog::error!(
                    "jobs: storing {} result(s) and claiming failed: {e}",
                    stored.results.len()
                );
                // Kept: tried again next call (the jobs stay running meanwhile).
                self.results.extend(stored.results);
                self.released.extend(stored.released);
            }
        }
    }

    /// Notes how a job went.
    fn ended(&mut self, ended: Result<(TaskId, (JobId, Dispatched)), tokio::task::JoinError>) {
        let (id, dispatched) = match ended {
            Ok((task, ended)) => {
                self.running.remove(&task);
                ended
            }
            Err(e) => {
                let Some(id) = self.running.remove(&e.id()) else {
                    return;
                };
                if e.is_cancelled() {
                    // Cut at stop: back to the queue (it may have run: at-least-once).
                    self.release(id, "stopped");
                } else {
                    // A panic: left claimed until reclaimed, not retried blindly.
                    spdlog::error!("jobs: running job {id} panicked: {e}");
                }
                return;
            }
        };
        match dispatched {
            Dispatched::Ran(outcome) => {
                match &outcome {
                    Outcome::Done(_) => self.metrics.completed.inc(),
                    Outcome::Failed(_) => self.metrics.failed.inc(),
                };
                self.results.push((id, outcome));
            }
            Dispatched::Overloaded => {
                self.budget.on_overload();
                self.metrics.overloads.inc();
                self.release(id, "overloaded");
            }
            Dispatched::Unavailable(why) => {
                spdlog::debug!("jobs: job {id} could not run now ({why}); queued again");
                // Not a blind retry: no claims for a while.
                self.backoff_until = Some(Instant::now() + UNAVAILABLE_BACKOFF);
                self.release(id, "unavailable");
            }
        }
    }

    fn release(&mut self, id: JobId, reason: &'static str) {
        self.metrics
            .released
            .get_or_create(&crate::metrics::ReasonLabel { reason })
            .inc();
        self.released.push(id);
    }

    /// Stores the results and releases gathered so far, on this thread (the
    /// last call, when stopping).
    fn store_results(&mut self) {
        if !self.results.is_empty() {
            match self.queue.complete(&self.results) {
                Ok(()) => self.results.clear(),
                Err(e) => {
                    spdlog::error!("jobs: storing {} result(s) failed: {e}", self.results.len())
                }
            }
        }
        if !self.released.is_empty() {
            if let Err(e) = self.queue.release(&self.released) {
                spdlog::error!("jobs: releasing jobs failed: {e}");
            }
            self.released.clear();
        }
        self.metrics.in_flight.set(self.in_flight.len() as i64);
    }
}

/// One store call, on the blocking pool: stores `results`, releases `released`
/// and claims up to `asked` jobs (one transaction in the embedded store), then
/// does the chores that are due. A failing chore is logged and tried again at
/// its next turn.
fn store_round(
    queue: &dyn JobQueue,
    consumer: &str,
    results: Vec<(JobId, Outcome)>,
    released: Vec<JobId>,
    asked: usize,
    chores: Chores,
) -> Stored {
    // With nothing to store or claim, the stores write nothing.
    let claimed = queue.settle_and_claim(&results, &released, consumer, asked);
    if let Some(before) = chores.expire_before {
        if let Err(e) = queue.expire(before) {
            spdlog::warn!("jobs: expiring old results failed: {e}");
        }
    }
    if let Some(idle) = chores.reclaim_idle {
        if let Err(e) = queue.reclaim(consumer, idle) {
            spdlog::warn!("jobs: reclaiming a dead consumer's jobs failed: {e}");
        }
    }
    let counts = chores
        .counts
        .then(|| {
            queue
                .counts()
                .map_err(|e| spdlog::warn!("jobs: cannot read the store's counts: {e}"))
                .ok()
        })
        .flatten();
    Stored {
        results,
        released,
        asked,
        claimed,
        counts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chore_is_due_once_a_period() {
        let start = Instant::now();
        let period = Duration::from_secs(10);
        let mut at_once = Every::at_once(period);
        assert!(at_once.due(start), "due at its first check");
        assert!(!at_once.due(start + period / 2));
        assert!(at_once.due(start + period));
        let mut after = Every::after(period, start);
        assert!(!after.due(start));
        assert!(after.due(start + period));
        assert!(!after.due(start + period + period / 2));
    }
}
