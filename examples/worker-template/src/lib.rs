//! `template`: a small, complete worker plugin to copy when you write your own.
//!
//! FP32 `INPUT0` of shape [-1] → FP32 `OUTPUT0` = `INPUT0` × `scale`, where `scale`
//! is a load-time parameter (default 1.0):
//!
//! ```text
//! kiln serve --load template:scale=2
//! curl -X POST localhost:8000/v2/workers/template/load -d '{"scale": 2}'
//! ```
//!
//! The guide is docs/writing-a-worker.md.

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, TensorSpec, Worker,
    WorkerError, WorkerInfo,
};

/// Largest batch (in rows) this worker accepts. The group's `batch_size` load-time
/// parameter may ask for less, never more.
const MAX_BATCH_SIZE: u32 = 64;

/// One instance of the worker. The server creates one per `instances` (default 1)
/// and drives each on its own thread, so `&mut self` needs no locking.
pub struct Template {
    scale: f32,
}

impl Worker for Template {
    /// The parameters the server checks for this worker, read before any `init`:
    /// `ParamSpec::load` (anyone who may load it), `ParamSpec::operator` (only the
    /// operator: use it for anything naming a file, folder, library or host) and
    /// `ParamSpec::request` (per request, checked at admission).
    const PARAMETERS: &'static [ParamSpec] = &[ParamSpec::load(
        "scale",
        ParamKind::Float {
            min: f64::MIN,
            max: f64::MAX,
        },
    )];

    /// Called once per instance with every load-time parameter (the server's own,
    /// such as `batch_size`, included). An error here fails the load cleanly.
    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        // The getters coerce: `scale=2` from the CLI arrives as text, `{"scale": 2}`
        // over REST as a number. A value that does not parse is an `Err(String)`,
        // which `?` turns into a `WorkerError`.
        let scale = params.float("scale")?.unwrap_or(1.0);
        if !scale.is_finite() {
            return Err(format!("parameter `scale` must be finite, got {scale}").into());
        }
        // `log` records reach the server's log as `[plugin kiln_worker_template] ...`.
        log::info!("template: scale {scale}");
        Ok(Template {
            scale: scale as f32,
        })
    }

    /// What the worker takes and gives. The server validates every request against
    /// this before it is queued, so `run` only sees data of these types and shapes.
    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            // `dims` exclude the batch dimension because max_batch_size > 0: a client
            // sends INPUT0 with shape [rows, n]. -1 means any size.
            inputs: vec![TensorSpec::new("INPUT0", DataType::Fp32, &[-1])].into(),
            outputs: vec![TensorSpec::new("OUTPUT0", DataType::Fp32, &[-1])].into(),
            max_batch_size: MAX_BATCH_SIZE,
            // Soft: up to batch_size rows, or whatever has arrived `timeout` ms (a
            // load-time parameter, default 0) after the first request.
            batcher: BatcherKind::Soft,
            // Elementwise, so requests of different lengths may share one batch.
            allow_ragged_batch: true,
        }
    }

    // `allocate`, `acquire`, `release` and `deallocate` keep their default (do
    // nothing). Override them to set up and free per-instance resources (scratch
    // memory, a model session, a device).

    /// Runs one batch. Input `i` holds every request's tensor back to back, in request
    /// order; `shapes()` gives each request's shape (with its batch dimension).
    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let values = input.as_slice::<f32>()?;
        // The output has the input's shapes, so the buffer has the input's length.
        let mut output = batch.output(0)?;
        let out = output.allocate_as::<f32>(input.shapes())?;
        for (o, v) in out.iter_mut().zip(values) {
            *o = v * self.scale;
        }
        Ok(())
    }
}

// Exports `Template` as the plugin's root module: exactly once per cdylib.
export_worker!(Template);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    fn request(dims: &[i64], values: &[f32]) -> Vec<TestTensor> {
        vec![TestTensor::new("INPUT0", DataType::Fp32, dims, values)]
    }

    #[test]
    fn scales_each_request_of_a_batch() {
        // Parameters arrive as text, as from `kiln serve --load template:scale=2`.
        let mut h = Harness::start::<Template>(&[("scale", "2")]).unwrap();
        assert_eq!(h.info().max_batch_size, MAX_BATCH_SIZE);
        let out = h
            .run(&[
                request(&[1, 3], &[1.0, 2.0, -3.0]),
                request(&[2, 1], &[0.5, 10.0]),
            ])
            .unwrap();
        assert_eq!(out[0][0].name, "OUTPUT0");
        assert_eq!(out[0][0].shape.dims(), &[1, 3]);
        assert_eq!(out[0][0].values::<f32>(), vec![2.0, 4.0, -6.0]);
        assert_eq!(out[1][0].shape.dims(), &[2, 1]);
        assert_eq!(out[1][0].values::<f32>(), vec![1.0, 20.0]);
    }

    #[test]
    fn scale_defaults_to_one() {
        let mut h = Harness::start::<Template>(&[]).unwrap();
        let out = h.run(&[request(&[1, 2], &[1.5, -2.5])]).unwrap();
        assert_eq!(out[0][0].values::<f32>(), vec![1.5, -2.5]);
    }

    #[test]
    fn bad_scale_fails_init() {
        let err = Harness::start::<Template>(&[("scale", "fast")])
            .err()
            .unwrap();
        assert!(err.0.contains("must be a number"), "{err}");
        assert!(Harness::start::<Template>(&[("scale", "inf")]).is_err());
    }
}
