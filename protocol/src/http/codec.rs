//! The entry points of the REST codec with Triton's extensions: KServe v2 JSON with
//! binary tensor data (`*_binary`) and with system shared memory (`*_shm`). Each
//! splits a body and puts [`json`](super::json)'s parts together with the
//! extension's, so [`json`](super::json), [`binary`](super::binary) and
//! [`shm`](super::shm) need not import each other.

use bytes::Bytes;

use super::binary::{split, BinaryOutputs, Encoded};
use super::json::{
    decode_request_parts, decode_response_parts, encode_request_parts, encode_response_parts,
};
use super::shm_tensors::OutputPlacement;
use crate::error::Result;
use crate::infer::{InferRequest, InferResponse};
use crate::shm_regions::{NoSharedMemory, ShmRegions, ShmWindow};

/// Decodes an inference request for `model`, JSON or with binary tensors (`header`:
/// the value of `Inference-Header-Content-Length`, if sent). Binary inputs are
/// slices of `body`. Also returns which outputs the client wants binary.
pub fn decode_request_binary(
    model: &str,
    body: Bytes,
    header: Option<&[u8]>,
) -> Result<(InferRequest, BinaryOutputs)> {
    let (json, binary) = split(body, header)?;
    decode_request_parts(model, &json, binary, None::<&NoSharedMemory>)
        .map(|(request, placement, _)| (request, placement.binary))
}

/// Encodes a request with every input as binary tensor data, asking for every
/// output as binary (what `HttpClient::infer_binary` sends).
pub fn encode_request_binary(request: &InferRequest) -> Encoded {
    encode_request_parts(request, true)
}

/// Encodes a response, the outputs `binary` names as binary tensor data.
pub fn encode_response_binary(response: &InferResponse, binary: &BinaryOutputs) -> Encoded {
    encode_response_parts(response, binary, &[])
}

/// Decodes a response, JSON or with binary tensors (`header`: the value of
/// `Inference-Header-Content-Length`, if sent). Binary outputs are slices of `body`.
pub fn decode_response_binary(body: Bytes, header: Option<&[u8]>) -> Result<InferResponse> {
    let (json, binary) = split(body, header)?;
    decode_response_parts(&json, binary)
}

/// Decodes an inference request for `model` (JSON, or with binary tensors after
/// `header` bytes of JSON), reading shared-memory inputs from `shm`; also returns
/// where each output goes.
pub fn decode_request_shm<R: ShmRegions>(
    model: &str,
    body: Bytes,
    header: Option<&[u8]>,
    shm: &R,
) -> Result<(InferRequest, OutputPlacement<R::Window>)> {
    let (json, binary) = split(body, header)?;
    let (mut request, placement, reads) = decode_request_parts(model, &json, binary, Some(shm))?;
    reads.read_into(&mut request)?;
    Ok((request, placement))
}

/// Writes the outputs `placement` puts in shared memory, then encodes the response
/// (those outputs without data, the binary ones as binary tensor data). An output
/// larger than its window is an [`ProtocolError::InvalidRequest`].
pub fn encode_response_shm<W: ShmWindow>(
    response: &InferResponse,
    placement: &OutputPlacement<W>,
) -> Result<Encoded> {
    let in_shm = placement.write_outputs(response)?;
    Ok(encode_response_parts(response, &placement.binary, &in_shm))
}
