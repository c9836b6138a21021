//! What a session may name as a server-side source. Clients control data, operators
//! control the machine: a file is a name under the operator's media folder
//! (`--media-dir`), a URL is one of a host the operator allows
//! (`--media-url-allow`), checked here before FFmpeg connects anywhere.

use std::path::{Component, Path, PathBuf};

use url::Url;

use crate::MediaError;

/// Longest media name or URL a session may send.
const MAX_NAME_LEN: usize = 4096;

/// The operator's media folder: the only files a session may name.
#[derive(Debug, Clone)]
pub struct MediaDir {
    root: PathBuf,
}

impl MediaDir {
    /// The folder, resolved once (its own symlinks followed): names are checked
    /// against this real path.
    pub fn new(root: &Path) -> Result<MediaDir, MediaError> {
        let root = root
            .canonicalize()
            .map_err(|e| MediaError::Internal(format!("media folder {}: {e}", root.display())))?;
        if !root.is_dir() {
            return Err(MediaError::Internal(format!(
                "media folder {} is not a folder",
                root.display()
            )));
        }
        Ok(MediaDir { root })
    }

    /// The folder's real path.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The real path of the file `name` names in the folder. Refused: an empty or
    /// absolute name, one with `..`, `.` or a NUL, and one whose real path (symlinks
    /// followed) leaves the folder; a name that is not a file is not found.
    pub fn resolve(&self, name: &str) -> Result<PathBuf, MediaError> {
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(MediaError::Refused(format!(
                "media name `{}` is empty, too long or holds a NUL",
                shorten(name)
            )));
        }
        let path = Path::new(name);
        if !path.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(MediaError::Refused(format!(
                "media name `{}` must be a relative path inside the media folder (no `..`, `.` or leading `/`)",
                shorten(name)
            )));
        }
        let joined = self.root.join(path);
        let real = joined.canonicalize().map_err(|_| {
            MediaError::NotFound(format!(
                "media `{}` not found in the media folder",
                shorten(name)
            ))
        })?;
        if !real.starts_with(&self.root) {
            return Err(MediaError::Refused(format!(
                "media name `{}` leads out of the media folder",
                shorten(name)
            )));
        }
        if !real.is_file() {
            return Err(MediaError::NotFound(format!(
                "media `{}` is not a file in the media folder",
                shorten(name)
            )));
        }
        Ok(real)
    }
}

/// The hosts whose URLs kiln may decode (`--media-url-allow`), none by default.
#[derive(Debug, Clone, Default)]
pub struct UrlPolicy {
    hosts: Vec<String>,
}

/// URL schemes kiln decodes.
pub const URL_SCHEMES: [&str; 3] = ["http", "https", "rtsp"];

impl UrlPolicy {
    /// A policy allowing exactly `hosts` (names or IP addresses; any port;
    /// compared without regard to case, IPv6 with or without brackets).
    pub fn new<S: AsRef<str>>(hosts: &[S]) -> UrlPolicy {
        UrlPolicy {
            hosts: hosts.iter().map(|h| normalize_host(h.as_ref())).collect(),
        }
    }

    /// Whether any host is allowed.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The parsed URL when its scheme is http, https or rtsp and its host is
    /// allowed; otherwise why not. Nothing is connected to.
    pub fn check(&self, text: &str) -> Result<Url, MediaError> {
        if text.len() > MAX_NAME_LEN {
            return Err(MediaError::Refused("media URL is too long".into()));
        }
        let url = Url::parse(text)
            .map_err(|e| MediaError::Refused(format!("media URL `{}`: {e}", shorten(text))))?;
        if !URL_SCHEMES.contains(&url.scheme()) {
            return Err(MediaError::Refused(format!(
                "media URL scheme `{}` is not one of http, https, rtsp",
                url.scheme()
            )));
        }
        let host = url.host_str().map(normalize_host).ok_or_else(|| {
            MediaError::Refused(format!("media URL `{}` names no host", shorten(text)))
        })?;
        if self.hosts.is_empty() {
            return Err(MediaError::Refused(
                "media URLs are refused: the operator allows no host (--media-url-allow)".into(),
            ));
        }
        if !self.hosts.contains(&host) {
            return Err(MediaError::Refused(format!(
                "media URL host `{host}` is not allowed (--media-url-allow)"
            )));
        }
        Ok(url)
    }
}

fn normalize_host(host: &str) -> String {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// A name cut for an error message.
fn shorten(text: &str) -> &str {
    match text.char_indices().nth(200) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

/// A server-side source, checked: the only values FFmpeg is given.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaSource {
    /// A file's real path inside the media folder.
    File(PathBuf),
    /// A URL of an allowed host.
    Url(Url),
}

impl MediaSource {
    /// FFmpeg's input argument: `file:` before a path, so no part of a file name
    /// is read as a protocol.
    pub fn ffmpeg_input(&self) -> String {
        match self {
            MediaSource::File(path) => format!("file:{}", path.display()),
            MediaSource::Url(url) => url.as_str().to_owned(),
        }
    }

    /// FFmpeg's protocols for this source (`-protocol_whitelist`): a file opens no
    /// network protocol, a URL only those of its scheme; RTSP runs over TCP only
    /// (`-rtsp_transport tcp`), so no `rtp`/`udp` an SDP or `Transport` answer
    /// could aim at another host.
    pub fn protocols(&self) -> &'static str {
        match self {
            MediaSource::File(_) => "file",
            MediaSource::Url(url) if url.scheme() == "rtsp" => "rtsp,tcp",
            MediaSource::Url(_) => "http,https,tls,tcp",
        }
    }

    /// Whether FFmpeg reads it over the network.
    pub fn is_network(&self) -> bool {
        matches!(self, MediaSource::Url(_))
    }

    /// Whether it is an RTSP URL (read through [`crate::relay`]).
    pub fn is_rtsp(&self) -> bool {
        matches!(self, MediaSource::Url(url) if url.scheme() == "rtsp")
    }

    /// How the source is named in messages: a file by its name in the folder.
    pub fn display_name(&self, dir: Option<&MediaDir>) -> String {
        match (self, dir) {
            (MediaSource::File(path), Some(dir)) => path
                .strip_prefix(dir.root())
                .unwrap_or(path)
                .display()
                .to_string(),
            (MediaSource::File(path), None) => path.display().to_string(),
            (MediaSource::Url(url), _) => url.as_str().to_owned(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn folder() -> (PathBuf, MediaDir) {
        let base = std::env::temp_dir().join(format!("kiln-media-src-{}", std::process::id()));
        let root = base.join("media");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("a.mp4"), b"x").unwrap();
        std::fs::write(root.join("sub/b.mp4"), b"x").unwrap();
        std::fs::write(base.join("secret.mp4"), b"x").unwrap();
        let _ = std::os::unix::fs::symlink(base.join("secret.mp4"), root.join("out.mp4"));
        let _ = std::os::unix::fs::symlink(root.join("a.mp4"), root.join("in.mp4"));
        let dir = MediaDir::new(&root).unwrap();
        (base, dir)
    }

    #[test]
    fn names_inside_the_folder_resolve_and_others_are_refused() {
        let (_base, dir) = folder();
        assert!(dir.resolve("a.mp4").unwrap().ends_with("media/a.mp4"));
        assert!(dir.resolve("sub/b.mp4").is_ok());
        assert!(dir.resolve("in.mp4").unwrap().ends_with("media/a.mp4"));
        for name in [
            "../secret.mp4",
            "sub/../a.mp4",
            "/etc/passwd",
            "./a.mp4",
            "",
            "a\0b",
        ] {
            assert!(
                matches!(dir.resolve(name), Err(MediaError::Refused(_))),
                "{name:?}"
            );
        }
        let escape = dir.resolve("out.mp4").unwrap_err().to_string();
        assert!(escape.contains("leads out of the media folder"), "{escape}");
        assert!(matches!(
            dir.resolve("none.mp4"),
            Err(MediaError::NotFound(_))
        ));
        assert!(matches!(dir.resolve("sub"), Err(MediaError::NotFound(_))));
    }

    #[test]
    fn urls_need_an_allowed_host_and_scheme() {
        let none = UrlPolicy::default();
        let err = none
            .check("http://127.0.0.1/a.mp4")
            .unwrap_err()
            .to_string();
        assert!(err.contains("allows no host"), "{err}");
        let policy = UrlPolicy::new(&["127.0.0.1", "Cams.Example", "[::1]"]);
        assert!(policy.check("http://127.0.0.1:8080/a.mp4").is_ok());
        assert!(policy.check("rtsp://cams.example/live").is_ok());
        assert!(policy.check("https://CAMS.example./x").is_ok());
        assert!(policy.check("http://[::1]:9/x").is_ok());
        for bad in [
            "http://127.0.0.2/a.mp4",
            "http://evil.example/a.mp4",
            "http://127.0.0.1.evil.example/",
            "file:///etc/passwd",
            "ftp://127.0.0.1/a",
            "not a url",
            "http://user@evil.example/",
        ] {
            assert!(
                matches!(policy.check(bad), Err(MediaError::Refused(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn ffmpeg_gets_a_file_protocol_path_and_only_the_scheme_protocols() {
        let file = MediaSource::File(PathBuf::from("/m/a:b.mp4"));
        assert_eq!(file.ffmpeg_input(), "file:/m/a:b.mp4");
        assert_eq!(file.protocols(), "file");
        let url = MediaSource::Url(Url::parse("rtsp://h/x").unwrap());
        assert_eq!(url.protocols(), "rtsp,tcp");
    }
}
