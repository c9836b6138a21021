//! The sequence batcher end to end with the `accumulate` worker (a running sum kept
//! as implicit state, reporting the control inputs it was given): the client view
//! and `/config`, no batcher thread (the instances form their batches), state
//! carried and reset, control values, ordering and exclusivity
//! with many concurrent sequences over HTTP and gRPC streaming, 64-bit ids over
//! HTTP and gRPC, and the errors
//! (no id, not started, ended, expired, too many sequences).

// `unwrap` is test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{
    DataType, GrpcClient, HttpClient, InferRequest, InferResponse, InputTensor, Param, ParamValue,
};
use kiln_tests::{metric, requests_outcome, thread_names, wait_metric, Kiln};
use serde_json::{json, Value};

/// Load-time parameters serving `accumulate` as a stateful model.
fn stateful(extra: Value) -> Value {
    let mut params = json!({
        "batcher": "sequence",
        "batch_size": 8,
        "state.STATE": "STATE_OUT",
        "control.start": "START",
        "control.end": "END",
        "control.ready": "READY",
        "control.corrid": "CORRID",
    });
    if let (Some(p), Some(e)) = (params.as_object_mut(), extra.as_object()) {
        p.extend(e.clone());
    }
    params
}

fn param(key: &str, value: ParamValue) -> Param {
    Param {
        key: key.into(),
        value,
    }
}

/// One value of sequence `id`.
fn step(model: &str, id: ParamValue, value: f32, start: bool, end: bool) -> InferRequest {
    InferRequest {
        model: model.into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT",
            DataType::Fp32,
            &[1, 1],
            &[value],
        )],
        parameters: vec![
            param("sequence_id", id),
            param("sequence_start", ParamValue::Bool(start)),
            param("sequence_end", ParamValue::Bool(end)),
        ],
        ..Default::default()
    }
}

fn output<'a>(r: &'a InferResponse, name: &str) -> &'a kiln_client::OutputTensor {
    r.outputs.iter().find(|o| o.name == name).unwrap()
}

fn sum(r: &InferResponse) -> f32 {
    output(r, "OUTPUT").values::<f32>()[0]
}

async fn error_of(c: &HttpClient, request: &InferRequest) -> (u16, String) {
    let e = c.infer(request).await.unwrap_err();
    (e.status().unwrap(), e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_controls_and_the_client_view() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let model = c.load("accumulate", &stateful(json!({}))).await.unwrap();
    // Clients see only the real input and outputs.
    let meta = c.model_metadata(&model).await.unwrap();
    assert_eq!(meta["inputs"].as_array().unwrap().len(), 1, "{meta}");
    assert_eq!(meta["inputs"][0]["name"], "INPUT");
    let outputs: Vec<&str> = meta["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap())
        .collect();
    assert_eq!(outputs, vec!["OUTPUT", "CONTROLS", "CORRID_OUT"]);
    let config: Value = reqwest::get(format!("{}/v2/models/{model}/config", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let seq = &config["sequence_batching"];
    assert!(config.get("dynamic_batching").is_none(), "{config}");
    assert_eq!(seq["state"][0]["input_name"], "STATE", "{seq}");
    assert_eq!(seq["state"][0]["output_name"], "STATE_OUT");
    assert_eq!(seq["control_input"].as_array().unwrap().len(), 4);
    assert_eq!(seq["direct"]["max_queue_delay_microseconds"], 0);

    // A running sum with the control values each step was given.
    let id = || ParamValue::Int(77);
    let r = c
        .infer(&step(&model, id(), 1.0, true, false))
        .await
        .unwrap();
    assert_eq!(sum(&r), 1.0);
    assert_eq!(output(&r, "CONTROLS").values::<i32>(), vec![1, 0, 1]);
    assert_eq!(output(&r, "CORRID_OUT").values::<u64>(), vec![77]);
    assert!(r.outputs.iter().all(|o| o.name != "STATE_OUT"));
    // The instance forms its own batches: the group has no batcher thread.
    let names = thread_names(kiln.pid());
    // Linux keeps 15 bytes of a thread's name.
    let mut instance = format!("worker-{model}-0");
    instance.truncate(15);
    assert!(names.contains(&instance), "the instance runs: {names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with("sequence-")),
        "no sequence batcher thread: {names:?}"
    );
    let r = c
        .infer(&step(&model, id(), 2.0, false, false))
        .await
        .unwrap();
    assert_eq!(sum(&r), 3.0);
    assert_eq!(output(&r, "CONTROLS").values::<i32>(), vec![0, 0, 1]);
    // A start on a live sequence resets its state.
    let r = c
        .infer(&step(&model, id(), 5.0, true, false))
        .await
        .unwrap();
    assert_eq!(sum(&r), 5.0);
    let r = c
        .infer(&step(&model, id(), 1.0, false, true))
        .await
        .unwrap();
    assert_eq!(sum(&r), 6.0);
    assert_eq!(output(&r, "CONTROLS").values::<i32>(), vec![0, 1, 1]);

    // After its end, the id needs a new start.
    let (status, message) = error_of(&c, &step(&model, id(), 1.0, false, false)).await;
    assert_eq!(status, 400);
    assert!(message.contains("sequence 77 is not active"), "{message}");
    let r = c.infer(&step(&model, id(), 4.0, true, true)).await.unwrap();
    assert_eq!(sum(&r), 4.0);

    // The largest uint64 id, over HTTP (a JSON number beyond i64's range) and over
    // gRPC (a `uint64_param`), reaches CORRID whole.
    let big = || ParamValue::from_u64(u64::MAX);
    assert_eq!(big(), ParamValue::Uint(u64::MAX));
    let r = c
        .infer(&step(&model, big(), 2.0, true, false))
        .await
        .unwrap();
    assert_eq!(output(&r, "CORRID_OUT").values::<u64>(), vec![u64::MAX]);
    let grpc = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    let r = grpc
        .infer(&step(&model, big(), 3.0, false, true))
        .await
        .unwrap();
    assert_eq!(sum(&r), 5.0);
    assert_eq!(output(&r, "CORRID_OUT").values::<u64>(), vec![u64::MAX]);

    // No id; two rows in one request; a string id that does not fit UINT64 CORRID.
    let mut no_id = step(&model, id(), 1.0, true, false);
    no_id.parameters.clear();
    let (status, message) = error_of(&c, &no_id).await;
    assert_eq!(status, 400);
    assert!(message.contains("needs a `sequence_id`"), "{message}");
    let mut two_rows = step(&model, id(), 1.0, true, false);
    two_rows.inputs = vec![InputTensor::from_slice(
        "INPUT",
        DataType::Fp32,
        &[2, 1],
        &[1.0f32, 2.0],
    )];
    let (status, message) = error_of(&c, &two_rows).await;
    assert_eq!(status, 400);
    assert!(message.contains("one row"), "{message}");
    let text = step(&model, ParamValue::Str("abc".into()), 1.0, true, false);
    let (status, message) = error_of(&c, &text).await;
    assert_eq!(status, 400);
    assert!(message.contains("CORRID"), "{message}");
    let metrics = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&metrics, &model, "invalid"), Some(4.0));
}

/// 32 sequences at once, each 24 steps with the next sent when the last is answered:
/// every sum is right (state never crosses sequences, steps never reorder), and
/// sequences share batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sequences_over_http_and_grpc_streams() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let model = c
        .load(
            "accumulate",
            &stateful(json!({
                "batch_size": 32,
                "sequence_strategy": "oldest",
                "max_queue_delay_microseconds": 50_000,
                "corrid_type": "STRING",
            })),
        )
        .await
        .unwrap();
    let steps = 24u64;
    let mut tasks = Vec::new();
    for s in 0..32u64 {
        let model = model.clone();
        let mut caller = kiln.caller(s % 2 == 0).await;
        tasks.push(tokio::spawn(async move {
            // Even sequences use string ids over gRPC streams, odd ones numbers over HTTP.
            let id = if s % 2 == 0 {
                ParamValue::Str(format!("stream-{s}").into())
            } else {
                ParamValue::Int(1000 + s as i64)
            };
            let id_text = match &id {
                ParamValue::Str(s) => s.to_string(),
                other => other.to_string(),
            };
            let mut expected = 0.0f32;
            for k in 0..steps {
                let value = (s * 100 + k) as f32;
                expected += value;
                let request = step(&model, id.clone(), value, k == 0, k == steps - 1);
                let r = caller.infer(&request).await.unwrap();
                assert_eq!(sum(&r), expected, "sequence {s} step {k}");
                // CORRID as a string: numeric ids in decimal.
                let corrid = &output(&r, "CORRID_OUT").data;
                assert_eq!(&corrid[4..], id_text.as_bytes());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let text = c.metrics().await.unwrap();
    let batches = metric(&text, "kiln_batch_size_count", &[("model", &model)]).unwrap();
    let requests = metric(&text, "kiln_batch_size_sum", &[("model", &model)]).unwrap();
    assert_eq!(requests, 32.0 * steps as f64);
    assert!(
        requests / batches > 4.0,
        "{requests} requests in {batches} batches"
    );
    assert_eq!(
        metric(&text, "kiln_sequences_active", &[("model", &model)]),
        Some(0.0)
    );
}

/// Two instances, each forming the batches of the sequences pinned to it (eight
/// slots each, so the sixteen sequences fill both): 20 steps each over HTTP keep
/// their sums (no step lost, repeated or reordered across the instances).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequences_on_two_instances_keep_their_state() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let model = c
        .load(
            "accumulate",
            &stateful(json!({"batch_size": 8, "instances": 2})),
        )
        .await
        .unwrap();
    let steps = 20u64;
    let mut tasks = Vec::new();
    for s in 0..16u64 {
        let (c, model) = (c.clone(), model.clone());
        tasks.push(tokio::spawn(async move {
            let mut expected = 0.0f32;
            for k in 0..steps {
                let value = (s * 100 + k) as f32;
                expected += value;
                let request = step(
                    &model,
                    ParamValue::Int(500 + s as i64),
                    value,
                    k == 0,
                    k == steps - 1,
                );
                let r = c.infer(&request).await.unwrap();
                assert_eq!(sum(&r), expected, "sequence {s} step {k}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let text = c.metrics().await.unwrap();
    let requests = metric(&text, "kiln_batch_size_sum", &[("model", &model)]).unwrap();
    assert_eq!(requests, 16.0 * steps as f64);
    let names = thread_names(kiln.pid());
    for n in 0..2 {
        let mut instance = format!("worker-{model}-{n}");
        instance.truncate(15);
        assert!(names.contains(&instance), "{instance}: {names:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sequences_expire_and_live_ones_are_bounded() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let params = stateful(json!({"batch_size": 2, "max_sequence_idle_microseconds": 200_000}));
    let model = c.load("accumulate", &params).await.unwrap();
    c.infer(&step(&model, ParamValue::Int(1), 1.0, true, false))
        .await
        .unwrap();
    c.infer(&step(&model, ParamValue::Int(2), 1.0, true, false))
        .await
        .unwrap();
    // Two slots (batch_size 2, one instance, direct) are taken: a third start waits
    // for none (no backlog) and is refused with 429.
    let (status, message) = error_of(&c, &step(&model, ParamValue::Int(3), 1.0, true, false)).await;
    assert_eq!(status, 429, "{message}");
    assert!(message.contains("sequence places are taken"), "{message}");
    // Both go idle and expire (the batcher reports no live sequence once they have);
    // a later step of sequence 1 says so, and the slots are free.
    wait_metric(&c, "kiln_sequences_active", &model, 0.0).await;
    let (status, message) =
        error_of(&c, &step(&model, ParamValue::Int(1), 1.0, false, false)).await;
    assert_eq!(status, 400);
    assert!(message.contains("expired after 200000 µs"), "{message}");
    let r = c
        .infer(&step(&model, ParamValue::Int(3), 2.0, true, false))
        .await
        .unwrap();
    assert_eq!(sum(&r), 2.0);
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, &model, "rejected"), Some(1.0));
    assert_eq!(
        metric(&text, "kiln_sequences_active", &[("model", &model)]),
        Some(1.0)
    );

    // With a backlog, a start beyond the live bound waits for a sequence to end.
    let params = stateful(json!({"batch_size": 1, "max_sequence_backlog": 1}));
    let model = c.load("accumulate", &params).await.unwrap();
    c.infer(&step(&model, ParamValue::Int(1), 1.0, true, false))
        .await
        .unwrap();
    let waiting = {
        let (c, model) = (c.clone(), model.clone());
        tokio::spawn(async move {
            c.infer(&step(&model, ParamValue::Int(2), 7.0, true, true))
                .await
        })
    };
    // The second start waits in the backlog, unanswered, until the first ends.
    wait_metric(&c, "kiln_sequence_backlog", &model, 1.0).await;
    assert!(!waiting.is_finished());
    c.infer(&step(&model, ParamValue::Int(1), 1.0, false, true))
        .await
        .unwrap();
    assert_eq!(sum(&waiting.await.unwrap().unwrap()), 7.0);
}
