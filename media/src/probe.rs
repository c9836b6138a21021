//! `ffprobe`: a source's frame size and rate, before any frame is decoded.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::source::MediaSource;
use crate::stderr::StderrTail;
use crate::MediaError;

/// The largest frame kiln decodes (pixels): 3840 × 2160, 24 MiB of rgb24.
pub const MAX_PIXELS: u64 = 3840 * 2160;

/// What `ffprobe` says of a source's first video stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoInfo {
    pub width: u32,
    pub height: u32,
    /// Frames per second (the stream's average rate, else its base rate); 0 when
    /// the source does not say.
    pub fps: f64,
}

impl VideoInfo {
    /// Bytes of one rgb24 frame.
    pub fn frame_len(&self) -> usize {
        self.width as usize * self.height as usize * 3
    }

    /// Reads `ffprobe`'s `key=value` lines.
    pub(crate) fn parse(text: &str) -> Option<VideoInfo> {
        let (mut width, mut height, mut avg, mut base) = (None, None, 0.0, 0.0);
        for line in text.lines() {
            let Some((key, value)) = line.trim().split_once('=') else {
                continue;
            };
            match key {
                "width" => width = value.parse().ok(),
                "height" => height = value.parse().ok(),
                "avg_frame_rate" => avg = rate(value),
                "r_frame_rate" => base = rate(value),
                _ => {}
            }
        }
        let fps = if avg > 0.0 { avg } else { base };
        Some(VideoInfo {
            width: width?,
            height: height?,
            fps,
        })
    }
}

/// `30000/1001` → 29.97; `0/0` → 0.
fn rate(text: &str) -> f64 {
    let (num, den) = text.split_once('/').unwrap_or((text, "1"));
    match (num.parse::<f64>(), den.parse::<f64>()) {
        (Ok(n), Ok(d)) if d > 0.0 && n.is_finite() => n / d,
        _ => 0.0,
    }
}

/// The FFmpeg options every run over `source` takes before `-i`: the protocols and
/// demuxers it may open (no playlist or concat demuxer that would name other files
/// or hosts), no redirect, RTSP over TCP only, and a timeout on network reads.
pub(crate) fn input_options(source: &MediaSource, io_timeout: Duration) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "-protocol_whitelist".into(),
        source.protocols().into(),
        "-format_whitelist".into(),
        DEMUXERS.into(),
    ];
    if source.is_rtsp() {
        // Interleaved over the one TCP connection the relay carries: the server's
        // SDP or `Transport` cannot steer RTP to other hosts or ports. The RTSP
        // demuxer takes its socket timeout as `-timeout` (`-rw_timeout` is not
        // passed to the TCP connection it opens itself).
        args.extend(["-rtsp_transport".into(), "tcp".into()]);
        args.extend(["-timeout".into(), io_timeout.as_micros().to_string()]);
    } else if source.is_network() {
        args.push("-rw_timeout".into());
        args.push(io_timeout.as_micros().to_string());
        // A redirect could lead to a host the operator did not allow.
        args.push("-max_redirects".into());
        args.push("0".into());
    }
    args
}

/// The container formats kiln opens: common video files and RTSP. Not `hls`,
/// `dash`, `concat`, `image2`, `sdp` and the like, whose input names further files
/// or hosts.
const DEMUXERS: &str =
    "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,flv,mpegts,mpeg,ogg,nut,h264,hevc,m4v,mjpeg,asf,rtsp";

/// Runs `ffprobe` on `source`, given to it as `input` (its [`MediaSource::ffmpeg_input`],
/// or the relay's URL), killed after `timeout`. `name` is how messages name the
/// source.
pub fn probe(
    source: &MediaSource,
    input: &str,
    name: &str,
    timeout: Duration,
) -> Result<VideoInfo, MediaError> {
    let mut child = Command::new("ffprobe")
        .args(["-v", "error", "-hide_banner"])
        .args(input_options(source, timeout))
        .args([
            "-select_streams",
            "v:0",
            "-show_entries",
            "stream=width,height,avg_frame_rate,r_frame_rate",
            "-of",
            "default=noprint_wrappers=1",
            "-i",
        ])
        .arg(input)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            MediaError::Internal(format!("cannot run ffprobe (scripts/setup-ffmpeg): {e}"))
        })?;
    let mut stderr = child.stderr.take().map(StderrTail::start);
    let stdout = child.stdout.take();
    let reader = std::thread::Builder::new()
        .name("kiln-ffprobe-out".into())
        .spawn(move || {
            let mut text = String::new();
            if let Some(out) = stdout {
                let _ = out.take(64 * 1024).read_to_string(&mut text);
            }
            text
        })
        .map_err(|e| MediaError::Internal(format!("ffprobe reader thread: {e}")))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let out = reader.join().unwrap_or_default();
    let words = stderr.as_mut().map(StderrTail::finish).unwrap_or_default();
    // FFmpeg names its input by the server's path: the client knows it by its name.
    let words = words.replace(input, name);
    let Some(status) = status else {
        return Err(MediaError::Undecodable(format!(
            "cannot decode `{name}`: ffprobe gave no answer in {} s",
            timeout.as_secs()
        )));
    };
    if !status.success() {
        return Err(MediaError::Undecodable(format!(
            "cannot decode `{name}`: {}",
            if words.is_empty() {
                status.to_string()
            } else {
                words
            }
        )));
    }
    let info = VideoInfo::parse(&out).ok_or_else(|| {
        MediaError::Undecodable(format!("cannot decode `{name}`: it has no video stream"))
    })?;
    if info.width == 0
        || info.height == 0
        || u64::from(info.width) * u64::from(info.height) > MAX_PIXELS
    {
        return Err(MediaError::Undecodable(format!(
            "cannot decode `{name}`: frame size {}x{} is outside 1..={MAX_PIXELS} pixels",
            info.width, info.height
        )));
    }
    Ok(info)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_ffprobe_lines() {
        let info = VideoInfo::parse(
            "width=640\nheight=480\nr_frame_rate=30/1\navg_frame_rate=30000/1001\n",
        )
        .unwrap();
        assert_eq!((info.width, info.height), (640, 480));
        assert!((info.fps - 29.97).abs() < 0.01);
        let info =
            VideoInfo::parse("width=2\nheight=2\nr_frame_rate=25/1\navg_frame_rate=0/0").unwrap();
        assert_eq!(info.fps, 25.0);
        assert!(VideoInfo::parse("").is_none());
        assert_eq!(rate("1/0"), 0.0);
    }
}
