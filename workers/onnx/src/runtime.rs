//! Finding and loading the ONNX Runtime library, once per process.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kiln_worker_sdk::WorkerError;
use ort::environment::Environment;

/// The runtime file the project's `scripts/fetch-models` provides.
pub const RUNTIME_FILE: &str = "libonnxruntime.so.1.31.1";

/// The loaded runtime and where it came from. Only a successful load is kept, so a
/// wrong path can be corrected without restarting the server.
static ENVIRONMENT: Mutex<Option<(PathBuf, Environment)>> = Mutex::new(None);

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
    let mut loaded = ENVIRONMENT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((from, environment)) = loaded.as_ref() {
        if from != path {
            return Err(WorkerError::new(format!(
                "ONNX Runtime is already loaded from {}; cannot also load {}",
                from.display(),
                path.display()
            )));
        }
        return Ok(environment.clone());
    }
    let fail = |e: String| {
        WorkerError::new(format!(
            "cannot load ONNX Runtime from {}: {e} (run scripts/fetch-models, or set the \
             `runtime` parameter or KILN_ONNXRUNTIME)",
            path.display()
        ))
    };
    if !path.is_file() {
        return Err(fail("file not found".into()));
    }
    let environment = ort::init_from(path)
        .map_err(|e| fail(e.to_string()))?
        .with_name("kiln")
        .build()
        .map_err(|e| fail(e.to_string()))?;
    *loaded = Some((path.to_path_buf(), environment.clone()));
    Ok(environment)
}
