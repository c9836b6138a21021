//! A frame's result message, and the session's other messages (opened, frame
//! errors, the closing error, the end of a source): docs/websocket.md, "Results"
//! and "Errors".

use base64::Engine;
use bytes::{BufMut, Bytes, BytesMut};
use kiln_protocol::http::DataJson;
use kiln_protocol::{DataType, OutputTensor};
use serde::Serialize;
use serde_json::{json, Map, Value};

use std::sync::Arc;

use kiln_core::memory::client_bytes::{ClientBytes, Exhausted, Reservation, Use};
use kiln_core::observe::stream_metrics::DropReason;

use super::image::encode_jpeg;
use super::processing::Processed;
use super::protocol::{ImageFormat, Open, OutputFormat};
use super::source::SourceInfo;

/// A message to send.
#[derive(Debug, Clone)]
pub enum Message {
    Text(String),
    Binary(Bytes),
}

impl Message {
    /// Its size in bytes.
    pub fn len(&self) -> usize {
        match self {
            Message::Text(t) => t.len(),
            Message::Binary(b) => b.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A message on its way to the client, with the budget's bytes it holds
/// (`Use::StreamResult`; none for the session's small messages).
#[derive(Debug)]
pub struct Outgoing {
    pub message: Message,
    pub held: Option<Reservation>,
}

impl From<Message> for Outgoing {
    fn from(message: Message) -> Self {
        Outgoing {
            message,
            held: None,
        }
    }
}

/// Drops of a session so far, by reason (`DropReason::index`).
pub type Dropped = [u64; DropReason::ALL.len()];

fn dropped_json(dropped: &Dropped) -> Value {
    let mut m = Map::new();
    for reason in DropReason::ALL {
        m.insert(reason.as_str().into(), dropped[reason.index()].into());
    }
    Value::Object(m)
}

/// What bounds a result: its size (`--stream-max-result-bytes`), and the
/// server's budget its bytes are reserved from while they wait to be sent.
#[derive(Debug, Clone)]
pub struct ResultLimit {
    pub max_bytes: usize,
    pub budget: Arc<ClientBytes>,
}

/// Why a frame's result was not made.
#[derive(Debug)]
pub enum EncodeError {
    /// Post-processing or encoding failed (a frame error).
    Failed(String),
    /// It would pass `--stream-max-result-bytes` (a frame error).
    TooLarge(usize),
    /// The budget had no room (a frame dropped, reason `memory`).
    Exhausted(Exhausted),
}

impl EncodeError {
    /// The frame error's text.
    pub fn message(&self, max_bytes: usize) -> String {
        match self {
            EncodeError::Failed(e) => e.clone(),
            EncodeError::TooLarge(bytes) => format!(
                "the result is over {max_bytes} bytes (at least {bytes}), the server's \
                 --stream-max-result-bytes: ask for fewer outputs, `\"image_format\": \"jpeg\"` \
                 or `\"output_format\": \"binary\"`"
            ),
            EncodeError::Exhausted(e) => e.to_string(),
        }
    }
}

impl From<Exhausted> for EncodeError {
    fn from(e: Exhausted) -> Self {
        EncodeError::Exhausted(e)
    }
}

/// A `Write` into memory that reserves each growth of its buffer from the
/// budget before it allocates it, and stops at the result's limit.
struct Budgeted<'a> {
    out: Vec<u8>,
    held: &'a mut Reservation,
    /// Bytes the reservation holds for other parts of the result.
    base: usize,
    max: usize,
    stop: Option<EncodeError>,
}

impl std::io::Write for Budgeted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let len = self.out.len() + buf.len();
        if self.base + len > self.max {
            self.stop = Some(EncodeError::TooLarge(self.base + len));
            return Err(std::io::Error::other("over the limit"));
        }
        if len > self.out.capacity() {
            let capacity = len.max(self.out.capacity() * 2).min(self.max - self.base);
            if let Err(e) = self.held.grow_to(self.base + capacity) {
                self.stop = Some(e.into());
                return Err(std::io::Error::other("over the budget"));
            }
            self.out.reserve_exact(capacity - self.out.len());
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a result needs besides its outputs.
pub struct ResultHead<'a> {
    pub key: &'a str,
    pub frame: u64,
    pub model_name: &'a str,
    pub model_version: &'a str,
    /// The source's size and rate: the session's first result only.
    pub source: Option<SourceInfo>,
    pub latency_ms: f64,
    pub dropped: Dropped,
    pub format: OutputFormat,
}

#[derive(Serialize)]
struct OutputHeader<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [i64],
    #[serde(skip_serializing_if = "Option::is_none")]
    content_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    binary_data_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<Data<'a>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Data<'a> {
    Base64(String),
    Tensor(DataJson<'a>),
}

/// Whether an output is a picture: UINT8 `[H, W, 3]`.
fn image_size(output: &OutputTensor) -> Option<(usize, usize)> {
    match (output.dtype, output.shape.as_slice()) {
        (DataType::Uint8, &[h, w, 3]) if h > 0 && w > 0 => Some((h as usize, w as usize)),
        _ => None,
    }
}

/// A frame's outputs, encoded: the `outputs` array's JSON, the binary payloads
/// (with `"output_format": "binary"`), the fields post-processing added, and the
/// budget's bytes they hold.
#[derive(Debug)]
pub struct EncodedOutputs {
    pub outputs: String,
    pub payloads: Vec<Bytes>,
    pub fields: Map<String, Value>,
    pub held: Reservation,
}

/// Encodes a frame's outputs as `open` asks: JPEG-encoding image outputs and
/// writing tensors as JSON, which takes milliseconds (call it on a blocking
/// thread). What it makes is reserved from `limit`'s budget before it is
/// allocated, and refused beyond `limit.max_bytes` (a JSON tensor is some 4–20
/// bytes an element: one raw 8192×8192 frame would be a 768 MiB message).
pub fn encode_outputs(
    processed: Processed,
    open: &Open,
    limit: &ResultLimit,
) -> Result<EncodedOutputs, EncodeError> {
    let mut held = limit.budget.empty(Use::StreamResult);
    let mut size = 0usize;
    let mut add = |held: &mut Reservation, bytes: usize| -> Result<(), EncodeError> {
        size = size.saturating_add(bytes);
        if size > limit.max_bytes {
            return Err(EncodeError::TooLarge(size));
        }
        Ok(held.grow_to(size)?)
    };
    let binary = open.output_format == OutputFormat::Binary;
    let mut payloads: Vec<Bytes> = Vec::new();
    let mut outputs = Vec::with_capacity(processed.outputs.len());
    for output in &processed.outputs {
        let image = match open.image_format {
            ImageFormat::Jpeg => image_size(output),
            ImageFormat::Raw => None,
        };
        let (content_type, bytes) = match image {
            Some((h, w)) => (
                Some("image/jpeg"),
                Bytes::from(
                    encode_jpeg(&output.data, w, h, open.jpeg_quality)
                        .map_err(EncodeError::Failed)?,
                ),
            ),
            None => (None, output.data.clone()),
        };
        let (binary_data_size, data) = if binary {
            let size = bytes.len();
            add(&mut held, size)?;
            payloads.push(bytes);
            (Some(size), None)
        } else if content_type.is_some() {
            add(&mut held, bytes.len().div_ceil(3) * 4)?;
            let text = base64::engine::general_purpose::STANDARD.encode(&bytes);
            (None, Some(Data::Base64(text)))
        } else {
            (
                None,
                Some(Data::Tensor(DataJson {
                    dtype: output.dtype,
                    bytes: &output.data,
                })),
            )
        };
        outputs.push(OutputHeader {
            name: &output.name,
            datatype: output.dtype.as_str(),
            shape: &output.shape,
            content_type,
            binary_data_size,
            data,
        });
    }
    let mut writer = Budgeted {
        out: Vec::new(),
        base: held.amount(),
        held: &mut held,
        max: limit.max_bytes,
        stop: None,
    };
    if let Err(e) = serde_json::to_writer(&mut writer, &outputs) {
        return Err(writer
            .stop
            .take()
            .unwrap_or_else(|| EncodeError::Failed(e.to_string())));
    }
    let outputs = String::from_utf8(writer.out).map_err(|e| EncodeError::Failed(e.to_string()))?;
    Ok(EncodedOutputs {
        outputs,
        payloads,
        fields: processed.fields,
        held,
    })
}

/// A frame's result message: `head`, then the encoded outputs. The message's
/// bytes are reserved (beside the outputs', until they are dropped) before it is
/// made, and it is refused beyond `max_bytes`.
pub fn result_message(
    head: &ResultHead<'_>,
    encoded: EncodedOutputs,
    max_bytes: usize,
) -> Result<Outgoing, EncodeError> {
    let mut header = Map::new();
    header.insert("session".into(), head.key.into());
    header.insert("frame".into(), head.frame.into());
    header.insert("model_name".into(), head.model_name.into());
    header.insert("model_version".into(), head.model_version.into());
    if let Some(source) = head.source {
        header.insert("source".into(), source_json(&source));
    }
    header.insert("latency_ms".into(), json!(head.latency_ms));
    header.insert("dropped".into(), dropped_json(&head.dropped));
    for (k, v) in &encoded.fields {
        header.insert(k.clone(), v.clone());
    }
    // `outputs` goes last, as the JSON it already is.
    let head_text = Value::Object(header).to_string();
    const OUTPUTS: &str = ",\"outputs\":";
    let text_len = head_text.len() + OUTPUTS.len() + encoded.outputs.len();
    let size = match head.format {
        OutputFormat::Json => text_len,
        OutputFormat::Binary => {
            4 + text_len + encoded.payloads.iter().map(Bytes::len).sum::<usize>()
        }
    };
    if size > max_bytes {
        return Err(EncodeError::TooLarge(size));
    }
    let mut held = encoded.held;
    let parts = held.amount();
    held.grow_to(parts + size)?;
    let mut text = String::with_capacity(text_len);
    text.push_str(&head_text[..head_text.len() - 1]);
    text.push_str(OUTPUTS);
    text.push_str(&encoded.outputs);
    text.push('}');
    let message = match head.format {
        OutputFormat::Json => Message::Text(text),
        OutputFormat::Binary => Message::Binary(framed(text.as_bytes(), &encoded.payloads)),
    };
    drop((encoded.outputs, encoded.payloads));
    held.shrink_to(size);
    Ok(Outgoing {
        message,
        held: Some(held),
    })
}

/// `u32` LE length, `header`, then `payloads`: a binary result or raw frame.
pub fn framed(header: &[u8], payloads: &[Bytes]) -> Bytes {
    let size = 4 + header.len() + payloads.iter().map(Bytes::len).sum::<usize>();
    let mut out = BytesMut::with_capacity(size);
    out.put_u32_le(header.len() as u32);
    out.put_slice(header);
    for p in payloads {
        out.put_slice(p);
    }
    out.freeze()
}

fn source_json(source: &SourceInfo) -> Value {
    json!({"width": source.width, "height": source.height, "fps": source.fps})
}

/// `{"event": "opened", ...}`: the answer to a good opening message.
pub fn opened(
    open: &Open,
    model_name: &str,
    model_version: &str,
    source: Option<SourceInfo>,
) -> Message {
    let mut m = json!({
        "session": open.key,
        "event": "opened",
        "model_name": model_name,
        "model_version": model_version,
        "input": open.input,
        "max_inflight_frames": open.max_inflight,
    });
    if let Some(source) = source {
        m["source"] = source_json(&source);
    }
    Message::Text(m.to_string())
}

/// A frame's error message; the session goes on.
pub fn frame_error(key: &str, frame: u64, error: &str, dropped: &Dropped) -> Message {
    Message::Text(
        json!({"session": key, "frame": frame, "error": error, "dropped": dropped_json(dropped)})
            .to_string(),
    )
}

/// The error that ends a session, sent before its close frame.
pub fn session_error(key: Option<&str>, error: &str, code: u16) -> Message {
    Message::Text(json!({"session": key, "error": error, "close_code": code}).to_string())
}

/// The end of a server-side source: `frames` read.
pub fn end(key: &str, frames: u64, dropped: &Dropped) -> Message {
    Message::Text(
        json!({"session": key, "event": "end", "frames": frames, "dropped": dropped_json(dropped)})
            .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::image::decode_jpeg;
    use crate::stream::processing::Processing;

    fn open(format: OutputFormat) -> Open {
        Open {
            key: "k".into(),
            input: "image".into(),
            encoding: Default::default(),
            parameters: vec![],
            outputs: None,
            output_format: format,
            image_format: ImageFormat::Jpeg,
            jpeg_quality: 90,
            max_inflight: 4,
            source: None,
            processing: Processing::None,
        }
    }

    fn processed() -> Processed {
        Processed {
            outputs: vec![
                OutputTensor {
                    name: "img".into(),
                    dtype: DataType::Uint8,
                    shape: vec![8, 8, 3],
                    data: Bytes::from(vec![200u8; 192]),
                },
                OutputTensor {
                    name: "score".into(),
                    dtype: DataType::Fp32,
                    shape: vec![1],
                    data: Bytes::copy_from_slice(&0.5f32.to_le_bytes()),
                },
            ],
            fields: Map::new(),
        }
    }

    fn limit() -> ResultLimit {
        ResultLimit {
            max_bytes: 1 << 20,
            budget: ClientBytes::new(64 << 20),
        }
    }

    /// A raw tensor as JSON is refused over the limit, and over the budget,
    /// before its text is made; nothing stays reserved.
    #[test]
    fn results_are_bounded_by_size_and_budget() {
        let big = || Processed {
            outputs: vec![OutputTensor {
                name: "raw".into(),
                dtype: DataType::Uint8,
                shape: vec![512, 512, 3],
                data: Bytes::from(vec![255u8; 512 * 512 * 3]),
            }],
            fields: Map::new(),
        };
        let raw = Open {
            image_format: ImageFormat::Raw,
            ..open(OutputFormat::Json)
        };
        let small = ResultLimit {
            max_bytes: 1 << 20,
            budget: ClientBytes::new(64 << 20),
        };
        match encode_outputs(big(), &raw, &small) {
            Err(EncodeError::TooLarge(n)) => assert!(n > 1 << 20 && n < 2 << 20, "{n}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(small.budget.held(), 0);
        let poor = ResultLimit {
            max_bytes: 64 << 20,
            budget: ClientBytes::new(1 << 20),
        };
        assert!(matches!(
            encode_outputs(big(), &raw, &poor),
            Err(EncodeError::Exhausted(_))
        ));
        assert_eq!(poor.budget.held(), 0);
        // Within both: the message holds its bytes until it is dropped.
        let roomy = ResultLimit {
            max_bytes: 8 << 20,
            budget: ClientBytes::new(64 << 20),
        };
        let encoded = encode_outputs(big(), &raw, &roomy).unwrap();
        let out = result_message(&head(), encoded, roomy.max_bytes).unwrap();
        assert_eq!(roomy.budget.held(), out.message.len());
        drop(out);
        assert_eq!(roomy.budget.held(), 0);
    }

    fn head() -> ResultHead<'static> {
        ResultHead {
            key: "k",
            frame: 3,
            model_name: "m",
            model_version: "1",
            source: Some(SourceInfo {
                width: 8,
                height: 8,
                fps: None,
            }),
            latency_ms: 1.5,
            dropped: [1, 0, 0, 0],
            format: OutputFormat::Json,
        }
    }

    #[test]
    fn json_results_carry_jpeg_images_and_tensors() {
        let encoded = encode_outputs(processed(), &open(OutputFormat::Json), &limit()).unwrap();
        let Message::Text(text) = result_message(&head(), encoded, 1 << 20).unwrap().message else {
            panic!("a text message")
        };
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["frame"], 3);
        assert_eq!(v["source"]["width"], 8);
        assert_eq!(v["dropped"]["overrun"], 1);
        assert_eq!(v["outputs"][0]["content_type"], "image/jpeg");
        let jpeg = base64::engine::general_purpose::STANDARD
            .decode(v["outputs"][0]["data"].as_str().unwrap())
            .unwrap();
        assert!(decode_jpeg(&jpeg, &limit().budget)
            .unwrap()
            .0
            .pixels
            .iter()
            .all(|&p| p.abs_diff(200) <= 3));
        assert_eq!(v["outputs"][1]["data"], json!([0.5]));
    }

    #[test]
    fn binary_results_frame_a_header_and_payloads() {
        let encoded = encode_outputs(processed(), &open(OutputFormat::Binary), &limit()).unwrap();
        let head = ResultHead {
            format: OutputFormat::Binary,
            ..head()
        };
        let Message::Binary(msg) = result_message(&head, encoded, 1 << 20).unwrap().message else {
            panic!("a binary message")
        };
        let len = u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize;
        let v: Value = serde_json::from_slice(&msg[4..4 + len]).unwrap();
        let jpeg_size = v["outputs"][0]["binary_data_size"].as_u64().unwrap() as usize;
        assert_eq!(v["outputs"][1]["binary_data_size"], 4);
        assert_eq!(msg.len(), 4 + len + jpeg_size + 4);
        assert_eq!(&msg[msg.len() - 4..], &0.5f32.to_le_bytes());
        assert!(decode_jpeg(&msg[4 + len..4 + len + jpeg_size], &limit().budget).is_ok());
    }
}
