//! The media tests' videos and frames: generated once with FFmpeg's own sources
//! (`kiln_media::testvideo`) into the project cache, and decoded by the test
//! itself (to compare kiln's answers with) through the same `ffmpeg`.

use std::path::PathBuf;
use std::process::Command;

use crate::cache_dir;

/// The folder holding the generated test videos (`.cache/test-media`), made on
/// first use; tests pass it as `--media-dir`.
pub fn media_dir() -> PathBuf {
    let dir = cache_dir().join("test-media");
    kiln_media::testvideo::ensure(&dir)
        .unwrap_or_else(|e| panic!("generating the test videos (scripts/setup-ffmpeg): {e}"));
    dir
}

/// Every frame of the video `name` in [`media_dir`], rgb24, decoded by `ffmpeg`.
pub fn frames(name: &str) -> Vec<Vec<u8>> {
    let path = media_dir().join(name);
    let out = Command::new("ffmpeg")
        .args(["-nostdin", "-hide_banner", "-loglevel", "error", "-i"])
        .arg(&path)
        .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"])
        .output()
        .expect("run ffmpeg");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let len = (kiln_media::testvideo::WIDTH * kiln_media::testvideo::HEIGHT * 3) as usize;
    out.stdout.chunks_exact(len).map(<[u8]>::to_vec).collect()
}
