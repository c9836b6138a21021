//! The bound on a group's queue: every request accepted and not yet in a batch
//! (Triton's `max_queue_size`: requests queued, not yet scheduled).
//!
//! A request takes a [`Ticket`] when it is accepted, before it enters the group's
//! channel, and holds it wherever it waits: in the channel, in a batcher's own queues
//! (the dynamic batcher's priority levels, the sequence batcher's per-sequence FIFOs),
//! or in a batcher thread's hands while it waits for a buffer set. The ticket is
//! dropped with the request's last field when the request joins a batch
//! ([`crate::Batch::push`]) or leaves unbatched (answered: timed out, cancelled,
//! refused), so no path can forget to give the place back. When every place is taken
//! the caller is refused at once, before anything is queued.
//!
//! Cost: one compare-and-swap at admission and the `Arc`'s count; a batch gives its
//! requests' places back with one atomic subtraction once it is formed (a request
//! that leaves unbatched gives its own back); measured in `docs/benchmarks.md`
//! ("Queue bound").

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A group's count of requests accepted and not yet in a batch, with its bound.
#[derive(Debug)]
pub struct Admission {
    queued: AtomicUsize,
    limit: usize,
}

/// Places in the queue (one request's, or a forming batch's, see
/// [`Ticket::absorb`]); dropping it gives them back.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    places: usize,
}

impl Admission {
    /// A bound of `limit` requests (at least 1).
    pub fn new(limit: usize) -> Arc<Admission> {
        Arc::new(Admission {
            queued: AtomicUsize::new(0),
            limit: limit.max(1),
        })
    }

    /// Takes a place, or `None` when all `limit` are taken.
    pub fn try_admit(self: &Arc<Self>) -> Option<Ticket> {
        // A compare-and-swap loop, not add-then-undo: a refused caller never shows
        // as queued, so a request below the bound is never refused.
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Ticket {
                admission: Arc::clone(self),
                places: 1,
            })
    }

    /// Requests accepted and not yet in a batch.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// The bound.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl Ticket {
    /// Takes over `other`'s places when both are of one bound, to give them all back
    /// at once (a batch absorbs its requests' tickets as they join and gives the
    /// places back when it is formed, so the count its callers write is written by
    /// the batch's thread once per batch, not once per request); otherwise
    /// `other`'s are given back now.
    pub fn absorb(&mut self, mut other: Ticket) {
        if Arc::ptr_eq(&self.admission, &other.admission) {
            self.places += std::mem::take(&mut other.places);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.places > 0 {
            self.admission
                .queued
                .fetch_sub(self.places, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_bounded_and_given_back_on_drop() {
        let admission = Admission::new(2);
        let a = admission.try_admit().unwrap();
        let b = admission.try_admit().unwrap();
        assert!(admission.try_admit().is_none());
        assert_eq!(admission.queued(), 2);
        drop(a);
        let c = admission.try_admit().unwrap();
        drop((b, c));
        assert_eq!(admission.queued(), 0);
    }

    #[test]
    fn an_absorbed_ticket_gives_its_place_back_with_the_absorber() {
        let admission = Admission::new(3);
        let other = Admission::new(3);
        let mut batch = admission.try_admit().unwrap();
        batch.absorb(admission.try_admit().unwrap());
        batch.absorb(admission.try_admit().unwrap());
        assert_eq!(admission.queued(), 3);
        assert!(admission.try_admit().is_none());
        // Another bound's ticket is not taken over: its place is given back at once.
        batch.absorb(other.try_admit().unwrap());
        assert_eq!(other.queued(), 0);
        drop(batch);
        assert_eq!(admission.queued(), 0);
    }

    #[test]
    fn concurrent_admissions_never_exceed_the_bound() {
        let admission = Admission::new(100);
        let taken: Vec<Vec<Ticket>> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..1000).filter_map(|_| admission.try_admit()).collect()))
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(taken.iter().map(Vec::len).sum::<usize>(), 100);
        assert_eq!(admission.queued(), 100);
    }
}
