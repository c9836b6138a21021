//! Issue 27, findings 8-11 (docs/security.md, "Jobs"): a submission bounded in
//! bytes and jobs and counted in the client-bytes budget; a store quota; a job
//! read reserved in the budget; ids that cannot be guessed and a listing that is
//! the operator's; an embedded store that recovers from a full disk by itself.
//! Real servers, real HTTP, the real echo worker, a real tmpfs.

use std::time::Duration;

use kiln_tests::jobs::{
    echo_job, get, jobs_arg, json_lines, list_all, store_dir, submit, submit_ok, wait_finished,
    ADMIN_ARG, ADMIN_HEADER,
};
use kiln_tests::Kiln;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

fn lines(n: u32) -> String {
    json_lines(&(0..n).map(echo_job).collect::<Vec<Value>>())
}

/// The attack of finding 8: with `--max-body-bytes` 64 KiB (an inference over it
/// is 413), a job submission over it was accepted whole. Measured: the status,
/// and the store (through the operator's listing) holding nothing of it.
#[tokio::test]
async fn a_submission_is_bounded_in_bytes_and_in_jobs() {
    let dir = store_dir("bound");
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        &jobs_arg(&dir),
        ADMIN_ARG,
        "--max-body-bytes",
        "65536",
        "--jobs-max-per-submission",
        "100",
        "--jobs-max-sys",
        "0",
    ]);
    let url = &kiln.url;
    let body = lines(1000); // ~110 KiB, 1000 jobs
    assert!(body.len() > 65536);
    let (status, answer) = submit(url, "echo", "", body).await;
    assert_eq!(status, 413, "{answer}");
    // Within the bytes, over the jobs: 413 naming the flag.
    let (status, answer) = submit(url, "echo", "", lines(101)).await;
    assert_eq!(status, 413, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|e| e.contains("--jobs-max-per-submission")),
        "{answer}"
    );
    assert!(list_all(url, "", 1000).await.is_empty(), "nothing stored");
    // Within both: accepted.
    assert_eq!(submit_ok(url, "echo", lines(100)).await.len(), 100);
}

/// Over `--jobs-max-stored` a submission gets 429 at once, and nothing of it is
/// stored.
#[tokio::test]
async fn a_full_store_refuses_submissions_at_once() {
    let dir = store_dir("quota");
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        &jobs_arg(&dir),
        ADMIN_ARG,
        "--jobs-max-stored",
        "10",
        "--jobs-max-sys",
        "0",
    ]);
    let url = &kiln.url;
    assert_eq!(submit_ok(url, "echo", lines(8)).await.len(), 8);
    let (status, answer) = submit(url, "echo", "", lines(3)).await;
    assert_eq!(status, 429, "{answer}");
    assert_eq!(submit_ok(url, "echo", lines(2)).await.len(), 2);
    let (status, answer) = submit(url, "echo", "", lines(1)).await;
    assert_eq!(status, 429, "{answer}");
    assert_eq!(list_all(url, "", 100).await.len(), 10);
}

/// A submission's bytes are reserved from `--max-client-bytes` as they arrive
/// (`job_submission`), and a job's result while it is sent (`job_result`): a
/// budget of 256 KiB takes a 150 KiB submission but refuses one of 300 KiB, and
/// refuses to send a result of ~150 KiB (its stored copy and the body: ~300 KiB).
#[tokio::test]
async fn submissions_and_results_reserve_client_bytes() {
    let dir = store_dir("budget");
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        &jobs_arg(&dir),
        "--max-client-bytes",
        "262144",
    ]);
    let url = &kiln.url;
    let wide = |n: usize| {
        json!({"inputs": [{"name": "INPUT0", "datatype": "UINT32", "shape": [1, n],
                           "data": vec![1_000_000u32; n]}]})
        .to_string()
    };
    let small = wide(18_000);
    assert!((140_000..200_000).contains(&small.len()), "{}", small.len());
    let (status, answer) = submit(url, "echo", "", wide(36_000)).await;
    assert_eq!(status, 429, "{answer}");
    let ids = submit_ok(url, "echo", small).await;
    // Wait for it through the job's state (a small read), then read it whole.
    let deadline = std::time::Instant::now() + WAIT;
    let status = loop {
        let response = reqwest::get(format!("{url}/v2/jobs/{}", ids[0]))
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        if status != 200 || text.contains("\"done\"") || text.contains("\"failed\"") {
            break (status, text);
        }
        assert!(std::time::Instant::now() < deadline, "not finished: {text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.0, 429, "{}", &status.1[..status.1.len().min(300)]);
}

/// Finding 11: ids carry 128 random bits; a job is read or cancelled only by
/// its whole id; listing is refused unless the operator opened `jobs-admin`,
/// and then only with its header.
#[tokio::test]
async fn ids_cannot_be_guessed_and_listing_is_the_operators() {
    let dir = store_dir("ids");
    let kiln = Kiln::start(&["--load", "echo", &jobs_arg(&dir), "--jobs-max-sys", "0"]);
    let url = &kiln.url;
    let ids = submit_ok(url, "echo", lines(2)).await;
    for id in &ids {
        let (seq, secret) = id.split_once('-').expect("SEQ-SECRET");
        assert!(seq.parse::<u64>().is_ok(), "{id}");
        assert_eq!(secret.len(), 32, "{id}");
        assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    }
    assert_ne!(
        ids[0].split_once('-').unwrap().1,
        ids[1].split_once('-').unwrap().1
    );
    let (seq, secret) = ids[0].split_once('-').unwrap();
    let wrong = format!("{seq}-{}", "0".repeat(secret.len()));
    let client = reqwest::Client::new();
    for guess in [seq.to_owned(), wrong, format!("{seq}-")] {
        let (status, _) = get(url, &guess).await;
        assert_eq!(status, 404, "GET {guess}");
        let cancel = client
            .delete(format!("{url}/v2/jobs/{guess}"))
            .send()
            .await
            .unwrap();
        assert_eq!(cancel.status().as_u16(), 404, "DELETE {guess}");
    }
    let (status, job) = get(url, &ids[0]).await;
    assert_eq!(
        (status, job["state"].as_str()),
        (200, Some("queued")),
        "{job}"
    );
    let cancel = client
        .delete(format!("{url}/v2/jobs/{}", ids[0]))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status().as_u16(), 200);
    // No jobs-admin: listing is closed to everyone.
    let listing = client.get(format!("{url}/v2/jobs")).send().await.unwrap();
    assert_eq!(listing.status().as_u16(), 403);
    drop(kiln);

    // jobs-admin opened: the header lists, its absence does not.
    let kiln = Kiln::start(&["--load", "echo", &jobs_arg(&dir), ADMIN_ARG]);
    let url = &kiln.url;
    let listing = client.get(format!("{url}/v2/jobs")).send().await.unwrap();
    assert_eq!(listing.status().as_u16(), 403);
    let listing = client
        .get(format!("{url}/v2/jobs"))
        .header(ADMIN_HEADER, "test")
        .send()
        .await
        .unwrap();
    assert_eq!(listing.status().as_u16(), 200);
    let listed: Value = listing.json().await.unwrap();
    let listed: Vec<&str> = listed["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|j| j["id"].as_str())
        .collect();
    assert_eq!(listed, ids.iter().map(String::as_str).collect::<Vec<_>>());
    let done = wait_finished(url, &ids[1], WAIT).await;
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["id"], ids[1].as_str());
}

/// Mounts a tmpfs of `size` at a fresh folder; `None` where this process may
/// not mount (not root): the test then says so and checks nothing.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(name: &str, size: &str) -> Option<Tmpfs> {
        let dir = std::env::temp_dir().join(format!("kiln-tmpfs-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Finding 9: one ENOSPC during a commit poisoned the embedded store until
/// restart (every call 503 "Previous I/O error occurred"). On a 4 MiB tmpfs,
/// filled by another file: submissions fail (503) while it is full; once the
/// file is removed the store works again by itself and holds every job it
/// accepted before.
#[tokio::test]
async fn the_embedded_store_recovers_from_a_full_disk() {
    let Some(disk) = Tmpfs::mount("enospc", "4m") else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (needs root)");
        return;
    };
    let store = disk.0.join("store");
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        &jobs_arg(&store),
        ADMIN_ARG,
        "--jobs-max-sys",
        "0",
    ]);
    let url = &kiln.url;
    let before = submit_ok(url, "echo", lines(10)).await;
    // Fill the disk.
    let filler = disk.0.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![7u8; 64 << 10];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    // Submissions of ~100 KiB until one fails on the full disk (redb may have
    // room left in its file for the first).
    let mut failed = None;
    for _ in 0..40 {
        let (status, answer) = submit(url, "echo", "", lines(900)).await;
        if status != 202 {
            failed = Some((status, answer));
            break;
        }
    }
    let (status, answer) = failed.expect("a submission failed on the full disk");
    assert_eq!(status, 503, "{answer}");
    std::fs::remove_file(&filler).unwrap();
    // The fault cleared: the store works again, without a restart.
    let after = submit_ok(url, "echo", lines(5)).await;
    assert_eq!(after.len(), 5);
    for id in before.iter().chain(&after) {
        let (status, job) = get(url, id).await;
        assert_eq!(status, 200, "{id}: {job}");
    }
    let listed = list_all(url, "", 1000).await;
    assert!(listed.len() >= 15, "{}", listed.len());
}
