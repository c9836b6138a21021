//! `preserve_ordering`: responses leave in the order their batches were formed, even
//! when a later batch finishes first on another instance.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::error::Result;
use crate::infer::InferResponse;

/// One batch's answers, ready to send.
pub type Answers = Vec<(
    oneshot::Sender<Result<InferResponse>>,
    Result<InferResponse>,
)>;

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

    fn answers(tag: &str) -> (Answers, oneshot::Receiver<Result<InferResponse>>) {
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
}
