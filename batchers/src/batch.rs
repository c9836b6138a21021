//! A batch: pooled contiguous input memory plus what answering each request needs.

use std::time::Instant;

use kiln_buffers::{BufferSet, Pooled};
use kiln_worker_sdk::{Param, Shape};

use crate::admission::Ticket;
use crate::request::{Request, Tensor};

/// The most bytes of a request's tensors its batch keeps, to be let go with its
/// answer ([`Member::inputs`]).
pub const KEEP_INPUTS_UP_TO: usize = 64 * 1024;

/// What a batch keeps of each request once its tensors are copied in.
#[derive(Debug)]
pub struct Member<R> {
    pub rows: usize,
    pub params: Vec<Param>,
    pub arrived: Instant,
    /// The sequence batcher's handle of the request's sequence: the instance reports
    /// the sequence's new state under it.
    pub sequence: Option<u64>,
    /// The request's tensors, already copied into the batch: kept to be let go by
    /// whoever answers the client (the thread that made them), not by the thread
    /// that formed the batch. With glibc's per-thread arenas a free of memory
    /// another thread allocated takes that thread's arena lock, and the two threads
    /// then wait on each other once per request. Empty when the tensors came to
    /// more than [`KEEP_INPUTS_UP_TO`] bytes: those are let go at once.
    pub inputs: Vec<Tensor>,
    pub reply: R,
}

/// Requests combined for one `run`: input `i` of every request lies back to back in
/// `buffers.inputs[i]`, and `shapes[i][j]` is request `j`'s shape of input `i`.
pub struct Batch<R> {
    pub buffers: Pooled<BufferSet>,
    pub shapes: Vec<Vec<Shape>>,
    pub members: Vec<Member<R>>,
    pub rows: usize,
    /// The batch's number in formation order (dynamic batcher), for
    /// `preserve_ordering`.
    pub order: u64,
    /// The first request kept for shape comparisons (its tensors are already copied).
    first_shapes: Vec<Shape>,
    /// The members' places in the queue bound, given back together by
    /// [`Batch::release_places`] once the batch is formed (or when it is dropped).
    places: Option<Ticket>,
}

impl<R> Batch<R> {
    /// An empty batch on a cleared buffer set, for a worker with `inputs` inputs.
    pub fn new(mut buffers: Pooled<BufferSet>, inputs: usize, capacity: usize) -> Batch<R> {
        buffers.clear();
        Batch {
            buffers,
            shapes: (0..inputs).map(|_| Vec::with_capacity(capacity)).collect(),
            members: Vec::with_capacity(capacity),
            rows: 0,
            order: 0,
            first_shapes: Vec::new(),
            places: None,
        }
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the batch holds no request.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Whether `request` may join without exceeding `batch_size` rows and, unless
    /// `ragged`, with the same non-batch dimensions as the batch.
    pub fn accepts(&self, request: &Request<R>, batch_size: usize, ragged: bool) -> bool {
        if self.members.is_empty() {
            return true;
        }
        self.rows + request.rows <= batch_size
            && (ragged
                || self
                    .first_shapes
                    .iter()
                    .zip(&request.inputs)
                    .all(|(a, b)| a.inner() == b.shape.inner()))
    }

    /// Copies `request`'s tensors in and keeps what answering it needs.
    pub fn push(&mut self, request: Request<R>) {
        if self.members.is_empty() {
            self.first_shapes = request.inputs.iter().map(|t| t.shape).collect();
        }
        let mut bytes = 0;
        for (i, tensor) in request.inputs.iter().enumerate() {
            if let (Some(buf), Some(shapes)) =
                (self.buffers.inputs.get_mut(i), self.shapes.get_mut(i))
            {
                buf.extend_from_slice(&tensor.data);
                shapes.push(tensor.shape);
            }
            bytes += tensor.data.len();
        }
        // Large tensors are let go at once: the batch does not hold them beside
        // their copy while it runs (and one free per request is nothing beside
        // copying them).
        let inputs = if bytes <= KEEP_INPUTS_UP_TO {
            request.inputs
        } else {
            Vec::new()
        };
        self.rows += request.rows;
        self.members.push(Member {
            rows: request.rows,
            params: request.params,
            arrived: request.arrived,
            sequence: request.sequence.map(|s| s.handle),
            inputs,
            reply: request.reply,
        });
        // In a batch now: its place in the queue bound is free, given back with the
        // batch's others (`release_places`).
        match (&mut self.places, request.ticket) {
            (Some(places), Some(ticket)) => places.absorb(ticket),
            (places @ None, ticket) => *places = ticket,
            (Some(_), None) => {}
        }
    }

    /// Gives back the queue places of the requests pushed so far: a batcher calls it
    /// once the batch is formed, and before it waits for more requests.
    pub fn release_places(&mut self) {
        self.places = None;
    }

    /// Pushes each of `requests`, then gives their places back.
    pub fn push_all(&mut self, requests: impl IntoIterator<Item = Request<R>>) {
        for request in requests {
            self.push(request);
        }
        self.release_places();
    }
}
