//! The KServe v2 / Triton binary tensor data extension over REST.
//!
//! With the header `Inference-Header-Content-Length: N`, a body's first N bytes are
//! the JSON (request or response) and the rest are tensors' raw bytes: a tensor whose
//! `parameters` has `"binary_data_size": K` has no `data`, its data is the next K
//! bytes of that binary part, in the order the tensors appear. Bytes are laid out as
//! kiln holds them (little-endian; BYTES elements each a 4-byte little-endian length
//! then the bytes). A request's binary tensors are slices of its body (no copy).
//!
//! A client asks for binary outputs with the request parameter
//! `"binary_data_output": true` (every output) or, per requested output,
//! `"parameters": {"binary_data": true}` (which overrides the request-level choice).
//! That choice is an HTTP matter: it is returned beside the protocol-free
//! [`InferRequest`](crate::InferRequest) as [`BinaryOutputs`], never passed to the worker.

use bytes::Bytes;
use kiln_types::{tensor_byte_len, DataType};
use serde_json::{Map, Value};

use crate::error::{ProtocolError, Result};

/// The header giving the length of the JSON part of a body with binary tensors.
pub const INFERENCE_HEADER_CONTENT_LENGTH: &str = "Inference-Header-Content-Length";

/// Which outputs of a response are sent as binary tensor data: the request-level
/// `binary_data_output`, overridden per output by its `binary_data`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BinaryOutputs {
    /// The request-level `binary_data_output` (default false).
    pub all: bool,
    /// Per-output `binary_data` settings, by output name.
    pub outputs: Vec<(String, bool)>,
}

impl BinaryOutputs {
    /// Whether output `name` is sent binary.
    pub fn is_binary(&self, name: &str) -> bool {
        self.outputs
            .iter()
            .find(|(n, _)| n == name)
            .map_or(self.all, |&(_, binary)| binary)
    }

    /// Takes the protocol's keys (`binary_data_output`, and `binary_data` /
    /// `binary_data_size`, which mean nothing at request level) out of the request
    /// parameters, so they never reach the worker.
    pub(super) fn from_request_parameters(params: &mut Map<String, Value>) -> Result<Self> {
        params.remove("binary_data");
        params.remove("binary_data_size");
        let all = match params.remove("binary_data_output") {
            None => false,
            Some(Value::Bool(b)) => b,
            Some(other) => {
                return Err(ProtocolError::invalid(format!(
                    "parameter `binary_data_output` must be a boolean, got {other}"
                )))
            }
        };
        Ok(BinaryOutputs {
            all,
            outputs: Vec::new(),
        })
    }

    /// Records output `name`'s own `binary_data`, if its parameters have one.
    pub(super) fn set_from_output_parameters(
        &mut self,
        name: &str,
        params: Option<&Map<String, Value>>,
    ) -> Result<()> {
        match params.and_then(|p| p.get("binary_data")) {
            None => Ok(()),
            Some(Value::Bool(b)) => {
                self.outputs.push((name.to_owned(), *b));
                Ok(())
            }
            Some(other) => Err(ProtocolError::invalid(format!(
                "output `{name}`: `binary_data` must be a boolean, got {other}"
            ))),
        }
    }
}

/// An encoded message: the JSON part, then each binary tensor's bytes in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Encoded {
    /// The JSON (the whole message when `binary` is empty).
    pub json: Vec<u8>,
    /// The binary tensors in order (zero-length ones included); empty when the
    /// message is JSON only.
    pub binary: Vec<Bytes>,
}

impl Encoded {
    /// The `Inference-Header-Content-Length` to send: the JSON's length when the
    /// message has binary tensors.
    pub fn header_length(&self) -> Option<usize> {
        (!self.binary.is_empty()).then_some(self.json.len())
    }

    /// The length of the whole body.
    pub fn body_len(&self) -> usize {
        self.json.len() + self.binary.iter().map(Bytes::len).sum::<usize>()
    }

    /// The whole body in one buffer.
    pub fn into_body(self) -> Vec<u8> {
        let mut body = Vec::with_capacity(self.body_len());
        body.extend_from_slice(&self.json);
        for chunk in &self.binary {
            body.extend_from_slice(chunk);
        }
        body
    }
}

/// Splits `body` into its JSON and binary parts by the value of the
/// `Inference-Header-Content-Length` header (`None`: all JSON).
pub fn split(body: Bytes, header: Option<&[u8]>) -> Result<(Bytes, Bytes)> {
    let Some(header) = header else {
        return Ok((body, Bytes::new()));
    };
    let length = std::str::from_utf8(header)
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .ok_or_else(|| {
            ProtocolError::invalid(format!(
                "{INFERENCE_HEADER_CONTENT_LENGTH} `{}` is not a byte count",
                String::from_utf8_lossy(header)
            ))
        })?;
    if length > body.len() {
        return Err(ProtocolError::invalid(format!(
            "{INFERENCE_HEADER_CONTENT_LENGTH} is {length} but the body has only {} bytes",
            body.len()
        )));
    }
    let binary = body.slice(length..);
    let mut json = body;
    json.truncate(length);
    Ok((json, binary))
}

/// A tensor's `binary_data_size` parameter, if it has one (`kind`: "input" or
/// "output", for messages).
pub(super) fn binary_data_size(
    kind: &str,
    name: &str,
    params: Option<&Map<String, Value>>,
) -> Result<Option<usize>> {
    match params {
        None => Ok(None),
        Some(p) => byte_count(p, "binary_data_size", || format!("{kind} `{name}`: ")),
    }
}

/// `params[key]` as a byte count, if present; `context` begins the error message.
pub fn byte_count(
    params: &Map<String, Value>,
    key: &str,
    context: impl FnOnce() -> String,
) -> Result<Option<usize>> {
    match params.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                ProtocolError::invalid(format!(
                    "{}`{key}` must be a non-negative integer, got {v}",
                    context()
                ))
            }),
    }
}

/// A tensor whose data arrives as a byte count (`param`: the parameter that gave
/// it) rather than as JSON values: what its size is checked against.
pub(super) struct SizedTensor<'a> {
    /// "input" or "output", for messages.
    pub kind: &'a str,
    pub name: &'a str,
    pub dtype: DataType,
    pub shape: &'a [i64],
    /// Elements of `shape`.
    pub elements: usize,
    pub param: &'a str,
}

impl SizedTensor<'_> {
    /// A fixed-size datatype's `size` must be exactly the shape's bytes.
    pub(super) fn check_size(&self, size: usize) -> Result<()> {
        let SizedTensor {
            kind,
            name,
            dtype,
            shape,
            param,
            ..
        } = self;
        if let Some(width) = dtype.size() {
            let needed = self.elements.checked_mul(width);
            if needed != Some(size) {
                return Err(ProtocolError::invalid(format!(
                    "{kind} `{name}`: {param} {size} does not match shape {shape:?} of \
                     {dtype} ({} bytes)",
                    needed.map_or_else(|| "too many".to_owned(), |n| n.to_string())
                )));
            }
        }
        Ok(())
    }

    /// BYTES elements must fill `data` exactly.
    pub(super) fn check_bytes(&self, data: &[u8]) -> Result<()> {
        let SizedTensor {
            kind,
            name,
            dtype,
            elements,
            param,
            ..
        } = self;
        if *dtype != DataType::Bytes {
            return Ok(());
        }
        let size = data.len();
        match tensor_byte_len(*dtype, *elements, data) {
            Ok(n) if n == size => Ok(()),
            Ok(n) => Err(ProtocolError::invalid(format!(
                "{kind} `{name}`: {param} {size} but its {elements} BYTES elements take {n} bytes"
            ))),
            Err(e) => Err(ProtocolError::invalid(format!(
                "{kind} `{name}`: BYTES data of {size} bytes ({param}): {e}"
            ))),
        }
    }
}

/// The binary part of a message, handed out tensor by tensor in order.
pub(super) struct BinaryPart {
    data: Bytes,
    taken: usize,
}

impl BinaryPart {
    pub(super) fn new(data: Bytes) -> Self {
        BinaryPart { data, taken: 0 }
    }

    /// The next `size` bytes, as the data of a tensor of `dtype` and `shape`
    /// (`elements` elements); the size must fit them exactly.
    pub(super) fn take(
        &mut self,
        kind: &str,
        name: &str,
        dtype: DataType,
        shape: &[i64],
        elements: usize,
        size: usize,
    ) -> Result<Bytes> {
        let tensor = SizedTensor {
            kind,
            name,
            dtype,
            shape,
            elements,
            param: "binary_data_size",
        };
        tensor.check_size(size)?;
        let left = self.data.len() - self.taken;
        if size > left {
            return Err(ProtocolError::invalid(format!(
                "{kind} `{name}`: binary_data_size {size} runs past the end of the binary data \
                 ({left} of {} bytes left)",
                self.data.len()
            )));
        }
        let data = self.data.slice(self.taken..self.taken + size);
        self.taken += size;
        tensor.check_bytes(&data)?;
        Ok(data)
    }

    /// Every byte must belong to a tensor (`what`: "inputs" or "outputs").
    pub(super) fn finish(&self, what: &str) -> Result<()> {
        if self.taken != self.data.len() {
            return Err(ProtocolError::invalid(format!(
                "the binary data has {} bytes but the {what}' binary_data_size add up to {}",
                self.data.len(),
                self.taken
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
