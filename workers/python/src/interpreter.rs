//! Starting the embedded interpreter in a worker host: once per process, with the
//! operator's environment's packages (its `site-packages`) on `sys.path`.

use std::ffi::CStr;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use pyo3::prelude::*;

/// The result of the one start of this process's interpreter.
static STARTED: OnceLock<Result<(), String>> = OnceLock::new();

/// Starts the interpreter (once per process) and puts the package folders of
/// `python` (an interpreter, e.g. a virtualenv's `bin/python`) first on its path.
pub fn start(python: &Path) -> Result<(), String> {
    STARTED
        .get_or_init(|| {
            make_libpython_global()?;
            Python::initialize();
            let paths = site_packages(python)?;
            Python::attach(|py| -> PyResult<()> {
                let sys = py.import("sys")?;
                let path = sys.getattr("path")?;
                for (i, dir) in paths.iter().enumerate() {
                    path.call_method1("insert", (i, dir))?;
                }
                // No `__pycache__` written into the operator's model repository.
                sys.setattr("dont_write_bytecode", true)?;
                // The host's stdout goes nowhere; its stderr reaches the server's log.
                sys.setattr("stdout", sys.getattr("stderr")?)?;
                Ok(())
            })
            .map_err(|e| format!("cannot set up the interpreter: {e}"))
        })
        .clone()
}

/// Re-opens the libpython this plugin links with `RTLD_GLOBAL`: the worker host
/// opened the plugin (and so libpython) with its symbols local, and C extension
/// modules (numpy's) find the interpreter's symbols only in the global scope.
fn make_libpython_global() -> Result<(), String> {
    let symbol = pyo3::ffi::Py_IsInitialized as *const libc::c_void;
    // SAFETY: dladdr only reads the loader's tables; `info` is a plain C struct.
    let path = unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(symbol, &mut info) == 0 || info.dli_fname.is_null() {
            return Err("cannot find the loaded libpython".into());
        }
        CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned()
    };
    // SAFETY: the library is already loaded (RTLD_NOLOAD): no initializers run.
    let library = unsafe {
        libloading::os::unix::Library::open(
            Some(&path),
            libc::RTLD_NOW | libc::RTLD_GLOBAL | libc::RTLD_NOLOAD,
        )
    }
    .map_err(|e| format!("cannot make {path}'s symbols global: {e}"))?;
    // Never closed: the interpreter lives as long as the process.
    std::mem::forget(library);
    Ok(())
}

/// The `site-packages`/`dist-packages` folders on `python`'s `sys.path`, after
/// checking that it is the Python version this worker embeds.
fn site_packages(python: &Path) -> Result<Vec<String>, String> {
    const QUERY: &str = "import json, sys; print(json.dumps([list(sys.version_info[:2]), \
        [p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]]))";
    let output = Command::new(python)
        .args(["-I", "-c", QUERY])
        .output()
        .map_err(|e| format!("python `{}`: cannot run it: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!(
            "python `{}`: {}: {}",
            python.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let (version, paths): ((u32, u32), Vec<String>) = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("python `{}`: unexpected answer: {e}", python.display()))?;
    let embedded = Python::attach(|py| {
        let v = py.version_info();
        (u32::from(v.major), u32::from(v.minor))
    });
    if version != embedded {
        return Err(format!(
            "python `{}` is Python {}.{}; this worker embeds Python {}.{} \
             (the python3 it was built with): use an environment of that version",
            python.display(),
            version.0,
            version.1,
            embedded.0,
            embedded.1
        ));
    }
    Ok(paths)
}
