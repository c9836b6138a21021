//! The service the gRPC server runs: `ModelInfer` answered directly from HTTP/2, every
//! other RPC by the tonic-generated service, and tonic's size-limit status mapped to
//! Triton's.
//!
//! `ModelInfer` is the call a client makes thousands of times a second with small
//! tensors, so it skips tonic's per-call machinery (codec, decode stream, encode
//! stream, the boxed `async_trait` future): the request's one length-prefixed
//! message is read from the body (without a copy when it arrives in one DATA frame,
//! so its `raw_input_contents` stay slices of it), decoded with prost, and the
//! answer is encoded once into a buffer of its exact size and sent as one DATA frame
//! and a `grpc-status: 0` trailer. Anything unusual (a compressed request, another
//! method) goes through the tonic-generated service; the wire format and status
//! codes are the same on both paths.
//!
//! Every call honours the client's `grpc-timeout`: past it the call is dropped and
//! answered `DEADLINE_EXCEEDED`.

use std::convert::Infallible;
use std::future::ready;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use prost::Message;
use tonic::body::Body as TonicBody;
use tonic::codec::CompressionEncoding;
use tonic::codegen::http::{self, header, HeaderMap, HeaderValue};
use tonic::codegen::{BoxFuture, Service, StdError};
use tonic::Status;

use super::connection::{Activity, Call};
use super::gather::Gathered;
use super::message_budget::{Charge, MessageBudget};
use super::proto::grpc_inference_service_server::GrpcInferenceServiceServer;
use super::proto::ModelInferRequest;
use super::service::{KilnGrpc, ModelInferCall};
use super::status::{status, triton_code};
use super::GrpcLimits;
use crate::restricted::{Category, Restrictions};
use kiln_core::error::ServerError;
use kiln_core::observe::trace::Trace;
use kiln_core::server::Server;

/// The path of `ModelInfer`.
const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// The length prefix of a gRPC message: a compression flag, then the length (big-endian).
const PREFIX: usize = 5;

// Big messages are decoded and encoded on the runtime's blocking threads, not on
// the connection's thread, which serves every other call of its connections.
// Measured on the 2-core development machine (release build, prost 0.14, best
// of 20): decoding typed contents (`fp32_contents`) costs about 0.27 µs per KiB
// and turning them into tensor bytes 0.14 µs per KiB (256 KiB: 69 + 36 µs; 1 MiB:
// 273 + 144 µs; 64 MiB: 55 + 38 ms); `raw_input_contents` decode as slices (0.1
// µs at any size); encoding an answer copies its raw outputs (256 KiB: 5 µs,
// 1 MiB: 30 µs, 4 MiB: 283 µs, 64 MiB: 51 ms). A hand-off to a blocking thread and
// back costs some tens of µs, so a message is moved off at the size where the
// work it may take passes about 100 µs.

/// A request message at least this long is decoded and queued on a blocking thread.
const DECODE_OFFLOAD_BYTES: usize = 256 << 10;

/// An answer at least this long is encoded on a blocking thread.
const ENCODE_OFFLOAD_BYTES: usize = 1 << 20;

/// Triton's `GRPCInferenceService`, as [`super::serve`] runs it (see the module
/// documentation).
#[derive(Clone)]
pub struct GrpcRoutes {
    tonic: GrpcInferenceServiceServer<KilnGrpc>,
    server: Server,
    max_message_bytes: usize,
    /// `--grpc-restricted-protocol`; `None` when nothing is restricted.
    restricted: Option<Arc<Restrictions>>,
    /// Bytes held by unfinished messages, server-wide.
    budget: Arc<MessageBudget>,
    /// The calls of the connection this copy serves ([`GrpcRoutes::on_connection`]).
    activity: Option<Arc<Activity>>,
}

impl GrpcRoutes {
    /// The service over `server`, with the message size limit and the budget of
    /// bytes held by unfinished messages of `limits`, and the `restricted` APIs.
    pub fn new(server: Server, limits: &GrpcLimits, restricted: Arc<Restrictions>) -> GrpcRoutes {
        let max_message_bytes = limits.max_message_bytes;
        // Compressed requests (tritonclient's `compression_algorithm`) are read;
        // answers go uncompressed, as Triton's do by default.
        let tonic = GrpcInferenceServiceServer::new(KilnGrpc::new(server.clone()))
            .accept_compressed(CompressionEncoding::Gzip)
            .accept_compressed(CompressionEncoding::Deflate)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes);
        let restricted = Some(restricted).filter(|r| !r.is_empty());
        let budget =
            MessageBudget::within(limits.max_pending_bytes, Arc::clone(server.client_bytes()));
        GrpcRoutes {
            tonic,
            server,
            max_message_bytes,
            restricted,
            budget,
            activity: None,
        }
    }

    /// The copy that serves one connection, counting its calls in `activity`.
    pub(super) fn on_connection(&self, activity: Arc<Activity>) -> GrpcRoutes {
        GrpcRoutes {
            activity: Some(activity),
            ..self.clone()
        }
    }
}

impl hyper::service::Service<http::Request<Incoming>> for GrpcRoutes {
    type Response = http::Response<TonicBody>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    /// Runs on the connection's task (hyper calls it as each request arrives; the
    /// future it returns runs on a task of its own).
    fn call(&self, request: http::Request<Incoming>) -> Self::Future {
        if let Some(refused) = self
            .restricted
            .as_ref()
            .and_then(|r| refusal(r, request.uri().path(), request.headers()))
        {
            return Box::pin(ready(Ok(status(refused).into_http())));
        }
        let deadline = grpc_timeout(request.headers());
        let call = self.activity.as_ref().map(Activity::start);
        let answer: Self::Future =
            if request.uri().path() == MODEL_INFER && !compressed(request.headers()) {
                let trace = Trace::receive(|| super::service::propagated(request.headers()));
                self.model_infer(request.into_body(), call, trace)
            } else {
                // tonic sees each message once it has wholly arrived.
                let (limit, budget) = (self.max_message_bytes, &self.budget);
                let request = request.map(|body| Gathered::new(body, limit, budget));
                let answer = self.tonic.clone().call(request);
                Box::pin(async move {
                    // The call stays open while its answer (a stream, maybe) is sent.
                    let mut response = answer.await?.map(|body| {
                        TonicBody::new(TritonBody {
                            inner: body,
                            _call: call,
                        })
                    });
                    triton_code(response.headers_mut());
                    Ok(response)
                })
            };
        let Some(deadline) = deadline else {
            return answer;
        };
        Box::pin(async move {
            match tokio::time::timeout(deadline, answer).await {
                Ok(response) => response,
                Err(_) => Ok(Status::deadline_exceeded("Timeout expired").into_http()),
            }
        })
    }
}

impl GrpcRoutes {
    /// One `ModelInfer` call: its message read, decoded and queued, then its answer.
    ///
    /// The call is polled once here, on the connection's task. When the whole
    /// message arrived with the headers (the usual case: HTTP/2 hands over a request
    /// once it has read every frame the socket held), that poll queues it, so the
    /// batcher has it before the connection reads its next request, as actix-web's
    /// HTTP/1 path queues it. What is left (a message still on its way, the answer)
    /// runs on the call's own task, whose waker replaces the no-op one.
    fn model_infer(
        &self,
        body: Incoming,
        open: Option<Call>,
        trace: Trace,
    ) -> BoxFuture<http::Response<TonicBody>, Infallible> {
        let (server, limit) = (self.server.clone(), self.max_message_bytes);
        let budget = Arc::clone(&self.budget);
        let mut call: BoxFuture<_, Infallible> = Box::pin(async move {
            let _open = open;
            let pending = match read_message(body, limit, &budget).await {
                Ok(message) if message.len() >= DECODE_OFFLOAD_BYTES => {
                    tokio::task::spawn_blocking(move || start(&server, message, trace))
                        .await
                        .unwrap_or_else(|e| Err(Status::internal(format!("decoding: {e}"))))
                }
                Ok(message) => start(&server, message, trace),
                Err(status) => Err(status),
            };
            Ok(answer(pending, limit).await)
        });
        match call.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(response) => Box::pin(ready(response)),
            Poll::Pending => call,
        }
    }
}

/// The client's deadline from its `grpc-timeout` header: up to 8 digits and a unit
/// (`H`, `M`, `S`, `m`, `u`, `n`). A malformed value is ignored, as tonic ignores it.
fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The refusal for a call to `path` with `headers` under `restrictions`
/// (`--grpc-restricted-protocol`), when its category is restricted and its header
/// is missing or wrong.
fn refusal(restrictions: &Restrictions, path: &str, headers: &HeaderMap) -> Option<ServerError> {
    let restriction = restrictions.get(Category::of_grpc_path(path)?)?;
    let value = headers.get(restriction.lookup_name()).map(|v| v.as_bytes());
    (!restriction.allows(value)).then(|| restriction.refusal())
}

/// `true` when the request says its message is compressed (tonic answers that).
fn compressed(headers: &HeaderMap) -> bool {
    headers
        .get("grpc-encoding")
        .is_some_and(|e| e.as_bytes() != b"identity")
}

/// Decodes a `ModelInfer` request's message and queues it.
fn start(server: &Server, message: Bytes, trace: Trace) -> Result<ModelInferCall, Status> {
    let request = ModelInferRequest::decode(message)
        .map_err(|e| Status::internal(format!("failed to decode Protobuf message: {e}")))?;
    Ok(ModelInferCall::start(server, request, trace))
}

/// The answer to a `ModelInfer` call once its inference is done.
async fn answer(
    pending: Result<ModelInferCall, Status>,
    max_message_bytes: usize,
) -> http::Response<TonicBody> {
    let mut call = None;
    let answered = async {
        let (response, answered) = pending?.finish().await.map_err(status)?;
        call = Some(answered);
        let length = response.encoded_len();
        if length > max_message_bytes {
            return Err(too_large("encoded", length, max_message_bytes));
        }
        let prefix =
            u32::try_from(length).map_err(|_| too_large("encoded", length, max_message_bytes))?;
        let encode = move || {
            let mut framed = BytesMut::with_capacity(PREFIX + length);
            framed.put_u8(0);
            framed.put_u32(prefix);
            response
                .encode(&mut framed)
                .map_err(|e| Status::internal(format!("encoding the answer: {e}")))?;
            Ok(framed.freeze())
        };
        if length >= ENCODE_OFFLOAD_BYTES {
            tokio::task::spawn_blocking(encode)
                .await
                .unwrap_or_else(|e| Err(Status::internal(format!("encoding the answer: {e}"))))
        } else {
            encode()
        }
    };
    let answered = answered.await;
    if let Some(call) = call {
        // Answered by the worker: delivered, or not (too large, not encodable).
        let sent = match &answered {
            Ok(_) => Ok(()),
            Err(refused) => Err(ServerError::Internal(refused.message().to_owned())),
        };
        let _ = call.end(sent);
    }
    match answered {
        Ok(message) => {
            let mut response = http::Response::new(TonicBody::new(OneMessage {
                message: Some(message),
                trailers: true,
            }));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            response
        }
        Err(status) => status.into_http(),
    }
}

/// The body of a successful unary answer: its one message, then `grpc-status: 0`.
/// Its size is not announced (as tonic's bodies do not announce it), so hyper
/// adds no `content-length` header.
struct OneMessage {
    message: Option<Bytes>,
    trailers: bool,
}

impl http_body::Body for OneMessage {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(message) = this.message.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(message))));
        }
        if std::mem::take(&mut this.trailers) {
            let mut trailers = HeaderMap::with_capacity(1);
            trailers.insert(Status::GRPC_STATUS, HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.trailers
    }
}

/// The status Triton answers for a message over the size limit.
fn too_large(what: &str, length: usize, limit: usize) -> Status {
    Status::resource_exhausted(format!(
        "Error, {what} message length too large: found {length} bytes, the limit is: {limit} bytes"
    ))
}

/// The one length-prefixed message of a unary call's body, without its prefix. A
/// body that arrives in one DATA frame (the usual case) is sliced, not copied; a
/// length over `limit` is refused as soon as the prefix is read. A message in
/// several frames is gathered in a buffer that grows with the bytes that arrive,
/// charged to `budget` until it is complete.
async fn read_message<B>(
    body: B,
    limit: usize,
    budget: &Arc<MessageBudget>,
) -> Result<Bytes, Status>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<StdError>,
{
    let mut body = std::pin::pin!(body);
    let mut received = Received::Nothing;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Status::from_error(e.into()))?;
        // Request trailers carry nothing kiln reads.
        if let Ok(data) = frame.into_data() {
            received = received.push(data, limit, budget)?;
        }
    }
    received.message(limit)
}

/// The body received so far.
enum Received {
    Nothing,
    One(Bytes),
    /// Two frames or more, gathered; what the buffer holds is charged.
    Joined(BytesMut, Charge),
}

impl Received {
    /// Adds a DATA frame; an error when the body now holds more than one message,
    /// or when the budget of unfinished messages has no room for it.
    fn push(
        self,
        data: Bytes,
        limit: usize,
        budget: &Arc<MessageBudget>,
    ) -> Result<Received, Status> {
        let received = match self {
            Received::Nothing => Received::One(data),
            Received::One(first) => {
                // Sized by what arrived, not by the length the prefix declares.
                let mut charge = budget.charge();
                let so_far = first.len() + data.len();
                charge.grow_to(so_far)?;
                let mut joined = BytesMut::with_capacity(so_far);
                joined.put(first);
                joined.put(data);
                charge.grow_to(joined.capacity())?;
                Received::Joined(joined, charge)
            }
            Received::Joined(mut joined, mut charge) => {
                charge.grow_to(joined.len() + data.len())?;
                joined.put(data);
                charge.grow_to(joined.capacity())?;
                Received::Joined(joined, charge)
            }
        };
        if received.len() > expected_len(received.bytes(), limit)? {
            return Err(Status::internal("a unary call sent more than one message"));
        }
        Ok(received)
    }

    /// The whole body's one message, without its prefix.
    fn message(self, limit: usize) -> Result<Bytes, Status> {
        let mut message = match self {
            Received::Nothing => return Err(Status::internal("Missing request message.")),
            Received::One(bytes) => bytes,
            Received::Joined(bytes, _charge) => bytes.freeze(),
        };
        if message.len() < expected_len(&message, limit)? {
            return Err(Status::internal("the request message was cut short"));
        }
        if message[0] != 0 {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        message.advance(PREFIX);
        Ok(message)
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Received::Nothing => &[],
            Received::One(b) => b,
            Received::Joined(b, _) => b,
        }
    }

    fn len(&self) -> usize {
        self.bytes().len()
    }
}

/// The length of the prefixed message `buf` starts with, prefix included (at
/// least the prefix while it is incomplete); an error when it exceeds `limit`.
fn expected_len(buf: &[u8], limit: usize) -> Result<usize, Status> {
    let Some(prefix) = buf.get(..PREFIX) else {
        return Ok(PREFIX.max(buf.len()));
    };
    let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if length > limit {
        return Err(too_large("decoded", length, limit));
    }
    Ok(PREFIX + length)
}

fn triton_trailers(frame: http_body::Frame<Bytes>) -> http_body::Frame<Bytes> {
    match frame.into_trailers() {
        Ok(mut trailers) => {
            triton_code(&mut trailers);
            http_body::Frame::trailers(trailers)
        }
        Err(frame) => frame,
    }
}

/// The body of an answer from the tonic-generated service: its trailers mapped by
/// [`triton_trailers`]; the call counts as open until the body is dropped.
struct TritonBody {
    inner: TonicBody,
    _call: Option<Call>,
}

impl http_body::Body for TritonBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        std::pin::Pin::new(&mut self.get_mut().inner)
            .poll_frame(cx)
            .map(|frame| frame.map(|frame| frame.map(triton_trailers)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
