//! Ensembles (Triton's `platform: "ensemble"`): repository models wired from other
//! models by tensor names, served by the real `kiln` binary with the real plugins.
//! What is refused or fails: `ensemble_failures.rs`.

// Helpers outside `#[test]` functions: a failed request should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{DataType, InferRequest, InferResponse, InputTensor, NativeClient};
use kiln_core::ServerConfig;
use kiln_tests::ensembles::{counts, get, graph, step, IN_U32, OUT_U32};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;
use kiln_worker_sdk::encode_bytes;
use serde_json::{json, Value};

/// Two echo steps: OUT = IN + 2.
const CHAIN: &str = r#"
platform = "ensemble"
max_batch_size = 8
input = [{ name = "IN", data_type = "TYPE_UINT32", dims = [-1] }]
output = [{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }]

[[ensemble_scheduling.step]]
model_name = "echo"
model_version = -1
input_map = { INPUT0 = "IN" }
output_map = { OUTPUT0 = "mid" }

[[ensemble_scheduling.step]]
model_name = "echo"
input_map = { INPUT0 = "mid" }
output_map = { OUTPUT0 = "OUT" }
"#;

/// The worker models the ensembles run on, and `chain` and `diamond` (the
/// example's own configuration).
fn repository(extra: &[(&str, &str, &[u64])]) -> TempRepository {
    let diamond = std::fs::read_to_string(
        kiln_tests::repo_root().join("examples/models/echo-diamond/config.toml"),
    )
    .unwrap();
    let mut models: Vec<(&str, &str, &[u64])> = vec![
        ("echo", "worker = \"echo\"\n", &[1]),
        ("echo-multi", "worker = \"echo-multi\"\n", &[1]),
        ("chain", CHAIN, &[]),
        ("diamond", &diamond, &[]),
    ];
    models.extend_from_slice(extra);
    TempRepository::new(&models)
}

fn chain_request(values: &[u32]) -> InferRequest {
    InferRequest {
        model: "chain".into(),
        id: Some("c1".into()),
        inputs: vec![InputTensor::from_slice(
            "IN",
            DataType::Uint32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    }
}

fn diamond_request() -> InferRequest {
    InferRequest {
        model: "diamond".into(),
        inputs: vec![
            InputTensor::from_slice("IN", DataType::Uint32, &[2, 2], &[1u32, 2, 10, 20]),
            InputTensor::from_slice("SCALE", DataType::Fp32, &[2, 2], &[0.5f32, 1.5, -1.0, 4.0]),
            InputTensor::from_slice(
                "TEXT",
                DataType::Bytes,
                &[2, 1],
                &encode_bytes(&["kiln", "ensemble"]),
            ),
        ],
        ..Default::default()
    }
}

fn check_diamond(r: &InferResponse) {
    assert_eq!(r.model_name, "diamond");
    let out = |name: &str| r.outputs.iter().find(|o| o.name == name).unwrap();
    assert_eq!(out("OUT").values::<u32>(), vec![4, 5, 13, 23]);
    assert_eq!(out("OUT").shape, vec![2, 2]);
    assert_eq!(out("DOUBLED").dtype, DataType::Fp64);
    assert_eq!(out("DOUBLED").values::<f64>(), vec![1.0, 3.0, -2.0, 8.0]);
    assert_eq!(
        out("TEXT_OUT").data.as_ref(),
        encode_bytes(&["kiln", "ensemble"]).as_slice()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_and_diamond_over_every_ingress() {
    let repo = repository(&[]);
    // Loading the ensembles loads their step models from the repository.
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load-model",
        "chain",
        "--load-model",
        "diamond",
    ]);
    let c = &kiln.client;
    let r = c.infer(&chain_request(&[1, 2, 3])).await.unwrap();
    assert_eq!(r.outputs[0].name, "OUT");
    assert_eq!(r.outputs[0].values::<u32>(), vec![3, 4, 5]);
    assert_eq!(
        (
            r.model_name.as_str(),
            r.model_version.as_str(),
            r.id.as_deref()
        ),
        ("chain", "1", Some("c1"))
    );
    let r = c.infer_binary(&chain_request(&[7])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![9]);
    let g = kiln.grpc().await;
    let r = g.infer(&chain_request(&[40, 41])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![42, 43]);
    let mut stream = g.stream().await.unwrap();
    let r = stream.infer(&chain_request(&[5])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![7]);
    check_diamond(&c.infer(&diamond_request()).await.unwrap());
    check_diamond(&g.infer(&diamond_request()).await.unwrap());
    // Only the outputs asked for.
    let mut only = diamond_request();
    only.outputs = Some(vec!["DOUBLED".into()]);
    let r = c.infer(&only).await.unwrap();
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.outputs[0].name, "DOUBLED");

    // A request that does not fit the ensemble's own inputs: 400, nothing run.
    let wrong = InferRequest {
        inputs: vec![InputTensor::from_slice(
            "IN",
            DataType::Fp32,
            &[1, 1],
            &[1.0f32],
        )],
        ..chain_request(&[])
    };
    let err = c.infer(&wrong).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("`IN`"), "{err}");

    // Readiness, metadata, index.
    assert_eq!(get(&kiln, "/v2/models/diamond/ready").await.0, 200);
    assert!(g.is_model_ready("chain").await.unwrap());
    let meta = c.model_metadata("diamond").await.unwrap();
    assert_eq!(meta["platform"], "ensemble");
    assert_eq!(meta["parameters"], json!({"max_batch_size": 8}));
    let tensors = |key: &str| -> Vec<(String, String, Value)> {
        meta[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap().to_owned(),
                    t["datatype"].as_str().unwrap().to_owned(),
                    t["shape"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        tensors("inputs"),
        vec![
            ("IN".into(), "UINT32".into(), json!([-1, -1])),
            ("SCALE".into(), "FP32".into(), json!([-1, 2])),
            ("TEXT".into(), "BYTES".into(), json!([-1, -1])),
        ]
    );
    assert_eq!(
        tensors("outputs")[1],
        ("DOUBLED".into(), "FP64".into(), json!([-1, 2]))
    );
    let grpc_meta = g.model_metadata("chain").await.unwrap();
    assert_eq!(grpc_meta.platform, "ensemble");
    assert_eq!(grpc_meta.inputs[0].name, "IN");
    let index = c.repository_index().await.unwrap();
    for name in ["chain", "diamond", "echo", "echo-multi"] {
        let entry = index.iter().find(|m| m["name"] == name).unwrap();
        assert_eq!(entry["state"], "READY", "{entry}");
    }

    // Statistics: each ensemble's own requests; each step counted by its model.
    assert_eq!(counts(&kiln, "chain").await, (4, 0, 4));
    assert_eq!(counts(&kiln, "diamond").await.0, 3);
    // echo: 2 steps × 4 chain requests, 2 (fork, left) × 3 diamond requests.
    assert_eq!(counts(&kiln, "echo").await.0, 14);
    assert_eq!(counts(&kiln, "echo-multi").await.0, 6);
    let metrics = c.metrics().await.unwrap();
    assert_eq!(
        kiln_tests::requests_outcome(&metrics, "chain", "success"),
        Some(4.0)
    );
    assert_eq!(
        kiln_tests::requests_outcome(&metrics, "chain", "invalid"),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_ensemble() {
    let repo = repository(&[]);
    let client = NativeClient::start(ServerConfig {
        plugin_dirs: vec![kiln_tests::build_dir()],
        model_repository: Some(repo.path().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    client
        .server()
        .load_model("diamond", None, Vec::new())
        .await
        .unwrap();
    check_diamond(&client.infer(diamond_request()).await.unwrap());
    client.shutdown().await;
}

/// A one-step ensemble over `echo`.
fn via_echo() -> String {
    graph(
        IN_U32,
        OUT_U32,
        &step("echo", "INPUT0 = \"IN\"", "OUTPUT0 = \"OUT\""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_requests_batch_with_direct_requests() {
    // The dynamic batcher holds a batch open 500 ms: every request sent at once
    // lands in it, from the ensemble or not.
    let repo = TempRepository::new(&[
        (
            "echo",
            "worker = \"echo\"\n[parameters]\nbatcher = \"dynamic\"\n\
             max_queue_delay_microseconds = 500000\n",
            &[1],
        ),
        ("via-echo", &via_echo(), &[]),
    ]);
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load-model",
        "via-echo",
    ]);
    let tasks: Vec<_> = (0..8u32)
        .map(|i| {
            let client = kiln.client.clone();
            tokio::spawn(async move {
                let (model, input) = if i % 2 == 0 {
                    ("echo", "INPUT0")
                } else {
                    ("via-echo", "IN")
                };
                let r = client
                    .infer(&InferRequest {
                        model: model.into(),
                        inputs: vec![InputTensor::from_slice(
                            input,
                            DataType::Uint32,
                            &[1, 1],
                            &[i],
                        )],
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert_eq!(r.outputs[0].values::<u32>(), vec![i + 1]);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let (_, stats) = get(&kiln, "/v2/models/echo/stats").await;
    let s = &stats["model_stats"][0];
    assert_eq!(s["inference_count"], 8, "{s}");
    assert_eq!(s["execution_count"], 1, "one batch held all eight: {s}");
    assert_eq!(s["batch_stats"][0]["batch_size"], 8, "{s}");
    assert_eq!(counts(&kiln, "via-echo").await, (4, 0, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_in_triton_form_over_rest_and_grpc() {
    let repo = repository(&[]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "chain"]);
    let (status, config) = get(&kiln, "/v2/models/chain/config").await;
    assert_eq!(status, 200, "{config}");
    assert_eq!(config["platform"], "ensemble");
    assert_eq!(config["max_batch_size"], 8);
    assert_eq!(config["instance_group"], json!([]));
    assert!(config.get("dynamic_batching").is_none(), "{config}");
    assert_eq!(config["input"][0]["name"], "IN");
    assert_eq!(config["input"][0]["data_type"], "TYPE_UINT32");
    assert_eq!(config["input"][0]["dims"], json!([-1]));
    assert_eq!(
        config["ensemble_scheduling"],
        json!({"step": [
            {"model_name": "echo", "model_version": -1, "input_map": {"INPUT0": "IN"},
             "output_map": {"OUTPUT0": "mid"}, "model_namespace": ""},
            {"model_name": "echo", "model_version": -1, "input_map": {"INPUT0": "mid"},
             "output_map": {"OUTPUT0": "OUT"}, "model_namespace": ""},
        ]})
    );
    let config = kiln.grpc().await.model_config("chain").await.unwrap();
    assert_eq!(config.platform, "ensemble");
    assert!(config.instance_group.is_empty());
    use kiln_server::grpc::proto::model_config::SchedulingChoice;
    let Some(SchedulingChoice::EnsembleScheduling(e)) = config.scheduling_choice else {
        panic!("not an ensemble: {config:?}");
    };
    assert_eq!(e.step.len(), 2);
    assert_eq!(e.step[1].model_name, "echo");
    assert_eq!(e.step[1].model_version, -1);
    assert_eq!(
        e.step[1].input_map.get("INPUT0").map(String::as_str),
        Some("mid")
    );
    assert_eq!(
        e.step[1].output_map.get("OUTPUT0").map(String::as_str),
        Some("OUT")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unloading_a_step_model_makes_the_ensemble_unavailable_until_reloaded() {
    let repo = repository(&[]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "chain"]);
    let c = &kiln.client;
    c.unload_model("echo").await.unwrap();
    assert_eq!(get(&kiln, "/v2/models/chain/ready").await.0, 503);
    let err = c.infer(&chain_request(&[1])).await.unwrap_err();
    assert_eq!(err.status(), Some(503), "{err}");
    assert!(
        err.to_string()
            .contains("step 1 (model `echo`): model `echo` is not loaded"),
        "{err}"
    );
    let index = c.repository_index().await.unwrap();
    let chain = index.iter().find(|m| m["name"] == "chain").unwrap();
    assert_eq!(chain["state"], "UNAVAILABLE", "{chain}");
    assert_eq!(chain["reason"], "a step's model is not loaded or not ready");
    c.load_model("echo", &json!({})).await.unwrap();
    assert_eq!(get(&kiln, "/v2/models/chain/ready").await.0, 200);
    let r = c.infer(&chain_request(&[1])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![3]);
}

#[test]
fn tritonclient_reads_and_runs_an_ensemble() {
    let repo = repository(&[]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "chain"]);
    kiln_tests::pytest::run_pytest(&kiln, "tests/tritonclient-ensemble", &[]);
}
