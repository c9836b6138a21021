//! The onnx worker's one ONNX Runtime thread pool (#32): every model of the process
//! runs on the global pools created with the environment, so loading more models
//! adds no ONNX Runtime threads, and models loaded and idle cost no CPU (the pool
//! spins only while there is work, then parks). Counts, not timings: threads from
//! `/proc/PID/status`, CPU ticks from `/proc/PID/stat`.

// Test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kiln_client::InferRequest;
use kiln_tests::golden::golden;
use kiln_tests::{model_repository, thread_names, Kiln};
use serde_json::{json, Value};

const MODELS: [&str; 4] = ["ocr-det", "ocr-cls", "ocr-rec", "silero-vad"];

fn start() -> Kiln {
    let repo = model_repository();
    Kiln::start(&["--model-repository", repo.to_str().unwrap()])
}

/// Threads of the process that ONNX Runtime may have started: the global pools'
/// (`onnx-pool-<n>`) and those named `kiln-manager` — the Manager and every thread
/// started on it, which a session's own pool is (sessions are made while a model
/// loads, and their threads take the creator's name). Other threads come and go
/// with the load of the machine (actix's blocking pool), so the whole process's
/// count would be noise.
fn threads(pid: u32) -> usize {
    named(pid, |comm| {
        comm == "kiln-manager" || comm.starts_with("onnx-pool-")
    })
}

/// Threads of process `pid` whose name `keep` keeps.
fn named(pid: u32, keep: impl Fn(&str) -> bool) -> usize {
    thread_names(pid).iter().filter(|name| keep(name)).count()
}

/// CPU time the process has used, user + system, in clock ticks (fields 14 and 15
/// of `/proc/PID/stat`, counted after the `(comm)` field, which may hold spaces).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, after_comm) = stat.rsplit_once(')').unwrap();
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // After `)`: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// The thread count after loading each of [`MODELS`] in turn with `params`, read
/// once it holds still: a thread that ends with the load (a session's pool torn
/// down) may still be listed for a moment after the answer, which a loaded machine
/// stretches (CI saw two extra threads once: [5, 7, 9, 13] against [5, 7, 9, 11]).
async fn threads_per_load(params: &Value) -> Vec<usize> {
    let kiln = start();
    let mut counts = Vec::new();
    for model in MODELS {
        kiln.client.load_model(model, params).await.unwrap();
        counts.push(settled_threads(kiln.pid()).await);
    }
    counts
}

/// [`threads`] once three reads 100 ms apart agree (at most 5 s of reads).
async fn settled_threads(pid: u32) -> usize {
    settled(|| threads(pid)).await
}

/// `count()` once three reads 100 ms apart agree (at most 5 s of reads).
async fn settled(count: impl Fn() -> usize) -> usize {
    let mut last = count();
    let mut same = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = count();
        same = if now == last { same + 1 } else { 0 };
        last = now;
        if same == 2 {
            break;
        }
    }
    last
}

/// With the default (the shared pool), the second to fourth model add only the
/// server's own threads for a model — as many as sessions with no pool threads at
/// all (`intra_op_threads` 1: the calling thread only) — and the first adds at
/// most the pool (one thread per core). Per-session pools (before #32) added
/// `cores - 1` threads with every model: 3 more over the four loads on 2 cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loading_more_models_adds_no_onnx_runtime_threads() {
    let shared = threads_per_load(&json!({})).await;
    let none = threads_per_load(&json!({"intra_op_threads": 1})).await;
    let growth = |counts: &[usize]| counts[3] as i64 - counts[0] as i64;
    // ONNX Runtime may start one more thread of its shared pools lazily (seen once
    // at silero-vad's load: [3, 3, 3, 4] against [3, 3, 3, 3]); it is one for the
    // process, where per-session pools add threads with every model (below: 2 a
    // model with 3 intra-op threads).
    assert!(
        growth(&shared) <= growth(&none) + 1,
        "threads after each load: shared pool {shared:?}, no pool threads {none:?}"
    );
    let cores = std::thread::available_parallelism().unwrap().get();
    assert!(
        shared[0] <= none[0] + cores,
        "shared pool {shared:?}, no pool threads {none:?}"
    );
    // An operator's per-session pool is still one: 3 intra-op threads are the
    // caller and 2 of the session's own, for every model loaded: 3 * 2 more over
    // the last three loads, give or take the one lazy thread of the shared pools
    // above, which may start in either run (CI saw it land on one side).
    let own = threads_per_load(&json!({"intra_op_threads": 3})).await;
    let extra = growth(&own) - growth(&none);
    assert!(
        (3 * 2 - 1..=3 * 2 + 1).contains(&extra),
        "own pools {own:?}, no pool threads {none:?}"
    );
}

/// The global pools' threads carry a name of their own, so `top -H` and `perf` tell
/// the pool's work from the Manager's: one per core beyond the calling thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_pool_threads_are_named() {
    let kiln = start();
    kiln.client.load_model("ocr-cls", &json!({})).await.unwrap();
    let pool = settled(|| named(kiln.pid(), |comm| comm.starts_with("onnx-pool-"))).await;
    let cores = std::thread::available_parallelism().unwrap().get();
    assert!(
        (1..=cores).contains(&pool),
        "{pool} onnx-pool threads on {cores} cores"
    );
}

/// Four models loaded, three of them run (the pool's threads spin while there is
/// work), then nothing: over the idle second that follows the server uses at most
/// a few clock ticks of CPU. One thread spinning would use all 100 (at the usual
/// 100 ticks a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_loaded_and_idle_cost_no_cpu() {
    let golden = golden();
    let kiln = start();
    for model in MODELS {
        kiln.client.load_model(model, &json!({})).await.unwrap();
    }
    for model in ["ocr-det", "ocr-cls", "ocr-rec"] {
        for case in golden.cases_for(model) {
            let request = InferRequest {
                model: case.model.clone(),
                inputs: case.inputs.iter().map(|t| t.input()).collect(),
                ..Default::default()
            };
            kiln.client.infer(&request).await.unwrap();
        }
    }
    // Past ONNX Runtime's spin budget (microseconds to milliseconds) with margin;
    // what is measured is the CPU time after it, not a duration.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = cpu_ticks(kiln.pid());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cpu_ticks(kiln.pid()) - before;
    assert!(used <= 5, "{used} clock ticks of CPU in an idle second");
}
