//! KServe v2 over REST, without the transport: the JSON codec ([`json`]), Triton's
//! binary tensor data extension ([`binary`]) and system shared-memory extension
//! ([`shm`]). Bodies in, protocol-free [`crate::InferRequest`]s out, and back.

pub mod binary;
pub mod json;
pub mod shm;

pub use binary::{
    byte_count, decode_request_binary, decode_response_binary, encode_request_binary,
    encode_response_binary, split, BinaryOutputs, Encoded, INFERENCE_HEADER_CONTENT_LENGTH,
};
pub use json::{
    decode_request, decode_request_parts, decode_response, encode_request, encode_response,
    load_params_from_json, params_from_json,
};
pub use shm::{decode_request_shm, encode_response_shm, OutputPlacement, ShmReads};
