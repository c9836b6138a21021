//! kiln-batchers: turn single requests into batches.
//!
//! Hard and soft batches are formed by whoever runs them: a group's instance threads
//! take turns on a [`BatchFormer`] over the group's request queue (or a thread runs
//! [`run_batcher`] and hands the batches on). Forming a batch takes a request,
//! takes a buffer set from the group's pool (blocking while every set is in flight:
//! the backpressure), copies request tensors into the set's contiguous memory, and
//! ends the [`Batch`] when the policy fires:
//!
//! - **hard**: exactly `batch_size` rows;
//! - **soft**: up to `batch_size` rows, or what has arrived when `timeout` after the
//!   first request (counted from its arrival) expires; with no timeout, a batcher
//!   that finds requests waiting while its callers fall behind lets up to half as
//!   many as they hold answers of gather first ([`gather_target`]);
//! - **dynamic** ([`dynamic`]): Triton's dynamic batcher;
//! - **sequence** ([`sequence`]): Triton's sequence batcher, for stateful models.
//!
//! A request whose first dimension is a batch of its own counts with that many rows
//! and is never split. Unless the worker allows ragged batches, a batch only holds
//! requests whose non-batch dimensions match. Nothing here knows about protocols:
//! a request carries an opaque reply handle `R`.

pub mod admission;
mod batch;
mod batcher;
pub mod dynamic;
mod request;
pub mod sequence;

pub use admission::{Admission, Ticket};
pub use batch::{Batch, Member, KEEP_INPUTS_UP_TO};
pub use batcher::{
    form_batch, gather_target, run_batcher, wait_for_first, wait_for_first_or_stop, BatchFormer,
    BatcherConfig, Idle, Screen, GATHER_FROM_HELD, GATHER_GAP, GATHER_MOST, IDLE_LINGER,
    LEAVE_POLL,
};
pub use request::{Request, Tensor};
