#![allow(clippy::unwrap_used)]

use super::*;

fn input(
    name: &str,
    datatype: &str,
    shape: &[i64],
    contents: InferTensorContents,
) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        parameters: HashMap::new(),
        contents: Some(contents),
    }
}

#[test]
fn typed_contents_become_little_endian_bytes() {
    let request = ModelInferRequest {
        model_name: "m".into(),
        id: "7".into(),
        inputs: vec![
            input(
                "a",
                "UINT16",
                &[2],
                InferTensorContents {
                    uint_contents: vec![1, 65535],
                    ..Default::default()
                },
            ),
            input(
                "b",
                "FP32",
                &[1],
                InferTensorContents {
                    fp32_contents: vec![0.5],
                    ..Default::default()
                },
            ),
            input(
                "c",
                "BYTES",
                &[2],
                InferTensorContents {
                    bytes_contents: vec![Bytes::from_static(b"ab"), Bytes::new()],
                    ..Default::default()
                },
            ),
            input(
                "d",
                "BOOL",
                &[2],
                InferTensorContents {
                    bool_contents: vec![true, false],
                    ..Default::default()
                },
            ),
            input(
                "e",
                "INT8",
                &[1],
                InferTensorContents {
                    int_contents: vec![-2],
                    ..Default::default()
                },
            ),
        ],
        ..Default::default()
    };
    let r = decode_request(request).unwrap();
    assert_eq!(r.model, "m");
    assert_eq!(r.id.as_deref(), Some("7"));
    assert_eq!(r.outputs, None);
    assert_eq!(r.inputs[0].data.as_ref(), &[1, 0, 255, 255]);
    assert_eq!(r.inputs[1].data.as_ref(), &0.5f32.to_le_bytes());
    assert_eq!(
        r.inputs[2].data.as_ref(),
        &[2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0]
    );
    assert_eq!(r.inputs[3].data.as_ref(), &[1, 0]);
    assert_eq!(r.inputs[4].data.as_ref(), &[0xfe]);
}

#[test]
fn raw_contents_are_taken_in_order_and_counted() {
    let mut request = ModelInferRequest {
        model_name: "m".into(),
        inputs: vec![
            input("a", "UINT8", &[1], InferTensorContents::default()),
            input("b", "UINT8", &[2], InferTensorContents::default()),
        ],
        raw_input_contents: vec![Bytes::from_static(&[1]), Bytes::from_static(&[2, 3])],
        outputs: vec![InferRequestedOutputTensor {
            name: "y".into(),
            parameters: HashMap::new(),
        }],
        ..Default::default()
    };
    let r = decode_request(request.clone()).unwrap();
    assert_eq!(r.inputs[1].data.as_ref(), &[2, 3]);
    assert_eq!(r.outputs, Some(vec!["y".to_owned()]));
    request.raw_input_contents.pop();
    assert!(decode_request(request.clone())
        .unwrap_err()
        .to_string()
        .contains("fewer than the inputs"));
    request.raw_input_contents = vec![Bytes::new(); 3];
    assert!(decode_request(request)
        .unwrap_err()
        .to_string()
        .contains("3 entries for 2 inputs"));
}

#[test]
fn misfit_contents_are_refused() {
    let decode = |i: InferInputTensor| {
        decode_request(ModelInferRequest {
            inputs: vec![i],
            ..Default::default()
        })
        .unwrap_err()
        .to_string()
    };
    let cases = [
        (
            "FP32",
            InferTensorContents {
                int_contents: vec![1],
                ..Default::default()
            },
            "goes in fp32_contents, not int_contents",
        ),
        (
            "UINT8",
            InferTensorContents {
                uint_contents: vec![256],
                ..Default::default()
            },
            "256 is out of range for UINT8",
        ),
        (
            "FP16",
            InferTensorContents {
                fp32_contents: vec![1.0],
                ..Default::default()
            },
            "raw_input_contents",
        ),
    ];
    for (datatype, contents, want) in cases {
        let e = decode(input("a", datatype, &[1], contents));
        assert!(e.contains(want), "{e}");
    }
    let e = decode(input("a", "NOPE", &[1], InferTensorContents::default()));
    assert!(e.contains("unknown datatype `NOPE`"), "{e}");
}

#[test]
fn requests_and_responses_round_trip() {
    let request = InferRequest {
        model: "echo".into(),
        id: Some("x".into()),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 2],
            &[1u32, 2],
        )],
        outputs: Some(vec!["OUTPUT0".into()]),
        parameters: vec![
            Param {
                key: "a".into(),
                value: ParamValue::Bool(true),
            },
            Param {
                key: "b".into(),
                value: ParamValue::Int(-3),
            },
            Param {
                key: "c".into(),
                value: ParamValue::Float(0.25),
            },
            Param {
                key: "d".into(),
                value: ParamValue::Str("s".into()),
            },
            Param {
                key: "e".into(),
                value: ParamValue::Uint(u64::MAX),
            },
        ],
    };
    assert_eq!(decode_request(encode_request(&request)).unwrap(), request);
    // A `uint64_param` that fits in i64 is an `Int`, like every such integer.
    let small = HashMap::from([(
        "n".to_owned(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::Uint64Param(5)),
        },
    )]);
    assert_eq!(
        params_from_proto(small).unwrap()[0].value,
        ParamValue::Int(5)
    );
    let response = InferResponse {
        model_name: "echo".into(),
        model_version: "1".into(),
        id: Some("x".into()),
        outputs: vec![OutputTensor {
            name: "OUTPUT0".into(),
            dtype: DataType::Bytes,
            shape: vec![1, 1],
            data: Bytes::from_static(&[1, 0, 0, 0, b'k']),
        }],
    };
    assert_eq!(
        decode_response(encode_response(response.clone())).unwrap(),
        response
    );
}
