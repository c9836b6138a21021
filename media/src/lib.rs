//! Server-side video for kiln, with no HTTP and no async runtime:
//!
//! - [`source`]: what a session may name as a server-side source: a file under the
//!   operator's media folder, or a URL of a host the operator allows;
//! - [`probe`] and [`decode`]: FFmpeg's `ffprobe` (size, frame rate) and a managed
//!   `ffmpeg` subprocess that pipes raw `rgb24` frames, within a bounded number of
//!   concurrent decoders ([`decode::DecoderSlots`]), each running at most
//!   `max_duration`; an RTSP source only over TCP and through [`relay`], which
//!   connects to the allowed host alone and refuses redirects;
//! - [`det`]: text detection's image math (PP-OCR det): a frame resized to multiples
//!   of 32 and normalized into the model's NCHW `f32` input, and the boxes found in
//!   its probability map, in the frame's own pixels.

pub mod decode;
pub mod det;
mod error;
pub mod probe;
pub mod relay;
pub mod source;
mod stderr;
pub mod testrtsp;
pub mod testvideo;

pub use decode::{DecoderPermit, DecoderSlots, VideoDecoder};
pub use error::MediaError;
pub use probe::VideoInfo;
pub use source::{MediaDir, MediaSource, UrlPolicy};
