//! Runs on the shared ONNX Runtime pool take turns (`kiln_worker_onnx::turns`); a
//! session with a pool of its own does not. Needs `scripts/fetch-models`.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::{line, ocr_cls};
use kiln_worker_onnx::turns;

#[test]
fn a_run_on_the_shared_pool_waits_for_its_turn() {
    let mut shared = ocr_cls(&[]);
    let mut own = ocr_cls(&[("intra_op_threads", "1")]);
    let turn = turns::SHARED.take();

    // A pool of its own: no turn to wait for.
    let own_run = thread::spawn(move || own.run(&[vec![line(0)]]).map(|a| a.len()));
    for _ in 0..3000 {
        if own_run.is_finished() {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    assert!(
        own_run.is_finished(),
        "a session with its own pool waited for the shared pool's turn"
    );
    assert_eq!(own_run.join().unwrap().unwrap(), 1);

    // The shared pool: the run waits until the turn held here is given back.
    let (done, finished) = mpsc::channel();
    let runner = thread::spawn(move || {
        let answers = shared.run(&[vec![line(1)]]).map(|a| a.len());
        done.send(answers).unwrap();
    });
    let mut polls = 0;
    while turns::SHARED.waiting() == 0 {
        if let Ok(answers) = finished.try_recv() {
            panic!("ran ({answers:?}) while another run held the shared pool's turn");
        }
        polls += 1;
        assert!(polls < 3000, "the run never asked for a turn");
        thread::sleep(Duration::from_millis(10));
    }
    assert!(finished.try_recv().is_err());
    drop(turn);
    assert_eq!(finished.recv().unwrap().unwrap(), 1);
    runner.join().unwrap();
    assert_eq!(turns::SHARED.waiting(), 0);
}
