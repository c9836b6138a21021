//! KServe v2 JSON: decoding inference requests (tensor data parsed straight into
//! little-endian bytes by datatype, nested or flat arrays) and encoding responses.
//! The same code reads and writes the JSON header of the binary tensor data
//! extension ([`super::binary`]): a tensor with `binary_data_size` takes its bytes
//! from the binary part instead of `data`, and one with `shared_memory_region` from
//! a registered shared-memory region ([`super::shm`]).

use std::fmt;

use bytes::Bytes;
use half::{bf16, f16};
use kiln_types::{DataType, Param, ParamValue, Shape};
use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::binary::{binary_data_size, BinaryOutputs, BinaryPart, Encoded, SizedTensor};
use super::shm::{input_window, shm_place, InShm, OutputPlacement, ShmReads};
use crate::error::{ProtocolError, Result};
use crate::infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
use crate::shm::{NoSharedMemory, ShmRegions};

#[derive(Deserialize)]
struct RequestJson<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(borrow)]
    inputs: Vec<InputJson<'a>>,
    #[serde(default)]
    outputs: Option<Vec<OutputRequestJson>>,
}

#[derive(Deserialize)]
struct InputJson<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct OutputRequestJson {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

/// Decodes a KServe v2 JSON inference request for `model`.
pub fn decode_request(model: &str, body: &[u8]) -> Result<InferRequest> {
    decode_request_parts(model, body, Bytes::new(), None::<&NoSharedMemory>)
        .map(|(request, ..)| request)
}

/// Decodes the JSON header `json` of a request whose binary tensors are `binary`,
/// its shared-memory tensors in `shm` (none allowed without it); also returns where
/// the client wants each output, and the shared-memory inputs still to be read
/// (their data is empty until [`ShmReads::read_into`] fills it).
#[allow(clippy::type_complexity)]
pub fn decode_request_parts<R: ShmRegions>(
    model: &str,
    json: &[u8],
    binary: Bytes,
    shm: Option<&R>,
) -> Result<(
    InferRequest,
    OutputPlacement<R::Window>,
    ShmReads<R::Window>,
)> {
    let parsed: RequestJson<'_> = serde_json::from_slice(json)
        .map_err(|e| ProtocolError::invalid(format!("malformed inference request: {e}")))?;
    let mut part = BinaryPart::new(binary);
    let mut reads = ShmReads::default();
    let inputs = parsed
        .inputs
        .into_iter()
        .enumerate()
        .map(|(i, input)| decode_tensor(input, "input", &mut part, shm.map(|s| (s, i, &mut reads))))
        .collect::<Result<Vec<_>>>()?;
    part.finish("inputs")?;
    let mut parameters = parsed.parameters.unwrap_or_default();
    let mut placement = OutputPlacement::from_request_parameters(&mut parameters)?;
    let outputs = match parsed.outputs {
        None => None,
        Some(outs) => Some(
            outs.into_iter()
                .map(|o| {
                    placement.set_from_output_parameters(&o.name, o.parameters.as_ref(), shm)?;
                    Ok(o.name)
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    let request = InferRequest {
        model: model.to_owned(),
        id: parsed.id,
        inputs,
        outputs,
        parameters: params_from_json(parameters)?,
    };
    Ok((request, placement, reads))
}

/// Where a request's tensor `index` reads shared memory from: the registry, and the
/// list its window joins.
type ShmTarget<'a, 'r, R> = (&'a R, usize, &'r mut ShmReads<<R as ShmRegions>::Window>);

/// One tensor (`kind` is "input" or "output"), its data from `data`, with
/// `binary_data_size` from the binary part, or with `shared_memory_region` from a
/// window of `shm` (checked now, its data left empty and its window added to the
/// reads; refused without `shm`).
fn decode_tensor<R: ShmRegions>(
    input: InputJson<'_>,
    kind: &str,
    part: &mut BinaryPart,
    shm: Option<ShmTarget<'_, '_, R>>,
) -> Result<InputTensor> {
    let name = &input.name;
    let dtype = DataType::parse(&input.datatype).ok_or_else(|| {
        ProtocolError::invalid(format!(
            "{kind} `{name}`: unknown datatype `{}`",
            input.datatype
        ))
    })?;
    let elements = Shape::new(&input.shape)
        .filter(|_| input.shape.iter().all(|&d| d >= 0))
        .map(|s| s.element_count())
        .ok_or_else(|| {
            ProtocolError::invalid(format!(
                "{kind} `{name}`: shape {:?} is invalid",
                input.shape
            ))
        })?;
    let binary_size = binary_data_size(kind, name, input.parameters.as_ref())?;
    let in_shm = shm_place(kind, name, input.parameters.as_ref())?;
    let both = |a: &str, b: &str| {
        Err(ProtocolError::invalid(format!(
            "{kind} `{name}` has both `{a}` and `{b}`"
        )))
    };
    let data = match (input.data, binary_size, in_shm) {
        (Some(_), Some(_), _) => return both("data", "binary_data_size"),
        (Some(_), None, Some(_)) => return both("data", "shared_memory_region"),
        (None, Some(_), Some(_)) => return both("binary_data_size", "shared_memory_region"),
        (None, None, None) => {
            return Err(ProtocolError::invalid(format!(
                "{kind} `{name}` has no data (no `data`, `parameters.binary_data_size` or \
                 `parameters.shared_memory_region`)"
            )))
        }
        (Some(raw), None, None) => decode_data(dtype, elements, raw)
            .map_err(|e| ProtocolError::invalid(format!("{kind} `{name}` ({dtype}): {e}")))?,
        (None, Some(size), None) => part.take(kind, name, dtype, &input.shape, elements, size)?,
        (None, None, Some(params)) => {
            let tensor = SizedTensor {
                kind,
                name,
                dtype,
                shape: &input.shape,
                elements,
                param: "shared_memory_byte_size",
            };
            let window = input_window(&tensor, &params, shm.as_ref().map(|s| s.0))?;
            if let Some((_, index, reads)) = shm {
                reads.push(index, window, elements);
            }
            Bytes::new()
        }
    };
    Ok(InputTensor {
        name: input.name,
        dtype,
        shape: input.shape,
        data,
    })
}

/// Parameters from a JSON object of booleans, numbers and strings.
pub fn params_from_json(map: Map<String, Value>) -> Result<Vec<Param>> {
    map.into_iter()
        .map(|(key, value)| {
            let value = match value {
                Value::Bool(b) => ParamValue::Bool(b),
                Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                    (Some(i), _) => ParamValue::Int(i),
                    (None, Some(u)) => ParamValue::Uint(u),
                    (None, None) => ParamValue::Float(n.as_f64().unwrap_or(f64::NAN)),
                },
                Value::String(s) => ParamValue::Str(s.into()),
                other => {
                    return Err(ProtocolError::invalid(format!(
                        "parameter `{key}` must be a boolean, number or string, got {other}"
                    )))
                }
            };
            Ok(Param {
                key: key.into(),
                value,
            })
        })
        .collect()
}

/// Load parameters from a JSON object: as [`params_from_json`], and the list of a
/// list parameter (Triton's `"preferred_batch_size": [4, 8]`) is its
/// comma-separated text (`"4,8"`), the form every ingress shares.
pub fn load_params_from_json(mut map: Map<String, Value>) -> Result<Vec<Param>> {
    for (key, value) in map.iter_mut() {
        if let (true, Value::Array(items)) = (crate::params::takes_list(key), &*value) {
            let text = items
                .iter()
                .map(|item| match item {
                    Value::Number(n) => Ok(n.to_string()),
                    Value::String(s) => Ok(s.clone()),
                    other => Err(ProtocolError::invalid(format!(
                        "parameter `{key}`: a list of numbers or strings, got {other}"
                    ))),
                })
                .collect::<Result<Vec<_>>>()?;
            *value = Value::String(text.join(","));
        }
    }
    params_from_json(map)
}

fn decode_data(dtype: DataType, elements: usize, raw: &RawValue) -> Result<Bytes, String> {
    let mut out = Vec::with_capacity(reserve(dtype, elements, raw.get().len()));
    let mut count = 0usize;
    let mut de = serde_json::Deserializer::from_str(raw.get());
    Flat {
        dtype,
        out: &mut out,
        count: &mut count,
        limit: elements,
    }
    .deserialize(&mut de)
    .map_err(|e| e.to_string())?;
    if count != elements {
        return Err(format!(
            "the shape holds {elements} elements but data has {count}"
        ));
    }
    Ok(Bytes::from(out))
}

/// The bytes to reserve for `elements` values of `dtype` written as `json_len` bytes
/// of JSON: what the shape declares, but never more than that JSON can hold (the
/// shape is not yet checked against the model, and `[16777216]` with three values
/// must not reserve 16 MiB). Each value takes at least one character and a
/// separator; BYTES values, of unknown size, get the JSON's length and grow.
fn reserve(dtype: DataType, elements: usize, json_len: usize) -> usize {
    match dtype.size() {
        Some(size) => size.saturating_mul(elements.min(json_len / 2 + 1)),
        None => json_len,
    }
}

/// Flattens nested JSON arrays of scalars into little-endian bytes of `dtype`.
struct Flat<'o> {
    dtype: DataType,
    out: &'o mut Vec<u8>,
    count: &'o mut usize,
    limit: usize,
}

impl Flat<'_> {
    fn reborrow(&mut self) -> Flat<'_> {
        Flat {
            dtype: self.dtype,
            out: self.out,
            count: self.count,
            limit: self.limit,
        }
    }

    fn element<E: de::Error>(&mut self) -> Result<(), E> {
        *self.count += 1;
        if *self.count > self.limit {
            return Err(E::custom(format!(
                "data has more elements than the shape's {}",
                self.limit
            )));
        }
        Ok(())
    }

    fn int<E: de::Error>(&mut self, v: i128) -> Result<(), E> {
        self.element()?;
        let range = || E::custom(format!("{v} is out of range for {}", self.dtype));
        let out = &mut *self.out;
        match self.dtype {
            DataType::Uint8 => out.push(u8::try_from(v).map_err(|_| range())?),
            DataType::Uint16 => out.extend(u16::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Uint32 => out.extend(u32::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Uint64 => out.extend(u64::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int8 => out.extend(i8::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int16 => out.extend(i16::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int32 => out.extend(i32::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int64 => out.extend(i64::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Fp16 | DataType::Bf16 | DataType::Fp32 | DataType::Fp64 => {
                return self.float_value(v as f64)
            }
            DataType::Bool => match v {
                0 | 1 => out.push(v as u8),
                _ => return Err(E::custom(format!("{v} is not a boolean"))),
            },
            DataType::Bytes => return Err(E::custom("expected a string, got a number")),
        }
        Ok(())
    }

    fn float_value<E: de::Error>(&mut self, v: f64) -> Result<(), E> {
        let out = &mut *self.out;
        match self.dtype {
            DataType::Fp16 => out.extend(f16::from_f64(v).to_le_bytes()),
            DataType::Bf16 => out.extend(bf16::from_f64(v).to_le_bytes()),
            DataType::Fp32 => out.extend((v as f32).to_le_bytes()),
            DataType::Fp64 => out.extend(v.to_le_bytes()),
            other => {
                return Err(E::custom(format!(
                    "expected an integer for {other}, got {v}"
                )))
            }
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Flat<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Flat<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an array of {} values", self.dtype)
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self.reborrow())?.is_some() {}
        Ok(())
    }

    fn visit_u64<E: de::Error>(mut self, v: u64) -> Result<(), E> {
        self.int(i128::from(v))
    }

    fn visit_i64<E: de::Error>(mut self, v: i64) -> Result<(), E> {
        self.int(i128::from(v))
    }

    fn visit_f64<E: de::Error>(mut self, v: f64) -> Result<(), E> {
        self.element()?;
        self.float_value(v)
    }

    fn visit_bool<E: de::Error>(mut self, v: bool) -> Result<(), E> {
        if self.dtype != DataType::Bool {
            return Err(E::custom(format!(
                "expected {} values, got a boolean",
                self.dtype
            )));
        }
        self.element()?;
        self.out.push(u8::from(v));
        Ok(())
    }

    fn visit_str<E: de::Error>(mut self, v: &str) -> Result<(), E> {
        if self.dtype != DataType::Bytes {
            return Err(E::custom(format!(
                "expected {} values, got a string",
                self.dtype
            )));
        }
        self.element()?;
        let len = u32::try_from(v.len()).map_err(|_| E::custom("string longer than 4 GiB"))?;
        self.out.extend(len.to_le_bytes());
        self.out.extend_from_slice(v.as_bytes());
        Ok(())
    }
}

#[derive(Serialize)]
struct ResponseJson<'a> {
    model_name: &'a str,
    model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    outputs: Vec<OutputJson<'a>>,
}

#[derive(Serialize)]
struct OutputJson<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [i64],
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<BinarySizeJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<DataJson<'a>>,
}

#[derive(Serialize)]
struct BinarySizeJson {
    binary_data_size: usize,
}

/// A tensor's JSON: its `data`, or when `binary` its `binary_data_size`, its bytes
/// then appended to `chunks` (a cheap clone of the `Bytes`).
fn tensor_json<'a>(
    name: &'a str,
    dtype: DataType,
    shape: &'a [i64],
    data: &'a Bytes,
    binary: bool,
    chunks: &mut Vec<Bytes>,
) -> OutputJson<'a> {
    let (parameters, data) = if binary {
        chunks.push(data.clone());
        let size = data.len();
        (
            Some(BinarySizeJson {
                binary_data_size: size,
            }),
            None,
        )
    } else {
        (None, Some(DataJson { dtype, bytes: data }))
    };
    OutputJson {
        name,
        datatype: dtype.as_str(),
        shape,
        parameters,
        data,
    }
}

/// Tensor bytes written as a flat JSON array of their datatype's values (KServe's
/// `data`; the WebSocket stream's results use it too).
pub struct DataJson<'a> {
    pub dtype: DataType,
    pub bytes: &'a [u8],
}

macro_rules! seq_of {
    ($seq:ident, $bytes:expr, $t:ty, $n:literal, $map:expr) => {
        for chunk in $bytes.chunks_exact($n) {
            let mut word = [0u8; $n];
            word.copy_from_slice(chunk);
            $seq.serialize_element(&$map(<$t>::from_le_bytes(word)))?;
        }
    };
}

impl Serialize for DataJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.bytes;
        let mut seq = s.serialize_seq(None)?;
        match self.dtype {
            DataType::Bool => seq_of!(seq, b, u8, 1, |v: u8| v != 0),
            DataType::Uint8 => seq_of!(seq, b, u8, 1, |v| v),
            DataType::Uint16 => seq_of!(seq, b, u16, 2, |v| v),
            DataType::Uint32 => seq_of!(seq, b, u32, 4, |v| v),
            DataType::Uint64 => seq_of!(seq, b, u64, 8, |v| v),
            DataType::Int8 => seq_of!(seq, b, i8, 1, |v| v),
            DataType::Int16 => seq_of!(seq, b, i16, 2, |v| v),
            DataType::Int32 => seq_of!(seq, b, i32, 4, |v| v),
            DataType::Int64 => seq_of!(seq, b, i64, 8, |v| v),
            DataType::Fp16 => seq_of!(seq, b, u16, 2, |v| f16::from_bits(v).to_f32()),
            DataType::Bf16 => seq_of!(seq, b, u16, 2, |v| bf16::from_bits(v).to_f32()),
            DataType::Fp32 => seq_of!(seq, b, f32, 4, |v| v),
            DataType::Fp64 => seq_of!(seq, b, f64, 8, |v| v),
            DataType::Bytes => {
                let mut rest = b;
                while let Some((len, tail)) = rest.split_first_chunk::<4>() {
                    let len = (u32::from_le_bytes(*len) as usize).min(tail.len());
                    let (item, tail) = tail.split_at(len);
                    seq.serialize_element(&String::from_utf8_lossy(item))?;
                    rest = tail;
                }
            }
        }
        seq.end()
    }
}

#[derive(Serialize)]
struct RequestOutJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    inputs: Vec<OutputJson<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    outputs: Option<Vec<Value>>,
    #[serde(skip_serializing_if = "Map::is_empty")]
    parameters: Map<String, Value>,
}

/// Encodes a request as KServe v2 JSON (what a client sends).
pub fn encode_request(request: &InferRequest) -> Vec<u8> {
    encode_request_parts(request, false).json
}

/// Encodes a request; with `binary`, every input as binary tensor data and every
/// output asked for as binary (`binary_data_output`).
pub(super) fn encode_request_parts(request: &InferRequest, binary: bool) -> Encoded {
    let mut chunks = Vec::new();
    let inputs = request
        .inputs
        .iter()
        .map(|t| tensor_json(&t.name, t.dtype, &t.shape, &t.data, binary, &mut chunks))
        .collect();
    let mut parameters: Map<String, Value> = request
        .parameters
        .iter()
        .map(|p| {
            let value = match &p.value {
                ParamValue::Bool(b) => Value::from(*b),
                ParamValue::Int(i) => Value::from(*i),
                ParamValue::Float(f) => Value::from(*f),
                ParamValue::Str(s) => Value::from(s.as_str()),
                ParamValue::Uint(u) => Value::from(*u),
            };
            (p.key.to_string(), value)
        })
        .collect();
    if binary {
        parameters.insert("binary_data_output".into(), Value::Bool(true));
    }
    let json = RequestOutJson {
        id: request.id.as_deref(),
        inputs,
        outputs: request.outputs.as_ref().map(|names| {
            names
                .iter()
                .map(|n| serde_json::json!({ "name": n }))
                .collect()
        }),
        parameters,
    };
    Encoded {
        json: serde_json::to_vec(&json).unwrap_or_default(),
        binary: chunks,
    }
}

#[derive(Deserialize)]
struct ResponseInJson<'a> {
    model_name: String,
    #[serde(default)]
    model_version: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(borrow)]
    outputs: Vec<InputJson<'a>>,
}

/// Decodes a KServe v2 JSON response (what a client receives).
pub fn decode_response(body: &[u8]) -> Result<InferResponse> {
    decode_response_parts(body, Bytes::new())
}

/// Decodes the JSON header `json` of a response whose binary tensors are `binary`.
pub(super) fn decode_response_parts(json: &[u8], binary: Bytes) -> Result<InferResponse> {
    let parsed: ResponseInJson<'_> = serde_json::from_slice(json)
        .map_err(|e| ProtocolError::invalid(format!("malformed inference response: {e}")))?;
    let mut part = BinaryPart::new(binary);
    let mut outputs = Vec::with_capacity(parsed.outputs.len());
    for out in parsed.outputs {
        let tensor = decode_tensor::<NoSharedMemory>(out, "output", &mut part, None)?;
        outputs.push(OutputTensor {
            name: tensor.name,
            dtype: tensor.dtype,
            shape: tensor.shape,
            data: tensor.data,
        });
    }
    part.finish("outputs")?;
    Ok(InferResponse {
        model_name: parsed.model_name,
        model_version: parsed.model_version,
        id: parsed.id,
        outputs,
    })
}

/// Encodes a response as KServe v2 JSON.
pub fn encode_response(response: &InferResponse) -> Vec<u8> {
    encode_response_parts(response, &BinaryOutputs::default(), &[]).json
}

/// Encodes a response, the outputs `binary` names as binary tensor data and those
/// `in_shm` names (already written there) as shared-memory parameters.
pub(super) fn encode_response_parts(
    response: &InferResponse,
    binary: &BinaryOutputs,
    in_shm: &[InShm<'_>],
) -> Encoded {
    let mut chunks = Vec::new();
    let outputs = response
        .outputs
        .iter()
        .map(|o| match in_shm.iter().find(|s| s.output == o.name) {
            // Written into shared memory: no data and, as Triton answers, no
            // parameters (Triton's C++ client reads `binary_data_size` from any
            // output that has parameters).
            Some(_) => OutputJson {
                name: &o.name,
                datatype: o.dtype.as_str(),
                shape: &o.shape,
                parameters: None,
                data: None,
            },
            None => {
                let as_binary = binary.is_binary(&o.name);
                tensor_json(&o.name, o.dtype, &o.shape, &o.data, as_binary, &mut chunks)
            }
        })
        .collect();
    let json = ResponseJson {
        model_name: &response.model_name,
        model_version: &response.model_version,
        id: response.id.as_deref(),
        outputs,
    };
    Encoded {
        // Serializing plain structs of numbers and strings into memory cannot fail.
        json: serde_json::to_vec(&json).unwrap_or_default(),
        binary: chunks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_input(datatype: &str, shape: &str, data: &str) -> Result<InferRequest> {
        let body = format!(
            r#"{{"id":"7","inputs":[{{"name":"x","shape":{shape},"datatype":"{datatype}","data":{data}}}]}}"#
        );
        decode_request("m", body.as_bytes())
    }

    #[test]
    fn decodes_every_datatype() {
        let cases: Vec<(&str, &str, Vec<u8>)> = vec![
            ("BOOL", "[true,false]", vec![1, 0]),
            ("UINT8", "[1,255]", vec![1, 255]),
            ("UINT16", "[1,2]", vec![1, 0, 2, 0]),
            ("UINT32", "[[1],[2]]", vec![1, 0, 0, 0, 2, 0, 0, 0]),
            (
                "UINT64",
                "[1,2]",
                [1u64.to_le_bytes(), 2u64.to_le_bytes()].concat(),
            ),
            ("INT8", "[-1,2]", vec![255, 2]),
            ("INT16", "[-1,2]", vec![255, 255, 2, 0]),
            (
                "INT32",
                "[-1,2]",
                [(-1i32).to_le_bytes(), 2i32.to_le_bytes()].concat(),
            ),
            (
                "INT64",
                "[-1,2]",
                [(-1i64).to_le_bytes(), 2i64.to_le_bytes()].concat(),
            ),
            (
                "FP16",
                "[1.0,2]",
                [
                    f16::from_f32(1.0).to_le_bytes(),
                    f16::from_f32(2.0).to_le_bytes(),
                ]
                .concat(),
            ),
            (
                "BF16",
                "[1.0,2]",
                [
                    bf16::from_f32(1.0).to_le_bytes(),
                    bf16::from_f32(2.0).to_le_bytes(),
                ]
                .concat(),
            ),
            (
                "FP32",
                "[1.5,2]",
                [1.5f32.to_le_bytes(), 2f32.to_le_bytes()].concat(),
            ),
            (
                "FP64",
                "[1.5,2]",
                [1.5f64.to_le_bytes(), 2f64.to_le_bytes()].concat(),
            ),
            (
                "BYTES",
                r#"["ab",""]"#,
                vec![2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0],
            ),
        ];
        for (dtype, data, want) in cases {
            let req = one_input(dtype, "[2]", data).unwrap_or_else(|e| panic!("{dtype}: {e}"));
            assert_eq!(req.inputs[0].data.as_ref(), want.as_slice(), "{dtype}");
            assert_eq!(req.id.as_deref(), Some("7"));
        }
    }

    #[test]
    fn refuses_bad_data() {
        for (dtype, shape, data, want) in [
            ("UINT8", "[2]", "[1,256]", "out of range"),
            ("INT32", "[2]", "[1,2.5]", "expected an integer"),
            ("FP32", "[2]", "[1,\"a\"]", "got a string"),
            ("BYTES", "[1]", "[1]", "expected a string"),
            ("FP32", "[3]", "[1,2]", "holds 3 elements but data has 2"),
            ("FP32", "[1]", "[1,2]", "more elements"),
            ("FP33", "[1]", "[1]", "unknown datatype"),
            ("FP32", "[-1]", "[1]", "invalid"),
            ("BOOL", "[1]", "[2]", "not a boolean"),
            ("FP32", "[1]", "{}", "invalid type"),
        ] {
            let err = one_input(dtype, shape, data).unwrap_err().to_string();
            assert!(err.contains(want), "{dtype} {data}: {err}");
        }
        assert!(decode_request("m", b"{").is_err());
        assert!(decode_request(
            "m",
            b"{\"inputs\":[{\"name\":\"x\",\"shape\":[1],\"datatype\":\"FP32\"}]}"
        )
        .unwrap_err()
        .to_string()
        .contains("no data"));
    }

    #[test]
    fn reserves_what_the_json_can_hold() {
        // Three values declared as 16 Mi: the reserve follows the JSON.
        assert_eq!(reserve(DataType::Uint8, 1 << 24, "[1,2,3]".len()), 4);
        assert_eq!(reserve(DataType::Fp64, 1 << 24, 7), 32);
        // The shape's size when the JSON could hold it.
        assert_eq!(reserve(DataType::Int32, 3, 7), 12);
        assert_eq!(reserve(DataType::Bytes, 1 << 24, 9), 9);
        assert_eq!(reserve(DataType::Fp32, usize::MAX, usize::MAX), usize::MAX);
        let err = one_input("UINT8", "[16777216]", "[1,2,3]").unwrap_err();
        assert!(
            err.to_string()
                .contains("the shape holds 16777216 elements but data has 3"),
            "{err}"
        );
    }

    #[test]
    fn encodes_outputs() {
        let response = InferResponse {
            model_name: "m".into(),
            model_version: "1".into(),
            id: Some("9".into()),
            outputs: vec![
                OutputTensor {
                    name: "y".into(),
                    dtype: DataType::Fp16,
                    shape: vec![1, 2],
                    data: Bytes::from(
                        [
                            f16::from_f32(0.5).to_le_bytes(),
                            f16::from_f32(-2.0).to_le_bytes(),
                        ]
                        .concat(),
                    ),
                },
                OutputTensor {
                    name: "s".into(),
                    dtype: DataType::Bytes,
                    shape: vec![2],
                    data: Bytes::from_static(&[1, 0, 0, 0, b'z', 0, 0, 0, 0]),
                },
            ],
        };
        let v: Value = serde_json::from_slice(&encode_response(&response)).unwrap();
        assert_eq!(v["id"], "9");
        assert_eq!(v["outputs"][0]["data"], serde_json::json!([0.5, -2.0]));
        assert_eq!(v["outputs"][0]["datatype"], "FP16");
        assert_eq!(v["outputs"][1]["data"], serde_json::json!(["z", ""]));
        assert_eq!(
            decode_response(&encode_response(&response)).unwrap(),
            response
        );
    }

    #[test]
    fn request_round_trip() {
        let request = InferRequest {
            model: "m".into(),
            id: Some("x".into()),
            inputs: vec![InputTensor::from_slice(
                "a",
                DataType::Int16,
                &[1, 2],
                &[-3i16, 4],
            )],
            outputs: Some(vec!["y".into()]),
            parameters: vec![
                Param {
                    key: "k".into(),
                    value: ParamValue::Int(3),
                },
                Param {
                    key: "u".into(),
                    value: ParamValue::Uint(u64::MAX),
                },
            ],
        };
        assert_eq!(
            decode_request("m", &encode_request(&request)).unwrap(),
            request
        );
        // Integers take one form: `Int` up to i64::MAX, `Uint` beyond.
        let params = params_from_json(
            serde_json::from_str(
                r#"{"a": 9223372036854775807, "b": 9223372036854775808, "c": -1}"#,
            )
            .unwrap(),
        )
        .unwrap();
        let values: Vec<_> = params.into_iter().map(|p| p.value).collect();
        assert_eq!(
            values,
            [
                ParamValue::Int(i64::MAX),
                ParamValue::Uint(1 << 63),
                ParamValue::Int(-1)
            ]
        );
    }

    #[test]
    fn load_lists_are_comma_separated_text() {
        let params = load_params_from_json(
            serde_json::from_str(r#"{"Preferred_Batch_Size": [4, "8"]}"#).unwrap(),
        )
        .unwrap();
        assert_eq!(params.len(), 1);
        assert!(params[0].key.eq_ignore_ascii_case("preferred_batch_size"));
        assert_eq!(params[0].value, ParamValue::Str("4,8".into()));
        for bad in [
            r#"{"preferred_batch_size": [[1]]}"#,
            r#"{"batch_size": [4]}"#,
        ] {
            let err = load_params_from_json(serde_json::from_str(bad).unwrap()).unwrap_err();
            assert!(err.to_string().contains("_size`"), "{err}");
        }
        // Request parameters stay scalars.
        assert!(params_from_json(serde_json::from_str(r#"{"x": [1]}"#).unwrap()).is_err());
    }
}
