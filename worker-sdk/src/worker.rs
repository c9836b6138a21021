//! The trait a plugin author implements: plain Rust, free to panic (the SDK catches it).

use crate::async_batch::AsyncBatch;
use crate::batch::Batch;
use crate::error::WorkerError;
use crate::spec::ParamSpec;
use crate::types::{Params, WorkerInfo};

/// A worker: one instance of a plugin's compute. The server drives each instance on
/// one thread through `init → allocate → acquire → run… → release → deallocate →
/// destroy` (destroy is `Drop`). Panics in any step are caught at the boundary.
pub trait Worker: Send + Sized + 'static {
    /// The worker's parameters: which load-time ones only the operator may set
    /// (files, folders, libraries, hosts), and the request parameters the server
    /// checks at admission. Read by the server before any `init`; parameters not
    /// declared here are passed through unchecked.
    const PARAMETERS: &'static [ParamSpec] = &[];

    /// Creates the worker from its load-time parameters (`batch_size`, and any of the
    /// worker's own).
    fn init(params: Params<'_>) -> Result<Self, WorkerError>;

    /// Describes inputs, outputs and batching. Called after `init`.
    fn info(&self) -> WorkerInfo;

    /// Allocates per-instance resources sized for `batch_size` rows.
    fn allocate(&mut self, _batch_size: usize) -> Result<(), WorkerError> {
        Ok(())
    }

    /// Acquires what running needs (sessions, devices). Called again after a failure.
    fn acquire(&mut self) -> Result<(), WorkerError> {
        Ok(())
    }

    /// Runs one batch: read the inputs, allocate and fill every output. An error
    /// fails every request of the batch (HTTP 500); [`Batch::fail`] fails one
    /// request alone, with its own error.
    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError>;

    /// Releases what `acquire` took.
    fn release(&mut self) -> Result<(), WorkerError> {
        Ok(())
    }

    /// Frees what `allocate` took.
    fn deallocate(&mut self) -> Result<(), WorkerError> {
        Ok(())
    }
}

/// An asynchronous worker (a device driven through a thread-safe runner, such as an
/// FPGA's compute units): `submit` takes a batch and returns at once; the worker
/// completes the batch later, from any thread, through the [`AsyncBatch`] it was
/// given. The server keeps at most `max_outstanding` batches (a load parameter)
/// submitted to each instance, and the lifecycle steps are as [`Worker`]'s, on the
/// instance's thread; `release` comes only after every submitted batch completed.
pub trait AsyncWorker: Send + Sized + 'static {
    /// See [`Worker::PARAMETERS`].
    const PARAMETERS: &'static [ParamSpec] = &[];

    /// See [`Worker::init`].
    fn init(params: Params<'_>) -> Result<Self, WorkerError>;

    /// See [`Worker::info`].
    fn info(&self) -> WorkerInfo;

    /// See [`Worker::allocate`].
    fn allocate(&mut self, _batch_size: usize) -> Result<(), WorkerError> {
        Ok(())
    }

    /// See [`Worker::acquire`].
    fn acquire(&mut self) -> Result<(), WorkerError> {
        Ok(())
    }

    /// Takes one batch and returns without waiting for it: the batch is the
    /// worker's until it completes it ([`AsyncBatch::complete`] or
    /// [`AsyncBatch::complete_with`]); dropping it fails the batch. A failed batch
    /// fails only its own requests (no restart: other batches may be in flight).
    fn submit(&mut self, batch: AsyncBatch);

    /// See [`Worker::release`]. Called once no batch is in flight.
    fn release(&mut self) -> Result<(), WorkerError> {
        Ok(())
    }

    /// See [`Worker::deallocate`].
    fn deallocate(&mut self) -> Result<(), WorkerError> {
        Ok(())
    }
}
