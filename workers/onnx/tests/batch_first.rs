//! A model batched on its first dim, without the `batch_axis.*` or `input.*`
//! parameters: `ocr-cls` (text line [N, 3, H, W] -> [N, 2]). Needs
//! `scripts/fetch-models`.

#![allow(clippy::unwrap_used)]

mod common;

use common::{line, ocr_cls};
use kiln_worker_sdk::{DataType, TensorSpec};

#[test]
fn first_dim_batches_as_before() {
    let mut h = ocr_cls(&[]);
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
