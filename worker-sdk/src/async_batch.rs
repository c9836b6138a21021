//! Asynchronous batches: the batch an [`crate::AsyncWorker`] takes in `submit` and
//! completes later, from any thread (its own thread pool, a device callback).
//!
//! Across the boundary a batch in flight is one host-owned object,
//! [`BatchCompletion`]: it owns the batch's memory (the pool's buffer set, the
//! requests) until it is completed, so the worker may read inputs and write outputs
//! from its own threads in the meantime. [`AsyncBatch`] is the worker's safe handle
//! on it: it is completed exactly once ([`AsyncBatch::complete`] consumes it), a
//! panic in [`AsyncBatch::complete_with`] fails the batch with the panic's message,
//! and a handle dropped without completing fails the batch instead of leaving its
//! clients waiting.

// `#[sabi_trait]` expands to impls inside a const block.
#![allow(non_local_definitions)]

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::sabi_trait;
use abi_stable::std_types::{RBox, RResult, RString};

use crate::batch::{Batch, BatchFfi};
use crate::error::{panic_message, WorkerError};

/// A batch in flight, implemented by the host. The memory its [`BatchFfi`] points to
/// is owned by this object and stays in place, usable from any thread, until the
/// object is completed or dropped. Dropping it without completing fails the batch.
#[sabi_trait]
pub trait BatchCompletion: Send {
    /// The batch's boundary form, valid (and to be used only) until `complete` is
    /// called or the object dropped: the lifetimes are the host's promise, kept by
    /// [`AsyncBatch`], which lends the batch out only for shorter borrows of itself.
    fn batch(&mut self) -> BatchFfi<'static, 'static>;
    /// Completes the batch: `ROk` answers each request with its outputs (or the
    /// error it was failed with alone), `RErr` fails every request of the batch.
    /// Only the first call counts.
    #[sabi(last_prefix_field)]
    fn complete(&mut self, result: RResult<(), RString>);
}

/// An owned batch in flight behind the boundary.
pub type BatchCompletionBox = BatchCompletion_TO<'static, RBox<()>>;

/// The batch an [`crate::AsyncWorker`] was handed: send it to another thread, read
/// its inputs and write its outputs there ([`AsyncBatch::batch`]), then complete it
/// once ([`AsyncBatch::complete`], or [`AsyncBatch::complete_with`], which also
/// catches panics). Dropped without completing, it fails the batch.
pub struct AsyncBatch {
    /// What `done` owns: valid while `done` is `Some`.
    view: BatchFfi<'static, 'static>,
    done: Option<BatchCompletionBox>,
}

// SAFETY: `view` points only into memory the completion object owns, which its
// `Send` bound and the host's promise (usable from any thread) cover; `AsyncBatch`
// is never shared, only moved.
unsafe impl Send for AsyncBatch {}

impl AsyncBatch {
    /// Wraps the host's batch in flight.
    pub fn new(mut done: BatchCompletionBox) -> AsyncBatch {
        AsyncBatch {
            view: done.batch(),
            done: Some(done),
        }
    }

    /// The batch, as [`crate::Worker::run`] sees it: inputs to read, outputs to
    /// write, requests to fail alone. Borrowed from the handle, so nothing of it
    /// outlives the completion.
    pub fn batch(&mut self) -> Batch<'_, '_> {
        let view: *mut BatchFfi<'static, 'static> = &mut self.view;
        // SAFETY: the memory is valid while `self` is (see `view`); the lifetimes are
        // shortened to this borrow, so no slice of it escapes the handle. `Batch`
        // writes only plain values (shapes, lengths, flags, owned errors) into the
        // view, never a reference of the shorter lifetime the host could later read.
        Batch::new(unsafe { &mut *view.cast::<BatchFfi<'_, '_>>() })
    }

    /// Completes the batch: `Ok` answers each request with its outputs, an error
    /// fails every request of the batch (HTTP 500) with its message.
    pub fn complete(mut self, result: Result<(), WorkerError>) {
        self.finish(result);
    }

    /// Runs `compute` on the batch and completes it with the outcome; a panic in
    /// `compute` fails the batch with the panic's message (and does not unwind
    /// further: the calling thread, e.g. a compute unit's, lives on).
    pub fn complete_with(
        mut self,
        compute: impl FnOnce(&mut Batch<'_, '_>) -> Result<(), WorkerError>,
    ) {
        let outcome = catch_unwind(AssertUnwindSafe(|| compute(&mut self.batch())));
        let result = match outcome {
            Ok(result) => result,
            Err(payload) => Err(WorkerError::new(format!(
                "worker panicked: {}",
                panic_message(&*payload)
            ))),
        };
        self.finish(result);
    }

    fn finish(&mut self, result: Result<(), WorkerError>) {
        if let Some(mut done) = self.done.take() {
            let result = match result {
                Ok(()) => RResult::ROk(()),
                Err(e) => RResult::RErr(e.0.into()),
            };
            done.complete(result);
        }
    }
}

impl Drop for AsyncBatch {
    /// A batch dropped without completing fails, so its clients are answered.
    fn drop(&mut self) {
        let why = if std::thread::panicking() {
            "the worker panicked while holding the batch"
        } else {
            "the worker dropped the batch without completing it"
        };
        self.finish(Err(WorkerError::new(why)));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use abi_stable::std_types::{RSlice, RSliceMut};

    use super::*;
    use crate::TD_Opaque;

    /// Every completion a probe was told of.
    type Log = Arc<Mutex<Vec<Result<(), String>>>>;

    /// A host's batch in flight that records every completion it is told of.
    struct Probe(Log);

    impl BatchCompletion for Probe {
        fn batch(&mut self) -> BatchFfi<'static, 'static> {
            BatchFfi {
                inputs: RSlice::from_slice(&[]),
                outputs: RSliceMut::from_mut_slice(&mut []),
                requests: RSliceMut::from_mut_slice(&mut []),
            }
        }

        fn complete(&mut self, result: RResult<(), RString>) {
            let result = result.into_result().map_err(RString::into_string);
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(result);
        }
    }

    fn probe() -> (AsyncBatch, Log) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let done = BatchCompletion_TO::from_value(Probe(Arc::clone(&seen)), TD_Opaque);
        (AsyncBatch::new(done), seen)
    }

    fn seen(s: &Mutex<Vec<Result<(), String>>>) -> Vec<Result<(), String>> {
        s.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    #[test]
    fn completed_once_from_another_thread() {
        let (mut batch, log) = probe();
        assert_eq!(batch.batch().request_count(), 0);
        std::thread::spawn(move || batch.complete(Ok(())))
            .join()
            .unwrap_or_else(|_| panic!("completing thread panicked"));
        assert_eq!(seen(&log), vec![Ok(())]);
    }

    #[test]
    fn a_dropped_handle_fails_the_batch() {
        let (batch, log) = probe();
        drop(batch);
        let got = seen(&log);
        assert_eq!(got.len(), 1);
        assert!(matches!(&got[0], Err(e) if e.contains("dropped the batch without completing")));
    }

    #[test]
    fn a_panic_fails_the_batch_with_its_message() {
        let (batch, log) = probe();
        batch.complete_with(|_| panic!("unit 3 fell over"));
        assert_eq!(
            seen(&log),
            vec![Err("worker panicked: unit 3 fell over".to_owned())]
        );
        // Dropped by a thread that unwinds: failed, and said so.
        let (batch, log) = probe();
        let unwound = std::thread::spawn(move || {
            let _held = batch;
            panic!("outside complete_with");
        })
        .join();
        assert!(unwound.is_err());
        let got = seen(&log);
        assert_eq!(got.len(), 1);
        assert!(matches!(&got[0], Err(e) if e.contains("panicked while holding")));
    }

    #[test]
    fn an_error_fails_the_batch() {
        let (batch, log) = probe();
        batch.complete_with(|_| Err(WorkerError::new("unit fault")));
        assert_eq!(seen(&log), vec![Err("unit fault".to_owned())]);
    }
}
