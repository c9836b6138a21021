//! End-to-end: the binary tensor data extension over REST, with the real `kiln`
//! binary, the echo-multi plugin and real sockets.

// The helpers are test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::InferResponse;
use kiln_server::http::{
    decode_response_binary, encode_request_binary, INFERENCE_HEADER_CONTENT_LENGTH,
};
use kiln_tests::fixtures::{check_echo_multi, echo_multi_request, inflate};
use kiln_tests::{requests_outcome, Kiln};
use serde_json::{json, Value};

/// Posts `body` to `model`'s infer route, with the header when `json_length` is given.
async fn post(
    kiln: &Kiln,
    model: &str,
    json_length: Option<String>,
    body: Vec<u8>,
) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v2/models/{model}/infer", kiln.url))
        .body(body);
    if let Some(length) = json_length {
        request = request.header(INFERENCE_HEADER_CONTENT_LENGTH, length);
    }
    request.send().await.unwrap()
}

/// Posts a JSON-only request to echo-multi.
async fn post_json(kiln: &Kiln, request: &Value) -> reqwest::Response {
    post(
        kiln,
        "echo-multi",
        None,
        serde_json::to_vec(request).unwrap(),
    )
    .await
}

/// A JSON header followed by binary parts; returns the body and the header's length.
fn body(header: &Value, binary: &[&[u8]]) -> (Vec<u8>, String) {
    let mut out = serde_json::to_vec(header).unwrap();
    let length = out.len().to_string();
    for b in binary {
        out.extend_from_slice(b);
    }
    (out, length)
}

/// Reads a successful response: its content type, its JSON header, and the decoded tensors.
async fn read(response: reqwest::Response) -> (String, Value, InferResponse) {
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    let header = response
        .headers()
        .get(INFERENCE_HEADER_CONTENT_LENGTH)
        .map(|v| v.as_bytes().to_vec());
    let body = response.bytes().await.unwrap();
    let json_end = match &header {
        Some(h) => std::str::from_utf8(h).unwrap().parse::<usize>().unwrap(),
        None => body.len(),
    };
    let json: Value = serde_json::from_slice(&body[..json_end]).unwrap();
    let decoded = decode_response_binary(body, header.as_deref()).unwrap();
    (content_type, json, decoded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_request_and_binary_response() {
    let kiln = Kiln::start(&["--load", "echo-multi"]);
    let request = echo_multi_request("b-1");
    let r = kiln.client.infer_binary(&request).await.unwrap();
    check_echo_multi(&r);
    assert_eq!(r.id.as_deref(), Some("b-1"));
    assert_eq!(
        r,
        kiln.client.infer(&request).await.unwrap(),
        "same answer as JSON"
    );

    // On the wire: octet-stream, the header, sizes in the JSON, the bytes after it.
    let encoded = encode_request_binary(&request);
    let length = encoded.json.len().to_string();
    let response = post(&kiln, "echo-multi", Some(length), encoded.into_body()).await;
    let (content_type, json, decoded) = read(response).await;
    assert_eq!(content_type, "application/octet-stream");
    check_echo_multi(&decoded);
    for (i, size) in [12, 16, 12].into_iter().enumerate() {
        let out = &json["outputs"][i];
        assert_eq!(out["parameters"]["binary_data_size"], size, "{out}");
        assert!(out.get("data").is_none(), "{out}");
    }
    assert!(kiln.client.server_metadata().await.unwrap()["extensions"]
        .as_array()
        .unwrap()
        .contains(&json!("binary_tensor_data")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_json_and_binary_inputs() {
    let kiln = Kiln::start(&["--load", "echo-multi"]);
    let fp: Vec<u8> = [0.5f32, -1.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let text = kiln_worker_sdk::encode_bytes(&["kiln", ""]);
    let (request, length) = body(
        &json!({"id": "m", "inputs": [
            {"name": "INPUT0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 2, 3]},
            {"name": "INPUT1", "shape": [1, 2], "datatype": "FP32",
             "parameters": {"binary_data_size": fp.len()}},
            {"name": "INPUT2", "shape": [1, 2], "datatype": "BYTES",
             "parameters": {"binary_data_size": text.len()}},
        ]}),
        &[&fp, &text],
    );
    let response = post(&kiln, "echo-multi", Some(length), request).await;
    assert!(response
        .headers()
        .get(INFERENCE_HEADER_CONTENT_LENGTH)
        .is_none());
    let (content_type, json, decoded) = read(response).await;
    // No binary output was asked for: a plain JSON answer.
    assert_eq!(content_type, "application/json");
    assert_eq!(json["outputs"][2]["data"], json!(["nlik", ""]));
    check_echo_multi(&decoded);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_output_binary_choice() {
    let kiln = Kiln::start(&["--load", "echo-multi"]);
    let inputs = json!([
        {"name": "INPUT0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 2, 3]},
        {"name": "INPUT1", "shape": [1, 2], "datatype": "FP32", "data": [0.5, -1.0]},
        {"name": "INPUT2", "shape": [1, 2], "datatype": "BYTES", "data": ["kiln", ""]},
    ]);
    // Everything binary but OUTPUT1, which says otherwise; a JSON-only request.
    let request = json!({
        "inputs": inputs,
        "parameters": {"binary_data_output": true},
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1", "parameters": {"binary_data": false}},
                    {"name": "OUTPUT2"}],
    });
    let (content_type, json, decoded) = read(post_json(&kiln, &request).await).await;
    assert_eq!(content_type, "application/octet-stream");
    check_echo_multi(&decoded);
    assert_eq!(json["outputs"][0]["parameters"]["binary_data_size"], 12);
    assert_eq!(json["outputs"][1]["data"], json!([1.0, -2.0]));
    assert!(json["outputs"][1].get("parameters").is_none());
    assert_eq!(json["outputs"][2]["parameters"]["binary_data_size"], 12);
    // Only OUTPUT2, asked for binary per output.
    let request = json!({
        "inputs": inputs,
        "outputs": [{"name": "OUTPUT2", "parameters": {"binary_data": true}}],
    });
    let (content_type, json, decoded) = read(post_json(&kiln, &request).await).await;
    assert_eq!(content_type, "application/octet-stream");
    assert_eq!(json["outputs"].as_array().unwrap().len(), 1);
    assert_eq!(decoded.outputs[0].name, "OUTPUT2");
    assert_eq!(
        decoded.outputs[0].data.as_ref(),
        kiln_worker_sdk::encode_bytes(&["nlik", ""]).as_slice()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_binary_requests_answer_400() {
    let kiln = Kiln::start(&["--load", "echo-multi"]);
    let input0 = |params: Value| {
        json!({"inputs": [
            {"name": "INPUT0", "shape": [1, 2], "datatype": "UINT32", "parameters": params},
            {"name": "INPUT1", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]},
            {"name": "INPUT2", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]},
        ]})
    };
    let eight = [0u8; 8];
    let (good, good_length) = body(&input0(json!({"binary_data_size": 8})), &[&eight]);
    let cases: Vec<(Option<String>, Vec<u8>, &str)> = vec![
        (
            Some("100000".into()),
            good.clone(),
            "is 100000 but the body has only",
        ),
        (
            Some("twelve".into()),
            good.clone(),
            "`twelve` is not a byte count",
        ),
        {
            let (b, l) = body(&input0(json!({"binary_data_size": 8})), &[&eight, &[1]]);
            (
                Some(l),
                b,
                "binary data has 9 bytes but the inputs' binary_data_size add up to 8",
            )
        },
        {
            let (b, l) = body(&input0(json!({"binary_data_size": 8})), &[&[0; 4]]);
            (Some(l), b, "runs past the end of the binary data")
        },
        {
            let (b, l) = body(&input0(json!({"binary_data_size": 4})), &[&[0; 4]]);
            (
                Some(l),
                b,
                "binary_data_size 4 does not match shape [1, 2] of UINT32 (8 bytes)",
            )
        },
        {
            let mut request = input0(json!({"binary_data_size": 8}));
            request["inputs"][0]["data"] = json!([1, 2]);
            let (b, l) = body(&request, &[&eight]);
            (
                Some(l),
                b,
                "input `INPUT0` has both `data` and `binary_data_size`",
            )
        },
        {
            let (b, l) = body(&input0(json!({})), &[]);
            (Some(l), b, "input `INPUT0` has no data")
        },
        // A binary input but no header: the binary part is empty.
        (
            None,
            serde_json::to_vec(&input0(json!({"binary_data_size": 0}))).unwrap(),
            "does not match shape",
        ),
    ];
    for (length, request, want) in cases {
        let response = post(&kiln, "echo-multi", length.clone(), request).await;
        assert_eq!(response.status(), 400, "{want}");
        let v: Value = response.json().await.unwrap();
        let message = v["error"].as_str().unwrap_or_default();
        assert!(
            message.contains(want),
            "`{message}` lacks `{want}` (header {length:?})"
        );
    }
    // The well-formed one succeeds, and the server counted the others as invalid.
    let response = post(&kiln, "echo-multi", Some(good_length), good).await;
    let (_, _, decoded) = read(response).await;
    assert_eq!(decoded.outputs[0].values::<u32>(), vec![1, 1]);
    let text = kiln.client.metrics().await.unwrap();
    let invalid = requests_outcome(&text, "echo-multi", "invalid");
    assert_eq!(invalid, Some(8.0));
}

/// Posts `request` as binary tensor data with `Accept-Encoding: accept` (none when
/// empty); returns the answer's `Content-Encoding`, its header length and its body
/// as sent.
async fn post_accepting(
    kiln: &Kiln,
    request: &kiln_client::InferRequest,
    accept: &str,
) -> (Option<String>, Option<String>, Vec<u8>) {
    let encoded = encode_request_binary(request);
    let mut post = reqwest::Client::new()
        .post(format!("{}/v2/models/{}/infer", kiln.url, request.model))
        .header(
            INFERENCE_HEADER_CONTENT_LENGTH,
            encoded.json.len().to_string(),
        )
        .body(encoded.into_body());
    if !accept.is_empty() {
        post = post.header("accept-encoding", accept);
    }
    let response = post.send().await.unwrap();
    assert_eq!(response.status(), 200);
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let (encoding, length) = (
        header("content-encoding"),
        header(INFERENCE_HEADER_CONTENT_LENGTH),
    );
    (encoding, length, response.bytes().await.unwrap().to_vec())
}

/// `Accept-Encoding: gzip` or `deflate` (tritonclient's
/// `response_compression_algorithm`) gets the answer compressed, the same bytes
/// once inflated, with the header length of the uncompressed body; small answers
/// and 256 KiB ones (compressed off the connection's thread) alike. Without the
/// header, or with encodings kiln does not give, the answer is plain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_compressed_when_asked() {
    use kiln_client::{DataType, InputTensor};
    let kiln = Kiln::start(&["--load", "echo-multi", "--load", "echo"]);
    let values: Vec<u32> = (0..65536).map(|i| i % 1000).collect();
    let big = kiln_client::InferRequest {
        model: "echo".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 65536],
            &values,
        )],
        ..Default::default()
    };
    for request in [echo_multi_request("z-1"), big] {
        let (encoding, plain_length, plain) = post_accepting(&kiln, &request, "").await;
        assert_eq!(encoding, None);
        assert!(plain_length.is_some());
        for (accept, expected) in [
            ("gzip", "gzip"),
            ("deflate", "deflate"),
            ("gzip;q=0.5, deflate", "deflate"),
        ] {
            let (encoding, length, body) = post_accepting(&kiln, &request, accept).await;
            assert_eq!(encoding.as_deref(), Some(expected), "{accept}");
            assert_eq!(length, plain_length, "{accept}");
            assert_eq!(inflate(expected, &body), plain, "{accept}");
            if request.model == "echo" {
                assert!(body.len() < plain.len() / 2, "{}", body.len());
            }
        }
        for accept in ["br", "identity", "gzip;q=0"] {
            let (encoding, _, body) = post_accepting(&kiln, &request, accept).await;
            assert_eq!(encoding, None, "{accept}");
            assert_eq!(body, plain, "{accept}");
        }
    }
    // A JSON answer keeps its content type.
    let response = reqwest::Client::new()
        .post(format!("{}/v2/models/echo-multi/infer", kiln.url))
        .header("accept-encoding", "gzip")
        .body(kiln_server::http::encode_request(&echo_multi_request(
            "z-2",
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(response.headers()["content-encoding"], "gzip");
    let json: Value =
        serde_json::from_slice(&inflate("gzip", &response.bytes().await.unwrap())).unwrap();
    assert_eq!(json["id"], "z-2");
    assert_eq!(json["outputs"][0]["data"], json!([2, 3, 4]));
}
