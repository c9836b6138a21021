//! Runs on the shared ONNX Runtime pool take turns (`kiln_worker_onnx::turns`); a
//! session with a pool of its own does not. Needs `scripts/fetch-models`.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::{line, ocr_cls};
use kiln_worker_onnx::turns;

/// How long a step may take before the test fails (a bound on a hang, never on a pass).
const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn a_run_on_the_shared_pool_waits_for_its_turn() {
    let mut shared = ocr_cls(&[]);
    let mut own = ocr_cls(&[("intra_op_threads", "1")]);
    let turn = turns::SHARED.take();

    // A pool of its own: no turn to wait for.
    let (own_done, own_finished) = mpsc::channel();
    thread::spawn(move || {
        let _ = own_done.send(own.run(&[vec![line(0)]]).map(|a| a.len()));
    });
    let own_answers = own_finished
        .recv_timeout(LIMIT)
        .expect("a session with its own pool waited for the shared pool's turn");
    assert_eq!(own_answers.unwrap(), 1);

    // The shared pool: the run waits until the turn held here is given back.
    let (done, finished) = mpsc::channel();
    let runner = thread::spawn(move || {
        let answers = shared.run(&[vec![line(1)]]).map(|a| a.len());
        done.send(answers).unwrap();
    });
    if !turns::SHARED.until_waiting(1, LIMIT) {
        panic!(
            "the run never asked for a turn (it {})",
            match finished.try_recv() {
                Ok(_) => "ran while another run held the shared pool's turn",
                Err(_) => "did not finish either",
            }
        );
    }
    assert!(finished.try_recv().is_err());
    drop(turn);
    assert_eq!(finished.recv().unwrap().unwrap(), 1);
    runner.join().unwrap();
    assert_eq!(turns::SHARED.waiting(), 0);
}
