//! Housekeeping: hands memory freed after a burst back to the system.
//!
//! glibc keeps what a flood of requests freed in its arenas (one per thread that
//! allocated: actix-web workers, gRPC threads, batchers, instances), so the process
//! stayed at gigabytes long after the flood. A thread looks every `interval` at the
//! loaded models and the budget of bytes held for clients; on the first few ticks
//! after activity on which the server stayed quiet for a whole interval (nothing
//! pending, nothing answered, no model loaded or unloaded, the bytes held for
//! clients unchanged), it calls `malloc_trim(0)`, which returns every arena's free
//! pages. Under steady traffic it never runs, so it costs the serving threads
//! nothing; the tick itself reads a few atomics per model. Plugins allocate through
//! the same glibc `malloc` (no host-only global allocator), so their freed memory is
//! returned too.
//!
//! The budget and the set of models count as activity because the models' own
//! counts miss two floods: one still arriving (its bodies are held, nothing is
//! pending yet) and one answered by unloading its model (the model's counts leave
//! the sum with it).
//! Measured in `docs/benchmarks.md` ("Memory after a flood").

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;
use crossbeam_channel::{bounded, RecvTimeoutError, Sender};

use crate::error::{Result, ServerError};
use crate::manager::Models;
use crate::memory::client_bytes::ClientBytes;

/// The housekeeping thread; it stops when this is dropped.
pub struct Housekeeping {
    _stop: Sender<()>,
    _thread: JoinHandle<()>,
}

impl Housekeeping {
    /// Starts the thread, looking at `models` and `client_bytes` every `interval`.
    pub fn start(
        models: Arc<ArcSwap<Models>>,
        client_bytes: Arc<ClientBytes>,
        interval: Duration,
    ) -> Result<Housekeeping> {
        let (stop, stopped) = bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name("kiln-housekeeping".into())
            .spawn(move || {
                let mut quiet = Quiet::default();
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    let loaded = models.load();
                    let (pending, answered) = loaded
                        .values()
                        .map(|g| g.activity())
                        .fold((0, 0), |(p, a), (gp, ga)| (p + gp, a + ga));
                    let now = Activity {
                        pending,
                        answered,
                        client_bytes: client_bytes.held(),
                        // A load or unload stores a new map.
                        models: Arc::as_ptr(&loaded) as usize,
                    };
                    drop(loaded);
                    if quiet.tick(now) {
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

/// What the server is doing, as one tick sees it.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
struct Activity {
    /// Requests waiting, over the loaded models.
    pending: i64,
    /// Requests answered so far, over the loaded models (an unload may lower it).
    answered: u64,
    /// Bytes held for clients (`--max-client-bytes`'s budget): bodies arriving,
    /// images decoded, results waiting for their readers.
    client_bytes: usize,
    /// Which map of loaded models this is (its address): a new one after each load
    /// or unload.
    models: usize,
}

/// Decides when to trim: on the first few quiet ticks after activity.
#[derive(Default)]
struct Quiet {
    /// The last tick's view.
    last: Activity,
    /// Quiet ticks on which to trim still.
    trims: u32,
}

impl Quiet {
    /// One tick seeing `now`; `true`: trim.
    fn tick(&mut self, now: Activity) -> bool {
        // Quiet: nothing pending now, and nothing else moved since the last tick.
        let moved = |a: &Activity| (a.answered, a.client_bytes, a.models);
        let still = moved(&now) == moved(&self.last);
        self.last = now;
        if now.pending != 0 || !still {
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
    use super::{Activity, Quiet, TRIMS_AFTER_ACTIVITY};

    /// Ticks until `q` stops trimming; how many trimmed.
    fn trims(q: &mut Quiet, now: Activity) -> u32 {
        let mut n = 0;
        while q.tick(now) {
            n += 1;
        }
        n
    }

    fn answered(answered: u64) -> Activity {
        Activity {
            answered,
            ..Activity::default()
        }
    }

    #[test]
    fn trims_on_the_quiet_ticks_that_follow_activity() {
        let mut q = Quiet::default();
        assert!(!q.tick(Activity::default()), "nothing happened yet");
        let busy = Activity {
            pending: 5,
            answered: 10,
            ..Activity::default()
        };
        assert!(!q.tick(busy));
        assert!(
            !q.tick(answered(20)),
            "answered during this tick: not quiet yet"
        );
        assert_eq!(trims(&mut q, answered(20)), TRIMS_AFTER_ACTIVITY);
        assert!(
            !q.tick(answered(20)),
            "quiet for long: nothing more to return"
        );
        assert!(
            !q.tick(Activity {
                pending: 3,
                ..answered(20)
            }),
            "pending"
        );
        // The model that held them is unloaded: its counts leave the sum.
        assert!(!q.tick(answered(5)));
        assert!(q.tick(answered(5)));
    }

    #[test]
    fn a_flood_still_arriving_is_activity() {
        let mut q = Quiet::default();
        for held in [4 << 20, 90 << 20, 160 << 20] {
            let arriving = Activity {
                client_bytes: held,
                ..Activity::default()
            };
            assert!(!q.tick(arriving), "bodies arriving: {held} bytes held");
        }
        assert!(!q.tick(Activity::default()), "the bodies were let go of");
        assert_eq!(trims(&mut q, Activity::default()), TRIMS_AFTER_ACTIVITY);
        // A client that holds the same bytes for long does not keep it busy.
        let still = Activity {
            client_bytes: 1 << 20,
            ..Activity::default()
        };
        assert!(!q.tick(still));
        assert_eq!(trims(&mut q, still), TRIMS_AFTER_ACTIVITY);
    }

    #[test]
    fn a_flood_answered_by_an_unload_is_activity() {
        let mut q = Quiet::default();
        let loaded = Activity {
            answered: 4,
            models: 1,
            ..Activity::default()
        };
        assert!(!q.tick(loaded));
        assert_eq!(trims(&mut q, loaded), TRIMS_AFTER_ACTIVITY);
        // The flood is answered by the unload of the model that held it, between
        // two ticks: the sums are as before, only the map of models changed.
        let unloaded = Activity {
            models: 2,
            ..loaded
        };
        assert!(!q.tick(unloaded));
        assert_eq!(trims(&mut q, unloaded), TRIMS_AFTER_ACTIVITY);
    }
}
