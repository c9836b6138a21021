//! The `cuda` worker end to end: the real plugin through the real server. Without a
//! GPU its load is refused with 400 naming why (tested on every machine); with one
//! (the driver loads and a device opens), its kernels' answers are checked against
//! the CPU's. The GPU tests print why they skip; `KILN_REQUIRE_GPU=1` (the GPU
//! machine's check, `scripts/gpu-check`) turns a skip into a failure.

// The helpers are test support: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::{DataType, HttpClient, InferRequest, InputTensor};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;
use serde_json::json;

/// The repository of the GPU tests: the worker's two kernels as named models.
fn repository() -> TempRepository {
    TempRepository::new(&[
        (
            "cuda-invert-image",
            "worker = \"cuda\"\n[parameters]\nkernel = \"invert-image\"\nchunk_bytes = 65536\n",
            &[1],
        ),
        (
            "cuda-matvec",
            "worker = \"cuda\"\n[parameters]\nkernel = \"matvec\"\nrows = 48\ncols = 40\n\
             max_batch_size = 16\nchunk_rows = 3\ntimeout = 2\n",
            &[1],
        ),
    ])
}

/// Loads a repository model; `None` (after printing why) when the server says CUDA
/// is unavailable here and no GPU is required.
async fn load_or_skip(c: &HttpClient, model: &str) -> Option<()> {
    match c.load_model(model, &json!({})).await {
        Ok(()) => Some(()),
        Err(e) if e.to_string().contains("CUDA is unavailable") => {
            assert!(
                std::env::var_os("KILN_REQUIRE_GPU").is_none(),
                "KILN_REQUIRE_GPU is set but {model} did not load: {e}"
            );
            println!("SKIPPED (no GPU here): {model}: {e}");
            None
        }
        Err(e) => panic!("{model}: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parameters_are_refused_with_or_without_a_gpu() {
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    for (params, needle) in [
        (json!({}), "the `kernel` parameter is required"),
        (json!({"kernel": "fft"}), "kernel `fft` is unknown"),
        (json!({"kernel": "matvec", "streams": 0}), "streams"),
        (json!({"kernel": "matvec", "rows": 1_000_000}), "rows"),
        (
            json!({"kernel": "matvec", "rows": 512, "chunk_rows": 4096}),
            "lower chunk_rows",
        ),
        (
            json!({"kernel": "matvec", "cuda_library_dir": "/tmp"}),
            "may only be set by the operator",
        ),
    ] {
        let err = c.load("cuda", &params).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{params}: {err}");
        assert!(err.to_string().contains(needle), "{params}: {err}");
    }
    assert!(c.is_ready().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_driver_the_load_is_a_400_naming_why() {
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    match c.load("cuda", &json!({"kernel": "invert-image"})).await {
        Ok(endpoint) => {
            println!("SKIPPED (a GPU is here): the no-driver refusal; {endpoint} loaded");
        }
        Err(err) => {
            assert_eq!(err.status(), Some(400), "{err}");
            let text = err.to_string();
            assert!(
                text.contains("cuda worker: CUDA is unavailable: "),
                "{text}"
            );
            assert!(text.contains("libcuda.so.1"), "{text}");
            // Nothing of it remains, and the server goes on serving.
            assert!(c.models().await.unwrap().is_empty());
            assert!(c.is_ready().await.unwrap());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_inverts_images_of_any_size_as_the_cpu_worker_does() {
    let repo = repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load", "invert-image"]);
    let c = &kiln.client;
    if load_or_skip(c, "cuda-invert-image").await.is_none() {
        return;
    }
    // Sizes around the 64 KiB chunk and the 4-byte word: odd tails, one chunk,
    // many chunks over both streams and more chunks than staging sets.
    for (i, dims) in [
        [1, 1, 1],
        [3, 5, 3],
        [128, 128, 4],
        [129, 257, 3],
        [720, 1280, 3],
    ]
    .iter()
    .enumerate()
    {
        let n = dims.iter().product::<i64>() as usize;
        let pixels: Vec<u8> = (0..n).map(|v| (v * 7 + i) as u8).collect();
        let mut answers = Vec::new();
        for model in ["cuda-invert-image", "invert-image"] {
            let response = c
                .infer_binary(&InferRequest {
                    model: model.into(),
                    inputs: vec![InputTensor::from_slice(
                        "image",
                        DataType::Uint8,
                        dims,
                        &pixels,
                    )],
                    ..Default::default()
                })
                .await
                .unwrap();
            assert_eq!(response.outputs[0].shape, dims.to_vec());
            answers.push(response.outputs[0].values::<u8>());
        }
        assert_eq!(answers[0], answers[1], "{dims:?}");
        assert!(answers[0].iter().zip(&pixels).all(|(o, p)| *o == 255 - p));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_matvec_matches_the_cpu_under_concurrent_batches() {
    let repo = repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    if load_or_skip(c, "cuda-matvec").await.is_none() {
        return;
    }
    let (rows, cols) = (48usize, 40usize);
    // 40 concurrent clients of 1–3 rows each: batches of up to 16, chunks of 3.
    let tasks: Vec<_> = (0..40usize)
        .map(|t| {
            let c = c.clone();
            tokio::spawn(async move {
                let b = 1 + t % 3;
                let a: Vec<f32> = (0..b * rows * cols)
                    .map(|k| ((k * 31 + t * 17) % 97) as f32 / 97.0 - 0.5)
                    .collect();
                let x: Vec<f32> = (0..b * cols)
                    .map(|k| ((k * 13 + t) % 89) as f32 / 89.0 - 0.5)
                    .collect();
                let response = c
                    .infer_binary(&InferRequest {
                        model: "cuda-matvec".into(),
                        inputs: vec![
                            InputTensor::from_slice(
                                "matrix",
                                DataType::Fp32,
                                &[b as i64, rows as i64, cols as i64],
                                &a,
                            ),
                            InputTensor::from_slice(
                                "vector",
                                DataType::Fp32,
                                &[b as i64, cols as i64],
                                &x,
                            ),
                        ],
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert_eq!(response.outputs[0].shape, vec![b as i64, rows as i64]);
                let y = response.outputs[0].values::<f32>();
                for r in 0..b {
                    for i in 0..rows {
                        let row = &a[(r * rows + i) * cols..][..cols];
                        let want: f32 = row.iter().zip(&x[r * cols..]).map(|(p, q)| p * q).sum();
                        let got = y[r * rows + i];
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{got} vs {want}"
                        );
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // A request of the wrong shape is refused before the GPU sees it.
    let err = c
        .infer(&InferRequest {
            model: "cuda-matvec".into(),
            inputs: vec![
                InputTensor::from_slice("matrix", DataType::Fp32, &[1, 2, 2], &[0f32; 4]),
                InputTensor::from_slice("vector", DataType::Fp32, &[1, 2], &[0f32; 2]),
            ],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onnx_runs_on_the_cuda_provider_or_says_why() {
    let repo = kiln_tests::model_repository();
    let kiln = Kiln::start(&["--model-repository", repo.to_str().unwrap()]);
    let c = &kiln.client;
    let line: Vec<f32> = (0..3 * 48 * 192)
        .map(|k| (k % 251) as f32 / 125.0 - 1.0)
        .collect();
    let classify = || async {
        let request = InferRequest {
            model: "ocr-cls".into(),
            inputs: vec![InputTensor::from_slice(
                "x",
                DataType::Fp32,
                &[1, 3, 48, 192],
                &line,
            )],
            ..Default::default()
        };
        c.infer_binary(&request).await.unwrap().outputs[0].values::<f32>()
    };
    c.load_model("ocr-cls", &json!({})).await.unwrap();
    let on_cpu = classify().await;
    match c
        .load_model("ocr-cls", &json!({"execution_provider": "cuda"}))
        .await
    {
        Ok(()) => {
            let on_gpu = classify().await;
            let diff = kiln_tests::golden::max_abs_diff(&on_cpu, &on_gpu);
            assert!(diff < 1e-3, "CPU {on_cpu:?} vs CUDA {on_gpu:?}");
            println!("ocr-cls on ONNX Runtime's CUDA provider: max |CPU - CUDA| = {diff}");
        }
        Err(e) => {
            assert_eq!(e.status(), Some(400), "{e}");
            let text = e.to_string();
            assert!(
                text.contains(
                    "execution_provider cuda: ONNX Runtime's CUDA provider is not available: "
                ),
                "{text}"
            );
            assert!(
                std::env::var_os("KILN_REQUIRE_ONNX_CUDA").is_none(),
                "KILN_REQUIRE_ONNX_CUDA is set: {text}"
            );
            println!("SKIPPED (no CUDA provider here): {text}");
        }
    }
    let err = c
        .load_model("ocr-cls", &json!({"execution_provider": "tpu"}))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("must be `cpu` or `cuda`"), "{err}");
}
