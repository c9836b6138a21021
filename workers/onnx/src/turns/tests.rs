#![allow(clippy::unwrap_used)]

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use super::{Runs, Turns};

/// How long a step may take before the test fails (a bound on a hang, never on a pass).
const LIMIT: Duration = Duration::from_secs(30);

/// Waits until `n` callers wait for a turn.
fn until_waiting(turns: &Turns, n: u64) {
    assert!(
        turns.until_waiting(n, LIMIT),
        "{n} callers never waited; {} do",
        turns.waiting()
    );
}

/// A caller's thread: what it says (whether it holds the pool), the sender that
/// tells it to give its turn back, and its handle.
type Caller = (
    mpsc::Receiver<bool>,
    mpsc::Sender<()>,
    thread::JoinHandle<()>,
);

/// Starts a caller that takes a turn, says whether it holds the pool, and holds the
/// turn until told to give it back.
fn caller(turns: &Arc<Turns>, runs: Runs) -> Caller {
    let (said, heard) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let turns = turns.clone();
    let handle = thread::spawn(move || {
        let turn = turns.take(runs);
        said.send(turn.on_pool()).unwrap();
        let _ = released.recv();
    });
    (heard, release, handle)
}

/// Holds the whole pool until a caller (`runs`) waits behind it, then gives it
/// back: a caller that had to wait.
fn caller_that_waited(turns: &Arc<Turns>, runs: Runs) -> Caller {
    let pool = turns.take(Runs::PoolOrCore);
    assert!(pool.on_pool());
    let waiter = caller(turns, runs);
    until_waiting(turns, 1);
    drop(pool);
    waiter
}

#[test]
fn a_run_alone_takes_the_whole_pool() {
    let turns = Turns::new(2);
    assert!(turns.take(Runs::PoolOrCore).on_pool());
    assert!(turns.take(Runs::PoolOrCore).on_pool());
    assert!(turns.take(Runs::PoolOnly).on_pool());
    assert_eq!(turns.waiting(), 0);
}

#[test]
fn runs_that_meet_go_side_by_side_on_one_core_each() {
    let turns = Arc::new(Turns::new(2));
    let pool = turns.take(Runs::PoolOrCore);
    assert!(pool.on_pool());
    // Two callers meet the run on the pool: they wait, then get a core each.
    let (a_said, a_release, a) = caller(&turns, Runs::PoolOrCore);
    until_waiting(&turns, 1);
    let (b_said, b_release, b) = caller(&turns, Runs::PoolOrCore);
    until_waiting(&turns, 2);
    assert!(a_said.try_recv().is_err() && b_said.try_recv().is_err());
    drop(pool);
    assert!(
        !a_said.recv_timeout(LIMIT).unwrap(),
        "a waiter took the whole pool"
    );
    assert!(
        !b_said.recv_timeout(LIMIT).unwrap(),
        "a waiter took the whole pool"
    );
    // Both cores held: the next waits, and gets the core given back first.
    let (c_said, c_release, c) = caller(&turns, Runs::PoolOrCore);
    until_waiting(&turns, 1);
    a_release.send(()).unwrap();
    assert!(!c_said.recv_timeout(LIMIT).unwrap());
    // A run that finds a core busy takes the free one without waiting.
    b_release.send(()).unwrap();
    b.join().unwrap();
    let d = turns.take(Runs::PoolOrCore);
    assert!(!d.on_pool(), "took the whole pool while a run held a core");
    c_release.send(()).unwrap();
    for t in [a, c] {
        t.join().unwrap();
    }
    drop(d);
    assert!(turns.take(Runs::PoolOrCore).on_pool());
}

#[test]
fn a_run_without_a_side_session_waits_for_every_core() {
    let turns = Arc::new(Turns::new(2));
    let (core_said, core_release, core) = caller_that_waited(&turns, Runs::PoolOrCore);
    assert!(!core_said.recv_timeout(LIMIT).unwrap());
    // One core is free, but this caller runs only on the whole pool.
    let (pool_said, pool_release, whole) = caller(&turns, Runs::PoolOnly);
    until_waiting(&turns, 1);
    assert!(pool_said.try_recv().is_err());
    core_release.send(()).unwrap();
    assert!(pool_said.recv_timeout(LIMIT).unwrap());
    pool_release.send(()).unwrap();
    for t in [core, whole] {
        t.join().unwrap();
    }
}

#[test]
fn turns_are_given_in_the_order_asked() {
    let turns = Arc::new(Turns::new(2));
    let order = Arc::new(Mutex::new(Vec::new()));
    let first = turns.take(Runs::PoolOnly);
    let mut callers = Vec::new();
    for name in ["a", "b", "c"] {
        let waiting = turns.waiting();
        let (mine, order) = (turns.clone(), order.clone());
        callers.push(thread::spawn(move || {
            let _turn = mine.take(Runs::PoolOnly);
            order.lock().unwrap().push(name);
        }));
        until_waiting(&turns, waiting + 1);
    }
    assert!(
        order.lock().unwrap().is_empty(),
        "a turn was taken while the pool was held"
    );
    drop(first);
    for caller in callers {
        caller.join().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["a", "b", "c"]);
    assert_eq!(turns.waiting(), 0);
}

#[test]
fn a_pool_of_one_core_is_always_the_whole_pool() {
    let turns = Arc::new(Turns::new(1));
    let (said, release, t) = caller_that_waited(&turns, Runs::PoolOrCore);
    assert!(said.recv_timeout(LIMIT).unwrap());
    release.send(()).unwrap();
    t.join().unwrap();
}
