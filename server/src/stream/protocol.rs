//! The stream's messages (docs/websocket.md): the session-opening message, the
//! raw-tensor frame header, and the close codes. What results look like is
//! `result.rs`'s.

use kiln_protocol::http::params_from_json;
use kiln_protocol::{DataType, Param};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::processing::Processing;
use super::source::SourceSpec;
use kiln_core::models::Served;

/// WebSocket close codes (RFC 6455, 7.4.1) the stream closes with.
pub mod close {
    /// The client closed, or a server-side source ended.
    pub const NORMAL: u16 = 1000;
    /// Idle timeout, shutdown, the model unloaded.
    pub const GOING_AWAY: u16 = 1001;
    /// A WebSocket protocol violation.
    pub const PROTOCOL: u16 = 1002;
    /// A message of a kind the session does not take at that point.
    pub const UNSUPPORTED: u16 = 1003;
    /// The opening message is not a JSON object.
    pub const INVALID_PAYLOAD: u16 = 1007;
    /// The opening message is refused.
    pub const POLICY: u16 = 1008;
    /// A message over the size limit.
    pub const TOO_BIG: u16 = 1009;
    /// kiln failed.
    pub const INTERNAL: u16 = 1011;
}

/// An error that ends a session: its close code and reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closing {
    pub code: u16,
    pub reason: String,
}

impl Closing {
    /// A session ending with `code` for `reason`.
    pub fn new(code: u16, reason: impl Into<String>) -> Closing {
        Closing {
            code,
            reason: reason.into(),
        }
    }
}

/// How the client encodes its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Jpeg,
    Png,
    Raw,
}

/// How results are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// Text messages of JSON.
    #[default]
    Json,
    /// Binary messages: a JSON header, then the outputs' bytes.
    Binary,
}

/// How image outputs (UINT8 `[H, W, 3]`) are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    #[default]
    Jpeg,
    Raw,
}

/// `max_inflight_frames` when the opening message does not say.
pub const DEFAULT_INFLIGHT: usize = 4;
/// `jpeg_quality` when the opening message does not say.
pub const DEFAULT_JPEG_QUALITY: u8 = 85;

/// The opening message as sent (docs/websocket.md, "Opening a session").
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenJson {
    id: Option<String>,
    input: Option<String>,
    #[serde(default)]
    encoding: Encoding,
    parameters: Option<Map<String, Value>>,
    outputs: Option<Vec<String>>,
    #[serde(default)]
    output_format: OutputFormat,
    #[serde(default)]
    image_format: ImageFormat,
    jpeg_quality: Option<u8>,
    max_inflight_frames: Option<usize>,
    source: Option<Value>,
    processing: Option<Value>,
}

/// A session's settings, checked against its model.
#[derive(Debug, Clone)]
pub struct Open {
    /// The session key (the client's `id`, or one made by kiln).
    pub key: String,
    /// The input tensor the frames feed.
    pub input: String,
    pub encoding: Encoding,
    pub parameters: Vec<Param>,
    pub outputs: Option<Vec<String>>,
    pub output_format: OutputFormat,
    pub image_format: ImageFormat,
    pub jpeg_quality: u8,
    pub max_inflight: usize,
    pub source: Option<SourceSpec>,
    pub processing: Processing,
}

impl Open {
    /// Parses and checks the opening message `text` for a session of `group`
    /// (`key`: the session key when the client gives none; `max_inflight`: the
    /// operator's bound). 1007 for text that is not a JSON object, 1008 for one
    /// that is refused.
    pub fn parse(
        text: &str,
        group: &Served,
        key: impl FnOnce() -> String,
        max_inflight: usize,
    ) -> Result<Open, Closing> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            Closing::new(
                close::INVALID_PAYLOAD,
                format!("the opening message is not JSON: {e}"),
            )
        })?;
        if !value.is_object() {
            return Err(Closing::new(
                close::INVALID_PAYLOAD,
                "the opening message must be a JSON object",
            ));
        }
        let refused = |reason: String| Closing::new(close::POLICY, reason);
        let open: OpenJson = serde_json::from_value(value)
            .map_err(|e| refused(format!("bad opening message: {e}")))?;
        let key = match open.id {
            None => key(),
            Some(id) if (1..=128).contains(&id.len()) => id,
            Some(_) => return Err(refused("`id` must be 1 to 128 bytes long".into())),
        };
        let inputs = &group.info().inputs;
        let input = match open.input {
            Some(name) if inputs.iter().any(|t| t.name.as_str() == name) => name,
            Some(name) => {
                return Err(refused(format!(
                    "model `{}` has no input `{name}` (inputs: {})",
                    group.endpoint(),
                    names(inputs.iter().map(|t| t.name.as_str()))
                )))
            }
            None if inputs.len() == 1 => inputs[0].name.to_string(),
            None => {
                return Err(refused(format!(
                    "model `{}` has {} inputs: name the one the frames feed with `input` ({})",
                    group.endpoint(),
                    inputs.len(),
                    names(inputs.iter().map(|t| t.name.as_str()))
                )))
            }
        };
        if let Some(outputs) = &open.outputs {
            let known = &group.info().outputs;
            if let Some(bad) = outputs
                .iter()
                .find(|o| !known.iter().any(|t| t.name.as_str() == o.as_str()))
            {
                return Err(refused(format!(
                    "model `{}` has no output `{bad}` (outputs: {})",
                    group.endpoint(),
                    names(known.iter().map(|t| t.name.as_str()))
                )));
            }
        }
        let parameters = match open.parameters {
            None => Vec::new(),
            Some(map) => params_from_json(map).map_err(|e| refused(e.to_string()))?,
        };
        let jpeg_quality = match open.jpeg_quality {
            None => DEFAULT_JPEG_QUALITY,
            Some(q @ 1..=100) => q,
            Some(q) => return Err(refused(format!("`jpeg_quality` {q}: it is 1 to 100"))),
        };
        let max_inflight = match open.max_inflight_frames {
            None => DEFAULT_INFLIGHT.min(max_inflight),
            Some(n) if (1..=max_inflight).contains(&n) => n,
            Some(n) => {
                return Err(refused(format!(
                    "`max_inflight_frames` {n}: it is 1 to {max_inflight} \
                     (the operator's --stream-max-inflight-frames)"
                )))
            }
        };
        let source = open
            .source
            .as_ref()
            .map(SourceSpec::parse)
            .transpose()
            .map_err(refused)?;
        let processing = Processing::parse(open.processing.as_ref()).map_err(refused)?;
        Ok(Open {
            key,
            input,
            encoding: open.encoding,
            parameters,
            outputs: open.outputs,
            output_format: open.output_format,
            image_format: open.image_format,
            jpeg_quality,
            max_inflight,
            source,
            processing,
        })
    }
}

fn names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

/// A raw frame's header (`"encoding": "raw"`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeader {
    datatype: String,
    shape: Vec<i64>,
}

/// Splits a raw frame (`u32` LE header length, JSON header, data) into its
/// datatype, shape and data, checking the data's size against them.
pub fn parse_raw(message: &bytes::Bytes) -> Result<(DataType, Vec<i64>, bytes::Bytes), String> {
    let (len, rest) = message
        .split_first_chunk::<4>()
        .ok_or("a raw frame starts with its header's length (4 bytes, little-endian)")?;
    let len = u32::from_le_bytes(*len) as usize;
    if len > rest.len() {
        return Err(format!(
            "a raw frame's header of {len} bytes is longer than the {} bytes that follow",
            rest.len()
        ));
    }
    let header: RawHeader = serde_json::from_slice(&rest[..len])
        .map_err(|e| format!("a raw frame's header is not {{\"datatype\", \"shape\"}}: {e}"))?;
    let dtype = DataType::parse(&header.datatype)
        .ok_or_else(|| format!("unknown datatype `{}`", header.datatype))?;
    let size = dtype.size().ok_or("a raw frame cannot be BYTES")?;
    let elements = header
        .shape
        .iter()
        .try_fold(1usize, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
        })
        .ok_or_else(|| format!("bad shape {:?}", header.shape))?;
    let data = message.slice(4 + len..);
    let want = elements.saturating_mul(size);
    if data.len() != want {
        return Err(format!(
            "a raw frame of {} {:?} holds {want} bytes, not {}",
            header.datatype,
            header.shape,
            data.len()
        ));
    }
    Ok((dtype, header.shape, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(dtype: DataType, shape: &[i64], data: &[u8]) -> bytes::Bytes {
        let header = serde_json::json!({"datatype": dtype.as_str(), "shape": shape}).to_string();
        crate::stream::result::framed(header.as_bytes(), &[bytes::Bytes::copy_from_slice(data)])
    }

    #[test]
    fn raw_frames_round_trip_and_sizes_are_checked() {
        let data = [1u8, 2, 3, 4, 5, 6];
        let msg = raw(DataType::Uint8, &[1, 2, 3], &data);
        let (dtype, shape, got) = parse_raw(&msg).unwrap();
        assert_eq!(
            (dtype, shape, &got[..]),
            (DataType::Uint8, vec![1, 2, 3], &data[..])
        );
        let short = raw(DataType::Uint8, &[1, 2, 4], &data);
        assert!(parse_raw(&short).unwrap_err().contains("holds 8 bytes"));
        for bad in [&b""[..], &[200, 0, 0, 0, b'{'], &[2, 0, 0, 0, b'{', b'}']] {
            assert!(parse_raw(&bytes::Bytes::copy_from_slice(bad)).is_err());
        }
        let neg = raw(DataType::Fp32, &[-1, 2], &[]);
        assert!(parse_raw(&neg).is_err());
    }
}
