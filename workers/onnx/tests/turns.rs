//! Runs on the shared ONNX Runtime pool take turns (`kiln_worker_onnx::turns`): a
//! run that meets another goes beside it on one core (its side session), one that
//! may not waits for the whole pool, and a session with a pool of its own takes no
//! turn. Needs `scripts/fetch-models`.
//!
//! The tests share the process's one set of turns, so they run one at a time.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{mpsc, Mutex};
use std::thread;
use std::time::Duration;

use common::{line, ocr_cls};
use kiln_worker_onnx::turns::{self, Runs};
use kiln_worker_sdk::testing::Harness;

/// How long a step may take before the test fails (a bound on a hang, never on a pass).
const LIMIT: Duration = Duration::from_secs(30);

/// One test at a time on the process's turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Starts `harness` running `line(seed)` on a thread; its answer (the class
/// scores) comes on the channel.
fn start_run(mut harness: Harness, seed: usize) -> mpsc::Receiver<Result<Vec<f32>, String>> {
    let (done, finished) = mpsc::channel();
    thread::spawn(move || {
        let answer = harness
            .run(&[vec![line(seed)]])
            .map(|a| a[0][0].values::<f32>())
            .map_err(|e| e.to_string());
        let _ = done.send(answer);
    });
    finished
}

/// Waits until `n` callers wait for a turn of the shared pool.
fn until_waiting(n: u64, what: &str) {
    assert!(turns::SHARED.until_waiting(n, LIMIT), "{what}");
}

#[test]
fn a_run_that_meets_another_goes_beside_it_on_one_core() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if !turns::SHARED.take(Runs::PoolOrCore).on_pool() {
        eprintln!("skipped: a pool of one core has no room beside a run");
        return;
    }
    let expected = ocr_cls(&[]).run(&[vec![line(1)]]).unwrap()[0][0].values::<f32>();

    // The test's run holds the whole pool; the worker's run meets it and waits.
    let pool = turns::SHARED.take(Runs::PoolOrCore);
    let finished = start_run(ocr_cls(&[]), 1);
    until_waiting(1, "the run did not wait for the pool held here");
    // A second caller queues behind it; when the pool is given back, the worker's
    // run gets one core and the second caller the other, held while the run runs.
    let (held, holding) = mpsc::channel();
    let (give_back, given_back) = mpsc::channel::<()>();
    let beside = thread::spawn(move || {
        let turn = turns::SHARED.take(Runs::PoolOrCore);
        held.send(turn.on_pool()).unwrap();
        let _ = given_back.recv();
    });
    until_waiting(2, "the second caller did not wait");
    drop(pool);
    let answer = finished
        .recv_timeout(LIMIT)
        .expect("the run did not go beside the turn held on the other core")
        .unwrap();
    assert!(
        !holding.recv().unwrap(),
        "the caller beside the run held the whole pool"
    );
    give_back.send(()).unwrap();
    beside.join().unwrap();
    // The side session (one thread) answers as the pool's session does.
    assert_eq!(answer.len(), expected.len());
    for (a, e) in answer.iter().zip(&expected) {
        assert!(
            (a - e).abs() < 1e-5,
            "side session {answer:?}, pool {expected:?}"
        );
    }
}

#[test]
fn a_run_waits_for_the_whole_pool_unless_its_pool_is_its_own() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let shared = ocr_cls(&[("side_by_side", "false")]);
    let own = ocr_cls(&[("intra_op_threads", "1")]);
    let pool = turns::SHARED.take(Runs::PoolOrCore);

    // A pool of its own: no turn to wait for.
    let own_answer = start_run(own, 0)
        .recv_timeout(LIMIT)
        .expect("a session with its own pool waited for the shared pool's turn");
    assert_eq!(own_answer.unwrap().len(), 2);

    // The shared pool, without a side session: the run waits until every core is free.
    let finished = start_run(shared, 1);
    if !turns::SHARED.until_waiting(1, LIMIT) {
        panic!(
            "the run never asked for a turn (it {})",
            match finished.try_recv() {
                Ok(_) => "ran while the shared pool was held",
                Err(_) => "did not finish either",
            }
        );
    }
    assert!(finished.try_recv().is_err());
    drop(pool);
    assert_eq!(finished.recv_timeout(LIMIT).unwrap().unwrap().len(), 2);
    assert_eq!(turns::SHARED.waiting(), 0);
}
