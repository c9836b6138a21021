//! kiln-protocol: the KServe v2 protocol (with Triton's extensions) as codecs,
//! with no transport and no server inside.
//!
//! - [`http`]: KServe v2 JSON, the binary tensor data extension and the system
//!   shared-memory extension, body bytes to a protocol-free [`InferRequest`] and
//!   an [`InferResponse`] back to body bytes (both directions, for servers and
//!   clients).
//! - [`grpc`]: the messages, service and client generated from
//!   `proto/inference.proto`, and their conversion to and from the same types.
//!
//! Both are cargo features (on by default); without them the crate is the data
//! model, [`ProtocolError`] and the shared-memory traits, which kiln-core uses.
//!
//! Tensor data stays zero-copy where the protocol allows: binary tensors and raw
//! gRPC contents are slices of the received body or message. Shared-memory
//! regions belong to whoever serves; the codecs reach them through
//! [`shm_regions::ShmRegions`].

pub mod error;
#[cfg(feature = "grpc")]
pub mod grpc;
#[cfg(feature = "http")]
pub mod http;
pub mod infer;
pub mod params;
pub mod shm_regions;

pub use error::ProtocolError;
pub use infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
pub use kiln_types::{DataType, Param, ParamValue};
