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
                        gather: false,
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

/// The hand-off of requests into a group's queue and out of it, 64 at a time (a
/// batch's worth; the requests move back into a reused `Vec`, nothing is dropped):
/// today's bounded crossbeam channel (`try_send` at submit, `try_recv` in batch
/// formation) against crossbeam-queue's `ArrayQueue` and `SegQueue` (which would
/// still need a parking mechanism for an idle instance).
fn handoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("handoff_64");
    group.throughput(Throughput::Elements(64));
    let mut held: Vec<Request<u32>> = requests().into_iter().take(64).collect();
    let (tx, rx) = crossbeam_channel::bounded(4096);
    group.bench_function("channel_bounded", |b| {
        b.iter(|| {
            for r in held.drain(..) {
                let _ = tx.try_send(r);
            }
            held.extend(rx.try_iter());
        })
    });
    let queue = crossbeam_queue::ArrayQueue::new(4096);
    group.bench_function("array_queue", |b| {
        b.iter(|| {
            for r in held.drain(..) {
                let _ = queue.push(r);
            }
            held.extend(std::iter::from_fn(|| queue.pop()));
        })
    });
    let queue = crossbeam_queue::SegQueue::new();
    group.bench_function("seg_queue", |b| {
        b.iter(|| {
            for r in held.drain(..) {
                queue.push(r);
            }
            held.extend(std::iter::from_fn(|| queue.pop()));
        })
    });
    group.finish();
}

/// The buffer pool's free list, one take and return (once per batch): today's
/// bounded channel against an `ArrayQueue` (which would need its own parking for
/// `acquire` while every set is out).
fn free_list(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool_free_list");
    let (back, free) = crossbeam_channel::bounded(4);
    for _ in 0..4 {
        let _ = back.send(BufferSet::with_capacities(&[4096], &[4096]));
    }
    group.bench_function("channel", |b| {
        b.iter(|| {
            if let Ok(set) = free.try_recv() {
                let _ = back.send(std::hint::black_box(set));
            }
        })
    });
    let queue = crossbeam_queue::ArrayQueue::new(4);
    for _ in 0..4 {
        let _ = queue.push(BufferSet::with_capacities(&[4096], &[4096]));
    }
    group.bench_function("array_queue", |b| {
        b.iter(|| {
            if let Some(set) = queue.pop() {
                let _ = queue.push(std::hint::black_box(set));
            }
        })
    });
    group.finish();
}

/// An idle instance's wait for work, woken for each item (a round trip through an
/// echoing thread that waits for every item): a plain blocking receive
/// (`wait_for_first`) against one that also watches the group's leave channel
/// (`wait_for_first_or_stop`, what a scalable group's instances wait with).
fn idle_wait(c: &mut Criterion) {
    let mut group = c.benchmark_group("idle_wait_round_trip");
    for watch_leave in [false, true] {
        let (tx, rx) = crossbeam_channel::bounded::<u32>(1);
        let (back_tx, back) = crossbeam_channel::bounded::<u32>(1);
        let (_leave_tx, leave) = unbounded::<()>();
        let echo = std::thread::spawn(move || {
            let leave = watch_leave.then_some(&leave);
            while let Some(v) = kiln_batchers::wait_for_first_or_stop(&rx, &mut (), leave) {
                if back_tx.send(v).is_err() {
                    return;
                }
            }
        });
        let name = if watch_leave { "or_stop" } else { "plain" };
        group.bench_function(name, |b| {
            b.iter(|| {
                let _ = tx.send(1);
                back.recv()
            })
        });
        drop(tx);
        let _ = echo.join();
    }
    group.finish();
}

criterion_group!(benches, batcher, pool, admission, handoff, free_list, idle_wait);
criterion_main!(benches);
