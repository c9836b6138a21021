//! The server-wide budget of bytes held by unfinished gRPC messages.
//!
//! A message that arrives in more than one DATA frame is gathered into a buffer
//! that grows with the bytes that arrive (never with the length the client
//! declares): `ModelInfer`'s by `routes::read_message`, every other call's by
//! [`super::gather::Gathered`]. What such buffers hold, summed over every stream of every
//! connection, may not exceed `--grpc-max-pending-bytes`: the stream whose bytes
//! would go beyond it is answered `RESOURCE_EXHAUSTED`, and its buffer freed. A
//! message that arrives in one frame (the usual small call) is not counted: it is
//! never unfinished, and costs nothing here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tonic::Status;

/// The bytes unfinished messages hold, and their limit.
#[derive(Debug)]
pub(crate) struct Budget {
    held: AtomicUsize,
    max: usize,
}

/// What one unfinished message holds of the [`Budget`]; given back on drop.
pub(crate) struct Charge {
    budget: Arc<Budget>,
    amount: usize,
}

impl Budget {
    /// A budget of `max` bytes.
    pub(crate) fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            held: AtomicUsize::new(0),
            max,
        })
    }

    /// An empty charge on this budget.
    pub(crate) fn charge(self: &Arc<Self>) -> Charge {
        Charge {
            budget: Arc::clone(self),
            amount: 0,
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

impl Charge {
    /// Grows the charge to `bytes`; `RESOURCE_EXHAUSTED` when the budget has no
    /// room (the charge is then unchanged).
    pub(crate) fn grow_to(&mut self, bytes: usize) -> Result<(), Status> {
        let Some(more) = bytes.checked_sub(self.amount).filter(|&m| m > 0) else {
            return Ok(());
        };
        let before = self.budget.held.fetch_add(more, Ordering::Relaxed);
        if before.saturating_add(more) > self.budget.max {
            self.budget.held.fetch_sub(more, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "the server holds too many bytes of unfinished messages \
                 (--grpc-max-pending-bytes {}): try again later",
                self.budget.max
            )));
        }
        self.amount = bytes;
        Ok(())
    }

    /// Shrinks the charge to `bytes` (nothing when it holds less).
    pub(crate) fn shrink_to(&mut self, bytes: usize) {
        if let Some(less) = self.amount.checked_sub(bytes).filter(|&l| l > 0) {
            self.budget.held.fetch_sub(less, Ordering::Relaxed);
            self.amount = bytes;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.amount, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_bounded_and_given_back() {
        let budget = Budget::new(100);
        let mut a = budget.charge();
        a.grow_to(60).unwrap();
        let mut b = budget.charge();
        let refused = b.grow_to(50).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        b.grow_to(40).unwrap();
        assert_eq!(budget.held(), 100);
        drop(a);
        assert_eq!(budget.held(), 40);
        b.grow_to(90).unwrap();
        b.shrink_to(10);
        assert_eq!(budget.held(), 10);
        drop(b);
        assert_eq!(budget.held(), 0);
    }
}
