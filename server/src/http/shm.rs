//! Triton's system shared-memory extension over REST.
//!
//! Regions (windows of `/dev/shm` objects, held by the server's
//! [`SharedMemory`] registry) are managed under `/v2/systemsharedmemory`:
//! `POST region/{r}/register` with `{"key": "/name", "offset": 0, "byte_size": N}`,
//! `POST region/{r}/unregister`, `POST unregister` (every region), `GET status` and
//! `GET region/{r}/status` (a list of `{"name", "key", "offset", "byte_size"}`).
//!
//! In an inference request, a tensor whose `parameters` carry
//! `shared_memory_region`, `shared_memory_byte_size` and optionally
//! `shared_memory_offset` has no `data`: an input's bytes are copied out of the
//! region when the request is decoded (see [`crate::shm`] for why), an output is written into it after inference and answered with
//! `"parameters": {"shared_memory_region": r, "shared_memory_byte_size": written}`
//! instead of data. Where each output goes is returned beside the protocol-free
//! [`InferRequest`] as an [`OutputPlacement`]; the protocol's keys never reach the
//! worker.

use actix_web::{web, HttpResponse};
use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::binary::{byte_count, split, BinaryOutputs, Encoded, SizedTensor};
use super::body::json_object;
use super::json::{decode_request_parts, encode_response_parts};
use super::{HttpError, State};
use crate::error::{Result, ServerError};
use crate::infer::{InferRequest, InferResponse};
use crate::shm::{SharedMemory, ShmSlice};

const REGION: &str = "shared_memory_region";
const BYTE_SIZE: &str = "shared_memory_byte_size";
const OFFSET: &str = "shared_memory_offset";

/// A tensor's place in shared memory, from its `parameters`.
pub(super) struct ShmParams {
    region: String,
    byte_size: usize,
    offset: usize,
}

impl ShmParams {
    /// The shared-memory parameters of tensor `name` (`kind`: "input" or "output"),
    /// if it names a region.
    pub(super) fn from_parameters(
        kind: &str,
        name: &str,
        params: Option<&Map<String, Value>>,
    ) -> Result<Option<ShmParams>> {
        let Some(params) = params else {
            return Ok(None);
        };
        let context = || format!("{kind} `{name}`: ");
        let byte_size = byte_count(params, BYTE_SIZE, context)?;
        let offset = byte_count(params, OFFSET, context)?;
        let region = match params.get(REGION) {
            None if byte_size.is_none() && offset.is_none() => return Ok(None),
            None => {
                return Err(ServerError::invalid(format!(
                    "{kind} `{name}`: `{BYTE_SIZE}` or `{OFFSET}` without `{REGION}`"
                )))
            }
            Some(Value::String(region)) => region.clone(),
            Some(other) => {
                return Err(ServerError::invalid(format!(
                    "{kind} `{name}`: `{REGION}` must be a string, got {other}"
                )))
            }
        };
        let byte_size = byte_size.ok_or_else(|| {
            ServerError::invalid(format!("{kind} `{name}`: `{REGION}` needs `{BYTE_SIZE}`"))
        })?;
        Ok(Some(ShmParams {
            region,
            byte_size,
            offset: offset.unwrap_or(0),
        }))
    }

    /// The window these parameters name. As Triton answers an inference naming an
    /// unregistered region with 400, an unknown region is an invalid request here.
    fn slice(&self, kind: &str, name: &str, shm: Option<&SharedMemory>) -> Result<ShmSlice> {
        let shm = shm.ok_or_else(|| {
            ServerError::invalid(format!(
                "{kind} `{name}`: shared memory is not available here"
            ))
        })?;
        shm.slice(&self.region, self.offset, self.byte_size)
            .map_err(|e| match e {
                ServerError::NotFound(message) => {
                    ServerError::invalid(format!("{kind} `{name}`: {message}"))
                }
                other => in_tensor(other, kind, name),
            })
    }
}

/// The window of an input in shared memory: `byte_size` must fit its shape and
/// datatype exactly. Its bytes are copied later, by [`ShmReads::read_into`].
pub(super) fn input_window(
    tensor: &SizedTensor<'_>,
    params: &ShmParams,
    shm: Option<&SharedMemory>,
) -> Result<ShmSlice> {
    tensor.check_size(params.byte_size)?;
    params.slice(tensor.kind, tensor.name, shm)
}

/// The shared-memory inputs of a decoded request, still to be copied out of their
/// regions (decoding checks the windows; copying them is the costly part, done
/// where the caller chooses).
#[derive(Default)]
pub struct ShmReads(Vec<PendingRead>);

struct PendingRead {
    /// The input's index in the request.
    input: usize,
    window: ShmSlice,
    /// Elements of the input's shape.
    elements: usize,
}

impl ShmReads {
    pub(super) fn push(&mut self, input: usize, window: ShmSlice, elements: usize) {
        self.0.push(PendingRead {
            input,
            window,
            elements,
        });
    }

    /// The bytes to copy.
    pub fn bytes(&self) -> usize {
        self.0.iter().map(|r| r.window.len()).sum()
    }

    /// Copies each window into its input's data (a copy, read now: an object
    /// truncated meanwhile is a 400, and later changes of the region do not reach
    /// the request). BYTES elements must fill their window.
    pub fn read_into(self, request: &mut InferRequest) -> Result<()> {
        for read in self.0 {
            let input = request.inputs.get_mut(read.input).ok_or_else(|| {
                ServerError::Internal(format!("no input {} to read into", read.input))
            })?;
            let data = read
                .window
                .read()
                .map_err(|e| in_tensor(e, "input", &input.name))?;
            SizedTensor {
                kind: "input",
                name: &input.name,
                dtype: input.dtype,
                shape: &input.shape,
                elements: read.elements,
                param: BYTE_SIZE,
            }
            .check_bytes(&data)?;
            input.data = data;
        }
        Ok(())
    }
}

/// `e`, its message beginning with the tensor it concerns.
fn in_tensor(e: ServerError, kind: &str, name: &str) -> ServerError {
    let prefixed = |message: String| format!("{kind} `{name}`: {message}");
    match e {
        ServerError::InvalidRequest(m) => ServerError::InvalidRequest(prefixed(m)),
        ServerError::TooLarge(m) => ServerError::TooLarge(prefixed(m)),
        ServerError::Exhausted(m) => ServerError::Exhausted(prefixed(m)),
        other => other,
    }
}

/// Where each output of a response goes: into a shared-memory region when the
/// request placed it there, else binary or JSON as [`BinaryOutputs`] says.
#[derive(Clone, Default)]
pub struct OutputPlacement {
    /// The binary tensor data choice, for outputs not in shared memory.
    pub binary: BinaryOutputs,
    /// Outputs to write into shared memory, by name, with the window checked (and
    /// held) when the request was decoded.
    shared_memory: Vec<(String, ShmSlice)>,
}

/// An output written into shared memory (the response leaves its data out).
pub(super) struct InShm<'a> {
    pub output: &'a str,
}

impl OutputPlacement {
    /// Takes the protocol's keys (binary and shared-memory) out of the request
    /// parameters, so they never reach the worker.
    pub(super) fn from_request_parameters(params: &mut Map<String, Value>) -> Result<Self> {
        for key in [REGION, BYTE_SIZE, OFFSET] {
            params.remove(key);
        }
        Ok(OutputPlacement {
            binary: BinaryOutputs::from_request_parameters(params)?,
            shared_memory: Vec::new(),
        })
    }

    /// Records output `name`'s own choice: binary, or a window of `shm`.
    pub(super) fn set_from_output_parameters(
        &mut self,
        name: &str,
        params: Option<&Map<String, Value>>,
        shm: Option<&SharedMemory>,
    ) -> Result<()> {
        self.binary.set_from_output_parameters(name, params)?;
        if let Some(place) = ShmParams::from_parameters("output", name, params)? {
            let slice = place.slice("output", name, shm)?;
            self.shared_memory.push((name.to_owned(), slice));
        }
        Ok(())
    }

    /// The work of encoding `response`: its bytes to write as JSON, and those to
    /// write into shared memory (binary outputs are sent as they are).
    pub(super) fn encoding_work(&self, response: &InferResponse) -> (usize, usize) {
        let (mut json, mut copy) = (0, 0);
        for output in &response.outputs {
            if self.shared_memory.iter().any(|(n, _)| *n == output.name) {
                copy += output.data.len();
            } else if !self.binary.is_binary(&output.name) {
                json += output.data.len();
            }
        }
        (json, copy)
    }

    /// Writes the outputs placed in shared memory; each must fit its window (else
    /// nothing is written).
    fn write_outputs<'a>(&'a self, response: &'a InferResponse) -> Result<Vec<InShm<'a>>> {
        let mut placed = Vec::with_capacity(self.shared_memory.len());
        for output in &response.outputs {
            let Some((_, slice)) = self.shared_memory.iter().find(|(n, _)| *n == output.name)
            else {
                continue;
            };
            if output.data.len() > slice.len() {
                return Err(ServerError::invalid(format!(
                    "output `{}` needs {} bytes but its {BYTE_SIZE} is {}",
                    output.name,
                    output.data.len(),
                    slice.len()
                )));
            }
            placed.push((slice, output));
        }
        placed
            .into_iter()
            .map(|(slice, output)| {
                slice
                    .write(&output.data)
                    .map_err(|e| in_tensor(e, "output", &output.name))?;
                Ok(InShm {
                    output: &output.name,
                })
            })
            .collect()
    }
}

/// Decodes an inference request for `model` (JSON, or with binary tensors after
/// `header` bytes of JSON), reading shared-memory inputs from `shm`; also returns
/// where each output goes.
pub fn decode_request_shm(
    model: &str,
    body: Bytes,
    header: Option<&[u8]>,
    shm: &SharedMemory,
) -> Result<(InferRequest, OutputPlacement)> {
    let (json, binary) = split(body, header)?;
    let (mut request, placement, reads) = decode_request_parts(model, &json, binary, Some(shm))?;
    reads.read_into(&mut request)?;
    Ok((request, placement))
}

/// Writes the outputs `placement` puts in shared memory, then encodes the response
/// (those outputs without data, the binary ones as binary tensor data). An output
/// larger than its window is an [`ServerError::InvalidRequest`].
pub fn encode_response_shm(
    response: &InferResponse,
    placement: &OutputPlacement,
) -> Result<Encoded> {
    let in_shm = placement.write_outputs(response)?;
    Ok(encode_response_parts(response, &placement.binary, &in_shm))
}

type Reply = Result<HttpResponse, HttpError>;

/// `POST /v2/systemsharedmemory/region/{r}/register`.
pub(super) async fn register(
    state: web::Data<State>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Reply {
    let body = json_object(payload, state.max_body_bytes).await?;
    let key = match body.get("key") {
        Some(Value::String(key)) => key,
        _ => return Err(ServerError::invalid("`key` must be a string such as \"/name\"").into()),
    };
    let offset = byte_count(&body, "offset", String::new)?.unwrap_or(0);
    let byte_size = byte_count(&body, "byte_size", String::new)?
        .ok_or_else(|| ServerError::invalid("`byte_size` is required"))?;
    state
        .server
        .shared_memory()
        .register(&path, key, offset, byte_size)?;
    Ok(HttpResponse::Ok().json(json!({})))
}

/// `POST /v2/systemsharedmemory/region/{r}/unregister` (an unknown region is not an
/// error, as in Triton).
pub(super) async fn unregister(state: web::Data<State>, path: web::Path<String>) -> HttpResponse {
    state.server.shared_memory().unregister(&path);
    HttpResponse::Ok().json(json!({}))
}

/// `POST /v2/systemsharedmemory/unregister`: every region.
pub(super) async fn unregister_all(state: web::Data<State>) -> HttpResponse {
    state.server.shared_memory().unregister_all();
    HttpResponse::Ok().json(json!({}))
}

/// `GET /v2/systemsharedmemory/status`.
pub(super) async fn status_all(state: web::Data<State>) -> Reply {
    status(&state, None)
}

/// `GET /v2/systemsharedmemory/region/{r}/status` (404 for an unknown region).
pub(super) async fn status_region(state: web::Data<State>, path: web::Path<String>) -> Reply {
    status(&state, Some(&path))
}

fn status(state: &State, name: Option<&str>) -> Reply {
    let regions: Vec<Value> = state
        .server
        .shared_memory()
        .status(name)?
        .into_iter()
        .map(
            |r| json!({"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}),
        )
        .collect();
    Ok(HttpResponse::Ok().json(regions))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::infer::OutputTensor;
    use crate::shm::testing::Object;
    use kiln_worker_sdk::{DataType, Param, ParamValue};

    fn decode(shm: &SharedMemory, body: Value) -> Result<(InferRequest, OutputPlacement)> {
        decode_request_shm("m", Bytes::from(body.to_string()), None, shm)
    }

    fn words(values: &[u32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn input(params: Value) -> Value {
        json!({"inputs": [{"name": "a", "shape": [3], "datatype": "UINT32", "parameters": params}]})
    }

    #[test]
    fn inputs_are_copied_from_the_region() {
        let object = Object::new(&[[0; 4].as_slice(), &words(&[7, 8, 9])].concat());
        let shm = SharedMemory::new();
        shm.register("in", &object.key, 0, 16).unwrap();
        let mut body = input(
            json!({"shared_memory_region": "in", "shared_memory_byte_size": 12,
                                    "shared_memory_offset": 4}),
        );
        body["parameters"] = json!({"shared_memory_region": "in", "shared_memory_byte_size": 1,
                                    "shared_memory_offset": 2, "k": 1});
        let (request, placement) = decode(&shm, body).unwrap();
        let data = &request.inputs[0].data;
        assert_eq!(data.as_ref(), words(&[7, 8, 9]).as_slice());
        // Read at decode time: the object truncated afterwards changes nothing.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&object.path)
            .unwrap()
            .set_len(0)
            .unwrap();
        assert_eq!(data.as_ref(), words(&[7, 8, 9]).as_slice());
        assert_eq!(
            request.parameters,
            vec![Param {
                key: "k".into(),
                value: ParamValue::Int(1)
            }],
            "the protocol's keys stay out"
        );
        assert!(placement.shared_memory.is_empty());
    }

    #[test]
    fn input_mismatches_are_invalid_requests() {
        let object = Object::new(&[2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let shm = SharedMemory::new();
        shm.register("in", &object.key, 0, 16).unwrap();
        let region = |size: usize, offset: usize| {
            json!({"shared_memory_region": "in", "shared_memory_byte_size": size,
                   "shared_memory_offset": offset})
        };
        let cases: Vec<(Value, &str)> = vec![
            (
                input(region(8, 0)),
                "input `a`: shared_memory_byte_size 8 does not match shape [3] of UINT32 (12 bytes)",
            ),
            (input(region(12, 8)), "run past its 16 bytes"),
            (
                input(json!({"shared_memory_region": "nope", "shared_memory_byte_size": 12})),
                "input `a`: unable to find system shared memory region `nope`",
            ),
            (
                input(json!({"shared_memory_region": "in"})),
                "`shared_memory_region` needs `shared_memory_byte_size`",
            ),
            (
                input(json!({"shared_memory_byte_size": 12})),
                "without `shared_memory_region`",
            ),
            (
                input(json!({"shared_memory_region": 1, "shared_memory_byte_size": 12})),
                "`shared_memory_region` must be a string",
            ),
            (
                input(json!({"shared_memory_region": "in", "shared_memory_byte_size": -1})),
                "`shared_memory_byte_size` must be a non-negative integer",
            ),
            (
                json!({"inputs": [{"name": "a", "shape": [1], "datatype": "UINT32", "data": [1],
                                   "parameters": region(4, 0)}]}),
                "input `a` has both `data` and `shared_memory_region`",
            ),
            (
                json!({"inputs": [{"name": "a", "shape": [1], "datatype": "UINT32",
                                   "parameters": {"binary_data_size": 4, "shared_memory_region": "in",
                                                  "shared_memory_byte_size": 4}}]}),
                "has both `binary_data_size` and `shared_memory_region`",
            ),
            // BYTES elements must fill the window.
            (
                json!({"inputs": [{"name": "s", "shape": [1], "datatype": "BYTES",
                                   "parameters": region(8, 0)}]}),
                "shared_memory_byte_size 8 but its 1 BYTES elements take 6 bytes",
            ),
            (
                json!({"outputs": [{"name": "y", "parameters": region(17, 0)}], "inputs": []}),
                "output `y`: shared-memory region `in`: offset 0 and byte size 17 run past",
            ),
        ];
        for (body, want) in cases {
            let err = decode(&shm, body).err().unwrap();
            assert!(matches!(err, ServerError::InvalidRequest(_)), "{err}");
            assert!(err.to_string().contains(want), "`{err}` lacks `{want}`");
        }
        let bytes = json!({"inputs": [{"name": "s", "shape": [1], "datatype": "BYTES",
                                       "parameters": region(6, 0)}]});
        let (request, _) = decode(&shm, bytes.clone()).unwrap();
        assert_eq!(request.inputs[0].data.as_ref(), b"\x02\0\0\0ab");
        // Without a registry (the client's decoder) shared memory is refused.
        let err = super::super::decode_request("m", bytes.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().contains("not available here"), "{err}");
    }

    fn response(y: &[u32]) -> InferResponse {
        let tensor = |name: &str, values: &[u32]| OutputTensor {
            name: name.into(),
            dtype: DataType::Uint32,
            shape: vec![values.len() as i64],
            data: Bytes::from(words(values)),
        };
        InferResponse {
            model_name: "m".into(),
            model_version: "1".into(),
            id: None,
            outputs: vec![tensor("y", y), tensor("z", &[3])],
        }
    }

    #[test]
    fn outputs_are_written_and_reported() {
        let object = Object::new(&[0; 16]);
        let shm = SharedMemory::new();
        shm.register("out", &object.key, 0, 16).unwrap();
        let body = json!({"inputs": [], "parameters": {"binary_data_output": true}, "outputs": [
            {"name": "y", "parameters": {"shared_memory_region": "out",
                                         "shared_memory_byte_size": 12, "shared_memory_offset": 4}},
            {"name": "z"}]});
        let (request, placement) = decode(&shm, body).unwrap();
        assert_eq!(request.outputs, Some(vec!["y".into(), "z".into()]));
        // The work of encoding: `y` goes to shared memory, `z` binary.
        assert_eq!(placement.encoding_work(&response(&[1, 2])), (0, 8));
        let mut as_json = placement.clone();
        as_json.binary.all = false;
        assert_eq!(as_json.encoding_work(&response(&[1, 2])), (4, 8));
        // Unregistering now does not take the window from the request.
        shm.unregister("out");
        let encoded = encode_response_shm(&response(&[1, 2]), &placement).unwrap();
        let v: Value = serde_json::from_slice(&encoded.json).unwrap();
        // In shared memory: no data and no parameters, as Triton answers.
        assert_eq!(
            v["outputs"][0],
            json!({"name": "y", "datatype": "UINT32", "shape": [2]})
        );
        assert_eq!(
            v["outputs"][1]["parameters"],
            json!({"binary_data_size": 4})
        );
        assert_eq!(encoded.binary, vec![Bytes::from(words(&[3]))]);
        assert_eq!(&object.contents()[4..12], words(&[1, 2]).as_slice());
        // Too large for its window: refused, and nothing is written.
        let err = encode_response_shm(&response(&[5, 6, 7, 8]), &placement).unwrap_err();
        assert!(matches!(err, ServerError::InvalidRequest(_)));
        assert!(
            err.to_string()
                .contains("output `y` needs 16 bytes but its shared_memory_byte_size is 12"),
            "{err}"
        );
        assert_eq!(&object.contents()[4..12], words(&[1, 2]).as_slice());
    }
}
