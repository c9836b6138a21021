//! `cost`: a worker whose batch costs `a + b·n` in real computation, for measuring
//! batching. Every batch first makes `fixed_passes` passes of multiply-adds over a
//! 64 KiB scratch buffer (`a`: what a model pays once per batch — weights through the
//! cache, kernel launch, …); then each row of FP32 `INPUT0` [dim] is multiplied by a
//! fixed dim×dim matrix into `OUTPUT0` [dim] (`b` per row). Parameters: `dim`
//! (default 64), `fixed_passes` (default 16), `max_batch_size` (default 256).

use std::hint::black_box;

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, TensorSpec, Worker,
    WorkerError, WorkerInfo,
};

/// Floats in the per-batch scratch buffer (64 KiB).
const SCRATCH: usize = 16 * 1024;

/// The cost worker.
pub struct Cost {
    dim: usize,
    fixed_passes: usize,
    max_batch_size: u32,
    matrix: Vec<f32>,
    scratch: Vec<f32>,
}

impl Cost {
    /// The fixed per-batch work: `fixed_passes` sweeps of multiply-adds.
    fn fixed_work(&mut self) -> f32 {
        let mut acc = 0.0f32;
        for pass in 0..self.fixed_passes {
            let k = 1.0 + pass as f32 * 1e-3;
            for v in self.scratch.iter_mut() {
                *v = *v * 0.999 + k;
                acc += *v;
            }
        }
        black_box(acc)
    }

    /// One row: `out = M · x`.
    fn row(&self, x: &[f32], out: &mut [f32]) {
        for (o, m) in out.iter_mut().zip(self.matrix.chunks_exact(self.dim)) {
            *o = m.iter().zip(x).map(|(a, b)| a * b).sum();
        }
    }
}

impl Worker for Cost {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::load("dim", ParamKind::Int { min: 1, max: 4096 }),
        ParamSpec::load(
            "fixed_passes",
            ParamKind::Int {
                min: 1,
                max: 1 << 20,
            },
        ),
        ParamSpec::load("max_batch_size", ParamKind::Int { min: 1, max: 4096 }),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let get = |key: &str, default: i64, max: i64| -> Result<usize, WorkerError> {
            match params.int(key)?.unwrap_or(default) {
                v if (1..=max).contains(&v) => Ok(v as usize),
                v => Err(format!("`{key}` must be in 1..={max}, got {v}").into()),
            }
        };
        let dim = get("dim", 64, 4096)?;
        let matrix = (0..dim * dim)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        Ok(Cost {
            dim,
            fixed_passes: get("fixed_passes", 16, 1 << 20)?,
            max_batch_size: get("max_batch_size", 256, 4096)? as u32,
            matrix,
            scratch: vec![0.5; SCRATCH],
        })
    }

    fn info(&self) -> WorkerInfo {
        let dims = [self.dim as i64];
        WorkerInfo {
            inputs: vec![TensorSpec::new("INPUT0", DataType::Fp32, &dims)].into(),
            outputs: vec![TensorSpec::new("OUTPUT0", DataType::Fp32, &dims)].into(),
            max_batch_size: self.max_batch_size,
            batcher: BatcherKind::Dynamic,
            allow_ragged_batch: false,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        self.fixed_work();
        let input = batch.input(0)?;
        let x = input.as_slice::<f32>()?;
        let mut output = batch.output(0)?;
        let out = output.allocate_as::<f32>(input.shapes())?;
        for (xi, oi) in x.chunks_exact(self.dim).zip(out.chunks_exact_mut(self.dim)) {
            self.row(xi, oi);
        }
        Ok(())
    }
}

export_worker!(Cost);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    #[test]
    fn multiplies_each_row_by_the_matrix() {
        let mut h = Harness::start::<Cost>(&[("dim", "2"), ("fixed_passes", "1")]).unwrap();
        // M = [[-0.5, 0.419], [0.338, 0.257]] from the generator above; rows e1, e2
        // give M's columns.
        let want = [-0.5f32, 0.338, 0.419, 0.257];
        let a = vec![TestTensor::new(
            "INPUT0",
            DataType::Fp32,
            &[2, 2],
            &[1.0f32, 0.0, 0.0, 1.0],
        )];
        let out = h.run(&[a]).unwrap();
        let got = out[0][0].values::<f32>();
        assert!(
            got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6),
            "{got:?}"
        );
        assert_eq!(out[0][0].shape.dims(), &[2, 2]);
    }

    #[test]
    fn parameters_are_checked() {
        assert!(Harness::start::<Cost>(&[("dim", "0")]).is_err());
        assert!(Harness::start::<Cost>(&[("fixed_passes", "x")]).is_err());
    }
}
