//! Triton's logging extension and `--log-format` with the real binary: the settings
//! are read and changed over REST (`/v2/logging`) and gRPC (`LogSettings`), the
//! switches and the format change what kiln writes while it runs, bad settings are
//! refused with 400 / INVALID_ARGUMENT and change nothing, and the log file stays
//! the operator's.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_server::grpc::proto;
use kiln_tests::Kiln;
use serde_json::{json, Value};

async fn get(kiln: &Kiln) -> Value {
    let response = reqwest::get(format!("{}/v2/logging", kiln.url))
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    response.json().await.unwrap()
}

async fn post(kiln: &Kiln, body: &str) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/v2/logging", kiln.url))
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Loads echo once more and unloads it: kiln logs `unloaded `echo-…`` at info.
async fn load_and_unload(kiln: &Kiln) -> String {
    let endpoint = kiln.client.load("echo", &json!({})).await.unwrap();
    kiln.client.unload(&endpoint).await.unwrap();
    endpoint
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_settings_change_what_kiln_writes() {
    let kiln = Kiln::start(&["--load", "echo", "--log-format", "json"]);
    let defaults = json!({
        "log_file": "", "log_info": true, "log_warnings": true, "log_errors": true,
        "log_verbose_level": 0, "log_format": "json"
    });
    assert_eq!(get(&kiln).await, defaults);
    // `--log-format json`: every line is one JSON object.
    let first = kiln.log_with("serving");
    for line in first.lines().filter(|l| !l.trim().is_empty()) {
        let record: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            record["level"].is_string() && record["payload"].is_string(),
            "{line}"
        );
    }

    // Verbose: a request answered with an error is logged with its id, as a
    // key-value of the JSON line.
    let (status, now) = post(&kiln, r#"{"log_verbose_level": 1}"#).await;
    assert_eq!(
        (status, &now["log_verbose_level"]),
        (200, &json!(1)),
        "{now}"
    );
    let bad = json!({"id": "bad-json", "inputs": [{"name": "NOPE", "shape": [1],
                     "datatype": "UINT32", "data": [1]}]});
    let response = reqwest::Client::new()
        .post(format!("{}/v2/models/echo/infer", kiln.url))
        .body(bad.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let log = kiln.log_with("bad-json");
    let line = log.lines().find(|l| l.contains("bad-json")).unwrap();
    let record: Value = serde_json::from_str(line).unwrap();
    assert_eq!(record["kv"]["request_id"], "bad-json", "{line}");
    assert_eq!(record["level"], "debug", "{line}");
    assert!(
        record["payload"]
            .as_str()
            .unwrap()
            .contains("unknown input `NOPE`"),
        "{line}"
    );
    let (status, _) = post(&kiln, r#"{"log_verbose_level": 0}"#).await;
    assert_eq!(status, 200);

    // Info off: an unload (info) is not written, a failed load (warning) is.
    let (status, now) = post(&kiln, r#"{"log_info": false}"#).await;
    assert_eq!(status, 200, "{now}");
    assert_eq!(now["log_info"], false);
    assert_eq!(now["log_warnings"], true);
    let quiet = load_and_unload(&kiln).await;
    assert!(kiln
        .client
        .load("no-such-worker", &json!({}))
        .await
        .is_err());
    let log = kiln.log_with("no-such-worker");
    assert!(log.contains("no-such-worker"), "{log}");
    assert!(!log.contains(&format!("unloaded `{quiet}`")), "{log}");

    // Info back on, in Triton's ISO8601 format.
    let (status, now) = post(&kiln, r#"{"log_info": true, "log_format": "ISO8601"}"#).await;
    assert_eq!(status, 200, "{now}");
    assert_eq!(now["log_format"], "ISO8601");
    let loud = load_and_unload(&kiln).await;
    let needle = format!("unloaded `{loud}`");
    let log = kiln.log_with(&needle);
    let line = log.lines().find(|l| l.contains(&needle)).unwrap();
    let iso = regex_lite_iso8601(line);
    assert!(iso, "not ISO8601 `YYYY-MM-DDTHH:MM:SSZ I …`: {line}");
}

/// `2026-11-25T06:18:35Z I …` (Triton's ISO8601 layout; the seconds may carry a
/// fraction).
fn regex_lite_iso8601(line: &str) -> bool {
    let Some((stamp, rest)) = line.split_once(' ') else {
        return false;
    };
    let Some((date, time)) = stamp.split_once('T') else {
        return false;
    };
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    let date: Vec<&str> = date.split('-').collect();
    let time = time.trim_end_matches('Z');
    let hms: Vec<&str> = time.split(':').collect();
    date.len() == 3
        && digits(date[0], 4)
        && digits(date[1], 2)
        && digits(date[2], 2)
        && stamp.ends_with('Z')
        && hms.len() == 3
        && digits(hms[0], 2)
        && digits(hms[1], 2)
        && rest.starts_with("I ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_and_change_nothing() {
    // A folder that goes away with the test.
    let dir = kiln_tests::fixtures::TempRepository::new(&[]);
    let file = dir.path().join("kiln.log");
    let file_arg = file.display().to_string();
    let kiln = Kiln::start(&["--load", "echo", "--log-file", &file_arg]);
    let before = get(&kiln).await;
    assert_eq!(before["log_file"], file_arg.as_str());
    for (body, says) in [
        (r#"{"log_file": "/tmp/elsewhere.log"}"#, "operator"),
        (r#"{"log_verbose_level": -1}"#, "unsigned"),
        (r#"{"log_verbose_level": 4294967296}"#, "unsigned"),
        (r#"{"log_info": "yes"}"#, "boolean"),
        (r#"{"log_format": "xml"}"#, "ISO8601"),
        // One bad setting refuses the others of the request too.
        (r#"{"log_verbose_level": 2, "log_warning": false}"#, "known"),
        (r#"[1, 2]"#, "object"),
        (r#"{"log_info": null}"#, "boolean"),
    ] {
        let (status, answer) = post(&kiln, body).await;
        assert_eq!(status, 400, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(says), "{body}: {error}");
    }
    assert_eq!(get(&kiln).await, before);
    // The file's own value is accepted (tritonclient sends every field back).
    let (status, answer) = post(&kiln, &json!({ "log_file": file_arg }).to_string()).await;
    assert_eq!(status, 200, "{answer}");
    // The file gets the info lines.
    load_and_unload(&kiln).await;
    let written = std::fs::read_to_string(&file).unwrap();
    assert!(written.contains("serving"), "{written}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_settings_over_grpc() {
    use proto::log_settings_request::setting_value::ParameterChoice as In;
    use proto::log_settings_response::setting_value::ParameterChoice as Out;
    let kiln = Kiln::start(&["--load", "echo"]);
    let mut client = kiln.grpc().await.raw();
    let setting = |choice: In| proto::log_settings_request::SettingValue {
        parameter_choice: Some(choice),
    };
    let read = client
        .log_settings(proto::LogSettingsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let value = |r: &proto::LogSettingsResponse, name: &str| {
        r.settings[name].parameter_choice.clone().unwrap()
    };
    assert_eq!(value(&read, "log_verbose_level"), Out::Uint32Param(0));
    assert_eq!(
        value(&read, "log_format"),
        Out::StringParam("default".into())
    );
    assert_eq!(read.settings.len(), 6);
    let changed = client
        .log_settings(proto::LogSettingsRequest {
            settings: [("log_verbose_level".to_owned(), setting(In::Uint32Param(2)))].into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(value(&changed, "log_verbose_level"), Out::Uint32Param(2));
    let refused = client
        .log_settings(proto::LogSettingsRequest {
            settings: [("log_info".to_owned(), setting(In::StringParam("no".into())))].into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("boolean"), "{refused:?}");
}

/// Finding 13 of issue #27: ids that clients send go into lines about failed
/// requests. A 16 MiB id costs the log one bounded line (it was 16 MiB a line), and
/// an id holding a newline cannot forge a line of its own, in every format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_strings_cannot_flood_or_forge_log_lines() {
    for format in ["default", "ISO8601", "json"] {
        let dir = kiln_tests::fixtures::TempRepository::new(&[]);
        let file = dir.path().join("kiln.log");
        let file_arg = file.display().to_string();
        let kiln = Kiln::start(&[
            "--load",
            "echo",
            "--log-file",
            &file_arg,
            "--log-format",
            format,
        ]);
        assert_eq!(post(&kiln, r#"{"log_verbose_level": 1}"#).await.0, 200);
        let before = std::fs::metadata(&file).unwrap().len();
        let forged = "x\n[2030-01-01 00:00:00.000] [critical] FORGED LINE admin logged in";
        let huge = "i".repeat(16 << 20);
        let http = reqwest::Client::new();
        for id in [huge.as_str(), forged, huge.as_str()] {
            // A wrong datatype: the request fails, and its id is logged.
            let body = json!({"id": id, "inputs": [{"name": "INPUT0", "shape": [1, 1],
                                                  "datatype": "FP32", "data": [1.0]}]});
            let status = http
                .post(format!("{}/v2/models/echo/infer", kiln.url))
                .body(body.to_string())
                .send()
                .await
                .unwrap()
                .status();
            assert_eq!(status.as_u16(), 400);
        }
        // Lines are written as they come; wait until the three failures are there.
        let mut log = String::new();
        for _ in 0..200 {
            log = std::fs::read_to_string(&file).unwrap();
            if log.matches("request failed").count() >= 3 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(
            log.matches("request failed").count() >= 3,
            "{format}: {log}"
        );
        let grown = std::fs::metadata(&file).unwrap().len() - before;
        assert!(
            grown < 64 << 10,
            "{format}: three failed requests grew the log by {grown} bytes"
        );
        for line in log.lines() {
            let shown: String = line.chars().take(300).collect();
            assert!(
                !line.contains("FORGED LINE") || line.contains("request failed"),
                "{format}: a forged line: {shown}"
            );
            let well_formed = match format {
                "json" => serde_json::from_str::<Value>(line).is_ok(),
                // `2026-11-25T06:18:35Z V …`
                "ISO8601" => {
                    line.get(10..11) == Some("T")
                        && line.get(19..20) == Some("Z")
                        && ["I ", "W ", "E ", "V "].contains(&line.get(21..23).unwrap_or(""))
                }
                _ => line.starts_with("[20"),
            };
            assert!(well_formed, "{format}: {shown}");
        }
    }
}
