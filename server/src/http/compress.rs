//! Compressed inference answers, as Triton gives them: a request whose
//! `Accept-Encoding` takes `gzip` or `deflate` (tritonclient's
//! `response_compression_algorithm`) gets its answer's whole body compressed, with
//! `Content-Encoding` saying how. `Inference-Header-Content-Length` still counts
//! the JSON part of the body before compression, which is what clients split once
//! they have inflated it. Requests without `Accept-Encoding` (perf_analyzer,
//! kiln-load) cost one header lookup.

use actix_web::http::header::{AcceptEncoding, ContentEncoding, Encoding, Header, ACCEPT_ENCODING};
use actix_web::{web, HttpRequest, HttpResponse};
use flate2::{Compress, Compression, Crc, FlushCompress, Status};
use std::cell::RefCell;

use kiln_protocol::http::Encoded;

use super::encoded::EncodedResponse;
use kiln_core::error::ServerError;

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

/// A gzip member's fixed header (RFC 1952): deflate, no flags, no time, unknown OS.
const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];

/// One thread's compressors, kept between answers: a new one allocates and clears
/// some 300 KB of tables, which made a small gzip answer cost 3× a plain one.
struct Compressors {
    /// Raw deflate, inside gzip's framing.
    raw: Compress,
    /// zlib: HTTP's `deflate`.
    zlib: Compress,
}

thread_local! {
    /// Made on a thread's first compressed answer.
    static COMPRESSORS: RefCell<Compressors> = RefCell::new(Compressors {
        raw: Compress::new(Compression::fast(), false),
        zlib: Compress::new(Compression::fast(), true),
    });
}

/// `body` compressed with `encoding` at zlib's fastest level (1, nginx's default),
/// to keep what an answer costs in CPU low.
pub(super) fn compress(encoding: BodyEncoding, body: &[u8]) -> std::io::Result<Vec<u8>> {
    // The gzip header and trailer, and room for the compressed body.
    let mut out = Vec::with_capacity(GZIP_HEADER.len() + 8 + room(body.len()));
    COMPRESSORS.with(|cell| {
        let compressors = &mut *cell.borrow_mut();
        match encoding {
            BodyEncoding::Gzip => {
                out.extend_from_slice(&GZIP_HEADER);
                deflate(&mut compressors.raw, body, &mut out)?;
                let mut crc = Crc::new();
                crc.update(body);
                out.extend_from_slice(&crc.sum().to_le_bytes());
                out.extend_from_slice(&crc.amount().to_le_bytes());
            }
            BodyEncoding::Deflate => deflate(&mut compressors.zlib, body, &mut out)?,
        }
        Ok(out)
    })
}

/// Output space to have free before compressing `input_len` more bytes.
fn room(input_len: usize) -> usize {
    input_len / 2 + 1024
}

/// Appends all of `input`, compressed by `compress` from a fresh start, to `out`.
fn deflate(compress: &mut Compress, mut input: &[u8], out: &mut Vec<u8>) -> std::io::Result<()> {
    compress.reset();
    loop {
        out.reserve(room(input.len()));
        let (before, written) = (compress.total_in(), out.len());
        let status = compress
            .compress_vec(input, out, FlushCompress::Finish)
            .map_err(std::io::Error::other)?;
        let consumed = (compress.total_in() - before) as usize;
        input = &input[consumed..];
        match status {
            Status::StreamEnd => return Ok(()),
            Status::BufError if consumed == 0 && out.len() == written => {
                return Err(std::io::Error::other("the compressor made no progress"))
            }
            _ => {}
        }
    }
}

/// The answer `encoded` with its body compressed as `encoding`.
pub(super) async fn respond(
    encoded: Encoded,
    encoding: BodyEncoding,
) -> Result<HttpResponse, ServerError> {
    let mut response = encoded.response_head();
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
    response.insert_header(match encoding {
        BodyEncoding::Gzip => ContentEncoding::Gzip,
        BodyEncoding::Deflate => ContentEncoding::Deflate,
    });
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

    /// Every body inflates back, with each compressor reused: empty, small,
    /// compressible and incompressible, and one larger than a single output reserve.
    #[test]
    fn bodies_inflate_back() {
        let mut noise = 1u64;
        let incompressible: Vec<u8> = (0..300_000)
            .map(|_| {
                noise = noise
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (noise >> 56) as u8
            })
            .collect();
        let bodies = [
            Vec::new(),
            b"{}".to_vec(),
            (0..10_000u32).flat_map(|i| (i % 7).to_le_bytes()).collect(),
            incompressible,
        ];
        for _ in 0..2 {
            for body in &bodies {
                let gz = compress(BodyEncoding::Gzip, body).unwrap();
                let mut out = Vec::new();
                flate2::read::GzDecoder::new(&gz[..])
                    .read_to_end(&mut out)
                    .unwrap();
                assert_eq!(&out, body);
                let zlib = compress(BodyEncoding::Deflate, body).unwrap();
                out.clear();
                flate2::read::ZlibDecoder::new(&zlib[..])
                    .read_to_end(&mut out)
                    .unwrap();
                assert_eq!(&out, body);
            }
        }
        let repetitive = &bodies[2];
        let gz = compress(BodyEncoding::Gzip, repetitive).unwrap();
        assert!(gz.len() < repetitive.len() / 4, "{}", gz.len());
    }
}
