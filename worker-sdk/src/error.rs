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

/// What kind of failure one request of a batch met (see [`RequestError`]).
#[repr(u8)]
#[derive(abi_stable::StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestErrorKind {
    /// The request itself is at fault (a bad parameter or input value): the client
    /// gets HTTP 400 / gRPC INVALID_ARGUMENT.
    Invalid,
    /// The worker could not serve this request: HTTP 500 / gRPC INTERNAL.
    Internal,
}

/// The failure of one request of a batch, set with [`crate::Batch::fail`]; the
/// other requests of the batch are answered normally.
#[repr(C)]
#[derive(abi_stable::StableAbi, Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub kind: RequestErrorKind,
    pub message: abi_stable::std_types::RString,
}

impl RequestError {
    /// The request is invalid (HTTP 400 / INVALID_ARGUMENT).
    pub fn invalid(message: impl Into<String>) -> Self {
        RequestError {
            kind: RequestErrorKind::Invalid,
            message: message.into().into(),
        }
    }

    /// The worker failed this request (HTTP 500 / INTERNAL).
    pub fn internal(message: impl Into<String>) -> Self {
        RequestError {
            kind: RequestErrorKind::Internal,
            message: message.into().into(),
        }
    }
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-text panic payload".to_owned()
    }
}
