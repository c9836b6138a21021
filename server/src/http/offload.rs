//! Big work off the HTTP I/O threads. An actix-web worker thread serves many
//! connections; while it parses a large JSON body, copies a large shared-memory
//! input or writes a large JSON answer, every other connection of that thread
//! waits. Work above [`INLINE_JSON_BYTES`] or [`INLINE_COPY_BYTES`] runs on
//! actix's blocking pool instead; the usual small request does its work where it
//! is, with no extra hop.

use actix_web::web;
use bytes::Bytes;

use kiln_protocol::http::{decode_request_parts, encode_response_shm, split, Encoded};

use super::OutputPlacement;
use kiln_core::error::{Result, ServerError};
use kiln_core::request::infer::{InferRequest, InferResponse};
use kiln_core::server::Server;

// Measured with `cargo run --release -p kiln-server --example decode_cost` on the
// development machine (2 shared cores), medians:
//
// | tensor (FP32) | JSON body | decode      | encode      | shared-memory copy |
// |---------------|-----------|-------------|-------------|--------------------|
// | 4 KiB         | 10 KiB    | 21 µs       | 12 µs       | 0.4 µs             |
// | 16 KiB        | 43 KiB    | 85 µs       | 49 µs       | 0.7 µs             |
// | 64 KiB        | 184 KiB   | 0.34-0.8 ms | 0.19 ms     | 3.5 µs             |
// | 256 KiB       | 760 KiB   | 1.4-2.6 ms  | 0.78 ms     | 13 µs              |
// | 1 MiB         | 3.2 MiB   | 8-10 ms     | 3-4 ms      | 79 µs              |
// | 4 MiB         | 13 MiB    | 40-60 ms    | 20-50 ms    | 580 µs             |
//
// JSON decodes at about 500 MB/s of body and encodes at about 330 MB/s of tensor;
// `pread` copies at about 13 GB/s. The hop to the blocking pool and back costs
// 2.4 µs when a pool thread is idle (more when one must be woken or started).
// Each bound is where the work is some 50 times the hop: below it a request holds
// its thread's other connections for at most ~0.1 ms, above it the hop adds at
// most ~2% to the request.

/// Bytes of JSON parsed or written on the connection's thread (64 KiB: ~120 µs of
/// decoding, ~190 µs of encoding); beyond, on a blocking thread.
pub(super) const INLINE_JSON_BYTES: usize = 64 * 1024;

/// Bytes copied from or into shared memory on the connection's thread (1 MiB:
/// ~80 µs); beyond, on a blocking thread.
pub(super) const INLINE_COPY_BYTES: usize = 1 << 20;

/// Runs `work` on a blocking thread.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    web::block(work)
        .await
        .map_err(|e| ServerError::Internal(format!("a blocking task failed: {e}")))
}

/// Decodes an inference request for `model` (as [`super::decode_request_shm`]),
/// on a blocking thread when its JSON is larger than [`INLINE_JSON_BYTES`] or its
/// shared-memory inputs larger than [`INLINE_COPY_BYTES`].
pub(super) async fn decode_request(
    server: &Server,
    model: &str,
    body: Bytes,
    header: Option<&[u8]>,
) -> Result<(InferRequest, OutputPlacement)> {
    let (json, binary) = split(body, header)?;
    if json.len() > INLINE_JSON_BYTES {
        let (server, model) = (server.clone(), model.to_owned());
        return blocking(move || {
            let shm = Some(server.shared_memory());
            let (mut request, placement, reads) = decode_request_parts(&model, &json, binary, shm)?;
            reads.read_into(&mut request)?;
            Ok::<_, ServerError>((request, placement))
        })
        .await?;
    }
    let (mut request, placement, reads) =
        decode_request_parts(model, &json, binary, Some(server.shared_memory()))?;
    if reads.bytes() > INLINE_COPY_BYTES {
        return blocking(move || {
            reads.read_into(&mut request)?;
            Ok::<_, ServerError>((request, placement))
        })
        .await?;
    }
    reads.read_into(&mut request)?;
    Ok((request, placement))
}

/// Writes the outputs placed in shared memory and encodes the answer (as
/// [`encode_response_shm`]), on a blocking thread when the outputs to write as JSON
/// are larger than [`INLINE_JSON_BYTES`] or those to write into shared memory
/// larger than [`INLINE_COPY_BYTES`].
pub(super) async fn encode_response(
    response: InferResponse,
    placement: OutputPlacement,
) -> Result<Encoded> {
    let (json, copy) = placement.encoding_work(&response);
    if json > INLINE_JSON_BYTES || copy > INLINE_COPY_BYTES {
        return Ok(blocking(move || encode_response_shm(&response, &placement)).await??);
    }
    Ok(encode_response_shm(&response, &placement)?)
}
