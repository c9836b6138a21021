//! The in-process API: the same server without a socket.

use kiln_client::{DataType, InferRequest, InputTensor, NativeClient};
use kiln_core::{params_from_pairs, ServerConfig, ServerError};

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

/// The one inference path ([`kiln_core::request::serve`]) that every ingress takes, driven
/// in its split form: lookup (with a version), then admission, then the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_path_looks_up_admits_and_answers() {
    let client = NativeClient::start(ServerConfig::default()).unwrap();
    let server = client.server().clone();
    let endpoint = client.load("echo", Vec::new()).await.unwrap();
    let request = |id: &str, dtype: DataType| InferRequest {
        model: endpoint.to_uppercase(),
        id: Some(id.into()),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            dtype,
            &[1, 2],
            &[4u32, 5],
        )],
        ..Default::default()
    };
    // Lookup: names case-insensitive, only the version loaded.
    let group = server.lookup(&endpoint, Some("1")).unwrap();
    assert_eq!(group.endpoint(), endpoint);
    assert!(matches!(
        server.lookup(&endpoint, Some("2")),
        Err(ServerError::NotFound(_))
    ));
    assert!(matches!(
        server.lookup("nope", None),
        Err(ServerError::NotFound(_))
    ));
    // Admission queues the request; its answer, id echoed, comes when awaited.
    let pending = server.submit(request("a", DataType::Uint32)).unwrap();
    let answer = pending.await.unwrap();
    assert_eq!(answer.id.as_deref(), Some("a"));
    assert_eq!(answer.outputs[0].values::<u32>(), vec![5, 6]);
    // Refused at admission: a request that does not fit, and one an ingress could
    // not decode, each counted invalid for the model.
    assert!(matches!(
        server.submit(request("b", DataType::Int32)),
        Err(ServerError::InvalidRequest(_))
    ));
    let undecodable = kiln_core::request::serve::submit::<()>(
        &group,
        Err(ServerError::invalid("bad")),
        &mut Default::default(),
    );
    assert!(matches!(undecodable, Err(ServerError::InvalidRequest(_))));
    let text = server.metrics_text();
    let invalid = kiln_tests::requests_outcome(&text, &endpoint, "invalid");
    assert_eq!(invalid, Some(2.0), "{text}");
    client.shutdown().await;
}
