//! Reading request bodies, up to `--max-body-bytes` (413 beyond): a control
//! request's raw body or optional JSON object, an inference request's body
//! (decompressed first when it says `Content-Encoding: gzip` or `deflate`).

use actix_web::{web, HttpRequest};
use bytes::Bytes;
use serde_json::{Map, Value};

use super::HttpError;
use crate::error::ServerError;

/// Reads a control request's whole body (not compressed), up to `limit` bytes.
pub(super) async fn read_raw_body(payload: web::Payload, limit: usize) -> Result<Bytes, HttpError> {
    match payload.to_bytes_limited(limit).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(e)) => Err(HttpError(ServerError::invalid(format!(
            "cannot read the request body: {e}"
        )))),
        Err(_) => Err(HttpError(ServerError::TooLarge(format!(
            "request body exceeds the limit of {limit} bytes"
        )))),
    }
}

/// Reads an inference request's whole body, up to `limit` bytes (413 beyond). A body sent with
/// `Content-Encoding: gzip` or `deflate` (tritonclient's request compression) is
/// decoded first, and the limit applies to what it decodes to.
pub(super) async fn read_body(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
) -> Result<Bytes, HttpError> {
    let encoding = req
        .headers()
        .get(actix_web::http::header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let too_large = || {
        HttpError(ServerError::TooLarge(format!(
            "request body exceeds the limit of {limit} bytes"
        )))
    };
    let unreadable = |e: &dyn std::fmt::Display| {
        HttpError(ServerError::invalid(format!(
            "cannot read the request body: {e}"
        )))
    };
    match encoding.as_deref() {
        None | Some("identity") => read_raw_body(payload, limit).await,
        Some("gzip" | "x-gzip" | "deflate") => {
            let mut stream =
                actix_web::dev::Decompress::from_headers(payload.into_inner(), req.headers());
            let mut body = bytes::BytesMut::new();
            while let Some(chunk) = std::future::poll_fn(|cx| {
                futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
            })
            .await
            {
                let chunk = chunk.map_err(|e| unreadable(&e))?;
                if body.len() + chunk.len() > limit {
                    return Err(too_large());
                }
                body.extend_from_slice(&chunk);
            }
            Ok(body.freeze())
        }
        Some(other) => Err(HttpError(ServerError::invalid(format!(
            "Content-Encoding `{other}` is not supported (gzip, deflate or identity)"
        )))),
    }
}

/// Reads an optional JSON object body.
pub(super) async fn json_object(
    payload: web::Payload,
    limit: usize,
) -> Result<Map<String, Value>, HttpError> {
    let body = read_raw_body(payload, limit).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    serde_json::from_slice(&body).map_err(|e| {
        HttpError(ServerError::invalid(format!(
            "the request body must be a JSON object: {e}"
        )))
    })
}
