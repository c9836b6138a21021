//! The sequence batching policy as a pure structure: every decision takes `now`, so
//! each rule is tested with a fake clock.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::Instant;

use bytes::Bytes;

use super::{SequenceConfig, SequenceId, Strategy};
use crate::request::Request;

/// Why a request leaves the scheduler without being batched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceRejection {
    /// The request names no sequence.
    MissingId,
    /// No live sequence has this id and the request does not start one; `expired`
    /// when the id belonged to a sequence freed after being idle.
    NotActive { expired: bool },
    /// The sequence's end request is already queued; only a new start may follow.
    Ended,
    /// Every live-sequence place and backlog place is taken.
    TooManySequences,
    /// Too many requests are queued across sequences.
    QueueFull,
    /// The id does not fit the worker's CORRID datatype.
    BadCorrId,
    /// The client went away while the request was queued.
    Cancelled,
}

/// What the scheduler decided.
#[derive(Debug)]
pub enum SequencePoll<R> {
    /// Run these requests (worker inputs assembled) as one batch on `instance`.
    Batch {
        instance: usize,
        requests: Vec<Request<R>>,
    },
    /// Nothing to send; look again at the instant given, or when something happens.
    Wait(Option<Instant>),
}

/// One live (or backlogged) sequence.
struct Sequence<R> {
    id: SequenceId,
    /// `None` while in the backlog.
    instance: Option<usize>,
    slot: usize,
    queue: VecDeque<Request<R>>,
    in_flight: bool,
    last_active: Instant,
    state: Vec<Bytes>,
    corrid: Bytes,
    /// An end request is queued: later requests need a new start.
    ending: bool,
    /// The end request is running: the sequence is freed when it completes.
    closing: bool,
}

/// One worker instance's share of the sequences.
struct Instance {
    busy: bool,
    members: Vec<u64>,
    /// Free batch slots (`direct`), lowest first.
    free_slots: BinaryHeap<Reverse<usize>>,
}

/// How many recently expired ids are remembered for a precise error.
const EXPIRED_MEMORY: usize = 1024;

/// Live sequences, their queued requests and states, and the instances they are
/// pinned to.
pub struct SequenceScheduler<R> {
    config: SequenceConfig,
    sequences: HashMap<u64, Sequence<R>>,
    ids: HashMap<SequenceId, u64>,
    next_handle: u64,
    instances: Vec<Instance>,
    backlog: VecDeque<u64>,
    live: usize,
    queued: usize,
    expired: VecDeque<SequenceId>,
    expired_set: HashSet<SequenceId>,
    /// No idle sequence expires before this (a lower bound; `None`: none is idle).
    next_expiry: Option<Instant>,
    closed: bool,
}

impl<R> SequenceScheduler<R> {
    /// A scheduler with no instance yet (see [`SequenceScheduler::add_instance`]).
    pub fn new(config: SequenceConfig) -> SequenceScheduler<R> {
        SequenceScheduler {
            config,
            sequences: HashMap::new(),
            ids: HashMap::new(),
            next_handle: 1,
            instances: Vec::new(),
            backlog: VecDeque::new(),
            live: 0,
            queued: 0,
            expired: VecDeque::new(),
            expired_set: HashSet::new(),
            next_expiry: None,
            closed: false,
        }
    }

    /// The settings.
    pub fn config(&self) -> &SequenceConfig {
        &self.config
    }

    /// Adds a worker instance; returns its index. Backlogged sequences may move in.
    pub fn add_instance(&mut self, now: Instant) -> usize {
        let slots = match self.config.strategy {
            Strategy::Direct => (0..self.config.max_batch_size).map(Reverse).collect(),
            Strategy::Oldest => BinaryHeap::new(),
        };
        self.instances.push(Instance {
            busy: false,
            members: Vec::new(),
            free_slots: slots,
        });
        self.promote(now);
        self.instances.len() - 1
    }

    /// Live sequences (pinned to an instance).
    pub fn live(&self) -> usize {
        self.live
    }

    /// Sequences waiting in the backlog.
    pub fn backlogged(&self) -> usize {
        self.backlog.len()
    }

    /// Requests queued across sequences.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Whether nothing is queued and no batch is running.
    pub fn is_drained(&self) -> bool {
        self.queued == 0 && self.instances.iter().all(|i| !i.busy)
    }

    /// Takes `request` into its sequence's queue, starting a sequence if it says so.
    // A refused request goes back whole, so its host can answer it: the large `Err`
    // is the request itself, moved, not a copy or an allocation.
    #[allow(clippy::result_large_err)]
    pub fn admit(
        &mut self,
        request: Request<R>,
        now: Instant,
    ) -> Result<(), (Request<R>, SequenceRejection)> {
        let Some(flags) = request.sequence.as_ref() else {
            return Err((request, SequenceRejection::MissingId));
        };
        if self.queued >= self.config.max_queued {
            return Err((request, SequenceRejection::QueueFull));
        }
        let (start, end) = (flags.start, flags.end);
        let current = self.ids.get(&flags.id).copied();
        let handle = match current.and_then(|h| self.sequences.get(&h).map(|s| (h, s.ending))) {
            Some((h, false)) => h,
            Some((_, true)) if !start => return Err((request, SequenceRejection::Ended)),
            _ if !start => {
                let expired = self.expired_set.contains(&flags.id);
                return Err((request, SequenceRejection::NotActive { expired }));
            }
            _ => {
                let corrid = match self.config.layout.corrid_dtype() {
                    None => Bytes::new(),
                    Some(dtype) => match super::InputLayout::corrid(dtype, &flags.id) {
                        Some(bytes) => bytes,
                        None => return Err((request, SequenceRejection::BadCorrId)),
                    },
                };
                let id = flags.id.clone();
                match self.create(id, corrid, now) {
                    Some(h) => h,
                    None => return Err((request, SequenceRejection::TooManySequences)),
                }
            }
        };
        let Some(sequence) = self.sequences.get_mut(&handle) else {
            return Err((request, SequenceRejection::NotActive { expired: false }));
        };
        sequence.ending |= end;
        sequence.last_active = now;
        sequence.queue.push_back(request);
        self.queued += 1;
        Ok(())
    }

    /// A new sequence, live if there is room, else backlogged if the backlog has room.
    fn create(&mut self, id: SequenceId, corrid: Bytes, now: Instant) -> Option<u64> {
        let place = self.place();
        if place.is_none() && self.backlog.len() >= self.config.max_backlog {
            return None;
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        self.expired_set.remove(&id);
        self.ids.insert(id.clone(), handle);
        self.sequences.insert(
            handle,
            Sequence {
                id,
                instance: None,
                slot: 0,
                queue: VecDeque::new(),
                in_flight: false,
                last_active: now,
                state: self.config.layout.initial_states(),
                corrid,
                ending: false,
                closing: false,
            },
        );
        match place {
            Some(instance) => self.pin(handle, instance),
            None => self.backlog.push_back(handle),
        }
        Some(handle)
    }

    /// The instance a new sequence would go to: the least loaded one with room.
    fn place(&self) -> Option<usize> {
        if self.live >= self.config.max_sequences {
            return None;
        }
        self.instances
            .iter()
            .enumerate()
            .filter(|(_, i)| match self.config.strategy {
                Strategy::Direct => !i.free_slots.is_empty(),
                Strategy::Oldest => true,
            })
            .min_by_key(|(_, i)| i.members.len())
            .map(|(index, _)| index)
    }

    fn pin(&mut self, handle: u64, instance: usize) {
        let (Some(inst), Some(sequence)) = (
            self.instances.get_mut(instance),
            self.sequences.get_mut(&handle),
        ) else {
            return;
        };
        sequence.instance = Some(instance);
        sequence.slot = inst.free_slots.pop().map_or(0, |Reverse(s)| s);
        inst.members.push(handle);
        self.live += 1;
    }

    /// Moves backlogged sequences in while there is room.
    fn promote(&mut self, now: Instant) {
        while !self.backlog.is_empty() {
            let Some(instance) = self.place() else { return };
            let Some(handle) = self.backlog.pop_front() else {
                return;
            };
            if let Some(sequence) = self.sequences.get_mut(&handle) {
                // Time in the backlog does not count as idle time.
                sequence.last_active = now;
            }
            self.pin(handle, instance);
        }
    }

    /// Frees a sequence: its slot, its place on its instance, its id.
    fn free(&mut self, handle: u64, now: Instant) {
        let Some(sequence) = self.sequences.remove(&handle) else {
            return;
        };
        if self.ids.get(&sequence.id) == Some(&handle) {
            self.ids.remove(&sequence.id);
        }
        self.queued -= sequence.queue.len();
        match sequence.instance {
            Some(index) => {
                if let Some(inst) = self.instances.get_mut(index) {
                    inst.members.retain(|&h| h != handle);
                    if self.config.strategy == Strategy::Direct {
                        inst.free_slots.push(Reverse(sequence.slot));
                    }
                }
                self.live -= 1;
                self.promote(now);
            }
            None => self.backlog.retain(|&h| h != handle),
        }
    }

    /// A batch `instance` ran has finished; `done` gives each sequence's new state
    /// (`None`: the batch failed and the state stays as it was).
    pub fn complete(
        &mut self,
        instance: usize,
        done: Vec<(u64, Option<Vec<Bytes>>)>,
        now: Instant,
    ) {
        if let Some(inst) = self.instances.get_mut(instance) {
            inst.busy = false;
        }
        for (handle, state) in done {
            let Some(sequence) = self.sequences.get_mut(&handle) else {
                continue;
            };
            sequence.in_flight = false;
            sequence.last_active = now;
            if let Some(state) = state {
                sequence.state = state;
            }
            let idle = sequence.queue.is_empty();
            if sequence.closing || (self.closed && idle) {
                self.free(handle, now);
            } else if idle {
                self.note_idle(now);
            }
        }
    }

    fn note_idle(&mut self, now: Instant) {
        let at = now + self.config.max_idle;
        self.next_expiry = Some(self.next_expiry.map_or(at, |n| n.min(at)));
    }

    /// Frees every sequence idle for `max_idle`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        if self.next_expiry.is_none_or(|at| at > now) {
            return 0;
        }
        let mut next: Option<Instant> = None;
        let mut gone = Vec::new();
        for (&handle, s) in &self.sequences {
            if s.in_flight || !s.queue.is_empty() {
                continue;
            }
            let at = s.last_active + self.config.max_idle;
            if at <= now {
                gone.push(handle);
            } else {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        self.next_expiry = next;
        for &handle in &gone {
            if let Some(id) = self.sequences.get(&handle).map(|s| s.id.clone()) {
                self.remember_expired(id);
            }
            self.free(handle, now);
        }
        gone.len()
    }

    fn remember_expired(&mut self, id: SequenceId) {
        if self.expired.len() >= EXPIRED_MEMORY {
            if let Some(old) = self.expired.pop_front() {
                self.expired_set.remove(&old);
            }
        }
        self.expired_set.insert(id.clone());
        self.expired.push_back(id);
    }

    /// Takes out the queued requests whose client went away.
    pub fn cancel(&mut self, now: Instant, is_cancelled: impl Fn(&R) -> bool) -> Vec<Request<R>> {
        let mut out = Vec::new();
        for sequence in self.sequences.values_mut() {
            if sequence.queue.iter().any(|r| is_cancelled(&r.reply)) {
                let (gone, kept): (VecDeque<_>, VecDeque<_>) = sequence
                    .queue
                    .drain(..)
                    .partition(|r| is_cancelled(&r.reply));
                sequence.queue = kept;
                out.extend(gone);
            }
        }
        if !out.is_empty() {
            self.queued -= out.len();
            // A sequence left with nothing queued is idle from now.
            self.note_idle(now);
        }
        out
    }

    /// No more requests will come (unload): idle sequences are freed now, the others
    /// once their queues empty, and batches no longer wait.
    pub fn close(&mut self, now: Instant) {
        self.closed = true;
        let idle: Vec<u64> = self
            .sequences
            .iter()
            .filter(|(_, s)| !s.in_flight && s.queue.is_empty())
            .map(|(&h, _)| h)
            .collect();
        for handle in idle {
            self.free(handle, now);
        }
    }

    /// The next instant something is due: a partial batch's delay or an expiry.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.next_expiry
    }

    /// Forms instance `index`'s next batch, if it is idle and one is due.
    pub fn poll_instance(&mut self, index: usize, now: Instant) -> SequencePoll<R> {
        match self.due(index, now) {
            Ok(chosen) => SequencePoll::Batch {
                instance: index,
                requests: self.take(index, chosen),
            },
            Err(at) => SequencePoll::Wait(at),
        }
    }

    /// Whether instance `index` is idle with a batch due now.
    pub fn is_due(&self, index: usize, now: Instant) -> bool {
        self.due(index, now).is_ok()
    }

    /// The sequences whose next requests form `instance`'s batch now, in row order;
    /// else when to look again (`None`: nothing waits for time).
    fn due(&self, index: usize, now: Instant) -> Result<Vec<u64>, Option<Instant>> {
        let Some(inst) = self.instances.get(index) else {
            return Err(None);
        };
        if inst.busy {
            return Err(None);
        }
        // (arrival of the next request, slot, handle) of every ready sequence.
        let mut ready: Vec<(Instant, usize, u64)> = inst
            .members
            .iter()
            .filter_map(|&h| {
                let s = self.sequences.get(&h)?;
                let head = s.queue.front()?;
                (!s.in_flight).then_some((head.arrived, s.slot, h))
            })
            .collect();
        if ready.is_empty() {
            return Err(None);
        }
        match self.config.strategy {
            Strategy::Direct => ready.sort_unstable_by_key(|&(_, slot, _)| slot),
            Strategy::Oldest => ready.sort_unstable_by_key(|&(at, _, h)| (at, h)),
        }
        // Requests of one batch share their non-batch dimensions.
        let first = ready.first().and_then(|&(_, _, h)| self.head(h));
        ready.retain(|&(_, _, h)| match (first, self.head(h)) {
            (Some(a), Some(b)) => a.same_inner_shapes(b),
            _ => false,
        });
        let max = self.config.max_batch_size.max(1);
        let oldest = ready.iter().map(|&(at, _, _)| at).min().unwrap_or(now);
        let all_ready = ready.len() == inst.members.len();
        let waited = self.closed || oldest + self.config.max_queue_delay <= now;
        let take = if ready.len() >= max || all_ready || waited {
            ready.len().min(max)
        } else {
            match self.config.strategy {
                Strategy::Oldest => self
                    .config
                    .preferred_batch_sizes
                    .iter()
                    .rev()
                    .copied()
                    .find(|&p| p <= ready.len())
                    .unwrap_or(0),
                Strategy::Direct => 0,
            }
        };
        if take == 0 {
            return Err(Some(oldest + self.config.max_queue_delay));
        }
        ready.truncate(take);
        Ok(ready.into_iter().map(|(_, _, h)| h).collect())
    }

    fn head(&self, handle: u64) -> Option<&Request<R>> {
        self.sequences.get(&handle)?.queue.front()
    }

    /// Takes the next request of each chosen sequence, with its worker inputs
    /// assembled, and marks the instance busy.
    fn take(&mut self, index: usize, chosen: Vec<u64>) -> Vec<Request<R>> {
        let mut out = Vec::with_capacity(chosen.len());
        for handle in chosen {
            let Some(sequence) = self.sequences.get_mut(&handle) else {
                continue;
            };
            let Some(mut request) = sequence.queue.pop_front() else {
                continue;
            };
            self.queued -= 1;
            let (start, end) = request
                .sequence
                .as_ref()
                .map_or((false, false), |f| (f.start, f.end));
            if start {
                sequence.state = self.config.layout.initial_states();
            }
            sequence.in_flight = true;
            sequence.closing = end;
            if end {
                // The id is free for a new sequence from now on.
                if self.ids.get(&sequence.id) == Some(&handle) {
                    self.ids.remove(&sequence.id);
                }
            }
            let client = std::mem::take(&mut request.inputs);
            request.inputs = self.config.layout.assemble(
                client,
                sequence.state.clone(),
                (start, end),
                &sequence.corrid,
            );
            if let Some(flags) = request.sequence.as_mut() {
                flags.handle = handle;
            }
            out.push(request);
        }
        if let Some(inst) = self.instances.get_mut(index) {
            inst.busy = !out.is_empty();
        }
        out
    }
}

#[cfg(test)]
mod tests;
