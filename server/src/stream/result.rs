//! A frame's result message, and the session's other messages (opened, frame
//! errors, the closing error, the end of a source): docs/websocket.md, "Results"
//! and "Errors".

use base64::Engine;
use bytes::{BufMut, Bytes, BytesMut};
use kiln_protocol::http::DataJson;
use kiln_protocol::{DataType, OutputTensor};
use serde::Serialize;
use serde_json::{json, Map, Value};

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

/// Drops of a session so far, by reason (`DropReason::index`).
pub type Dropped = [u64; 3];

fn dropped_json(dropped: &Dropped) -> Value {
    json!({"overrun": dropped[0], "slow_reader": dropped[1], "rejected": dropped[2]})
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
/// (with `"output_format": "binary"`) and the fields post-processing added.
#[derive(Debug)]
pub struct EncodedOutputs {
    pub outputs: Box<serde_json::value::RawValue>,
    pub payloads: Vec<Bytes>,
    pub fields: Map<String, Value>,
}

/// Encodes a frame's outputs as `open` asks: JPEG-encoding image outputs and
/// writing tensors as JSON, which takes milliseconds (call it on a blocking thread).
pub fn encode_outputs(processed: Processed, open: &Open) -> Result<EncodedOutputs, String> {
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
                Bytes::from(encode_jpeg(&output.data, w, h, open.jpeg_quality)?),
            ),
            None => (None, output.data.clone()),
        };
        let (binary_data_size, data) = if binary {
            let size = bytes.len();
            payloads.push(bytes);
            (Some(size), None)
        } else if content_type.is_some() {
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
    let outputs = serde_json::value::to_raw_value(&outputs).map_err(|e| e.to_string())?;
    Ok(EncodedOutputs {
        outputs,
        payloads,
        fields: processed.fields,
    })
}

/// A frame's result message: `head`, then the encoded outputs.
pub fn result_message(head: &ResultHead<'_>, encoded: &EncodedOutputs) -> Message {
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
    let mut text = Value::Object(header).to_string();
    text.pop();
    text.push_str(",\"outputs\":");
    text.push_str(encoded.outputs.get());
    text.push('}');
    match head.format {
        OutputFormat::Json => Message::Text(text),
        OutputFormat::Binary => Message::Binary(framed(text.as_bytes(), &encoded.payloads)),
    }
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
            dropped: [1, 0, 0],
            format: OutputFormat::Json,
        }
    }

    #[test]
    fn json_results_carry_jpeg_images_and_tensors() {
        let encoded = encode_outputs(processed(), &open(OutputFormat::Json)).unwrap();
        let Message::Text(text) = result_message(&head(), &encoded) else {
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
        assert!(decode_jpeg(&jpeg)
            .unwrap()
            .pixels
            .iter()
            .all(|&p| p.abs_diff(200) <= 3));
        assert_eq!(v["outputs"][1]["data"], json!([0.5]));
    }

    #[test]
    fn binary_results_frame_a_header_and_payloads() {
        let encoded = encode_outputs(processed(), &open(OutputFormat::Binary)).unwrap();
        let head = ResultHead {
            format: OutputFormat::Binary,
            ..head()
        };
        let Message::Binary(msg) = result_message(&head, &encoded) else {
            panic!("a binary message")
        };
        let len = u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize;
        let v: Value = serde_json::from_slice(&msg[4..4 + len]).unwrap();
        let jpeg_size = v["outputs"][0]["binary_data_size"].as_u64().unwrap() as usize;
        assert_eq!(v["outputs"][1]["binary_data_size"], 4);
        assert_eq!(msg.len(), 4 + len + jpeg_size + 4);
        assert_eq!(&msg[msg.len() - 4..], &0.5f32.to_le_bytes());
        assert!(decode_jpeg(&msg[4 + len..4 + len + jpeg_size]).is_ok());
    }
}
