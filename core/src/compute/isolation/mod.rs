//! Crash isolation: a worker group may run each of its instances in its own
//! `kiln worker-host` process (`isolation = "process"`), so that a plugin that
//! segfaults or aborts loses only the batch it was running, not the server.
//!
//! - [`process`]: the server's side, a worker instance object whose calls are
//!   messages to the host (the instance thread cannot tell it from a plugin).
//! - [`spawn`]: starting a host process (command, environment, descriptors, log)
//!   and describing how one ended.
//! - [`host`]: the host's side, the `worker-host` subcommand's loop.
//! - [`wire`]: the control messages; [`arena`]: the shared memory batches travel in.
//! - [`relay`]: model calls from a worker in a host, relayed to the server.
//!
//! `docs/architecture.md` ("Worker isolation") has the whole picture.

pub mod arena;
pub mod host;
pub mod process;
pub mod relay;
pub mod spawn;
pub mod wire;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Where a group's plugin runs (the `isolation` load parameter).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Isolation {
    /// In the server's process (`"none"`, the default): nothing between the
    /// server and the plugin; a crash of the plugin is a crash of the server.
    #[default]
    None,
    /// Each instance in its own `kiln worker-host` process (`"process"`).
    Process,
}

impl Isolation {
    /// The parameter's value (`none`, `process`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Isolation::None => "none",
            Isolation::Process => "process",
        }
    }
}

static HOST_PROGRAM: OnceLock<PathBuf> = OnceLock::new();

/// Names the executable whose `worker-host` subcommand runs isolated workers (a
/// program embedding kiln-core sets it; the `kiln` binary needs not).
pub fn set_host_program(path: PathBuf) {
    let _ = HOST_PROGRAM.set(path);
}

/// The executable to start hosts with: the one set, else this executable when
/// it is `kiln`, else a `kiln` beside it or one folder up (a test executable in
/// `target/<profile>/deps`).
fn host_program() -> Result<PathBuf, String> {
    if let Some(path) = HOST_PROGRAM.get() {
        return Ok(path.clone());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    if exe.file_name() == Some(OsStr::new("kiln")) {
        return Ok(exe);
    }
    let dir = exe.parent();
    dir.into_iter()
        .chain(dir.and_then(|d| d.parent()))
        .map(|d| d.join("kiln"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            format!(
                "isolation = \"process\" needs the `kiln` executable (its `worker-host` \
                 subcommand), and none is beside {}",
                exe.display()
            )
        })
}

/// The environment a worker host gets: only these variables of the server's
/// (the system's basics, library paths, and kiln's own `KILN_*`, which plugins
/// read for their settings), nothing else.
pub fn passes_environment(key: &OsStr) -> bool {
    const PASSED: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "RUST_BACKTRACE",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
    ];
    let Some(key) = key.to_str() else {
        return false;
    };
    PASSED.contains(&key) || key.starts_with("KILN_")
}
