//! `echo`: UINT32 `INPUT0` of shape [-1] → `OUTPUT0` = input + 1 (AMD Inference Server
//! parity). Elementwise, so requests of any length share a batch. A request may carry
//! the parameter `increment` (0..=4294967295) to add something other than 1; each
//! request of a batch gets its own. `increment` is declared, so the server refuses a
//! bad value at admission; should one reach `run` anyway, that request alone fails
//! (400) and the rest of its batch is answered.

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, RequestError,
    TensorSpec, Worker, WorkerError, WorkerInfo,
};

/// Largest batch (rows) echo accepts.
const MAX_BATCH: i64 = 4096;

/// The echo worker.
pub struct Echo {
    max_batch_size: u32,
}

impl Worker for Echo {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::load(
            "max_batch_size",
            ParamKind::Int {
                min: 1,
                max: MAX_BATCH,
            },
        ),
        ParamSpec::request(
            "increment",
            ParamKind::Int {
                min: 0,
                max: u32::MAX as i64,
            },
        ),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let max = params.int("max_batch_size")?.unwrap_or(MAX_BATCH);
        if !(1..=MAX_BATCH).contains(&max) {
            return Err(format!("max_batch_size must be in 1..={MAX_BATCH}, got {max}").into());
        }
        Ok(Echo {
            max_batch_size: max as u32,
        })
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("INPUT0", DataType::Uint32, &[-1])].into(),
            outputs: vec![TensorSpec::new("OUTPUT0", DataType::Uint32, &[-1])].into(),
            max_batch_size: self.max_batch_size,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let values = input.as_slice::<u32>()?;
        let mut increments = Vec::with_capacity(batch.request_count());
        for request in 0..batch.request_count() {
            let increment = batch.params(request).int("increment").and_then(|v| {
                let v = v.unwrap_or(1);
                u32::try_from(v).map_err(|_| format!("increment {v} is outside 0..=4294967295"))
            });
            match increment {
                Ok(increment) => increments.push(increment),
                Err(message) => {
                    // This request alone fails; its rows are still written.
                    batch.fail(request, RequestError::invalid(message))?;
                    increments.push(0);
                }
            }
        }
        // A span of the worker's own in the batch's trace (when it is traced).
        let mut span = kiln_worker_sdk::trace::span("echo: add");
        span.attribute("requests", batch.request_count());
        let mut output = batch.output(0)?;
        let out = output.allocate_as::<u32>(input.shapes())?;
        let mut start = 0;
        for (shape, increment) in input.shapes().iter().zip(increments) {
            let end = start + shape.element_count();
            for (o, v) in out[start..end].iter_mut().zip(&values[start..end]) {
                *o = v.wrapping_add(increment);
            }
            start = end;
        }
        Ok(())
    }
}

export_worker!(Echo);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    #[test]
    fn adds_one_per_request() {
        let mut h = Harness::start::<Echo>(&[]).unwrap();
        let a = vec![TestTensor::new(
            "INPUT0",
            DataType::Uint32,
            &[1, 3],
            &[1u32, 2, 3],
        )];
        let b = vec![TestTensor::new(
            "INPUT0",
            DataType::Uint32,
            &[2, 1],
            &[10u32, u32::MAX],
        )];
        let out = h.run(&[a, b]).unwrap();
        assert_eq!(out[0][0].values::<u32>(), vec![2, 3, 4]);
        assert_eq!(out[0][0].shape.dims(), &[1, 3]);
        assert_eq!(out[1][0].values::<u32>(), vec![11, 0]);
        assert_eq!(out[1][0].shape.dims(), &[2, 1]);
    }

    #[test]
    fn a_bad_increment_fails_its_request_alone() {
        use kiln_worker_sdk::{Param, ParamValue, RequestErrorKind};
        let mut h = Harness::start::<Echo>(&[]).unwrap();
        let tensor = |v: u32| vec![TestTensor::new("INPUT0", DataType::Uint32, &[1, 1], &[v])];
        let increment = |value: ParamValue| {
            vec![Param {
                key: "increment".into(),
                value,
            }]
        };
        let out = h
            .run_requests(&[
                (tensor(1), Vec::new()),
                (tensor(2), increment(ParamValue::Int(-1))),
                (tensor(3), increment(ParamValue::Str("x".into()))),
                (tensor(4), increment(ParamValue::Int(5))),
            ])
            .unwrap();
        assert_eq!(out[0].as_ref().unwrap()[0].values::<u32>(), vec![2]);
        let err = out[1].as_ref().unwrap_err();
        assert_eq!(err.kind, RequestErrorKind::Invalid);
        assert!(err.message.contains("-1"), "{err}");
        assert_eq!(out[2].as_ref().unwrap_err().kind, RequestErrorKind::Invalid);
        assert_eq!(out[3].as_ref().unwrap()[0].values::<u32>(), vec![9]);
    }

    #[test]
    fn rejects_bad_max_batch_size() {
        assert!(Harness::start::<Echo>(&[("max_batch_size", "4096")]).is_ok());
        assert!(Harness::start::<Echo>(&[("max_batch_size", "0")]).is_err());
        assert!(Harness::start::<Echo>(&[("max_batch_size", "x")]).is_err());
    }
}
