//! Server-side video sources of WebSocket sessions: the operator's settings
//! (`--media-dir`, `--media-url-allow`, `--media-max-decoders`), a session's source
//! checked against them, and its frames decoded by a managed `ffmpeg`
//! (`kiln_media`). The image math of text detection is `kiln_media::det`.

use std::path::PathBuf;
use std::time::Duration;

use kiln_media::decode::{DecodeOptions, DecodeStop};
pub use kiln_media::det::{TextBox, TextDetection};
use kiln_media::{DecoderSlots, MediaDir, MediaSource, UrlPolicy, VideoDecoder};
pub use kiln_media::{MediaError, VideoInfo};

/// Decoders running at once by default (`--media-max-decoders`).
pub const DEFAULT_MAX_DECODERS: usize = 16;

/// The operator's media settings, as the flags give them.
#[derive(Debug, Clone, Default)]
pub struct MediaConfig {
    /// The only folder media files are read from; `None`: file sources refused.
    pub dir: Option<PathBuf>,
    /// Hosts whose http, https and rtsp URLs may be decoded; empty: URLs refused.
    pub url_allow: Vec<String>,
    /// Decoders running at once; a session beyond is refused (0: the default).
    pub max_decoders: usize,
    /// Network reads (and `ffprobe`) time out after this (zero: 10 s).
    pub io_timeout: Duration,
}

/// What a session names as its server-side source.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceSpec {
    /// A file name relative to the media folder.
    File(String),
    /// An http, https or rtsp URL.
    Url(String),
}

/// The server's media settings, checked at start.
#[derive(Debug, Clone)]
pub struct Media {
    dir: Option<MediaDir>,
    urls: UrlPolicy,
    slots: DecoderSlots,
    io_timeout: Duration,
}

impl Default for Media {
    fn default() -> Self {
        Media {
            dir: None,
            urls: UrlPolicy::default(),
            slots: DecoderSlots::new(DEFAULT_MAX_DECODERS),
            io_timeout: Duration::from_secs(10),
        }
    }
}

impl Media {
    /// Checks the settings (the media folder must exist).
    pub fn new(config: &MediaConfig) -> Result<Media, MediaError> {
        let dir = config.dir.as_deref().map(MediaDir::new).transpose()?;
        let max = if config.max_decoders == 0 {
            DEFAULT_MAX_DECODERS
        } else {
            config.max_decoders
        };
        Ok(Media {
            dir,
            urls: UrlPolicy::new(&config.url_allow),
            slots: DecoderSlots::new(max),
            io_timeout: if config.io_timeout.is_zero() {
                Duration::from_secs(10)
            } else {
                config.io_timeout
            },
        })
    }

    /// The checked source `spec` names, and how messages name it. Nothing is
    /// opened or connected to.
    pub fn resolve(&self, spec: &SourceSpec) -> Result<(MediaSource, String), MediaError> {
        match spec {
            SourceSpec::File(name) => {
                let dir = self.dir.as_ref().ok_or_else(|| {
                    MediaError::Refused(
                        "media files are refused: the server has no media folder (--media-dir)"
                            .into(),
                    )
                })?;
                Ok((MediaSource::File(dir.resolve(name)?), name.clone()))
            }
            SourceSpec::Url(text) => {
                let url = self.urls.check(text)?;
                let name = url.as_str().to_owned();
                Ok((MediaSource::Url(url), name))
            }
        }
    }

    /// Decoders running now.
    pub fn decoders_in_use(&self) -> usize {
        self.slots.in_use()
    }

    /// Opens `spec`: checked (nothing is opened or connected to before), given a
    /// decoder slot (refused at once when none is free), probed and started.
    /// Blocks while FFmpeg probes the source (up to the I/O timeout).
    pub fn open(&self, spec: &SourceSpec) -> Result<VideoDecoder, MediaError> {
        let (source, name) = self.resolve(spec)?;
        let permit = self.slots.try_acquire()?;
        let options = DecodeOptions {
            io_timeout: self.io_timeout,
            realtime: false,
        };
        VideoDecoder::open(&source, &name, permit, options, DecodeStop::default())
    }
}
