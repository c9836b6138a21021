//! Triton's `inference.GRPCInferenceService` (KServe v2 plus Triton's extensions):
//! the messages, server trait and client generated from `proto/inference.proto`
//! ([`proto`]), and their conversion to and from kiln's protocol-free types
//! ([`convert`]). No server runs here.

pub mod convert;

/// The protocol's messages, server and client, generated from `proto/inference.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod proto {
    tonic::include_proto!("inference");
}

/// `proto/inference.proto` compiled to a `FileDescriptorSet` (protobuf bytes).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/inference_descriptor.bin"));
