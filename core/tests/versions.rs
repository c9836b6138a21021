//! Versions served side by side ([`kiln_core::models`]): a request that found a
//! version in the snapshot just before it was unloaded or dropped by a reload is
//! answered by the model's new highest version when it came by the unversioned
//! name, and refused when it named a version that is gone. Deterministic: the test
//! holds the group as an ingress does between its lookup and its submit.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kiln_core::models::Served;
use kiln_core::observe::trace::Trace;
use kiln_core::ServerError;
use support::{request, Repository};

/// Submits to `group` (held since an earlier lookup) and awaits the answer.
async fn submit(group: &Served, value: u32) -> Result<(String, Vec<u32>), ServerError> {
    let (pending, ()) = kiln_core::request::serve::submit(
        group,
        Ok((request("fake", &[value]), ())),
        &mut Trace::default(),
    )?;
    let response = pending.await?;
    Ok((response.model_version, response.outputs[0].values::<u32>()))
}

fn policy(repo: &Repository, policy: &str) {
    let config = format!("worker = \"fake\"\nversion_policy = {policy}\n");
    std::fs::write(repo.0.join("fake/config.toml"), config).unwrap();
}

#[tokio::test]
async fn the_unversioned_names_late_request_goes_to_the_version_left() {
    let repo = Repository::new("versions-unload");
    policy(&repo, "\"all\"");
    let server = repo.server();
    server.load_model("fake", None, Vec::new()).await.unwrap();
    assert_eq!(server.versions("fake"), ["1", "2"]);
    // What ingresses hold between their lookup and their submit: the unversioned
    // name's group (version 2), and version 1 asked for by number.
    let latest = server.lookup("fake", None).unwrap();
    let one = server.lookup("fake", Some("1")).unwrap();
    assert_eq!((latest.version(), one.version()), ("2", "1"));

    server.unload_version("fake", 2).await.unwrap();
    assert_eq!(server.versions("fake"), ["1"]);
    assert_eq!(submit(&latest, 4).await.unwrap(), ("1".into(), vec![5]));
    let gone = server.lookup("fake", Some("2")).err().unwrap().to_string();
    assert!(
        gone.contains("Request for unknown model: 'fake' version 2 is not found"),
        "{gone}"
    );

    // Version 1 by number, once unloaded with nothing left: refused.
    server.unload_version("fake", 1).await.unwrap();
    assert!(server.versions("fake").is_empty());
    assert!(submit(&one, 4).await.is_err());
}

#[tokio::test]
async fn a_version_asked_for_by_number_is_not_answered_by_another() {
    let repo = Repository::new("versions-by-number");
    policy(&repo, "\"all\"");
    let server = repo.server();
    server.load_model("fake", None, Vec::new()).await.unwrap();
    let one = server.lookup("fake", Some("1")).unwrap();
    // Version 1 is not the unversioned name's: its late requests are refused.
    server.unload_version("fake", 1).await.unwrap();
    assert!(submit(&one, 4).await.is_err());
    assert_eq!(server.versions("fake"), ["2"]);
    assert_eq!(
        submit(&server.lookup("fake", None).unwrap(), 4)
            .await
            .unwrap(),
        ("2".into(), vec![5])
    );
}

#[tokio::test]
async fn a_reload_that_moves_the_window_hands_late_requests_to_the_new_highest() {
    let repo = Repository::new("versions-window");
    let server = repo.server();
    // Triton's default policy: the latest version only.
    server.load_model("fake", None, Vec::new()).await.unwrap();
    assert_eq!(server.versions("fake"), ["2"]);
    let held = server.lookup("fake", None).unwrap();
    std::fs::create_dir_all(repo.0.join("fake/3")).unwrap();
    server.load_model("fake", None, Vec::new()).await.unwrap();
    assert_eq!(server.versions("fake"), ["3"]);
    assert_eq!(submit(&held, 9).await.unwrap(), ("3".into(), vec![10]));

    // `latest = 2`: versions 2 and 3 come in (3 kept as it was loaded).
    let three = server.lookup("fake", None).unwrap();
    policy(&repo, "{ latest = 2 }");
    server.load_model("fake", None, Vec::new()).await.unwrap();
    assert_eq!(server.versions("fake"), ["2", "3"]);
    assert!(three.is(&server.lookup("fake", Some("3")).unwrap()));
    // A version without a folder, or a policy that allows none, is refused and
    // leaves what is served as it was.
    policy(&repo, "{ specific = [7] }");
    let e = server
        .load_model("fake", None, Vec::new())
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains(
            "at least one version must be available under the version policy of model 'fake'"
        ),
        "{e}"
    );
    assert_eq!(server.versions("fake"), ["2", "3"]);
}
