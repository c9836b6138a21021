//! WebSocket streams' protocol errors (docs/websocket.md, "Errors"): close codes
//! for refused opening messages, wrong messages, oversized ones, protocol
//! violations and idle sessions; refusals before the upgrade (404, 403, 429,
//! 400). The real binary serving `invert-video`, real sockets on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::stream::{Event, StreamClient};
use kiln_client::ClientError;
use kiln_tests::stream::{invert_video, jpeg_frame, next, session, until_closed, BOUND};
use kiln_tests::Kiln;
use serde_json::json;

/// A first message (text, or binary bytes), the close code it gets, and a part
/// of the close reason.
type Case = (Result<String, Vec<u8>>, u16, &'static str);

/// Opens a stream and sends `first` as its first message (text or binary).
async fn first_message(
    kiln: &Kiln,
    first: Result<String, Vec<u8>>,
) -> (u16, String, Vec<serde_json::Value>) {
    let mut s = StreamClient::connect(&kiln.url, "invert-video", None)
        .await
        .unwrap();
    match first {
        Ok(text) => s.send_text(text).await.unwrap(),
        Err(bytes) => s.send_frame(bytes).await.unwrap(),
    }
    until_closed(&mut s).await
}

#[tokio::test]
async fn protocol_errors_close_with_their_codes() {
    let kiln = invert_video(&["--stream-max-message-bytes", "65536"]);
    let cases: Vec<Case> = vec![
        (Err(vec![1, 2, 3]), 1003, "opening text message"),
        (Ok("{not json".into()), 1007, "not JSON"),
        (Ok("[1]".into()), 1007, "JSON object"),
        (
            Ok(r#"{"colour": "red"}"#.into()),
            1008,
            "unknown field `colour`",
        ),
        (
            Ok(r#"{"input": "pixels"}"#.into()),
            1008,
            "no input `pixels`",
        ),
        (Ok(r#"{"outputs": ["x"]}"#.into()), 1008, "no output `x`"),
        (Ok(r#"{"encoding": "gif"}"#.into()), 1008, "gif"),
        (Ok(r#"{"max_inflight_frames": 17}"#.into()), 1008, "1 to 16"),
        (Ok(r#"{"jpeg_quality": 0}"#.into()), 1008, "jpeg_quality"),
        (
            Ok(r#"{"processing": "sharpen"}"#.into()),
            1008,
            "unknown processing",
        ),
        (
            Ok(r#"{"source": {"media": "clip.mp4"}}"#.into()),
            1008,
            "no media folder (--media-dir)",
        ),
        (
            Ok(r#"{"source": {"url": "http://127.0.0.1/v.mp4"}}"#.into()),
            1008,
            "allows no host (--media-url-allow)",
        ),
        (
            Ok(r#"{"source": {"file": "/etc/passwd"}}"#.into()),
            1008,
            "unknown source",
        ),
    ];
    for (first, code, text) in cases {
        let (got, reason, messages) = first_message(&kiln, first.clone()).await;
        assert_eq!(got, code, "{first:?}: {reason}");
        assert!(reason.contains(text), "{first:?}: {reason}");
        assert_eq!(messages.last().unwrap()["close_code"], code, "{messages:?}");
    }

    // After opening: a text message, and a message over the size limit.
    let mut s = session(&kiln, json!({})).await;
    s.send_text("{}".into()).await.unwrap();
    let (code, reason, _) = until_closed(&mut s).await;
    assert_eq!(code, 1003, "{reason}");
    let mut s = session(&kiln, json!({})).await;
    s.send_frame(vec![0u8; 100_000]).await.unwrap();
    let (code, reason, _) = until_closed(&mut s).await;
    assert_eq!(code, 1009, "{reason}");
}

#[tokio::test]
async fn idle_sessions_time_out() {
    let kiln = invert_video(&["--stream-idle-timeout", "0.5"]);
    let mut s = session(&kiln, json!({})).await;
    s.send_frame(jpeg_frame(0, 32, 32)).await.unwrap();
    assert!(matches!(next(&mut s).await, Event::Result(_)));
    let (code, reason, _) = until_closed(&mut s).await;
    assert_eq!((code, reason.as_str()), (1001, "idle timeout"));
    // Never opened.
    let mut s = StreamClient::connect(&kiln.url, "invert-video", None)
        .await
        .unwrap();
    let (code, _, _) = until_closed(&mut s).await;
    assert_eq!(code, 1001);
}

#[tokio::test]
async fn unknown_models_and_versions_are_refused_before_the_upgrade() {
    let kiln = invert_video(&["--stream-max-sessions", "1"]);
    for (model, version) in [("nope", None), ("invert-video", Some("7"))] {
        match StreamClient::connect(&kiln.url, model, version).await {
            Err(ClientError::Status { status, message }) => {
                assert_eq!(status, 404, "{message}");
            }
            Ok(_) => panic!("{model}: upgraded"),
            Err(e) => panic!("{model}: {e}"),
        }
    }
    // One session open: the next is refused with 429.
    let _open = session(&kiln, json!({})).await;
    match StreamClient::connect(&kiln.url, "invert-video", None).await {
        Err(ClientError::Status { status, .. }) => assert_eq!(status, 429),
        other => panic!("a second session: {:?}", other.err()),
    }
    // A plain GET (no upgrade) is a 400.
    let (status, body) = kiln_tests::http_raw(
        &kiln.url,
        "GET /v2/models/invert-video/stream HTTP/1.1\r\nHost: x\r\n\r\n",
        Vec::new(),
    )
    .await;
    assert_eq!(status, 400, "{body}");
}

/// The frames a raw socket read until the server closed it: (opcode, payload).
async fn raw_frames(tcp: &mut tokio::net::TcpStream) -> Vec<(u8, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(BOUND, tcp.read_to_end(&mut bytes)).await;
    let mut frames = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 2 {
        let (opcode, mut len, mut at) = (rest[0] & 0x0f, (rest[1] & 0x7f) as usize, 2);
        if len == 126 {
            len = u16::from_be_bytes([rest[2], rest[3]]) as usize;
            at = 4;
        }
        frames.push((opcode, rest[at..at + len].to_vec()));
        rest = &rest[at + len..];
    }
    frames
}

#[tokio::test]
async fn a_websocket_protocol_violation_closes_with_1002() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let kiln = invert_video(&[]);
    let mut tcp = tokio::net::TcpStream::connect(kiln.url.trim_start_matches("http://"))
        .await
        .unwrap();
    tcp.write_all(
        b"GET /v2/models/invert-video/stream HTTP/1.1\r\nHost: kiln\r\nUpgrade: websocket\r\n\
          Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
          Sec-WebSocket-Version: 13\r\n\r\n",
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        tcp.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    // A client's frame must be masked (RFC 6455, 5.1): this one is not.
    tcp.write_all(&[0x81, 0x02, b'{', b'}']).await.unwrap();
    let frames = raw_frames(&mut tcp).await;
    let (opcode, payload) = frames.last().expect("a close frame");
    assert_eq!(*opcode, 0x8, "{frames:?}");
    assert_eq!(u16::from_be_bytes([payload[0], payload[1]]), 1002);
}

#[tokio::test]
async fn a_restricted_inference_category_covers_streams() {
    let kiln = invert_video(&["--http-restricted-api", "inference:stream-key=open"]);
    match StreamClient::connect(&kiln.url, "invert-video", None).await {
        Err(ClientError::Status { status, message }) => assert_eq!(status, 403, "{message}"),
        other => panic!("upgraded without the header: {:?}", other.err()),
    }
}
