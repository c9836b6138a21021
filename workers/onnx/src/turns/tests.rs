#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use super::Turns;

/// Waits until `n` callers wait for a turn (fails after 30 s, never timing a pass).
fn until_waiting(turns: &Turns, n: u64) {
    assert!(
        turns.until_waiting(n, Duration::from_secs(30)),
        "{n} callers never waited; {} do",
        turns.waiting()
    );
}

#[test]
fn turns_go_one_at_a_time_in_the_order_asked() {
    let turns = Arc::new(Turns::new());
    let order = Arc::new(Mutex::new(Vec::new()));
    let first = turns.take();
    assert_eq!(turns.waiting(), 0);
    let mut callers = Vec::new();
    for name in ["a", "b", "c"] {
        let waiting = turns.waiting();
        let (mine, order) = (turns.clone(), order.clone());
        callers.push(thread::spawn(move || {
            let _turn = mine.take();
            order.lock().unwrap().push(name);
        }));
        until_waiting(&turns, waiting + 1);
    }
    assert!(
        order.lock().unwrap().is_empty(),
        "a turn was taken while one was held"
    );
    drop(first);
    for caller in callers {
        caller.join().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["a", "b", "c"]);
    assert_eq!(turns.waiting(), 0);
    // Free again: a turn is taken at once.
    drop(turns.take());
}
