//! A model batched on its first dim, without the `batch_axis.*` or `input.*`
//! parameters: `ocr-cls` (text line [N, 3, H, W] -> [N, 2]). Needs
//! `scripts/fetch-models`.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use kiln_worker_onnx::Onnx;
use kiln_worker_sdk::testing::{Harness, TestTensor};
use kiln_worker_sdk::{DataType, TensorSpec};

fn start() -> Harness {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cache = std::env::var_os("KILN_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cache"));
    let dir = root.join("examples/models/ocr-cls/1");
    assert!(
        dir.join("model.onnx").is_file(),
        "{} is missing: run scripts/fetch-models",
        dir.join("model.onnx").display()
    );
    let runtime = cache.join("onnxruntime/libonnxruntime.so.1.31.1");
    Harness::start::<Onnx>(&[
        ("model_dir", &dir.to_string_lossy()),
        ("runtime", &runtime.to_string_lossy()),
    ])
    .unwrap()
}

/// A text-line-sized input, different for every `seed`.
fn line(seed: usize) -> TestTensor {
    let data: Vec<f32> = (0..3 * 48 * 192)
        .map(|i| (((i * (seed + 3)) % 97) as f32 / 48.0) - 1.0)
        .collect();
    TestTensor::new("x", DataType::Fp32, &[1, 3, 48, 192], &data)
}

#[test]
fn first_dim_batches_as_before() {
    let mut h = start();
    assert_eq!(h.info().max_batch_size, 8);
    assert_eq!(
        h.info().inputs.to_vec(),
        vec![TensorSpec::new("x", DataType::Fp32, &[3, -1, -1])]
    );
    assert_eq!(h.info().outputs[0].dims.to_vec(), vec![2]);
    let alone: Vec<Vec<f32>> = (0..3)
        .map(|s| h.run(&[vec![line(s)]]).unwrap()[0][0].values())
        .collect();
    let batched = h
        .run(&[vec![line(0)], vec![line(1)], vec![line(2)]])
        .unwrap();
    for (s, response) in batched.iter().enumerate() {
        assert_eq!(response[0].shape.dims(), &[1, 2]);
        let got: Vec<f32> = response[0].values();
        let d = got
            .iter()
            .zip(&alone[s])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d <= 1e-5, "line {s}: differs by {d}");
    }
}
