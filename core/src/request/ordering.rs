//! `preserve_ordering`: responses leave in the order their batches were formed, even
//! when a later batch finishes first on another instance.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::request::answer::Answer;

/// One batch's answers, ready to send.
pub type Answers = Vec<(oneshot::Sender<Answer>, Answer)>;

/// Holds a batch's answers until every batch formed before it has been answered.
/// Taken once per batch (not per request), and only by groups that ask for it.
#[derive(Default)]
pub struct OrderGate {
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    /// The number of the next batch whose answers may leave.
    next: u64,
    held: BTreeMap<u64, Answers>,
}

impl OrderGate {
    /// Sends batch `order`'s answers now if every earlier batch's have left, then
    /// any later ones that were waiting for it; otherwise keeps them.
    pub fn release(&self, order: u64, answers: Answers) {
        let mut ready = Vec::new();
        {
            let mut state = self.state.lock();
            if order < state.next {
                // Released already (by its guard, as its thread unwound): nothing
                // waits for it.
                drop(state);
                send(answers);
                return;
            }
            if order != state.next {
                state.held.insert(order, answers);
                return;
            }
            ready.push(answers);
            state.next += 1;
            loop {
                let next = state.next;
                match state.held.remove(&next) {
                    Some(later) => {
                        ready.push(later);
                        state.next += 1;
                    }
                    None => break,
                }
            }
        }
        // Sent outside the lock.
        for answers in ready {
            send(answers);
        }
    }
}

/// Keeps batch `order`'s place in the gate while its instance thread works on it:
/// if the thread unwinds (a panic in server code) before the batch's answers were
/// released, the batch is released with no answers (its clients see their replies
/// dropped, an internal error) and the batches formed after it are not held forever.
pub struct OrderGuard<'a> {
    gate: &'a OrderGate,
    order: u64,
}

impl OrderGate {
    /// A guard for batch `order` (see [`OrderGuard`]).
    pub fn guard(&self, order: u64) -> OrderGuard<'_> {
        OrderGuard { gate: self, order }
    }
}

impl Drop for OrderGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.gate.release(self.order, Vec::new());
        }
    }
}

/// Sends each answer to its client (a client that left is skipped).
pub fn send(answers: Answers) {
    for (tx, answer) in answers {
        let _ = tx.send(answer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ServerError;

    fn answers(tag: &str) -> (Answers, oneshot::Receiver<Answer>) {
        let (tx, rx) = oneshot::channel();
        (vec![(tx, Err(ServerError::invalid(tag)))], rx)
    }

    #[test]
    fn later_batches_wait_for_earlier_ones() {
        let gate = OrderGate::default();
        let (b2, mut r2) = answers("2");
        let (b1, mut r1) = answers("1");
        let (b0, mut r0) = answers("0");
        gate.release(2, b2);
        gate.release(1, b1);
        assert!(r1.try_recv().is_err() && r2.try_recv().is_err());
        gate.release(0, b0);
        for (rx, tag) in [(&mut r0, "0"), (&mut r1, "1"), (&mut r2, "2")] {
            assert_eq!(rx.try_recv().unwrap().unwrap_err().to_string(), tag);
        }
    }

    #[test]
    fn a_thread_that_panics_on_a_batch_does_not_hold_the_later_ones() {
        let gate = OrderGate::default();
        let (b1, mut r1) = answers("1");
        gate.release(1, b1);
        assert!(r1.try_recv().is_err(), "held behind batch 0");
        // Batch 0's thread panics while working on it: its guard releases it.
        std::thread::scope(|s| {
            let panicked = s
                .spawn(|| {
                    let _guard = gate.guard(0);
                    panic!("a bug in server code");
                })
                .join();
            assert!(panicked.is_err());
        });
        assert_eq!(r1.try_recv().unwrap().unwrap_err().to_string(), "1");
        // A guard dropped normally releases nothing; later batches go in order.
        drop(gate.guard(2));
        let (b2, mut r2) = answers("2");
        gate.release(2, b2);
        assert_eq!(r2.try_recv().unwrap().unwrap_err().to_string(), "2");
        // Answers of a batch released already are sent, not held.
        let (late, mut r_late) = answers("late");
        gate.release(0, late);
        assert!(r_late.try_recv().is_ok());
    }
}
