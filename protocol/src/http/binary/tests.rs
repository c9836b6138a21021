use super::super::codec::*;
use super::*;
use crate::infer::{InferRequest, InferResponse};
use crate::infer::{InputTensor, OutputTensor};
use half::f16;
use kiln_types::{Param, ParamValue};
use serde_json::json;

/// Length-prefixed BYTES elements.
fn strings(items: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in items {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s);
    }
    out
}

/// A body: `header` as JSON, then `binary`; returns it and the header's length.
fn body(header: Value, binary: &[&[u8]]) -> (Bytes, String) {
    let mut out = serde_json::to_vec(&header).unwrap();
    let length = out.len().to_string();
    for b in binary {
        out.extend_from_slice(b);
    }
    (Bytes::from(out), length)
}

fn decode(body: Bytes, header: &str) -> Result<(InferRequest, BinaryOutputs)> {
    decode_request_binary("m", body, Some(header.as_bytes()))
}

fn error(body: Bytes, header: &str) -> String {
    decode(body, header).unwrap_err().to_string()
}

#[test]
fn binary_inputs_are_slices_of_the_body() {
    let values: Vec<u8> = [7u32, 8].iter().flat_map(|v| v.to_le_bytes()).collect();
    let (body, header) = body(
        json!({"inputs": [{"name": "a", "shape": [1, 2], "datatype": "UINT32",
                           "parameters": {"binary_data_size": 8}}]}),
        &[&values],
    );
    let (request, binary) = decode(body.clone(), &header).unwrap();
    let data = &request.inputs[0].data;
    assert_eq!(data.as_ref(), values.as_slice());
    let at = header.parse::<usize>().unwrap();
    assert_eq!(data.as_ptr(), body[at..].as_ptr(), "copied, not sliced");
    assert_eq!(binary, BinaryOutputs::default());
}

#[test]
fn bytes_with_empty_elements_and_with_no_elements() {
    let two = strings(&[b"", b"xy"]);
    let (body, header) = body(
        json!({"inputs": [
            {"name": "s", "shape": [2], "datatype": "BYTES",
             "parameters": {"binary_data_size": two.len()}},
            {"name": "none", "shape": [1, 0], "datatype": "BYTES",
             "parameters": {"binary_data_size": 0}},
            {"name": "empty", "shape": [1], "datatype": "BYTES",
             "parameters": {"binary_data_size": 4}},
        ]}),
        &[&two, &[], &strings(&[b""])],
    );
    let (request, _) = decode(body, &header).unwrap();
    assert_eq!(request.inputs[0].data.as_ref(), two.as_slice());
    assert!(request.inputs[1].data.is_empty());
    assert_eq!(request.inputs[2].data.as_ref(), &[0, 0, 0, 0]);
    // A BYTES slice whose elements do not fill it exactly.
    let (body, header) = body_of_bytes(&strings(&[b"ab"]), 1, 7);
    assert!(error(body, &header).contains("elements take 6 bytes"));
    let (body, header) = body_of_bytes(&[9, 0, 0, 0, b'a'], 1, 5);
    assert!(error(body, &header).contains("cut short"));
}

fn body_of_bytes(data: &[u8], elements: i64, size: usize) -> (Bytes, String) {
    let mut padded = data.to_vec();
    padded.resize(size, 0);
    body(
        json!({"inputs": [{"name": "s", "shape": [elements], "datatype": "BYTES",
                           "parameters": {"binary_data_size": size}}]}),
        &[&padded],
    )
}

#[test]
fn binary_and_json_inputs_mix_and_protocol_parameters_stay_out() {
    let fp = [1.5f32.to_le_bytes(), (-2f32).to_le_bytes()].concat();
    let (body, header) = body(
        json!({
            "id": "r",
            "parameters": {"binary_data_output": true, "increment": 3},
            "inputs": [
                {"name": "j", "shape": [2], "datatype": "INT16", "data": [1, -1]},
                {"name": "b", "shape": [2], "datatype": "FP32",
                 "parameters": {"binary_data_size": 8}},
                {"name": "j2", "shape": [1], "datatype": "BYTES", "data": ["z"]},
            ],
            "outputs": [{"name": "x", "parameters": {"binary_data": false}}, {"name": "y"}],
        }),
        &[&fp],
    );
    let (request, binary) = decode(body, &header).unwrap();
    assert_eq!(request.id.as_deref(), Some("r"));
    assert_eq!(request.inputs[0].data.as_ref(), &[1, 0, 255, 255]);
    assert_eq!(request.inputs[1].data.as_ref(), fp.as_slice());
    assert_eq!(request.inputs[2].data.as_ref(), &[1, 0, 0, 0, b'z']);
    assert_eq!(
        request.parameters,
        vec![Param {
            key: "increment".into(),
            value: ParamValue::Int(3)
        }]
    );
    assert_eq!(request.outputs, Some(vec!["x".into(), "y".into()]));
    assert!(!binary.is_binary("x"), "the per-output setting wins");
    assert!(binary.is_binary("y"));
    // A JSON-only request may ask for binary outputs too.
    let (request, binary) = decode_request_binary(
        "m",
        Bytes::from_static(
            br#"{"inputs":[],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}"#,
        ),
        None,
    )
    .unwrap();
    assert!(request.parameters.is_empty());
    assert!(binary.is_binary("y") && !binary.is_binary("x"));
}

#[test]
fn fp16_is_raw() {
    // A NaN payload and a subnormal: raw bytes, untouched by any conversion.
    let raw = [0x01, 0x7e, 0x01, 0x00];
    let (body, header) = body(
        json!({"inputs": [{"name": "h", "shape": [2], "datatype": "FP16",
                           "parameters": {"binary_data_size": 4}}]}),
        &[&raw],
    );
    let (request, _) = decode(body, &header).unwrap();
    assert_eq!(request.inputs[0].data.as_ref(), &raw);
    let response = InferResponse {
        model_name: "m".into(),
        model_version: "1".into(),
        id: None,
        outputs: vec![OutputTensor {
            name: "h".into(),
            dtype: DataType::Fp16,
            shape: vec![2],
            data: Bytes::from_static(&[0x01, 0x7e, 0x01, 0x00]),
        }],
    };
    let encoded = encode_response_binary(
        &response,
        &BinaryOutputs {
            all: true,
            outputs: Vec::new(),
        },
    );
    assert_eq!(encoded.binary, vec![Bytes::copy_from_slice(&raw)]);
    let header = encoded.header_length().unwrap().to_string();
    let decoded =
        decode_response_binary(Bytes::from(encoded.into_body()), Some(header.as_bytes())).unwrap();
    assert_eq!(decoded, response);
    assert!(f16::from_le_bytes([raw[0], raw[1]]).is_nan());
}

#[test]
fn mismatches_are_named() {
    let four = [0u8; 4];
    let input = |params: Value| json!({"inputs": [{"name": "a", "shape": [1], "datatype": "UINT32", "parameters": params}]});
    let (b, h) = body(input(json!({"binary_data_size": 4})), &[&four]);
    let cases: Vec<(Bytes, String, &str)> = vec![
        // The header.
        (b.clone(), "1000".into(), "is 1000 but the body has only"),
        (b.clone(), "abc".into(), "`abc` is not a byte count"),
        (b.clone(), "-1".into(), "is not a byte count"),
        // Sizes that do not add up to the binary part.
        {
            let (b, h) = body(input(json!({"binary_data_size": 4})), &[&four, &four]);
            (
                b,
                h,
                "binary data has 8 bytes but the inputs' binary_data_size add up to 4",
            )
        },
        {
            let (b, h) = body(input(json!({"binary_data_size": 4})), &[&[0, 0]]);
            (
                b,
                h,
                "runs past the end of the binary data (2 of 2 bytes left)",
            )
        },
        // The size against the shape.
        {
            let (b, h) = body(input(json!({"binary_data_size": 8})), &[&[0; 8]]);
            (
                b,
                h,
                "binary_data_size 8 does not match shape [1] of UINT32 (4 bytes)",
            )
        },
        {
            let (b, h) = body(input(json!({"binary_data_size": "4"})), &[&four]);
            (b, h, "must be a non-negative integer")
        },
        // Both, or neither.
        {
            let (b, h) = body(
                json!({"inputs": [{"name": "a", "shape": [1], "datatype": "UINT32",
                                   "data": [1], "parameters": {"binary_data_size": 4}}]}),
                &[&four],
            );
            (b, h, "input `a` has both `data` and `binary_data_size`")
        },
        {
            let (b, h) = body(input(json!({})), &[]);
            (b, h, "input `a` has no data")
        },
        {
            let (b, h) = body(
                json!({"inputs": [], "parameters": {"binary_data_output": 1}}),
                &[],
            );
            (b, h, "`binary_data_output` must be a boolean")
        },
        {
            let (b, h) = body(
                json!({"inputs": [], "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}),
                &[],
            );
            (b, h, "output `y`: `binary_data` must be a boolean")
        },
    ];
    for (body, header, want) in cases {
        let err = error(body, &header);
        assert!(err.contains(want), "`{err}` lacks `{want}`");
    }
    // Without the header the body is all JSON, so a binary input has nothing.
    assert!(decode_request_binary("m", b, None).is_err());
    assert!(decode(Bytes::new(), &h)
        .unwrap_err()
        .to_string()
        .contains("only 0 bytes"));
}

#[test]
fn responses_choose_binary_per_output() {
    let response = InferResponse {
        model_name: "m".into(),
        model_version: "1".into(),
        id: Some("i".into()),
        outputs: vec![
            OutputTensor {
                name: "a".into(),
                dtype: DataType::Uint32,
                shape: vec![1],
                data: Bytes::from_static(&[5, 0, 0, 0]),
            },
            OutputTensor {
                name: "s".into(),
                dtype: DataType::Bytes,
                shape: vec![2],
                data: Bytes::from(strings(&[b"", b"q"])),
            },
            OutputTensor {
                name: "none".into(),
                dtype: DataType::Bytes,
                shape: vec![0],
                data: Bytes::new(),
            },
        ],
    };
    // JSON only: the same bytes as the JSON encoder, no header.
    let plain = encode_response_binary(&response, &BinaryOutputs::default());
    assert_eq!(plain.header_length(), None);
    assert_eq!(plain.json, super::super::json::encode_response(&response));
    // Binary but `a`.
    let choice = BinaryOutputs {
        all: true,
        outputs: vec![("a".into(), false)],
    };
    let encoded = encode_response_binary(&response, &choice);
    let v: Value = serde_json::from_slice(&encoded.json).unwrap();
    assert_eq!(v["outputs"][0]["data"], json!([5]));
    assert!(v["outputs"][0].get("parameters").is_none());
    assert_eq!(
        v["outputs"][1]["parameters"],
        json!({"binary_data_size": 9})
    );
    assert!(v["outputs"][1].get("data").is_none());
    assert_eq!(
        v["outputs"][2]["parameters"],
        json!({"binary_data_size": 0})
    );
    assert_eq!(encoded.binary.len(), 2);
    assert_eq!(encoded.header_length(), Some(encoded.json.len()));
    let header = encoded.json.len().to_string();
    let decoded =
        decode_response_binary(Bytes::from(encoded.into_body()), Some(header.as_bytes())).unwrap();
    assert_eq!(decoded, response);
}

#[test]
fn request_round_trip_all_binary() {
    let request = InferRequest {
        model: "m".into(),
        id: Some("x".into()),
        inputs: vec![
            InputTensor::from_slice("a", DataType::Int16, &[1, 2], &[-3i16, 4]),
            InputTensor {
                name: "s".into(),
                dtype: DataType::Bytes,
                shape: vec![1, 3],
                data: Bytes::from(strings(&[b"", b"kiln", b"\xff"])),
            },
        ],
        outputs: Some(vec!["y".into()]),
        parameters: vec![Param {
            key: "k".into(),
            value: ParamValue::Str("v".into()),
        }],
    };
    let encoded = encode_request_binary(&request);
    assert_eq!(encoded.binary.len(), 2);
    let header = encoded.header_length().unwrap().to_string();
    let (decoded, binary) = decode(Bytes::from(encoded.into_body()), &header).unwrap();
    assert_eq!(decoded, request);
    assert!(binary.all);
}
