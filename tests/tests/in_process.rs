//! The in-process API: the same server without a socket.

use kiln_client::{DataType, InferRequest, InputTensor, NativeClient};
use kiln_server::{params_from_pairs, ServerConfig, ServerError};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_server_serves_and_validates() {
    let client = NativeClient::start(ServerConfig::default()).unwrap();
    let endpoint = client
        .load(
            "echo",
            params_from_pairs(&[("batch_size", "16"), ("timeout", "5")]),
        )
        .await
        .unwrap();
    let tasks: Vec<_> = (0..200u32)
        .map(|i| {
            let client = client.clone();
            let endpoint = endpoint.clone();
            tokio::spawn(async move {
                let r = client
                    .infer(InferRequest {
                        model: endpoint,
                        inputs: vec![InputTensor::from_slice(
                            "INPUT0",
                            DataType::Uint32,
                            &[1, 2],
                            &[i, i * 2],
                        )],
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert_eq!(r.outputs[0].values::<u32>(), vec![i + 1, i * 2 + 1]);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let err = client
        .infer(InferRequest {
            model: "echo".into(),
            inputs: vec![InputTensor::from_slice(
                "INPUT0",
                DataType::Fp32,
                &[1, 1],
                &[1.0f32],
            )],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400));
    client.unload("echo").await.unwrap();
    let err = client.server().model("echo").err().unwrap();
    assert!(matches!(err, ServerError::NotFound(_)));
    client.shutdown().await;
}
