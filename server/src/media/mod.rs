//! Server-side video sources of WebSocket sessions: the operator's settings
//! (`--media-dir`, `--media-url-allow`, `--media-max-decoders`,
//! `--media-max-duration`), a session's source
//! checked against them, and its frames decoded by a managed `ffmpeg`
//! (`kiln_media`). The image math of text detection is `kiln_media::det`.

pub mod text;

use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;

use clap::Args;
use kiln_media::decode::{DecodeOptions, DecodeStop};
use kiln_media::{DecoderSlots, MediaDir, MediaSource, UrlPolicy, VideoDecoder};
pub use kiln_media::{MediaError, VideoInfo};

use crate::stream::image::Rgb;
use crate::stream::source::{FrameSource, SourceError, SourceInfo, SourceOpener, SourceSpec};

/// Server-side video sources (docs/websocket.md, "Server-side sources").
#[derive(Args, Debug, Clone)]
pub struct MediaArgs {
    /// The folder whose video files stream sessions may name (`{"media": NAME}`,
    /// a path relative to it that stays inside it); none: file sources refused.
    #[arg(long, env = "KILN_MEDIA_DIR")]
    pub media_dir: Option<PathBuf>,
    /// A host whose http, https and rtsp URLs stream sessions may name
    /// (`{"url": ...}`; repeatable; env: `,`-separated); none: URLs refused.
    #[arg(
        long = "media-url-allow",
        env = "KILN_MEDIA_URL_ALLOW",
        value_delimiter = ','
    )]
    pub media_url_allow: Vec<String>,
    /// FFmpeg decoders running at once, server-wide; a session beyond is refused.
    #[arg(long, env = "KILN_MEDIA_MAX_DECODERS", default_value_t = DEFAULT_MAX_DECODERS)]
    pub media_max_decoders: usize,
    /// Seconds FFmpeg waits on a URL source's network reads (and `ffprobe`'s
    /// answer) before it fails.
    #[arg(long, env = "KILN_MEDIA_IO_TIMEOUT", default_value_t = 10.0)]
    pub media_io_timeout: f64,
    /// Seconds a session's server-side source may run before its decoder is
    /// stopped and its slot given back (a live camera never ends by itself);
    /// 0: no limit.
    #[arg(long, env = "KILN_MEDIA_MAX_DURATION", default_value_t = DEFAULT_MAX_DURATION_S)]
    pub media_max_duration: f64,
}

impl MediaArgs {
    /// The opener the flags give, for `StreamConfig::sources`.
    pub fn opener(&self) -> Result<Arc<dyn SourceOpener>, String> {
        let io_timeout = Duration::try_from_secs_f64(self.media_io_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                format!(
                    "--media-io-timeout {}: a positive number of seconds",
                    self.media_io_timeout
                )
            })?;
        let s = self.media_max_duration;
        let max_duration = Duration::try_from_secs_f64(s)
            .map_err(|_| format!("--media-max-duration {s}: seconds, 0 or more"))?;
        let max_duration = (!max_duration.is_zero()).then_some(max_duration);
        if self.media_max_decoders == 0 {
            return Err("--media-max-decoders 0: at least 1".into());
        }
        let media = Media::new(&MediaConfig {
            dir: self.media_dir.clone(),
            url_allow: self.media_url_allow.clone(),
            max_decoders: self.media_max_decoders,
            io_timeout,
            max_duration,
        })
        .map_err(|e| format!("--media-dir: {e}"))?;
        Ok(Arc::new(media))
    }
}

/// Decoders running at once by default (`--media-max-decoders`).
pub const DEFAULT_MAX_DECODERS: usize = 16;

/// How long a server-side source runs at most by default (`--media-max-duration`):
/// ten minutes, after which a camera's session ends and the client opens another.
pub const DEFAULT_MAX_DURATION_S: f64 = 600.0;

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
    /// A decoder is stopped after this long (`None`: never).
    pub max_duration: Option<Duration>,
}

/// The server's media settings, checked at start.
#[derive(Debug, Clone)]
pub struct Media {
    dir: Option<MediaDir>,
    urls: UrlPolicy,
    slots: DecoderSlots,
    io_timeout: Duration,
    max_duration: Option<Duration>,
}

impl Default for Media {
    fn default() -> Self {
        Media {
            dir: None,
            urls: UrlPolicy::default(),
            slots: DecoderSlots::new(DEFAULT_MAX_DECODERS),
            io_timeout: Duration::from_secs(10),
            max_duration: Some(Duration::from_secs_f64(DEFAULT_MAX_DURATION_S)),
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
            max_duration: config.max_duration,
        })
    }

    /// The checked source `spec` names, and how messages name it. Nothing is
    /// opened or connected to.
    pub fn resolve(&self, spec: &SourceSpec) -> Result<(MediaSource, String), MediaError> {
        match spec {
            SourceSpec::Media(name) => {
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
    pub fn open_decoder(&self, spec: &SourceSpec) -> Result<VideoDecoder, MediaError> {
        let (source, name) = self.resolve(spec)?;
        let permit = self.slots.try_acquire()?;
        let options = DecodeOptions {
            io_timeout: self.io_timeout,
            realtime: false,
            max_duration: self.max_duration,
        };
        VideoDecoder::open(&source, &name, permit, options, DecodeStop::default())
    }
}

impl SourceOpener for Media {
    fn open(&self, spec: &SourceSpec) -> Result<Box<dyn FrameSource>, SourceError> {
        let live = matches!(spec, SourceSpec::Url(url)
            if url.get(..5).is_some_and(|s| s.eq_ignore_ascii_case("rtsp:")));
        match self.open_decoder(spec) {
            Ok(decoder) => Ok(Box::new(VideoSource { decoder, live })),
            Err(e @ (MediaError::Undecodable(_) | MediaError::Internal(_))) => {
                Err(SourceError::Failed(e.to_string()))
            }
            Err(e) => Err(SourceError::Refused(e.to_string())),
        }
    }
}

/// A session's decoded video: FFmpeg's frames as pictures.
struct VideoSource {
    decoder: VideoDecoder,
    /// An RTSP stream runs in real time; a file (also over HTTP) is read as fast
    /// as the model answers.
    live: bool,
}

impl FrameSource for VideoSource {
    fn info(&self) -> SourceInfo {
        let info = self.decoder.info();
        SourceInfo {
            width: info.width as usize,
            height: info.height as usize,
            fps: (info.fps > 0.0).then_some(info.fps),
        }
    }

    fn next_frame(&mut self) -> Result<Option<Rgb>, SourceError> {
        let mut pixels = Vec::new();
        match self.decoder.read_frame(&mut pixels) {
            Ok(true) => {
                let info = self.decoder.info();
                Rgb::new(info.width as usize, info.height as usize, pixels)
                    .map(Some)
                    .map_err(SourceError::Failed)
            }
            Ok(false) => Ok(None),
            Err(e) => Err(SourceError::Failed(e.to_string())),
        }
    }

    fn is_live(&self) -> bool {
        self.live
    }
}
