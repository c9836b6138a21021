//! KServe v2 over REST, without the transport: the JSON codec ([`json`]), Triton's
//! binary tensor data extension ([`binary`]) and system shared-memory extension
//! ([`shm`]), put together by [`codec`]'s entry points. Bodies in, protocol-free [`crate::InferRequest`]s out, and back.

pub mod binary;
pub mod codec;
pub mod json;
pub mod shm_tensors;

pub use binary::{byte_count, split, BinaryOutputs, Encoded, INFERENCE_HEADER_CONTENT_LENGTH};
pub use codec::{
    decode_request_binary, decode_request_shm, decode_response_binary, encode_request_binary,
    encode_response_binary, encode_response_shm,
};
pub use json::{
    decode_request, decode_request_parts, decode_response, encode_request, encode_response,
    load_params_from_json, params_from_json, DataJson,
};
pub use shm_tensors::{OutputPlacement, ShmReads};
