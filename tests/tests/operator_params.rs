//! Parameters naming files, folders or libraries come only from the operator: a
//! client's load request that sets one is refused (400 / INVALID_ARGUMENT, naming
//! it) before the worker's `init`, so nothing is probed, parsed or `dlopen`ed.

// The helpers are test support: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_client::{ClientError, Param, ParamValue};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;
use serde_json::json;

/// A shared library whose constructor creates `marker` when it is loaded, built
/// with the system C compiler into `dir`.
fn evil_library(dir: &Path, marker: &Path) -> PathBuf {
    let source = dir.join("evil.c");
    std::fs::write(
        &source,
        format!(
            "#include <stdio.h>\n\
             __attribute__((constructor)) static void evil(void) {{\n\
                 FILE *f = fopen(\"{}\", \"w\");\n\
                 if (f) fclose(f);\n\
             }}\n",
            marker.display()
        ),
    )
    .unwrap();
    let library = dir.join("libevil.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("a C compiler (cc)");
    assert!(status.success(), "cc failed");
    library
}

/// A fresh temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!("kiln-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn assert_refused(err: &ClientError, parameter: &str) {
    assert_eq!(err.status(), Some(400), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("parameter `{parameter}`"))
            && text.contains("may only be set by the operator"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_load_cannot_name_files_or_libraries() {
    let dir = TempDir::new("evil-load");
    let marker = dir.0.join("constructor-ran");
    let library = evil_library(&dir.0, &marker);
    // A file the worker would find (the issue used /etc and `hostname`).
    std::fs::write(dir.0.join("hostname"), b"not a model").unwrap();
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    let lib = library.to_str().unwrap();
    let model_dir = dir.0.to_str().unwrap();
    // The reproduction: before the fix, ONNX Runtime's loader ran the
    // library's constructor inside kiln, then the load answered 400.
    let err = c
        .load(
            "onnx",
            &json!({"model_dir": model_dir, "model": "hostname", "runtime": lib}),
        )
        .await
        .unwrap_err();
    assert_refused(&err, "model_dir");
    for (body, parameter) in [
        (json!({"runtime": lib}), "runtime"),
        (json!({"Runtime": lib, "batch_size": 4}), "Runtime"),
        (json!({"model_dir": "/etc", "model": "passwd"}), "model_dir"),
        (json!({"model": "passwd"}), "model"),
    ] {
        let err = c.load("onnx", &body).await.unwrap_err();
        assert_refused(&err, parameter);
        assert!(!err.to_string().contains("Protobuf"), "{err}");
    }
    // `model_dir` is the repository's for every worker.
    let err = c
        .load("echo", &json!({"model_dir": "/etc"}))
        .await
        .unwrap_err();
    assert_refused(&err, "model_dir");
    assert!(
        !marker.exists(),
        "the library was loaded: its constructor ran"
    );
    // Refused loads leave the server as it was; ordinary parameters still load.
    assert!(c.is_ready().await.unwrap());
    assert_eq!(
        c.load("echo", &json!({"batch_size": 4})).await.unwrap(),
        "echo"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repository_load_overrides_cannot_name_files_or_libraries() {
    let dir = TempDir::new("evil-repo");
    let marker = dir.0.join("constructor-ran");
    let library = evil_library(&dir.0, &marker);
    let repo = TempRepository::new(&[
        ("net", "worker = \"onnx\"\n", &[1]),
        ("plain", "worker = \"echo\"\n", &[1]),
    ]);
    std::fs::write(repo.path().join("net/1/model.onnx"), b"not a model").unwrap();
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let lib = library.to_str().unwrap();

    // REST: `parameters` of POST /v2/repository/models/{m}/load.
    let c = &kiln.client;
    for (overrides, parameter) in [
        (json!({"runtime": lib}), "runtime"),
        (json!({"model": "../../../etc/passwd"}), "model"),
        (json!({"model_dir": "/etc"}), "model_dir"),
    ] {
        let err = c.load_model("net", &overrides).await.unwrap_err();
        assert_refused(&err, parameter);
    }
    let err = c
        .load_model("plain", &json!({"model_dir": "/etc"}))
        .await
        .unwrap_err();
    assert_refused(&err, "model_dir");

    // gRPC: RepositoryModelLoad's parameters.
    let g = kiln.grpc().await;
    for parameter in ["runtime", "model", "model_dir"] {
        let overrides = [Param {
            key: parameter.into(),
            value: ParamValue::Str(lib.into()),
        }];
        match g.load_model("net", &overrides).await.unwrap_err() {
            ClientError::Grpc { code, message } => {
                assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
                assert!(
                    message.contains(&format!("parameter `{parameter}`")),
                    "{message}"
                );
            }
            other => panic!("{other}"),
        }
    }
    assert!(
        !marker.exists(),
        "the library was loaded: its constructor ran"
    );
    // Overrides that name nothing are still the client's to set.
    c.load_model("plain", &json!({"batch_size": 2}))
        .await
        .unwrap();
    assert!(c.is_ready().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_names_them_on_the_command_line() {
    let model_dir = kiln_tests::model_repository().join("ocr-cls/1");
    let load = format!("onnx:model_dir={},model=model.onnx", model_dir.display());
    let kiln = Kiln::start(&["--load", &load, "--load", "echo:model_dir=/nonexistent"]);
    let c = &kiln.client;
    let meta = c.model_metadata("onnx").await.unwrap();
    assert_eq!(meta["inputs"].as_array().unwrap().len(), 1, "{meta}");
    assert!(c.model_metadata("echo").await.is_ok());
}
