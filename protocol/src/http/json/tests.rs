use half::{bf16, f16};

use super::data::reserve;
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
        serde_json::from_str(r#"{"a": 9223372036854775807, "b": 9223372036854775808, "c": -1}"#)
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
