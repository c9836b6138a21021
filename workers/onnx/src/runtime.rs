//! Finding and loading the ONNX Runtime library, once per process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_worker_sdk::WorkerError;
use ort::environment::Environment;

/// The runtime file the project's `scripts/fetch-models` provides.
pub const RUNTIME_FILE: &str = "libonnxruntime.so.1.31.1";

static ENVIRONMENT: OnceLock<(PathBuf, Result<Environment, String>)> = OnceLock::new();

/// Where the runtime is looked for, in order: the `runtime` load-time parameter,
/// `$KILN_ONNXRUNTIME`, `$KILN_CACHE/onnxruntime/`, `./.cache/onnxruntime/`.
pub fn locate(param: Option<String>) -> PathBuf {
    if let Some(path) = param {
        return PathBuf::from(path);
    }
    if let Some(path) = std::env::var_os("KILN_ONNXRUNTIME") {
        return PathBuf::from(path);
    }
    let cache = std::env::var_os("KILN_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("onnxruntime").join(RUNTIME_FILE)
}

/// The process's ONNX Runtime environment, loading the library at `path` the first
/// time. A later call with another path is refused: one process, one runtime.
pub fn environment(path: &Path) -> Result<Environment, WorkerError> {
    let (loaded_from, result) = ENVIRONMENT.get_or_init(|| {
        let result = if path.is_file() {
            ort::init_from(path)
                .map_err(|e| e.to_string())
                .and_then(|builder| builder.with_name("kiln").build().map_err(|e| e.to_string()))
        } else {
            Err("file not found".to_owned())
        };
        (path.to_path_buf(), result)
    });
    if loaded_from != path {
        return Err(WorkerError::new(format!(
            "ONNX Runtime is already loaded from {}; cannot also load {}",
            loaded_from.display(),
            path.display()
        )));
    }
    result.clone().map_err(|e| {
        WorkerError::new(format!(
            "cannot load ONNX Runtime from {}: {e} (run scripts/fetch-models, or set the \
             `runtime` parameter or KILN_ONNXRUNTIME)",
            path.display()
        ))
    })
}
