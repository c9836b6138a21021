//! How a request is answered once its batch has run: the [`Reply`] each queued
//! request carries, the [`Answer`] sent through it, and a stateful model's
//! [`SequenceLink`], through which its instance reports each sequence's new state
//! before answering. A leaf module: the group, its instances and the sequence
//! batcher's host all use these types.
//!
//! An instance thread answers with its request's row of the batch's outputs
//! ([`BatchRow`]: an [`OutputsHold`] on them and an index), not with a built
//! [`InferResponse`]: the response (its names, shape and output list) is built by
//! whoever awaits it, on its own thread. So the instance thread allocates nothing
//! per request, and nothing one thread allocates is freed by the other: with
//! glibc's per-thread arenas such frees lock the other thread's arena, and the two
//! threads then wait on each other (`docs/benchmarks.md`). Each answer carries its
//! request's input tensors back to be let go where they were made, and the
//! instance keeps its batches' outputs ([`KeptOutputs`]) until the last answer
//! lets go of them, then frees them itself.
//!
//! The answer side's names, one per idea (and used for nothing else in kiln):
//!
//! | name | the idea | where |
//! |---|---|---|
//! | [`Reply`] | the way a queued request is answered: its channel, log id, output mask, span | here |
//! | [`Answer`] | what comes through that channel: a [`BatchRow`] or the request's error | here |
//! | [`BatchRow`] | one request's row of a batch's outputs, built into its response by the awaiting thread | here |
//! | [`BatchOutputs`] | a batch's outputs, shared by its rows | here |
//! | [`OutputsHold`] | one hold on a batch's outputs that counts for its tally (the instance's, each row's) | here |
//! | [`BatchTally`] | counts a batch's answers in `/metrics` and `/stats` when the last hold lets go | here |
//! | [`KeptOutputs`] | an instance's recent batches' outputs, freed on its own thread | here |
//! | [`Delivery`] | an answer on its way to its client: a success when dropped unless it [`Delivery::failed`] | here |
//! | `Admitted` | an admitted request's answer to await (dropping it cancels the request) | [`crate::request::serve`] |
//! | `Call` | one request from admission to the end of its delivery, for every ingress | [`crate::request::serve`] |
//! | `CallFuture` | a worker's call to a model, its answer to come | [`crate::compute::calls`] |

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kiln_batchers::sequence::SequenceFormer;
use kiln_batchers::Tensor;
use kiln_worker_sdk::{Shape, WorkerInfo};
use tokio::sync::oneshot;

use crate::error::{Result, ServerError};
use crate::observe::metrics::ModelMetrics;
use crate::observe::request_log::RequestLog;
use crate::observe::stats::{nanos, BatchTiming, ModelStats};
use crate::request::infer::{InferResponse, OutputTensor};

/// What a request is answered with: its row of a batch that ran, or its error.
pub type Answer = Result<BatchRow>;

/// How a request is answered once its batch has run.
pub struct Reply {
    pub tx: oneshot::Sender<Answer>,
    /// What log lines about the request name (its id, which its answer carries).
    pub log: RequestLog,
    /// Bit `i` set: return output `i`.
    pub output_mask: u64,
    /// The request's span, when its trace is sampled ([`crate::observe::trace`]).
    /// Boxed, as [`RequestLog`]'s trace id: one word for a request not traced.
    pub trace: Option<Box<crate::observe::trace::SpanIds>>,
}

/// The model an instance's answers name: built once per group.
pub struct AnswerModel {
    pub name: String,
    pub version: String,
    pub info: Arc<WorkerInfo>,
    /// Outputs whose shape clients get reshaped (Triton's `reshape`).
    pub reshape: Arc<crate::group::reshape::Reshape>,
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
    pub tally: BatchTally,
}

/// One hold on a batch's outputs that counts for its [`BatchTally`]: the instance's
/// while it answers, then each answer's. The last let go counts the batch.
pub struct OutputsHold(Arc<BatchOutputs>);

impl OutputsHold {
    /// The first share of a batch's outputs (the answering thread's).
    pub fn first(outputs: BatchOutputs) -> OutputsHold {
        outputs.tally.shares.store(1, Ordering::Relaxed);
        OutputsHold(Arc::new(outputs))
    }

    /// The outputs themselves, held apart from the shares (see [`KeptOutputs`]).
    pub fn outputs(&self) -> Arc<BatchOutputs> {
        Arc::clone(&self.0)
    }
}

impl Clone for OutputsHold {
    fn clone(&self) -> OutputsHold {
        self.0.tally.shares.fetch_add(1, Ordering::Relaxed);
        OutputsHold(Arc::clone(&self.0))
    }
}

impl std::ops::Deref for OutputsHold {
    type Target = BatchOutputs;

    fn deref(&self) -> &BatchOutputs {
        &self.0
    }
}

impl Drop for OutputsHold {
    fn drop(&mut self) {
        // AcqRel: the last one sees every failure the others reported.
        if self.0.tally.shares.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.tally.settle();
        }
    }
}

/// The outputs of an instance's recent batches, kept by the thread that made them
/// until no answer holds them any more, and then freed there (see the module
/// comment): on each new batch the oldest that are done, and all that are done
/// when the thread waits for work. At most [`KeptOutputs::MOST`] are kept (past
/// that the oldest is let go), and none once the thread has waited
/// [`kiln_batchers::IDLE_LINGER`] with nothing to do: whichever holder is last
/// then frees them.
#[derive(Default)]
pub struct KeptOutputs(VecDeque<Arc<BatchOutputs>>);

impl KeptOutputs {
    /// Batches kept at most: more than the batches a group's callers usually
    /// hold answers of at once.
    pub const MOST: usize = 64;

    /// Frees the oldest kept outputs no answer holds any more, and keeps `outputs`.
    pub fn keep(&mut self, outputs: Arc<BatchOutputs>) {
        while self
            .0
            .front()
            .is_some_and(|oldest| Arc::strong_count(oldest) == 1 || self.0.len() >= Self::MOST)
        {
            self.0.pop_front();
        }
        self.0.push_back(outputs);
    }
}

impl kiln_batchers::Idle for KeptOutputs {
    fn idle(&mut self) -> bool {
        self.0.retain(|kept| Arc::strong_count(kept) > 1);
        !self.0.is_empty()
    }

    fn lingered(&mut self) {
        self.0.clear();
    }

    /// The answers of the kept batches not yet let go, newest first (the oldest
    /// are the likeliest done).
    fn held(&mut self, enough: usize) -> usize {
        let mut held = 0;
        for kept in self.0.iter().rev() {
            held += Arc::strong_count(kept) - 1;
            if held >= enough {
                break;
            }
        }
        held
    }
}

/// A batch's answered requests, counted in `/metrics` and `/stats` when the last
/// of their answers is let go (the last [`OutputsHold`]): each as a success, unless
/// whoever answered the client reported that it failed on the way out
/// ([`Delivery::failed`]: a shared-memory output that does not fit its window, an
/// answer too large to encode). So the hot path counts once per batch, as before,
/// and a request that failed after its inference is never counted a success.
pub struct BatchTally {
    pub metrics: Arc<ModelMetrics>,
    pub stats: Arc<ModelStats>,
    /// The batch's requests answered with outputs, their rows and their waits.
    pub requests: usize,
    pub rows: usize,
    pub queue_ns: u64,
    pub timing: BatchTiming,
    /// The [`OutputsHold`]s not yet let go.
    shares: AtomicUsize,
    /// Of those, the ones that failed on the way out (rare: atomics touched only
    /// then).
    invalid: AtomicU64,
    failed: AtomicU64,
    failed_rows: AtomicU64,
    failed_queue_ns: AtomicU64,
    failed_ns: AtomicU64,
}

impl BatchTally {
    /// The tally of `requests` requests (of `rows` rows, waiting `queue_ns` in all)
    /// answered by a batch that ran in `timing`.
    pub fn new(
        metrics: Arc<ModelMetrics>,
        stats: Arc<ModelStats>,
        (requests, rows, queue_ns): (usize, usize, u64),
        timing: BatchTiming,
    ) -> BatchTally {
        BatchTally {
            metrics,
            stats,
            requests,
            rows,
            queue_ns,
            timing,
            shares: AtomicUsize::new(0),
            invalid: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failed_rows: AtomicU64::new(0),
            failed_queue_ns: AtomicU64::new(0),
            failed_ns: AtomicU64::new(0),
        }
    }
}

impl BatchTally {
    /// Counts the batch's answers, once the last [`OutputsHold`] is let go.
    fn settle(&self) {
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        let invalid = load(&self.invalid);
        let failed = load(&self.failed);
        let lost = (invalid + failed) as usize;
        let succeeded = self.requests.saturating_sub(lost);
        if succeeded > 0 {
            let rows = self.rows.saturating_sub(load(&self.failed_rows) as usize);
            let queue_ns = self.queue_ns.saturating_sub(load(&self.failed_queue_ns));
            self.stats
                .record_success(succeeded, rows, queue_ns, self.timing);
        }
        if lost > 0 {
            self.stats.record_failure(lost, load(&self.failed_ns));
        }
        self.metrics.success.inc_by(succeeded as u64);
        self.metrics.invalid.inc_by(invalid);
        self.metrics.failure.inc_by(failed);
    }
}

/// One request's answer: row `index` of a batch's outputs, the outputs it asked
/// for, its id, and what its tally needs should it fail on the way out.
pub struct BatchRow {
    pub batch: OutputsHold,
    pub index: usize,
    /// Bit `k` set: return output `k`.
    pub output_mask: u64,
    pub id: Option<String>,
    /// The request's rows, when it arrived and how long it waited for its batch.
    pub rows: usize,
    pub arrived: Instant,
    pub queue_ns: u64,
    /// The request's input tensors (see [`kiln_batchers::Member::inputs`]): let go
    /// with the answer, on the thread that awaits it.
    pub inputs: Vec<Tensor>,
}

/// A request answered and on its way to its client: counted a success when
/// dropped, unless [`Delivery::failed`] says otherwise.
#[must_use = "dropping a Delivery counts its request a success"]
pub struct Delivery(CountedBy);

/// What counts a [`Delivery`] once it is let go.
enum CountedBy {
    /// A row of a batch: its batch's [`BatchTally`] counts it.
    Batch {
        batch: OutputsHold,
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
        Delivery(CountedBy::Ensemble(EnsembleAnswer {
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
            CountedBy::Batch {
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
            CountedBy::Ensemble(mut answer) => {
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

impl std::fmt::Debug for BatchRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchRow")
            .field("model", &self.batch.model.name)
            .field("index", &self.index)
            .field("id", &self.id)
            .finish()
    }
}

impl BatchRow {
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
            .map(|(k, (spec, out))| OutputTensor {
                name: spec.name.to_string(),
                dtype: spec.dtype,
                shape: out.shapes.get(j).map_or_else(Vec::new, |s| {
                    let batching = model.info.max_batch_size > 0;
                    match model.reshape.output_dims(k, s, batching) {
                        Some(client) => client.dims().to_vec(),
                        None => s.dims().to_vec(),
                    }
                }),
                data: out.parts.get(j).cloned().unwrap_or_default(),
            })
            .collect();
        let response = InferResponse {
            model_name: model.name.clone(),
            model_version: model.version.clone(),
            id: self.id,
            outputs,
        };
        let delivery = Delivery(CountedBy::Batch {
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
    /// The group's sequence batcher, told of each batch's new states.
    pub former: Arc<SequenceFormer<Reply>>,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kiln_batchers::Idle;
    use kiln_worker_sdk::{BatcherKind, DataType, TensorSpec};

    use super::*;
    use crate::observe::metrics::Metrics;

    fn batch(stats: &Arc<ModelStats>, requests: usize) -> OutputsHold {
        let info = WorkerInfo {
            inputs: vec![TensorSpec::new("X", DataType::Uint8, &[1])].into(),
            outputs: vec![TensorSpec::new("Y", DataType::Uint8, &[1])].into(),
            max_batch_size: 8,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: false,
        };
        OutputsHold::first(BatchOutputs {
            model: Arc::new(AnswerModel {
                name: "m".into(),
                version: "1".into(),
                info: Arc::new(info),
                reshape: Arc::default(),
            }),
            outputs: Vec::new(),
            tally: BatchTally::new(
                Arc::new(Metrics::new().model("m", "1")),
                Arc::clone(stats),
                (requests, requests, 0),
                BatchTiming {
                    input: Duration::ZERO,
                    infer: Duration::ZERO,
                    output: Duration::ZERO,
                },
            ),
        })
    }

    #[test]
    fn the_last_share_let_go_counts_the_batch_once() {
        let stats = Arc::new(ModelStats::default());
        let first = batch(&stats, 2);
        let kept = first.outputs();
        let (a, b) = (first.clone(), first.clone());
        drop(first);
        drop(a);
        assert_eq!(stats.snapshot().inference_count, 0, "one answer still out");
        drop(b);
        assert_eq!(stats.snapshot().inference_count, 2);
        // The outputs outlive their shares without counting again.
        drop(kept);
        assert_eq!(stats.snapshot().inference_count, 2);
    }

    #[test]
    fn kept_outputs_are_freed_once_no_answer_holds_them() {
        let stats = Arc::new(ModelStats::default());
        let mut kept = KeptOutputs::default();
        let answered = batch(&stats, 1);
        let outputs = answered.outputs();
        let watch = Arc::downgrade(&outputs);
        kept.keep(outputs);
        // Held by the answer: a new batch does not free it.
        kept.keep(batch(&stats, 1).outputs());
        assert!(watch.upgrade().is_some());
        drop(answered);
        assert!(
            watch.upgrade().is_some(),
            "freed by the keeper, not the answer"
        );
        kept.keep(batch(&stats, 1).outputs());
        assert!(watch.upgrade().is_none());
    }

    #[test]
    fn kept_outputs_are_bounded_and_let_go_after_idling() {
        let stats = Arc::new(ModelStats::default());
        let mut kept = KeptOutputs::default();
        let mut answers: Vec<OutputsHold> = (0..KeptOutputs::MOST + 3)
            .map(|_| batch(&stats, 1))
            .collect();
        for answer in &answers {
            kept.keep(answer.outputs());
        }
        assert_eq!(kept.0.len(), KeptOutputs::MOST);
        assert!(kept.idle(), "answers still hold them");
        let held = answers.split_off(KeptOutputs::MOST);
        drop(answers);
        assert!(kept.idle());
        assert_eq!(kept.0.len(), held.len());
        kept.lingered();
        assert!(kept.0.is_empty());
        assert!(!kept.idle());
    }

    #[test]
    fn kept_outputs_count_the_answers_still_held() {
        let stats = Arc::new(ModelStats::default());
        let mut kept = KeptOutputs::default();
        assert_eq!(kept.held(100), 0);
        let first = batch(&stats, 3);
        let answers = [first.clone(), first.clone(), first.clone()];
        kept.keep(first.outputs());
        drop(first);
        let other = batch(&stats, 1);
        kept.keep(other.outputs());
        assert_eq!(kept.held(100), 4);
        // Counted up to what is asked, newest first.
        assert_eq!(kept.held(1), 1);
        drop(answers);
        assert_eq!(kept.held(100), 1);
        drop(other);
        assert_eq!(kept.held(100), 0);
    }
}
