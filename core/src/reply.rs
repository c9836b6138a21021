//! How a request is answered once its batch has run: the [`Reply`] each queued
//! request carries, and a stateful model's [`SequenceLink`], through which its
//! instance reports each sequence's new state before answering. A leaf module:
//! the group, its instances and the sequence batcher's host all use these types.

use bytes::Bytes;
use kiln_batchers::sequence::SequenceEvent;
use tokio::sync::oneshot;

use crate::error::Result;
use crate::infer::InferResponse;

/// How a request is answered once its batch has run.
pub struct Reply {
    pub tx: oneshot::Sender<Result<InferResponse>>,
    pub id: Option<String>,
    /// Bit `i` set: return output `i`.
    pub output_mask: u64,
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
