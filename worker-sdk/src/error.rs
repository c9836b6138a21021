//! The error a worker returns from any lifecycle step.

/// A worker failure: a message for the log and for every request of the batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WorkerError(pub String);

impl WorkerError {
    /// A worker error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        WorkerError(message.into())
    }
}

impl From<String> for WorkerError {
    fn from(message: String) -> Self {
        WorkerError(message)
    }
}

impl From<&str> for WorkerError {
    fn from(message: &str) -> Self {
        WorkerError(message.to_owned())
    }
}

impl From<abi_stable::std_types::RString> for WorkerError {
    fn from(message: abi_stable::std_types::RString) -> Self {
        WorkerError(message.into_string())
    }
}
