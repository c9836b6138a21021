//! Text detection's image math per 640 × 480 frame (criterion): the pre-processing
//! (normalize into NCHW, and a resize to 960 × 704 for comparison) and the box
//! extraction from a probability map with a few text-like regions.
//!
//! `cargo bench -p kiln-media --bench det -- --warm-up-time 1 --measurement-time 3`

#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kiln_media::det::{BoxFinder, BoxParams, Preprocessor};

/// A frame of vertical colour bars with a gradient, like `testsrc2`.
fn frame(w: usize, h: usize) -> Vec<u8> {
    (0..w * h)
        .flat_map(|p| {
            let (x, y) = (p % w, p / w);
            [
                (x * 7 % 256) as u8,
                (y * 3 % 256) as u8,
                ((x + y) % 256) as u8,
            ]
        })
        .collect()
}

/// A probability map with 12 text lines and low noise elsewhere.
fn map(w: usize, h: usize) -> Vec<f32> {
    let mut map: Vec<f32> = (0..w * h).map(|i| (i % 17) as f32 * 0.01).collect();
    for line in 0..12 {
        let (y0, x0) = (20 + line * 38, 30 + (line % 3) * 40);
        for y in y0..y0 + 20 {
            map[y * w + x0..y * w + x0 + 300].fill(0.9);
        }
    }
    map
}

fn bench(c: &mut Criterion) {
    let rgb = frame(640, 480);
    let mut same = Preprocessor::new(640, 480, 640, 480);
    let mut out = vec![0f32; same.output_len()];
    c.bench_function("preprocess 640x480 (normalize, NCHW)", |b| {
        b.iter(|| same.run(black_box(&rgb), &mut out))
    });
    let mut up = Preprocessor::new(640, 480, 960, 704);
    let mut out = vec![0f32; up.output_len()];
    c.bench_function("preprocess 640x480 -> 960x704 (bilinear)", |b| {
        b.iter(|| up.run(black_box(&rgb), &mut out))
    });
    let probabilities = map(640, 480);
    let mut finder = BoxFinder::default();
    let mut boxes = Vec::new();
    let params = BoxParams::default();
    c.bench_function("boxes 640x480 map, 12 regions", |b| {
        b.iter(|| {
            finder.find(
                black_box(&probabilities),
                (640, 480),
                (640, 480),
                &params,
                &mut boxes,
            );
            assert_eq!(boxes.len(), 12);
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
