//! Triton's system shared-memory extension over REST.
//!
//! Regions (windows of `/dev/shm` objects, held by the server's
//! [`SharedMemory`](kiln_core::memory::shared_memory::SharedMemory) registry) are managed under
//! `/v2/systemsharedmemory`:
//! `POST region/{r}/register` with `{"key": "/name", "offset": 0, "byte_size": N}`,
//! `POST region/{r}/unregister`, `POST unregister` (every region), `GET status` and
//! `GET region/{r}/status` (a list of `{"name", "key", "offset", "byte_size"}`).
//!
//! In an inference request, a tensor whose `parameters` carry
//! `shared_memory_region`, `shared_memory_byte_size` and optionally
//! `shared_memory_offset` has no `data`: an input's bytes are copied out of the
//! region when the request is decoded (see [`kiln_core::memory::shared_memory`] for why), an output is written into it after inference and answered with
//! `"parameters": {"shared_memory_region": r, "shared_memory_byte_size": written}`
//! instead of data. That codec is [`kiln_protocol::http::shm_tensors`]'s, over this
//! server's regions (the registry is its [`kiln_protocol::shm_regions::ShmRegions`]).

use actix_web::{web, HttpResponse};
use kiln_protocol::http::byte_count;
use serde_json::{json, Value};

use super::body::json_object;
use super::{HttpResult, State};
use kiln_core::error::ServerError;

/// `POST /v2/systemsharedmemory/region/{r}/register`.
pub(super) async fn register(
    state: web::Data<State>,
    path: web::Path<String>,
    payload: web::Payload,
) -> HttpResult {
    let body = json_object(payload, &state).await?;
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
pub(super) async fn status_all(state: web::Data<State>) -> HttpResult {
    status(&state, None)
}

/// `GET /v2/systemsharedmemory/region/{r}/status` (404 for an unknown region).
pub(super) async fn status_region(state: web::Data<State>, path: web::Path<String>) -> HttpResult {
    status(&state, Some(&path))
}

fn status(state: &State, name: Option<&str>) -> HttpResult {
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
    use bytes::Bytes;
    use kiln_core::error::Result;
    use kiln_core::memory::shared_memory::testing::Object;
    use kiln_core::memory::shared_memory::SharedMemory;
    use kiln_core::request::infer::{InferRequest, InferResponse, OutputTensor};
    use kiln_protocol::http::{decode_request_shm, encode_response_shm};
    use kiln_worker_sdk::{DataType, Param, ParamValue};

    type OutputPlacement = super::super::OutputPlacement;

    fn decode(shm: &SharedMemory, body: Value) -> Result<(InferRequest, OutputPlacement)> {
        Ok(decode_request_shm(
            "m",
            Bytes::from(body.to_string()),
            None,
            shm,
        )?)
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
        assert!(placement.shared_memory_outputs().next().is_none());
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
        let err =
            kiln_protocol::http::decode_request("m", bytes.to_string().as_bytes()).unwrap_err();
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
        let err = ServerError::from(
            encode_response_shm(&response(&[5, 6, 7, 8]), &placement).unwrap_err(),
        );
        assert!(matches!(err, ServerError::InvalidRequest(_)));
        assert!(
            err.to_string()
                .contains("output `y` needs 16 bytes but its shared_memory_byte_size is 12"),
            "{err}"
        );
        assert_eq!(&object.contents()[4..12], words(&[1, 2]).as_slice());
    }
}
