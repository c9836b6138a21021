//! kiln-client: talk to kiln over HTTP (KServe v2 JSON, or binary tensors with
//! [`HttpClient::infer_binary`]), over gRPC ([`GrpcClient`], unary or one stream)
//! or in-process (`NativeClient`, with the `embedded` feature), with one API; and
//! over a WebSocket stream, frame by frame ([`stream::StreamClient`]).
//!
//! The codecs are [`kiln_protocol`]'s: without the `embedded` feature the client
//! does not depend on the server (no actix-web, no plugin loader).
//!
//! ```no_run
//! # async fn demo() -> Result<(), kiln_client::ClientError> {
//! use kiln_client::{HttpClient, InferRequest, InputTensor, DataType};
//! let client = HttpClient::new("http://127.0.0.1:8000")?;
//! let request = InferRequest {
//!     model: "echo".into(),
//!     inputs: vec![InputTensor::from_slice("INPUT0", DataType::Uint32, &[1, 2], &[1u32, 2])],
//!     ..Default::default()
//! };
//! let response = client.infer(&request).await?;
//! assert_eq!(response.outputs[0].values::<u32>(), vec![2, 3]);
//! # Ok(()) }
//! ```

mod grpc;
mod http;
#[cfg(feature = "embedded")]
mod native;
pub mod stream;

pub use grpc::{GrpcClient, InferStream};
pub use http::HttpClient;
pub use kiln_protocol::{
    DataType, InferRequest, InferResponse, InputTensor, OutputTensor, Param, ParamValue,
};
#[cfg(feature = "embedded")]
pub use native::NativeClient;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error status and `{"error": ...}`.
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    /// The request never got an answer (connection, timeout).
    #[error("transport: {0}")]
    Transport(String),
    /// The answer could not be understood.
    #[error("decode: {0}")]
    Decode(String),
    /// The in-process server refused the request.
    #[cfg(feature = "embedded")]
    #[error(transparent)]
    Server(#[from] kiln_core::ServerError),
    /// A gRPC call ended with a status other than OK.
    #[error("gRPC {code:?}: {message}")]
    Grpc { code: tonic::Code, message: String },
    /// The server answered a request on a stream with an error (the stream goes on).
    #[error("stream: request {id:?}: {message}")]
    Stream { id: Option<String>, message: String },
}

impl ClientError {
    /// The HTTP status this error stands for, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            #[cfg(feature = "embedded")]
            ClientError::Server(e) => Some(kiln_server::http::status_code(e).as_u16()),
            _ => None,
        }
    }

    /// The gRPC status code this error stands for, if any.
    pub fn grpc_code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Grpc { code, .. } => Some(*code),
            #[cfg(feature = "embedded")]
            ClientError::Server(e) => Some(kiln_server::grpc::code(e)),
            _ => None,
        }
    }
}
