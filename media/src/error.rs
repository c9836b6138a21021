//! The media layer's errors; the server maps each to its protocol's error shape.

/// Why a server-side source was refused or could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    /// The session named a source the operator's settings refuse (a name outside
    /// the media folder, a host not allowed, no media folder configured, ...).
    #[error("{0}")]
    Refused(String),
    /// The source does not exist.
    #[error("{0}")]
    NotFound(String),
    /// FFmpeg could not open or decode the source; the message carries its words.
    #[error("{0}")]
    Undecodable(String),
    /// Every decoder slot (`--media-max-decoders`) is taken.
    #[error("all {0} media decoders are busy (--media-max-decoders); try again later")]
    Busy(usize),
    /// FFmpeg itself could not be run (not installed, ...).
    #[error("{0}")]
    Internal(String),
}
