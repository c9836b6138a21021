//! KServe v2 JSON: decoding inference requests (tensor data parsed straight into
//! little-endian bytes by datatype, nested or flat arrays) and encoding responses.
//! The same code reads and writes the JSON header of the binary tensor data
//! extension ([`super::binary`]): a tensor with `binary_data_size` takes its bytes
//! from the binary part instead of `data`, and one with `shared_memory_region` from
//! a registered shared-memory region ([`super::shm`]).

use bytes::Bytes;
use kiln_types::{DataType, Param, ParamValue, Shape};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use data::decode_data;
pub use data::DataJson;

use super::binary::{binary_data_size, BinaryOutputs, BinaryPart, Encoded, SizedTensor};
use super::shm_tensors::{input_window, shm_place, InShm, OutputPlacement, ShmReads};
use crate::error::{ProtocolError, Result};
use crate::infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
use crate::shm_regions::{NoSharedMemory, ShmRegions};

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

mod data;
#[cfg(test)]
mod tests;
