//! Triton's model control: which repository models are served, and who changes
//! that (`--model-control-mode`, docs/models.md "Model control").
//!
//! - `none`: every model of the repository is loaded at start; the repository
//!   API's load and unload are refused as Triton refuses them.
//! - `explicit` (kiln's default): only the models named at start are loaded
//!   (`--load-model`, `*` for all); clients load and unload through the API.
//! - `poll`: `none`, and [`Poller`] rescans the repository on a timer: a model
//!   whose folder changed is loaded again (a failed load keeps the old one
//!   serving), an added one is loaded, a removed one unloaded.
//!
//! With strict readiness (Triton's default) the server is ready only while every
//! loaded model is; with a strict configuration (`--disable-auto-complete-config`)
//! a `config.pbtxt` must declare the model's inputs and outputs itself.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use crate::error::{Result, ServerError};
use crate::Server;

/// Triton's `--model-control-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Every model at start; no load or unload afterwards.
    None,
    /// `None`, plus the repository rescanned on a timer.
    Poll,
    /// The models named at start; clients load and unload.
    #[default]
    Explicit,
}

impl Mode {
    /// Triton's names, in any case.
    pub fn parse(name: &str) -> std::result::Result<Mode, String> {
        match name.to_ascii_lowercase().as_str() {
            "none" => Ok(Mode::None),
            "poll" => Ok(Mode::Poll),
            "explicit" => Ok(Mode::Explicit),
            _ => Err(format!(
                "unknown model control mode `{name}` (none, poll or explicit)"
            )),
        }
    }

    /// Triton's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Poll => "poll",
            Mode::Explicit => "explicit",
        }
    }
}

/// How the repository's models are controlled ([`Server::set_model_control`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelControl {
    pub mode: Mode,
    /// Ready only while every loaded model is ready (Triton's `--strict-readiness`).
    pub strict_readiness: bool,
    /// A `config.pbtxt` must declare its inputs and outputs
    /// (`--disable-auto-complete-config`).
    pub strict_config: bool,
}

impl Default for ModelControl {
    /// Triton's defaults but the mode: kiln's is `explicit`.
    fn default() -> ModelControl {
        ModelControl {
            mode: Mode::Explicit,
            strict_readiness: true,
            strict_config: false,
        }
    }
}

impl ModelControl {
    /// Refuses the repository API's load and unload unless the mode is
    /// `explicit`: Triton's status (UNAVAILABLE, 503) and its words.
    pub fn check_api(&self) -> Result<()> {
        if self.mode == Mode::Explicit {
            return Ok(());
        }
        Err(ServerError::Unavailable(
            "explicit model load / unload is not allowed if polling is enabled".into(),
        ))
    }
}

/// What a scan saw of each model folder: a fingerprint of its files' names,
/// sizes and modification times, and of the folder's own entries.
type Snapshot = BTreeMap<String, u64>;

/// Rescans the repository for `poll` mode and applies what changed.
pub struct Poller {
    server: Server,
    seen: Snapshot,
}

impl Poller {
    /// A poller that takes the repository as it is now as already served: call
    /// it before the start-up loads, so that a change made during them is seen.
    pub fn new(server: Server) -> Result<Poller> {
        let seen = scan(&server)?;
        Ok(Poller { server, seen })
    }

    /// Scans every `every` until the server stops; needs a tokio runtime (the
    /// scan runs on its blocking threads).
    pub async fn run(mut self, every: Duration) {
        loop {
            tokio::time::sleep(every).await;
            if self.server.is_stopping() {
                return;
            }
            self.poll_once().await;
        }
    }

    /// One scan: loads the added and changed models, unloads the removed ones.
    pub async fn poll_once(&mut self) {
        let server = self.server.clone();
        let now = match tokio::task::spawn_blocking(move || scan(&server)).await {
            Ok(Ok(now)) => now,
            Ok(Err(e)) => {
                spdlog::warn!("model repository poll: {e}");
                return;
            }
            Err(e) => {
                spdlog::warn!("model repository poll: the scan failed: {e}");
                return;
            }
        };
        for name in self.seen.keys().filter(|n| !now.contains_key(*n)) {
            match self.server.unload(name).await {
                Ok(()) => spdlog::info!("model repository poll: `{name}` removed: unloaded"),
                // Never loaded (its load failed): nothing to unload.
                Err(ServerError::NotFound(_)) => {}
                Err(e) => spdlog::warn!("model repository poll: cannot unload `{name}`: {e}"),
            }
        }
        for (name, print) in &now {
            let what = match self.seen.get(name) {
                Some(before) if before == print => continue,
                Some(_) => "changed",
                None => "added",
            };
            // A failed load changes nothing: the model loaded before keeps serving;
            // the index shows why it failed while no version serves. Changed files
            // are built again even where the parameters read the same (a
            // model.onnx rewritten in place: the same `model_dir`).
            let loaded = self.load(name, what == "changed").await;
            self.server.note_load(name, &loaded);
            match loaded {
                Ok(_) => spdlog::info!("model repository poll: `{name}` {what}: loaded"),
                Err(e) => spdlog::warn!(
                    "model repository poll: `{name}` {what}: not loaded (what was served is kept): {e}"
                ),
            }
        }
        self.seen = now;
    }

    /// Loads model `name` as configured, its files read on a blocking thread;
    /// `fresh`: every version is built again.
    async fn load(&self, name: &str, fresh: bool) -> Result<String> {
        let (server, model) = (self.server.clone(), name.to_owned());
        let resolved =
            tokio::task::spawn_blocking(move || server.resolve_model(&model, None, Vec::new()))
                .await
                .map_err(|e| ServerError::Internal(format!("a blocking task failed: {e}")))??;
        if fresh {
            self.server.reload_resolved(name, resolved).await
        } else {
            self.server.load_resolved(name, resolved, Vec::new()).await
        }
    }
}

/// Every model folder of the repository with its fingerprint.
fn scan(server: &Server) -> Result<Snapshot> {
    let root = server.repository_root()?;
    let mut snapshot = Snapshot::new();
    for entry in server.repository_index()? {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        fingerprint(&root.join(&entry.name), &mut hasher);
        snapshot.insert(entry.name, hasher.finish());
    }
    Ok(snapshot)
}

/// A file up to this size is fingerprinted by its content too: a config
/// rewritten with the same size within one tick of the file system's clock
/// (Linux stamps files with a coarse clock, 1–10 ms) has the same mtime.
const HASHED_CONTENT: u64 = 64 * 1024;

/// Feeds every entry under `dir` (sorted, recursively) to `hasher`: its name,
/// and for a file its size, modification and change times, inode, and the
/// content of a small one (a config).
fn fingerprint(dir: &Path, hasher: &mut impl Hasher) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        entry.file_name().hash(hasher);
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        if meta.is_dir() {
            fingerprint(&entry.path(), hasher);
        } else {
            meta.len().hash(hasher);
            meta.modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .hash(hasher);
            #[cfg(unix)]
            {
                use std::os::unix::fs::MetadataExt;
                (meta.ino(), meta.ctime(), meta.ctime_nsec()).hash(hasher);
            }
            if meta.len() <= HASHED_CONTENT {
                std::fs::read(entry.path()).ok().hash(hasher);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_as_triton_names_them() {
        assert_eq!(Mode::parse("none"), Ok(Mode::None));
        assert_eq!(Mode::parse("POLL"), Ok(Mode::Poll));
        assert_eq!(Mode::parse("Explicit"), Ok(Mode::Explicit));
        assert!(Mode::parse("auto")
            .unwrap_err()
            .contains("none, poll or explicit"));
    }

    #[test]
    fn only_explicit_allows_the_api() {
        let explicit = ModelControl::default();
        assert!(explicit.check_api().is_ok());
        for mode in [Mode::None, Mode::Poll] {
            let e = ModelControl { mode, ..explicit }.check_api().unwrap_err();
            assert!(matches!(e, ServerError::Unavailable(_)), "{e:?}");
        }
    }

    #[test]
    fn a_fingerprint_changes_with_a_file_or_a_folder() {
        let dir = std::env::temp_dir().join(format!("kiln-fingerprint-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("1")).unwrap();
        std::fs::write(dir.join("config.pbtxt"), "max_batch_size: 4").unwrap();
        let print = || {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            fingerprint(&dir, &mut h);
            h.finish()
        };
        let first = print();
        assert_eq!(first, print());
        std::fs::write(dir.join("config.pbtxt"), "max_batch_size: 16").unwrap();
        let second = print();
        assert_ne!(first, second);
        std::fs::create_dir_all(dir.join("2")).unwrap();
        assert_ne!(second, print());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
