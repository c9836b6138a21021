//! The test videos, generated with FFmpeg's own sources (never downloaded) and
//! cached: the media tests, the benchmark and the page's test use these.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::MediaError;

/// Frames of [`TEXT_VIDEO`]: 270 of `testsrc2` with text, then 30 blank (white).
pub const FRAMES: u32 = 300;
/// The first blank frame of [`TEXT_VIDEO`].
pub const FIRST_BLANK: u32 = 270;
/// Frame size and rate of the test videos.
pub const WIDTH: u32 = 640;
/// See [`WIDTH`].
pub const HEIGHT: u32 = 480;
/// See [`WIDTH`].
pub const FPS: u32 = 30;

/// 640 × 480 at 30 fps, H.264 in MP4 (`+faststart`, so it streams over HTTP).
pub const TEXT_VIDEO: &str = "text-640x480.mp4";
/// [`FRAMES`] blank (white) frames, same format.
pub const BLANK_VIDEO: &str = "blank-640x480.mp4";
/// A short clip for text detection (a CPU detector runs a few frames a second):
/// [`SHORT_TEXT_FRAMES`] frames at 5 fps of [`TEXT_VIDEO`]'s picture, then
/// [`SHORT_BLANK_FRAMES`] blank ones.
pub const SHORT_VIDEO: &str = "text-short-640x480.mp4";
/// See [`SHORT_VIDEO`].
pub const SHORT_TEXT_FRAMES: u32 = 10;
/// See [`SHORT_VIDEO`].
pub const SHORT_BLANK_FRAMES: u32 = 5;

/// Where [`TEXT_VIDEO`] draws its two lines of text (black on white boxes):
/// `(x0, y0, x1, y1)` of each box in frame pixels, measured on a decoded frame.
pub const TEXT_BOXES: [(u32, u32, u32, u32); 2] = [(28, 28, 382, 102), (288, 368, 552, 428)];

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Makes the test videos in `dir` unless they are there already; returns `dir`.
/// Each is written under a temporary name and renamed, so tests running at once
/// never see half a file.
pub fn ensure(dir: &Path) -> Result<PathBuf, MediaError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| MediaError::Internal(format!("{}: {e}", dir.display())))?;
    let text = |rate: u32, frames: u32| {
        format!(
            "testsrc2=s={WIDTH}x{HEIGHT}:r={rate}:d={},\
             drawtext=fontfile={FONT}:text='KILN 2026':x=40:y=40:fontsize=64:fontcolor=black:box=1:boxcolor=white:boxborderw=12,\
             drawtext=fontfile={FONT}:text='video text':x=300:y=380:fontsize=48:fontcolor=black:box=1:boxcolor=white:boxborderw=12",
            f64::from(frames) / f64::from(rate)
        )
    };
    let blank = |rate: u32, frames: u32| {
        format!(
            "color=c=white:s={WIDTH}x{HEIGHT}:r={rate}:d={}",
            f64::from(frames) / f64::from(rate)
        )
    };
    let inputs = |graphs: &[String]| -> Vec<String> {
        let mut args = Vec::new();
        for graph in graphs {
            args.extend(["-f", "lavfi", "-i", graph].map(str::to_owned));
        }
        if graphs.len() == 2 {
            args.extend(
                [
                    "-filter_complex",
                    "[0:v][1:v]concat=n=2:v=1[v]",
                    "-map",
                    "[v]",
                ]
                .map(str::to_owned),
            );
        }
        args
    };
    make(
        &dir.join(TEXT_VIDEO),
        &inputs(&[text(FPS, FIRST_BLANK), blank(FPS, FRAMES - FIRST_BLANK)]),
    )?;
    make(
        &dir.join(SHORT_VIDEO),
        &inputs(&[text(5, SHORT_TEXT_FRAMES), blank(5, SHORT_BLANK_FRAMES)]),
    )?;
    make(&dir.join(BLANK_VIDEO), &inputs(&[blank(FPS, FRAMES)]))?;
    Ok(dir.to_path_buf())
}

fn make(path: &Path, inputs: &[String]) -> Result<(), MediaError> {
    if path.is_file() {
        return Ok(());
    }
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let partial = path.with_extension(format!("part-{}-{n}.mp4", std::process::id()));
    let out = Command::new("ffmpeg")
        .args(["-nostdin", "-hide_banner", "-loglevel", "error", "-y"])
        .args(inputs)
        .args([
            "-c:v", "libx264", "-preset", "veryfast", "-crf", "18", "-pix_fmt", "yuv420p",
        ])
        .args(["-movflags", "+faststart"])
        .arg(&partial)
        .output()
        .map_err(|e| {
            MediaError::Internal(format!("cannot run ffmpeg (scripts/setup-ffmpeg): {e}"))
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(MediaError::Internal(format!(
            "generating {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    std::fs::rename(&partial, path)
        .map_err(|e| MediaError::Internal(format!("{}: {e}", path.display())))
}
