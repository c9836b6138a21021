//! gRPC calls over one HTTP/2 connection (prior knowledge, as gRPC clients
//! connect), written for the load generator: each call sends the same request,
//! encoded once, and waits for its answer before the next.
//!
//! Unary (`ModelInfer`): per call one HEADERS frame (its fields indexed in the
//! server's HPACK table after the first call, as gRPC clients do) and the
//! length-prefixed message in DATA frames, in one vectored write when flow control
//! allows; then frames are read until the call's stream ends, and `:status` and
//! `grpc-status` are checked. Streaming (`ModelStreamInfer`): one stream stays
//! open; per call the message goes out in DATA frames and frames are read until one
//! answer message is complete; an answer whose `error_message` (its first field)
//! is set is an error. Answers are counted, not decoded (the HTTP path does not
//! parse its JSON either). Every header block goes through the HPACK decoder, to
//! keep its table in step. Settings, PING, WINDOW_UPDATE (both ways), RST_STREAM and
//! GOAWAY are handled; no TLS, no compression, one call at a time.

use std::io::IoSlice;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::frames::{
    data_payload, frame_header, header_fragment, Answers, ACK, CONTINUATION, DATA, END_HEADERS,
    END_STREAM, GOAWAY, HEADERS, MAX_FRAME, PING, PUSH_PROMISE, RST_STREAM, SETTINGS,
    WINDOW_UPDATE,
};
use super::{hpack, io};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The receive windows the client announces, as tonic's client (hyper) does.
const STREAM_WINDOW: u32 = 2 << 20;
const CONNECTION_WINDOW: u32 = 5 << 20;
/// Every window until the peer's settings say otherwise.
const DEFAULT_WINDOW: i64 = 65_535;
/// What the client's four indexed request fields take in the server's HPACK table
/// (RFC 7541 section 4.1), with room for a longer authority.
const INDEXED_FIELDS_SIZE: usize = 512;

/// One connection, one call at a time.
pub struct Grpc {
    socket: TcpStream,
    read: BytesMut,
    hpack: hpack::Decoder,
    path: Vec<u8>,
    authority: Vec<u8>,
    /// The request: the gRPC length prefix, then the protobuf message.
    message: Bytes,
    next_stream: u32,
    /// Whether the request's fields are in the server's HPACK table.
    indexed: bool,
    /// Whether the server's table may hold them.
    may_index: bool,
    /// A table size update (to 0) owed to the server before the next header block.
    table_update: bool,
    /// The server's settings.
    max_frame: usize,
    initial_window: i64,
    settings_seen: bool,
    /// What the server lets the client send on the connection.
    send_window: i64,
    /// Received DATA not yet handed back to the server's connection window.
    received: u32,
    /// Frame headers and header block of the call being sent.
    out: Vec<u8>,
    /// Streaming: the open `ModelStreamInfer` stream (none before the first call).
    streaming: bool,
    stream: Option<Call>,
}

/// The call in flight.
struct Call {
    id: u32,
    /// What the server lets the client send on this stream.
    window: i64,
    /// Received DATA not yet handed back to the stream's window.
    received: u32,
    /// A header block waiting for its CONTINUATION frames, and its END_STREAM flag.
    block: Option<(Vec<u8>, bool)>,
    headers_seen: bool,
    outcome: Option<Result<(), String>>,
    ended: bool,
    /// Streaming: the answer messages, as they arrive.
    answers: Option<Answers>,
}

/// What a header block said.
#[derive(Default)]
struct Fields {
    status: Option<u16>,
    grpc_status: Option<Vec<u8>>,
}

impl Grpc {
    /// Connects to `url` (`http://HOST:PORT` or `HOST:PORT`), exchanges settings,
    /// and prepares calls of `path` carrying `message` (an encoded protobuf): each a
    /// unary call, or with `streaming` one message on a stream kept open.
    pub async fn connect(
        url: &str,
        path: &str,
        message: &[u8],
        streaming: bool,
    ) -> Result<Grpc, String> {
        let authority = url
            .strip_prefix("http://")
            .unwrap_or(url)
            .trim_end_matches('/')
            .to_owned();
        if authority.is_empty() || authority.contains('/') || url.starts_with("https://") {
            return Err(format!("--grpc-url `{url}`: expected http://HOST:PORT"));
        }
        let socket = TcpStream::connect(&authority)
            .await
            .map_err(|e| format!("connect {authority}: {e}"))?;
        socket.set_nodelay(true).map_err(|e| e.to_string())?;
        let mut framed = Vec::with_capacity(5 + message.len());
        framed.push(0); // not compressed
        framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
        framed.extend_from_slice(message);
        let mut client = Grpc {
            socket,
            read: BytesMut::with_capacity(2 * MAX_FRAME),
            hpack: hpack::Decoder::default(),
            path: path.as_bytes().to_vec(),
            authority: authority.into_bytes(),
            message: Bytes::from(framed),
            next_stream: 1,
            indexed: false,
            may_index: true,
            table_update: false,
            max_frame: MAX_FRAME,
            initial_window: DEFAULT_WINDOW,
            settings_seen: false,
            send_window: DEFAULT_WINDOW,
            received: 0,
            out: Vec::with_capacity(256),
            streaming,
            stream: None,
        };
        let mut hello = PREFACE.to_vec();
        let settings: [(u16, u32); 2] = [(0x2, 0), (0x4, STREAM_WINDOW)]; // no push; window
        frame_header(&mut hello, settings.len() * 6, SETTINGS, 0, 0);
        for (id, value) in settings {
            hello.extend_from_slice(&id.to_be_bytes());
            hello.extend_from_slice(&value.to_be_bytes());
        }
        frame_header(&mut hello, 4, WINDOW_UPDATE, 0, 0);
        hello.extend_from_slice(&(CONNECTION_WINDOW - DEFAULT_WINDOW as u32).to_be_bytes());
        client.write(&hello).await?;
        // The server's settings (windows, frame size) before the first call.
        while !client.settings_seen {
            let (kind, flags, stream, payload) = client.next_frame().await?;
            client.frame(kind, flags, stream, payload, None).await?;
        }
        Ok(client)
    }

    /// One call: `Ok` when the server answered it without an error.
    pub async fn call(&mut self) -> Result<(), String> {
        if self.streaming {
            return self.stream_call().await;
        }
        let mut call = self.new_call(false)?;
        self.send(&mut call, true, true).await?;
        while !call.ended {
            let (kind, flags, stream, payload) = self.next_frame().await?;
            self.frame(kind, flags, stream, payload, Some(&mut call))
                .await?;
        }
        call.outcome
            .unwrap_or_else(|| Err("the call ended without a status".into()))
    }

    /// One message on the open stream (opened by the first call), and its answer.
    async fn stream_call(&mut self) -> Result<(), String> {
        let (mut call, opening) = match self.stream.take() {
            Some(call) if !call.ended => (call, false),
            Some(_) => return Err("the stream has ended".into()),
            None => (self.new_call(true)?, true),
        };
        let result = async {
            self.send(&mut call, opening, false).await?;
            loop {
                if let Some(answers) = call.answers.as_mut() {
                    if !answers.done.is_empty() {
                        return answers.done.remove(0);
                    }
                }
                if call.ended {
                    return Err(call
                        .outcome
                        .clone()
                        .and_then(Result::err)
                        .unwrap_or_else(|| "the server ended the stream".into()));
                }
                let (kind, flags, stream, payload) = self.next_frame().await?;
                self.frame(kind, flags, stream, payload, Some(&mut call))
                    .await?;
            }
        }
        .await;
        self.stream = Some(call);
        result
    }

    /// A new stream.
    fn new_call(&mut self, streaming: bool) -> Result<Call, String> {
        let id = self.next_stream;
        if id > i32::MAX as u32 {
            return Err("stream ids used up on this connection".into());
        }
        self.next_stream += 2;
        Ok(Call {
            id,
            window: self.initial_window,
            received: 0,
            block: None,
            headers_seen: false,
            outcome: None,
            ended: false,
            answers: streaming.then(Answers::default),
        })
    }

    /// Sends the message on `call`'s stream (after a HEADERS frame when `headers`;
    /// the last DATA frame ending the stream when `end_stream`), in DATA frames as
    /// far as flow control allows, reading frames while it does not.
    async fn send(
        &mut self,
        call: &mut Call,
        headers: bool,
        end_stream: bool,
    ) -> Result<(), String> {
        let id = call.id;
        self.out.clear();
        if headers {
            let block = self.header_block();
            frame_header(&mut self.out, block.len(), HEADERS, END_HEADERS, id);
            self.out.extend_from_slice(&block);
        }
        // The frame headers are in `out`, the message is written from its own buffer.
        let mut sent = 0;
        let mut first = true;
        while sent < self.message.len() {
            if call.ended {
                // Answered before the request was all sent (a refusal): close our side.
                let mut reset = Vec::with_capacity(13);
                frame_header(&mut reset, 4, RST_STREAM, 0, id);
                reset.extend_from_slice(&0x8u32.to_be_bytes()); // CANCEL
                return self.write(&reset).await;
            }
            let mut budget = self.send_window.min(call.window).max(0) as usize;
            if budget == 0 && !(first && headers) {
                let (kind, flags, stream, payload) = self.next_frame().await?;
                self.frame(kind, flags, stream, payload, Some(&mut *call))
                    .await?;
                continue;
            }
            // Each piece: (in `out`, else in the message; start; end).
            let mut pieces: Vec<(bool, usize, usize)> = Vec::with_capacity(4);
            if first && headers {
                pieces.push((true, 0, self.out.len()));
            } else {
                self.out.clear();
            }
            while sent < self.message.len() && budget > 0 {
                let n = (self.message.len() - sent).min(budget).min(self.max_frame);
                let last = sent + n == self.message.len();
                let flags = if last && end_stream { END_STREAM } else { 0 };
                let at = self.out.len();
                frame_header(&mut self.out, n, DATA, flags, id);
                pieces.push((true, at, self.out.len()));
                pieces.push((false, sent, sent + n));
                self.send_window -= n as i64;
                call.window -= n as i64;
                sent += n;
                budget -= n;
            }
            first = false;
            let mut slices: Vec<IoSlice<'_>> = pieces
                .iter()
                .map(|&(head, a, b)| {
                    IoSlice::new(if head {
                        &self.out[a..b]
                    } else {
                        &self.message[a..b]
                    })
                })
                .collect();
            io::write_all(&mut self.socket, &mut slices).await?;
        }
        Ok(())
    }

    /// The request's header block: the first time literal fields that the server
    /// adds to its table, then references to them.
    fn header_block(&mut self) -> Vec<u8> {
        let mut b = Vec::with_capacity(96);
        if self.table_update {
            b.push(0x20); // dynamic table size 0
            self.table_update = false;
        }
        b.push(0x83); // :method POST
        b.push(0x86); // :scheme http
        if self.indexed {
            // :path, :authority, content-type, te: the entries the first call added
            // to the server's table (62 is the newest).
            b.extend_from_slice(&[0x80 | 65, 0x80 | 64, 0x80 | 63, 0x80 | 62]);
            return b;
        }
        // With incremental indexing (0x40) when the server's table may hold them,
        // else without indexing (0x00).
        let (with_index, name_bits) = if self.may_index {
            (0x40u8, 6)
        } else {
            (0x00u8, 4)
        };
        let field = |b: &mut Vec<u8>, name_index: usize, name: &[u8], value: &[u8]| {
            hpack::write_integer(b, name_index, name_bits, with_index);
            if name_index == 0 {
                hpack::write_integer(b, name.len(), 7, 0);
                b.extend_from_slice(name);
            }
            hpack::write_integer(b, value.len(), 7, 0);
            b.extend_from_slice(value);
        };
        field(&mut b, 4, b":path", &self.path);
        field(&mut b, 1, b":authority", &self.authority);
        field(&mut b, 31, b"content-type", b"application/grpc");
        field(&mut b, 0, b"te", b"trailers");
        self.indexed = self.may_index;
        b
    }

    /// Handles one frame; `call` is the call in flight, if any.
    async fn frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Bytes,
        mut call: Option<&mut Call>,
    ) -> Result<(), String> {
        let ours = call.as_ref().is_some_and(|c| c.id == stream && !c.ended);
        match kind {
            DATA => {
                let n = payload.len() as u32;
                self.received += n;
                if self.received >= CONNECTION_WINDOW / 2 {
                    self.window_update(0, self.received).await?;
                    self.received = 0;
                }
                if let (true, Some(call)) = (ours, call.as_deref_mut()) {
                    call.received += n;
                    if let Some(answers) = call.answers.as_mut() {
                        answers.take(data_payload(&payload, flags)?);
                    }
                    if flags & END_STREAM != 0 {
                        call.finish(Err("the answer ended without trailers".into()));
                    } else if call.received >= STREAM_WINDOW / 2 {
                        let (id, n) = (call.id, call.received);
                        call.received = 0;
                        self.window_update(id, n).await?;
                    }
                }
            }
            HEADERS | CONTINUATION => {
                let fragment = if kind == HEADERS {
                    header_fragment(&payload, flags)?
                } else {
                    &payload[..]
                };
                let pending = call
                    .as_deref_mut()
                    .and_then(|c| (c.id == stream).then(|| c.block.take()).flatten());
                let (mut block, end_stream) = match (kind, pending) {
                    (HEADERS, None) => (Vec::new(), flags & END_STREAM != 0),
                    (CONTINUATION, Some(pending)) => pending,
                    _ => return Err("HTTP/2: unexpected CONTINUATION or HEADERS".into()),
                };
                block.extend_from_slice(fragment);
                if flags & END_HEADERS == 0 {
                    match call.as_deref_mut() {
                        Some(c) if c.id == stream => c.block = Some((block, end_stream)),
                        _ => return Err("HTTP/2: header block on another stream".into()),
                    }
                    return Ok(());
                }
                // Every block goes through the decoder, to keep its table in step.
                let mut fields = Fields::default();
                self.hpack
                    .decode(&block, |name, value| match name {
                        b":status" => {
                            fields.status =
                                std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
                        }
                        b"grpc-status" => fields.grpc_status = Some(value.to_vec()),
                        _ => {}
                    })
                    .map_err(|e| e.to_string())?;
                if let (true, Some(call)) = (ours, call) {
                    call.headers(fields, end_stream);
                }
            }
            RST_STREAM => {
                if let (true, Some(call)) = (ours, call) {
                    let code = payload
                        .get(..4)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    call.finish(Err(format!("stream reset by the server (error {code})")));
                }
            }
            SETTINGS if flags & ACK == 0 => {
                if payload.len() % 6 != 0 {
                    return Err("HTTP/2: malformed SETTINGS".into());
                }
                for setting in payload.chunks_exact(6) {
                    let id = u16::from_be_bytes([setting[0], setting[1]]);
                    let value =
                        u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
                    match id {
                        0x1 if (value as usize) < INDEXED_FIELDS_SIZE => {
                            // The server's table cannot hold the request's fields.
                            self.may_index = false;
                            if self.indexed {
                                self.indexed = false;
                                self.table_update = true;
                            }
                        }
                        0x4 => {
                            let delta = i64::from(value) - self.initial_window;
                            self.initial_window = i64::from(value);
                            if let Some(call) = call.as_deref_mut() {
                                call.window += delta;
                            }
                        }
                        0x5 => self.max_frame = (value as usize).clamp(MAX_FRAME, 1 << 24),
                        _ => {}
                    }
                }
                self.settings_seen = true;
                let mut ack = Vec::with_capacity(9);
                frame_header(&mut ack, 0, SETTINGS, ACK, 0);
                self.write(&ack).await?;
            }
            PING if flags & ACK == 0 => {
                let mut pong = Vec::with_capacity(17);
                frame_header(&mut pong, payload.len(), PING, ACK, 0);
                pong.extend_from_slice(&payload);
                self.write(&pong).await?;
            }
            GOAWAY => {
                let code = payload
                    .get(4..8)
                    .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                return Err(format!(
                    "the server closed the connection (GOAWAY, error {code})"
                ));
            }
            WINDOW_UPDATE => {
                let increment = payload
                    .get(..4)
                    .map_or(0, |c| u32::from_be_bytes([c[0] & 0x7f, c[1], c[2], c[3]]));
                if stream == 0 {
                    self.send_window += i64::from(increment);
                } else if let (true, Some(call)) = (ours, call) {
                    call.window += i64::from(increment);
                }
            }
            PUSH_PROMISE => return Err("HTTP/2: PUSH_PROMISE, though push is off".into()),
            _ => {} // acknowledgements, unknown types
        }
        Ok(())
    }

    async fn window_update(&mut self, stream: u32, increment: u32) -> Result<(), String> {
        let mut update = Vec::with_capacity(13);
        frame_header(&mut update, 4, WINDOW_UPDATE, 0, stream);
        update.extend_from_slice(&increment.to_be_bytes());
        self.write(&update).await
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.socket
            .write_all(bytes)
            .await
            .map_err(|e| format!("send: {e}"))
    }

    /// The next frame: type, flags, stream id, payload.
    async fn next_frame(&mut self) -> Result<(u8, u8, u32, Bytes), String> {
        loop {
            if self.read.len() >= 9 {
                let len = usize::from(self.read[0]) << 16
                    | usize::from(self.read[1]) << 8
                    | usize::from(self.read[2]);
                if len > MAX_FRAME {
                    return Err(format!("HTTP/2: a frame of {len} bytes, above {MAX_FRAME}"));
                }
                if self.read.len() >= 9 + len {
                    let frame = self.read.split_to(9 + len).freeze();
                    let stream =
                        u32::from_be_bytes([frame[5] & 0x7f, frame[6], frame[7], frame[8]]);
                    return Ok((frame[3], frame[4], stream, frame.slice(9..)));
                }
                self.read.reserve(9 + len - self.read.len());
            } else {
                self.read.reserve(MAX_FRAME + 9);
            }
            io::read_more(&mut self.socket, &mut self.read).await?;
        }
    }
}

impl Call {
    fn finish(&mut self, outcome: Result<(), String>) {
        if self.outcome.is_none() {
            self.outcome = Some(outcome);
        }
        self.ended = true;
    }

    /// The answer's headers, or its trailers.
    fn headers(&mut self, fields: Fields, end_stream: bool) {
        if !self.headers_seen {
            self.headers_seen = true;
            if fields.status != Some(200) {
                let status = fields
                    .status
                    .map_or("no :status".to_owned(), |s| s.to_string());
                self.outcome = Some(Err(format!("HTTP {status}")));
            }
        }
        if let Some(code) = fields.grpc_status {
            let outcome = if code == b"0" {
                Ok(())
            } else {
                Err(format!("gRPC {:?}", tonic::Code::from_bytes(&code)))
            };
            if self.outcome.is_none() {
                self.outcome = Some(outcome);
            }
        }
        if end_stream {
            self.finish(Err("the answer ended without grpc-status".into()));
        }
    }
}
