//! Finding and loading worker plugins. A worker `NAME` is the library
//! `libkiln_worker_NAME.so` (dashes become underscores) in one of the configured
//! plugin directories, and nowhere else. Libraries are loaded once and never
//! unloaded (abi_stable leaks the handle: see DESIGN, "Never dlclose").

use std::collections::HashMap;
use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
use std::path::{Path, PathBuf};

use abi_stable::library::RootModule;
use kiln_worker_sdk::reexports::lib_header_from_path;
use kiln_worker_sdk::WorkerModRef;

use crate::error::{Result, ServerError};
use crate::logging::plugin_log_sink;

/// The plugin directories and the libraries loaded from them.
pub struct Plugins {
    dirs: Vec<PathBuf>,
    loaded: HashMap<String, WorkerModRef>,
}

impl Plugins {
    /// Plugins found in `dirs`, in order.
    pub fn new(dirs: Vec<PathBuf>) -> Plugins {
        Plugins {
            dirs,
            loaded: HashMap::new(),
        }
    }

    /// Where plugins are looked for when none is configured: the directory of the
    /// running executable (where `cargo build` puts the plugins beside `kiln`), and
    /// `../lib/kiln` next to it (an installed layout).
    pub fn default_dirs() -> Vec<PathBuf> {
        let Some(exe_dir) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_path_buf))
        else {
            return Vec::new();
        };
        // Test and bench executables live in target/<profile>/deps.
        let mut dirs = vec![exe_dir.clone()];
        if exe_dir.ends_with("deps") {
            if let Some(parent) = exe_dir.parent() {
                dirs.insert(0, parent.to_path_buf());
            }
        }
        dirs.push(exe_dir.join("../lib/kiln"));
        dirs
    }

    /// The configured directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The library file name for worker `name`.
    pub fn file_name(name: &str) -> String {
        format!(
            "{DLL_PREFIX}kiln_worker_{}{DLL_SUFFIX}",
            name.replace('-', "_")
        )
    }

    /// Loads (once) the plugin for worker `name`.
    pub fn load(&mut self, name: &str) -> Result<WorkerModRef> {
        check_name(name)?;
        if let Some(module) = self.loaded.get(name) {
            return Ok(*module);
        }
        let path = self.find(name)?;
        let fail = |reason: String| ServerError::LoadFailed {
            worker: name.to_owned(),
            reason,
        };
        let header = lib_header_from_path(&path)
            .map_err(|e| fail(format!("{} is not a kiln plugin: {e}", path.display())))?;
        let module = header.init_root_module::<WorkerModRef>().map_err(|e| {
            fail(format!(
                "{} does not match this server's plugin ABI ({} {}): {e}",
                path.display(),
                WorkerModRef::NAME,
                WorkerModRef::VERSION_STRINGS.version
            ))
        })?;
        (module.set_logger())(plugin_log_sink());
        spdlog::info!("loaded plugin `{name}` from {}", path.display());
        self.loaded.insert(name.to_owned(), module);
        Ok(module)
    }

    fn find(&self, name: &str) -> Result<PathBuf> {
        let file = Self::file_name(name);
        for dir in &self.dirs {
            let candidate = dir.join(&file);
            if !candidate.is_file() {
                continue;
            }
            // Refuse a link that leads out of the plugin directory.
            let (Ok(real), Ok(real_dir)) = (candidate.canonicalize(), dir.canonicalize()) else {
                continue;
            };
            if real.starts_with(&real_dir) {
                return Ok(real);
            }
            spdlog::warn!(
                "{} leads outside {}: ignored",
                candidate.display(),
                dir.display()
            );
        }
        Err(ServerError::NotFound(format!(
            "no plugin for worker `{name}` ({file}) in {}",
            self.dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }
}

/// A worker name is lower-case letters, digits, `-` and `_`: nothing that can leave
/// the plugin directory.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ServerError::invalid(format!(
            "invalid worker name `{name}`: use lower-case letters, digits, `-` and `_`"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_escape() {
        for bad in [
            "../echo",
            "/etc/passwd",
            "a/b",
            "",
            "echo.so",
            "ECHO",
            "a\0b",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["echo", "echo-multi", "invert_image", "w2"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        assert_eq!(
            Plugins::file_name("echo-multi"),
            format!("{DLL_PREFIX}kiln_worker_echo_multi{DLL_SUFFIX}")
        );
    }
}
