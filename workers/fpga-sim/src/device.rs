//! The SIMULATED device: `compute_units` threads taking batches from one queue, as
//! an FPGA's compute units take work from its runner. Nothing here touches
//! hardware. Each unit computes the batch for real (an int8 matrix multiply) and
//! then waits out the rest of the batch's modeled time:
//!
//! `time(batch) = setup_us + rows × row_ns (+ the largest sim_delay_us asked)`
//!
//! so a unit is busy exactly as long as the model says (when the arithmetic is
//! faster, which on any CPU it is for the defaults), and throughput follows the
//! model whatever the host's CPU count: waiting costs no CPU.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use kiln_worker_sdk::{AsyncBatch, Batch, Shape, WorkerError};

/// The device's fixed configuration: the weights and the cost model.
pub struct Config {
    /// Input width (`k`): each row of `X` is K int8 values.
    pub k: usize,
    /// Output width (`m`).
    pub m: usize,
    /// The weights, transposed: `wt[j * k + i]` is `W[i][j]` (see [`weight`]).
    pub wt: Vec<i8>,
    /// Fixed time per batch (setup: descriptors, DMA start, kernel launch).
    pub setup: Duration,
    /// Time per row.
    pub row: Duration,
}

impl Config {
    /// A device with the seeded weights.
    pub fn new(k: usize, m: usize, seed: u64, setup: Duration, row: Duration) -> Config {
        let mut wt = vec![0i8; k * m];
        for i in 0..k {
            for j in 0..m {
                wt[j * k + i] = weight(seed, i * m + j);
            }
        }
        Config {
            k,
            m,
            wt,
            setup,
            row,
        }
    }

    /// The modeled time of a batch of `rows` rows.
    pub fn cost(&self, rows: usize) -> Duration {
        self.setup
            + self
                .row
                .saturating_mul(u32::try_from(rows).unwrap_or(u32::MAX))
    }

    /// `y = x · W` for each row (int8 × int8 summed in int32).
    pub fn multiply(&self, x: &[i8], y: &mut [i32]) {
        for (xr, yr) in x.chunks_exact(self.k).zip(y.chunks_exact_mut(self.m)) {
            for (yj, wj) in yr.iter_mut().zip(self.wt.chunks_exact(self.k)) {
                *yj = xr.iter().zip(wj).map(|(&a, &b)| a as i32 * b as i32).sum();
            }
        }
    }
}

/// The weight `W[i][j]` at flat index `index = i * m + j`: the low byte of
/// splitmix64(`seed << 32 | index`), as i8. (Tests recompute it independently.)
pub fn weight(seed: u64, index: usize) -> i8 {
    let mut z = (seed << 32 | index as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u8 as i8
}

/// What the device counts: batches submitted and not completed, and completions.
#[derive(Default)]
pub struct Counters {
    pub in_flight: AtomicUsize,
    pub completed: AtomicU64,
}

/// One submitted batch: the batch and how many were in the device with it.
struct Job {
    batch: AsyncBatch,
    in_flight: usize,
}

/// The running device: its queue and its compute units.
pub struct Device {
    queue: Option<Sender<Job>>,
    units: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl Device {
    /// Starts `units` compute units.
    pub fn start(config: Arc<Config>, units: usize) -> Result<Device, WorkerError> {
        let (tx, rx) = unbounded::<Job>();
        let counters = Arc::new(Counters::default());
        let mut device = Device {
            queue: Some(tx),
            units: Vec::with_capacity(units),
            counters: Arc::clone(&counters),
        };
        for index in 0..units {
            let (rx, config, counters) = (rx.clone(), Arc::clone(&config), Arc::clone(&counters));
            let unit = std::thread::Builder::new()
                .name(format!("fpga-sim-cu{index}"))
                .spawn(move || run_unit(index, &rx, &config, &counters))
                .map_err(|e| WorkerError::new(format!("cannot start compute unit {index}: {e}")))?;
            device.units.push(unit);
        }
        Ok(device)
    }

    /// Batches submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.counters.in_flight.load(Ordering::SeqCst)
    }

    /// Queues a batch for the next free unit.
    pub fn submit(&self, batch: AsyncBatch) {
        let in_flight = self.counters.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        match &self.queue {
            // The units live as long as the queue: a send cannot fail while it is open.
            Some(queue) => {
                if let Err(job) = queue.send(Job { batch, in_flight }) {
                    self.counters.in_flight.fetch_sub(1, Ordering::SeqCst);
                    job.into_inner()
                        .batch
                        .complete(Err("the simulated device is stopped".into()));
                }
            }
            None => {
                self.counters.in_flight.fetch_sub(1, Ordering::SeqCst);
                batch.complete(Err("the simulated device is stopped".into()));
            }
        }
    }
}

impl Drop for Device {
    /// Closes the queue; each unit finishes what it holds and ends.
    fn drop(&mut self) {
        self.queue = None;
        for unit in self.units.drain(..) {
            let _ = unit.join();
        }
    }
}

/// Leaves the device's count when the batch's work ends, however it ends, and
/// before the batch is completed (so the host never sees a stale count).
struct Leaving<'a>(&'a Counters);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What the requests of a batch asked the simulation for.
#[derive(Default)]
struct Faults {
    fail: bool,
    panic: bool,
    drop: bool,
    delay: Duration,
}

fn faults(batch: &Batch<'_, '_>) -> Result<Faults, WorkerError> {
    let mut f = Faults::default();
    for j in 0..batch.request_count() {
        let p = batch.params(j);
        f.fail |= p.bool("sim_fail")?.unwrap_or(false);
        f.panic |= p.bool("sim_panic")?.unwrap_or(false);
        f.drop |= p.bool("sim_drop")?.unwrap_or(false);
        let delay = Duration::from_micros(p.int("sim_delay_us")?.unwrap_or(0).max(0) as u64);
        f.delay = f.delay.max(delay);
    }
    Ok(f)
}

/// A compute unit: takes batches until the queue closes. A panic outside a
/// batch's computation is caught too, so the unit lives on.
fn run_unit(index: usize, jobs: &Receiver<Job>, config: &Config, counters: &Counters) {
    for job in jobs {
        let _ = catch_unwind(AssertUnwindSafe(|| run_job(index, job, config, counters)));
    }
}

fn run_job(index: usize, mut job: Job, config: &Config, counters: &Counters) {
    let started = Instant::now();
    let leaving = Leaving(counters);
    let faults = match faults(&job.batch.batch()) {
        Ok(faults) => faults,
        Err(e) => {
            drop(leaving);
            return job.batch.complete(Err(e));
        }
    };
    if faults.drop {
        log::warn!("fpga-sim: compute unit {index} drops its batch (sim_drop)");
        drop(leaving);
        // Dropped uncompleted: the SDK fails the batch.
        return drop(job.batch);
    }
    job.batch.complete_with(|batch| {
        let _leaving = leaving;
        if faults.panic {
            panic!("simulated compute unit {index} panicked (sim_panic)");
        }
        if faults.fail {
            return Err(WorkerError::new(format!(
                "simulated compute unit {index} failed the batch (sim_fail)"
            )));
        }
        compute(batch, config)?;
        let modeled = config.cost(batch.rows()) + faults.delay;
        std::thread::sleep(modeled.saturating_sub(started.elapsed()));
        // Completion order, numbered as the batch leaves the unit.
        let seq = counters.completed.fetch_add(1, Ordering::SeqCst) as i64;
        let shapes = row_shapes(batch, 3)?;
        let mut device = batch.output(1)?;
        let rows = device.allocate_as::<i64>(&shapes)?;
        for row in rows.chunks_exact_mut(3) {
            row.copy_from_slice(&[job.in_flight as i64, seq, index as i64]);
        }
        Ok(())
    });
}

/// The multiply: `Y = X · W`.
fn compute(batch: &mut Batch<'_, '_>, config: &Config) -> Result<(), WorkerError> {
    let input = batch.input(0)?;
    let x = input.as_slice::<i8>()?;
    let shapes = row_shapes(batch, config.m)?;
    let mut output = batch.output(0)?;
    let y = output.allocate_as::<i32>(&shapes)?;
    config.multiply(x, y);
    Ok(())
}

/// Each request's output shape `[rows, width]`.
fn row_shapes(batch: &Batch<'_, '_>, width: usize) -> Result<Vec<Shape>, WorkerError> {
    batch
        .input(0)?
        .shapes()
        .iter()
        .map(|s| {
            Shape::new(&[s.rows() as i64, width as i64])
                .ok_or_else(|| WorkerError::new("output shape out of range"))
        })
        .collect()
}
