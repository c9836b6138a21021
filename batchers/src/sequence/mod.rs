//! Triton's sequence batcher, for stateful models.
//!
//! Requests carry a sequence id with start and end flags. Each live sequence is
//! pinned to one worker instance (and, with the `direct` strategy, to one batch slot
//! of it); a batch for an instance is formed only while that instance is idle, holds
//! at most one request per sequence, and each sequence's requests run in arrival
//! order. The server keeps each sequence's state tensors: a batch's state inputs are
//! the sequences' states, and the state outputs of a run become the next states, so a
//! stateful model runs as a stateless worker. Control inputs (START, END, READY,
//! CORRID) are filled in for workers that declare them.
//!
//! [`SequenceScheduler`] is the policy as a pure structure (every decision takes
//! `now`); [`SequenceFormer`] runs it on the instances' own turns (no thread of
//! its own).

mod layout;
mod scheduler;
mod turn;

pub use layout::{repeat, scalar_bytes, Control, InputLayout, InputSource, StateSpec};
pub use scheduler::{SequencePoll, SequenceRejection, SequenceScheduler};
pub use turn::{SequenceFormer, SequenceHost, SequenceTurn};

use std::fmt;
use std::time::Duration;

/// A sequence's correlation id as the client gives it: an unsigned integer or a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SequenceId {
    Number(u64),
    Text(String),
}

impl fmt::Display for SequenceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SequenceId::Number(n) => write!(f, "{n}"),
            SequenceId::Text(s) => write!(f, "\"{s}\""),
        }
    }
}

/// What a request says about its sequence (`sequence_id`, `sequence_start`,
/// `sequence_end` request parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceFlags {
    pub id: SequenceId,
    pub start: bool,
    pub end: bool,
    /// The scheduler's handle of the live sequence, set when the request is batched.
    pub handle: u64,
}

impl SequenceFlags {
    /// Flags for a request of sequence `id`.
    pub fn new(id: SequenceId, start: bool, end: bool) -> SequenceFlags {
        SequenceFlags {
            id,
            start,
            end,
            handle: 0,
        }
    }
}

/// How batches are formed from the live sequences of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Each sequence holds one batch slot of its instance; batch rows are in slot order.
    Direct,
    /// The sequences whose next requests are oldest go first; preferred sizes apply.
    Oldest,
}

impl Strategy {
    /// The name used in parameters and in Triton's configuration.
    pub const fn as_str(self) -> &'static str {
        match self {
            Strategy::Direct => "direct",
            Strategy::Oldest => "oldest",
        }
    }
}

/// The sequence batcher's settings (Triton's `sequence_batching`).
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceConfig {
    pub strategy: Strategy,
    /// Most requests (one row each) per batch; with `direct`, the slots per instance.
    pub max_batch_size: usize,
    /// `oldest`: batch sizes worth sending at once, ascending.
    pub preferred_batch_sizes: Vec<usize>,
    /// How long a partial batch may wait, counted from its oldest request, for every
    /// live sequence of the instance to have a request ready.
    pub max_queue_delay: Duration,
    /// A sequence with nothing queued or running for this long is freed.
    pub max_idle: Duration,
    /// Live sequences across all instances.
    pub max_sequences: usize,
    /// New sequences that may wait for a live one to end (beyond: refused).
    pub max_backlog: usize,
    /// Requests queued across all sequences (beyond: refused as queue full).
    pub max_queued: usize,
    /// Where each worker input comes from.
    pub layout: InputLayout,
}

/// A config for tests: one UINT32 client input and one UINT32 [1] state (zeros).
#[cfg(test)]
pub(crate) fn test_config(strategy: Strategy, max_batch_size: usize) -> SequenceConfig {
    use bytes::Bytes;
    use kiln_worker_sdk::{DataType, Shape};
    SequenceConfig {
        strategy,
        max_batch_size,
        preferred_batch_sizes: Vec::new(),
        max_queue_delay: Duration::ZERO,
        max_idle: Duration::from_millis(1000),
        max_sequences: 64,
        max_backlog: 0,
        max_queued: 1024,
        layout: InputLayout {
            sources: vec![InputSource::Client, InputSource::State(0)],
            states: vec![StateSpec {
                dtype: DataType::Uint32,
                dims: Shape::scalar().with_batch(1).unwrap_or(Shape::scalar()),
                initial: Bytes::copy_from_slice(&0u32.to_le_bytes()),
            }],
            batched: true,
        },
    }
}

/// Request `tag` of sequence `id`, for tests: its one input is `tag` as a UINT32.
#[cfg(test)]
pub(crate) fn test_request(
    id: u64,
    tag: u32,
    flags: (bool, bool),
    arrived: std::time::Instant,
) -> crate::Request<u32> {
    use bytes::Bytes;
    use kiln_worker_sdk::{DataType, Shape};
    crate::Request {
        inputs: vec![crate::Tensor {
            dtype: DataType::Uint32,
            shape: Shape::new(&[1, 1]).unwrap_or(Shape::scalar()),
            data: Bytes::copy_from_slice(&tag.to_le_bytes()),
        }],
        rows: 1,
        params: Vec::new(),
        arrived,
        priority: None,
        timeout: None,
        sequence: Some(SequenceFlags::new(SequenceId::Number(id), flags.0, flags.1)),
        ticket: None,
        reply: tag,
    }
}
