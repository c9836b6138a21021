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

use std::sync::Arc;

use bytes::Bytes;
use kiln_batchers::sequence::SequenceEvent;
use kiln_worker_sdk::{Shape, WorkerInfo};
use tokio::sync::oneshot;

use crate::error::Result;
use crate::infer::{InferResponse, OutputTensor};

/// What a request is answered with: its row of a batch that ran, or its error.
pub type Answer = Result<Answered>;

/// How a request is answered once its batch has run.
pub struct Reply {
    pub tx: oneshot::Sender<Answer>,
    pub id: Option<String>,
    /// Bit `i` set: return output `i`.
    pub output_mask: u64,
    /// The request's span, when its trace is sampled ([`crate::trace`]).
    pub trace: Option<crate::trace::SpanIds>,
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

/// A batch's outputs, shared by the answers of its requests.
pub struct BatchOutputs {
    pub model: Arc<AnswerModel>,
    pub outputs: Vec<RunOutput>,
}

/// One request's answer: row `index` of a batch's outputs, the outputs it asked
/// for, and its id.
pub struct Answered {
    pub batch: Arc<BatchOutputs>,
    pub index: usize,
    /// Bit `k` set: return output `k`.
    pub output_mask: u64,
    pub id: Option<String>,
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
    /// The response, built on the caller's thread.
    pub fn into_response(self) -> InferResponse {
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
        InferResponse {
            model_name: model.name.clone(),
            model_version: model.version.clone(),
            id: self.id,
            outputs,
        }
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
