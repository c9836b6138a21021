//! Where a session's frames come from.
//!
//! By default the client sends them (binary messages, decoded by the session:
//! [`super::frame`]). A session
//! may instead name a server-side source in its opening message ([`SourceSpec`]:
//! a media file or a URL); kiln then reads it through a [`SourceOpener`] the
//! operator's configuration provides ([`super::StreamConfig::sources`]), which
//! checks the name against what the operator allows and opens a [`FrameSource`].
//! A session's source is read on a thread of its own (`session.rs`), so
//! [`FrameSource::next_frame`] may block on a decoder.
//!
//! Without an opener every server-side source is refused with
//! [`SourceError::NotEnabled`].

use std::sync::Arc;

use serde_json::{Map, Value};

use super::image::Rgb;

/// A server-side source named by a session's opening message (`"source"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    /// `{"media": "NAME"}`: a file under the operator's media folder.
    Media(String),
    /// `{"url": "..."}`: a video kiln fetches, from a host the operator allows.
    Url(String),
}

impl SourceSpec {
    /// Parses the `"source"` object: exactly one of `media` or `url`, a non-empty
    /// string (whether it is allowed is the opener's to say).
    pub fn parse(value: &Value) -> Result<SourceSpec, String> {
        let object: &Map<String, Value> = value
            .as_object()
            .ok_or_else(|| format!("`source` must be an object, got {value}"))?;
        let mut fields = object.iter();
        let (key, value) = match (fields.next(), fields.next()) {
            (Some(field), None) => field,
            _ => return Err("`source` must have exactly one field: `media` or `url`".to_owned()),
        };
        let text = match value.as_str() {
            Some(s) if !s.is_empty() && s.len() <= 4096 => s.to_owned(),
            _ => {
                return Err(format!(
                    "`source.{key}` must be a non-empty string of at most 4096 bytes"
                ))
            }
        };
        match key.as_str() {
            "media" => Ok(SourceSpec::Media(text)),
            "url" => Ok(SourceSpec::Url(text)),
            other => Err(format!(
                "unknown source `{other}`: a source is `media` or `url`"
            )),
        }
    }
}

/// What a source tells of its frames (reported in the session's first result).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourceInfo {
    pub width: usize,
    pub height: usize,
    /// Frames per second, when the source knows it.
    pub fps: Option<f64>,
}

/// Why a source could not be opened or read.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// No opener is configured: the server reads no server-side sources.
    #[error("server-side sources are not enabled")]
    NotEnabled,
    /// The source names something the operator does not allow (a path leaving
    /// the media folder, a host not allowed): the session is refused (1008).
    #[error("{0}")]
    Refused(String),
    /// The source could not be opened or decoded (1011).
    #[error("{0}")]
    Failed(String),
}

/// A server-side source of decoded frames (a video file, a stream at a URL).
/// Called from the session's source thread only.
pub trait FrameSource: Send {
    /// The frames' size and rate.
    fn info(&self) -> SourceInfo;

    /// The next frame (blocking until it is decoded); `Ok(None)` at the end.
    fn next_frame(&mut self) -> Result<Option<Rgb>, SourceError>;

    /// Whether the source runs in real time (a camera): its frames are dropped,
    /// oldest first, when the model falls behind, as a client's are. A file
    /// (`false`) is read no faster than the model answers.
    fn is_live(&self) -> bool {
        false
    }
}

/// Opens the server-side sources a session names. The operator's settings (the
/// media folder, the allowed hosts) live in the implementation.
pub trait SourceOpener: Send + Sync {
    /// Opens `spec` for a session, or refuses it. Runs on a blocking thread.
    fn open(&self, spec: &SourceSpec) -> Result<Box<dyn FrameSource>, SourceError>;
}

/// Opens `spec` with `opener`, or refuses it when there is none.
pub fn open(
    opener: Option<&Arc<dyn SourceOpener>>,
    spec: &SourceSpec,
) -> Result<Box<dyn FrameSource>, SourceError> {
    match opener {
        Some(opener) => opener.open(spec),
        None => Err(SourceError::NotEnabled),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_source_is_one_of_media_or_url() {
        assert_eq!(
            SourceSpec::parse(&json!({"media": "clip.mp4"})).unwrap(),
            SourceSpec::Media("clip.mp4".into())
        );
        assert_eq!(
            SourceSpec::parse(&json!({"url": "http://127.0.0.1/v.mp4"})).unwrap(),
            SourceSpec::Url("http://127.0.0.1/v.mp4".into())
        );
        for bad in [
            json!("clip.mp4"),
            json!({}),
            json!({"media": "a", "url": "b"}),
            json!({"file": "a"}),
            json!({"media": ""}),
            json!({"media": 3}),
        ] {
            assert!(SourceSpec::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn without_an_opener_sources_are_not_enabled() {
        let e = open(None, &SourceSpec::Media("clip.mp4".into()))
            .err()
            .unwrap();
        assert_eq!(e.to_string(), "server-side sources are not enabled");
    }
}
