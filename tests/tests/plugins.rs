//! Plugin loading refuses what is not a kiln plugin, with an error and no crash.

use std::path::Path;

use kiln_tests::{build_dir, Kiln};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_mismatched_and_escaping_libraries_are_refused() {
    let dir = std::env::temp_dir().join(format!("kiln-plugins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Not a library at all.
    std::fs::write(dir.join("libkiln_worker_garbage.so"), b"\x7fELF not really").unwrap();
    // A real shared library that is not a kiln plugin (zlib: dpkg depends on it).
    let zlib = [
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
        "/lib/x86_64-linux-gnu/libz.so.1",
        "/usr/lib/libz.so.1",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("zlib is present on Debian");
    std::fs::copy(zlib, dir.join("libkiln_worker_foreign.so")).unwrap();
    // A link that leads out of the plugin directory.
    let _ = std::fs::remove_file(dir.join("libkiln_worker_escape.so"));
    std::os::unix::fs::symlink(
        build_dir().join("libkiln_worker_echo.so"),
        dir.join("libkiln_worker_escape.so"),
    )
    .unwrap();

    let dir_arg = dir.to_str().unwrap().to_owned();
    let kiln = Kiln::start(&["--plugin-dir", &dir_arg]);
    let c = &kiln.client;
    for (worker, status, want) in [
        ("garbage", 400, "is not a kiln plugin"),
        ("foreign", 400, "is not a kiln plugin"),
        ("mismatched", 400, "does not match this server's plugin ABI"),
        ("escape", 404, "no plugin for worker `escape`"),
    ] {
        let err = c.load(worker, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(status), "{worker}: {err}");
        assert!(err.to_string().contains(want), "{worker}: {err}");
    }
    // The server is unharmed and real plugins still load.
    assert!(c.is_ready().await.unwrap());
    assert_eq!(c.load("echo", &json!({})).await.unwrap(), "echo");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The lines of the `faulty` worker's lifecycle log, in order.
fn lifecycle(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| {
            l.split_once("faulty: ")
                .map(|(_, step)| step.trim().to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_loads_are_rolled_back_through_the_lifecycle() {
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    // A batch size the worker refuses: caught after init, before allocate.
    let err = c
        .load("faulty", &json!({"batch_size": 100}))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("exceeds the worker's max_batch_size 64"),
        "{err}"
    );
    // acquire fails on the second of two instances: both are taken back down.
    let err = c
        .load(
            "faulty",
            &json!({"fail_acquire": true, "instances": 2, "batch_size": 8}),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("acquire failed as asked"), "{err}");
    assert_eq!(
        c.models().await.unwrap(),
        Vec::<String>::new(),
        "nothing of a failed load remains"
    );
    // A good load gets the resolved batch size (the worker's max, capped at 64).
    assert_eq!(c.load("faulty", &json!({})).await.unwrap(), "faulty");
    c.unload("faulty").await.unwrap();
    let steps = lifecycle(&kiln.log());
    let want: Vec<&str> = vec![
        "init",
        "destroy", // batch_size 100 refused
        "init",
        "init",
        "allocate 8",
        "deallocate",
        "destroy",
        "destroy", // acquire failed on the first
        "init",
        "allocate 64",
        "acquire",
        "release",
        "deallocate",
        "destroy", // loaded, then unloaded
    ];
    assert_eq!(steps, want, "log:\n{}", kiln.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_model_config_is_reported_with_its_file_and_field() {
    let root = std::env::temp_dir().join(format!("kiln-bad-repo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (path, text) in [
        ("typo/config.toml", "worker = \"echo\"\nbatchsize = 4\n"),
        (
            "wrongtype/config.toml",
            "worker = \"echo\"\n[parameters]\nbatch_size = [4]\n",
        ),
        (
            "good/config.toml",
            "worker = \"echo\"\n[parameters]\nbatch_size = 4\n",
        ),
    ] {
        let file = root.join(path);
        std::fs::create_dir_all(file.parent().unwrap().join("1")).unwrap();
        std::fs::write(file, text).unwrap();
    }
    let root_arg = root.to_str().unwrap().to_owned();
    let kiln = Kiln::start(&["--model-repository", &root_arg, "--load-model", "good"]);
    let c = &kiln.client;
    assert_eq!(c.models().await.unwrap(), vec!["good"]);
    for (model, field) in [
        ("typo", "batchsize"),
        ("wrongtype", "parameters.batch_size"),
    ] {
        let err = c.load_model(model, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        let message = err.to_string();
        assert!(
            message.contains(&format!("{model}/config.toml")) && message.contains(field),
            "{message}"
        );
    }
    drop(kiln);
    // At start-up, a bad model stops the server with the same message.
    let (code, stderr) =
        kiln_tests::serve_until_exit(&["--model-repository", &root_arg, "--load-model", "typo"]);
    assert!(code != Some(0), "exit {code:?}");
    assert!(
        stderr.contains("typo/config.toml") && stderr.contains("batchsize"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Puts `from` at `to` the way an operator installs a new build: a new file renamed
/// over the old one (writing into a mapped library in place would change the code
/// the running server executes).
fn install(from: &Path, to: &Path) -> std::io::Result<()> {
    let staged = to.with_extension("so.new");
    std::fs::copy(from, &staged)?;
    std::fs::rename(&staged, to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_plugin_file_loads_its_new_code_and_an_unchanged_one_is_reused() {
    let dir = std::env::temp_dir().join(format!("kiln-plugin-swap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Worker `swap` (a name the build directory, also a plugin directory, lacks) is
    // first a copy of echo.
    let swap = dir.join("libkiln_worker_swap.so");
    install(&build_dir().join("libkiln_worker_echo.so"), &swap).unwrap();
    let kiln = Kiln::start(&["--plugin-dir", dir.to_str().unwrap()]);
    let c = &kiln.client;
    let inputs = |metadata: serde_json::Value| metadata["inputs"].as_array().unwrap().len();
    assert_eq!(c.load("swap", &json!({})).await.unwrap(), "swap");
    assert_eq!(inputs(c.model_metadata("swap").await.unwrap()), 1);
    // Unloaded and loaded again from the same file: the library already loaded.
    c.unload("swap").await.unwrap();
    assert_eq!(c.load("swap", &json!({})).await.unwrap(), "swap");
    assert_eq!(kiln.log().matches("loaded plugin `swap`").count(), 1);
    // A new build under the same name (here echo-multi's code, three inputs): a new
    // load runs the new code, from a fresh copy, while the group loaded before keeps
    // the old library and still answers.
    install(&build_dir().join("libkiln_worker_echo_multi.so"), &swap).unwrap();
    let endpoint = c.load("swap", &json!({"batch_size": 4})).await.unwrap();
    assert_eq!(endpoint, "swap-0");
    assert_eq!(
        inputs(c.model_metadata(&endpoint).await.unwrap()),
        3,
        "{}",
        kiln.log()
    );
    let mut request = kiln_tests::fixtures::echo_multi_request("swap");
    request.model = endpoint.clone();
    kiln_tests::fixtures::check_echo_multi(&c.infer(&request).await.unwrap());
    assert_eq!(inputs(c.model_metadata("swap").await.unwrap()), 1);
    let old = kiln_client::InferRequest {
        model: "swap".into(),
        inputs: vec![kiln_client::InputTensor::from_slice(
            "INPUT0",
            kiln_client::DataType::Uint32,
            &[1, 2],
            &[7u32, 8],
        )],
        ..Default::default()
    };
    assert_eq!(
        c.infer(&old).await.unwrap().outputs[0].values::<u32>(),
        vec![8, 9]
    );
    let log = kiln.log();
    assert!(
        log.contains("changed since it was loaded: a fresh copy"),
        "{log}"
    );
    // The unchanged new file is not copied again.
    c.unload(&endpoint).await.unwrap();
    assert_eq!(
        c.load("swap", &json!({"batch_size": 4})).await.unwrap(),
        endpoint
    );
    assert_eq!(kiln.log().matches("a fresh copy").count(), 1);
    // A library refused stays mapped too: once its file is fixed, the fixed code
    // loads (from a copy), not the refused mapping again.
    let fixed = dir.join("libkiln_worker_fixed.so");
    install(&build_dir().join("libkiln_worker_mismatched.so"), &fixed).unwrap();
    let err = c.load("fixed", &json!({})).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("does not match this server's plugin ABI"),
        "{err}"
    );
    install(&build_dir().join("libkiln_worker_echo.so"), &fixed).unwrap();
    assert_eq!(c.load("fixed", &json!({})).await.unwrap(), "fixed");
    assert_eq!(inputs(c.model_metadata("fixed").await.unwrap()), 1);
    drop(kiln);
    let _ = std::fs::remove_dir_all(&dir);
}
