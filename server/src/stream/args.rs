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
    /// Seconds a stream client has after the upgrade to send its opening message
    /// before it is closed (1001).
    #[arg(long, env = "KILN_STREAM_OPEN_TIMEOUT", default_value_t = 5.0)]
    pub stream_open_timeout: f64,
    /// Upgrades whose opening message has not come yet, at most, server-wide;
    /// beyond, the upgrade is answered 429.
    #[arg(long, env = "KILN_STREAM_MAX_OPENING", default_value_t = 16)]
    pub stream_max_opening: usize,
    /// The largest result message kiln sends, in bytes; a frame whose result
    /// would be larger gets an error message instead.
    #[arg(long, env = "KILN_STREAM_MAX_RESULT_BYTES", default_value_t = 16 << 20)]
    pub stream_max_result_bytes: usize,
    /// Seconds a stream client may leave its results unread before it is closed
    /// (1001) and everything its session holds is freed.
    #[arg(long, env = "KILN_STREAM_WRITE_TIMEOUT", default_value_t = 10.0)]
    pub stream_write_timeout: f64,
}

/// `value` seconds as a positive duration, or the error naming `flag`.
fn seconds(flag: &str, value: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("--{flag} {value}: a positive number of seconds"))
}

impl StreamArgs {
    /// The settings the flags give (server-side sources: none).
    pub fn config(&self) -> Result<StreamConfig, String> {
        Ok(StreamConfig {
            max_sessions: self.stream_max_sessions,
            max_inflight_frames: self.stream_max_inflight_frames as usize,
            max_message_bytes: self.stream_max_message_bytes,
            idle_timeout: seconds("stream-idle-timeout", self.stream_idle_timeout)?,
            open_timeout: seconds("stream-open-timeout", self.stream_open_timeout)?,
            max_opening: self.stream_max_opening.max(1),
            max_result_bytes: self.stream_max_result_bytes,
            write_timeout: seconds("stream-write-timeout", self.stream_write_timeout)?,
            sources: None,
        })
    }
}
