//! Batch formation cost: how many requests per second one batcher thread turns into
//! batches (copying 64 bytes of tensor per request), and a pool round-trip.
//!
//! `cargo bench -p kiln-batchers`

use std::time::Instant;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use crossbeam_channel::unbounded;
use kiln_batchers::{run_batcher, BatcherConfig, Request, Tensor};
use kiln_buffers::{BufferSet, Pool};
use kiln_worker_sdk::{BatcherKind, DataType, Shape};

const REQUESTS: usize = 4096;

fn requests() -> Vec<Request<u32>> {
    let shape = Shape::new(&[1, 16]).unwrap_or(Shape::scalar());
    let data = Bytes::from(vec![7u8; 64]);
    (0..REQUESTS as u32)
        .map(|i| Request {
            inputs: vec![Tensor {
                dtype: DataType::Uint32,
                shape,
                data: data.clone(),
            }],
            rows: 1,
            params: Vec::new(),
            arrived: Instant::now(),
            priority: None,
            timeout: None,
            sequence: None,
            ticket: None,
            reply: i,
        })
        .collect()
}

fn batcher(c: &mut Criterion) {
    let mut group = c.benchmark_group("batcher");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    for batch_size in [1usize, 8, 64] {
        let pool = Pool::new(REQUESTS, || {
            BufferSet::with_capacities(&[64 * 64], &[64 * 64])
        });
        group.bench_function(format!("soft_batch_{batch_size}"), |b| {
            b.iter_batched(
                requests,
                |reqs| {
                    let (tx, rx) = unbounded();
                    let (btx, brx) = unbounded();
                    for r in reqs {
                        let _ = tx.send(r);
                    }
                    drop(tx);
                    let config = BatcherConfig {
                        kind: BatcherKind::Soft,
                        batch_size,
                        timeout: std::time::Duration::ZERO,
                        allow_ragged: false,
                        inputs: 1,
                    };
                    run_batcher(config, rx, pool.clone(), btx);
                    brx.try_iter().count()
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

fn pool(c: &mut Criterion) {
    let pool = Pool::new(4, || BufferSet::with_capacities(&[4096], &[4096]));
    c.bench_function("pool_acquire_release", |b| b.iter(|| drop(pool.acquire())));
}

fn admission(c: &mut Criterion) {
    // What every request pays for the queue bound: take a place, give it back.
    let admission = kiln_batchers::Admission::new(4096);
    c.bench_function("admission_admit_release", |b| {
        b.iter(|| drop(std::hint::black_box(admission.try_admit())))
    });
}

criterion_group!(benches, batcher, pool, admission);
criterion_main!(benches);
