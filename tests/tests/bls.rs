//! Workers that call models (`kiln_worker_sdk::call`, Triton's BLS), through the
//! real binary and real plugins: `bls-echo` sends each request's values to another
//! model and answers with what it returned. The calls take the one inference path
//! (they show in the callee's counts), a call into the caller's own model or into
//! a model that itself calls models is refused, a callee's error fails only the
//! request it served, and the request's deadline and cancellation reach the call.
//! A worker in a worker host calls the same way (the host relays its calls), and
//! a call's inputs are reserved from the client-bytes budget.

// Test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{DataType, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::{metric, Kiln};

fn request(model: &str, values: &[i32], params: Vec<Param>) -> InferRequest {
    InferRequest {
        model: model.into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, values.len() as i64],
            values,
        )],
        parameters: params,
        ..Default::default()
    }
}

fn timeout_us(us: i64) -> Vec<Param> {
    vec![Param {
        key: "timeout".into(),
        value: ParamValue::Int(us),
    }]
}

/// Endpoints, in load order: `bls-echo` calls itself, `bls-echo-0` calls
/// `faulty`, `bls-echo-1` calls `echo`, `bls-echo-2` calls `bls-echo-1`.
fn start() -> Kiln {
    Kiln::start(&[
        "--load",
        "echo",
        "--load",
        "faulty",
        "--load",
        "bls-echo:target=bls-echo",
        "--load",
        "bls-echo:target=faulty,target_dtype=INT32",
        "--load",
        "bls-echo:target=echo",
        "--load",
        "bls-echo:target=bls-echo-1",
    ])
}

fn requests_to(text: &str, model: &str, outcome: &str) -> f64 {
    metric(
        text,
        "kiln_requests_total",
        &[("model", model), ("outcome", outcome)],
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_run_on_the_callee_and_errors_come_back_as_values() {
    let kiln = start();
    let c = &kiln.client;

    // Eight clients at once: each answer is its own values + 1 (echo's work), and
    // echo counts the eight calls as its own requests.
    let calls = (0..8).map(|i| {
        let c = c.clone();
        async move {
            c.infer(&request("bls-echo-1", &[i, 10 * i], Vec::new()))
                .await
        }
    });
    for (i, answer) in futures_join(calls).await.into_iter().enumerate() {
        let i = i as i32;
        assert_eq!(
            answer.unwrap().outputs[0].values::<i32>(),
            vec![i + 1, 10 * i + 1]
        );
    }
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_to(&text, "echo", "success"), 8.0, "{text}");
    assert_eq!(requests_to(&text, "bls-echo-1", "success"), 8.0);

    // A call into the caller's own model is refused, with the rule in the message.
    let err = c
        .infer(&request("bls-echo", &[1], Vec::new()))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(500), "{err}");
    assert!(err.to_string().contains("cannot call itself"), "{err}");

    // `bls-echo-1` calls models, so calling it is refused (calls go one level deep).
    let err = c
        .infer(&request("bls-echo-2", &[1], Vec::new()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("itself calls models"), "{err}");

    // The callee's errors: a request it refuses (400) and a batch it fails (500),
    // one after the other (together they could share faulty's failing batch); a
    // good request to the same caller is answered.
    let refused = c.infer(&request("bls-echo-0", &[-7], Vec::new())).await;
    let failed = c.infer(&request("bls-echo-0", &[-2], Vec::new())).await;
    let refused = refused.unwrap_err();
    assert_eq!(refused.status(), Some(400), "{refused}");
    assert!(
        refused.to_string().contains("faulty worker refused -7"),
        "{refused}"
    );
    let failed = failed.unwrap_err();
    assert_eq!(failed.status(), Some(500), "{failed}");
    assert!(
        failed.to_string().contains("faulty worker saw -2"),
        "{failed}"
    );
    let ok = c
        .infer(&request("bls-echo-0", &[5, 6], Vec::new()))
        .await
        .unwrap();
    assert_eq!(ok.outputs[0].values::<i32>(), vec![5, 6]);
    let text = c.metrics().await.unwrap();
    assert!(requests_to(&text, "faulty", "invalid") >= 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_deadline_ends_the_call() {
    let kiln = start();
    let c = &kiln.client;
    // faulty takes 1 s on -3; the request allows 200 ms (its `timeout`, µs), so
    // the call gives up at the deadline with a timeout, not faulty's answer.
    let err = c
        .infer(&request("bls-echo-0", &[-3], timeout_us(200_000)))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(500), "{err}");
    assert!(err.to_string().contains("deadline passed"), "{err}");
    // A deadline far enough away lets the slow call finish.
    let ok = c
        .infer(&request("bls-echo-0", &[-3, 4], timeout_us(30_000_000)))
        .await
        .unwrap();
    assert_eq!(ok.outputs[0].values::<i32>(), vec![-3, 4]);
}

/// A worker in a worker host (`isolation = "process"`) calls models as an
/// in-process one does: the host relays the calls to the server (inputs and
/// answers through its arena), which runs them through the one inference path,
/// with the request's deadline and the no-deadlock rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_host_relays_its_calls() {
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        "--load",
        "faulty",
        "--load",
        "bls-echo:target=echo,isolation=process",
        "--load",
        "bls-echo:target=faulty,target_dtype=INT32,isolation=process",
        "--load",
        "bls-echo:target=bls-echo,isolation=process",
    ]);
    let c = &kiln.client;
    // Eight requests at once (batched: several calls relayed in one message),
    // one of 64 KiB.
    let sizes = [1usize, 3, 16384, 2, 5, 1, 7, 4];
    let answers = futures_join(sizes.iter().map(|&n| {
        let c = c.clone();
        async move {
            let values: Vec<i32> = (0..n as i32).map(|v| v * 3 - 7).collect();
            let answer = c
                .infer_binary(&request("bls-echo", &values, Vec::new()))
                .await;
            (values, answer)
        }
    }))
    .await;
    for (values, answer) in answers {
        let want: Vec<i32> = values.iter().map(|v| v + 1).collect();
        assert_eq!(answer.unwrap().outputs[0].values::<i32>(), want);
    }
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_to(&text, "echo", "success"), 8.0, "{text}");

    // The request's deadline reaches the relayed call (faulty takes 1 s on -3).
    let err = c
        .infer(&request("bls-echo-0", &[-3], timeout_us(200_000)))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(500), "{err}");
    assert!(err.to_string().contains("deadline passed"), "{err}");
    // A call into a model that calls models (bls-echo) is refused, not waited on.
    let err = c
        .infer(&request("bls-echo-1", &[1], Vec::new()))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("which itself calls models"),
        "{err}"
    );
    let text = c.metrics().await.unwrap();
    for model in ["bls-echo", "bls-echo-0", "bls-echo-1"] {
        let restarts = metric(
            &text,
            "kiln_worker_host_restarts_total",
            &[("model", model)],
        );
        assert_eq!(restarts.unwrap_or(0.0), 0.0, "{model}: {text}");
    }
}

/// Runs the futures at once, answers in order.
async fn futures_join<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// From issue #27: a worker calling an ensemble that holds it waited on itself
/// until its deadline. The ensemble's steps call models, so the call is refused at
/// once, as a call into any caller is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_into_an_ensemble_that_holds_the_caller_is_refused() {
    let repo = kiln_tests::fixtures::TempRepository::new(&[
        (
            "caller",
            "worker = \"bls-echo\"\n[parameters]\ntarget = \"loop\"\ntarget_dtype = \"INT32\"\n",
            &[1],
        ),
        (
            "loop",
            "platform = \"ensemble\"\nmax_batch_size = 8\n\
             [[input]]\nname = \"IN\"\ndata_type = \"TYPE_INT32\"\ndims = [-1]\n\
             [[output]]\nname = \"OUT\"\ndata_type = \"TYPE_INT32\"\ndims = [-1]\n\
             [[ensemble_scheduling.step]]\nmodel_name = \"caller\"\n\
             input_map = { INPUT0 = \"IN\" }\noutput_map = { OUTPUT0 = \"OUT\" }\n",
            &[1],
        ),
    ]);
    let root = repo.path().to_str().unwrap().to_owned();
    let kiln = Kiln::start(&[
        "--model-repository",
        &root,
        "--load-model",
        "caller",
        "--load-model",
        "loop",
    ]);
    // A deadline far away: without the check the call would wait for all of it.
    let err = kiln
        .client
        .infer(&request("caller", &[1], timeout_us(600_000_000)))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(500), "{err}");
    assert!(err.to_string().contains("itself calls models"), "{err}");
}

/// A call's copy of its inputs is reserved from the client-bytes budget before
/// it is made (`Use::ModelCall`): a 64 KiB request, whose body the budget holds,
/// cannot make the server hold another 64 KiB for its call past 96 KiB; the call
/// fails at once saying so, smaller ones pass, and nothing stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_inputs_are_reserved_from_the_client_bytes_budget() {
    let kiln = Kiln::start(&[
        "--max-client-bytes",
        "98304",
        "--load",
        "echo",
        "--load",
        "bls-echo:target=echo",
    ]);
    let client = &kiln.client;
    let values: Vec<i32> = (0..16384).collect();
    let refused = client
        .infer_binary(&request("bls-echo", &values, Vec::new()))
        .await
        .unwrap_err();
    assert_eq!(refused.status(), Some(500), "{refused}");
    for want in ["model `echo`", "model call", "--max-client-bytes 98304"] {
        assert!(refused.to_string().contains(want), "{want}: {refused}");
    }
    let answer = client
        .infer_binary(&request("bls-echo", &values[..1024], Vec::new()))
        .await
        .unwrap();
    let want: Vec<i32> = values[..1024].iter().map(|v| v + 1).collect();
    assert_eq!(answer.outputs[0].values::<i32>(), want);
    let text = client.metrics().await.unwrap();
    assert_eq!(metric(&text, "kiln_client_bytes", &[]), Some(0.0), "{text}");
    let refusals = metric(
        &text,
        "kiln_client_bytes_refused_total",
        &[("use", "model_call")],
    );
    assert_eq!(refusals, Some(1.0), "{text}");
}
