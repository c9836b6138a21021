//! `--jobs URL` (env `KILN_JOBS`): which store holds the jobs.
//!
//! - `file:PATH` — the embedded store ([`crate::embedded`]) in the folder `PATH`
//!   (created when missing). The default is `file:kiln-jobs`: a folder
//!   `kiln-jobs` in the server's working directory.
//! - `redis://HOST:PORT/…` — Redis Streams, for several servers sharing one queue.

use std::path::PathBuf;
use std::sync::Arc;

use crate::queue::{JobQueue, JobsError, Result};

/// The default `--jobs`.
pub const DEFAULT_URL: &str = "file:kiln-jobs";

/// A parsed `--jobs` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// `file:PATH`.
    File(PathBuf),
    /// `redis://…`, as given.
    Redis(String),
}

impl BackendUrl {
    /// Parses `file:PATH` (also `file://PATH`) or `redis://…` (`rediss://…`).
    pub fn parse(url: &str) -> Result<BackendUrl> {
        if let Some(path) = url.strip_prefix("file:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(JobsError::Config(
                    "--jobs file: needs a folder, e.g. file:kiln-jobs".into(),
                ));
            }
            return Ok(BackendUrl::File(PathBuf::from(path)));
        }
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            return Ok(BackendUrl::Redis(url.to_string()));
        }
        Err(JobsError::Config(format!(
            "--jobs `{url}`: expected file:PATH (the embedded store) or redis://HOST:PORT/..."
        )))
    }

    /// Opens the store.
    pub fn open(&self) -> Result<Arc<dyn JobQueue>> {
        match self {
            BackendUrl::File(path) => Ok(Arc::new(crate::embedded::EmbeddedQueue::open(path)?)),
            BackendUrl::Redis(url) => Ok(Arc::new(crate::redis_streams::RedisQueue::open(url)?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_kinds() {
        assert_eq!(
            BackendUrl::parse("file:/var/lib/kiln").ok(),
            Some(BackendUrl::File("/var/lib/kiln".into()))
        );
        assert_eq!(
            BackendUrl::parse(DEFAULT_URL).ok(),
            Some(BackendUrl::File("kiln-jobs".into()))
        );
        assert!(matches!(
            BackendUrl::parse("redis://127.0.0.1:6379/0"),
            Ok(BackendUrl::Redis(_))
        ));
        assert!(BackendUrl::parse("http://x").is_err());
        assert!(BackendUrl::parse("file:").is_err());
    }
}
