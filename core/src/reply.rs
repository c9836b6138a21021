//! How a request is answered once its batch has run: the [`Reply`] each queued
//! request carries, the [`Answer`] sent through it, and a stateful model's
//! [`SequenceLink`], through which its instance reports each sequence's new state
//! before answering. A leaf module: the group, its instances and the sequence
//! batcher's host all use these types.
//!
//! An instance thread answers with its request's row of the batch's outputs
//! ([`Answered`]: a shared pointer and an index), not with a built
//! [`InferResponse`]: the response (its names, shape and output list) is built by
//! whoever awaits it, on its own thread. So the instance thread allocates nothing
//! per request, and nothing allocated by one thread per request is freed by the
//! other: with glibc's per-thread arenas, such frees lock the other thread's arena
//! and made the two threads wait on each other (a fifth of the in-process CPU,
//! `docs/benchmarks.md`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kiln_batchers::sequence::SequenceEvent;
use kiln_worker_sdk::{Shape, WorkerInfo};
use tokio::sync::oneshot;

use crate::error::{Result, ServerError};
use crate::infer::{InferResponse, OutputTensor};
use crate::metrics::ModelMetrics;
use crate::request_log::RequestLog;
use crate::stats::{nanos, BatchTiming, ModelStats};

/// What a request is answered with: its row of a batch that ran, or its error.
pub type Answer = Result<Answered>;

/// How a request is answered once its batch has run.
pub struct Reply {
    pub tx: oneshot::Sender<Answer>,
    /// What log lines about the request name (its id, which its answer carries).
    pub log: RequestLog,
    /// Bit `i` set: return output `i`.
    pub output_mask: u64,
    /// The request's span, when its trace is sampled ([`crate::trace`]).
    /// Boxed, as [`RequestLog`]'s trace id: one word for a request not traced.
    pub trace: Option<Box<crate::trace::SpanIds>>,
}

/// The model an instance's answers name: built once per group.
pub struct AnswerModel {
    pub name: String,
    pub version: String,
    pub info: Arc<WorkerInfo>,
}

/// One output of a batch that ran: each request's slice (sharing one allocation)
/// and shape.
pub struct RunOutput {
    pub parts: Vec<Bytes>,
    pub shapes: Vec<Shape>,
}

/// A batch's outputs, shared by the answers of its requests, and the count of its
/// answers.
pub struct BatchOutputs {
    pub model: Arc<AnswerModel>,
    pub outputs: Vec<RunOutput>,
    pub tally: Tally,
}

/// A batch's answered requests, counted in `/metrics` and `/stats` when the last
/// of their answers is let go (the batch's outputs dropped): each as a success,
/// unless whoever answered the client reported that it failed on the way out
/// ([`Delivery::failed`]: a shared-memory output that does not fit its window, an
/// answer too large to encode). So the hot path counts once per batch, as before,
/// and a request that failed after its inference is never counted a success.
pub struct Tally {
    pub metrics: Arc<ModelMetrics>,
    pub stats: Arc<ModelStats>,
    /// The batch's requests answered with outputs, their rows and their waits.
    pub requests: usize,
    pub rows: usize,
    pub queue_ns: u64,
    pub timing: BatchTiming,
    /// Of those, the ones that failed on the way out (rare: atomics touched only
    /// then).
    invalid: AtomicU64,
    failed: AtomicU64,
    failed_rows: AtomicU64,
    failed_queue_ns: AtomicU64,
    failed_ns: AtomicU64,
}

impl Tally {
    /// The tally of `requests` requests (of `rows` rows, waiting `queue_ns` in all)
    /// answered by a batch that ran in `timing`.
    pub fn new(
        metrics: Arc<ModelMetrics>,
        stats: Arc<ModelStats>,
        (requests, rows, queue_ns): (usize, usize, u64),
        timing: BatchTiming,
    ) -> Tally {
        Tally {
            metrics,
            stats,
            requests,
            rows,
            queue_ns,
            timing,
            invalid: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failed_rows: AtomicU64::new(0),
            failed_queue_ns: AtomicU64::new(0),
            failed_ns: AtomicU64::new(0),
        }
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let invalid = *self.invalid.get_mut();
        let failed = *self.failed.get_mut();
        let lost = (invalid + failed) as usize;
        let succeeded = self.requests.saturating_sub(lost);
        if succeeded > 0 {
            let rows = self
                .rows
                .saturating_sub(*self.failed_rows.get_mut() as usize);
            let queue_ns = self
                .queue_ns
                .saturating_sub(*self.failed_queue_ns.get_mut());
            self.stats
                .record_success(succeeded, rows, queue_ns, self.timing);
        }
        if lost > 0 {
            self.stats.record_failure(lost, *self.failed_ns.get_mut());
        }
        self.metrics.success.inc_by(succeeded as u64);
        self.metrics.invalid.inc_by(invalid);
        self.metrics.failure.inc_by(failed);
    }
}

/// One request's answer: row `index` of a batch's outputs, the outputs it asked
/// for, its id, and what its tally needs should it fail on the way out.
pub struct Answered {
    pub batch: Arc<BatchOutputs>,
    pub index: usize,
    /// Bit `k` set: return output `k`.
    pub output_mask: u64,
    pub id: Option<String>,
    /// The request's rows, when it arrived and how long it waited for its batch.
    pub rows: usize,
    pub arrived: Instant,
    pub queue_ns: u64,
}

/// A request answered and on its way to its client: counted a success when
/// dropped, unless [`Delivery::failed`] says otherwise.
#[must_use = "dropping a Delivery counts its request a success"]
pub struct Delivery(Delivered);

enum Delivered {
    /// A row of a batch: its batch's [`Tally`] counts it.
    Batch {
        batch: Arc<BatchOutputs>,
        rows: usize,
        arrived: Instant,
        queue_ns: u64,
    },
    /// An ensemble's answer ([`crate::ensemble`]): counted on its own.
    Ensemble(EnsembleAnswer),
}

/// An ensemble request answered: counted a success in its ensemble's statistics
/// and metrics when dropped, unless it failed on the way out.
struct EnsembleAnswer {
    stats: Arc<ModelStats>,
    metrics: Arc<ModelMetrics>,
    rows: usize,
    arrived: Instant,
    counted: bool,
}

impl Drop for EnsembleAnswer {
    fn drop(&mut self) {
        if !self.counted {
            self.stats
                .record_request(self.rows, nanos(self.arrived.elapsed()));
            self.metrics.success.inc();
        }
    }
}

impl Delivery {
    /// The delivery of an ensemble's answer to a request of `rows` rows that
    /// arrived at `arrived`.
    pub fn ensemble(
        stats: Arc<ModelStats>,
        metrics: Arc<ModelMetrics>,
        rows: usize,
        arrived: Instant,
    ) -> Delivery {
        Delivery(Delivered::Ensemble(EnsembleAnswer {
            stats,
            metrics,
            rows,
            arrived,
            counted: false,
        }))
    }

    /// The request's answer could not be delivered (`error`, which its client
    /// gets instead): counted as invalid for a client's error, as a failure
    /// otherwise.
    pub fn failed(self, error: &ServerError) {
        let invalid = matches!(error, ServerError::InvalidRequest(_));
        match self.0 {
            Delivered::Batch {
                batch,
                rows,
                arrived,
                queue_ns,
            } => {
                let tally = &batch.tally;
                let counter = if invalid {
                    &tally.invalid
                } else {
                    &tally.failed
                };
                counter.fetch_add(1, Ordering::Relaxed);
                tally.failed_rows.fetch_add(rows as u64, Ordering::Relaxed);
                tally.failed_queue_ns.fetch_add(queue_ns, Ordering::Relaxed);
                tally
                    .failed_ns
                    .fetch_add(nanos(arrived.elapsed()), Ordering::Relaxed);
            }
            Delivered::Ensemble(mut answer) => {
                answer.counted = true;
                answer
                    .stats
                    .record_failure(1, nanos(answer.arrived.elapsed()));
                let counter = if invalid {
                    &answer.metrics.invalid
                } else {
                    &answer.metrics.failure
                };
                counter.inc();
            }
        }
    }
}

impl std::fmt::Debug for Answered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answered")
            .field("model", &self.batch.model.name)
            .field("index", &self.index)
            .field("id", &self.id)
            .finish()
    }
}

impl Answered {
    /// The response, built on the caller's thread; the request counts as a
    /// success.
    pub fn into_response(self) -> InferResponse {
        self.into_delivery().0
    }

    /// The response, built on the caller's thread, and its [`Delivery`], through
    /// which a caller that still has to encode or place it reports a failure.
    pub fn into_delivery(self) -> (InferResponse, Delivery) {
        let j = self.index;
        let model = &self.batch.model;
        let outputs = model
            .info
            .outputs
            .iter()
            .zip(&self.batch.outputs)
            .enumerate()
            .filter(|(k, _)| self.output_mask & (1 << k) != 0)
            .map(|(_, (spec, out))| OutputTensor {
                name: spec.name.to_string(),
                dtype: spec.dtype,
                shape: out
                    .shapes
                    .get(j)
                    .map_or_else(Vec::new, |s| s.dims().to_vec()),
                data: out.parts.get(j).cloned().unwrap_or_default(),
            })
            .collect();
        let response = InferResponse {
            model_name: model.name.clone(),
            model_version: model.version.clone(),
            id: self.id,
            outputs,
        };
        let delivery = Delivery(Delivered::Batch {
            batch: self.batch,
            rows: self.rows,
            arrived: self.arrived,
            queue_ns: self.queue_ns,
        });
        (response, delivery)
    }
}

/// What an instance of a stateful model reports back after each batch.
pub struct SequenceLink {
    pub events: crossbeam_channel::Sender<SequenceEvent<Reply>>,
    pub state_outputs: Vec<usize>,
    pub state_bytes: Vec<usize>,
}

impl SequenceLink {
    /// Each state output's part for request `j`, if every one has the state's size.
    pub fn states_of(
        &self,
        parts: &[&[Bytes]],
        j: usize,
    ) -> std::result::Result<Vec<Bytes>, String> {
        self.state_outputs
            .iter()
            .zip(&self.state_bytes)
            .zip(parts)
            .map(|((&o, &bytes), parts)| {
                let part = parts.get(j).cloned().unwrap_or_default();
                if part.len() == bytes {
                    Ok(part)
                } else {
                    Err(format!(
                        "state output {o} of request {j} has {} bytes, the state has {bytes}",
                        part.len()
                    ))
                }
            })
            .collect()
    }
}
