//! Conversions between the protocol's messages and kiln's protocol-free types, for
//! the server (requests in, responses out) and for clients (the other way).

use std::collections::HashMap;

use bytes::Bytes;
use kiln_types::{encode_bytes, DataType, Param, ParamValue};

use super::proto::{
    self, infer_parameter::ParameterChoice, model_infer_request::InferInputTensor,
    model_infer_request::InferRequestedOutputTensor, model_infer_response::InferOutputTensor,
    model_repository_parameter, InferParameter, InferTensorContents, ModelInferRequest,
    ModelInferResponse,
};
use crate::error::{ProtocolError, Result};
use crate::infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
use crate::shm_regions::{
    check_fits, NoSharedMemory, ShmPlace, ShmRegions, ShmWindow, BYTE_SIZE, OFFSET, REGION,
};

/// Outputs the client wants written into shared memory: each output's window `W`
/// of a region.
#[derive(Clone)]
pub struct ShmOutputs<W>(Vec<(String, W)>);

impl<W> Default for ShmOutputs<W> {
    fn default() -> Self {
        ShmOutputs(Vec::new())
    }
}

/// Decodes a `ModelInferRequest` into an [`InferRequest`]. Each input's data comes
/// from the next `raw_input_contents` entry when the request has any, else from its
/// typed `contents`; the sizes are checked against shape and datatype when the
/// request is validated against the model. Shared-memory tensors are refused.
pub fn decode_request(request: ModelInferRequest) -> Result<InferRequest> {
    decode(request, None::<&NoSharedMemory>).map(|(request, _)| request)
}

/// [`decode_request`], with inputs copied out of (now: the window is read as the
/// request is decoded) and outputs placed in `shm`'s regions where their
/// parameters name one.
pub fn decode_request_shm<R: ShmRegions>(
    request: ModelInferRequest,
    shm: &R,
) -> Result<(InferRequest, ShmOutputs<R::Window>)> {
    decode(request, Some(shm))
}

fn decode<R: ShmRegions>(
    request: ModelInferRequest,
    shm: Option<&R>,
) -> Result<(InferRequest, ShmOutputs<R::Window>)> {
    let ModelInferRequest {
        model_name,
        id,
        parameters,
        inputs,
        outputs,
        raw_input_contents,
        ..
    } = request;
    let raw_count = raw_input_contents.len();
    let mut raw = raw_input_contents.into_iter();
    let mut raw_taken = 0;
    let mut decoded = Vec::with_capacity(inputs.len());
    for input in inputs {
        let dtype = DataType::parse(&input.datatype).ok_or_else(|| {
            ProtocolError::invalid(format!(
                "input `{}`: unknown datatype `{}`",
                input.name, input.datatype
            ))
        })?;
        let in_shm = shm_window("input", &input.name, &input.parameters, shm)?;
        let has_contents = input.contents.as_ref().is_some_and(|c| !is_empty(c));
        let data = if let Some(window) = in_shm {
            if has_contents {
                return Err(ProtocolError::invalid(format!(
                    "input `{}` has both contents and `{REGION}`",
                    input.name
                )));
            }
            window.read()?
        } else if raw_count > 0 {
            if has_contents {
                return Err(ProtocolError::invalid(format!(
                    "input `{}`: contents and raw_input_contents cannot be mixed",
                    input.name
                )));
            }
            raw_taken += 1;
            raw.next().ok_or_else(|| {
                ProtocolError::invalid(format!(
                    "raw_input_contents has {raw_count} entries, fewer than the inputs"
                ))
            })?
        } else {
            let contents = input.contents.unwrap_or_default();
            contents_to_bytes(&input.name, dtype, contents)?
        };
        decoded.push(InputTensor {
            name: input.name,
            dtype,
            shape: input.shape,
            data,
        });
    }
    if raw.next().is_some() {
        return Err(ProtocolError::invalid(format!(
            "raw_input_contents has {raw_count} entries for {raw_taken} inputs"
        )));
    }
    let mut in_shm = ShmOutputs::default();
    for output in &outputs {
        if let Some(window) = shm_window("output", &output.name, &output.parameters, shm)? {
            in_shm.0.push((output.name.clone(), window));
        }
    }
    let request = InferRequest {
        model: model_name,
        id: (!id.is_empty()).then_some(id),
        inputs: decoded,
        outputs: (!outputs.is_empty()).then(|| outputs.into_iter().map(|o| o.name).collect()),
        parameters: params_from_proto(parameters)?,
    };
    Ok((request, in_shm))
}

/// The shared-memory window a tensor's `parameters` name, if any.
fn shm_window<R: ShmRegions>(
    kind: &str,
    name: &str,
    parameters: &HashMap<String, InferParameter>,
    shm: Option<&R>,
) -> Result<Option<R::Window>> {
    let size = |key: &str| -> Result<Option<usize>> {
        let value = match parameters
            .get(key)
            .and_then(|p| p.parameter_choice.as_ref())
        {
            None => return Ok(None),
            Some(ParameterChoice::Int64Param(v)) => u64::try_from(*v).ok(),
            Some(ParameterChoice::Uint64Param(v)) => Some(*v),
            Some(_) => None,
        };
        value
            .and_then(|v| usize::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| {
                ProtocolError::invalid(format!(
                    "{kind} `{name}`: `{key}` must be a non-negative integer"
                ))
            })
    };
    let (byte_size, offset) = (size(BYTE_SIZE)?, size(OFFSET)?);
    let region = parameters
        .get(REGION)
        .and_then(|p| p.parameter_choice.as_ref())
        .map(|region| match region {
            ParameterChoice::StringParam(region) => Ok(region.as_str()),
            _ => Err(String::new()),
        });
    // An unknown region is the request's fault, as over REST.
    ShmPlace::from_parameters(kind, name, region, byte_size, offset)?
        .map(|place| place.window(kind, name, shm))
        .transpose()
}

/// Encodes an [`InferResponse`]: every output's data in `raw_output_contents`.
pub fn encode_response(response: InferResponse) -> ModelInferResponse {
    encode(response, &ShmOutputs::<NoSharedMemory>::default())
}

/// [`encode_response`], after writing the outputs `in_shm` names into their
/// windows: those have an empty raw entry (keeping the others' positions) and their
/// region and size in their `parameters`. An output larger than its window is an
/// error.
pub fn encode_response_shm<W: ShmWindow>(
    response: InferResponse,
    in_shm: &ShmOutputs<W>,
) -> Result<ModelInferResponse> {
    for output in &response.outputs {
        if let Some((_, window)) = in_shm.0.iter().find(|(n, _)| *n == output.name) {
            check_fits(output, window)?;
        }
    }
    for output in &response.outputs {
        if let Some((_, window)) = in_shm.0.iter().find(|(n, _)| *n == output.name) {
            window.write(&output.data)?;
        }
    }
    Ok(encode(response, in_shm))
}

fn encode<W: ShmWindow>(response: InferResponse, in_shm: &ShmOutputs<W>) -> ModelInferResponse {
    let mut outputs = Vec::with_capacity(response.outputs.len());
    let mut raw = Vec::with_capacity(response.outputs.len());
    for output in response.outputs {
        let mut parameters = HashMap::new();
        let mut data = output.data;
        if let Some((_, window)) = in_shm.0.iter().find(|(n, _)| *n == output.name) {
            let param = |choice| InferParameter {
                parameter_choice: Some(choice),
            };
            parameters.insert(
                REGION.to_owned(),
                param(ParameterChoice::StringParam(window.region().to_owned())),
            );
            parameters.insert(
                BYTE_SIZE.to_owned(),
                param(ParameterChoice::Int64Param(
                    i64::try_from(data.len()).unwrap_or(i64::MAX),
                )),
            );
            data = Bytes::new();
        }
        outputs.push(InferOutputTensor {
            name: output.name,
            datatype: output.dtype.as_str().to_owned(),
            shape: output.shape,
            parameters,
            contents: None,
        });
        raw.push(data);
    }
    ModelInferResponse {
        model_name: response.model_name,
        model_version: response.model_version,
        id: response.id.unwrap_or_default(),
        parameters: HashMap::new(),
        outputs,
        raw_output_contents: raw,
    }
}

/// Encodes an [`InferRequest`] for a client: every input's data raw.
pub fn encode_request(request: &InferRequest) -> ModelInferRequest {
    ModelInferRequest {
        model_name: request.model.clone(),
        model_version: String::new(),
        id: request.id.clone().unwrap_or_default(),
        parameters: params_to_proto(&request.parameters),
        inputs: request
            .inputs
            .iter()
            .map(|t| InferInputTensor {
                name: t.name.clone(),
                datatype: t.dtype.as_str().to_owned(),
                shape: t.shape.clone(),
                ..Default::default()
            })
            .collect(),
        outputs: request
            .outputs
            .iter()
            .flatten()
            .map(|name| InferRequestedOutputTensor {
                name: name.clone(),
                parameters: HashMap::new(),
            })
            .collect(),
        raw_input_contents: request.inputs.iter().map(|t| t.data.clone()).collect(),
    }
}

/// Decodes a `ModelInferResponse` for a client (raw or typed output data).
pub fn decode_response(response: ModelInferResponse) -> Result<InferResponse> {
    let raw_count = response.raw_output_contents.len();
    let mut raw = response.raw_output_contents.into_iter();
    let mut outputs = Vec::with_capacity(response.outputs.len());
    for output in response.outputs {
        let dtype = DataType::parse(&output.datatype).ok_or_else(|| {
            ProtocolError::invalid(format!(
                "output `{}`: unknown datatype `{}`",
                output.name, output.datatype
            ))
        })?;
        let data = match raw.next() {
            Some(data) => data,
            None if raw_count == 0 => {
                contents_to_bytes(&output.name, dtype, output.contents.unwrap_or_default())?
            }
            None => {
                return Err(ProtocolError::invalid(format!(
                    "raw_output_contents has {raw_count} entries, fewer than the outputs"
                )))
            }
        };
        outputs.push(OutputTensor {
            name: output.name,
            dtype,
            shape: output.shape,
            data,
        });
    }
    Ok(InferResponse {
        model_name: response.model_name,
        model_version: response.model_version,
        id: (!response.id.is_empty()).then_some(response.id),
        outputs,
    })
}

fn is_empty(c: &InferTensorContents) -> bool {
    c.bool_contents.is_empty()
        && c.int_contents.is_empty()
        && c.int64_contents.is_empty()
        && c.uint_contents.is_empty()
        && c.uint64_contents.is_empty()
        && c.fp32_contents.is_empty()
        && c.fp64_contents.is_empty()
        && c.bytes_contents.is_empty()
}

/// Typed contents as kiln's little-endian bytes (BYTES length-prefixed). Only the
/// field of `dtype` may hold elements.
fn contents_to_bytes(name: &str, dtype: DataType, c: InferTensorContents) -> Result<Bytes> {
    let field = match dtype {
        DataType::Bool => "bool_contents",
        DataType::Int8 | DataType::Int16 | DataType::Int32 => "int_contents",
        DataType::Int64 => "int64_contents",
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => "uint_contents",
        DataType::Uint64 => "uint64_contents",
        DataType::Fp32 => "fp32_contents",
        DataType::Fp64 => "fp64_contents",
        DataType::Bytes => "bytes_contents",
        DataType::Fp16 | DataType::Bf16 => "",
    };
    let used = [
        ("bool_contents", c.bool_contents.is_empty()),
        ("int_contents", c.int_contents.is_empty()),
        ("int64_contents", c.int64_contents.is_empty()),
        ("uint_contents", c.uint_contents.is_empty()),
        ("uint64_contents", c.uint64_contents.is_empty()),
        ("fp32_contents", c.fp32_contents.is_empty()),
        ("fp64_contents", c.fp64_contents.is_empty()),
        ("bytes_contents", c.bytes_contents.is_empty()),
    ];
    if let Some((wrong, _)) = used.iter().find(|(f, empty)| !empty && *f != field) {
        return Err(ProtocolError::invalid(if field.is_empty() {
            format!("input `{name}`: {dtype} data must be sent in raw_input_contents")
        } else {
            format!("input `{name}`: {dtype} data goes in {field}, not {wrong}")
        }));
    }
    let out_of_range = |v: &dyn std::fmt::Display| {
        ProtocolError::invalid(format!("input `{name}`: {v} is out of range for {dtype}"))
    };
    fn narrow<S: Copy + std::fmt::Display, T: TryFrom<S>>(
        values: &[S],
        out_of_range: impl Fn(&dyn std::fmt::Display) -> ProtocolError,
        mut push: impl FnMut(T),
    ) -> Result<()> {
        for &v in values {
            push(T::try_from(v).map_err(|_| out_of_range(&v))?);
        }
        Ok(())
    }
    let mut out: Vec<u8> = Vec::new();
    match dtype {
        DataType::Bool => out.extend(c.bool_contents.iter().map(|&b| u8::from(b))),
        DataType::Int8 => narrow(&c.int_contents, out_of_range, |v: i8| {
            out.extend_from_slice(&v.to_le_bytes())
        })?,
        DataType::Int16 => narrow(&c.int_contents, out_of_range, |v: i16| {
            out.extend_from_slice(&v.to_le_bytes())
        })?,
        DataType::Int32 => out.extend(c.int_contents.iter().flat_map(|v| v.to_le_bytes())),
        DataType::Int64 => out.extend(c.int64_contents.iter().flat_map(|v| v.to_le_bytes())),
        DataType::Uint8 => narrow(&c.uint_contents, out_of_range, |v: u8| out.push(v))?,
        DataType::Uint16 => narrow(&c.uint_contents, out_of_range, |v: u16| {
            out.extend_from_slice(&v.to_le_bytes())
        })?,
        DataType::Uint32 => out.extend(c.uint_contents.iter().flat_map(|v| v.to_le_bytes())),
        DataType::Uint64 => out.extend(c.uint64_contents.iter().flat_map(|v| v.to_le_bytes())),
        DataType::Fp32 => out.extend(c.fp32_contents.iter().flat_map(|v| v.to_le_bytes())),
        DataType::Fp64 => out.extend(c.fp64_contents.iter().flat_map(|v| v.to_le_bytes())),
        DataType::Bytes => out = encode_bytes(&c.bytes_contents),
        DataType::Fp16 | DataType::Bf16 => {}
    }
    Ok(Bytes::from(out))
}

/// Parameters as kiln [`Param`]s sorted by key, each value converted by `value`
/// (`None`: the parameter holds no value).
fn sorted_params<P>(
    parameters: HashMap<String, P>,
    value: impl Fn(&str, P) -> Result<Option<ParamValue>>,
) -> Result<Vec<Param>> {
    let mut params = parameters
        .into_iter()
        .map(|(key, p)| {
            let value = value(&key, p)?
                .ok_or_else(|| ProtocolError::invalid(format!("parameter `{key}` has no value")))?;
            Ok(Param {
                key: key.into(),
                value,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    params.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(params)
}

/// Request parameters as kiln [`Param`]s, sorted by key.
pub fn params_from_proto(parameters: HashMap<String, InferParameter>) -> Result<Vec<Param>> {
    sorted_params(parameters, |_, p| {
        Ok(match p.parameter_choice {
            Some(ParameterChoice::BoolParam(b)) => Some(ParamValue::Bool(b)),
            Some(ParameterChoice::Int64Param(i)) => Some(ParamValue::Int(i)),
            Some(ParameterChoice::StringParam(s)) => Some(ParamValue::Str(s.into())),
            Some(ParameterChoice::DoubleParam(f)) => Some(ParamValue::Float(f)),
            Some(ParameterChoice::Uint64Param(u)) => Some(ParamValue::from_u64(u)),
            None => None,
        })
    })
}

/// kiln [`Param`]s as request parameters.
pub fn params_to_proto(params: &[Param]) -> HashMap<String, InferParameter> {
    params
        .iter()
        .map(|p| {
            let choice = match &p.value {
                ParamValue::Bool(b) => ParameterChoice::BoolParam(*b),
                ParamValue::Int(i) => ParameterChoice::Int64Param(*i),
                ParamValue::Float(f) => ParameterChoice::DoubleParam(*f),
                ParamValue::Uint(u) => ParameterChoice::Uint64Param(*u),
                ParamValue::Str(s) => ParameterChoice::StringParam(s.to_string()),
            };
            (
                p.key.to_string(),
                InferParameter {
                    parameter_choice: Some(choice),
                },
            )
        })
        .collect()
}

/// Repository load parameters as kiln [`Param`]s (overrides), sorted by key.
pub fn repository_params(
    parameters: HashMap<String, proto::ModelRepositoryParameter>,
) -> Result<Vec<Param>> {
    use model_repository_parameter::ParameterChoice as Choice;
    sorted_params(parameters, |key, p| {
        Ok(match p.parameter_choice {
            Some(Choice::BoolParam(b)) => Some(ParamValue::Bool(b)),
            Some(Choice::Int64Param(i)) => Some(ParamValue::Int(i)),
            Some(Choice::StringParam(s)) => Some(ParamValue::Str(s.into())),
            Some(Choice::BytesParam(_)) => {
                return Err(ProtocolError::invalid(format!(
                    "parameter `{key}`: model files cannot be sent with a load"
                )))
            }
            None => None,
        })
    })
}

#[cfg(test)]
mod tests;
