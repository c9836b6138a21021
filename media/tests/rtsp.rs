//! RTSP sources against an RTSP server written here (a TCP listener answering
//! what FFmpeg asks), with Debian's FFmpeg (issue 27, finding 7): a redirect from
//! the allowed host never leads FFmpeg anywhere else, and FFmpeg asks for RTP
//! over the RTSP connection (TCP), never for UDP ports a server could aim
//! elsewhere.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_media::decode::{DecodeOptions, DecodeStop};
use kiln_media::{DecoderSlots, MediaError, MediaSource, UrlPolicy, VideoDecoder};

/// A request as the fake server read it: its header lines.
type Request = Vec<String>;

/// An RTSP server on 127.0.0.1 answering each request with `answer(method,
/// cseq)`; returns its port and the requests it saw.
fn rtsp_server(answer: fn(&str, &str) -> String) -> (u16, Arc<Mutex<Vec<Request>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let log = log.clone();
            std::thread::spawn(move || serve(conn, answer, &log));
        }
    });
    (port, seen)
}

fn serve(conn: TcpStream, answer: fn(&str, &str) -> String, log: &Mutex<Vec<Request>>) {
    let mut writer = conn.try_clone().unwrap();
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
        let method = lines[0].split(' ').next().unwrap_or("").to_owned();
        let cseq = lines
            .iter()
            .find_map(|l| l.strip_prefix("CSeq: "))
            .unwrap_or("0")
            .to_owned();
        log.lock().unwrap().push(lines);
        if writer.write_all(answer(&method, &cseq).as_bytes()).is_err() {
            return;
        }
    }
}

/// Where the redirect points: a listener on 127.0.0.2 that counts connections.
fn trap() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let count = hits.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            count.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (port, hits)
}

static TRAP_PORT: AtomicUsize = AtomicUsize::new(0);

fn redirecting(method: &str, cseq: &str) -> String {
    match method {
        "OPTIONS" => format!(
            "RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nPublic: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN\r\n\r\n"
        ),
        _ => format!(
            "RTSP/1.0 302 Moved Temporarily\r\nCSeq: {cseq}\r\nLocation: rtsp://127.0.0.2:{}/elsewhere\r\n\r\n",
            TRAP_PORT.load(Ordering::SeqCst)
        ),
    }
}

/// An SDP whose connection line names another host; SETUP is answered 461 (the
/// test only reads what FFmpeg asked for).
fn describing(method: &str, cseq: &str) -> String {
    let sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=cam\r\nc=IN IP4 127.0.0.3\r\nt=0 0\r\n\
               m=video 0 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\na=control:track1\r\n";
    match method {
        "OPTIONS" => format!(
            "RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nPublic: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN\r\n\r\n"
        ),
        "DESCRIBE" => format!(
            "RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nContent-Type: application/sdp\r\nContent-Length: {}\r\n\r\n{sdp}",
            sdp.len()
        ),
        _ => format!("RTSP/1.0 461 Unsupported Transport\r\nCSeq: {cseq}\r\n\r\n"),
    }
}

fn open(port: u16) -> Result<VideoDecoder, MediaError> {
    let url = UrlPolicy::new(&["127.0.0.1"])
        .check(&format!("rtsp://127.0.0.1:{port}/cam"))
        .unwrap();
    let slots = DecoderSlots::new(1);
    VideoDecoder::open(
        &MediaSource::Url(url),
        "cam",
        slots.try_acquire().unwrap(),
        DecodeOptions {
            io_timeout: Duration::from_secs(5),
            ..DecodeOptions::default()
        },
        DecodeStop::default(),
    )
}

#[test]
fn a_redirect_from_an_allowed_rtsp_server_is_not_followed() {
    let (trap_port, hits) = trap();
    TRAP_PORT.store(trap_port.into(), Ordering::SeqCst);
    let (port, seen) = rtsp_server(redirecting);
    let err = open(port).err().expect("a redirected source opens");
    // Time for a connection FFmpeg might still make.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "FFmpeg connected to the redirect's host ({err})"
    );
    assert!(matches!(err, MediaError::Refused(_)), "{err:?}");
    assert!(err.to_string().contains("redirect"), "{err}");
    // The allowed server was asked, under its own name (the relay is invisible).
    let seen = seen.lock().unwrap();
    let describe = seen
        .iter()
        .find(|r| r[0].starts_with("DESCRIBE"))
        .expect("a DESCRIBE");
    assert!(
        describe[0].starts_with(&format!("DESCRIBE rtsp://127.0.0.1:{port}/cam ")),
        "{describe:?}"
    );
}

#[test]
fn rtp_is_asked_for_over_the_rtsp_connection_only() {
    let (port, seen) = rtsp_server(describing);
    let err = open(port).err().expect("the fake server streams nothing");
    let seen = seen.lock().unwrap();
    let setups: Vec<&Request> = seen.iter().filter(|r| r[0].starts_with("SETUP")).collect();
    assert!(!setups.is_empty(), "no SETUP ({err}): {seen:?}");
    for setup in setups {
        let transport = setup
            .iter()
            .find_map(|l| l.strip_prefix("Transport: "))
            .expect("a Transport header");
        assert!(
            transport.contains("RTP/AVP/TCP") && transport.contains("interleaved"),
            "{transport}"
        );
        assert!(!transport.contains("client_port"), "{transport}");
    }
}
