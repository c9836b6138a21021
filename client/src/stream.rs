//! The WebSocket stream client (docs/websocket.md): open a session on
//! `/v2/models/{m}/stream`, send frames, read each frame's result. Used by the
//! tests and by `kiln-load --stream`.
//!
//! ```no_run
//! # async fn demo(jpeg: Vec<u8>) -> Result<(), kiln_client::ClientError> {
//! use kiln_client::stream::{Event, StreamClient};
//! let mut s = StreamClient::connect("http://127.0.0.1:8000", "invert-video", None).await?;
//! s.open(serde_json::json!({"encoding": "jpeg"})).await?;
//! s.send_frame(jpeg).await?;
//! if let Event::Result(r) = s.recv().await? {
//!     let inverted = kiln_client::stream::decode_jpeg(r.outputs[0].bytes.as_ref().unwrap())?;
//! }
//! # Ok(()) }
//! ```

use base64::Engine;
use bytes::Bytes;
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::{ClientError, DataType};

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One output of a result.
#[derive(Debug, Clone)]
pub struct StreamOutput {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
    /// `image/jpeg` for an image output sent as a JPEG.
    pub content_type: Option<String>,
    /// The output's bytes: the JPEG, or (binary results) the raw tensor data.
    pub bytes: Option<Bytes>,
    /// The output's JSON `data` array (a tensor in a JSON result).
    pub json: Option<Value>,
}

/// A frame's result.
#[derive(Debug, Clone)]
pub struct StreamResult {
    pub frame: u64,
    /// The whole header (session, model, `source`, `latency_ms`, `dropped`, ...).
    pub header: Value,
    pub outputs: Vec<StreamOutput>,
}

impl StreamResult {
    /// The session's drops so far for `reason` (`overrun`, `slow_reader`, `rejected`).
    pub fn dropped(&self, reason: &str) -> u64 {
        self.header["dropped"][reason].as_u64().unwrap_or(0)
    }
}

/// What the server sent.
#[derive(Debug, Clone)]
pub enum Event {
    /// A frame's result.
    Result(StreamResult),
    /// A frame's error; the session goes on.
    FrameError {
        frame: u64,
        error: String,
        message: Value,
    },
    /// Another JSON message: `{"event": "end", ...}`, a session error before
    /// the close.
    Message(Value),
    /// The server closed the session.
    Closed { code: u16, reason: String },
}

/// A session's socket.
pub struct StreamClient {
    socket: Socket,
}

/// The stream URL of `model` on the server at `base` (`http://` → `ws://`).
pub fn stream_url(base: &str, model: &str, version: Option<&str>) -> String {
    let base = base.trim_end_matches('/');
    let ws = match base.split_once("://") {
        Some(("https", rest)) => format!("wss://{rest}"),
        Some((_, rest)) => format!("ws://{rest}"),
        None => format!("ws://{base}"),
    };
    match version {
        Some(v) => format!("{ws}/v2/models/{model}/versions/{v}/stream"),
        None => format!("{ws}/v2/models/{model}/stream"),
    }
}

fn transport(e: impl std::fmt::Display) -> ClientError {
    ClientError::Transport(e.to_string())
}

impl StreamClient {
    /// Connects to `model`'s stream on the server at `base` (an `http://` URL).
    /// A refused upgrade (404, 429, ...) is a [`ClientError::Status`].
    pub async fn connect(
        base: &str,
        model: &str,
        version: Option<&str>,
    ) -> Result<StreamClient, ClientError> {
        let url = stream_url(base, model, version);
        let config = WebSocketConfig::default().max_message_size(Some(256 << 20));
        match tokio_tungstenite::connect_async_with_config(url, Some(config), true).await {
            Ok((socket, _)) => Ok(StreamClient { socket }),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let body = response.body().as_deref().unwrap_or_default();
                let message = serde_json::from_slice::<Value>(body)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(str::to_owned))
                    .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
                Err(ClientError::Status { status, message })
            }
            Err(e) => Err(transport(e)),
        }
    }

    /// Sends the opening message and waits for `{"event": "opened"}` (returned);
    /// an error message or a close is an error.
    pub async fn open(&mut self, open: Value) -> Result<Value, ClientError> {
        self.send_text(open.to_string()).await?;
        match self.recv().await? {
            Event::Message(m) if m["event"] == "opened" => Ok(m),
            other => Err(ClientError::Decode(format!(
                "the session did not open: {other:?}"
            ))),
        }
    }

    /// Sends a text message (the opening one, or a wrong one in a test).
    pub async fn send_text(&mut self, text: String) -> Result<(), ClientError> {
        self.socket
            .send(Message::text(text))
            .await
            .map_err(transport)
    }

    /// Sends one frame (a binary message).
    pub async fn send_frame(&mut self, frame: impl Into<Bytes>) -> Result<(), ClientError> {
        send_frame(&mut self.socket, frame.into()).await
    }

    /// The next message from the server.
    pub async fn recv(&mut self) -> Result<Event, ClientError> {
        recv(&mut self.socket).await
    }

    /// Closes the session (code 1000) and reads until the server's close.
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.socket.close(None).await.map_err(transport)?;
        while let Some(m) = self.socket.next().await {
            if m.is_err() {
                break;
            }
        }
        Ok(())
    }

    /// The session's two halves, to send and receive from different tasks.
    pub fn split(self) -> (FrameSender, ResultReceiver) {
        let (sink, stream) = self.socket.split();
        (FrameSender(sink), ResultReceiver(stream))
    }
}

/// The sending half of a session.
pub struct FrameSender(SplitSink<Socket, Message>);

impl FrameSender {
    /// Sends one frame.
    pub async fn send_frame(&mut self, frame: impl Into<Bytes>) -> Result<(), ClientError> {
        self.0
            .send(Message::Binary(frame.into()))
            .await
            .map_err(transport)
    }

    /// Sends a close (code 1000).
    pub async fn close(&mut self) -> Result<(), ClientError> {
        self.0.send(Message::Close(None)).await.map_err(transport)
    }
}

/// The receiving half of a session.
pub struct ResultReceiver(SplitStream<Socket>);

impl ResultReceiver {
    /// The next message from the server.
    pub async fn recv(&mut self) -> Result<Event, ClientError> {
        recv(&mut self.0).await
    }
}

async fn send_frame(socket: &mut Socket, frame: Bytes) -> Result<(), ClientError> {
    socket.send(Message::Binary(frame)).await.map_err(transport)
}

async fn recv<S>(socket: &mut S) -> Result<Event, ClientError>
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        match socket.next().await {
            Some(Ok(m)) => {
                if let Some(event) = event(m)? {
                    return Ok(event);
                }
            }
            Some(Err(e)) => return Err(transport(e)),
            None => return Err(transport("the session's socket closed")),
        }
    }
}

/// A message as an event (`None`: a ping or pong, which tungstenite answers).
fn event(message: Message) -> Result<Option<Event>, ClientError> {
    let decode = |e: serde_json::Error| ClientError::Decode(e.to_string());
    Ok(Some(match message {
        Message::Text(text) => json_event(serde_json::from_str(&text).map_err(decode)?, &[])?,
        Message::Binary(bytes) => {
            let (header, payload) = split_framed(&bytes)?;
            let header: Value = serde_json::from_slice(header).map_err(decode)?;
            json_event(header, payload)?
        }
        Message::Close(frame) => match frame {
            Some(f) => Event::Closed {
                code: f.code.into(),
                reason: f.reason.to_string(),
            },
            None => Event::Closed {
                code: 1005,
                reason: String::new(),
            },
        },
        _ => return Ok(None),
    }))
}

/// A framed message's header and payload (`u32` LE length, header, payload).
fn split_framed(bytes: &[u8]) -> Result<(&[u8], &[u8]), ClientError> {
    let (len, rest) = bytes
        .split_first_chunk::<4>()
        .ok_or_else(|| ClientError::Decode("a binary message under 4 bytes".into()))?;
    let len = u32::from_le_bytes(*len) as usize;
    if len > rest.len() {
        return Err(ClientError::Decode(
            "a binary message's header is cut".into(),
        ));
    }
    Ok(rest.split_at(len))
}

fn json_event(header: Value, mut payload: &[u8]) -> Result<Event, ClientError> {
    let Some(frame) = header["frame"].as_u64() else {
        return Ok(Event::Message(header));
    };
    if let Some(error) = header["error"].as_str() {
        return Ok(Event::FrameError {
            frame,
            error: error.to_owned(),
            message: header.clone(),
        });
    }
    let mut outputs = Vec::new();
    for o in header["outputs"].as_array().into_iter().flatten() {
        let content_type = o["content_type"].as_str().map(str::to_owned);
        let (bytes, json) = match (o["binary_data_size"].as_u64(), &o["data"]) {
            (Some(size), _) => {
                let size = size as usize;
                if size > payload.len() {
                    return Err(ClientError::Decode("a binary output is cut".into()));
                }
                let (data, rest) = payload.split_at(size);
                payload = rest;
                (Some(Bytes::copy_from_slice(data)), None)
            }
            (None, Value::String(b64)) => {
                let data = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| ClientError::Decode(e.to_string()))?;
                (Some(Bytes::from(data)), None)
            }
            (None, data) => (None, Some(data.clone())),
        };
        outputs.push(StreamOutput {
            name: o["name"].as_str().unwrap_or_default().to_owned(),
            datatype: o["datatype"].as_str().unwrap_or_default().to_owned(),
            shape: o["shape"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_i64)
                .collect(),
            content_type,
            bytes,
            json,
        });
    }
    Ok(Event::Result(StreamResult {
        frame,
        header,
        outputs,
    }))
}

/// A raw frame: the header for `dtype` and `shape`, then `data`.
pub fn raw_frame(dtype: DataType, shape: &[i64], data: &[u8]) -> Vec<u8> {
    let header = serde_json::json!({"datatype": dtype.as_str(), "shape": shape}).to_string();
    let mut out = Vec::with_capacity(4 + header.len() + data.len());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Encodes RGB pixels (`[height, width, 3]`) as a JPEG (to send as a frame).
pub fn encode_jpeg(
    pixels: &[u8],
    width: u16,
    height: u16,
    quality: u8,
) -> Result<Vec<u8>, ClientError> {
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, quality)
        .encode(pixels, width, height, jpeg_encoder::ColorType::Rgb)
        .map_err(|e| ClientError::Decode(e.to_string()))?;
    Ok(out)
}

/// Decodes a JPEG (a result's image output) to RGB pixels: `(width, height, pixels)`.
pub fn decode_jpeg(jpeg: &[u8]) -> Result<(usize, usize, Vec<u8>), ClientError> {
    use zune_jpeg::zune_core::{
        bytestream::ZCursor, colorspace::ColorSpace, options::DecoderOptions,
    };
    let options = DecoderOptions::default().jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(jpeg), options);
    let pixels = decoder
        .decode()
        .map_err(|e| ClientError::Decode(e.to_string()))?;
    let info = decoder
        .info()
        .ok_or_else(|| ClientError::Decode("no JPEG header".into()))?;
    Ok((info.width.into(), info.height.into(), pixels))
}
