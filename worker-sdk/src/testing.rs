//! Unit-testing a worker in-process, without the server: [`Harness`] drives a
//! [`Worker`] through the same boundary object the server uses (so panics are caught
//! exactly as they are when served) on batches built from plain vectors.

use abi_stable::std_types::{RResult, RSliceMut, RStr, RString};

use crate::batch::{BatchFfi, InputFfi, OutputBuffer, OutputFfi, RequestFfi};
use crate::error::{RequestError, WorkerError};
use crate::ffi::{new_worker, WorkerBox};
use crate::types::{params_from_pairs, tensor_byte_len, DataType, Param, Shape, WorkerInfo};
use crate::worker::Worker;

/// One tensor of a test request or response.
#[derive(Debug, Clone, PartialEq)]
pub struct TestTensor {
    pub name: String,
    pub dtype: DataType,
    pub shape: Shape,
    pub data: Vec<u8>,
}

impl TestTensor {
    /// A tensor from typed elements.
    pub fn new<T: bytemuck::Pod>(name: &str, dtype: DataType, dims: &[i64], data: &[T]) -> Self {
        TestTensor {
            name: name.to_owned(),
            dtype,
            shape: Shape::new(dims).unwrap_or(Shape::scalar()),
            data: bytemuck::cast_slice(data).to_vec(),
        }
    }

    /// The data as elements of `T`.
    pub fn values<T: bytemuck::Pod>(&self) -> Vec<T> {
        bytemuck::pod_collect_to_vec(&self.data)
    }
}

/// 16-byte aligned growable bytes (the host guarantees aligned batch memory).
#[derive(Default)]
struct AlignedBytes {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBytes {
    fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// Resizes to `len` bytes; an error (never an abort) when the memory cannot be had.
    fn resize(&mut self, len: usize) -> Result<&mut [u8], String> {
        let words = len.div_ceil(16);
        let more = words.saturating_sub(self.words.len());
        self.words
            .try_reserve_exact(more)
            .map_err(|e| format!("cannot allocate {len} bytes: {e}"))?;
        self.words.resize(words, 0);
        self.len = len;
        Ok(&mut bytemuck::cast_slice_mut(&mut self.words)[..len])
    }
}

impl OutputBuffer for AlignedBytes {
    fn resize(&mut self, len: usize) -> RResult<RSliceMut<'_, u8>, RString> {
        match AlignedBytes::resize(self, len) {
            Ok(buf) => RResult::ROk(buf.into()),
            Err(e) => RResult::RErr(e.into()),
        }
    }
}

/// One request's answer from [`Harness::run_requests`]: its outputs, or the error
/// the worker failed it with ([`crate::Batch::fail`]).
pub type Outcome = Result<Vec<TestTensor>, RequestError>;

/// Drives one worker instance through its lifecycle.
pub struct Harness {
    worker: WorkerBox,
    info: WorkerInfo,
}

impl Harness {
    /// `init`, `allocate` and `acquire` a `W` with these text parameters.
    pub fn start<W: Worker>(params: &[(&str, &str)]) -> Result<Harness, WorkerError> {
        let params: Vec<Param> = params_from_pairs(params);
        let mut worker = new_worker::<W>();
        let info = worker.init(params.as_slice().into()).into_result()?;
        let batch_size = (info.max_batch_size as usize).max(1);
        worker.allocate(batch_size).into_result()?;
        worker.acquire().into_result()?;
        Ok(Harness { worker, info })
    }

    /// What the worker said about itself.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// Runs one batch of `requests` (each a list of tensors, one per declared input,
    /// in any order) and returns each request's outputs in declared order. A request
    /// the worker failed alone fails the call with its message.
    pub fn run(
        &mut self,
        requests: &[Vec<TestTensor>],
    ) -> Result<Vec<Vec<TestTensor>>, WorkerError> {
        let requests: Vec<(Vec<TestTensor>, Vec<Param>)> =
            requests.iter().map(|r| (r.clone(), Vec::new())).collect();
        self.run_requests(&requests)?
            .into_iter()
            .map(|outcome| outcome.map_err(|e| WorkerError::new(e.message.into_string())))
            .collect()
    }

    /// Runs one batch of requests, each its tensors and its parameters, and returns
    /// each request's outcome: the batch's error fails the call, a request the
    /// worker failed alone has its own error.
    pub fn run_requests(
        &mut self,
        requests: &[(Vec<TestTensor>, Vec<Param>)],
    ) -> Result<Vec<Outcome>, WorkerError> {
        let mut input_data: Vec<(AlignedBytes, Vec<Shape>)> = Vec::new();
        for spec in self.info.inputs.iter() {
            let mut bytes = Vec::new();
            let mut shapes = Vec::new();
            for (request, _) in requests {
                let tensor = request
                    .iter()
                    .find(|t| t.name == spec.name.as_str())
                    .ok_or_else(|| {
                        WorkerError::new(format!("request lacks input `{}`", spec.name))
                    })?;
                bytes.extend_from_slice(&tensor.data);
                shapes.push(tensor.shape);
            }
            let mut aligned = AlignedBytes::default();
            aligned.resize(bytes.len())?.copy_from_slice(&bytes);
            input_data.push((aligned, shapes));
        }
        let inputs: Vec<InputFfi<'_>> = self
            .info
            .inputs
            .iter()
            .zip(&input_data)
            .map(|(spec, (data, shapes))| InputFfi {
                name: RStr::from_str(spec.name.as_str()),
                dtype: spec.dtype,
                data: data.as_slice().into(),
                shapes: shapes.as_slice().into(),
            })
            .collect();
        let mut out_buffers: Vec<AlignedBytes> = self
            .info
            .outputs
            .iter()
            .map(|_| AlignedBytes::default())
            .collect();
        let mut out_shapes: Vec<Vec<Shape>> = self
            .info
            .outputs
            .iter()
            .map(|_| vec![Shape::scalar(); requests.len()])
            .collect();
        let mut outputs: Vec<OutputFfi<'_>> = self
            .info
            .outputs
            .iter()
            .zip(out_buffers.iter_mut().zip(out_shapes.iter_mut()))
            .map(|(spec, (buffer, shapes))| OutputFfi::new(spec, shapes, buffer))
            .collect();
        let mut metas: Vec<RequestFfi<'_>> = requests
            .iter()
            .map(|(_, params)| RequestFfi::new(params))
            .collect();
        let mut batch = BatchFfi {
            inputs: inputs.as_slice().into(),
            outputs: outputs.as_mut_slice().into(),
            requests: metas.as_mut_slice().into(),
        };
        self.worker.run(&mut batch).into_result()?;
        let failures: Vec<Option<RequestError>> =
            metas.into_iter().map(|m| m.failure.into_option()).collect();
        let written: Vec<(bool, usize)> = outputs.iter().map(|o| (o.written, o.len)).collect();
        drop(outputs);
        let mut responses = vec![Vec::new(); requests.len()];
        for (((spec, buffer), shapes), (was_written, len)) in self
            .info
            .outputs
            .iter()
            .zip(&out_buffers)
            .zip(&out_shapes)
            .zip(written)
        {
            if !was_written {
                return Err(WorkerError::new(format!(
                    "worker did not write output `{}`",
                    spec.name
                )));
            }
            let mut rest = &buffer.as_slice()[..len];
            for (response, shape) in responses.iter_mut().zip(shapes) {
                let n = tensor_byte_len(spec.dtype, shape.element_count(), rest)?;
                let (mine, tail) = rest
                    .split_at_checked(n)
                    .ok_or_else(|| WorkerError::new(format!("output `{}` is short", spec.name)))?;
                rest = tail;
                response.push(TestTensor {
                    name: spec.name.to_string(),
                    dtype: spec.dtype,
                    shape: *shape,
                    data: mine.to_vec(),
                });
            }
        }
        Ok(responses
            .into_iter()
            .zip(failures)
            .map(|(tensors, failure)| match failure {
                Some(error) => Err(error),
                None => Ok(tensors),
            })
            .collect())
    }

    /// Restarts the instance as the server does after a failed batch.
    pub fn restart(&mut self) -> Result<(), WorkerError> {
        self.worker.release().into_result()?;
        Ok(self.worker.acquire().into_result()?)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.worker.release();
        let _ = self.worker.deallocate();
        self.worker.destroy();
    }
}
