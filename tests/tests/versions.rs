//! Model versions as Triton serves them (issue #31, item 2): several versions of a
//! repository model loaded side by side under one name, per its `version_policy`;
//! `/v2/models/{m}/versions/{v}/…` and gRPC `model_version` reach each one, the
//! unversioned name the highest; one version unloaded alone, and a reload that
//! moves the policy's window, while clients call throughout: every answer counted.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::{ClientError, GrpcClient, HttpClient};
use kiln_server::grpc::proto::{self, model_repository_parameter::ParameterChoice};
use kiln_tests::clients::{echo_row as request, Clients};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::{metric, Kiln};
use serde_json::{json, Value};

const CLIENTS: u32 = 8;

/// The version that answered `model`.
async fn answered_by(client: &HttpClient, model: &str) -> Result<String, ClientError> {
    Ok(client.infer(&request(model, 1)).await?.model_version)
}

/// The repository index as (name, version, state) rows.
async fn index(client: &HttpClient) -> Vec<(String, String, String)> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    client
        .repository_index()
        .await
        .unwrap()
        .iter()
        .map(|row| {
            (
                text(&row["name"]),
                text(&row["version"]),
                text(&row["state"]),
            )
        })
        .collect()
}

fn rows_of(rows: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    rows.iter()
        .map(|(n, v, s)| (n.to_string(), v.to_string(), s.to_string()))
        .collect()
}

/// `POST /v2/repository/models/{model}/unload` with `body`.
async fn unload(kiln: &Kiln, model: &str, body: Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/v2/repository/models/{model}/unload", kiln.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_version_the_policy_allows_answers_under_its_own_number() {
    let repo = TempRepository::new(&[(
        "echo",
        "worker = \"echo\"\nversion_policy = \"all\"\n",
        &[1, 2],
    )]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "echo"]);
    let c = &kiln.client;
    assert_eq!(answered_by(c, "echo/versions/1").await.unwrap(), "1");
    assert_eq!(answered_by(c, "echo/versions/2").await.unwrap(), "2");
    // The unversioned name is the highest loaded version.
    assert_eq!(answered_by(c, "echo").await.unwrap(), "2");
    let e = answered_by(c, "echo/versions/3").await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    assert!(
        e.to_string()
            .contains("Request for unknown model: 'echo' version 3 is not found"),
        "{e}"
    );
    assert_eq!(
        index(c).await,
        rows_of(&[("echo", "1", "READY"), ("echo", "2", "READY")])
    );
    let metadata = c.model_metadata("echo").await.unwrap();
    assert_eq!(metadata["versions"], json!(["1", "2"]), "{metadata}");

    // gRPC's model_version the same.
    let grpc = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    for (version, answers) in [("1", "1"), ("2", "2"), ("", "2")] {
        let mut message = kiln_server::grpc::convert::encode_request(&request("echo", 1));
        message.model_version = version.into();
        let response = grpc.infer_message(message).await.unwrap();
        assert_eq!(response.model_version, answers);
    }
    let mut message = kiln_server::grpc::convert::encode_request(&request("echo", 1));
    message.model_version = "7".into();
    let e = grpc.infer_message(message).await.unwrap_err().to_string();
    assert!(
        e.contains("NotFound") || e.contains("NOT_FOUND") || e.contains("not found"),
        "{e}"
    );
    assert!(e.contains("'echo' version 7 is not found"), "{e}");

    // Each version's requests are counted under its own `version` label.
    let text = c.metrics().await.unwrap();
    for version in ["1", "2"] {
        let labels = [
            ("model", "echo"),
            ("version", version),
            ("outcome", "success"),
        ];
        let counted = metric(&text, "kiln_requests_total", &labels).unwrap_or(0.0);
        assert!(counted >= 2.0, "version {version}: {counted}\n{text}");
    }

    // Over gRPC: the index has a row per version; an unload naming a version
    // unloads it alone.
    let rows = grpc.repository_index(false).await.unwrap();
    let versions: Vec<_> = rows
        .iter()
        .map(|m| (m.version.as_str(), m.state.as_str()))
        .collect();
    assert_eq!(versions, [("1", "READY"), ("2", "READY")]);
    let version = proto::ModelRepositoryParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(1)),
    };
    grpc.raw()
        .repository_model_unload(proto::RepositoryModelUnloadRequest {
            repository_name: String::new(),
            model_name: "echo".into(),
            parameters: [("version".to_owned(), version)].into(),
        })
        .await
        .unwrap();
    assert_eq!(index(c).await, rows_of(&[("echo", "2", "READY")]));
    assert_eq!(answered_by(c, "echo").await.unwrap(), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_default_policy_serves_the_newest_and_a_reload_moves_the_window_under_load() {
    let repo = TempRepository::new(&[
        ("newest", "worker = \"echo\"\n", &[1, 2, 3]),
        (
            "two",
            "worker = \"echo\"\nversion_policy = { latest = 2 }\n",
            &[1, 2, 3],
        ),
    ]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    c.load_model("newest", &json!({})).await.unwrap();
    c.load_model("two", &json!({})).await.unwrap();
    // Latest 1 (Triton's default): only version 3.
    assert_eq!(answered_by(c, "newest").await.unwrap(), "3");
    let e = answered_by(c, "newest/versions/2").await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    assert_eq!(
        index(c).await,
        rows_of(&[
            ("newest", "3", "READY"),
            ("two", "2", "READY"),
            ("two", "3", "READY")
        ])
    );

    // A new version folder appears; the model is loaded again (six times) while
    // clients call its unversioned name: version 4 comes in, version 2 drains and
    // goes.
    let running = Clients::start_from(c, "two", CLIENTS, &["3", "4"]);
    std::fs::create_dir_all(repo.path().join("two/4")).unwrap();
    for i in 0..6 {
        // Alternating the batch size: each load also replaces both versions' groups.
        c.load_model("two", &json!({"batch_size": 4 + i % 2}))
            .await
            .unwrap();
    }
    assert_eq!(answered_by(c, "two").await.unwrap(), "4");
    running.none_failed("reload to versions 3 and 4").await;
    assert_eq!(answered_by(c, "two/versions/3").await.unwrap(), "3");
    let e = answered_by(c, "two/versions/2").await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    let two: Vec<_> = index(c)
        .await
        .into_iter()
        .filter(|(name, _, _)| name == "two")
        .collect();
    assert_eq!(
        two,
        rows_of(&[("two", "3", "READY"), ("two", "4", "READY")])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unloading_one_version_fails_no_request_of_the_others() {
    let repo = TempRepository::new(&[(
        "echo",
        "worker = \"echo\"\nversion_policy = \"all\"\n",
        &[1, 2],
    )]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "echo"]);
    let c = &kiln.client;
    // Clients of version 1 by number, and of the unversioned name (version 2 until
    // it goes, then version 1), both answered before the unload.
    let mut one = Clients::start_from(c, "echo/versions/1", CLIENTS, &["1"]);
    let mut any = Clients::start_from(c, "echo", CLIENTS, &["1", "2"]);
    one.answered_past(0).await;
    any.answered_past(0).await;
    unload(&kiln, "echo", json!({"parameters": {"version": 2}})).await;
    assert_eq!(answered_by(c, "echo").await.unwrap(), "1");
    one.none_failed("version 2 unloaded: version 1").await;
    any.none_failed("version 2 unloaded: the unversioned name")
        .await;
    let e = answered_by(c, "echo/versions/2").await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    assert_eq!(index(c).await, rows_of(&[("echo", "1", "READY")]));
    // Its series went with it; version 1's stay.
    let text = c.metrics().await.unwrap();
    assert!(text.contains("version=\"1\""), "{text}");
    assert!(!text.contains("version=\"2\""), "{text}");
    // Unloading the model unloads every version.
    c.unload_model("echo").await.unwrap();
    assert_eq!(index(c).await, rows_of(&[("echo", "2", "UNAVAILABLE")]));
}
