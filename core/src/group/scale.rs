//! Scaling a running group: its instances raised or lowered in place, with no
//! request failed and the buffer pool resized to match (the pool's size bounds the
//! batches in flight).
//!
//! - Up: the Manager initializes and starts the new instances, then
//!   [`WorkerGroup::grow`] grows the pool first (so the new instances find buffer
//!   sets) and starts their threads on the group's batch source.
//! - Down: [`WorkerGroup::shrink`] sends one message per instance to leave on the
//!   group's leave channel. An instance reads it between batches (one try per
//!   batch) or while it waits for one ([`kiln_batchers::wait_for_first_or_stop`]):
//!   a busy one finishes its batch first, nothing it took is dropped, and it ends
//!   its lifecycle as in an unload. The pool shrinks at once by its free sets and
//!   by each set in use as it comes back, never taking one in use
//!   ([`kiln_buffers::Pool::resize`]). The call does not wait for the instances
//!   to leave (a hard batcher's instance may wait for its batch to fill for as long
//!   as no request comes): the count it reports is the one asked for, and
//!   `kiln_model_instances` follows as they leave.
//!
//! A stateful (sequence) group pins sequences to instances: it does not scale in
//! place ([`WorkerGroup::scales_in_place`]). An ensemble has no instances of its
//! own: the Manager refuses to scale it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_channel::{unbounded, Receiver, Sender};
use kiln_buffers::BufferSet;
use kiln_worker_sdk::{BatcherKind, WorkerBox};

use super::{buffer_capacities, pool_bytes, GroupSettings, WorkerGroup};
use crate::error::{Result, ServerError};

/// A group's instance count and its channel for instances to leave.
pub(super) struct Scaling {
    leave_tx: Sender<()>,
    pub(super) leave_rx: Receiver<()>,
    /// Instances running or starting, not counting those told to leave.
    pub(super) instances: AtomicUsize,
    /// Instances started so far: the next one's number (its former, its thread's
    /// name).
    pub(super) started: AtomicUsize,
    /// The pool's memory at its current size (see [`pool_bytes`]).
    pub(super) pool_bytes: AtomicU64,
}

impl Scaling {
    pub(super) fn new(pool_bytes: u64) -> Scaling {
        let (leave_tx, leave_rx) = unbounded();
        Scaling {
            leave_tx,
            leave_rx,
            instances: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            pool_bytes: AtomicU64::new(pool_bytes),
        }
    }
}

impl WorkerGroup {
    /// Whether the group's instances can be raised or lowered in place; else why
    /// not (a stateful model is reloaded with the new count instead).
    pub fn scales_in_place(&self) -> std::result::Result<(), String> {
        if self.settings.batcher == BatcherKind::Sequence {
            return Err(format!(
                "`{}` is stateful: its sequences are pinned to instances",
                self.endpoint
            ));
        }
        Ok(())
    }

    /// Adds `instances` (initialized, allocated and acquired by the Manager, like
    /// the group's own) once the pool holds `settings.max_buffers` sets. If the
    /// pool cannot grow that far, nothing changes and the instances are ended.
    pub(crate) fn grow(&self, instances: Vec<WorkerBox>, settings: &GroupSettings) -> Result<()> {
        if let Err(e) = self.resize_pool(settings) {
            instances.into_iter().for_each(super::end_lifecycle);
            return Err(e);
        }
        let mut pending = instances.into_iter();
        while let Some(instance) = pending.next() {
            if let Err(e) = self.add_instance(instance) {
                pending.for_each(super::end_lifecycle);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Tells `leaving` instances to leave after their current batch and shrinks the
    /// pool to `settings.max_buffers` sets as they give them back.
    pub(crate) fn shrink(&self, leaving: usize, settings: &GroupSettings) -> Result<()> {
        let leaving = leaving.min(self.instance_count().saturating_sub(1));
        for _ in 0..leaving {
            // The group holds the receiver too: this cannot fail.
            let _ = self.scaling.leave_tx.send(());
        }
        self.scaling.instances.fetch_sub(leaving, Ordering::SeqCst);
        self.resize_pool(settings)
    }

    /// Resizes the pool to `settings.max_buffers` sets, and counts its memory.
    fn resize_pool(&self, settings: &GroupSettings) -> Result<()> {
        let (inputs, outputs) = buffer_capacities(&self.worker_info, self.settings.batch_size);
        self.pool
            .resize(settings.max_buffers, || {
                BufferSet::with_capacities(&inputs, &outputs)
            })
            .map_err(|e| ServerError::LimitExceeded(format!("model `{}`: {e}", self.endpoint)))?;
        self.scaling
            .pool_bytes
            .store(pool_bytes(&self.worker_info, settings), Ordering::SeqCst);
        let m = &self.context.metrics;
        m.pool_size.set(self.pool.size() as i64);
        self.prune();
        Ok(())
    }

    /// Joins the threads of instances that left (their handles would pile up).
    fn prune(&self) {
        let finished: Vec<_> = {
            let mut threads = self.threads.lock();
            let (done, running) = std::mem::take(&mut *threads)
                .into_iter()
                .partition(|t| t.is_finished());
            *threads = running;
            done
        };
        for handle in finished {
            if handle.join().is_err() {
                spdlog::error!("a thread of `{}` panicked", self.endpoint);
            }
        }
    }

    /// Buffer sets in the pool now (its load-time `max_buffers` until scaled).
    pub fn buffer_sets(&self) -> usize {
        self.pool.size()
    }
}
