//! A tiny RTSP server for tests (the media crate's and the end-to-end ones): it
//! answers each request as the test says and records what it was asked, plus a
//! listener that counts who connects to it (where a redirect points), and
//! [`streaming`]: a camera that plays a video file as Motion JPEG over RTP
//! interleaved in the RTSP connection (the packets made by FFmpeg's RTP muxer).

use std::io::{self, BufRead, BufReader, Write};
use std::net::{IpAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A request's header lines, as the server read them.
pub type Request = Vec<String>;

/// How the server answers: `(method, cseq)` → the whole answer.
pub type RtspHandler = Arc<dyn Fn(&str, &str) -> String + Send + Sync>;

/// What a connection does once an answer is written: `Some(file)` after PLAY of
/// a [`streaming`] server starts sending that file's frames.
type Play = Option<PathBuf>;

/// An RTSP server on 127.0.0.1 that runs until the test ends.
pub struct RtspServer {
    pub port: u16,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl RtspServer {
    /// Listens on a free port of 127.0.0.1 and answers with `answer`.
    pub fn start(answer: RtspHandler) -> io::Result<RtspServer> {
        RtspServer::start_playing(answer, None)
    }

    /// A camera playing `video` (in real time, as Motion JPEG over RTP on the
    /// RTSP connection) to each client that sends PLAY.
    pub fn streaming(video: &Path) -> io::Result<RtspServer> {
        RtspServer::start_playing(Arc::new(camera), Some(video.to_owned()))
    }

    fn start_playing(answer: RtspHandler, play: Play) -> io::Result<RtspServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (log, answer, play) = (log.clone(), answer.clone(), play.clone());
                std::thread::spawn(move || serve(conn, &*answer, &log, play.as_deref()));
            }
        });
        Ok(RtspServer { port, requests })
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn serve(
    conn: TcpStream,
    answer: &(dyn Fn(&str, &str) -> String + Send + Sync),
    log: &Mutex<Vec<Request>>,
    play: Option<&Path>,
) {
    let Ok(mut writer) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    loop {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end().to_owned();
            if line.is_empty() {
                break;
            }
            lines.push(line);
        }
        let method = lines
            .first()
            .and_then(|l| l.split(' ').next())
            .unwrap_or("")
            .to_owned();
        let cseq = lines
            .iter()
            .find_map(|l| l.strip_prefix("CSeq: "))
            .unwrap_or("0")
            .to_owned();
        log.lock().unwrap_or_else(|e| e.into_inner()).push(lines);
        if writer.write_all(answer(&method, &cseq).as_bytes()).is_err() {
            return;
        }
        if let (Some(video), "PLAY") = (play, method.as_str()) {
            let _ = send_rtp(video, writer);
            return;
        }
    }
}

/// The camera's answers: one Motion JPEG track, RTP over the RTSP connection.
fn camera(method: &str, cseq: &str) -> String {
    let sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=camera\r\nt=0 0\r\n\
               m=video 0 RTP/AVP 26\r\na=control:track1\r\n";
    match method {
        "OPTIONS" => options(cseq),
        "DESCRIBE" => format!(
            "RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nContent-Type: application/sdp\r\n\
             Content-Length: {}\r\n\r\n{sdp}",
            sdp.len()
        ),
        "SETUP" => format!(
            "RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nSession: 1\r\n\
             Transport: RTP/AVP/TCP;unicast;interleaved=0-1\r\n\r\n"
        ),
        _ => format!("RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nSession: 1\r\n\r\n"),
    }
}

/// Plays `video` into `out`: FFmpeg's RTP muxer sends Motion JPEG packets to a
/// UDP socket here, each forwarded as an interleaved packet on channel 0, until
/// the video ends or the client leaves.
fn send_rtp(video: &Path, mut out: TcpStream) -> io::Result<()> {
    let udp = UdpSocket::bind("127.0.0.1:0")?;
    udp.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let port = udp.local_addr()?.port();
    let mut ffmpeg = Command::new("ffmpeg")
        .args([
            "-nostdin",
            "-hide_banner",
            "-loglevel",
            "error",
            "-re",
            "-i",
        ])
        .arg(video)
        // RTP's JPEG payload (RFC 2435) wants the standard Huffman tables.
        .args([
            "-an", "-c:v", "mjpeg", "-huffman", "default", "-pix_fmt", "yuvj420p",
        ])
        .args(["-q:v", "8"])
        .args([
            "-f",
            "rtp",
            &format!("rtp://127.0.0.1:{port}?pkt_size=1400"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let mut buf = [0u8; 2048];
    let result = loop {
        let n = match udp.recv(&mut buf) {
            Ok(n) => n,
            Err(e) => break Err(e),
        };
        let len = (n as u16).to_be_bytes();
        let sent = out
            .write_all(&[b'$', 0, len[0], len[1]])
            .and_then(|()| out.write_all(&buf[..n]));
        if let Err(e) = sent {
            break Err(e);
        }
    };
    let _ = ffmpeg.kill();
    let _ = ffmpeg.wait();
    result
}

/// The answer to OPTIONS.
pub fn options(cseq: &str) -> String {
    format!("RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nPublic: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN\r\n\r\n")
}

/// A server that answers DESCRIBE (and anything after OPTIONS) with a 302 to
/// `location`.
pub fn redirecting(location: String) -> RtspHandler {
    Arc::new(move |method, cseq| match method {
        "OPTIONS" => options(cseq),
        _ => format!(
            "RTSP/1.0 302 Moved Temporarily\r\nCSeq: {cseq}\r\nLocation: {location}\r\n\r\n"
        ),
    })
}

/// A listener on `ip` that counts the connections made to it.
pub struct Trap {
    pub port: u16,
    listener: TcpListener,
    hits: AtomicUsize,
}

impl Trap {
    /// Listens on a free port of `ip` (127.0.0.2, say: another loopback host).
    pub fn start(ip: IpAddr) -> io::Result<Trap> {
        let listener = TcpListener::bind((ip, 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        Ok(Trap {
            port,
            listener,
            hits: AtomicUsize::new(0),
        })
    }

    /// Connections so far. The kernel completes a connection before anyone accepts
    /// it, so once the process that might connect has exited, every connection it
    /// made is waiting here: no time to wait for.
    pub fn hits(&self) -> usize {
        while self.listener.accept().is_ok() {
            self.hits.fetch_add(1, Ordering::SeqCst);
        }
        self.hits.load(Ordering::SeqCst)
    }
}
