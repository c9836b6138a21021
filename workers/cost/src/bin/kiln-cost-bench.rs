//! kiln-cost-bench: the `cost` worker alone (through the SDK's in-process harness, no
//! server): batches of each size, back to back, and the rows per second they reach —
//! the ceiling served throughput is compared with.
//!
//! `kiln-cost-bench [SECONDS] [BATCH_SIZES]`, e.g. `kiln-cost-bench 5 1,8,32,64`.

use std::time::{Duration, Instant};

use kiln_worker_cost::Cost;
use kiln_worker_sdk::testing::{Harness, TestTensor};
use kiln_worker_sdk::DataType;

fn main() -> Result<(), kiln_worker_sdk::WorkerError> {
    let mut args = std::env::args().skip(1);
    let seconds: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(5.0);
    let sizes: Vec<usize> = args
        .next()
        .map(|s| s.split(',').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 8, 32, 64]);
    let mut harness = Harness::start::<Cost>(&[])?;
    let dim = 64;
    for n in sizes {
        // One request of n rows: the worker sees exactly a batch of n rows.
        let request = vec![vec![TestTensor::new(
            "INPUT0",
            DataType::Fp32,
            &[n as i64, dim],
            &vec![0.25f32; n * dim as usize],
        )]];
        let start = Instant::now();
        let mut batches = 0u64;
        while start.elapsed() < Duration::from_secs_f64(seconds) {
            harness.run(&request)?;
            batches += 1;
        }
        let elapsed = start.elapsed().as_secs_f64();
        println!(
            "cost worker alone: batch={n} rows/s={:.0} batch_ms={:.3}",
            batches as f64 * n as f64 / elapsed,
            elapsed * 1000.0 / batches as f64
        );
    }
    Ok(())
}
