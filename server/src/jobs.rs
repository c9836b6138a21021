//! Offline jobs in the binary: the `--jobs*` flags, and [`Jobs`], the store and
//! its dispatcher, which the HTTP job routes use (`http/jobs.rs`). See
//! `docs/jobs.md`; the store, budget and dispatcher are kiln-jobs'.
//!
//! The store is opened at start when `--jobs` (or `KILN_JOBS`) names one, or
//! when the default folder already holds a store (jobs left by an earlier run
//! resume at once); otherwise at the first submission, so a server that never
//! sees a job creates no folder.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kiln_jobs::remote::{RemoteConfig, RemoteTarget};
use kiln_jobs::{
    BackendUrl, BudgetConfig, DispatchMetrics, DispatchTarget, Dispatcher, DispatcherConfig,
    JobQueue, JobsError,
};
use parking_lot::Mutex;

use kiln_core::error::ServerError;
use kiln_core::Server;

/// The jobs flags (`kiln serve`).
#[derive(Args, Debug, Clone)]
pub struct JobsArgs {
    /// The job store: `file:PATH` (the embedded store, a folder; default
    /// `file:kiln-jobs` in the working directory) or `redis://HOST:PORT/...`.
    #[arg(long = "jobs", env = "KILN_JOBS")]
    pub jobs: Option<String>,
    /// Seconds a finished job (done, failed, cancelled) and its result are kept.
    #[arg(long, env = "KILN_JOBS_RESULT_TTL", default_value_t = 86_400.0)]
    pub jobs_result_ttl: f64,
    /// The dispatch budget's max_sys: requests the server runs at once (default:
    /// the sum over the loaded models of instances × batch_size, each at most its
    /// queue_size); 0 holds every job queued.
    #[arg(long, env = "KILN_JOBS_MAX_SYS")]
    pub jobs_max_sys: Option<f64>,
    /// The budget's baseline B, kept for realtime bursts.
    #[arg(long, env = "KILN_JOBS_BASELINE", default_value_t = 0.05)]
    pub jobs_baseline: f64,
    /// The budget's cap u: at most floor(max_sys × min(D, u)) jobs in flight.
    #[arg(long, env = "KILN_JOBS_CAP", default_value_t = 0.8)]
    pub jobs_cap: f64,
    /// Feed the jobs to this KServe v2 server (`http://HOST:PORT`), reading its
    /// `/metrics` for the budget, instead of to this server's own models.
    #[arg(long, env = "KILN_JOBS_TARGET")]
    pub jobs_target: Option<String>,
    /// The `priority` parameter jobs carry to `--jobs-target` (its lowest level;
    /// default: none, the target's default level).
    #[arg(long, env = "KILN_JOBS_TARGET_PRIORITY")]
    pub jobs_target_priority: Option<u32>,
    /// Seconds between two scrapes of `--jobs-target`'s `/metrics`.
    #[arg(long, env = "KILN_JOBS_TARGET_SCRAPE_INTERVAL", default_value_t = 0.1)]
    pub jobs_target_scrape_interval: f64,
    /// This server's name as a consumer of a shared (Redis) queue: unique among
    /// the replicas, and best stable across restarts (default: HOSTNAME-PID).
    #[arg(long, env = "KILN_JOBS_CONSUMER")]
    pub jobs_consumer: Option<String>,
    /// Seconds a job may stay claimed by a replica that does not answer for it
    /// before another replica takes it back (Redis: XAUTOCLAIM's min-idle-time).
    #[arg(long, env = "KILN_JOBS_CLAIM_TIMEOUT", default_value_t = 300.0)]
    pub jobs_claim_timeout: f64,
    /// Most jobs one submission (`POST /v2/models/{m}/jobs`) may carry; more: 413.
    #[arg(long, env = "KILN_JOBS_MAX_PER_SUBMISSION", default_value_t = DEFAULT_MAX_PER_SUBMISSION)]
    pub jobs_max_per_submission: usize,
    /// Most bytes one submission's body may carry (default: `--max-body-bytes`,
    /// as for an inference); more: 413.
    #[arg(long, env = "KILN_JOBS_MAX_SUBMISSION_BYTES")]
    pub jobs_max_submission_bytes: Option<usize>,
    /// Most jobs the store holds, in every state (finished ones count until they
    /// expire, `--jobs-result-ttl`); a submission that would pass it: 429 at once.
    #[arg(long, env = "KILN_JOBS_MAX_STORED", default_value_t = DEFAULT_MAX_STORED)]
    pub jobs_max_stored: u64,
}

/// `--jobs-max-per-submission`'s default. Also what bounds one redb commit
/// (one transaction a submission); Redis takes any size in bounded chunks.
pub const DEFAULT_MAX_PER_SUBMISSION: usize = 10_000;
/// `--jobs-max-stored`'s default.
pub const DEFAULT_MAX_STORED: u64 = 1_000_000;

/// What one submission and the store may hold.
#[derive(Debug, Clone, Copy)]
pub struct JobsLimits {
    pub max_per_submission: usize,
    /// `None`: `--max-body-bytes`.
    pub max_submission_bytes: Option<usize>,
    pub max_stored: u64,
}

impl JobsArgs {
    /// The settings the flags give.
    pub fn config(&self) -> Result<JobsConfig, String> {
        let (url, explicit) = match &self.jobs {
            Some(url) => (url.as_str(), true),
            None => (kiln_jobs::backend::DEFAULT_URL, false),
        };
        let url = BackendUrl::parse(url).map_err(|e| e.to_string())?;
        let budget = BudgetConfig {
            max_sys: self.jobs_max_sys,
            baseline: self.jobs_baseline,
            cap: self.jobs_cap,
        }
        .validate()?;
        let result_ttl = Duration::try_from_secs_f64(self.jobs_result_ttl).map_err(|_| {
            format!(
                "--jobs-result-ttl {}: not a number of seconds",
                self.jobs_result_ttl
            )
        })?;
        let secs = |flag: &str, v: f64| {
            Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("--{flag} {v}: not a positive number of seconds"))
        };
        let reclaim_after = secs("jobs-claim-timeout", self.jobs_claim_timeout)?;
        let target = match &self.jobs_target {
            None => None,
            Some(url) => Some(RemoteConfig {
                scrape_interval: secs(
                    "jobs-target-scrape-interval",
                    self.jobs_target_scrape_interval,
                )?,
                priority: self.jobs_target_priority,
                ..RemoteConfig::new(url)
            }),
        };
        if self.jobs_max_per_submission == 0 || self.jobs_max_stored == 0 {
            return Err("--jobs-max-per-submission and --jobs-max-stored: at least 1".into());
        }
        let limits = JobsLimits {
            max_per_submission: self.jobs_max_per_submission,
            max_submission_bytes: self.jobs_max_submission_bytes,
            max_stored: self.jobs_max_stored,
        };
        let consumer = self.jobs_consumer.clone().unwrap_or_else(default_consumer);
        if consumer.is_empty() || consumer.len() > 200 {
            return Err(format!("--jobs-consumer `{consumer}`: 1 to 200 characters"));
        }
        Ok(JobsConfig {
            url,
            explicit,
            limits,
            target,
            dispatcher: DispatcherConfig {
                budget,
                result_ttl,
                consumer,
                reclaim_after,
                ..DispatcherConfig::default()
            },
        })
    }
}

/// `HOSTNAME-PID`: unique among replicas on different hosts and processes.
fn default_consumer() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kiln".into());
    format!("{host}-{}", std::process::id())
}

/// The jobs settings.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    pub url: BackendUrl,
    /// A remote server to feed (`--jobs-target`); `None`: this server.
    pub target: Option<RemoteConfig>,
    /// Named by the operator (opened at start) rather than the default.
    pub explicit: bool,
    pub limits: JobsLimits,
    pub dispatcher: DispatcherConfig,
}

/// An open store and the dispatcher draining it.
struct Open {
    queue: Arc<dyn JobQueue>,
    dispatcher: Option<Dispatcher>,
}

/// The store and its dispatcher, opened at start or at the first submission.
pub struct Jobs {
    server: Server,
    config: JobsConfig,
    metrics: DispatchMetrics,
    open: Mutex<Option<Open>>,
}

/// A store's error as the server answers it.
pub fn server_error(e: JobsError) -> ServerError {
    match e {
        JobsError::Invalid(m) => ServerError::InvalidRequest(m),
        JobsError::Full(m) => ServerError::Exhausted(m),
        JobsError::Store(_) | JobsError::Config(_) => ServerError::Unavailable(e.to_string()),
    }
}

impl std::fmt::Debug for Jobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jobs")
            .field("config", &self.config)
            .finish()
    }
}

impl Jobs {
    /// Registers the metrics and, when the operator named a store or the default
    /// one exists, opens it and starts the dispatcher.
    pub fn start(server: Server, config: JobsConfig) -> Result<Arc<Jobs>, JobsError> {
        let metrics = DispatchMetrics::default();
        server.register_metrics(|registry| metrics.register(registry));
        let exists = match &config.url {
            BackendUrl::File(dir) => dir.join("jobs.redb").exists(),
            BackendUrl::Redis(_) => false,
        };
        let jobs = Arc::new(Jobs {
            server,
            metrics,
            open: Mutex::new(None),
            config,
        });
        if jobs.config.explicit || exists {
            jobs.queue(true)?;
        }
        Ok(jobs)
    }

    /// The store; `None` while it is not open and `create` is false. Opening
    /// blocks (the disk); call it where blocking is allowed.
    pub fn queue(&self, create: bool) -> Result<Option<Arc<dyn JobQueue>>, JobsError> {
        let mut open = self.open.lock();
        if let Some(open) = open.as_ref() {
            return Ok(Some(open.queue.clone()));
        }
        if !create {
            return Ok(None);
        }
        let queue = self.config.url.open()?;
        let target: Arc<dyn DispatchTarget> = match &self.config.target {
            Some(remote) => Arc::new(RemoteTarget::new(remote.clone()).map_err(JobsError::Config)?),
            None => Arc::new(kiln_jobs::local::LocalTarget::new(self.server.clone())),
        };
        let dispatcher = Dispatcher::start(
            queue.clone(),
            target,
            self.config.dispatcher.clone(),
            self.metrics.clone(),
        )
        .map_err(|e| JobsError::Store(format!("cannot start the dispatcher: {e}")))?;
        spdlog::info!(
            "jobs: store {:?} open, dispatcher started (consumer `{}`, target {})",
            self.config.url,
            self.config.dispatcher.consumer,
            self.config
                .target
                .as_ref()
                .map_or("this server", |t| t.url.as_str())
        );
        *open = Some(Open {
            queue: queue.clone(),
            dispatcher: Some(dispatcher),
        });
        Ok(Some(queue))
    }

    /// The submission and store limits.
    pub fn limits(&self) -> JobsLimits {
        self.config.limits
    }

    /// The server (its client-bytes budget).
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// Refuses `more` jobs when the store would then hold more than
    /// `--jobs-max-stored` (the counts are the store's own, kept with each
    /// write: one small read). Concurrent submissions may pass it by at most
    /// their own sizes, each bounded by `--jobs-max-per-submission`.
    pub fn check_quota(&self, queue: &dyn JobQueue, more: u64) -> Result<(), JobsError> {
        let c = queue.counts()?;
        let held = c.queued + c.running + c.done + c.failed + c.cancelled;
        let max = self.config.limits.max_stored;
        if held.saturating_add(more) > max {
            return Err(JobsError::Full(format!(
                "the job store holds {held} of its {max} jobs (--jobs-max-stored): \
                 retry once jobs have finished and expired"
            )));
        }
        Ok(())
    }

    /// Where a submission spills while it is read: the embedded store's folder,
    /// else the system's temporary folder.
    pub fn spool_dir(&self) -> PathBuf {
        match &self.config.url {
            BackendUrl::File(dir) => dir.clone(),
            BackendUrl::Redis(_) => std::env::temp_dir(),
        }
    }

    /// Stops the dispatcher: its jobs in flight get up to `wait` (the exit
    /// timeout) to finish; the rest go back to the queue.
    pub fn stop(&self, wait: Duration) {
        let dispatcher = self.open.lock().as_mut().and_then(|o| o.dispatcher.take());
        if let Some(dispatcher) = dispatcher {
            dispatcher.stop(wait);
        }
    }
}
