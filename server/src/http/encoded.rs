//! The HTTP answer of an [`Encoded`] message (kiln-protocol's codecs' output):
//! its head, and its body sent from the message's own buffers.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use actix_web::http::header::ContentType;
use actix_web::{HttpResponse, HttpResponseBuilder};
use bytes::Bytes;
use kiln_protocol::http::{Encoded, INFERENCE_HEADER_CONTENT_LENGTH};

/// An [`Encoded`] message as an actix-web answer.
pub(super) trait EncodedResponse {
    /// The HTTP answer's head: JSON only as `application/json`; otherwise
    /// `application/octet-stream` with the header.
    fn response_head(&self) -> HttpResponseBuilder;

    /// The HTTP answer ([`EncodedResponse::response_head`]), the tensors sent from
    /// the response's own buffers.
    fn into_response(self) -> HttpResponse;
}

impl EncodedResponse for Encoded {
    fn response_head(&self) -> HttpResponseBuilder {
        let mut head = HttpResponse::Ok();
        match self.header_length() {
            None => head.content_type(ContentType::json()),
            Some(length) => head
                .content_type(ContentType::octet_stream())
                .insert_header((INFERENCE_HEADER_CONTENT_LENGTH, length.to_string())),
        };
        head
    }

    fn into_response(self) -> HttpResponse {
        let mut head = self.response_head();
        if self.binary.is_empty() {
            return head.body(self.json);
        }
        let size = self.body_len() as u64;
        let mut chunks = Vec::with_capacity(self.binary.len() + 1);
        chunks.push(Bytes::from(self.json));
        chunks.extend(self.binary.into_iter().filter(|c| !c.is_empty()));
        head.body(ChunkBody {
            chunks: chunks.into_iter(),
            size,
        })
    }
}

/// A body of known size sent as a series of `Bytes`.
struct ChunkBody {
    chunks: std::vec::IntoIter<Bytes>,
    size: u64,
}

impl MessageBody for ChunkBody {
    type Error = std::convert::Infallible;

    fn size(&self) -> BodySize {
        BodySize::Sized(self.size)
    }

    fn poll_next(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Poll::Ready(self.get_mut().chunks.next().map(Ok))
    }
}
