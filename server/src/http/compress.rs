//! Compressed inference answers, as Triton gives them: a request whose
//! `Accept-Encoding` takes `gzip` or `deflate` (tritonclient's
//! `response_compression_algorithm`) gets its answer's whole body compressed, with
//! `Content-Encoding` saying how. `Inference-Header-Content-Length` still counts
//! the JSON part of the body before compression, which is what clients split once
//! they have inflated it. Requests without `Accept-Encoding` (perf_analyzer,
//! kiln-load) cost one header lookup.

use actix_web::http::header::{
    AcceptEncoding, ContentEncoding, ContentType, Encoding, Header, ACCEPT_ENCODING,
};
use actix_web::{web, HttpRequest, HttpResponse};
use flate2::write::{GzEncoder, ZlibEncoder};
use flate2::Compression;
use std::io::Write;

use super::binary::Encoded;
use super::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::error::ServerError;

/// Bodies up to this size are compressed on the connection's thread; larger ones
/// on a blocking thread, so a big answer does not hold up the other connections.
const INLINE_LIMIT: usize = 64 * 1024;

/// How an answer's body is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyEncoding {
    Gzip,
    /// HTTP's `deflate`: the zlib format.
    Deflate,
}

/// The compression the request's `Accept-Encoding` prefers among those kiln
/// gives; `None` for an uncompressed answer (no header, identity preferred, or
/// nothing kiln gives is acceptable).
pub(super) fn negotiate(req: &HttpRequest) -> Option<BodyEncoding> {
    req.headers().get(ACCEPT_ENCODING)?;
    let accept = AcceptEncoding::parse(req).ok()?;
    let offered = [Encoding::gzip(), Encoding::deflate(), Encoding::identity()];
    let chosen = accept.negotiate(offered.iter())?;
    if chosen == Encoding::gzip() {
        Some(BodyEncoding::Gzip)
    } else if chosen == Encoding::deflate() {
        Some(BodyEncoding::Deflate)
    } else {
        None
    }
}

/// `body` compressed with `encoding` at zlib's fastest level (1, nginx's default),
/// to keep what an answer costs in CPU low.
pub(super) fn compress(encoding: BodyEncoding, body: &[u8]) -> std::io::Result<Vec<u8>> {
    let out = Vec::with_capacity(body.len() / 2 + 64);
    match encoding {
        BodyEncoding::Gzip => {
            let mut e = GzEncoder::new(out, Compression::fast());
            e.write_all(body)?;
            e.finish()
        }
        BodyEncoding::Deflate => {
            let mut e = ZlibEncoder::new(out, Compression::fast());
            e.write_all(body)?;
            e.finish()
        }
    }
}

/// The answer `encoded` with its body compressed as `encoding`.
pub(super) async fn respond(
    encoded: Encoded,
    encoding: BodyEncoding,
) -> Result<HttpResponse, ServerError> {
    let header_length = encoded.header_length();
    let body = encoded.into_body();
    let failed = |e: &dyn std::fmt::Display| {
        ServerError::Internal(format!("cannot compress the answer: {e}"))
    };
    let compressed = if body.len() <= INLINE_LIMIT {
        compress(encoding, &body)
    } else {
        web::block(move || compress(encoding, &body))
            .await
            .map_err(|e| failed(&e))?
    }
    .map_err(|e| failed(&e))?;
    let mut response = HttpResponse::Ok();
    response.insert_header(match encoding {
        BodyEncoding::Gzip => ContentEncoding::Gzip,
        BodyEncoding::Deflate => ContentEncoding::Deflate,
    });
    match header_length {
        None => response.content_type(ContentType::json()),
        Some(length) => response
            .content_type(ContentType::octet_stream())
            .insert_header((INFERENCE_HEADER_CONTENT_LENGTH, length.to_string())),
    };
    Ok(response.body(compressed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;
    use std::io::Read;

    fn chosen(accept: Option<&str>) -> Option<BodyEncoding> {
        let mut req = TestRequest::default();
        if let Some(accept) = accept {
            req = req.insert_header((ACCEPT_ENCODING, accept));
        }
        negotiate(&req.to_http_request())
    }

    #[test]
    fn accept_encoding_picks_what_the_client_prefers() {
        assert_eq!(chosen(None), None);
        assert_eq!(chosen(Some("gzip")), Some(BodyEncoding::Gzip));
        assert_eq!(chosen(Some("deflate")), Some(BodyEncoding::Deflate));
        assert_eq!(
            chosen(Some("gzip;q=0.2, deflate")),
            Some(BodyEncoding::Deflate)
        );
        assert_eq!(chosen(Some("gzip;q=0, identity")), None);
        assert_eq!(chosen(Some("identity")), None);
        assert_eq!(chosen(Some("br")), None);
        assert_eq!(chosen(Some("")), None);
    }

    #[test]
    fn bodies_inflate_back() {
        let body: Vec<u8> = (0..10_000u32).flat_map(|i| (i % 7).to_le_bytes()).collect();
        let gz = compress(BodyEncoding::Gzip, &body).unwrap();
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, body);
        assert!(gz.len() < body.len() / 4, "{}", gz.len());
        let zlib = compress(BodyEncoding::Deflate, &body).unwrap();
        out.clear();
        flate2::read::ZlibDecoder::new(&zlib[..])
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, body);
    }
}
