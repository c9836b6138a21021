//! The codecs' errors.

/// Why a message could not be decoded or encoded. The kinds are those the server
/// answers with their own status codes (`kiln_core::ServerError` has a variant
/// of the same name for each); the messages are what the client reads.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProtocolError {
    /// The message is malformed, or names something it may not (HTTP 400, gRPC
    /// INVALID_ARGUMENT).
    #[error("{0}")]
    InvalidRequest(String),
    /// More bytes than a limit allows, e.g. a shared-memory input beyond the
    /// server's bound on bytes held (HTTP 413).
    #[error("{0}")]
    TooLarge(String),
    /// Something the message names does not exist, e.g. a shared-memory region
    /// (HTTP 404; the codecs report an unknown region as an invalid request).
    #[error("{0}")]
    NotFound(String),
    /// A capacity is used up for now, e.g. the bytes of shared-memory inputs the
    /// server may hold; retry later (HTTP 429, gRPC RESOURCE_EXHAUSTED).
    #[error("{0}")]
    Exhausted(String),
    /// A bug, or an I/O failure outside the client's control (HTTP 500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ProtocolError {
    /// Shorthand for [`ProtocolError::InvalidRequest`].
    pub fn invalid(message: impl Into<String>) -> Self {
        ProtocolError::InvalidRequest(message.into())
    }
}

/// Result with a [`ProtocolError`].
pub type Result<T, E = ProtocolError> = std::result::Result<T, E>;
