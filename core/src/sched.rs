//! The scheduling policy of the serving threads (HTTP workers, gRPC threads).
//!
//! A serving thread sleeps until a socket or an answer wakes it. Under Linux's
//! default policy a thread that has slept preempts the thread that woke it. When
//! an instance thread hands out a batch's answers, each answer it hands to a
//! sleeping serving thread on its core would stop it: the serving thread sends that
//! one answer and sleeps again, and the instance thread goes on to the next. Under
//! `SCHED_BATCH` a woken serving thread waits for the instance thread to finish or
//! for the other core, and then sends every answer waiting for it in one go. On the
//! 2-core development machine this gives gRPC 12–40% and HTTP 0–15% more small calls per
//! second (`docs/benchmarks.md`, "Serving threads under SCHED_BATCH").
//! `SCHED_BATCH` keeps the thread's nice value and needs no privilege.

/// Puts the calling thread under `SCHED_BATCH` (Linux; elsewhere nothing is done).
/// An error is logged, not returned: the thread serves either way.
pub fn serving_thread() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid `sched_param`; pid 0 is the calling thread.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            spdlog::warn!("serving thread: cannot set SCHED_BATCH: {e}");
        }
    }
}
