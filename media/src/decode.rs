//! Decoding with a managed `ffmpeg` subprocess that pipes raw `rgb24` frames.
//!
//! Managed: at most `--media-max-decoders` run at once ([`DecoderSlots`]); stdin is
//! `/dev/null`; stdout is read one frame at a time into the caller's buffer, so the
//! pipe (64 KiB) bounds what waits and FFmpeg blocks while the session does not
//! read; stderr is drained into a bounded tail quoted by errors; the process is
//! killed and reaped when the decoder is dropped, or at once through a
//! [`DecodeStop`] from another thread, or by a watchdog once it has run
//! `max_duration` (a live source never ends by itself: without it 16 cameras
//! would hold every slot for good). An RTSP source is read through an
//! [`RtspRelay`]. Why a subprocess rather than FFmpeg's libraries:
//! docs/websocket.md, "Decoding".

use std::io::{ErrorKind, Read};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::probe::{input_options, probe, VideoInfo};
use crate::relay::RtspRelay;
use crate::source::MediaSource;
use crate::stderr::StderrTail;
use crate::MediaError;

/// The server-wide count of running decoders, capped (`--media-max-decoders`).
#[derive(Debug, Clone)]
pub struct DecoderSlots {
    max: usize,
    used: Arc<AtomicUsize>,
}

impl DecoderSlots {
    /// At most `max` decoders at once.
    pub fn new(max: usize) -> DecoderSlots {
        DecoderSlots {
            max,
            used: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A slot, or [`MediaError::Busy`] when all are taken (never waits).
    pub fn try_acquire(&self) -> Result<DecoderPermit, MediaError> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .map_err(|_| MediaError::Busy(self.max))?;
        Ok(DecoderPermit {
            used: self.used.clone(),
        })
    }

    /// Decoders running now.
    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// One taken decoder slot, given back on drop.
#[derive(Debug)]
pub struct DecoderPermit {
    used: Arc<AtomicUsize>,
}

impl Drop for DecoderPermit {
    fn drop(&mut self) {
        self.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a decoder runs.
#[derive(Debug, Clone, Copy)]
pub struct DecodeOptions {
    /// Network reads and `ffprobe` time out after this.
    pub io_timeout: Duration,
    /// Frames at the source's own rate (FFmpeg's `-re`), as a camera delivers
    /// them; otherwise as fast as the reader takes them.
    pub realtime: bool,
    /// The decoder is stopped this long after it starts (`None`: never), and
    /// its slot given back.
    pub max_duration: Option<Duration>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            io_timeout: Duration::from_secs(10),
            realtime: false,
            max_duration: None,
        }
    }
}

/// Kills a decoder's process once it has run its longest; woken early (and
/// ended) when the decoder drops its sender.
#[derive(Debug)]
struct Watchdog {
    _cancel: mpsc::Sender<()>,
    expired: Arc<AtomicBool>,
    limit: Duration,
}

impl Watchdog {
    fn start(limit: Duration, stop: DecodeStop) -> Result<Watchdog, MediaError> {
        let (cancel, wait) = mpsc::channel::<()>();
        let expired = Arc::new(AtomicBool::new(false));
        let flag = expired.clone();
        std::thread::Builder::new()
            .name("kiln-decode-limit".into())
            .spawn(move || {
                if let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
                    flag.store(true, Ordering::Release);
                    stop.stop();
                }
            })
            .map_err(|e| MediaError::Internal(format!("decoder watchdog thread: {e}")))?;
        Ok(Watchdog {
            _cancel: cancel,
            expired,
            limit,
        })
    }
}

/// Kills a decoder's process from another thread (a session that ends while the
/// decoder waits for its source).
#[derive(Debug, Clone, Default)]
pub struct DecodeStop {
    /// The running, unreaped process; `None` before it starts and once reaped.
    pid: Arc<Mutex<Option<u32>>>,
}

impl DecodeStop {
    /// Kills the process if it runs; its reader then sees the end of its frames.
    pub fn stop(&self) {
        let pid = self.pid.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pid) = *pid {
            // SAFETY: kill(2) with a pid this process started and has not reaped
            // (the lock is held across the reaping), so it names that process.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

/// A running `ffmpeg` decoding one source into rgb24 frames.
pub struct VideoDecoder {
    child: Child,
    stdout: ChildStdout,
    stderr: StderrTail,
    info: VideoInfo,
    name: String,
    /// FFmpeg's input argument, replaced by `name` in its messages.
    input: String,
    stop: DecodeStop,
    done: bool,
    watchdog: Option<Watchdog>,
    /// Dropped after the process is killed (field order).
    relay: Option<RtspRelay>,
    _permit: DecoderPermit,
}

/// `error`, or the relay's refusal when it cut the connection.
fn refused_or(relay: Option<&RtspRelay>, name: &str, error: MediaError) -> MediaError {
    match relay.and_then(RtspRelay::refusal) {
        Some(why) => MediaError::Refused(format!("cannot decode `{name}`: {why}")),
        None => error,
    }
}

impl VideoDecoder {
    /// Probes `source` (size, frame rate) and starts decoding it. `name` is how
    /// errors name it; `stop` can kill the process from elsewhere.
    pub fn open(
        source: &MediaSource,
        name: &str,
        permit: DecoderPermit,
        options: DecodeOptions,
        stop: DecodeStop,
    ) -> Result<VideoDecoder, MediaError> {
        let relay = match source {
            MediaSource::Url(url) if source.is_rtsp() => {
                Some(RtspRelay::start(url, options.io_timeout)?)
            }
            _ => None,
        };
        let input = relay
            .as_ref()
            .map_or_else(|| source.ffmpeg_input(), |r| r.url().to_owned());
        let info = probe(source, &input, name, options.io_timeout)
            .map_err(|e| refused_or(relay.as_ref(), name, e))?;
        let mut command = Command::new("ffmpeg");
        command.args(["-nostdin", "-hide_banner", "-loglevel", "error"]);
        if options.realtime {
            command.arg("-re");
        }
        command
            .args(input_options(source, options.io_timeout))
            .args(["-threads", "1", "-i"])
            .arg(&input)
            .args([
                "-map",
                "0:v:0",
                "-an",
                "-sn",
                "-dn",
                "-fps_mode",
                "passthrough",
                "-f",
                "rawvideo",
                "-pix_fmt",
                "rgb24",
                "pipe:1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut slot = stop.pid.lock().unwrap_or_else(|e| e.into_inner());
        let mut child = command.spawn().map_err(|e| {
            MediaError::Internal(format!("cannot run ffmpeg (scripts/setup-ffmpeg): {e}"))
        })?;
        *slot = Some(child.id());
        drop(slot);
        let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(MediaError::Internal(
                "ffmpeg's pipes were not opened".into(),
            ));
        };
        let watchdog = match options.max_duration {
            Some(limit) => match Watchdog::start(limit, stop.clone()) {
                Ok(w) => Some(w),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e);
                }
            },
            None => None,
        };
        Ok(VideoDecoder {
            child,
            stdout,
            stderr: StderrTail::start(stderr),
            info,
            name: name.to_owned(),
            input,
            stop,
            done: false,
            watchdog,
            relay,
            _permit: permit,
        })
    }

    /// The source's size and frame rate.
    pub fn info(&self) -> VideoInfo {
        self.info
    }

    /// FFmpeg's process id while it runs unreaped.
    pub fn pid(&self) -> Option<u32> {
        *self.stop.pid.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the next frame (rgb24, `info().frame_len()` bytes, rows top down) into
    /// `frame`, resized to fit. `Ok(false)` at the end of the source; an error
    /// when FFmpeg failed (its words quoted) or stopped inside a frame.
    pub fn read_frame(&mut self, frame: &mut Vec<u8>) -> Result<bool, MediaError> {
        if self.done {
            return Ok(false);
        }
        frame.resize(self.info.frame_len(), 0);
        let mut filled = 0;
        while filled < frame.len() {
            match self.stdout.read(&mut frame[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.done = true;
                    return Err(MediaError::Internal(format!(
                        "reading ffmpeg's frames: {e}"
                    )));
                }
            }
        }
        if filled == frame.len() {
            return Ok(true);
        }
        self.done = true;
        let status = self.reap();
        let words = self.stderr.finish().replace(&self.input, &self.name);
        if let Some(w) = self.watchdog.as_ref() {
            if w.expired.load(Ordering::Acquire) {
                return Err(MediaError::Undecodable(format!(
                    "`{}` was stopped after {} s, the longest a server-side source runs \
                     (--media-max-duration)",
                    self.name,
                    w.limit.as_secs_f64()
                )));
            }
        }
        if let Some(why) = self.relay.as_ref().and_then(RtspRelay::refusal) {
            return Err(MediaError::Refused(format!(
                "cannot decode `{}`: {why}",
                self.name
            )));
        }
        match status {
            Some(status) if status.success() && filled == 0 => Ok(false),
            _ => Err(MediaError::Undecodable(format!(
                "cannot decode `{}`: {}",
                self.name,
                if !words.is_empty() {
                    words
                } else if filled > 0 {
                    "the decoder stopped inside a frame".into()
                } else {
                    status.map_or_else(|| "the decoder was stopped".into(), |s| s.to_string())
                }
            ))),
        }
    }

    /// Waits for the exited process and forgets its pid (under the lock
    /// [`DecodeStop`] kills under).
    fn reap(&mut self) -> Option<std::process::ExitStatus> {
        let mut pid = self.stop.pid.lock().unwrap_or_else(|e| e.into_inner());
        let status = self.child.wait().ok();
        *pid = None;
        status
    }
}

impl Drop for VideoDecoder {
    fn drop(&mut self) {
        let mut pid = self.stop.pid.lock().unwrap_or_else(|e| e.into_inner());
        if pid.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
            *pid = None;
        }
    }
}
