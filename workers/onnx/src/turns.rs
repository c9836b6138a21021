//! Runs on the process's shared ONNX Runtime pool take turns.
//!
//! The shared pool has one intra-op thread per physical core, the calling thread
//! being one of them ([`crate::runtime`]): one run already uses every core. Two runs
//! at once put both callers and the pool's threads on the same cores, and each
//! parallel section then waits for threads preempted in the middle of their share
//! of it. So runs on the shared pool go one at a time, in the order they asked (a
//! ticket lock: no model waits behind a stream of another's runs). The OCR pipeline
//! at 8 clients, three models on the pool, was ahead in 6 rounds of 6 (+2 to +29 %
//! images/s, the rounds' median +9 %; docs/benchmarks.md, #32); one model alone
//! (one run at a time anyway) pays nothing measurable. A session with a pool of its own
//! ([`crate::threads::Threads::Own`]) or on the CUDA provider does not take turns.
//!
//! A turn costs a run two uncontended lock/unlock pairs; only a turn handed to a
//! waiting run wakes a thread.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The turns of the process's shared pool: one per copy of this plugin, as the
/// pool is (a `kiln worker-host` process has its own pool and its own turns).
pub static SHARED: Turns = Turns::new();

/// Turns taken one at a time, in the order they were asked for.
pub struct Turns {
    tickets: Mutex<Tickets>,
    /// Told when a turn ends and another caller waits for it.
    next: Condvar,
    /// Told when a caller starts to wait, while someone watches ([`Turns::until_waiting`]).
    asked: Condvar,
}

#[derive(Debug)]
struct Tickets {
    /// Tickets handed out.
    issued: u64,
    /// Turns finished: the ticket whose turn it is.
    done: u64,
    /// Callers in [`Turns::until_waiting`].
    watchers: usize,
}

impl Tickets {
    fn waiting(&self) -> u64 {
        (self.issued - self.done).saturating_sub(1)
    }
}

/// A turn, held until dropped.
#[must_use = "the turn ends when this is dropped"]
pub struct Turn<'a> {
    turns: &'a Turns,
}

impl Turns {
    pub const fn new() -> Self {
        Turns {
            tickets: Mutex::new(Tickets {
                issued: 0,
                done: 0,
                watchers: 0,
            }),
            next: Condvar::new(),
            asked: Condvar::new(),
        }
    }

    /// Waits for the caller's turn, behind every caller that asked before it.
    pub fn take(&self) -> Turn<'_> {
        let mut tickets = self.lock();
        let ticket = tickets.issued;
        tickets.issued += 1;
        if tickets.done != ticket && tickets.watchers > 0 {
            self.asked.notify_all();
        }
        while tickets.done != ticket {
            tickets = self
                .next
                .wait(tickets)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Turn { turns: self }
    }

    /// How many callers wait for their turn (not counting the one whose turn it is).
    pub fn waiting(&self) -> u64 {
        self.lock().waiting()
    }

    /// Waits until `n` callers wait for their turn, for at most `limit`; whether
    /// they do. For tests and diagnostics: no caller pays for it unless one watches.
    pub fn until_waiting(&self, n: u64, limit: Duration) -> bool {
        let mut tickets = self.lock();
        tickets.watchers += 1;
        let (mut tickets, _) = self
            .asked
            .wait_timeout_while(tickets, limit, |t| t.waiting() < n)
            .unwrap_or_else(PoisonError::into_inner);
        tickets.watchers -= 1;
        tickets.waiting() >= n
    }

    fn lock(&self) -> MutexGuard<'_, Tickets> {
        // A turn's holder never panics while it holds the lock itself.
        self.tickets.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for Turns {
    fn default() -> Self {
        Turns::new()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut tickets = self.turns.lock();
        tickets.done += 1;
        let waiting = tickets.issued > tickets.done;
        drop(tickets);
        if waiting {
            self.turns.next.notify_all();
        }
    }
}

#[cfg(test)]
mod tests;
