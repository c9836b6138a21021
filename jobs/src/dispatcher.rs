//! The dispatcher: one thread (`kiln-jobs`) that owns the budget, claims jobs
//! from the [`JobQueue`] while the budget has room, runs them on the
//! [`DispatchTarget`] and stores their results.
//!
//! Each round it reads the target, updates the [`Budget`] with its own jobs in
//! flight, stores the results that came in since the last round and claims
//! `budget − in flight` jobs (at most [`MAX_CLAIM`]) in one store call
//! ([`JobQueue::settle_and_claim`]: one transaction, one fsync, in the embedded
//! store), starts them, then waits for a job to end or the next tick. An overload answer
//! releases the job back to the queue and zeroes the budget until the next
//! reading; the target unavailable (no healthy instance, server gone) releases
//! it too, and nothing is claimed for [`UNAVAILABLE_BACKOFF`]. The store is called on this thread (it blocks on disk or network; no
//! request thread waits on it). Every `ttl / 4` finished jobs older than the TTL
//! are removed; the state gauges are refreshed a few times a second.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::budget::{Budget, BudgetConfig, DispatchTarget, Dispatched};
use crate::metrics::DispatchMetrics;
use crate::queue::{JobId, JobQueue, Outcome};

/// Most jobs claimed in one round (one store transaction).
pub const MAX_CLAIM: usize = 256;

/// How long the dispatcher claims nothing after the target was unavailable.
pub const UNAVAILABLE_BACKOFF: Duration = Duration::from_millis(200);

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
    stop: Arc<(AtomicBool, Notify)>,
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
        let stop = Arc::new((AtomicBool::new(false), Notify::new()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            // I/O too: a remote target scrapes and posts over HTTP.
            .enable_all()
            .build()?;
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-jobs".into())
            .spawn(move || {
                let mut round = Rounds {
                    queue,
                    target,
                    budget: Budget::new(config.budget),
                    metrics,
                    config,
                    in_flight: JoinSet::new(),
                    results: Vec::new(),
                    released: Vec::new(),
                    backoff_until: None,
                };
                runtime.block_on(round.run(&flag));
            })?;
        Ok(Dispatcher {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops claiming, waits (up to 5 s) for the jobs in flight, stores their
    /// results and ends the thread. Jobs still running stay claimed; the store
    /// gives them back at the next start.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.0.store(true, Ordering::SeqCst);
        self.stop.1.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The dispatcher thread's state.
struct Rounds {
    queue: Arc<dyn JobQueue>,
    target: Arc<dyn DispatchTarget>,
    budget: Budget,
    metrics: DispatchMetrics,
    config: DispatcherConfig,
    in_flight: JoinSet<(JobId, Dispatched)>,
    results: Vec<(JobId, Outcome)>,
    released: Vec<JobId>,
    /// No claims before this (after the target was unavailable).
    backoff_until: Option<Instant>,
}

impl Rounds {
    async fn run(&mut self, stop: &(AtomicBool, Notify)) {
        let expire_every =
            (self.config.result_ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(60));
        let mut last_expire = Instant::now() - expire_every;
        let mut last_counts = Instant::now() - Duration::from_secs(1);
        let mut last_reclaim = Instant::now();
        while !stop.0.load(Ordering::SeqCst) {
            self.dispatch_round().await;
            tokio::select! {
                ended = self.in_flight.join_next(), if !self.in_flight.is_empty() => {
                    if let Some(ended) = ended {
                        self.ended(ended);
                    }
                }
                _ = tokio::time::sleep(self.config.tick) => {}
                _ = stop.1.notified() => {}
            }
            while let Some(ended) = self.in_flight.try_join_next() {
                self.ended(ended);
            }
            let now = Instant::now();
            if now.duration_since(last_counts) >= Duration::from_millis(200) {
                last_counts = now;
                match self.queue.counts() {
                    Ok(counts) => self.metrics.set_counts(&counts),
                    Err(e) => spdlog::warn!("jobs: cannot read the store's counts: {e}"),
                }
            }
            if now.duration_since(last_expire) >= expire_every {
                last_expire = now;
                if let Err(e) = self
                    .queue
                    .expire(SystemTime::now() - self.config.result_ttl)
                {
                    spdlog::warn!("jobs: expiring old results failed: {e}");
                }
            }
            if now.duration_since(last_reclaim) >= self.config.reclaim_after / 4 {
                last_reclaim = now;
                if let Err(e) = self
                    .queue
                    .reclaim(&self.config.consumer, self.config.reclaim_after)
                {
                    spdlog::warn!("jobs: reclaiming a dead consumer's jobs failed: {e}");
                }
            }
        }
        // Stopping: the jobs in flight get a few seconds to end.
        let deadline = tokio::time::sleep(Duration::from_secs(5));
        tokio::pin!(deadline);
        while !self.in_flight.is_empty() {
            tokio::select! {
                Some(ended) = self.in_flight.join_next() => self.ended(ended),
                _ = &mut deadline => break,
            }
        }
        self.in_flight.abort_all();
        self.store_results();
    }

    /// Reads the target, updates the budget, stores what ended and claims what
    /// the budget allows, in one store call, and starts the claimed jobs.
    async fn dispatch_round(&mut self) {
        let reading = self.target.read().await;
        let in_flight = self.in_flight.len();
        let figures = self.budget.update(reading, in_flight);
        self.metrics.set_figures(&figures, in_flight);
        let backing_off = self.backoff_until.is_some_and(|t| Instant::now() < t);
        let room = match backing_off {
            true => 0,
            false => figures.budget.saturating_sub(in_flight).min(MAX_CLAIM),
        };
        if room == 0 && self.results.is_empty() && self.released.is_empty() {
            return;
        }
        let jobs = match self.queue.settle_and_claim(
            &self.results,
            &self.released,
            &self.config.consumer,
            room,
        ) {
            Ok(jobs) => {
                self.results.clear();
                self.released.clear();
                jobs
            }
            Err(e) => {
                // Kept: tried again next round (the jobs stay running meanwhile).
                spdlog::error!(
                    "jobs: storing {} result(s) and claiming failed: {e}",
                    self.results.len()
                );
                return;
            }
        };
        for job in jobs {
            let id = job.id.clone();
            let run = self.target.dispatch(job);
            self.in_flight.spawn(async move { (id, run.await) });
            self.metrics.dispatched.inc();
        }
        self.metrics.in_flight.set(self.in_flight.len() as i64);
    }

    /// Notes how a job went.
    fn ended(&mut self, ended: Result<(JobId, Dispatched), tokio::task::JoinError>) {
        let Ok((id, dispatched)) = ended else {
            // Only an aborted task ends so: its job stays claimed until reclaimed.
            return;
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

    /// Stores the results and releases gathered so far (kept to retry when the
    /// store fails).
    fn store_results(&mut self) {
        if !self.results.is_empty() {
            match self.queue.complete(&self.results) {
                Ok(()) => self.results.clear(),
                // Kept: tried again next round (the jobs stay running meanwhile).
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
