//! Where an instance's batches come from: a batcher thread's queue, the dynamic
//! batcher's pull (a batch formed when the instance asks), or the instance's own
//! turn on a batch former or the sequence batcher.

use std::sync::Arc;

use crossbeam_channel::Receiver;
use kiln_batchers::dynamic::Pulls;
use kiln_batchers::sequence::{SequenceFormer, SequenceTurn};
use kiln_batchers::{wait_for_first_or_stop, Batch, BatchFormer, Idle};

use crate::request::answer::Reply;

/// Where an instance's batches come from, and the group's call for instances to
/// leave (a scale down, [`crate::group`]'s `scale`): each message on `leave` ends
/// one instance, between its batches or while it waits for one.
pub struct BatchSource {
    pub from: From,
    pub leave: Option<Receiver<()>>,
}

/// What forms an instance's batches.
pub enum From {
    /// A batcher thread that hands them over.
    Queue(Receiver<Batch<Reply>>),
    /// The dynamic batcher's thread, which forms a batch when an instance asks.
    Pulled(Pulled),
    /// The instance itself, in its turn (hard, soft, plain dynamic).
    Former(Arc<BatchFormer<Reply>>),
    /// The instance itself, forming batches of the sequences pinned to it.
    Sequence {
        former: Arc<SequenceFormer<Reply>>,
        turn: SequenceTurn,
    },
}

/// An instance's side of the dynamic batcher's pull (`kiln_batchers::dynamic::pull`):
/// it asks for every batch it takes, so the asks outstanding and the batches sent
/// add up to the instances waiting. Taking a batch unasked (one sent for another
/// instance's ask) would leave that instance waiting with no ask counted, for good
/// once every other instance is gone.
pub struct Pulled {
    batches: Receiver<Batch<Reply>>,
    pulls: Arc<Pulls>,
    /// Told to leave after its ask was answered: it runs that batch first.
    leaving: std::cell::Cell<bool>,
}

impl Pulled {
    pub fn new(batches: Receiver<Batch<Reply>>, pulls: Arc<Pulls>) -> Pulled {
        Pulled {
            batches,
            pulls,
            leaving: std::cell::Cell::new(false),
        }
    }

    fn next(&self, idle: &mut dyn Idle, leave: Option<&Receiver<()>>) -> Option<Batch<Reply>> {
        if self.leaving.get() || leave.is_some_and(|leave| leave.try_recv().is_ok()) {
            return None;
        }
        self.pulls.ask();
        let batch = wait_for_first_or_stop(&self.batches, idle, leave);
        if batch.is_some() || self.pulls.withdraw() {
            return batch;
        }
        // Answered before it could withdraw: a batch is sent for it (or the
        // batcher is gone and the queue closes).
        self.leaving.set(true);
        self.batches.recv().ok()
    }
}

impl BatchSource {
    /// The next batch; `idle` is told when none is ready at once. `None` once the
    /// source closes or the instance is to leave.
    pub(crate) fn next(&self, idle: &mut dyn Idle) -> Option<Batch<Reply>> {
        let leave = self.leave.as_ref();
        match &self.from {
            From::Queue(batches) => {
                // One try per batch (an empty channel's read) tells it between batches.
                if leave.is_some_and(|leave| leave.try_recv().is_ok()) {
                    return None;
                }
                wait_for_first_or_stop(batches, idle, leave)
            }
            From::Pulled(pulled) => pulled.next(idle, leave),
            From::Former(former) => former.next_batch(idle, leave),
            // A stateful group does not scale down (its sequences are pinned).
            From::Sequence { former, turn } => former.next_batch(turn, idle),
        }
    }
}
