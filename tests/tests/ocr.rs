//! The `ocr` model (a worker calling ocr-det, ocr-cls and ocr-rec through the
//! server) against the reference, `rapidocr_onnxruntime` 1.4.4 with the same
//! models, on rendered images: several fonts and sizes, two columns, an
//! upside-down line, an empty image. Line for line: the same text, box corners
//! within 3 px, confidences within 0.02. The real binary, real models; the
//! README's curl command is run as written (against this server).

// Test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::golden::bytemuck_f32;
use kiln_tests::ocr::{lines_of, reference, Line, RefImage};
use kiln_tests::{repo_root, Kiln};
use serde_json::json;

const CORNER_PX: f32 = 3.0;
const SCORE: f32 = 0.02;

fn start() -> Kiln {
    Kiln::serve_examples(&["ocr-det", "ocr-cls", "ocr-rec", "ocr", "ocr-rgb"])
}

fn check(image: &RefImage, got: &[Line], how: &str) {
    let want = &image.lines;
    let texts = |l: &[Line]| l.iter().map(|l| l.text.clone()).collect::<Vec<_>>();
    assert_eq!(texts(got), texts(want), "{} ({how})", image.name);
    for (g, w) in got.iter().zip(want) {
        for (gc, wc) in g.quad.iter().zip(&w.quad) {
            let d = (gc[0] - wc[0]).abs().max((gc[1] - wc[1]).abs());
            assert!(
                d <= CORNER_PX,
                "{} `{}` ({how}): box {:?}, reference {:?}",
                image.name,
                g.text,
                g.quad,
                w.quad
            );
        }
        assert!(
            (g.score - w.score).abs() <= SCORE,
            "{} `{}` ({how}): score {} vs {}",
            image.name,
            g.text,
            g.score,
            w.score
        );
    }
}

fn answer_lines(outputs: &[kiln_client::OutputTensor]) -> Vec<Line> {
    let get = |name: &str| outputs.iter().find(|o| o.name == name).unwrap();
    lines_of(
        &bytemuck_f32(&get("boxes").data),
        &get("texts").data,
        &bytemuck_f32(&get("scores").data),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ocr_matches_the_reference_line_for_line() {
    let images = reference();
    assert!(
        images.iter().any(|i| i.lines.len() >= 3),
        "the reference read nothing"
    );
    assert!(
        images.iter().any(|i| i.lines.is_empty()),
        "an empty image is among the cases"
    );
    let kiln = start();
    let http = reqwest::Client::new();
    for image in images {
        // The PNG as base64 text in a JSON BYTES element (the README's form).
        let png = std::fs::read(&image.png).unwrap();
        let body = json!({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
            "data": [base64(&png)]}]});
        let answer: serde_json::Value = http
            .post(format!("{}/v2/models/ocr/infer", kiln.url))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let out = |name: &str| {
            answer["outputs"]
                .as_array()
                .unwrap()
                .iter()
                .find(|o| o["name"] == name)
                .unwrap()["data"]
                .clone()
        };
        let boxes: Vec<f32> = serde_json::from_value(out("boxes")).unwrap();
        let texts: Vec<String> = serde_json::from_value(out("texts")).unwrap();
        let scores: Vec<f32> = serde_json::from_value(out("scores")).unwrap();
        let texts = kiln_worker_sdk::encode_bytes(&texts);
        check(image, &lines_of(&boxes, &texts, &scores), "PNG over JSON");

        // The raw bytes of the PNG (Triton's binary tensor extension).
        let request = InferRequest {
            model: "ocr".into(),
            inputs: vec![InputTensor {
                name: "IMAGE".into(),
                dtype: DataType::Bytes,
                shape: vec![1],
                data: kiln_worker_sdk::encode_bytes(&[&png]).into(),
            }],
            ..Default::default()
        };
        let got = kiln.client.infer_binary(&request).await.unwrap();
        check(image, &answer_lines(&got.outputs), "PNG bytes");

        // The pixels as a UINT8 [H, W, 3] tensor to `ocr-rgb`.
        let request = InferRequest {
            model: "ocr-rgb".into(),
            inputs: vec![InputTensor {
                name: "IMAGE".into(),
                dtype: DataType::Uint8,
                shape: vec![image.height as i64, image.width as i64, 3],
                data: image.rgb.clone().into(),
            }],
            ..Default::default()
        };
        let got = kiln.client.infer_binary(&request).await.unwrap();
        check(image, &answer_lines(&got.outputs), "RGB tensor");
    }

    // Not an image: 400, and the server goes on.
    let bad = InferRequest {
        model: "ocr".into(),
        inputs: vec![InputTensor {
            name: "IMAGE".into(),
            dtype: DataType::Bytes,
            shape: vec![1],
            data: kiln_worker_sdk::encode_bytes(&[b"not an image"]).into(),
        }],
        ..Default::default()
    };
    let err = kiln.client.infer_binary(&bad).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("neither PNG nor JPEG"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_curl_prints_the_text() {
    let images = reference();
    let image = images.iter().find(|i| i.name == "invoice").unwrap();
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let command = readme
        .lines()
        .find(|l| l.starts_with("curl -s localhost:8000/v2/models/ocr/infer"))
        .expect("the README's OCR curl command");
    let kiln = start();
    let command = command
        .replace("localhost:8000", kiln.url.trim_start_matches("http://"))
        .replace("image.png", image.png.to_str().unwrap());
    let out = Command::new("bash")
        .arg("-c")
        .arg(&command)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let want: Vec<String> = image.lines.iter().map(|l| l.text.clone()).collect();
    assert_eq!(printed, want);
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
