//! The `cuda` backend (feature `cuda`): pinned host memory and device memory on an
//! NVIDIA GPU, through `cudarc` with the driver (`libcuda.so.1`) and NVRTC
//! (`libnvrtc.so.13`) opened at run time, so building needs no CUDA toolkit.
//!
//! [`open`] answers [`CudaError::Unavailable`] with the reason when there is no
//! driver, no NVRTC or no device; it never panics (cudarc's lazy loader panics on a
//! missing library, so presence is checked first). The libraries are looked up by
//! the dynamic loader (`LD_LIBRARY_PATH`, the ldconfig cache); an operator may name
//! a folder to open them from first ([`Libraries::dir`]): once a library of that
//! soname is loaded, cudarc's lookup by name finds it. Libraries are never closed.

mod memory;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use cudarc;
use cudarc::driver::{CudaContext, DriverError};
pub use memory::{CudaBufferSet, DeviceBuf, PinnedBuf, Staging, StagingKind};

/// The driver library's name, as the dynamic loader finds it.
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";
/// NVRTC's library name for the CUDA major version kiln is built for (13).
pub const NVRTC_LIBRARY: &str = "libnvrtc.so.13";

/// What can go wrong with the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver, NVRTC or device: the reason, for the operator.
    #[error("CUDA is unavailable: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// NVRTC could not compile a kernel.
    #[error("NVRTC: {0}")]
    Compile(String),
    /// A size beyond what can be allocated.
    #[error("{0}")]
    Size(String),
}

/// Where the CUDA libraries come from.
#[derive(Debug, Clone, Default)]
pub struct Libraries {
    /// A folder holding `libcuda.so.1` and/or `libnvrtc.so.13`, opened before the
    /// loader's own search (operator-only: it names a folder).
    pub dir: Option<PathBuf>,
}

impl Libraries {
    /// Opens what `dir` holds of the two libraries (never closed), then checks that
    /// the loader finds both.
    pub fn load(&self) -> Result<(), CudaError> {
        if let Some(dir) = &self.dir {
            if !dir.is_dir() {
                return Err(CudaError::Unavailable(format!(
                    "the CUDA library folder {} does not exist",
                    dir.display()
                )));
            }
            for name in [DRIVER_LIBRARY, NVRTC_LIBRARY] {
                preload(&dir.join(name))?;
            }
        }
        let searched = match &self.dir {
            Some(dir) => format!("{} and the dynamic loader's path", dir.display()),
            None => "the dynamic loader's path (LD_LIBRARY_PATH, ldconfig)".to_owned(),
        };
        // SAFETY: dlopen of the driver / NVRTC by name: their constructors are the
        // vendor's, and the handle is closed at once (a loaded library stays).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(format!(
                "the CUDA driver library ({DRIVER_LIBRARY}) is not in {searched}: \
                 no NVIDIA driver is installed"
            )));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(format!(
                "NVRTC ({NVRTC_LIBRARY}) is not in {searched}: install the CUDA 13 \
                 runtime compiler (e.g. the cuda-nvrtc-13 package or the \
                 nvidia-cuda-nvrtc wheel) or name its folder"
            )));
        }
        Ok(())
    }
}

/// Opens one library by path if it exists, and keeps it loaded for good.
fn preload(path: &Path) -> Result<(), CudaError> {
    if !path.is_file() {
        return Ok(());
    }
    // SAFETY: the operator named this folder for its CUDA libraries; running their
    // constructors is what loading them means.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            // Never closed: cudarc's function pointers into it live for the process.
            std::mem::forget(lib);
            Ok(())
        }
        Err(e) => Err(CudaError::Unavailable(format!(
            "could not open {}: {e}",
            path.display()
        ))),
    }
}

/// Loads the libraries and opens device `ordinal`'s primary context.
pub fn open(ordinal: usize, libraries: &Libraries) -> Result<Arc<CudaContext>, CudaError> {
    libraries.load()?;
    let count = CudaContext::device_count()
        .map_err(|e| CudaError::Unavailable(format!("the driver found no device: {e}")))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::Unavailable(format!(
            "device {ordinal} asked for, the driver sees {count}"
        )));
    }
    Ok(CudaContext::new(ordinal)?)
}

/// Whether a CUDA device can be opened here, and if not why (for tests and
/// diagnostics: a GPU test skips with this reason).
pub fn probe() -> Result<String, CudaError> {
    let ctx = open(0, &Libraries::default())?;
    let name = ctx.name()?;
    let (major, minor) = ctx.compute_capability()?;
    Ok(format!("{name} (compute capability {major}.{minor})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_the_reason_names_where_it_looked() {
        if let Ok(device) = probe() {
            println!("SKIPPED (a GPU is here: {device}): the no-driver reason");
            return;
        }
        let dir = std::env::temp_dir().join(format!("kiln-cuda-libs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = open(
            0,
            &Libraries {
                dir: Some(dir.clone()),
            },
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, CudaError::Unavailable(_)), "{text}");
        assert!(text.contains(DRIVER_LIBRARY), "{text}");
        assert!(
            text.contains(&format!("{} and the dynamic loader's path", dir.display())),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let err = open(
            0,
            &Libraries {
                dir: Some(dir.clone()),
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
    }
}
