//! Pull-based batch forming: the dynamic batcher sends a batch only when an instance
//! asks for one, so requests that arrive while every instance is busy wait in the
//! queue and leave together, in one batch, when an instance frees up. This is
//! Triton's dynamic batcher (it forms a batch from everything queued at the moment
//! an instance becomes free). Formed ahead instead, batches came out 2–3× smaller
//! under load (#30: kiln's python echo 2.2 / 5.8 requests per `execute` at 8 / 32
//! gRPC clients, Triton's 3.4 / 13.3), and a model's per-call cost was paid as
//! many times more often.
//!
//! An instance that finds no batch ready [`Pulls::ask`]s (a counter, and a wake-up of
//! the batcher should it sleep for want of asks); the batcher answers one ask with
//! each batch it sends ([`Pulls::answer`]). A waiting instance that leaves (a scale
//! down) [`Pulls::withdraw`]s its ask; if the batcher answered it first, that batch
//! waits in the batch queue for the next instance that looks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crossbeam_channel::{bounded, Receiver, Sender};

/// The instances waiting for a batch, and the batcher's wake-up.
pub struct Pulls {
    /// Asks not yet answered with a batch.
    waiting: AtomicUsize,
    /// One pending wake-up at most: an ask while the batcher sleeps for want of one.
    wake_tx: Sender<()>,
    wake_rx: Receiver<()>,
}

impl Default for Pulls {
    fn default() -> Self {
        let (wake_tx, wake_rx) = bounded(1);
        Pulls {
            waiting: AtomicUsize::new(0),
            wake_tx,
            wake_rx,
        }
    }
}

impl Pulls {
    /// An instance is free and waits for a batch (one counter add, and a wake-up
    /// of the batcher: one per batch, never per request).
    pub fn ask(&self) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // Full: a wake-up is pending already.
        let _ = self.wake_tx.try_send(());
    }

    /// A waiting instance stops waiting (it leaves): `false` when its ask was
    /// answered already (the batch is in the batch queue for another instance).
    pub fn withdraw(&self) -> bool {
        self.take_one()
    }

    /// Whether some instance waits for a batch.
    pub fn asked(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// The batcher sends a batch: it answers one ask (none left if the asking
    /// instance withdrew meanwhile: the batch waits for the next one that looks).
    pub fn answer(&self) {
        self.take_one();
    }

    /// The batcher sleeps until an instance asks, or `until`.
    pub fn wait(&self, until: Instant) {
        if !self.asked() {
            let _ = self.wake_rx.recv_deadline(until);
        }
    }

    fn take_one(&self) -> bool {
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// The batcher, every instance busy, waits until one asks or `until`; with `watch`
/// it also takes requests in as they come (a queue policy that ends a queued
/// request's place needs them seen). `false` once the request queue closed.
pub(super) fn wait_for_ask<R>(
    pulls: &Pulls,
    queue: &mut super::DynamicQueue<R>,
    requests: &Receiver<crate::Request<R>>,
    until: Instant,
    host: &impl super::DynamicHost<R>,
    watch: bool,
) -> bool {
    if !watch {
        pulls.wait(until);
        return true;
    }
    if pulls.asked() {
        return true;
    }
    let mut select = crossbeam_channel::Select::new();
    let arrivals = select.recv(requests);
    select.recv(&pulls.wake_rx);
    match select.select_deadline(until) {
        Err(_) => true,
        Ok(op) if op.index() == arrivals => match op.recv(requests) {
            Ok(request) => {
                super::admit(queue, request, host);
                true
            }
            Err(_) => false,
        },
        Ok(op) => {
            let _ = op.recv(&pulls.wake_rx);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn asks_are_answered_or_withdrawn_once() {
        let pulls = Pulls::default();
        assert!(!pulls.asked());
        pulls.ask();
        pulls.ask();
        assert!(pulls.asked());
        pulls.answer();
        assert!(pulls.withdraw(), "one ask left to withdraw");
        assert!(!pulls.withdraw(), "answered and withdrawn: none left");
        pulls.answer(); // nothing to answer: stays at none
        assert!(!pulls.asked());
    }

    #[test]
    fn an_ask_wakes_a_waiting_batcher() {
        let pulls = std::sync::Arc::new(Pulls::default());
        let asker = std::sync::Arc::clone(&pulls);
        let thread = std::thread::spawn(move || asker.ask());
        // Woken by the ask, long before the hour is up.
        pulls.wait(Instant::now() + Duration::from_secs(3600));
        assert!(pulls.asked());
        thread.join().unwrap();
    }
}
