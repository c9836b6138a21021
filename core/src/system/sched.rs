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
//!
//! Background threads (the jobs dispatcher and its store calls) run under
//! `SCHED_IDLE` ([`background_thread`]): they get a core only when no other
//! thread wants it, so decoding jobs, encoding their results and committing them
//! never takes CPU from realtime requests. Also without privilege.

/// Puts the calling thread under `SCHED_BATCH` (Linux; elsewhere nothing is done).
/// An error is logged, not returned: the thread serves either way.
pub fn serving_thread() {
    #[cfg(target_os = "linux")]
    set_policy(libc::SCHED_BATCH, "serving thread: cannot set SCHED_BATCH");
}

/// Puts the calling thread under `SCHED_IDLE` (Linux; elsewhere nothing is done):
/// it runs only on a core no other thread wants. An error is logged, not
/// returned: the thread works either way.
pub fn background_thread() {
    #[cfg(target_os = "linux")]
    set_policy(libc::SCHED_IDLE, "background thread: cannot set SCHED_IDLE");
}

/// Sets the calling thread's scheduling policy (static priority 0), logging
/// `failed` with the error when it cannot.
#[cfg(target_os = "linux")]
fn set_policy(policy: libc::c_int, failed: &str) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid `sched_param`; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, policy, &param) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        spdlog::warn!("{failed}: {e}");
    }
}
