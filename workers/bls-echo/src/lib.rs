//! `bls-echo`: a worker that calls another model (`kiln_worker_sdk::call`), to test
//! and show the mechanism. INT32 `INPUT0` [-1] → `OUTPUT0`: each request's values
//! are sent, as one call per request made together (so they can share the
//! callee's batches), to the model `target` (load parameter, default `echo`) as
//! its `INPUT0` of datatype `target_dtype` (`UINT32` or `INT32`, default
//! `UINT32`: the same bits), and the callee's `OUTPUT0` is the request's answer. A
//! failed call fails its request alone, with the callee's message (400 when the
//! call was invalid, else 500).

use kiln_worker_sdk::call::{self, CallErrorKind, CallInput, ModelCall};
use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, RequestError,
    TensorSpec, Worker, WorkerError, WorkerInfo,
};

/// The bls-echo worker.
pub struct BlsEcho {
    target: String,
    target_dtype: DataType,
}

impl Worker for BlsEcho {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::operator("target"),
        ParamSpec::load("target_dtype", ParamKind::Any),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let target_dtype = match params.string("target_dtype").as_deref() {
            None | Some("UINT32") => DataType::Uint32,
            Some("INT32") => DataType::Int32,
            Some(other) => {
                return Err(format!("target_dtype must be UINT32 or INT32, got `{other}`").into())
            }
        };
        Ok(BlsEcho {
            target: params.string("target").unwrap_or_else(|| "echo".into()),
            target_dtype,
        })
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("INPUT0", DataType::Int32, &[-1])].into(),
            outputs: vec![TensorSpec::new("OUTPUT0", DataType::Int32, &[-1])].into(),
            max_batch_size: 64,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let bytes = input.bytes();
        let shapes = input.shapes();
        // Each request's shape, batch dimension first, as the callee takes it.
        let dims: Vec<&[i64]> = shapes.iter().map(|s| s.dims()).collect();
        let mut calls = Vec::with_capacity(shapes.len());
        let mut start = 0;
        for (request, (dims, shape)) in dims.iter().zip(shapes).enumerate() {
            let end = start + shape.element_count() * 4;
            calls.push(ModelCall {
                model: &self.target,
                inputs: vec![CallInput {
                    name: "INPUT0",
                    dtype: self.target_dtype,
                    shape: dims,
                    data: &bytes[start..end],
                }],
                outputs: vec!["OUTPUT0"],
                for_request: Some(request),
                timeout: None,
            });
            start = end;
        }
        let answers = call::infer_all(&calls);
        let mut out = vec![0u8; bytes.len()];
        let mut start = 0;
        for (request, answer) in answers.into_iter().enumerate() {
            let end = start + shapes[request].element_count() * 4;
            let written = answer.and_then(|outputs| {
                let data = outputs
                    .into_iter()
                    .next()
                    .map(|o| o.data)
                    .unwrap_or_default();
                if data.len() == end - start {
                    Ok(data)
                } else {
                    Err(call::CallError::new(
                        CallErrorKind::Failed,
                        format!(
                            "`{}` answered {} bytes, not {}",
                            self.target,
                            data.len(),
                            end - start
                        ),
                    ))
                }
            });
            match written {
                Ok(data) => out[start..end].copy_from_slice(&data),
                Err(e) => {
                    let error = match e.kind {
                        CallErrorKind::Invalid => RequestError::invalid(e.message.as_str()),
                        _ => RequestError::internal(e.message.as_str()),
                    };
                    batch.fail(request, error)?;
                }
            }
            start = end;
        }
        batch.output(0)?.allocate(shapes)?.copy_from_slice(&out);
        Ok(())
    }
}

export_worker!(BlsEcho);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    /// Outside a server (the harness gives no call callback) a call fails its
    /// request with a clear error; the worker itself does not fail.
    #[test]
    fn without_a_host_calls_are_refused() {
        let mut h = Harness::start::<BlsEcho>(&[]).unwrap();
        let input = vec![TestTensor::new("INPUT0", DataType::Int32, &[2], &[1i32, 2])];
        let outcomes = h.run_requests(&[(input, Vec::new())]).unwrap();
        let failure = outcomes[0].as_ref().expect_err("the request fails");
        assert!(failure.message.contains("not available"), "{failure:?}");
    }
}
