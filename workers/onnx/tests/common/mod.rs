//! What the onnx worker's tests share: where the repository, the cache and a
//! model's folder are, and starting the worker on a model of the example
//! repository. Needs `scripts/fetch-models`.

// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::path::PathBuf;

use kiln_worker_onnx::Onnx;
use kiln_worker_sdk::testing::{Harness, TestTensor};
use kiln_worker_sdk::DataType;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$KILN_CACHE`, else the repository's `.cache`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("KILN_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache"))
}

/// Version 1 of `model` in the example repository.
pub fn model_dir(model: &str) -> PathBuf {
    let dir = repo_root().join("examples/models").join(model).join("1");
    assert!(
        dir.join("model.onnx").is_file(),
        "{} is missing: run scripts/fetch-models",
        dir.join("model.onnx").display()
    );
    dir
}

/// Starts the worker on `model` of the example repository with `extra` parameters
/// after the model's and the runtime's locations.
pub fn start(model: &str, extra: &[(&str, &str)]) -> Result<Harness, String> {
    let dir = model_dir(model).to_string_lossy().into_owned();
    let runtime = cache_dir()
        .join("onnxruntime/libonnxruntime.so.1.31.1")
        .to_string_lossy()
        .into_owned();
    let mut params = vec![("model_dir", dir.as_str()), ("runtime", runtime.as_str())];
    params.extend_from_slice(extra);
    Harness::start::<Onnx>(&params).map_err(|e| e.0)
}

/// The worker on `ocr-cls` (text line [N, 3, 48, 192] -> [N, 2]).
pub fn ocr_cls(extra: &[(&str, &str)]) -> Harness {
    match start("ocr-cls", extra) {
        Ok(harness) => harness,
        Err(e) => panic!("ocr-cls did not start: {e}"),
    }
}

/// A text-line-sized input, different for every `seed`.
pub fn line(seed: usize) -> TestTensor {
    let data: Vec<f32> = (0..3 * 48 * 192)
        .map(|i| (((i * (seed + 3)) % 97) as f32 / 48.0) - 1.0)
        .collect();
    TestTensor::new("x", DataType::Fp32, &[1, 3, 48, 192], &data)
}
