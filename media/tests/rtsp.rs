//! RTSP sources against an RTSP server written for the tests
//! ([`kiln_media::testrtsp`]: a TCP listener answering what FFmpeg asks), with
//! Debian's FFmpeg (issue 27, finding 7): a redirect from the allowed host never
//! leads FFmpeg anywhere else, and FFmpeg asks for RTP over the RTSP connection
//! (TCP), never for UDP ports a server could aim elsewhere.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kiln_media::decode::{DecodeOptions, DecodeStop};
use kiln_media::testrtsp::{self, Request, RtspServer, Trap};
use kiln_media::{testvideo, DecoderSlots, MediaError, MediaSource, UrlPolicy, VideoDecoder};

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
    let trap = Trap::start([127, 0, 0, 2].into()).unwrap();
    let location = format!("rtsp://127.0.0.2:{}/elsewhere", trap.port);
    let server = RtspServer::start(testrtsp::redirecting(location)).unwrap();
    // `open` returns once ffprobe has exited: any connection it made is queued.
    let err = open(server.port).err().expect("a redirected source opens");
    assert_eq!(
        trap.hits(),
        0,
        "FFmpeg connected to the redirect's host ({err})"
    );
    assert!(matches!(err, MediaError::Refused(_)), "{err:?}");
    assert!(err.to_string().contains("redirect"), "{err}");
    // The allowed server was asked, under its own name (the relay is invisible).
    let requests = server.requests();
    let describe = requests
        .iter()
        .find(|r| r[0].starts_with("DESCRIBE"))
        .expect("a DESCRIBE");
    let want = format!("DESCRIBE rtsp://127.0.0.1:{}/cam ", server.port);
    assert!(describe[0].starts_with(&want), "{describe:?}");
}

/// An SDP whose connection line names another host; SETUP is answered 461 (the
/// test only reads what FFmpeg asked for).
fn describing(method: &str, cseq: &str) -> String {
    let sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=cam\r\nc=IN IP4 127.0.0.3\r\nt=0 0\r\n\
               m=video 0 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\na=control:track1\r\n";
    match method {
        "OPTIONS" => testrtsp::options(cseq),
        "DESCRIBE" => format!(
            "RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nContent-Type: application/sdp\r\n\
             Content-Length: {}\r\n\r\n{sdp}",
            sdp.len()
        ),
        _ => format!("RTSP/1.0 461 Unsupported Transport\r\nCSeq: {cseq}\r\n\r\n"),
    }
}

#[test]
fn rtp_is_asked_for_over_the_rtsp_connection_only() {
    let server = RtspServer::start(Arc::new(describing)).unwrap();
    let err = open(server.port).err().expect("the server streams nothing");
    let requests = server.requests();
    let setups: Vec<&Request> = requests
        .iter()
        .filter(|r| r[0].starts_with("SETUP"))
        .collect();
    assert!(!setups.is_empty(), "no SETUP ({err}): {requests:?}");
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

/// A camera through the relay: frames of the right size arrive in real time.
#[test]
fn a_camera_streams_through_the_relay() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kiln-media-videos");
    testvideo::ensure(&dir).unwrap();
    let server = RtspServer::streaming(&dir.join(testvideo::TEXT_VIDEO)).unwrap();
    let mut decoder = open(server.port).unwrap();
    let info = decoder.info();
    assert_eq!((info.width, info.height), (640, 480), "{info:?}");
    let mut frame = Vec::new();
    for i in 0..15 {
        assert!(decoder.read_frame(&mut frame).unwrap(), "frame {i}");
        assert_eq!(frame.len(), 640 * 480 * 3);
    }
    let setup = server
        .requests()
        .into_iter()
        .find(|r| r[0].starts_with("SETUP"))
        .expect("a SETUP");
    assert!(
        setup[0].contains(&format!("127.0.0.1:{}", server.port)),
        "{setup:?}"
    );
}
