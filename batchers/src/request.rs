//! A protocol-free inference request.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_worker_sdk::{DataType, Param, Shape};

use crate::admission::Ticket;
use crate::sequence::SequenceFlags;

/// One input tensor of one request.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub dtype: DataType,
    pub shape: Shape,
    pub data: Bytes,
}

/// A request, validated against the worker: one tensor per declared input, in
/// declared order. `R` answers the client; batchers only carry it.
#[derive(Debug)]
pub struct Request<R> {
    pub inputs: Vec<Tensor>,
    /// Rows this request adds to a batch (its batch dimension; 1 when the worker does
    /// not batch).
    pub rows: usize,
    /// The request's own parameters, handed to the worker.
    pub params: Vec<Param>,
    /// When the request was accepted.
    pub arrived: Instant,
    /// Priority level (1 highest) for the dynamic batcher; `None` or 0: the default.
    pub priority: Option<u32>,
    /// The request's own queue timeout (the dynamic batcher's policy decides whether
    /// it may apply; it can only shorten the default).
    pub timeout: Option<Duration>,
    /// The sequence the request belongs to (sequence batcher only).
    pub sequence: Option<SequenceFlags>,
    /// Its place in the group's queue bound, held until it joins a batch or leaves
    /// (`None`: not counted, e.g. in tests and benches).
    pub ticket: Option<Ticket>,
    pub reply: R,
}

impl<R> Request<R> {
    /// Whether `other` has the same non-batch dimensions on every input.
    pub fn same_inner_shapes(&self, other: &Request<R>) -> bool {
        self.inputs.len() == other.inputs.len()
            && self
                .inputs
                .iter()
                .zip(&other.inputs)
                .all(|(a, b)| a.shape.inner() == b.shape.inner())
    }
}
