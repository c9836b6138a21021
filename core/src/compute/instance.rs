//! A worker instance's thread: take a batch, run it across the boundary, split the
//! outputs back per request and answer each one. A failed batch fails only its own
//! requests; the instance is then restarted through `release` → `acquire`. A request
//! the worker failed alone (`Batch::fail`) gets its own error and the rest of its
//! batch is answered normally.
//! Each batch's stages (queue, building the boundary batch, `run`, answering) are
//! timed here for [`ModelStats`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kiln_batchers::{Batch, Member};
use kiln_buffers::BufferSet;
use kiln_worker_sdk::reexports::RStr;
use kiln_worker_sdk::{
    tensor_byte_len, BatchFfi, InputFfi, OutputBuffer_TO, OutputFfi, RequestError, RequestFfi,
    Shape, TD_Opaque, WorkerBox, WorkerInfo,
};

use crate::error::ServerError;
use crate::observe::metrics::ModelMetrics;
use crate::observe::request_log::request_ids;
use crate::observe::stats::{nanos, BatchTiming, ModelStats};
use crate::observe::trace::BatchTrace;
use crate::request::answer::{
    AnswerModel, BatchOutputs, BatchRow, BatchTally, KeptOutputs, OutputsHold, Reply, RunOutput,
    SequenceLink,
};
use crate::request::ordering::{send, Answers, OrderGate};

mod source;
pub use source::{BatchSource, From, Pulled};

/// What every instance of a group shares.
pub struct InstanceContext {
    /// What the answers name (the model, its version, its outputs).
    pub answer_model: Arc<AnswerModel>,
    pub endpoint: String,
    pub version: String,
    pub info: Arc<WorkerInfo>,
    pub metrics: Arc<ModelMetrics>,
    /// Triton-style statistics (`/stats`).
    pub stats: Arc<ModelStats>,
    /// Instances able to run batches now.
    pub healthy: AtomicUsize,
    /// Time the instances spent running batches, in nanoseconds (one add per
    /// batch; read at scrape time for `kiln_instance_busy_*`).
    pub busy_ns: AtomicU64,
    /// Moving average of a batch's run time in nanoseconds (the dynamic batcher's
    /// deadline-aware sending reads it).
    pub compute_estimate_ns: AtomicU64,
    /// A stateful model's link to its sequence batcher.
    pub sequence: Option<SequenceLink>,
    /// `preserve_ordering`: answers leave in batch order.
    pub ordering: Option<OrderGate>,
    /// An asynchronous worker's batches in flight (`None`: a synchronous worker).
    pub outstanding: Option<crate::compute::outstanding::Outstanding>,
    /// The models the group's workers may call, and whether they have.
    pub caller: crate::compute::calls::Caller,
}

impl InstanceContext {
    /// Folds one batch's run time into the estimate (weight 1/8).
    pub(crate) fn record_compute(&self, took: std::time::Duration) {
        let sample = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        let old = self.compute_estimate_ns.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.compute_estimate_ns.store(new, Ordering::Relaxed);
    }
}

/// Runs batches until its source closes (the batch queue, or the group's request
/// queue once drained), then ends the instance's lifecycle. `index` numbers the
/// instance for a stateful model's sequence batcher.
pub fn run_instance(
    mut worker: WorkerBox,
    ctx: Arc<InstanceContext>,
    batches: BatchSource,
    index: usize,
) {
    let mut healthy = true;
    let mut kept = KeptOutputs::default();
    while let Some(mut batch) = batches.next(&mut kept) {
        // Should this thread unwind on the batch, later batches are not held.
        let _in_order = ctx.ordering.as_ref().map(|gate| gate.guard(batch.order));
        if !healthy {
            healthy = worker.acquire().into_result().is_ok();
            if healthy {
                ctx.healthy.fetch_add(1, Ordering::SeqCst);
            } else {
                report_failed(&ctx, index, &batch);
                fail_all(
                    &ctx,
                    batch,
                    &ServerError::Unavailable(format!(
                        "model `{}`: worker instance cannot be acquired",
                        ctx.endpoint
                    )),
                );
                continue;
            }
        }
        let started = Instant::now();
        let m = &ctx.metrics;
        let queue_ns = observe_start(&ctx, &batch, started);
        // Empty (no allocation) unless a member's trace is sampled.
        let mut traced = BatchTrace::of(
            batch
                .members
                .iter()
                .map(|m| (m.reply.trace.as_deref().copied(), m.arrived)),
            started,
            batch.len(),
            batch.rows,
        );
        traced.begin_worker();
        let result = run_batch(&mut worker, &ctx, &mut batch);
        traced.end_worker();
        let took = started.elapsed();
        m.compute_seconds.observe(took.as_secs_f64());
        ctx.record_compute(took);
        ctx.busy_ns.fetch_add(nanos(took), Ordering::Relaxed);
        // A stateful model's batcher hears of the new states before the clients
        // do, so a sequence's next request can be batched as soon as it arrives.
        let result = result.and_then(|ran| {
            report_states(&ctx, index, &batch, Some(&ran))?;
            Ok(ran)
        });
        match result {
            Ok(ran) => {
                let stages = (ran.building, ran.built, ran.ran);
                kept.keep(answer(&ctx, batch, ran, queue_ns));
                traced.record(&ctx.endpoint, &ctx.version, Some(stages), None);
            }
            Err(message) => {
                let traces = traced.log_suffix();
                traced.record(&ctx.endpoint, &ctx.version, None, Some(&message));
                report_failed(&ctx, index, &batch);
                spdlog::error!(
                    "model `{}`: batch of {} failed: {message}{traces}",
                    ctx.endpoint,
                    batch.len(),
                    kv: { request_ids = request_ids(batch.members.iter().map(|m| &m.reply.log)) }
                );
                fail_all(&ctx, batch, &ServerError::WorkerFailed(message));
                let restarted = worker.release().into_result().is_ok()
                    && worker.acquire().into_result().is_ok();
                if !restarted {
                    spdlog::error!("model `{}`: instance restart failed", ctx.endpoint);
                    ctx.healthy.fetch_sub(1, Ordering::SeqCst);
                    healthy = false;
                }
            }
        }
    }
    if healthy {
        ctx.healthy.fetch_sub(1, Ordering::SeqCst);
        let _ = worker.release();
    }
    let _ = worker.deallocate();
    worker.destroy();
}

/// Records a batch starting its run at `started`: each member's queue time and the
/// batch's size; returns the members' queue time in all (nanoseconds).
pub(crate) fn observe_start(ctx: &InstanceContext, batch: &Batch<Reply>, started: Instant) -> u64 {
    let m = &ctx.metrics;
    let mut queue_ns = 0u64;
    for member in &batch.members {
        let waited = started.saturating_duration_since(member.arrived);
        m.queue_seconds.observe(waited.as_secs_f64());
        queue_ns = queue_ns.saturating_add(nanos(waited));
    }
    m.batch_size.observe(batch.len() as f64);
    queue_ns
}

/// Tells a stateful model's sequence batcher that `batch` is done, with each
/// sequence's new state taken from the state outputs of `ran` (`None`: the batch
/// failed, the states stay). A state output of the wrong size fails the batch.
pub(crate) fn report_states(
    ctx: &InstanceContext,
    index: usize,
    batch: &Batch<Reply>,
    ran: Option<&Ran>,
) -> Result<(), String> {
    let Some(link) = &ctx.sequence else {
        return Ok(());
    };
    let parts: Option<Vec<&[Bytes]>> = ran.map(|ran| {
        link.state_outputs
            .iter()
            .map(|&o| ran.outputs.get(o).map_or(&[][..], |out| &out.parts[..]))
            .collect()
    });
    let mut sequences = Vec::with_capacity(batch.members.len());
    for (j, member) in batch.members.iter().enumerate() {
        let Some(handle) = member.sequence else {
            continue;
        };
        // A request failed alone leaves its sequence's state as it was.
        let state = match (&parts, ran.and_then(|ran| ran.failure(j))) {
            (Some(parts), None) => Some(link.states_of(parts, j)?),
            _ => None,
        };
        sequences.push((handle, state));
    }
    link.former.complete(index, sequences);
    Ok(())
}

/// Tells a stateful model's sequence batcher that `batch` failed (states stay).
pub(crate) fn report_failed(ctx: &InstanceContext, index: usize, batch: &Batch<Reply>) {
    // Without outputs there is no state to check: this cannot fail.
    let _ = report_states(ctx, index, batch, None);
}

/// A batch that ran: its outputs, the requests the worker failed alone (by index;
/// usually none, and then nothing is allocated), when building its `BatchFfi`
/// began, and when `run` was called and returned.
pub(crate) struct Ran {
    pub(crate) outputs: Vec<RunOutput>,
    pub(crate) failures: Vec<(usize, RequestError)>,
    pub(crate) building: Instant,
    pub(crate) built: Instant,
    pub(crate) ran: Instant,
}

impl Ran {
    /// The error request `j` was failed with, if it was.
    fn failure(&self, j: usize) -> Option<&RequestError> {
        self.failures.iter().find(|(i, _)| *i == j).map(|(_, e)| e)
    }
}

fn run_batch(
    worker: &mut WorkerBox,
    ctx: &InstanceContext,
    batch: &mut Batch<Reply>,
) -> Result<Ran, String> {
    let info = &*ctx.info;
    let building = Instant::now();
    let mut out_shapes = output_shapes(info, batch.members.len());
    let set = &mut *batch.buffers;
    let mut views = Views::new(info, set, &batch.shapes, &batch.members, &mut out_shapes);
    let built = Instant::now();
    // The worker may call other models from `run` (two thread-local stores).
    let calls = crate::compute::calls::enter(&ctx.caller, &batch.members);
    let result = worker.run(&mut views.ffi()).into_result();
    drop(calls);
    result.map_err(|e| e.into_string())?;
    let ran = Instant::now();
    let (failures, written) = views.finish();
    let outputs = split_outputs(info, set, out_shapes, written)?;
    Ok(Ran {
        outputs,
        failures,
        building,
        built,
        ran,
    })
}

/// Each output's per-request shapes, for the worker to fill in.
pub(crate) fn output_shapes(info: &WorkerInfo, members: usize) -> Vec<Vec<Shape>> {
    info.outputs
        .iter()
        .map(|_| vec![Shape::scalar(); members])
        .collect()
}

/// A batch's boundary form: what a [`BatchFfi`] points to. Every pointer in it
/// leads to heap memory (the buffers' bytes, the vectors' elements, the worker
/// info's names), never into a struct that moves: an asynchronous batch keeps
/// these views beside what they point to while it is in flight.
pub(crate) struct Views<'a> {
    inputs: Vec<InputFfi<'a>>,
    outputs: Vec<OutputFfi<'a>>,
    requests: Vec<RequestFfi<'a>>,
}

impl<'a> Views<'a> {
    /// The views of a batch's buffer set, shapes and requests, with `out_shapes`
    /// (from [`output_shapes`]) for the worker's output shapes.
    pub(crate) fn new(
        info: &'a WorkerInfo,
        set: &'a mut BufferSet,
        shapes: &'a [Vec<Shape>],
        members: &'a [Member<Reply>],
        out_shapes: &'a mut [Vec<Shape>],
    ) -> Views<'a> {
        let inputs: Vec<InputFfi<'a>> = info
            .inputs
            .iter()
            .zip(&set.inputs)
            .zip(shapes)
            .map(|((spec, buf), shapes)| InputFfi {
                name: RStr::from_str(spec.name.as_str()),
                dtype: spec.dtype,
                data: buf.as_slice().into(),
                shapes: shapes.as_slice().into(),
            })
            .collect();
        let outputs: Vec<OutputFfi<'a>> = info
            .outputs
            .iter()
            .zip(set.outputs.iter_mut())
            .zip(out_shapes.iter_mut())
            .map(|((spec, buf), shapes)| {
                buf.clear();
                OutputFfi {
                    name: RStr::from_str(spec.name.as_str()),
                    dtype: spec.dtype,
                    shapes: shapes.as_mut_slice().into(),
                    buffer: OutputBuffer_TO::from_ptr(
                        kiln_worker_sdk::reexports::RMut::new(buf),
                        TD_Opaque,
                    ),
                    len: 0,
                    written: false,
                }
            })
            .collect();
        let requests: Vec<RequestFfi<'a>> = members
            .iter()
            .map(|m: &Member<Reply>| RequestFfi::new(&m.params))
            .collect();
        Views {
            inputs,
            outputs,
            requests,
        }
    }

    /// The batch as the worker sees it.
    pub(crate) fn ffi(&mut self) -> BatchFfi<'_, 'a> {
        BatchFfi {
            inputs: self.inputs.as_slice().into(),
            outputs: self.outputs.as_mut_slice().into(),
            requests: self.requests.as_mut_slice().into(),
        }
    }

    /// What the worker reported: the requests it failed alone, and whether (and
    /// how many bytes of) each output it wrote.
    pub(crate) fn finish(self) -> (Failures, Written) {
        let failures = self
            .requests
            .into_iter()
            .enumerate()
            .filter_map(|(j, r)| r.failure.into_option().map(|e| (j, e)))
            .collect();
        let written = self.outputs.iter().map(|o| (o.written, o.len)).collect();
        (failures, written)
    }
}

/// The requests a worker failed alone, by index, with their errors.
pub(crate) type Failures = Vec<(usize, RequestError)>;

/// Per output: whether the worker wrote it, and how many bytes.
pub(crate) type Written = Vec<(bool, usize)>;

/// Splits each output the worker wrote into its requests' parts (sharing one copy).
pub(crate) fn split_outputs(
    info: &WorkerInfo,
    set: &BufferSet,
    out_shapes: Vec<Vec<Shape>>,
    written: Written,
) -> Result<Vec<RunOutput>, String> {
    info.outputs
        .iter()
        .zip(&set.outputs)
        .zip(out_shapes)
        .zip(written)
        .map(|(((spec, buf), shapes), (was_written, len))| {
            if !was_written {
                return Err(format!("worker did not write output `{}`", spec.name));
            }
            let bytes = buf.as_slice().get(..len).ok_or_else(|| {
                format!(
                    "output `{}`: {len} bytes reported, {} written",
                    spec.name,
                    buf.len()
                )
            })?;
            let data = Bytes::copy_from_slice(bytes);
            let mut parts = Vec::with_capacity(shapes.len());
            let mut offset = 0;
            for shape in &shapes {
                let rest = &data[offset..];
                let n = tensor_byte_len(spec.dtype, shape.element_count(), rest)
                    .ok()
                    .filter(|&n| n <= rest.len())
                    .ok_or_else(|| {
                        format!(
                            "output `{}` is shorter than the shapes the worker reported",
                            spec.name
                        )
                    })?;
                parts.push(data.slice(offset..offset + n));
                offset += n;
            }
            Ok(RunOutput { parts, shapes })
        })
        .collect()
}

/// Answers every request of a batch that ran: those the worker failed alone with
/// their own error, the others with their outputs. The failed ones are counted
/// here, the answered ones by the batch's [`BatchTally`] once every answer is let go
/// (see [`crate::request::answer`]); this thread lets go of its share before sending, so a
/// client that has its answer, and whose batch-mates have theirs, sees it counted.
/// Returns the batch's outputs for the answering thread to keep ([`KeptOutputs`]).
pub(crate) fn answer(
    ctx: &InstanceContext,
    batch: Batch<Reply>,
    ran: Ran,
    queue_ns: u64,
) -> Arc<BatchOutputs> {
    let (requests, order) = (batch.len(), batch.order);
    let Ran {
        outputs,
        failures,
        building,
        built,
        ran,
    } = ran;
    let waited = |member: &Member<Reply>| nanos(building.saturating_duration_since(member.arrived));
    // What the requests answered with outputs add up to (usually all of them).
    let (mut rows, mut answered_queue_ns) = (batch.rows, queue_ns);
    for member in failures.iter().filter_map(|(j, _)| batch.members.get(*j)) {
        rows = rows.saturating_sub(member.rows);
        answered_queue_ns = answered_queue_ns.saturating_sub(waited(member));
    }
    let timing = BatchTiming {
        input: built.saturating_duration_since(building),
        infer: ran.saturating_duration_since(built),
        output: ran.elapsed(),
    };
    // The answers share the outputs; each caller builds its own response.
    let shared = OutputsHold::first(BatchOutputs {
        model: Arc::clone(&ctx.answer_model),
        outputs,
        tally: BatchTally::new(
            Arc::clone(&ctx.metrics),
            Arc::clone(&ctx.stats),
            (requests - failures.len(), rows, answered_queue_ns),
            timing,
        ),
    });
    let failure = |j: usize| failures.iter().find(|(i, _)| *i == j).map(|(_, e)| e);
    let mut replies = Vec::with_capacity(requests);
    let (mut invalid, mut failed, mut failed_ns) = (0u64, 0u64, 0u64);
    for (j, member) in batch.members.into_iter().enumerate() {
        let queue_ns = waited(&member);
        let reply = member.reply;
        if let Some(error) = failure(j) {
            failed_ns = failed_ns.saturating_add(nanos(member.arrived.elapsed()));
            let error = ServerError::from_request(error);
            crate::observe::request_log::failed(&reply.log, &ctx.endpoint, &error);
            match error {
                ServerError::InvalidRequest(_) => invalid += 1,
                _ => failed += 1,
            }
            replies.push((reply.tx, Err(error)));
            continue;
        }
        let answered = BatchRow {
            batch: shared.clone(),
            index: j,
            output_mask: reply.output_mask,
            id: reply.log.id,
            rows: member.rows,
            arrived: member.arrived,
            queue_ns,
            inputs: member.inputs,
        };
        replies.push((reply.tx, Ok(answered)));
    }
    // Only the answers share the outputs now: the last one let go counts them.
    let outputs = shared.outputs();
    drop(shared);
    if invalid + failed > 0 {
        ctx.stats
            .record_failure((invalid + failed) as usize, failed_ns);
    }
    let m = &ctx.metrics;
    m.pending.dec_by(requests as i64);
    m.invalid.inc_by(invalid);
    m.failure.inc_by(failed);
    deliver(ctx, order, replies);
    outputs
}

/// Sends a batch's answers, through the group's order gate when it preserves ordering.
fn deliver(ctx: &InstanceContext, order: u64, answers: Answers) {
    match &ctx.ordering {
        Some(gate) => gate.release(order, answers),
        None => send(answers),
    }
}

pub(crate) fn fail_all(ctx: &InstanceContext, batch: Batch<Reply>, error: &ServerError) {
    let now = Instant::now();
    let waited = batch
        .members
        .iter()
        .map(|member| nanos(now.saturating_duration_since(member.arrived)))
        .fold(0u64, u64::saturating_add);
    ctx.stats.record_failure(batch.len(), waited);
    let m = &ctx.metrics;
    let count = batch.members.len();
    m.pending.dec_by(count as i64);
    match error {
        ServerError::Unavailable(_) => m.unavailable.inc_by(count as u64),
        _ => m.failure.inc_by(count as u64),
    };
    let answers = batch
        .members
        .into_iter()
        .map(|member| {
            crate::observe::request_log::failed(&member.reply.log, &ctx.endpoint, error);
            (member.reply.tx, Err(error.clone()))
        })
        .collect();
    deliver(ctx, batch.order, answers);
}
