//! Stopping as Triton does (`--exit-timeout-secs`, docs/operations.md): on
//! SIGTERM or SIGINT the server turns not ready (liveness stays 200), refuses new
//! requests with 503 / UNAVAILABLE ("server is stopping") but the continuations of
//! open sequences, keeps its listeners open while it answers what it accepted, and
//! then exits 0; when the exit timeout expires first, what is left is cut and the
//! exit status is non-zero. The binary drives the steps; this module holds the
//! signals and the wait.

use std::time::Duration;

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Instant;

use kiln_core::server::Server;

/// How often a stopping server looks whether it is idle: only while stopping, so
/// serving pays nothing for it.
const IDLE_POLL: Duration = Duration::from_millis(10);

/// SIGTERM and SIGINT, caught from the moment this is made (made before the
/// server says it listens, so a signal sent at once still drains rather than
/// killing the process).
pub struct StopSignals {
    term: Signal,
    int: Signal,
}

impl StopSignals {
    /// Installs the handlers (needs a tokio runtime).
    pub fn new() -> std::io::Result<StopSignals> {
        Ok(StopSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the next SIGTERM or SIGINT; returns its name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Everything accepted was answered.
    Idle,
    /// The exit timeout expired first.
    TimedOut,
    /// A second signal asked to stop at once.
    Interrupted(&'static str),
}

/// Waits until `server` has answered every request it accepted
/// ([`Server::is_idle`]), `deadline` passes, or another signal comes.
pub async fn until_idle(server: &Server, deadline: Instant, signals: &mut StopSignals) -> Drained {
    let idle = async {
        while !server.is_idle() {
            tokio::time::sleep(IDLE_POLL).await;
        }
    };
    tokio::select! {
        () = idle => Drained::Idle,
        () = tokio::time::sleep_until(deadline) => {
            // The last look: idle exactly at the deadline is still a clean drain.
            if server.is_idle() { Drained::Idle } else { Drained::TimedOut }
        }
        name = signals.recv() => Drained::Interrupted(name),
    }
}

/// What a stopping server still holds, for the log line of a cut drain.
pub fn left(server: &Server) -> String {
    let load = server.load_figures();
    let sequences: u64 = server
        .models()
        .iter()
        .filter_map(|s| s.group())
        .map(|g| g.live_sequences())
        .sum();
    format!(
        "{} request(s) queued, {} in batches, {sequences} open sequence(s)",
        load.queued, load.in_batches
    )
}
