//! Load parameters a user can trust: an unknown or misspelt parameter is refused
//! (naming it, the closest known name and every known one) over each way a load
//! arrives, and Triton's list values (`"preferred_batch_size": [4, 8]`) load the
//! same group as their comma-separated text.

// Test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::{Param, ParamValue};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::{serve_until_exit, triton_config, Kiln};
use serde_json::{json, Value};
use tonic::Code;

const DYNAMIC_ECHO: &str =
    "worker = \"echo\"\n[parameters]\nbatcher = \"dynamic\"\nbatch_size = 8\n";

async fn preferred_sizes(url: &str, model: &str) -> Value {
    triton_config(url, model).await["dynamic_batching"]["preferred_batch_size"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_worker_load_refuses_tritons_unprefixed_allow_timeout_override() {
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    let err = c
        .load("echo", &json!({"allow_timeout_override": true}))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    let text = err.to_string();
    for want in [
        "unknown parameter `allow_timeout_override` for worker `echo`",
        "did you mean `default_queue_policy.allow_timeout_override`?",
        "known: batch_size, batcher, batchers,",
        "max_batch_size",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }
    // Nothing was loaded; the prefixed name is the real one.
    assert_eq!(
        c.model_metadata("echo").await.unwrap_err().status(),
        Some(404)
    );
    let params = json!({"batcher": "dynamic", "default_queue_policy.ALLOW_TIMEOUT_OVERRIDE": true});
    assert_eq!(c.load("echo", &params).await.unwrap(), "echo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_worker_load_refuses_a_misspelt_worker_parameter() {
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    let err = c.load("echo", &json!({"incremnet": 1})).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string()
            .contains("unknown parameter `incremnet` for worker `echo`"),
        "{err}"
    );
    let err = c
        .load("echo", &json!({"max_bath_size": 8}))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("did you mean `max_batch_size`?"),
        "{err}"
    );
    // A request parameter is no load parameter.
    let err = c.load("echo", &json!({"increment": 1})).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("request parameter"), "{err}");
    assert_eq!(
        c.load("echo", &json!({"max_batch_size": 8})).await.unwrap(),
        "echo"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repository_loads_refuse_unknown_overrides_over_rest_and_grpc() {
    let repo = TempRepository::new(&[("m", DYNAMIC_ECHO, &[1])]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    let err = c
        .load_model("m", &json!({"allow_timeout_override": true}))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string()
            .contains("unknown parameter `allow_timeout_override` for model `m` (worker `echo`)"),
        "{err}"
    );
    let grpc = kiln.grpc().await;
    let overrides = [Param {
        key: "incremnet".into(),
        value: ParamValue::Int(1),
    }];
    let err = grpc.load_model("m", &overrides).await.unwrap_err();
    assert_eq!(err.grpc_code(), Some(Code::InvalidArgument), "{err}");
    assert!(
        err.to_string()
            .contains("unknown parameter `incremnet` for model `m`"),
        "{err}"
    );
    assert_eq!(c.model_metadata("m").await.unwrap_err().status(), Some(404));
    grpc.load_model("m", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_toml_with_an_unknown_parameter_fails_that_model_only() {
    let bad = "worker = \"echo\"\n[parameters]\nbatch_size = 4\nincremnet = 1\n";
    let repo = TempRepository::new(&[("bad", bad, &[1]), ("good", DYNAMIC_ECHO, &[1])]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    let err = c.load_model("bad", &json!({})).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string()
            .contains("unknown parameter `incremnet` for model `bad` (worker `echo`)"),
        "{err}"
    );
    c.load_model("good", &json!({})).await.unwrap();
}

#[test]
fn unknown_parameters_at_start_stop_the_server() {
    let (code, log) = serve_until_exit(&["--load", "echo:batch_size=4,incremnet=1"]);
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {log}");
    assert!(
        log.contains("unknown parameter `incremnet` for worker `echo`"),
        "{log}"
    );
    let bad = "worker = \"echo\"\n[parameters]\nallow_timeout_override = true\n";
    let repo = TempRepository::new(&[("bad", bad, &[1])]);
    let (code, log) = serve_until_exit(&["--model-repository", &repo.arg(), "--load-model", "bad"]);
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {log}");
    assert!(
        log.contains("unknown parameter `allow_timeout_override` for model `bad`"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_values_load_the_group_their_text_loads() {
    let listed = format!("{DYNAMIC_ECHO}preferred_batch_size = [4, 8]\n");
    let repo = TempRepository::new(&[("listed", &listed, &[1])]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    let params = |sizes: Value| json!({"batcher": "dynamic", "batch_size": 8, "preferred_batch_size": sizes});
    let endpoint = c.load("echo", &params(json!([4, 8]))).await.unwrap();
    assert_eq!(preferred_sizes(&kiln.url, &endpoint).await, json!([4, 8]));
    // The text form is the same configuration: the same group answers.
    assert_eq!(
        c.load("echo", &params(json!("4,8"))).await.unwrap(),
        endpoint
    );
    // A repository model's TOML list, and a JSON list as a repository override.
    c.load_model("listed", &json!({})).await.unwrap();
    assert_eq!(preferred_sizes(&kiln.url, "listed").await, json!([4, 8]));
    c.load_model("listed", &json!({"preferred_batch_size": [2, 8]}))
        .await
        .unwrap();
    assert_eq!(preferred_sizes(&kiln.url, "listed").await, json!([2, 8]));
    // gRPC's repository parameters have no list: the text form.
    let text = [Param {
        key: "preferred_batch_size".into(),
        value: ParamValue::Str("4,8".into()),
    }];
    kiln.grpc().await.load_model("listed", &text).await.unwrap();
    assert_eq!(preferred_sizes(&kiln.url, "listed").await, json!([4, 8]));
    let err = c.load("echo", &params(json!([4, [8]]))).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_flag_takes_a_list_in_brackets() {
    let kiln = Kiln::start(&[
        "--load",
        "echo:batcher=dynamic,batch_size=8,preferred_batch_size=[4,8],max_queue_delay_microseconds=100",
    ]);
    assert_eq!(preferred_sizes(&kiln.url, "echo").await, json!([4, 8]));
    // The JSON list is the same configuration: the same group answers.
    let params = json!({"batcher": "dynamic", "batch_size": 8, "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 100});
    assert_eq!(kiln.client.load("echo", &params).await.unwrap(), "echo");
    // A bracket left open stops the server, naming the spec.
    let (code, log) = serve_until_exit(&["--load", "echo:preferred_batch_size=[4,8"]);
    assert_ne!(code, Some(0), "{log}");
    assert!(log.contains("`[` without its `]`"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_settings_take_text_and_name_a_bad_value_on_every_ingress() {
    let repo = TempRepository::new(&[("m", DYNAMIC_ECHO, &[1])]);
    // Text from `--load`: a number, an enum in any case, a boolean word, nested names.
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load",
        "echo:batcher=DYNAMIC,batch_size=8,priority_levels=2,default_queue_policy.allow_timeout_override=yes,priority_queue_policy.2.timeout_action=delay",
    ]);
    let c = &kiln.client;
    let config = triton_config(&kiln.url, "echo").await;
    let db = &config["dynamic_batching"];
    assert_eq!(db["priority_levels"], 2, "{config}");
    assert_eq!(
        db["priority_queue_policy"]["2"]["timeout_action"], "DELAY",
        "{config}"
    );
    let bad = "parameter `priority_queue_policy.1.max_queue_size` must be an integer, got `x`";
    // REST: a worker load and a repository override.
    let params = json!({"priority_levels": 1, "priority_queue_policy.1.max_queue_size": "x"});
    let err = c.load("echo", &params).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains(bad), "{err}");
    let err = c.load_model("m", &params).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains(bad), "{err}");
    // gRPC's string parameters.
    let overrides = [Param {
        key: "priority_queue_policy.1.max_queue_size".into(),
        value: ParamValue::Str("x".into()),
    }];
    let err = kiln
        .grpc()
        .await
        .load_model("m", &overrides)
        .await
        .unwrap_err();
    assert_eq!(err.grpc_code(), Some(Code::InvalidArgument), "{err}");
    assert!(err.to_string().contains(bad), "{err}");
    // A range the type cannot hold is named too.
    let err = c.load("echo", &json!({"instances": 0})).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("parameter `instances` must be in 1..=256, got 0"),
        "{err}"
    );
}
