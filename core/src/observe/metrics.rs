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
use std::sync::atomic::AtomicU64;

/// A model version's series, labelled as Triton's (`model`, `version`): the
/// versions of one model served side by side are counted apart.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
    version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    model: String,
    version: String,
    outcome: String,
}

/// A series of the model as a whole (its worker hosts, whatever the version).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NameLabels {
    model: String,
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
/// A counter of seconds.
type Seconds = Counter<f64, AtomicU64>;
/// A gauge of a fraction.
type Fraction = Gauge<f64, AtomicU64>;

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
    pool_in_use_max: Family<ModelLabels, Gauge>,
    outstanding: Family<ModelLabels, Gauge>,
    outstanding_max: Family<ModelLabels, Gauge>,
    instances: Family<ModelLabels, Gauge>,
    sequences: Family<ModelLabels, Gauge>,
    sequence_backlog: Family<ModelLabels, Gauge>,
    host_restarts: Family<NameLabels, Counter>,
    queue_depth: Family<ModelLabels, Gauge>,
    capacity: Family<ModelLabels, Gauge>,
    pool_free: Family<ModelLabels, Gauge>,
    busy_seconds: Family<ModelLabels, Seconds>,
    busy_fraction: Family<ModelLabels, Fraction>,
    stream: crate::observe::stream_metrics::StreamMetrics,
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
    /// The most buffer sets in flight at once since the load.
    pub pool_in_use_max: Gauge,
    /// Batches submitted to the asynchronous instances and not yet completed.
    pub outstanding: Gauge,
    /// The most batches outstanding at once since the load.
    pub outstanding_max: Gauge,
    pub instances: Gauge,
    /// Live sequences (sequence batcher).
    pub sequences: Gauge,
    /// Sequences waiting for a live one to end (sequence batcher).
    pub sequence_backlog: Gauge,
    /// Set at scrape time ([`crate::group::WorkerGroup::refresh_gauges`]): requests
    /// admitted and not yet in a batch, buffer sets free, the instances' time
    /// running batches, and its share of the time since the previous scrape.
    pub queue_depth: Gauge,
    /// Requests it can have in batches at once (a jobs dispatcher's `max_sys`;
    /// [`crate::group::GroupLoad::capacity`]), set at scrape time.
    pub capacity: Gauge,
    pub pool_free: Gauge,
    pub busy_seconds: Seconds,
    pub busy_fraction: Fraction,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The registry with every family registered.
    pub fn new() -> Metrics {
        // The WebSocket streams' families come first in the exposition.
        let mut registry = Registry::default();
        let stream = crate::observe::stream_metrics::StreamMetrics::register(&mut registry);
        let metrics = Metrics {
            registry: Mutex::new(registry),
            requests: Family::default(),
            queue: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            compute: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            batch_size: Family::new_with_constructor(batch_histogram as fn() -> Histogram),
            pending: Family::default(),
            pool_in_use: Family::default(),
            pool_size: Family::default(),
            pool_in_use_max: Family::default(),
            outstanding: Family::default(),
            outstanding_max: Family::default(),
            instances: Family::default(),
            sequences: Family::default(),
            sequence_backlog: Family::default(),
            host_restarts: Family::default(),
            queue_depth: Family::default(),
            capacity: Family::default(),
            pool_free: Family::default(),
            busy_seconds: Family::default(),
            busy_fraction: Family::default(),
            stream,
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
                "kiln_buffer_pool_in_use_max",
                "The most buffer sets in flight at once since the model was loaded (asynchronous workers)",
                metrics.pool_in_use_max.clone(),
            );
            r.register(
                "kiln_outstanding_batches",
                "Batches submitted to an asynchronous worker and not yet completed",
                metrics.outstanding.clone(),
            );
            r.register(
                "kiln_outstanding_batches_max",
                "The most batches outstanding at once since the model was loaded",
                metrics.outstanding_max.clone(),
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
            r.register(
                "kiln_queue_depth",
                "Requests admitted and not yet in a batch (the bound is queue_size)",
                metrics.queue_depth.clone(),
            );
            r.register(
                "kiln_request_capacity",
                "Requests the model runs at once: healthy instances x batch_size (x max_outstanding), at most queue_size (a jobs dispatcher's max_sys)",
                metrics.capacity.clone(),
            );
            r.register(
                "kiln_buffer_pool_free",
                "Buffer sets free: batches that can start forming now",
                metrics.pool_free.clone(),
            );
            r.register(
                "kiln_instance_busy_seconds",
                "Time the worker instances spent running batches, summed over instances",
                metrics.busy_seconds.clone(),
            );
            r.register(
                "kiln_instance_busy_fraction",
                "Share of the instances' time spent running batches since the previous scrape (0..1)",
                metrics.busy_fraction.clone(),
            );
            r.register_collector(Box::new(crate::observe::process_metrics::ProcessCollector));
        }
        metrics
    }

    /// Adds a collector read on each scrape (a server-wide figure kept elsewhere).
    pub fn register_collector(&self, collector: Box<dyn prometheus_client::collector::Collector>) {
        self.registry.lock().register_collector(collector);
    }

    /// The handles for version `version` of `model`, created on first use.
    pub fn model(&self, model: &str, version: &str) -> ModelMetrics {
        let m = ModelLabels {
            model: model.to_owned(),
            version: version.to_owned(),
        };
        let outcome = |o: &str| {
            self.requests.get_or_create_owned(&OutcomeLabels {
                model: model.to_owned(),
                version: version.to_owned(),
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
            pool_in_use_max: self.pool_in_use_max.get_or_create_owned(&m),
            outstanding: self.outstanding.get_or_create_owned(&m),
            outstanding_max: self.outstanding_max.get_or_create_owned(&m),
            instances: self.instances.get_or_create_owned(&m),
            sequences: self.sequences.get_or_create_owned(&m),
            sequence_backlog: self.sequence_backlog.get_or_create_owned(&m),
            queue_depth: self.queue_depth.get_or_create_owned(&m),
            capacity: self.capacity.get_or_create_owned(&m),
            pool_free: self.pool_free.get_or_create_owned(&m),
            busy_seconds: self.busy_seconds.get_or_create_owned(&m),
            busy_fraction: self.busy_fraction.get_or_create_owned(&m),
        }
    }

    /// The WebSocket stream handles for `model` (`kiln_stream_*`), created on first use.
    pub fn stream(&self, model: &str) -> crate::observe::stream_metrics::ModelStreamMetrics {
        self.stream.model(model)
    }

    /// `kiln_worker_host_restarts_total{model}`, created on first use (a model
    /// loaded with `isolation = "process"`).
    pub fn host_restarts(&self, model: &str) -> Counter {
        self.host_restarts.get_or_create_owned(&NameLabels {
            model: model.to_owned(),
        })
    }

    /// Drops every series of version `version` of `model` (after it is
    /// unloaded).
    pub fn remove(&self, model: &str, version: &str) {
        let m = ModelLabels {
            model: model.to_owned(),
            version: version.to_owned(),
        };
        for o in OUTCOMES {
            self.requests.remove(&OutcomeLabels {
                model: model.to_owned(),
                version: version.to_owned(),
                outcome: o.to_owned(),
            });
        }
        for family in [&self.queue, &self.compute, &self.batch_size] {
            family.remove(&m);
        }
        for family in [
            &self.pending,
            &self.pool_in_use,
            &self.pool_size,
            &self.pool_in_use_max,
            &self.outstanding,
            &self.outstanding_max,
            &self.instances,
            &self.sequences,
            &self.sequence_backlog,
            &self.queue_depth,
            &self.capacity,
            &self.pool_free,
        ] {
            family.remove(&m);
        }
        self.busy_seconds.remove(&m);
        self.busy_fraction.remove(&m);
    }

    /// Drops the series of `model` as a whole (once no version of it is loaded).
    pub fn remove_model(&self, model: &str) {
        self.host_restarts.remove(&NameLabels {
            model: model.to_owned(),
        });
        self.stream.remove(model);
    }

    /// Registers more families (another crate's metrics) in the registry.
    pub fn register(&self, register: impl FnOnce(&mut Registry)) {
        register(&mut self.registry.lock());
    }

    /// The Prometheus text exposition (format 0.0.4) of everything.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        open_metrics_to_text(&out)
    }
}

/// prometheus-client writes OpenMetrics: a counter's `# HELP` and `# TYPE` name its
/// family (`kiln_requests`) while its samples are `kiln_requests_total`, and the
/// text ends with `# EOF`. The text format 0.0.4 that `/metrics` announces (and
/// that `promtool check metrics` reads) names the samples themselves: a counter's
/// metadata lines get `_total` and `# EOF` goes. Without this, Prometheus and
/// promtool see `kiln_requests_total` without help or type (promtool fails).
fn open_metrics_to_text(open_metrics: &str) -> String {
    let counters: Vec<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len() + 16 * counters.len());
    for line in open_metrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(&name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_by_their_samples_and_no_eof_is_left() {
        let open = "# HELP kiln_requests Inference requests.\n# TYPE kiln_requests counter\n\
                    kiln_requests_total{model=\"m\"} 3\n# HELP kiln_pending Pending.\n\
                    # TYPE kiln_pending gauge\nkiln_pending{model=\"m\"} 1\n# EOF\n";
        assert_eq!(
            open_metrics_to_text(open),
            "# HELP kiln_requests_total Inference requests.\n# TYPE kiln_requests_total counter\n\
             kiln_requests_total{model=\"m\"} 3\n# HELP kiln_pending Pending.\n\
             # TYPE kiln_pending gauge\nkiln_pending{model=\"m\"} 1\n"
        );
    }

    #[test]
    fn every_family_of_a_loaded_model_is_exposed() {
        let metrics = Metrics::new();
        let _m = metrics.model("m", "1");
        let text = metrics.encode();
        for name in [
            "kiln_requests_total",
            "kiln_queue_depth",
            "kiln_request_capacity",
            "kiln_buffer_pool_free",
            "kiln_instance_busy_seconds_total",
            "kiln_instance_busy_fraction",
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}: {text}");
            assert!(
                text.contains(&format!("{name}{{model=\"m\"")),
                "{name}: {text}"
            );
        }
        assert!(!text.contains("# EOF"));
    }
}
