//! `echo-multi`: several inputs and outputs of different datatypes and shapes.
//!
//! | input | type | dims | output | type | dims | value |
//! |---|---|---|---|---|---|---|
//! | `INPUT0` | UINT32 | [-1] | `OUTPUT0` | UINT32 | [-1] | input + 1 |
//! | `INPUT1` | FP32 | [2] | `OUTPUT1` | FP64 | [2] | input × 2 |
//! | `INPUT2` | BYTES | [-1] | `OUTPUT2` | BYTES | [-1] | each string reversed |

use kiln_worker_sdk::{
    export_worker, tensor_byte_len, Batch, BatcherKind, DataType, Params, Shape, TensorSpec,
    Worker, WorkerError, WorkerInfo,
};

/// The echo-multi worker.
pub struct EchoMulti;

impl Worker for EchoMulti {
    fn init(_params: Params<'_>) -> Result<Self, WorkerError> {
        Ok(EchoMulti)
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![
                TensorSpec::new("INPUT0", DataType::Uint32, &[-1]),
                TensorSpec::new("INPUT1", DataType::Fp32, &[2]),
                TensorSpec::new("INPUT2", DataType::Bytes, &[-1]),
            ]
            .into(),
            outputs: vec![
                TensorSpec::new("OUTPUT0", DataType::Uint32, &[-1]),
                TensorSpec::new("OUTPUT1", DataType::Fp64, &[2]),
                TensorSpec::new("OUTPUT2", DataType::Bytes, &[-1]),
            ]
            .into(),
            max_batch_size: 64,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let in0 = batch.input(0)?;
        let in1 = batch.input(1)?;
        let in2 = batch.input(2)?;

        let mut out0 = batch.output(0)?;
        for (o, v) in out0
            .allocate_as::<u32>(in0.shapes())?
            .iter_mut()
            .zip(in0.as_slice::<u32>()?)
        {
            *o = v.wrapping_add(1);
        }

        let mut out1 = batch.output(1)?;
        for (o, v) in out1
            .allocate_as::<f64>(in1.shapes())?
            .iter_mut()
            .zip(in1.as_slice::<f32>()?)
        {
            *o = f64::from(*v) * 2.0;
        }

        // BYTES keep their length prefixes; reversing each string keeps the size.
        let elements: usize = in2.shapes().iter().map(Shape::element_count).sum();
        let src = in2.bytes();
        let len = tensor_byte_len(DataType::Bytes, elements, src)?;
        let mut out2 = batch.output(2)?;
        let dst = out2.allocate_bytes(in2.shapes(), len)?;
        let mut at = 0;
        while at < len {
            let n = u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]) as usize;
            dst[at..at + 4].copy_from_slice(&src[at..at + 4]);
            for (d, s) in dst[at + 4..at + 4 + n]
                .iter_mut()
                .zip(src[at + 4..at + 4 + n].iter().rev())
            {
                *d = *s;
            }
            at += 4 + n;
        }
        Ok(())
    }
}

export_worker!(EchoMulti);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    #[test]
    fn every_output_per_request() {
        let mut h = Harness::start::<EchoMulti>(&[]).unwrap();
        let request = |a: &[u32], b: [f32; 2], c: &[&str]| {
            let mut bytes =
                TestTensor::new::<u8>("INPUT2", DataType::Bytes, &[1, c.len() as i64], &[]);
            bytes.data = kiln_worker_sdk::encode_bytes(c);
            vec![
                TestTensor::new("INPUT0", DataType::Uint32, &[1, a.len() as i64], a),
                TestTensor::new("INPUT1", DataType::Fp32, &[1, 2], &b),
                bytes,
            ]
        };
        let out = h
            .run(&[
                request(&[1, 2], [1.5, -2.0], &["abc", ""]),
                request(&[7], [0.0, 3.0], &["xy"]),
            ])
            .unwrap();
        assert_eq!(out[0][0].values::<u32>(), vec![2, 3]);
        assert_eq!(out[0][1].values::<f64>(), vec![3.0, -4.0]);
        assert_eq!(out[0][2].data, kiln_worker_sdk::encode_bytes(&["cba", ""]));
        assert_eq!(out[1][0].values::<u32>(), vec![8]);
        assert_eq!(out[1][1].values::<f64>(), vec![0.0, 6.0]);
        assert_eq!(out[1][2].data, kiln_worker_sdk::encode_bytes(&["yx"]));
    }
}
