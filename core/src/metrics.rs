//! Prometheus metrics (prometheus-client), per model. Each worker group takes its
//! handles once at load, so the hot path only touches atomics and, per batch, the
//! histograms' own locks.

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    model: String,
    outcome: String,
}

/// How a request ended, as counted in `kiln_requests_total{outcome}`.
/// `rejected`: refused for a full queue (429); `timeout`: its queue timeout passed;
/// `cancelled`: its client went away before it was batched.
pub const OUTCOMES: [&str; 7] = [
    "success",
    "failure",
    "rejected",
    "invalid",
    "unavailable",
    "timeout",
    "cancelled",
];

type HistogramFamily = Family<ModelLabels, Histogram, fn() -> Histogram>;

fn duration_histogram() -> Histogram {
    // 10 µs .. ~84 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 24))
}

fn batch_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 14))
}

/// All of the server's metrics.
pub struct Metrics {
    registry: Mutex<Registry>,
    requests: Family<OutcomeLabels, Counter>,
    queue: HistogramFamily,
    compute: HistogramFamily,
    batch_size: HistogramFamily,
    pending: Family<ModelLabels, Gauge>,
    pool_in_use: Family<ModelLabels, Gauge>,
    pool_size: Family<ModelLabels, Gauge>,
    instances: Family<ModelLabels, Gauge>,
    sequences: Family<ModelLabels, Gauge>,
    sequence_backlog: Family<ModelLabels, Gauge>,
    host_restarts: Family<ModelLabels, Counter>,
}

/// One model's metric handles.
#[derive(Clone)]
pub struct ModelMetrics {
    pub success: Counter,
    pub failure: Counter,
    pub rejected: Counter,
    pub invalid: Counter,
    pub unavailable: Counter,
    pub timeout: Counter,
    pub cancelled: Counter,
    pub queue_seconds: Histogram,
    pub compute_seconds: Histogram,
    pub batch_size: Histogram,
    pub pending: Gauge,
    pub pool_in_use: Gauge,
    pub pool_size: Gauge,
    pub instances: Gauge,
    /// Live sequences (sequence batcher).
    pub sequences: Gauge,
    /// Sequences waiting for a live one to end (sequence batcher).
    pub sequence_backlog: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The registry with every family registered.
    pub fn new() -> Metrics {
        let metrics = Metrics {
            registry: Mutex::new(Registry::default()),
            requests: Family::default(),
            queue: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            compute: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            batch_size: Family::new_with_constructor(batch_histogram as fn() -> Histogram),
            pending: Family::default(),
            pool_in_use: Family::default(),
            pool_size: Family::default(),
            instances: Family::default(),
            sequences: Family::default(),
            sequence_backlog: Family::default(),
            host_restarts: Family::default(),
        };
        {
            let mut r = metrics.registry.lock();
            r.register(
                "kiln_requests",
                "Inference requests by model and outcome",
                metrics.requests.clone(),
            );
            r.register(
                "kiln_queue_duration_seconds",
                "Time from a request's arrival to the start of its batch",
                metrics.queue.clone(),
            );
            r.register(
                "kiln_compute_duration_seconds",
                "Time a worker spent running one batch",
                metrics.compute.clone(),
            );
            r.register(
                "kiln_batch_size",
                "Requests per batch run",
                metrics.batch_size.clone(),
            );
            r.register(
                "kiln_pending_requests",
                "Requests accepted and not yet answered",
                metrics.pending.clone(),
            );
            r.register(
                "kiln_buffer_pool_in_use",
                "Buffer sets (batches) in flight",
                metrics.pool_in_use.clone(),
            );
            r.register(
                "kiln_buffer_pool_size",
                "Buffer sets in the pool: the bound on batches in flight",
                metrics.pool_size.clone(),
            );
            r.register(
                "kiln_worker_instances",
                "Worker instances able to run batches",
                metrics.instances.clone(),
            );
            r.register(
                "kiln_sequences_active",
                "Live sequences of a stateful model (sequence batcher)",
                metrics.sequences.clone(),
            );
            r.register(
                "kiln_sequence_backlog",
                "Sequences waiting for a live one to end (sequence batcher)",
                metrics.sequence_backlog.clone(),
            );
            r.register(
                "kiln_worker_host_restarts",
                "Worker host processes started again after one died (isolation = \"process\")",
                metrics.host_restarts.clone(),
            );
            r.register_collector(Box::new(crate::process_metrics::ProcessCollector));
        }
        metrics
    }

    /// The handles for `model`, created on first use.
    pub fn model(&self, model: &str) -> ModelMetrics {
        let m = ModelLabels {
            model: model.to_owned(),
        };
        let outcome = |o: &str| {
            self.requests.get_or_create_owned(&OutcomeLabels {
                model: model.to_owned(),
                outcome: o.to_owned(),
            })
        };
        ModelMetrics {
            success: outcome("success"),
            failure: outcome("failure"),
            rejected: outcome("rejected"),
            invalid: outcome("invalid"),
            unavailable: outcome("unavailable"),
            timeout: outcome("timeout"),
            cancelled: outcome("cancelled"),
            queue_seconds: self.queue.get_or_create_owned(&m),
            compute_seconds: self.compute.get_or_create_owned(&m),
            batch_size: self.batch_size.get_or_create_owned(&m),
            pending: self.pending.get_or_create_owned(&m),
            pool_in_use: self.pool_in_use.get_or_create_owned(&m),
            pool_size: self.pool_size.get_or_create_owned(&m),
            instances: self.instances.get_or_create_owned(&m),
            sequences: self.sequences.get_or_create_owned(&m),
            sequence_backlog: self.sequence_backlog.get_or_create_owned(&m),
        }
    }

    /// `kiln_worker_host_restarts_total{model}`, created on first use (a model
    /// loaded with `isolation = "process"`).
    pub fn host_restarts(&self, model: &str) -> Counter {
        self.host_restarts.get_or_create_owned(&ModelLabels {
            model: model.to_owned(),
        })
    }

    /// Drops every series of `model` (after it is unloaded).
    pub fn remove(&self, model: &str) {
        let m = ModelLabels {
            model: model.to_owned(),
        };
        for o in OUTCOMES {
            self.requests.remove(&OutcomeLabels {
                model: model.to_owned(),
                outcome: o.to_owned(),
            });
        }
        self.host_restarts.remove(&m);
        for family in [&self.queue, &self.compute, &self.batch_size] {
            family.remove(&m);
        }
        for family in [
            &self.pending,
            &self.pool_in_use,
            &self.pool_size,
            &self.instances,
            &self.sequences,
            &self.sequence_backlog,
        ] {
            family.remove(&m);
        }
    }

    /// The Prometheus text exposition of everything.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        out
    }
}
