//! Per-model inference statistics in Triton's schema (`GET /v2/models/{m}/stats`),
//! measured on the instance threads; each protocol renders a [`StatsSnapshot`]
//! (REST in `http/triton.rs`, gRPC in `grpc/convert.rs`).
//!
//! Every number follows Triton's meaning: `inference_count` is the sum of the
//! batch rows of successful requests, `execution_count` the batches run; in
//! `inference_stats`, `success`, `queue` and the three `compute_*` stages count
//! successful requests, and each request is charged its whole batch's compute
//! time (so `ns / count` is the average per request, as perf_analyzer reads it);
//! `fail` counts accepted requests answered with an error. `batch_stats` has one
//! entry per batch size (in rows) with the batch-level durations.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// A count and a cumulative duration, Triton's `StatisticDuration`.
#[derive(Default)]
struct Stat {
    count: AtomicU64,
    ns: AtomicU64,
}

impl Stat {
    fn add(&self, count: u64, ns: u64) {
        self.count.fetch_add(count, Ordering::Relaxed);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn read(&self) -> StatDuration {
        StatDuration {
            count: self.count.load(Ordering::Relaxed),
            ns: self.ns.load(Ordering::Relaxed),
        }
    }
}

/// A count and a cumulative duration in nanoseconds, as read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatDuration {
    pub count: u64,
    pub ns: u64,
}

/// One batch size's totals, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSizeStats {
    /// Rows per batch.
    pub batch_size: u64,
    pub compute_input: StatDuration,
    pub compute_infer: StatDuration,
    pub compute_output: StatDuration,
}

/// A group's statistics read at one moment, for any protocol to render.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Milliseconds since the epoch; 0: never.
    pub last_inference: u64,
    pub inference_count: u64,
    pub execution_count: u64,
    pub success: StatDuration,
    pub fail: StatDuration,
    pub queue: StatDuration,
    pub compute_input: StatDuration,
    pub compute_infer: StatDuration,
    pub compute_output: StatDuration,
    /// One entry per batch size seen, by size.
    pub batches: Vec<BatchSizeStats>,
}

/// One batch size's totals: batches of that size and their stage durations.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct BatchTotals {
    count: u64,
    input_ns: u64,
    infer_ns: u64,
    output_ns: u64,
}

/// How long the compute stages of one successful batch took.
#[derive(Debug, Clone, Copy)]
pub struct BatchTiming {
    /// Building the boundary batch (`BatchFfi`).
    pub input: Duration,
    /// The plugin's `run`.
    pub infer: Duration,
    /// Splitting the outputs and building every response.
    pub output: Duration,
}

/// A group's statistics, shared by its instances.
///
/// The request-level counters are plain atomics (relaxed: each is exact, and a
/// reader racing a batch may see some of that batch's counters and not others).
/// Per-batch-size totals live in a mutex-protected map rather than a fixed array
/// of atomics: it is touched once per batch (never per request), so the lock is
/// one uncontended acquire next to a plugin call, and the map holds only the
/// sizes actually seen, however large `batch_size` is, already sorted for
/// rendering.
#[derive(Default)]
pub struct ModelStats {
    last_inference_ms: AtomicU64,
    inference_count: AtomicU64,
    execution_count: AtomicU64,
    success: Stat,
    fail: Stat,
    queue: Stat,
    compute_input: Stat,
    compute_infer: Stat,
    compute_output: Stat,
    batches: Mutex<BTreeMap<u64, BatchTotals>>,
}

/// `d` in nanoseconds, saturating.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl ModelStats {
    /// Records a batch of `requests` requests and `rows` rows that ran and was
    /// answered; `queue_ns` is the sum of its requests' waits (arrival to
    /// the start of its batch).
    pub fn record_success(&self, requests: usize, rows: usize, queue_ns: u64, timing: BatchTiming) {
        let n = requests as u64;
        let (input, infer, output) = (
            nanos(timing.input),
            nanos(timing.infer),
            nanos(timing.output),
        );
        let total = input.saturating_add(infer).saturating_add(output);
        self.queue.add(n, queue_ns);
        self.compute_input.add(n, input.saturating_mul(n));
        self.compute_infer.add(n, infer.saturating_mul(n));
        self.compute_output.add(n, output.saturating_mul(n));
        // Each request waited, then took its whole batch's time.
        self.success
            .add(n, queue_ns.saturating_add(total.saturating_mul(n)));
        self.inference_count
            .fetch_add(rows as u64, Ordering::Relaxed);
        self.execution_count.fetch_add(1, Ordering::Relaxed);
        {
            let mut batches = self.batches.lock();
            let entry = batches.entry(rows as u64).or_default();
            entry.count += 1;
            entry.input_ns = entry.input_ns.saturating_add(input);
            entry.infer_ns = entry.infer_ns.saturating_add(infer);
            entry.output_ns = entry.output_ns.saturating_add(output);
        }
        self.last_inference_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Records one ensemble request of `rows` rows answered in `ns` (arrival to
    /// answer): Triton counts an ensemble's requests and rows, its steps' batches
    /// are their own models'.
    pub fn record_request(&self, rows: usize, ns: u64) {
        self.success.add(1, ns);
        self.inference_count
            .fetch_add(rows as u64, Ordering::Relaxed);
        self.execution_count.fetch_add(1, Ordering::Relaxed);
        self.last_inference_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Records `requests` accepted requests answered with an error; `ns` is the
    /// sum of their times from arrival to the error.
    pub fn record_failure(&self, requests: usize, ns: u64) {
        self.fail.add(requests as u64, ns);
        self.last_inference_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Reads every counter (each exactly; a batch recorded meanwhile may show in
    /// some and not others).
    pub fn snapshot(&self) -> StatsSnapshot {
        let batches = self
            .batches
            .lock()
            .iter()
            .map(|(&batch_size, t)| {
                let stage = |ns: u64| StatDuration { count: t.count, ns };
                BatchSizeStats {
                    batch_size,
                    compute_input: stage(t.input_ns),
                    compute_infer: stage(t.infer_ns),
                    compute_output: stage(t.output_ns),
                }
            })
            .collect();
        StatsSnapshot {
            last_inference: self.last_inference_ms.load(Ordering::Relaxed),
            inference_count: self.inference_count.load(Ordering::Relaxed),
            execution_count: self.execution_count.load(Ordering::Relaxed),
            success: self.success.read(),
            fail: self.fail.read(),
            queue: self.queue.read(),
            compute_input: self.compute_input.read(),
            compute_infer: self.compute_infer.read(),
            compute_output: self.compute_output.read(),
            batches,
        }
    }
}
