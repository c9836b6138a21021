//! What the onnx worker's tests on `ocr-cls` share. Needs `scripts/fetch-models`.

use std::path::PathBuf;

use kiln_worker_onnx::Onnx;
use kiln_worker_sdk::testing::{Harness, TestTensor};
use kiln_worker_sdk::DataType;

/// The worker on the example repository's `ocr-cls` (text line [N, 3, 48, 192] ->
/// [N, 2]) with `extra` parameters after the model's and runtime's locations.
pub fn ocr_cls(extra: &[(&str, &str)]) -> Harness {
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
    let (dir, runtime) = (
        dir.to_string_lossy().into_owned(),
        cache
            .join("onnxruntime/libonnxruntime.so.1.31.1")
            .to_string_lossy()
            .into_owned(),
    );
    let mut params = vec![("model_dir", dir.as_str()), ("runtime", runtime.as_str())];
    params.extend_from_slice(extra);
    match Harness::start::<Onnx>(&params) {
        Ok(harness) => harness,
        Err(e) => panic!("ocr-cls did not start: {}", e.0),
    }
}

/// A text-line-sized input, different for every `seed`.
pub fn line(seed: usize) -> TestTensor {
    let data: Vec<f32> = (0..3 * 48 * 192)
        .map(|i| (((i * (seed + 3)) % 97) as f32 / 48.0) - 1.0)
        .collect();
    TestTensor::new("x", DataType::Fp32, &[1, 3, 48, 192], &data)
}
