//! kiln-buffers: buffer backends and bounded pools.
//!
//! - [`AlignedBuf`]: growable CPU memory aligned to 64 bytes, reused across batches.
//! - [`BufferSet`]: one batch's input and output buffers.
//! - [`Pool`]: a fixed number of items handed out and returned on drop; taking one
//!   blocks while all are out. The pool size bounds the batches in flight.
//! - [`cuda`] (feature `cuda`): pinned host and device memory on an NVIDIA GPU,
//!   driver loaded at run time; CUDA workers take their staging sets from a [`Pool`].

mod aligned;
#[cfg(feature = "cuda")]
pub mod cuda;
mod pool;

pub use aligned::AlignedBuf;
pub use pool::{Pool, Pooled, TooLarge};

/// The buffers of one batch: one per worker input and one per worker output.
#[derive(Debug, Default)]
pub struct BufferSet {
    pub inputs: Vec<AlignedBuf>,
    pub outputs: Vec<AlignedBuf>,
}

impl BufferSet {
    /// A set with buffers of these initial capacities (bytes).
    pub fn with_capacities(inputs: &[usize], outputs: &[usize]) -> BufferSet {
        BufferSet {
            inputs: inputs
                .iter()
                .map(|&c| AlignedBuf::with_capacity(c))
                .collect(),
            outputs: outputs
                .iter()
                .map(|&c| AlignedBuf::with_capacity(c))
                .collect(),
        }
    }

    /// Empties every buffer, keeping its memory.
    pub fn clear(&mut self) {
        self.inputs
            .iter_mut()
            .chain(&mut self.outputs)
            .for_each(AlignedBuf::clear);
    }
}
