//! One bad request fails alone: a declared request parameter with a bad value is
//! refused at admission (400 / INVALID_ARGUMENT), and a request the worker fails
//! at run time gets its own error (400 invalid, 500 worker fault) while the rest
//! of its batch is answered normally. A worker asking for an impossible output
//! size gets an error, and the server lives on.

use kiln_client::{ClientError, DataType, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::{requests_outcome, Kiln};

fn request(model: &str, dtype: DataType, values: &[i32], params: Vec<Param>) -> InferRequest {
    let input = match dtype {
        DataType::Uint32 => {
            let values: Vec<u32> = values.iter().map(|&v| v as u32).collect();
            InputTensor::from_slice("INPUT0", dtype, &[1, values.len() as i64], &values)
        }
        _ => InputTensor::from_slice("INPUT0", dtype, &[1, values.len() as i64], values),
    };
    InferRequest {
        model: model.into(),
        inputs: vec![input],
        parameters: params,
        ..Default::default()
    }
}

fn increment(value: ParamValue) -> Vec<Param> {
    vec![Param {
        key: "increment".into(),
        value,
    }]
}

fn grpc_code(err: &ClientError) -> tonic::Code {
    match err {
        ClientError::Grpc { code, .. } => *code,
        other => panic!("not a gRPC status: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_parameter_fails_only_its_request() {
    // The setup: three clients within one 300 ms batch window.
    let kiln = Kiln::start(&["--load", "echo:batch_size=8,timeout=300"]);
    let c = &kiln.client;
    let good_a = request(
        "echo",
        DataType::Uint32,
        &[1, 2],
        increment(ParamValue::Int(10)),
    );
    let bad = request(
        "echo",
        DataType::Uint32,
        &[3],
        increment(ParamValue::Int(-1)),
    );
    let good_b = request("echo", DataType::Uint32, &[4], Vec::new());
    let (a, b, x) = tokio::join!(c.infer(&good_a), c.infer(&good_b), c.infer(&bad));
    assert_eq!(a.unwrap().outputs[0].values::<u32>(), vec![11, 12]);
    assert_eq!(b.unwrap().outputs[0].values::<u32>(), vec![5]);
    let err = x.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("`increment`"), "{err}");

    // gRPC: the string "x" (and an out-of-range number) is INVALID_ARGUMENT, the
    // others OK.
    let g = kiln.grpc().await;
    let text = request(
        "echo",
        DataType::Uint32,
        &[5],
        increment(ParamValue::Str("x".into())),
    );
    let big = request(
        "echo",
        DataType::Uint32,
        &[5],
        increment(ParamValue::Int(1 << 32)),
    );
    let good = request(
        "echo",
        DataType::Uint32,
        &[6],
        increment(ParamValue::Int(1)),
    );
    let (t, n, ok) = tokio::join!(g.infer(&text), g.infer(&big), g.infer(&good));
    assert_eq!(grpc_code(&t.unwrap_err()), tonic::Code::InvalidArgument);
    assert_eq!(grpc_code(&n.unwrap_err()), tonic::Code::InvalidArgument);
    assert_eq!(ok.unwrap().outputs[0].values::<u32>(), vec![7]);

    let metrics = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&metrics, "echo", "invalid"), Some(3.0));
    assert_eq!(requests_outcome(&metrics, "echo", "success"), Some(3.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_fails_one_request_of_a_batch_with_its_class() {
    // batch_size=3 and a long timeout: the three requests make one batch.
    let kiln = Kiln::start(&["--load", "faulty:batch_size=3,timeout=60000"]);
    let c = &kiln.client;
    for (bad_value, status) in [(-7, 400), (-8, 500)] {
        let good_a = request("faulty", DataType::Int32, &[7, 8], Vec::new());
        let bad = request("faulty", DataType::Int32, &[bad_value], Vec::new());
        let good_b = request("faulty", DataType::Int32, &[9], Vec::new());
        let (a, x, b) = tokio::join!(c.infer(&good_a), c.infer(&bad), c.infer(&good_b));
        assert_eq!(a.unwrap().outputs[0].values::<i32>(), vec![7, 8]);
        assert_eq!(b.unwrap().outputs[0].values::<i32>(), vec![9]);
        let err = x.unwrap_err();
        assert_eq!(err.status(), Some(status), "{err}");
        assert!(err.to_string().contains(&bad_value.to_string()), "{err}");
    }
    // The same over gRPC.
    let g = kiln.grpc().await;
    for (bad_value, code) in [
        (-7, tonic::Code::InvalidArgument),
        (-8, tonic::Code::Internal),
    ] {
        let good_a = request("faulty", DataType::Int32, &[1], Vec::new());
        let bad = request("faulty", DataType::Int32, &[bad_value], Vec::new());
        let good_b = request("faulty", DataType::Int32, &[2, 3], Vec::new());
        let (a, x, b) = tokio::join!(g.infer(&good_a), g.infer(&bad), g.infer(&good_b));
        assert_eq!(a.unwrap().outputs[0].values::<i32>(), vec![1]);
        assert_eq!(b.unwrap().outputs[0].values::<i32>(), vec![2, 3]);
        assert_eq!(grpc_code(&x.unwrap_err()), code);
    }
    let metrics = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&metrics, "faulty", "success"), Some(8.0));
    assert_eq!(requests_outcome(&metrics, "faulty", "invalid"), Some(2.0));
    assert_eq!(requests_outcome(&metrics, "faulty", "failure"), Some(2.0));
    // A request failed alone is no fault of the instance: it was not restarted.
    assert!(!kiln.log().contains("faulty: release"), "{}", kiln.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impossible_output_size_fails_the_batch_not_the_server() {
    let kiln = Kiln::start(&["--load", "faulty:batch_size=1"]);
    let c = &kiln.client;
    let err = c
        .infer(&request("faulty", DataType::Int32, &[-6], Vec::new()))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(500), "{err}");
    assert!(err.to_string().contains("cannot allocate"), "{err}");
    // The server is alive and serves the next request.
    let ok = c
        .infer(&request("faulty", DataType::Int32, &[5], Vec::new()))
        .await
        .unwrap();
    assert_eq!(ok.outputs[0].values::<i32>(), vec![5]);
}
