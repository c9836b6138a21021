//! Chunks of a batch through the GPU with copies overlapped with compute.
//!
//! Each chunk takes a staging set from the instance's pool, the CPU copies its
//! inputs into the set's pinned memory, and its upload, kernel and download are
//! enqueued on one of the streams (round robin), followed by the set's event. While
//! the GPU works on chunk k, the CPU fills chunk k+1 and the other stream's copy
//! engines move data: with two streams an upload, a kernel and a download run at
//! once. When every set is in flight, the oldest chunk is finished (wait on its
//! event, copy its output out of pinned memory) and its set reused, so the pool
//! bounds both the pinned/device memory and the chunks in flight.
//!
//! Measured on an H200 with a 6 MB image (docs/benchmarks.md, "CUDA"): chunks of
//! 1 MiB bring a batch from 1.14 ms (one chunk) to ~0.93 ms; the kernel is ~12 µs and
//! the bus ~0.24 ms of it, the rest is this thread's copies through pinned staging.

use std::collections::VecDeque;
use std::sync::Arc;

use kiln_buffers::cuda::cudarc::driver::{CudaContext, CudaStream};
use kiln_buffers::cuda::{CudaBufferSet, CudaError};
use kiln_buffers::{Pool, Pooled};

use crate::chunks::Chunk;

/// Enqueues a chunk's kernel: the stream, the set (device addresses of its
/// uploaded inputs and of its output) and the chunk.
pub type Launch<'a> = dyn Fn(&CudaStream, &CudaBufferSet, &Chunk) -> Result<(), CudaError> + 'a;

/// One instance's streams and staging pool.
pub struct Pipeline {
    ctx: Arc<CudaContext>,
    streams: Vec<Arc<CudaStream>>,
    pool: Arc<Pool<CudaBufferSet>>,
    /// Chunks in flight, oldest first (kept to reuse its memory).
    in_flight: VecDeque<(Pooled<CudaBufferSet>, Chunk)>,
}

impl Pipeline {
    /// `streams` streams and `sets` staging sets of these sizes (bytes).
    pub fn new(
        ctx: &Arc<CudaContext>,
        streams: usize,
        sets: usize,
        input_sizes: &[usize],
        output_sizes: &[usize],
    ) -> Result<Pipeline, CudaError> {
        let streams = (0..streams.max(1))
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        let pool = CudaBufferSet::pool(ctx, sets, input_sizes, output_sizes)?;
        Ok(Pipeline {
            ctx: Arc::clone(ctx),
            streams,
            pool,
            in_flight: VecDeque::with_capacity(sets),
        })
    }

    /// Runs every chunk: `inputs` are the batch's input bytes, `output` the batch's
    /// output to fill. On error the chunks in flight are waited for (their sets'
    /// memory outlives their copies) and the batch fails.
    pub fn run(
        &mut self,
        inputs: &[&[u8]],
        output: &mut [u8],
        chunks: impl Iterator<Item = Chunk>,
        launch: &Launch<'_>,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        let enqueue = || -> Result<(), CudaError> {
            for (index, chunk) in chunks.enumerate() {
                let mut set = self.take_set(output)?;
                let stream = &self.streams[index % self.streams.len()];
                for ((staging, range), data) in set.inputs.iter_mut().zip(&chunk.inputs).zip(inputs)
                {
                    let src = data.get(range.clone()).ok_or_else(|| out_of_range(range))?;
                    staging.reserve(&self.ctx, src.len())?;
                    staging.host.as_mut_slice()[..src.len()].copy_from_slice(src);
                    staging.upload(stream, src.len())?;
                }
                let out_len = chunk.output.len();
                if let Some(staging) = set.outputs.first_mut() {
                    staging.reserve(&self.ctx, out_len)?;
                }
                launch(stream, &set, &chunk)?;
                if let Some(staging) = set.outputs.first_mut() {
                    staging.download(stream, out_len)?;
                }
                set.record(stream)?;
                self.in_flight.push_back((set, chunk));
            }
            Ok(())
        };
        let result = enqueue();
        // Whatever happened, nothing stays in flight past this batch.
        let mut finished = Ok(());
        while let Some((mut set, chunk)) = self.in_flight.pop_front() {
            let done = finish(&mut set, &chunk, output);
            if finished.is_ok() {
                finished = done;
            }
        }
        result.and(finished)
    }

    /// A free staging set, or when every set is in flight the oldest one, finished.
    fn take_set(&mut self, output: &mut [u8]) -> Result<Pooled<CudaBufferSet>, CudaError> {
        if let Some(set) = self.pool.try_acquire() {
            return Ok(set);
        }
        let (mut set, done) = self.in_flight.pop_front().ok_or_else(|| {
            CudaError::Size("the staging pool is empty with nothing in flight".into())
        })?;
        finish(&mut set, &done, output)?;
        Ok(set)
    }
}

/// Waits for a chunk and copies its output from pinned memory into the batch.
fn finish(set: &mut CudaBufferSet, chunk: &Chunk, output: &mut [u8]) -> Result<(), CudaError> {
    set.wait()?;
    let dst = output
        .get_mut(chunk.output.clone())
        .ok_or_else(|| out_of_range(&chunk.output))?;
    let staging = set
        .outputs
        .first()
        .ok_or_else(|| CudaError::Size("a staging set without an output".into()))?;
    dst.copy_from_slice(&staging.host.as_slice()[..dst.len()]);
    Ok(())
}

fn out_of_range(range: &std::ops::Range<usize>) -> CudaError {
    CudaError::Size(format!("chunk bytes {range:?} outside the batch"))
}
