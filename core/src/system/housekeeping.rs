//! Housekeeping: hands memory freed after a burst back to the system.
//!
//! glibc keeps what a flood of requests freed in its arenas (one per thread that
//! allocated: actix-web workers, gRPC threads, batchers, instances), so the process
//! stayed at gigabytes long after the flood. A thread looks every `interval` at the
//! loaded models; on the first few ticks after activity on which the server stayed
//! quiet for a whole interval (nothing pending, nothing answered), it calls
//! `malloc_trim(0)`, which returns every arena's free pages. Under steady traffic it
//! never runs, so it costs the serving threads nothing; the tick itself reads a few
//! atomics per model. Plugins allocate through the same glibc `malloc` (no host-only
//! global allocator), so their freed memory is returned too.
//! Measured in `docs/benchmarks.md` ("Memory after a flood").

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;
use crossbeam_channel::{bounded, RecvTimeoutError, Sender};

use crate::error::{Result, ServerError};
use crate::manager::Models;

/// The housekeeping thread; it stops when this is dropped.
pub struct Housekeeping {
    _stop: Sender<()>,
    _thread: JoinHandle<()>,
}

impl Housekeeping {
    /// Starts the thread, looking at `models` every `interval`.
    pub fn start(models: Arc<ArcSwap<Models>>, interval: Duration) -> Result<Housekeeping> {
        let (stop, stopped) = bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name("kiln-housekeeping".into())
            .spawn(move || {
                let mut quiet = Quiet::default();
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    let (pending, answered) = models
                        .load()
                        .values()
                        .map(|g| g.activity())
                        .fold((0, 0), |(p, a), (gp, ga)| (p + gp, a + ga));
                    if quiet.tick(pending, answered) {
                        trim();
                    }
                }
            })
            .map_err(|e| ServerError::Internal(format!("cannot start housekeeping: {e}")))?;
        Ok(Housekeeping {
            _stop: stop,
            _thread: thread,
        })
    }
}

/// Quiet ticks after activity on which housekeeping trims: a burst's memory is
/// freed over a few seconds (its answers are still being written to slow clients
/// when nothing is pending any more), and a trim with nothing to return costs
/// well under a millisecond.
const TRIMS_AFTER_ACTIVITY: u32 = 5;

/// Decides when to trim: on the first few quiet ticks after activity.
#[derive(Default)]
struct Quiet {
    /// Requests answered, at the last tick.
    last: u64,
    /// Quiet ticks on which to trim still.
    trims: u32,
}

impl Quiet {
    /// One tick with `pending` requests waiting and `answered` answered so far (a
    /// sum over the loaded models: an unload may also lower it); `true`: trim.
    fn tick(&mut self, pending: i64, answered: u64) -> bool {
        let still = answered == self.last;
        self.last = answered;
        if pending != 0 || !still {
            self.trims = TRIMS_AFTER_ACTIVITY;
            return false;
        }
        let trim = self.trims > 0;
        self.trims = self.trims.saturating_sub(1);
        trim
    }
}

/// Returns free heap memory to the system and logs how much.
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let before = resident_bytes();
        let started = std::time::Instant::now();
        // SAFETY: malloc_trim only walks glibc's own arenas, under their locks.
        unsafe {
            libc::malloc_trim(0);
        }
        let after = resident_bytes();
        spdlog::debug!(
            "housekeeping: returned {} MiB to the system in {:?} (resident {} MiB)",
            before.saturating_sub(after) >> 20,
            started.elapsed(),
            after >> 20
        );
    }
}

/// The process's resident memory in bytes (`/proc/self/statm`; 0 if unreadable).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0);
    // SAFETY: sysconf only reads system configuration.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages.saturating_mul(page.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::{Quiet, TRIMS_AFTER_ACTIVITY};

    #[test]
    fn trims_on_the_quiet_ticks_that_follow_activity() {
        let mut q = Quiet::default();
        assert!(!q.tick(0, 0), "nothing happened yet");
        assert!(!q.tick(5, 10), "busy");
        assert!(!q.tick(0, 20), "answered during this tick: not quiet yet");
        for _ in 0..TRIMS_AFTER_ACTIVITY {
            assert!(q.tick(0, 20), "a quiet tick after activity");
        }
        assert!(!q.tick(0, 20), "quiet for long: nothing more to return");
        assert!(!q.tick(3, 20), "pending");
        // The model that held them is unloaded: its counts leave the sum.
        assert!(!q.tick(0, 5));
        assert!(q.tick(0, 5));
    }
}
