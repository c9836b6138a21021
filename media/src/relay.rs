//! The RTSP relay: FFmpeg reaches an RTSP source only through kiln, which connects
//! to the allowed host alone and refuses redirects.
//!
//! Why: FFmpeg's RTSP demuxer follows a 3xx answer to any `Location` with no
//! option to stop it (`ff_rtsp_connect`: `goto redirect`; `-max_redirects` is
//! http's), so an allowed RTSP server could send FFmpeg to any host
//! (reproduced: allowed 127.0.0.1 answered DESCRIBE with 302 to 127.0.0.2, and
//! FFmpeg sent OPTIONS there). So FFmpeg is given `rtsp://127.0.0.1:PORT/...`, a
//! listener of this relay, and with `-rtsp_transport tcp` everything it says and
//! hears (requests, answers, the interleaved RTP) passes here: each connection
//! is joined to the host the URL names (checked by [`crate::UrlPolicy`]), the
//! requests' URLs are turned back to the original authority, and an answer with
//! a 3xx status closes the connection instead of reaching FFmpeg.
//!
//! The relay parses only the framing: a `$`-framed interleaved packet (4 bytes
//! then its length) is passed as is; anything else is a message whose header
//! (at most [`MAX_HEADER`] bytes) is read whole, then its `Content-Length` body.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use url::Url;

use crate::MediaError;

/// The longest RTSP message header the relay reads.
const MAX_HEADER: usize = 64 * 1024;

/// RTSP's port when the URL names none.
const RTSP_PORT: u16 = 554;

/// What the relay's threads share.
#[derive(Debug, Default)]
struct Shared {
    stopped: AtomicBool,
    /// Why a connection was cut (a redirect), for the decoder's error.
    refusal: Mutex<Option<String>>,
    /// Every open socket, shut down when the relay stops.
    sockets: Mutex<Vec<TcpStream>>,
}

/// A running relay for one RTSP source; stopped (its sockets shut) on drop.
#[derive(Debug)]
pub struct RtspRelay {
    local: SocketAddr,
    url: Url,
    shared: Arc<Shared>,
}

impl RtspRelay {
    /// Resolves `url`'s host and listens on a loopback port for FFmpeg.
    pub fn start(url: &Url, io_timeout: Duration) -> Result<RtspRelay, MediaError> {
        let host = url
            .host_str()
            .ok_or_else(|| MediaError::Refused(format!("media URL `{url}` names no host")))?;
        let port = url.port().unwrap_or(RTSP_PORT);
        let targets: Vec<SocketAddr> = (host.trim_matches(['[', ']']), port)
            .to_socket_addrs()
            .map_err(|e| MediaError::Undecodable(format!("cannot resolve `{host}`: {e}")))?
            .collect();
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .map_err(|e| MediaError::Internal(format!("RTSP relay: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| MediaError::Internal(format!("RTSP relay: {e}")))?;
        let mut relayed = url.clone();
        relayed
            .set_host(Some("127.0.0.1"))
            .and_then(|()| {
                relayed
                    .set_port(Some(local.port()))
                    .map_err(|()| url::ParseError::InvalidPort)
            })
            .map_err(|e| MediaError::Internal(format!("RTSP relay URL: {e}")))?;
        let shared = Arc::new(Shared::default());
        let ctx = Arc::new(Conn {
            from: authority(&relayed),
            to: authority(url),
            targets,
            io_timeout,
            shared: shared.clone(),
        });
        std::thread::Builder::new()
            .name("kiln-rtsp-relay".into())
            .spawn(move || accept(listener, ctx))
            .map_err(|e| MediaError::Internal(format!("RTSP relay thread: {e}")))?;
        Ok(RtspRelay {
            local,
            url: relayed,
            shared,
        })
    }

    /// The URL FFmpeg is given: the source's, at the relay's address.
    pub fn url(&self) -> &str {
        self.url.as_str()
    }

    /// Why the relay cut a connection (a redirect it refused), if it did.
    pub fn refusal(&self) -> Option<String> {
        self.shared
            .refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for RtspRelay {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Release);
        // Wakes the accepting thread, which then sees `stopped`.
        let _ = TcpStream::connect_timeout(&self.local, Duration::from_millis(100));
        for s in self
            .shared
            .sockets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// `rtsp://host:port` of a URL, as it starts the URLs in requests.
fn authority(url: &Url) -> String {
    let port = url.port().map(|p| format!(":{p}")).unwrap_or_default();
    format!(
        "{}://{}{port}",
        url.scheme(),
        url.host_str().unwrap_or_default()
    )
}

/// One relay's settings, shared by its connections.
#[derive(Debug)]
struct Conn {
    /// The relay's authority (`rtsp://127.0.0.1:PORT`), in FFmpeg's requests.
    from: String,
    /// The source's authority, which requests are given instead.
    to: String,
    targets: Vec<SocketAddr>,
    io_timeout: Duration,
    shared: Arc<Shared>,
}

impl Conn {
    fn keep(&self, s: &TcpStream) {
        if let Ok(clone) = s.try_clone() {
            self.shared
                .sockets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(clone);
        }
    }

    fn refuse(&self, why: String) {
        *self
            .shared
            .refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(why);
    }
}

fn accept(listener: TcpListener, ctx: Arc<Conn>) {
    for client in listener.incoming() {
        if ctx.shared.stopped.load(Ordering::Acquire) {
            return;
        }
        let Ok(client) = client else { continue };
        let ctx = ctx.clone();
        let _ = std::thread::Builder::new()
            .name("kiln-rtsp-conn".into())
            .spawn(move || join(client, &ctx));
    }
}

/// Joins FFmpeg's connection `client` to the source's host: requests one way,
/// answers (checked) the other, until either side closes.
fn join(client: TcpStream, ctx: &Arc<Conn>) {
    let server = ctx
        .targets
        .iter()
        .find_map(|addr| TcpStream::connect_timeout(addr, ctx.io_timeout).ok());
    let Some(server) = server else {
        return; // FFmpeg sees the connection closed and reports it.
    };
    ctx.keep(&client);
    ctx.keep(&server);
    let (Ok(client_w), Ok(server_r)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let answers = {
        let ctx = ctx.clone();
        std::thread::Builder::new()
            .name("kiln-rtsp-answers".into())
            .spawn(move || {
                let _ = pump(server_r, &client_w, |head| check_answer(head, &ctx));
                let _ = client_w.shutdown(Shutdown::Both);
            })
    };
    let (from, to) = (ctx.from.as_bytes(), ctx.to.as_bytes());
    let _ = pump(client, &server, |head| Ok(replace(head, from, to)));
    let _ = server.shutdown(Shutdown::Both);
    if let Ok(t) = answers {
        let _ = t.join();
    }
}

/// A 3xx answer is refused (the connection is cut); others pass unchanged.
fn check_answer(head: Vec<u8>, ctx: &Conn) -> io::Result<Vec<u8>> {
    let status = head
        .strip_prefix(b"RTSP/")
        .and_then(|rest| rest.split(|&b| b == b' ').nth(1))
        .and_then(|code| std::str::from_utf8(code).ok())
        .and_then(|code| code.parse::<u16>().ok());
    if let Some(code @ 300..=399) = status {
        let text = String::from_utf8_lossy(&head);
        let location = text
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.trim()
                    .eq_ignore_ascii_case("location")
                    .then(|| value.trim().to_owned())
            })
            .unwrap_or_default();
        let location: String = location.chars().take(200).collect();
        ctx.refuse(format!(
            "the RTSP server answered {code}, a redirect to `{location}`: kiln follows no \
             RTSP redirect (it could lead to a host --media-url-allow does not name)"
        ));
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "redirect"));
    }
    Ok(head)
}

/// `head` with every `from` replaced by `to`.
fn replace(head: Vec<u8>, from: &[u8], to: &[u8]) -> Vec<u8> {
    if from.is_empty() || !head.windows(from.len()).any(|w| w == from) {
        return head;
    }
    let mut out = Vec::with_capacity(head.len() + to.len());
    let mut i = 0;
    while i < head.len() {
        if head[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(head[i]);
            i += 1;
        }
    }
    out
}

/// Copies RTSP traffic from `src` to `dst` message by message, each message's
/// header through `edit` (an error ends the copy); interleaved packets and
/// bodies pass as they are.
fn pump(
    src: TcpStream,
    mut dst: &TcpStream,
    mut edit: impl FnMut(Vec<u8>) -> io::Result<Vec<u8>>,
) -> io::Result<()> {
    let mut src = BufReader::with_capacity(64 * 1024, src);
    loop {
        let first = match src.fill_buf()? {
            [] => return Ok(()),
            buf => buf[0],
        };
        if first == b'$' {
            let mut frame = [0u8; 4];
            src.read_exact(&mut frame)?;
            let len = u16::from_be_bytes([frame[2], frame[3]]) as u64;
            dst.write_all(&frame)?;
            io::copy(&mut (&mut src).take(len), &mut dst)?;
            continue;
        }
        let head = read_head(&mut src)?;
        let body = content_length(&head);
        dst.write_all(&edit(head)?)?;
        io::copy(&mut (&mut src).take(body), &mut dst)?;
    }
}

/// A message's header, through its blank line.
fn read_head(src: &mut BufReader<TcpStream>) -> io::Result<Vec<u8>> {
    let mut head = Vec::new();
    loop {
        let n = src
            .by_ref()
            .take((MAX_HEADER - head.len()) as u64)
            .read_until(b'\n', &mut head)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if head.ends_with(b"\r\n\r\n") || head.ends_with(b"\n\n") {
            return Ok(head);
        }
        if head.len() >= MAX_HEADER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "RTSP header too long",
            ));
        }
    }
}

fn content_length(head: &[u8]) -> u64 {
    String::from_utf8_lossy(head)
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_the_source_again() {
        let head = b"DESCRIBE rtsp://127.0.0.1:4000/cam RTSP/1.0\r\nCSeq: 2\r\n\r\n".to_vec();
        let out = replace(head, b"rtsp://127.0.0.1:4000", b"rtsp://cams.example");
        assert_eq!(
            out,
            b"DESCRIBE rtsp://cams.example/cam RTSP/1.0\r\nCSeq: 2\r\n\r\n".to_vec()
        );
        assert_eq!(
            content_length(b"RTSP/1.0 200 OK\r\ncontent-length: 12\r\n\r\n"),
            12
        );
    }
}
