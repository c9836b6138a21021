//! Finding and loading worker plugins. A worker `NAME` is the library
//! `libkiln_worker_NAME.so` (dashes become underscores) in one of the configured
//! plugin directories, and nowhere else.
//!
//! Libraries are opened with `libloading` (`RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE`)
//! and never closed (see DESIGN, "Never dlclose"); the root module is then taken
//! through abi_stable's checked path (`LibHeader::init_root_module`: version and
//! type layouts), so a mismatched plugin is refused with a clear error. A plugin
//! file that changed since it was loaded is loaded again from a fresh copy under a
//! new name, since `dlopen` of the same path answers with the old mapping.

use std::collections::HashMap;
use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use abi_stable::library::{AbiHeaderRef, RootModule, ROOT_MODULE_LOADER_NAME_WITH_NUL};
use kiln_worker_sdk::WorkerModRef;

use crate::error::{Result, ServerError};
use crate::observe::logging::plugin_log_sink;

/// Why a plugin library could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// Not a library, or one that exports no (valid) abi_stable root module.
    #[error("{} is not a kiln plugin: {reason}", path.display())]
    NotAPlugin { path: PathBuf, reason: String },
    /// A kiln plugin built against another version of the plugin contract.
    #[error(
        "{} does not match this server's plugin ABI ({} {}): {reason}",
        path.display(),
        WorkerModRef::NAME,
        WorkerModRef::VERSION_STRINGS.version
    )]
    Mismatch { path: PathBuf, reason: String },
    /// The fresh copy of a changed plugin file could not be made.
    #[error("cannot copy the changed plugin {} to {}: {source}", path.display(), copy.display())]
    Copy {
        path: PathBuf,
        copy: PathBuf,
        source: std::io::Error,
    },
}

/// What identifies one version of a plugin file: a replaced or rewritten file
/// differs in inode, size or modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct FileVersion {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileVersion {
    fn of(path: &Path) -> Option<FileVersion> {
        let meta = std::fs::metadata(path).ok()?;
        Some(FileVersion {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        })
    }
}

/// A plugin library loaded for a worker, and the version of its file it came from.
struct Loaded {
    module: WorkerModRef,
    path: PathBuf,
    version: Option<FileVersion>,
}

/// A worker compiled into the host program rather than loaded from a library: an
/// embedding program serves its own worker types through the same Manager, groups
/// and instances (`ServerConfig::builtin_workers`), and kiln-core's own tests drive
/// groups and the Manager with one. It runs in the server's process only
/// (`isolation = "process"` needs a plugin file).
#[derive(Clone)]
pub struct BuiltinWorker {
    /// The worker's name, as a plugin's would be (`[a-z0-9_-]`).
    pub name: String,
    /// Its root module ([`kiln_worker_sdk::ffi::root_module`]).
    pub module: WorkerModRef,
}

impl BuiltinWorker {
    /// The worker `W` under `name`.
    pub fn new<W: kiln_worker_sdk::Worker>(name: &str) -> BuiltinWorker {
        BuiltinWorker {
            name: name.to_owned(),
            module: kiln_worker_sdk::ffi::root_module::<W>(),
        }
    }
}

impl std::fmt::Debug for BuiltinWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltinWorker")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The plugin directories and the libraries loaded from them.
pub struct Plugins {
    dirs: Vec<PathBuf>,
    /// Workers compiled into the host, found before any library.
    builtin: HashMap<String, WorkerModRef>,
    loaded: HashMap<String, Loaded>,
    /// Each plugin file opened under its own path, with the version then mapped
    /// (loaded or refused: it stays mapped either way), which `dlopen` of that path
    /// answers with from then on.
    mapped: HashMap<PathBuf, Option<FileVersion>>,
    /// The copy made of each later version of a file.
    copies_of: HashMap<(PathBuf, FileVersion), PathBuf>,
    /// The private folder of fresh copies of changed plugin files (made on first
    /// need, under the temporary directory: `$TMPDIR`), and copies made so far.
    copies: Option<PathBuf>,
    copied: usize,
}

impl Plugins {
    /// Plugins found in `dirs`, in order.
    pub fn new(dirs: Vec<PathBuf>) -> Plugins {
        Plugins {
            dirs,
            builtin: HashMap::new(),
            loaded: HashMap::new(),
            mapped: HashMap::new(),
            copies_of: HashMap::new(),
            copies: None,
            copied: 0,
        }
    }

    /// Adds a worker compiled into the host; it is found before any library of
    /// the same name.
    pub fn add_builtin(&mut self, worker: BuiltinWorker) -> Result<()> {
        check_name(&worker.name)?;
        let module = worker.module;
        (module.set_logger())(plugin_log_sink());
        (module.set_tracer())(crate::observe::trace::plugin_trace_sink());
        (module.set_caller())(crate::compute::calls::plugin_call_sink());
        self.builtin.insert(worker.name, module);
        Ok(())
    }

    /// Whether `name` is a worker compiled into the host.
    pub fn is_builtin(&self, name: &str) -> bool {
        self.builtin.contains_key(name)
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

    /// Loads the plugin for worker `name`: once, and again (from a fresh copy) when
    /// its file has changed since.
    pub fn load(&mut self, name: &str) -> Result<WorkerModRef> {
        check_name(name)?;
        if let Some(module) = self.builtin.get(name) {
            return Ok(*module);
        }
        let path = self.find(name)?;
        let version = FileVersion::of(&path);
        if let Some(loaded) = self.loaded.get(name) {
            if loaded.path == path && loaded.version.is_some() && loaded.version == version {
                return Ok(loaded.module);
            }
        }
        let fail = |e: PluginError| ServerError::LoadFailed {
            worker: name.to_owned(),
            reason: e.to_string(),
        };
        let open = self.library_path(&path, version).map_err(fail)?;
        let module = open_plugin(&open).map_err(fail)?;
        (module.set_logger())(plugin_log_sink());
        (module.set_tracer())(crate::observe::trace::plugin_trace_sink());
        (module.set_caller())(crate::compute::calls::plugin_call_sink());
        if open == path {
            spdlog::info!("loaded plugin `{name}` from {}", path.display());
        } else {
            spdlog::info!(
                "loaded plugin `{name}` from {} (changed since it was loaded: a fresh copy, {})",
                path.display(),
                open.display()
            );
        }
        self.loaded.insert(
            name.to_owned(),
            Loaded {
                module,
                path,
                version,
            },
        );
        Ok(module)
    }

    /// The file the plugin of worker `name` was loaded from (after [`Plugins::load`]).
    pub fn path(&self, name: &str) -> Option<&Path> {
        self.loaded.get(name).map(|l| l.path.as_path())
    }

    /// Where to open `path` at `version` so that this version's code is what gets
    /// mapped: the path itself the first time, and again while the file is the one
    /// mapped then; once the file changed, a copy under a new name (`dlopen` of the
    /// path would answer with the library mapped before), one per version.
    fn library_path(
        &mut self,
        path: &Path,
        version: Option<FileVersion>,
    ) -> Result<PathBuf, PluginError> {
        match self.mapped.get(path) {
            None => {
                self.mapped.insert(path.to_owned(), version);
                return Ok(path.to_owned());
            }
            Some(mapped) if mapped.is_some() && *mapped == version => return Ok(path.to_owned()),
            Some(_) => {}
        }
        let key = version.map(|v| (path.to_owned(), v));
        if let Some(copy) = key.as_ref().and_then(|k| self.copies_of.get(k)) {
            return Ok(copy.clone());
        }
        let copy = self.fresh_copy(path)?;
        if let Some(key) = key {
            self.copies_of.insert(key, copy.clone());
        }
        Ok(copy)
    }

    /// Copies `path` under a new name into this process's private folder of copies.
    fn fresh_copy(&mut self, path: &Path) -> Result<PathBuf, PluginError> {
        let copy_err = |copy: PathBuf| {
            let path = path.to_owned();
            move |source| PluginError::Copy { path, copy, source }
        };
        let dir = match &self.copies {
            Some(dir) => dir.clone(),
            None => {
                let dir = private_dir().map_err(copy_err(std::env::temp_dir()))?;
                self.copies = Some(dir.clone());
                dir
            }
        };
        self.copied += 1;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let copy = dir.join(format!("{stem}-{}{DLL_SUFFIX}", self.copied));
        let mut from = std::fs::File::open(path).map_err(copy_err(copy.clone()))?;
        let mut to = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&copy)
            .map_err(copy_err(copy.clone()))?;
        std::io::copy(&mut from, &mut to).map_err(copy_err(copy.clone()))?;
        Ok(copy)
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

impl Drop for Plugins {
    /// Removes the folder of fresh copies (best effort): the libraries stay mapped
    /// until the process exits, removing their files does not unmap them.
    fn drop(&mut self) {
        if let Some(dir) = &self.copies {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                spdlog::warn!("cannot remove {}: {e}", dir.display());
            }
        }
    }
}

/// Makes `$TMPDIR/kiln-plugin-copies-<pid>[-n]`, readable by this user only, new
/// (never one another process made).
fn private_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir().join(format!("kiln-plugin-copies-{}", std::process::id()));
    let mut attempt = 0;
    loop {
        let dir = match attempt {
            0 => base.clone(),
            n => PathBuf::from(format!("{}-{n}", base.display())),
        };
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => {
                attempt += 1
            }
            Err(e) => return Err(e),
        }
    }
}

/// Opens the library at `path` for good (`RTLD_NODELETE`, and the handle is never
/// dropped) and takes its root module through abi_stable's version and layout
/// checks.
pub(crate) fn open_plugin(path: &Path) -> Result<WorkerModRef, PluginError> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    let not_a_plugin = |reason: String| PluginError::NotAPlugin {
        path: path.to_owned(),
        reason,
    };
    // SAFETY: running a library's initializers is what loading a plugin means; the
    // operator chose the plugin directories.
    let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL | libc::RTLD_NODELETE) }
        .map_err(|e| not_a_plugin(e.to_string()))?;
    // Never dlclose (DESIGN, "Never dlclose"): the module's references are 'static.
    let library: &'static Library = Box::leak(Box::new(library));
    // SAFETY: abi_stable exports its root module loader under this name with this
    // type (`abi_stable::library::abi_header_from_raw_library` reads it the same
    // way), and the library stays mapped for the life of the process.
    let header: AbiHeaderRef = unsafe {
        *library
            .get::<AbiHeaderRef>(ROOT_MODULE_LOADER_NAME_WITH_NUL.as_bytes())
            .map_err(|e| not_a_plugin(e.to_string()))?
    };
    let header = header.upgrade().map_err(|e| not_a_plugin(e.to_string()))?;
    header
        .init_root_module::<WorkerModRef>()
        .map_err(|e| PluginError::Mismatch {
            path: path.to_owned(),
            reason: e.to_string(),
        })
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

    #[test]
    fn fresh_copies_have_new_names_in_a_private_folder_removed_with_the_plugins() {
        use std::os::unix::fs::PermissionsExt;
        let file = std::env::temp_dir().join(format!("kiln-copy-test-{}.so", std::process::id()));
        std::fs::write(&file, b"v1").unwrap();
        let mut plugins = Plugins::new(Vec::new());
        let first = plugins.fresh_copy(&file).unwrap();
        std::fs::write(&file, b"v2").unwrap();
        let second = plugins.fresh_copy(&file).unwrap();
        assert_ne!(first, second);
        assert_eq!(std::fs::read(&first).unwrap(), b"v1");
        assert_eq!(std::fs::read(&second).unwrap(), b"v2");
        let dir = first.parent().unwrap().to_owned();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(plugins);
        assert!(!dir.exists());
        std::fs::remove_file(&file).unwrap();
    }
}
