//! Decode rate of the managed `ffmpeg` subprocess (rgb24 through a pipe) on the
//! generated 640 × 480 test video, for docs/websocket.md's "Decoding":
//!
//! ```text
//! cargo run --release -p kiln-media --example decode_fps [ROUNDS]
//! ```
//!
//! The in-process comparison (the same libavcodec decode and swscale conversion to
//! rgb24, no pipe) is `ffmpeg -threads 1 -i VIDEO -pix_fmt rgb24 -f null -`.

use std::time::Instant;

use kiln_media::decode::{DecodeOptions, DecodeStop};
use kiln_media::{testvideo, DecoderSlots, MediaDir, MediaSource, VideoDecoder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args().nth(1).map_or(Ok(5), |a| a.parse())?;
    let dir = std::env::temp_dir().join("kiln-media-videos");
    testvideo::ensure(&dir)?;
    let media = MediaDir::new(&dir)?;
    let source = MediaSource::File(media.resolve(testvideo::TEXT_VIDEO)?);
    let slots = DecoderSlots::new(1);
    let mut frame = Vec::new();
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        let mut decoder = VideoDecoder::open(
            &source,
            testvideo::TEXT_VIDEO,
            slots.try_acquire()?,
            DecodeOptions::default(),
            DecodeStop::default(),
        )?;
        let mut frames = 0u32;
        let mut sum = 0u64;
        while decoder.read_frame(&mut frame)? {
            frames += 1;
            sum += u64::from(frame[frames as usize % frame.len()]);
        }
        let secs = start.elapsed().as_secs_f64();
        rates.push(f64::from(frames) / secs);
        println!(
            "{frames} frames in {secs:.3} s (probe and start included): {:.0} fps (checksum {sum})",
            rates[rates.len() - 1]
        );
    }
    rates.sort_by(f64::total_cmp);
    println!("median {:.0} fps", rates[rates.len() / 2]);
    Ok(())
}
