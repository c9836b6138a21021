//! The operator's `--stream-*` flags (each with its `KILN_STREAM_*` variable),
//! flattened into `kiln serve`'s arguments.

use std::time::Duration;

use clap::Args;

use super::StreamConfig;

/// WebSocket streams (docs/websocket.md, "Operator flags").
#[derive(Args, Debug, Clone)]
pub struct StreamArgs {
    /// Open WebSocket stream sessions at most, server-wide; beyond, the upgrade
    /// is answered 429.
    #[arg(long, env = "KILN_STREAM_MAX_SESSIONS", default_value_t = 256)]
    pub stream_max_sessions: usize,
    /// The largest `max_inflight_frames` a stream session may ask (frames of a
    /// session in the model at once).
    #[arg(long, env = "KILN_STREAM_MAX_INFLIGHT_FRAMES", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub stream_max_inflight_frames: u32,
    /// The largest message a stream client may send, in bytes (close 1009 beyond).
    #[arg(long, env = "KILN_STREAM_MAX_MESSAGE_BYTES", default_value_t = 16 << 20)]
    pub stream_max_message_bytes: usize,
    /// Seconds a stream session may be idle (no message from the client, no
    /// frame in flight) before it is closed (1001).
    #[arg(long, env = "KILN_STREAM_IDLE_TIMEOUT", default_value_t = 60.0)]
    pub stream_idle_timeout: f64,
}

impl StreamArgs {
    /// The settings the flags give (server-side sources: none).
    pub fn config(&self) -> Result<StreamConfig, String> {
        let idle_timeout = Duration::try_from_secs_f64(self.stream_idle_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                format!(
                    "--stream-idle-timeout {}: a positive number of seconds",
                    self.stream_idle_timeout
                )
            })?;
        Ok(StreamConfig {
            max_sessions: self.stream_max_sessions,
            max_inflight_frames: self.stream_max_inflight_frames as usize,
            max_message_bytes: self.stream_max_message_bytes,
            idle_timeout,
            sources: None,
        })
    }
}
