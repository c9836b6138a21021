//! The server-wide budget of bytes held by unfinished gRPC messages
//! ([`MessageBudget`]; the jobs' dispatch budget is `kiln_jobs::DispatchBudget`).
//!
//! A message that arrives in more than one DATA frame is gathered into a buffer
//! that grows with the bytes that arrive (never with the length the client
//! declares): `ModelInfer`'s by `routes::read_message`, every other call's by
//! [`super::gather::Gathered`]. What such buffers hold, summed over every stream of every
//! connection, may not exceed `--grpc-max-pending-bytes`: the stream whose bytes
//! would go beyond it is answered `RESOURCE_EXHAUSTED`, and its buffer freed. A
//! message that arrives in one frame (the usual small call) is not counted: it is
//! never unfinished, and costs nothing here.
//!
//! The same bytes are reserved from the server's one budget of bytes held for
//! clients (`--max-client-bytes`, [`kiln_core::memory::client_bytes`]), so unfinished
//! messages and every other surface share one bound; this flag stays a finer cap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kiln_core::memory::client_bytes::{ClientBytes, Reservation, Use};
use tonic::Status;

/// The bytes unfinished messages hold, and their limit.
#[derive(Debug)]
pub(crate) struct MessageBudget {
    held: AtomicUsize,
    max: usize,
    /// The server-wide budget (none in unit tests of this one alone).
    server: Option<Arc<ClientBytes>>,
}

/// What one unfinished message holds of the [`MessageBudget`]; given back on drop.
pub(crate) struct Charge {
    budget: Arc<MessageBudget>,
    amount: usize,
    /// Its bytes in the server-wide budget.
    reserved: Option<Reservation>,
}

impl MessageBudget {
    /// A budget of `max` bytes.
    #[cfg(test)]
    pub(crate) fn new(max: usize) -> Arc<MessageBudget> {
        Arc::new(MessageBudget {
            held: AtomicUsize::new(0),
            max,
            server: None,
        })
    }

    /// A budget of `max` bytes whose charges are also reserved from `server`.
    pub(crate) fn within(max: usize, server: Arc<ClientBytes>) -> Arc<MessageBudget> {
        Arc::new(MessageBudget {
            held: AtomicUsize::new(0),
            max,
            server: Some(server),
        })
    }

    /// An empty charge on this budget.
    pub(crate) fn charge(self: &Arc<Self>) -> Charge {
        Charge {
            budget: Arc::clone(self),
            amount: 0,
            reserved: self.server.as_ref().map(|s| s.empty(Use::GrpcMessage)),
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
        if let Some(reserved) = &mut self.reserved {
            reserved
                .grow_to(bytes)
                .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        }
        let before = self.budget.held.fetch_add(more, Ordering::Relaxed);
        if before.saturating_add(more) > self.budget.max {
            self.budget.held.fetch_sub(more, Ordering::Relaxed);
            if let Some(reserved) = &mut self.reserved {
                reserved.shrink_to(self.amount);
            }
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
            if let Some(reserved) = &mut self.reserved {
                reserved.shrink_to(bytes);
            }
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
        let budget = MessageBudget::new(100);
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

    #[test]
    fn charges_are_reserved_from_the_server_wide_budget() {
        let server = ClientBytes::new(100);
        let budget = MessageBudget::within(1000, Arc::clone(&server));
        let other = server.reserve(Use::DecodedImage, 40).unwrap();
        let mut a = budget.charge();
        a.grow_to(60).unwrap();
        assert_eq!(server.held(), 100);
        let refused = a.grow_to(61).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(
            refused.message().contains("--max-client-bytes"),
            "{refused:?}"
        );
        assert_eq!(budget.held(), 60, "refused: unchanged here too");
        drop(other);
        a.grow_to(90).unwrap();
        a.shrink_to(5);
        assert_eq!(server.held(), 5);
        drop(a);
        assert_eq!((server.held(), budget.held()), (0, 0));
    }
}
