//! The server's errors, protocol-free: each protocol maps them to its status codes
//! at its edge, in one table (`http/error.rs`, `grpc/status.rs`).

use std::time::Duration;

/// Anything that can go wrong serving a request or changing the loaded workers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServerError {
    /// The request is malformed or does not fit the model (HTTP 400, gRPC
    /// INVALID_ARGUMENT).
    #[error("{0}")]
    InvalidRequest(String),
    /// What the request would create exists already, e.g. a shared-memory region
    /// registered twice (HTTP 400 as Triton answers, gRPC ALREADY_EXISTS).
    #[error("{0}")]
    AlreadyExists(String),
    /// The thing named is not in a state that allows the request, e.g. cancelling
    /// a job that is already running (HTTP 409, gRPC FAILED_PRECONDITION).
    #[error("{0}")]
    Conflict(String),
    /// The request body is larger than the configured limit (HTTP 413).
    #[error("{0}")]
    TooLarge(String),
    /// No such model, version or worker (HTTP 404).
    #[error("{0}")]
    NotFound(String),
    /// The model's queue is full; retry later (HTTP 429 with `Retry-After`).
    #[error("model `{model}` is overloaded: its request queue of {capacity} is full")]
    QueueFull { model: String, capacity: usize },
    /// A capacity other than the queue is used up, e.g. every sequence slot of a
    /// stateful model; retry later (HTTP 429 with `Retry-After`, gRPC
    /// RESOURCE_EXHAUSTED).
    #[error("{0}")]
    Exhausted(String),
    /// The server or model cannot take requests now (HTTP 503).
    #[error("{0}")]
    Unavailable(String),
    /// The worker failed this request's batch (HTTP 500).
    #[error("worker failed: {0}")]
    WorkerFailed(String),
    /// Loading a worker failed; nothing of it remains (HTTP 400).
    #[error("cannot load worker `{worker}`: {reason}")]
    LoadFailed { worker: String, reason: String },
    /// A restricted API called without its header (`--http-restricted-api`,
    /// `--grpc-restricted-protocol`): HTTP 403, gRPC UNAVAILABLE, as Triton answers.
    #[error("{0}")]
    Restricted(String),
    /// A load would take more than a server-wide limit allows (`--max-instances`,
    /// …); the message names the flag and its value. HTTP 400, as every refused load
    /// (Triton answers a failed load 400); gRPC RESOURCE_EXHAUSTED, the code for a
    /// quota. No `Retry-After`: only an unload or the operator frees it.
    #[error("{0}")]
    LimitExceeded(String),
    /// A bug or a lost internal reply (HTTP 500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServerError {
    /// How long a refused client should wait before retrying, when that applies.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ServerError::QueueFull { .. }
            | ServerError::Exhausted(_)
            | ServerError::Unavailable(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The error of a request the worker failed alone: an invalid request is 400 /
    /// INVALID_ARGUMENT, any other failure 500 / INTERNAL (as a failed batch).
    pub fn from_request(error: &kiln_worker_sdk::RequestError) -> Self {
        let message = error.message.to_string();
        match error.kind {
            kiln_worker_sdk::RequestErrorKind::Invalid => ServerError::InvalidRequest(message),
            kiln_worker_sdk::RequestErrorKind::Internal => ServerError::WorkerFailed(message),
        }
    }

    /// Shorthand for [`ServerError::InvalidRequest`].
    pub fn invalid(message: impl Into<String>) -> Self {
        ServerError::InvalidRequest(message.into())
    }
}

/// A codec's error as the server answers it: each kind is the variant of the same
/// name, with the same message.
impl From<kiln_protocol::ProtocolError> for ServerError {
    fn from(e: kiln_protocol::ProtocolError) -> Self {
        use kiln_protocol::ProtocolError as P;
        match e {
            P::InvalidRequest(m) => ServerError::InvalidRequest(m),
            P::TooLarge(m) => ServerError::TooLarge(m),
            P::NotFound(m) => ServerError::NotFound(m),
            P::Exhausted(m) => ServerError::Exhausted(m),
            P::Internal(m) => ServerError::Internal(m),
        }
    }
}

/// Result with a [`ServerError`].
pub type Result<T, E = ServerError> = std::result::Result<T, E>;
