//! Asynchronous workers end to end, with the simulated device `fpga-sim` (compute
//! units as threads, completing batches later): outputs checked against an
//! independent int8 matrix multiply under many concurrent clients; the
//! `max_outstanding` cap and the buffer pool bounding what is in flight (the
//! server's high-water gauges and what the device itself saw); a batch failed,
//! panicked on or dropped by a unit fails alone; `preserve_ordering` answers in
//! order when the device completes out of order; unloading drains what is out.

// Test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{
    DataType, HttpClient, InferRequest, InferResponse, InputTensor, Param, ParamValue,
};
use kiln_tests::{metric, requests_outcome, wait_metric, wait_metric_until, Kiln};
use serde_json::{json, Value};

const K: usize = 16;
const M: usize = 8;
const SEED: u64 = 42;

/// The load parameters shared by every group here, plus `extra`.
fn params(extra: Value) -> Value {
    let mut p = json!({"k": K, "m": M, "seed": SEED, "setup_us": 2000, "row_ns": 100_000});
    for (key, value) in extra.as_object().unwrap() {
        p[key] = value.clone();
    }
    p
}

/// W[i][j] as documented by the worker, computed here on its own:
/// splitmix64(seed << 32 | (i·M + j)), low byte as i8.
fn weight(i: usize, j: usize) -> i32 {
    let mut z = (SEED << 32 | (i * M + j) as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    i32::from((z ^ (z >> 31)) as u8 as i8)
}

/// `x · W` for `rows` rows of K int8 values.
fn expected(x: &[i8]) -> Vec<i32> {
    x.chunks_exact(K)
        .flat_map(|row| (0..M).map(move |j| (0..K).map(|i| i32::from(row[i]) * weight(i, j)).sum()))
        .collect()
}

/// Deterministic int8 rows for request `n`.
fn rows(n: u64, count: usize) -> Vec<i8> {
    let mut state = n
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count * K)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 56) as u8 as i8
        })
        .collect()
}

fn request(model: &str, x: &[i8], params: &[(&str, ParamValue)]) -> InferRequest {
    InferRequest {
        model: model.into(),
        inputs: vec![InputTensor::from_slice(
            "X",
            DataType::Int8,
            &[(x.len() / K) as i64, K as i64],
            x,
        )],
        parameters: params
            .iter()
            .map(|(k, v)| Param {
                key: (*k).into(),
                value: v.clone(),
            })
            .collect(),
        ..Default::default()
    }
}

fn output<'a>(r: &'a InferResponse, name: &str) -> &'a kiln_client::OutputTensor {
    r.outputs.iter().find(|o| o.name == name).unwrap()
}

/// Checks `Y` of an answer against the independent multiply; returns its
/// `DEVICE` rows ([batches in the device at submission, completion number, unit]).
fn check(r: &InferResponse, x: &[i8]) -> Vec<[i64; 3]> {
    let y = output(r, "Y");
    assert_eq!(y.shape, vec![(x.len() / K) as i64, M as i64]);
    assert_eq!(y.values::<i32>(), expected(x), "Y = X·W");
    output(r, "DEVICE")
        .values::<i64>()
        .chunks_exact(3)
        .map(|c| [c[0], c[1], c[2]])
        .collect()
}

/// `clients` concurrent clients each sending `each` requests of 1..=3 rows to
/// `model`; every answer checked. Returns every `DEVICE` row seen.
async fn hammer(
    c: &HttpClient,
    model: &str,
    clients: u64,
    each: u64,
    most_rows: u64,
) -> Vec<[i64; 3]> {
    let tasks: Vec<_> = (0..clients)
        .map(|client| {
            let (c, model) = (c.clone(), model.to_owned());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for i in 0..each {
                    let n = client * 1000 + i;
                    let x = rows(n, 1 + (n % most_rows) as usize);
                    let r = c.infer(&request(&model, &x, &[])).await.unwrap();
                    seen.extend(check(&r, &x));
                }
                seen
            })
        })
        .collect();
    let mut seen = Vec::new();
    for t in tasks {
        seen.extend(t.await.unwrap());
    }
    seen
}

async fn gauge(c: &HttpClient, name: &str, model: &str) -> f64 {
    let text = c.metrics().await.unwrap();
    metric(&text, name, &[("model", model)]).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outputs_are_right_under_concurrency_and_the_bounds_hold() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    // Four units, at most four batches out; the pool's default is then
    // 1 instance × (4 + 1) + 1 = 6 sets.
    let model = c
        .load(
            "fpga-sim",
            &params(json!({"compute_units": 4, "max_outstanding": 4, "batch_size": 4})),
        )
        .await
        .unwrap();
    let seen = hammer(&c, &model, 48, 4, 3).await;
    let deepest = seen.iter().map(|d| d[0]).max().unwrap();
    assert!(
        deepest <= 4,
        "the device saw {deepest} batches at once, cap 4"
    );
    assert!(deepest >= 2, "48 clients never had two batches out at once");
    let most = gauge(&c, "kiln_outstanding_batches_max", &model).await;
    assert!((2.0..=4.0).contains(&most), "outstanding high-water {most}");
    assert_eq!(gauge(&c, "kiln_buffer_pool_size", &model).await, 6.0);
    let pool_most = gauge(&c, "kiln_buffer_pool_in_use_max", &model).await;
    assert!(
        (most..=6.0).contains(&pool_most),
        "pool high-water {pool_most}"
    );
    assert_eq!(gauge(&c, "kiln_outstanding_batches", &model).await, 0.0);
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, &model, "success"), Some(192.0));
    assert_eq!(
        metric(&text, "kiln_pending_requests", &[("model", &model)]),
        Some(0.0)
    );
    let units: std::collections::BTreeSet<i64> = seen.iter().map(|d| d[2]).collect();
    assert!(units.len() >= 2, "one unit did all the work: {units:?}");

    // Two buffer sets: a batch holds its set until it completes, so however high
    // max_outstanding is, no more than two batches are ever out.
    let tight = c
        .load("fpga-sim", &params(json!({"compute_units": 4, "max_outstanding": 4, "batch_size": 4, "max_buffers": 2})))
        .await
        .unwrap();
    assert_ne!(tight, model);
    let seen = hammer(&c, &tight, 32, 3, 3).await;
    let deepest = seen.iter().map(|d| d[0]).max().unwrap();
    assert!(
        deepest <= 2,
        "the device saw {deepest} batches with 2 buffer sets"
    );
    let most = gauge(&c, "kiln_outstanding_batches_max", &tight).await;
    assert!(
        most <= 2.0,
        "outstanding high-water {most} with 2 buffer sets"
    );
    assert_eq!(gauge(&c, "kiln_buffer_pool_in_use_max", &tight).await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_a_unit_fails_panics_on_or_drops_fails_alone() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    // One request per batch, so a failed batch is one request.
    let model = c
        .load(
            "fpga-sim",
            &params(json!({"compute_units": 4, "max_outstanding": 4, "batch_size": 1})),
        )
        .await
        .unwrap();
    let good = {
        let c = c.clone();
        let model = model.clone();
        tokio::spawn(async move { hammer(&c, &model, 8, 4, 1).await })
    };
    let faults = [
        ("sim_fail", "simulated compute unit"),
        ("sim_panic", "worker panicked: simulated compute unit"),
        ("sim_drop", "dropped the batch without completing it"),
    ];
    for (fault, message) in faults {
        let x = rows(7, 1);
        let err = c
            .infer(&request(&model, &x, &[(fault, ParamValue::Bool(true))]))
            .await
            .unwrap_err();
        assert_eq!(err.status(), Some(500), "{fault}: {err}");
        assert!(err.to_string().contains(message), "{fault}: {err}");
    }
    assert_eq!(
        good.await.unwrap().len(),
        8 * 4,
        "every good request answered"
    );
    // A bad value of a declared request parameter is refused at admission.
    let err = c
        .infer(&request(
            &model,
            &rows(1, 1),
            &[("sim_delay_us", ParamValue::Int(-5))],
        ))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    // The device serves on: its units survived the panic.
    hammer(&c, &model, 4, 4, 1).await;
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, &model, "failure"), Some(3.0));
    assert_eq!(requests_outcome(&text, &model, "success"), Some(48.0));
    assert_eq!(gauge(&c, "kiln_outstanding_batches", &model).await, 0.0);

    // max_outstanding is checked, and only for asynchronous workers.
    for bad in [
        json!({"max_outstanding": 0}),
        json!({"max_outstanding": 2000}),
    ] {
        let err = c.load("fpga-sim", &params(bad)).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
    }
    let err = c
        .load("echo", &json!({"max_outstanding": 2}))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("synchronous"), "{err}");
    let err = c
        .load("fpga-sim", &params(json!({"batcher": "sequence"})))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
}

/// One answer as it arrived: its tag, its batch's completion number on the
/// device, and how many batches the server had seen complete by then.
type Arrival = (&'static str, i64, f64);

/// Sends a request that the device holds `delay_us` longer, and reports its
/// [`Arrival`] on `done` when its answer arrives.
fn send(
    c: &HttpClient,
    model: &str,
    tag: &'static str,
    delay_us: i64,
    done: &tokio::sync::mpsc::UnboundedSender<Arrival>,
) -> tokio::task::JoinHandle<()> {
    let (c, model, done) = (c.clone(), model.to_owned(), done.clone());
    tokio::spawn(async move {
        let x = rows(delay_us as u64, 1);
        let r = c
            .infer(&request(
                &model,
                &x,
                &[("sim_delay_us", ParamValue::Int(delay_us))],
            ))
            .await
            .unwrap();
        let device = check(&r, &x);
        // Counted as each batch completes, before its answers leave (gone once
        // the model is unloaded).
        let text = c.metrics().await.unwrap();
        let completed = metric(
            &text,
            "kiln_compute_duration_seconds_count",
            &[("model", &model)],
        )
        .unwrap_or(f64::NAN);
        done.send((tag, device[0][1], completed)).unwrap();
    })
}

/// Sends a slow request (1 s on the device) then a quick one to `model`; returns
/// their arrivals (slow, quick) and the completions counted before.
async fn slow_then_quick(c: &HttpClient, model: &str) -> (Arrival, Arrival, f64) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let before = gauge(c, "kiln_batch_size_count", model).await;
    let completed = gauge(c, "kiln_compute_duration_seconds_count", model).await;
    let slow = send(c, model, "slow", 1_000_000, &tx);
    // The slow batch is out before the quick one is sent.
    wait_metric(c, "kiln_batch_size_count", model, before + 1.0).await;
    let quick = send(c, model, "quick", 0, &tx);
    slow.await.unwrap();
    quick.await.unwrap();
    drop(tx);
    let mut arrivals = Vec::new();
    while let Some(arrival) = rx.recv().await {
        arrivals.push(arrival);
    }
    arrivals.sort_by_key(|a| a.0 != "slow");
    (arrivals[0], arrivals[1], completed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn preserve_ordering_answers_in_order_when_the_device_completes_out_of_order() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let base = json!({"compute_units": 2, "max_outstanding": 2, "batch_size": 1});
    let ordered = c
        .load("fpga-sim", &params(json!({"compute_units": 2, "max_outstanding": 2, "batch_size": 1, "preserve_ordering": true})))
        .await
        .unwrap();
    let (slow, quick, before) = slow_then_quick(&c, &ordered).await;
    assert!(
        quick.1 < slow.1,
        "the device completed the quick batch first: {slow:?} {quick:?}"
    );
    assert_eq!(
        quick.2,
        before + 2.0,
        "the quick answer waited for the slow batch"
    );
    // Without preserve_ordering the quick answer leaves while the slow batch is out.
    let free = c.load("fpga-sim", &params(base)).await.unwrap();
    let (slow, quick, before) = slow_then_quick(&c, &free).await;
    assert!(quick.1 < slow.1, "{slow:?} {quick:?}");
    assert_eq!(quick.2, before + 1.0, "the quick answer did not wait");

    // Unloading drains: a batch out on the device is answered, then the
    // instance is released.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let before = gauge(&c, "kiln_batch_size_count", &free).await;
    let pending = send(&c, &free, "last", 300_000, &tx);
    wait_metric(&c, "kiln_batch_size_count", &free, before + 1.0).await;
    wait_metric_until(&c, "kiln_outstanding_batches", &free, |v| v == 1.0).await;
    c.unload(&free).await.unwrap();
    pending.await.unwrap();
    assert_eq!(rx.recv().await.map(|(tag, ..)| tag), Some("last"));
    let log = kiln.log_with("fpga-sim: release");
    assert!(
        log.contains("fpga-sim: release, 0 batches in the device"),
        "{log}"
    );
}
