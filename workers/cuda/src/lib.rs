//! `cuda`: kernels compiled at load time with NVRTC, run on an NVIDIA GPU with
//! staging buffers from kiln-buffers' `cuda` backend. One plugin, the `kernel`
//! load parameter picks what an instance runs (one NVRTC program, one context and
//! pool type for both; a repository names each as its own model, e.g.
//! `cuda-invert-image` and `cuda-matvec`):
//!
//! - `invert-image`: UINT8 `image` [H, W, C] → `inverted` = 255 − v, the contract of
//!   the CPU `invert-image` worker (no batching: one image per batch, any size).
//! - `matvec`: FP32 `matrix` [rows, cols] and `vector` [cols] → `product` [rows]
//!   per request (a batched matrix–vector product, batched up to `max_batch_size`).
//!
//! Without a driver, NVRTC or device the load fails naming why (HTTP 400): see
//! [`kiln_buffers::cuda::open`]. No tokio: `run` is synchronous on the instance
//! thread and waits for its chunks' events; panics are caught by the SDK.

pub mod chunks;
pub mod config;
pub mod kernels;
pub mod pipeline;

pub use kiln_buffers::cuda::probe;
use kiln_buffers::cuda::{self, CudaError, Libraries};
use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamSpec, Params, Shape, TensorSpec, Worker,
    WorkerError, WorkerInfo,
};

use config::{Config, Kernel};
use kernels::Compiled;
use pipeline::Pipeline;

/// The CUDA worker.
pub struct CudaWorker {
    config: Config,
    kernel: Compiled,
    pipeline: Pipeline,
}

fn gpu_error(e: CudaError) -> WorkerError {
    WorkerError::new(format!("cuda worker: {e}"))
}

impl Worker for CudaWorker {
    const PARAMETERS: &'static [ParamSpec] = config::PARAMETERS;

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        CudaWorker::open(Config::from_params(params)?)
    }

    fn info(&self) -> WorkerInfo {
        match self.config.kernel {
            Kernel::InvertImage => WorkerInfo {
                inputs: vec![TensorSpec::new("image", DataType::Uint8, &[-1, -1, -1])].into(),
                outputs: vec![TensorSpec::new("inverted", DataType::Uint8, &[-1, -1, -1])].into(),
                max_batch_size: 0,
                batcher: BatcherKind::Soft,
                allow_ragged_batch: true,
            },
            Kernel::Matvec => {
                let (rows, cols) = (self.config.rows as i64, self.config.cols as i64);
                WorkerInfo {
                    inputs: vec![
                        TensorSpec::new("matrix", DataType::Fp32, &[rows, cols]),
                        TensorSpec::new("vector", DataType::Fp32, &[cols]),
                    ]
                    .into(),
                    outputs: vec![TensorSpec::new("product", DataType::Fp32, &[rows])].into(),
                    max_batch_size: self.config.max_batch_size as u32,
                    batcher: BatcherKind::Soft,
                    allow_ragged_batch: false,
                }
            }
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        match self.config.kernel {
            Kernel::InvertImage => self.invert(batch),
            Kernel::Matvec => self.matvec(batch),
        }
    }
}

impl CudaWorker {
    /// Opens the device, compiles the kernel and allocates the staging pool.
    pub fn open(config: Config) -> Result<CudaWorker, WorkerError> {
        let libraries = Libraries {
            dir: config.library_dir.clone(),
        };
        let ctx = cuda::open(config.device, &libraries).map_err(gpu_error)?;
        let kernel = Compiled::new(&ctx, config.kernel).map_err(gpu_error)?;
        let (inputs, outputs) = config.chunk_sizes();
        let pipeline = Pipeline::new(
            &ctx,
            config.streams,
            config.staging_sets(),
            &inputs,
            &outputs,
        )
        .map_err(gpu_error)?;
        Ok(CudaWorker {
            config,
            kernel,
            pipeline,
        })
    }

    fn invert(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let mut output = batch.output(0)?;
        let out = output.allocate(input.shapes())?;
        self.invert_bytes(input.bytes(), out)
    }

    /// Inverts `data` into `out` (same length) through the GPU.
    pub fn invert_bytes(&mut self, data: &[u8], out: &mut [u8]) -> Result<(), WorkerError> {
        if out.len() != data.len() {
            return Err(format!(
                "output of {} bytes for {} input bytes",
                out.len(),
                data.len()
            )
            .into());
        }
        let kernel = &self.kernel;
        let launch = |stream: &_, set: &cuda::CudaBufferSet, chunk: &chunks::Chunk| {
            kernel.invert(
                stream,
                set.inputs[0].device.ptr(),
                set.outputs[0].device.ptr(),
                chunk.items,
            )
        };
        let chunks = chunks::bytes(data.len(), self.config.chunk_bytes);
        self.pipeline
            .run(&[data], out, chunks, &launch)
            .map_err(gpu_error)
    }

    fn matvec(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let rows = self.config.rows;
        let matrix = batch.input(0)?;
        let vector = batch.input(1)?;
        // Batch rows: one matrix and one vector each.
        let requests = batch.rows();
        let mut output = batch.output(0)?;
        // Each request's product: [its batch rows, rows].
        let shapes = vector
            .shapes()
            .iter()
            .map(|s| Shape::new(&[s.rows() as i64, rows as i64]))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| WorkerError::new("product shape"))?;
        let out = output.allocate(&shapes)?;
        self.matvec_bytes(requests, matrix.bytes(), vector.bytes(), out)
    }

    /// `requests` products of FP32 matrices and vectors (bytes, back to back) into
    /// `out`, through the GPU.
    pub fn matvec_bytes(
        &mut self,
        requests: usize,
        matrix: &[u8],
        vector: &[u8],
        out: &mut [u8],
    ) -> Result<(), WorkerError> {
        let (rows, cols) = (self.config.rows, self.config.cols);
        let f = std::mem::size_of::<f32>();
        let row_bytes = [rows * cols * f, cols * f];
        if matrix.len() != requests * row_bytes[0]
            || vector.len() != requests * row_bytes[1]
            || out.len() != requests * rows * f
        {
            return Err(format!(
                "{requests} requests with {} matrix, {} vector and {} product bytes \
                 (want {rows}x{cols}, {cols} and {rows} FP32 each)",
                matrix.len(),
                vector.len(),
                out.len()
            )
            .into());
        }
        let kernel = &self.kernel;
        let launch = |stream: &_, set: &cuda::CudaBufferSet, chunk: &chunks::Chunk| {
            let ptrs = (
                set.inputs[0].device.ptr(),
                set.inputs[1].device.ptr(),
                set.outputs[0].device.ptr(),
            );
            kernel.matvec(stream, ptrs, chunk.items, rows, cols)
        };
        let chunks = chunks::rows(requests, self.config.chunk_rows, row_bytes, rows * f);
        self.pipeline
            .run(&[matrix, vector], out, chunks, &launch)
            .map_err(gpu_error)
    }
}

export_worker!(CudaWorker);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::types::params_from_pairs;

    #[test]
    fn without_a_gpu_init_says_why() {
        if let Ok(device) = cuda::probe() {
            println!("GPU present ({device}): the no-driver error is tested on CPU machines");
            return;
        }
        let params = params_from_pairs(&[("kernel", "invert-image")]);
        let err = CudaWorker::init(Params(&params)).err().unwrap().to_string();
        assert!(
            err.starts_with("cuda worker: CUDA is unavailable: "),
            "{err}"
        );
        let params = params_from_pairs(&[
            ("kernel", "matvec"),
            ("cuda_library_dir", "/nonexistent/cuda"),
        ]);
        let err = CudaWorker::init(Params(&params)).err().unwrap().to_string();
        assert!(err.contains("/nonexistent/cuda does not exist"), "{err}");
    }
}
