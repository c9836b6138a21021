//! The one server-wide budget of bytes that clients make kiln hold.
//!
//! Every surface that turns client input into memory the server keeps — decoded
//! images and frames, shared-memory copies, unfinished gRPC messages, WebSocket
//! results waiting for a slow reader, job submissions being stored, stored job
//! results being sent — reserves its bytes here **before** it allocates them, and
//! gives them back when it lets go (a [`Reservation`] returns its bytes on drop).
//! A reservation beyond the budget is refused at once with [`Exhausted`], which the
//! protocols answer 429 / `RESOURCE_EXHAUSTED` (or, on a stream, a frame dropped and
//! counted). Per-feature limits (`--shm-max-held-bytes`,
//! `--grpc-max-pending-bytes`, …) stay as finer caps under this one.
//!
//! The budget is `--max-client-bytes` (`KILN_MAX_CLIENT_BYTES`), by default a
//! quarter of the machine's memory ([`default_max`]). It counts what clients make
//! kiln hold beyond the bounded buffer pools: the pools are sized at load by the
//! operator's limits (`--max-buffer-bytes`), so the server's memory under any client
//! is about the pools plus this budget.
//!
//! Cost: one `fetch_add` (and a `fetch_sub` on drop) per reservation, on a counter
//! shared by every thread. Reservations are made per image, frame, message or job
//! submission, never per tensor element.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::error::ServerError;

/// What a reservation holds bytes for; the label of
/// `kiln_client_bytes_refused_total{use}` and the name in the refusal's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Use {
    /// Pixels of an image or video frame decoded for a client.
    DecodedImage,
    /// Results of a stream waiting to be sent to its client.
    StreamResult,
    /// Inputs copied out of a client's shared-memory region.
    SharedMemory,
    /// An unfinished gRPC message being gathered.
    GrpcMessage,
    /// A job submission being decoded and stored.
    JobSubmission,
    /// A stored job record being sent to its client.
    JobResult,
    /// A request or response body held for a client.
    Body,
    /// Inputs of a model call a worker makes for a client's request (BLS),
    /// copied for the callee until it answers.
    ModelCall,
}

impl Use {
    /// Every use, in label order.
    pub const ALL: [Use; 8] = [
        Use::DecodedImage,
        Use::StreamResult,
        Use::SharedMemory,
        Use::GrpcMessage,
        Use::JobSubmission,
        Use::JobResult,
        Use::Body,
        Use::ModelCall,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Use::DecodedImage => "decoded_image",
            Use::StreamResult => "stream_result",
            Use::SharedMemory => "shared_memory",
            Use::GrpcMessage => "grpc_message",
            Use::JobSubmission => "job_submission",
            Use::JobResult => "job_result",
            Use::Body => "body",
            Use::ModelCall => "model_call",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Use {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str().replace('_', " "))
    }
}

/// A reservation the budget had no room for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the server holds too many bytes for clients: {bytes} more for {what} would pass \
     --max-client-bytes {max} ({held} held): try again later"
)]
pub struct Exhausted {
    /// What the bytes were for.
    pub what: Use,
    /// The bytes asked for (beyond what the reservation held already).
    pub bytes: usize,
    /// Bytes held server-wide when it was refused.
    pub held: usize,
    /// The budget.
    pub max: usize,
}

impl From<Exhausted> for ServerError {
    fn from(e: Exhausted) -> Self {
        ServerError::Exhausted(e.to_string())
    }
}

/// The budget: bytes held for clients now, and their bound. Shared by every
/// surface of one server ([`crate::Server::client_bytes`]).
pub struct ClientBytes {
    held: AtomicUsize,
    max: AtomicUsize,
    refused: [AtomicU64; Use::ALL.len()],
}

impl fmt::Debug for ClientBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBytes")
            .field("held", &self.held())
            .field("max", &self.max())
            .finish()
    }
}

/// The default budget: a quarter of the machine's memory.
pub fn default_max() -> usize {
    usize::try_from(crate::load::limits::physical_memory() / 4).unwrap_or(usize::MAX)
}

impl ClientBytes {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Arc<ClientBytes> {
        Arc::new(ClientBytes {
            held: AtomicUsize::new(0),
            max: AtomicUsize::new(max),
            refused: Default::default(),
        })
    }

    /// Changes the bound; reservations already made keep their bytes.
    pub fn set_max(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Reservations refused for `what` since the start.
    pub fn refused(&self, what: Use) -> u64 {
        self.refused[what.index()].load(Ordering::Relaxed)
    }

    /// Reserves `bytes` for `what`, or refuses at once when the budget has no room.
    pub fn reserve(self: &Arc<Self>, what: Use, bytes: usize) -> Result<Reservation, Exhausted> {
        let mut reservation = self.empty(what);
        reservation.grow_to(bytes)?;
        Ok(reservation)
    }

    /// A reservation of nothing yet, for bytes that arrive bit by bit
    /// ([`Reservation::grow_to`]).
    pub fn empty(self: &Arc<Self>, what: Use) -> Reservation {
        Reservation {
            budget: Arc::clone(self),
            what,
            amount: 0,
        }
    }

    fn take(&self, what: Use, more: usize) -> Result<(), Exhausted> {
        let max = self.max();
        let before = self.held.fetch_add(more, Ordering::Relaxed);
        if before.saturating_add(more) > max {
            self.held.fetch_sub(more, Ordering::Relaxed);
            self.refused[what.index()].fetch_add(1, Ordering::Relaxed);
            return Err(Exhausted {
                what,
                bytes: more,
                held: before,
                max,
            });
        }
        Ok(())
    }

    fn give(&self, less: usize) {
        self.held.fetch_sub(less, Ordering::Relaxed);
    }

    /// The budget's metrics (`kiln_client_bytes`, `kiln_client_bytes_limit`,
    /// `kiln_client_bytes_refused_total{use}`), read on each scrape.
    pub fn collector(self: &Arc<Self>) -> Box<dyn Collector> {
        Box::new(BudgetCollector(Arc::clone(self)))
    }
}

/// Bytes held of a [`ClientBytes`] budget; given back when dropped.
pub struct Reservation {
    budget: Arc<ClientBytes>,
    what: Use,
    amount: usize,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("what", &self.what)
            .field("amount", &self.amount)
            .finish()
    }
}

impl Reservation {
    /// Bytes this reservation holds.
    pub fn amount(&self) -> usize {
        self.amount
    }

    /// Grows the reservation to `bytes` (nothing when it holds as much already);
    /// refused at once, the reservation unchanged, when the budget has no room.
    pub fn grow_to(&mut self, bytes: usize) -> Result<(), Exhausted> {
        if let Some(more) = bytes.checked_sub(self.amount).filter(|&m| m > 0) {
            self.budget.take(self.what, more)?;
            self.amount = bytes;
        }
        Ok(())
    }

    /// Grows the reservation by `more` bytes.
    pub fn grow_by(&mut self, more: usize) -> Result<(), Exhausted> {
        self.grow_to(self.amount.saturating_add(more))
    }

    /// Shrinks the reservation to `bytes` (nothing when it holds less).
    pub fn shrink_to(&mut self, bytes: usize) {
        if let Some(less) = self.amount.checked_sub(bytes).filter(|&l| l > 0) {
            self.budget.give(less);
            self.amount = bytes;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.give(self.amount);
    }
}

struct BudgetCollector(Arc<ClientBytes>);

impl fmt::Debug for BudgetCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Collector for BudgetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let budget = &self.0;
        for (name, help, value) in [
            (
                "kiln_client_bytes",
                "Bytes the server holds for clients now (decoded images, stream results, shared-memory copies, unfinished messages, job submissions and results)",
                budget.held(),
            ),
            (
                "kiln_client_bytes_limit",
                "The bound on bytes held for clients (--max-client-bytes)",
                budget.max(),
            ),
        ] {
            let gauge = ConstGauge::new(value as i64);
            let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(metric)?;
        }
        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "kiln_client_bytes_refused",
            "Reservations refused because the client-bytes budget was full, by use",
            None,
            counter.metric_type(),
        )?;
        for what in Use::ALL {
            let labels = [("use", what.as_str())];
            let metric = family.encode_family(&labels)?;
            ConstCounter::new(budget.refused(what)).encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_bounded_and_given_back() {
        let budget = ClientBytes::new(100);
        let a = budget.reserve(Use::DecodedImage, 60).unwrap();
        let refused = budget.reserve(Use::StreamResult, 50).unwrap_err();
        assert_eq!(refused.held, 60);
        assert_eq!(budget.refused(Use::StreamResult), 1);
        assert_eq!(budget.held(), 60, "a refusal holds nothing");
        let mut b = budget.reserve(Use::StreamResult, 40).unwrap();
        assert_eq!(budget.held(), 100);
        drop(a);
        assert_eq!(budget.held(), 40);
        b.grow_to(90).unwrap();
        b.shrink_to(10);
        assert_eq!(budget.held(), 10);
        assert!(b.grow_by(91).is_err());
        assert_eq!(b.amount(), 10, "a refused growth leaves the reservation");
        drop(b);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn a_refusal_is_a_429() {
        let budget = ClientBytes::new(1);
        let e = ServerError::from(budget.reserve(Use::JobSubmission, 2).unwrap_err());
        assert!(matches!(e, ServerError::Exhausted(_)));
        assert!(e.to_string().contains("--max-client-bytes 1"), "{e}");
        assert!(e.to_string().contains("job submission"), "{e}");
    }

    #[test]
    fn the_metrics_name_the_budget() {
        let budget = ClientBytes::new(1000);
        let _held = budget.reserve(Use::Body, 10).unwrap();
        let _ = budget.reserve(Use::Body, 1000);
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(budget.collector());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("kiln_client_bytes 10"), "{text}");
        assert!(text.contains("kiln_client_bytes_limit 1000"), "{text}");
        assert!(
            text.contains("kiln_client_bytes_refused_total{use=\"body\"} 1"),
            "{text}"
        );
    }
}
