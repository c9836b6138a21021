//! Reading request bodies, up to `--max-body-bytes` (413 beyond): a control
//! request's raw body or optional JSON object, an inference request's body
//! (decompressed first when it says `Content-Encoding: gzip` or `deflate`), its
//! bytes reserved from the server-wide budget of bytes held for clients.

use std::sync::Arc;

use actix_web::http::header;
use actix_web::{web, HttpRequest};
use bytes::{Bytes, BytesMut};
use kiln_core::memory::client_bytes::{ClientBytes, Reservation, Use};
use serde_json::{Map, Value};

use super::{HttpError, State};
use kiln_core::error::ServerError;

/// Reads a control request's whole body (not compressed), up to
/// `--max-body-bytes` (413 beyond), its bytes reserved from the client-bytes
/// budget as they come (429 when it has no room).
pub(super) async fn read_raw_body(payload: web::Payload, state: &State) -> Result<Body, HttpError> {
    let mut held = state.server.client_bytes().empty(Use::Body);
    let bytes = gather(payload.into_inner(), state.max_body_bytes, &mut held).await?;
    Ok(Body { bytes, held })
}

/// An inference request's body, and its bytes in the server-wide budget of bytes
/// held for clients (`--max-client-bytes`, `Use::Body`): keep it as long as the
/// body (or the request decoded from it, which may point into it) lives.
pub(super) struct Body {
    pub bytes: Bytes,
    pub held: Reservation,
}

/// Reads an inference request's whole body, up to `limit` bytes (413 beyond). A body sent with
/// `Content-Encoding: gzip` or `deflate` (tritonclient's request compression) is
/// decoded first, and the limit applies to what it decodes to.
///
/// The bytes are reserved from `budget` as they arrive, before they are kept (429
/// at once when it has no room): one atomic add per chunk (a small body is one
/// chunk) and one subtract when dropped. Not the declared `Content-Length` up front:
/// a client could then hold the budget with headers alone and no bytes sent.
pub(super) async fn read_body(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
    budget: &Arc<ClientBytes>,
) -> Result<Body, HttpError> {
    let headers = req.headers();
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let mut held = budget.empty(Use::Body);
    match encoding.as_deref() {
        None | Some("identity") => {
            let declared = headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
            if let Some(declared) = declared {
                if declared > limit {
                    return Err(too_large(limit));
                }
            }
            let bytes = gather(payload.into_inner(), limit, &mut held).await?;
            Ok(Body { bytes, held })
        }
        Some("gzip" | "x-gzip" | "deflate") => {
            let stream = actix_web::dev::Decompress::from_headers(payload.into_inner(), headers);
            let bytes = gather(stream, limit, &mut held).await?;
            Ok(Body { bytes, held })
        }
        Some(other) => Err(HttpError(ServerError::invalid(format!(
            "Content-Encoding `{other}` is not supported (gzip, deflate or identity)"
        )))),
    }
}

/// Gathers `stream`'s chunks, at most `limit` bytes, each reserved in `held`
/// before it is kept. A body that comes in one chunk is kept as it came (no copy;
/// actix's `to_bytes_limited` copied every body); one in several is gathered into
/// one buffer that grows with what arrived (never sized by what is declared).
async fn gather<S, E>(
    mut stream: S,
    limit: usize,
    held: &mut Reservation,
) -> Result<Bytes, HttpError>
where
    S: futures_core::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut first: Option<Bytes> = None;
    let mut rest = BytesMut::new();
    while let Some(chunk) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut stream).poll_next(cx)).await
    {
        let chunk = chunk.map_err(|e| {
            HttpError(ServerError::invalid(format!(
                "cannot read the request body: {e}"
            )))
        })?;
        let len = first.as_ref().map_or(0, Bytes::len) + rest.len() + chunk.len();
        if len > limit {
            return Err(too_large(limit));
        }
        held.grow_to(len).map_err(ServerError::from)?;
        match first.take() {
            None if rest.is_empty() => first = Some(chunk),
            first => {
                if let Some(first) = first {
                    rest.reserve(len);
                    rest.extend_from_slice(&first);
                }
                rest.extend_from_slice(&chunk);
            }
        }
    }
    Ok(first.unwrap_or_else(|| rest.freeze()))
}

fn too_large(limit: usize) -> HttpError {
    HttpError(ServerError::TooLarge(format!(
        "request body exceeds the limit of {limit} bytes"
    )))
}

/// Reads an optional JSON object body.
pub(super) async fn json_object(
    payload: web::Payload,
    state: &State,
) -> Result<Map<String, Value>, HttpError> {
    // The body stays reserved while it is parsed, then goes.
    let Body {
        bytes: body,
        held: _held,
    } = read_raw_body(payload, state).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    serde_json::from_slice(&body).map_err(|e| {
        HttpError(ServerError::invalid(format!(
            "the request body must be a JSON object: {e}"
        )))
    })
}
