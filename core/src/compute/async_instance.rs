//! An asynchronous worker's instance (the FPGA/XRT model): the instance thread
//! takes a batch, submits it and goes for the next one, keeping at most
//! `max_outstanding` batches submitted (as the AMD inference server's XModel
//! worker does with its counter); it pulls no batch while that many are out. The
//! worker completes each batch later on a thread of its own, and the batch is
//! answered there: its outputs split per request, the statistics recorded, the
//! answers sent (through the order gate with `preserve_ordering`), and only then
//! its buffer set returned to the pool and its slot freed. So the pool still bounds
//! every batch in flight, submitted ones included.
//!
//! A batch in flight is one [`InFlight`] behind the boundary: it owns the batch
//! (pooled buffers, requests) and the views the worker reads and writes through.
//! Completed twice, only the first counts; dropped uncompleted, it fails its batch.
//! A failed batch fails only its own requests: the instance is not restarted while
//! other batches may be in flight. Unloading drains: the thread waits for every
//! submitted batch before `release`, `deallocate` and `destroy`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kiln_batchers::Batch;
use kiln_worker_sdk::reexports::{RResult, RString};
use kiln_worker_sdk::{BatchCompletion, BatchCompletion_TO, BatchFfi, Shape, TD_Opaque, WorkerBox};
use parking_lot::{Condvar, Mutex};

use crate::compute::instance::{
    answer, fail_all, observe_start, output_shapes, split_outputs, BatchSource, InstanceContext,
    Ran, Views,
};
use crate::error::ServerError;
use crate::observe::stats::nanos;
use crate::request::answer::Reply;

/// One instance's submitted batches: the counter the instance thread waits on.
#[derive(Default)]
struct Slots {
    count: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    /// Waits until fewer than `max` batches are out, then counts one more.
    fn take(&self, max: usize) {
        let mut count = self.count.lock();
        while *count >= max {
            self.freed.wait(&mut count);
        }
        *count += 1;
    }

    fn give_back(&self) {
        *self.count.lock() -= 1;
        self.freed.notify_all();
    }

    /// Waits until every batch is completed.
    fn drain(&self) {
        let mut count = self.count.lock();
        while *count > 0 {
            self.freed.wait(&mut count);
        }
    }
}

/// Submits batches until the source closes, then waits for the outstanding ones
/// and ends the instance's lifecycle.
pub fn run_async_instance(mut worker: WorkerBox, ctx: Arc<InstanceContext>, batches: BatchSource) {
    let max = ctx.outstanding.as_ref().map_or(1, |o| o.max);
    let slots = Arc::new(Slots::default());
    loop {
        // A slot first: no batch is pulled (nor its buffer set held) while the
        // worker has `max` of ours.
        slots.take(max);
        let Some(batch) = batches.next(&mut ()) else {
            slots.give_back();
            break;
        };
        // Should this thread unwind before the batch is in flight, later batches
        // are not held.
        let _in_order = ctx.ordering.as_ref().map(|gate| gate.guard(batch.order));
        let flight = InFlight::new(batch, Arc::clone(&ctx), Arc::clone(&slots));
        let flight = BatchCompletion_TO::from_value(flight, TD_Opaque);
        if let Err(e) = worker.submit(flight).into_result() {
            // The batch is failed already (the SDK completes it whatever happens).
            spdlog::error!("model `{}`: submit failed: {e}", ctx.endpoint);
        }
    }
    slots.drain();
    ctx.healthy.fetch_sub(1, Ordering::SeqCst);
    let _ = worker.release();
    let _ = worker.deallocate();
    worker.destroy();
}

/// A batch submitted to an asynchronous worker, until it completes. Field order is
/// drop order: the views go before the batch they point into.
struct InFlight {
    /// What the worker reads and writes through; points into `batch`, `out_shapes`
    /// and `ctx.info` (heap memory only, see [`Views`]). `None` once completed.
    views: Option<Views<'static>>,
    out_shapes: Vec<Vec<Shape>>,
    batch: Option<Batch<Reply>>,
    ctx: Arc<InstanceContext>,
    slots: Arc<Slots>,
    started: Instant,
    queue_ns: u64,
    building: Instant,
    built: Instant,
}

impl InFlight {
    fn new(mut batch: Batch<Reply>, ctx: Arc<InstanceContext>, slots: Arc<Slots>) -> InFlight {
        let started = Instant::now();
        let queue_ns = observe_start(&ctx, &batch, started);
        if let Some(outstanding) = &ctx.outstanding {
            outstanding.submitted(&ctx.metrics);
        }
        let building = Instant::now();
        let mut out_shapes = output_shapes(&ctx.info, batch.members.len());
        // SAFETY: every pointer the views hold leads to heap memory owned by this
        // `InFlight` (the buffer set's bytes and buffers, the batch's shape and
        // member vectors, `out_shapes`' vectors, the worker info behind `ctx`),
        // which no move of these owners relocates and nothing resizes while the
        // views live; the views are dropped (`complete`, field order) before any
        // of it is touched again or freed.
        let views = unsafe {
            let info: *const kiln_worker_sdk::WorkerInfo = &*ctx.info;
            let set: *mut kiln_buffers::BufferSet = &mut *batch.buffers;
            let shapes: *const [Vec<Shape>] = batch.shapes.as_slice();
            let members: *const [kiln_batchers::Member<Reply>] = batch.members.as_slice();
            let outs: *mut [Vec<Shape>] = out_shapes.as_mut_slice();
            Views::new(&*info, &mut *set, &*shapes, &*members, &mut *outs)
        };
        InFlight {
            views: Some(views),
            out_shapes,
            batch: Some(batch),
            ctx,
            slots,
            started,
            queue_ns,
            building,
            built: Instant::now(),
        }
    }

    /// Answers the batch with `result` (the first time only), returns its buffers
    /// to the pool, then frees its slot.
    fn finish(&mut self, result: Result<(), String>) {
        let (Some(views), Some(batch)) = (self.views.take(), self.batch.take()) else {
            return;
        };
        let ran = Instant::now();
        let ctx = Arc::clone(&self.ctx);
        // Completed: no longer outstanding, though its buffer set is held until
        // its answers are out (so outstanding ≤ buffer sets in use, always).
        if let Some(outstanding) = &ctx.outstanding {
            outstanding.completed(&ctx.metrics);
        }
        ctx.metrics
            .compute_seconds
            .observe(ran.saturating_duration_since(self.started).as_secs_f64());
        let took = ran.saturating_duration_since(self.started);
        ctx.record_compute(took);
        // Summed over the batches out: an asynchronous instance is "busy" for
        // each of them (the busy fraction is clamped to 1).
        ctx.busy_ns.fetch_add(nanos(took), Ordering::Relaxed);
        let (failures, written) = views.finish();
        let out_shapes = std::mem::take(&mut self.out_shapes);
        let outputs =
            result.and_then(|()| split_outputs(&ctx.info, &batch.buffers, out_shapes, written));
        // Server code running on the worker's thread: a bug here must not unwind
        // into the plugin (or abort at the boundary), and the slot is freed anyway.
        let answered = catch_unwind(AssertUnwindSafe(|| match outputs {
            Ok(outputs) => {
                let ran = Ran {
                    outputs,
                    failures,
                    building: self.building,
                    built: self.built,
                    ran,
                };
                // The worker's completing thread keeps nothing: the last answer
                // let go frees the outputs.
                drop(answer(&ctx, batch, ran, self.queue_ns));
            }
            Err(message) => {
                spdlog::error!(
                    "model `{}`: batch of {} failed: {message}",
                    ctx.endpoint,
                    batch.len()
                );
                fail_all(&ctx, batch, &ServerError::WorkerFailed(message));
            }
        }));
        if answered.is_err() {
            spdlog::error!("model `{}`: answering a batch panicked", ctx.endpoint);
        }
        // `answer` and `fail_all` consumed the batch: its buffer set is back in the
        // pool before the slot frees.
        self.slots.give_back();
    }
}

// SAFETY: the only part not `Send` by itself is the views' output buffer objects,
// borrowed `AlignedBuf`s (plain owned memory, `Send`) of the batch this `InFlight`
// owns; nothing else holds them, and the whole moves between threads at once.
unsafe impl Send for InFlight {}

impl BatchCompletion for InFlight {
    fn batch(&mut self) -> BatchFfi<'static, 'static> {
        match self.views.as_mut() {
            Some(views) => {
                let ffi = views.ffi();
                // SAFETY: the slices point into the views' vectors, heap memory that
                // stays in place until `complete` or the drop (see `InFlight::new`).
                unsafe {
                    std::mem::transmute::<BatchFfi<'_, 'static>, BatchFfi<'static, 'static>>(ffi)
                }
            }
            // Completed already: an empty batch (nothing to read or write).
            None => BatchFfi {
                inputs: Default::default(),
                outputs: Default::default(),
                requests: Default::default(),
            },
        }
    }

    fn complete(&mut self, result: RResult<(), RString>) {
        self.finish(result.into_result().map_err(RString::into_string));
    }
}

impl Drop for InFlight {
    /// A batch dropped without completing (a worker that lost its handle) fails.
    fn drop(&mut self) {
        self.finish(Err(
            "the worker dropped the batch without completing it".to_owned()
        ));
    }
}
