//! `fpga-sim`: a SIMULATED asynchronous accelerator, for the asynchronous worker
//! contract ([`kiln_worker_sdk::AsyncWorker`]). No FPGA is involved: it models an
//! XRT-style device whose `compute_units` (threads here) take submitted batches from
//! one queue and complete them later, each after the time of the cost model in
//! [`device`] (`setup_us + rows × row_ns`), having computed the batch for real.
//!
//! Contract: INT8 `X` [-1, k] times a fixed int8 weight matrix W [k, m] (seeded:
//! [`device::weight`]) gives INT32 `Y` [-1, m]. `DEVICE` INT64 [-1, 3] tells, for
//! every row, what the simulated device saw: batches in the device when this one
//! was submitted (itself included), the batch's completion number, and its unit.
//!
//! Load parameters: `compute_units` (1..=64, default 4), `k` (default 64), `m`
//! (default 32), `seed` (default 1), `setup_us` (default 1000), `row_ns` (default
//! 50000), `max_batch_size` (default 64). Request parameters, to simulate faults:
//! `sim_fail` (the unit fails the batch), `sim_panic` (the unit panics on it),
//! `sim_drop` (the unit drops the batch uncompleted), `sim_delay_us` (the batch
//! takes this much longer). Each instance is its own simulated device.

pub mod device;

use std::sync::Arc;
use std::time::Duration;

use kiln_worker_sdk::{
    export_worker, AsyncBatch, AsyncWorker, BatcherKind, DataType, ParamKind, ParamSpec, Params,
    TensorSpec, WorkerError, WorkerInfo,
};

use device::{Config, Device};

/// The simulated device worker.
pub struct FpgaSim {
    config: Arc<Config>,
    units: usize,
    max_batch_size: u32,
    device: Option<Device>,
}

const fn int(name: &'static str, min: i64, max: i64) -> ParamSpec {
    ParamSpec::load(name, ParamKind::Int { min, max })
}

impl AsyncWorker for FpgaSim {
    const PARAMETERS: &'static [ParamSpec] = &[
        int("compute_units", 1, 64),
        int("k", 1, 4096),
        int("m", 1, 4096),
        int("seed", 0, u32::MAX as i64),
        int("setup_us", 0, 10_000_000),
        int("row_ns", 0, 1_000_000_000),
        int("max_batch_size", 1, 4096),
        ParamSpec::request("sim_fail", ParamKind::Bool),
        ParamSpec::request("sim_panic", ParamKind::Bool),
        ParamSpec::request("sim_drop", ParamKind::Bool),
        ParamSpec::request(
            "sim_delay_us",
            ParamKind::Int {
                min: 0,
                max: 10_000_000,
            },
        ),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        // The values are in range: the SDK checked the declared ones.
        let get = |key: &str, default: i64| -> Result<u64, WorkerError> {
            Ok(params.int(key)?.unwrap_or(default).max(0) as u64)
        };
        let (k, m) = (get("k", 64)? as usize, get("m", 32)? as usize);
        let config = Config::new(
            k,
            m,
            get("seed", 1)?,
            Duration::from_micros(get("setup_us", 1000)?),
            Duration::from_nanos(get("row_ns", 50_000)?),
        );
        log::info!(
            "fpga-sim (simulated device): k={k} m={m}, cost {:?} + {:?}/row",
            config.setup,
            config.row
        );
        Ok(FpgaSim {
            config: Arc::new(config),
            units: get("compute_units", 4)? as usize,
            max_batch_size: get("max_batch_size", 64)? as u32,
            device: None,
        })
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new(
                "X",
                DataType::Int8,
                &[self.config.k as i64],
            )]
            .into(),
            outputs: vec![
                TensorSpec::new("Y", DataType::Int32, &[self.config.m as i64]),
                TensorSpec::new("DEVICE", DataType::Int64, &[3]),
            ]
            .into(),
            max_batch_size: self.max_batch_size,
            batcher: BatcherKind::Dynamic,
            allow_ragged_batch: false,
        }
    }

    /// Starts the compute units (the device is "opened" here).
    fn acquire(&mut self) -> Result<(), WorkerError> {
        if self.device.is_none() {
            self.device = Some(Device::start(Arc::clone(&self.config), self.units)?);
        }
        Ok(())
    }

    fn submit(&mut self, batch: AsyncBatch) {
        match &self.device {
            Some(device) => device.submit(batch),
            None => batch.complete(Err("the simulated device is not acquired".into())),
        }
    }

    /// Stops the units (every batch has completed: the host drains first).
    fn release(&mut self) -> Result<(), WorkerError> {
        if let Some(device) = self.device.take() {
            log::info!(
                "fpga-sim: release, {} batches in the device",
                device.in_flight()
            );
        }
        Ok(())
    }
}

export_worker!(async FpgaSim);

#[cfg(test)]
mod tests {
    use super::device::{weight, Config};
    use std::time::Duration;

    #[test]
    fn multiplies_by_the_seeded_weights() {
        let c = Config::new(3, 2, 7, Duration::ZERO, Duration::ZERO);
        let x = [1i8, -2, 3, 0, 0, -128];
        let mut y = [0i32; 4];
        c.multiply(&x, &mut y);
        let w = |i: usize, j: usize| weight(7, i * 2 + j) as i32;
        let want = [
            w(0, 0) - 2 * w(1, 0) + 3 * w(2, 0),
            w(0, 1) - 2 * w(1, 1) + 3 * w(2, 1),
            -128 * w(2, 0),
            -128 * w(2, 1),
        ];
        assert_eq!(y, want);
    }

    #[test]
    fn the_cost_model_is_setup_plus_rows() {
        let c = Config::new(
            1,
            1,
            1,
            Duration::from_micros(100),
            Duration::from_nanos(10),
        );
        assert_eq!(c.cost(0), Duration::from_micros(100));
        assert_eq!(c.cost(5), Duration::from_nanos(100_050));
    }
}
