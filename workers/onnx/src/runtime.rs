//! Finding and loading the ONNX Runtime library, once per process, and its one
//! environment with the global thread pools every session shares by default
//! ([`crate::threads`]). "Per process" is per copy of this plugin: every model the
//! onnx worker serves lives in the one copy the server loads, so they share one
//! pool (the OCR worker runs no ONNX Runtime itself: it calls these models).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use kiln_worker_sdk::WorkerError;
use ort::environment::{Environment, GlobalThreadPoolOptions, ThreadManager};

/// The runtime file the project's `scripts/fetch-models` provides.
pub const RUNTIME_FILE: &str = "libonnxruntime.so.1.31.1";

/// The loaded runtime and where it came from. Only a successful load is kept, so a
/// wrong path can be corrected without restarting the server.
static ENVIRONMENT: Mutex<Option<(PathBuf, Environment)>> = Mutex::new(None);

/// The size of the global intra-op pool, once the environment exists.
pub static GLOBAL_INTRA_OP_THREADS: OnceLock<usize> = OnceLock::new();

/// The global pools: one intra-op thread per physical core (ONNX Runtime's own
/// default for one session, the calling thread being one of them), one inter-op
/// thread (only sessions with parallel execution use it), spinning allowed. With
/// one pool, a thread that spins after its work takes the next work of any model
/// rather than a core another model's pool needs; an idle pool stops spinning and
/// parks within ONNX Runtime's spin budget (tests/tests/onnx_thread_pool.rs).
fn global_pools(intra: usize) -> ort::Result<GlobalThreadPoolOptions> {
    GlobalThreadPoolOptions::default()
        .with_intra_threads(intra)?
        .with_inter_threads(1)?
        .with_spin_control(true)?
        .with_thread_manager(NamedThreads::default())
}

/// Starts the global pools' threads with names of their own, `onnx-pool-<n>`: left
/// to ONNX Runtime they took the name of the thread that loaded the first model
/// (`kiln-manager`), and `top -H` or `perf` showed the pool's work and spinning as
/// the Manager's.
#[derive(Default)]
struct NamedThreads {
    started: AtomicUsize,
}

impl ThreadManager for NamedThreads {
    type Thread = JoinHandle<()>;

    fn create(&self, work: impl FnOnce() + Send + 'static) -> ort::Result<Self::Thread> {
        let n = self.started.fetch_add(1, Ordering::Relaxed);
        std::thread::Builder::new()
            .name(format!("onnx-pool-{n}"))
            .spawn(work)
            .map_err(|e| ort::Error::new(format!("cannot start an ONNX Runtime pool thread: {e}")))
    }

    fn join(thread: Self::Thread) -> ort::Result<()> {
        thread
            .join()
            .map_err(|_| ort::Error::new("an ONNX Runtime pool thread panicked"))
    }
}

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
    let builder = ort::init_from(path).map_err(|e| fail(e.to_string()))?;
    let intra = crate::threads::physical_cores();
    let pools = global_pools(intra).map_err(|e| fail(e.to_string()))?;
    let environment = builder
        .with_name("kiln")
        .with_global_thread_pool(pools)
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let _ = GLOBAL_INTRA_OP_THREADS.set(intra);
    *loaded = Some((path.to_path_buf(), environment.clone()));
    Ok(environment)
}
