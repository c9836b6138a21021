//! Runs on the process's shared ONNX Runtime pool take turns: the whole pool for a
//! run alone, one core each for runs that meet.
//!
//! The shared pool has one intra-op thread per physical core, the calling thread
//! being one of them ([`crate::runtime`]): one run on it uses every core. Two runs
//! on it at once put both callers and the pool's threads on the same cores, and each
//! parallel section then waits for threads preempted in the middle of their share.
//! So a turn holds cores: a run that finds every core free and no one waiting takes
//! the whole pool ([`Turn::on_pool`]); a run that meets another (one is running, or
//! it had to wait) takes one core and runs on a session of its own with one thread
//! (the onnx worker's side session), beside the others. Never more runs than cores,
//! never more threads than cores. One client gets every core for each run; many get
//! runs side by side, which on two cores gave `ocr-det` 1.3x the frames of one run
//! at a time on both (docs/benchmarks.md, #32). Waiters are served in the order
//! they asked (a ticket lock: no model waits behind a stream of another's runs). A
//! session with a pool of its own ([`crate::threads::Threads::Own`]) or on the CUDA
//! provider does not take turns.
//!
//! A turn costs a run two uncontended lock/unlock pairs; only a turn given to a
//! waiting run wakes a thread.

use std::sync::{Condvar, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The turns of the process's shared pool, one core per thread of its intra-op
/// pool: one per copy of this plugin, as the pool is (a `kiln worker-host` process
/// has its own pool and its own turns).
pub static SHARED: LazyLock<Turns> = LazyLock::new(|| {
    let threads = crate::runtime::GLOBAL_INTRA_OP_THREADS.get().copied();
    Turns::new(threads.unwrap_or_else(crate::threads::physical_cores))
});

/// What a caller can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// The whole pool, or one core when it meets other runs (it has a side session).
    PoolOrCore,
    /// Only the whole pool: it waits until every core is free.
    PoolOnly,
}

/// Cores given out in turns, in the order they were asked for.
pub struct Turns {
    state: Mutex<State>,
    /// Told when cores are given back or a turn is given, while callers wait.
    next: Condvar,
    /// Told when a caller starts to wait, while someone watches ([`Turns::until_waiting`]).
    asked: Condvar,
}

#[derive(Debug)]
struct State {
    /// The pool's cores (threads).
    cores: usize,
    /// Cores held by turns.
    busy: usize,
    /// Tickets handed out.
    issued: u64,
    /// Tickets given their turn: the next one is the first in line.
    served: u64,
    /// Callers in [`Turns::until_waiting`].
    watchers: usize,
}

impl State {
    fn waiting(&self) -> u64 {
        self.issued - self.served
    }

    /// The cores the first in line gets now, if any: the whole pool when it did not
    /// wait and every core is free, else one core when it can run on one and one is
    /// free, else the whole pool when it is free.
    fn grant(&self, runs: Runs, waited: bool) -> Option<usize> {
        if self.busy == 0 && (!waited || runs == Runs::PoolOnly) {
            Some(self.cores)
        } else if runs == Runs::PoolOrCore && self.busy < self.cores {
            Some(1)
        } else {
            None
        }
    }
}

/// A turn: cores held until dropped.
#[must_use = "the turn ends when this is dropped"]
pub struct Turn<'a> {
    turns: &'a Turns,
    cores: usize,
    on_pool: bool,
}

impl Turn<'_> {
    /// Whether the turn holds the whole pool (else one core, for a side session).
    pub fn on_pool(&self) -> bool {
        self.on_pool
    }
}

impl Turns {
    /// Turns over a pool of `cores` threads (at least one).
    pub fn new(cores: usize) -> Self {
        Turns {
            state: Mutex::new(State {
                cores: cores.max(1),
                busy: 0,
                issued: 0,
                served: 0,
                watchers: 0,
            }),
            next: Condvar::new(),
            asked: Condvar::new(),
        }
    }

    /// Waits for the caller's turn, behind every caller that asked before it.
    pub fn take(&self, runs: Runs) -> Turn<'_> {
        let mut state = self.lock();
        let ticket = state.issued;
        state.issued += 1;
        let mut waited = false;
        loop {
            if state.served == ticket {
                if let Some(cores) = state.grant(runs, waited) {
                    let on_pool = cores == state.cores;
                    state.busy += cores;
                    state.served += 1;
                    let more = state.waiting() > 0;
                    drop(state);
                    if more {
                        // The next in line may get a core too.
                        self.next.notify_all();
                    }
                    return Turn {
                        turns: self,
                        cores,
                        on_pool,
                    };
                }
            }
            if !waited {
                waited = true;
                if state.watchers > 0 {
                    self.asked.notify_all();
                }
            }
            state = self
                .next
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// How many callers wait for their turn.
    pub fn waiting(&self) -> u64 {
        self.lock().waiting()
    }

    /// Waits until `n` callers wait for their turn, for at most `limit`; whether
    /// they do. For tests and diagnostics: no caller pays for it unless one watches.
    pub fn until_waiting(&self, n: u64, limit: Duration) -> bool {
        let mut state = self.lock();
        state.watchers += 1;
        let (mut state, _) = self
            .asked
            .wait_timeout_while(state, limit, |s| s.waiting() < n)
            .unwrap_or_else(PoisonError::into_inner);
        state.watchers -= 1;
        state.waiting() >= n
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No one panics while holding the lock itself.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut state = self.turns.lock();
        state.busy -= self.cores;
        let waiting = state.waiting() > 0;
        drop(state);
        if waiting {
            self.turns.next.notify_all();
        }
    }
}

#[cfg(test)]
mod tests;
