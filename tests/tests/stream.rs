//! WebSocket streams (docs/websocket.md) end to end: the real binary with the
//! invert-image plugin serving the example repository's `invert-video`, a real
//! WebSocket client (kiln-client's, tokio-tungstenite) on loopback, frames of a
//! video generated here.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kiln_client::stream::{raw_frame, Event, StreamClient};
use kiln_client::{ClientError, DataType};
use kiln_tests::stream::{
    frame, inversion_error, invert_video, jpeg_frame, result_image, rss_bytes, session,
    until_closed,
};
use kiln_tests::{metric, Kiln};
use serde_json::json;

/// How long any wait for the server may take before the test fails.
const BOUND: Duration = Duration::from_secs(60);

async fn next(s: &mut StreamClient) -> Event {
    tokio::time::timeout(BOUND, s.recv())
        .await
        .expect("a message in time")
        .expect("a message")
}

/// Sends `count` JPEG frames of `width`×`height`, keeping at most `window`
/// unanswered (so none is dropped), and checks each answer: in order, inverted.
async fn stream_in_order(s: &mut StreamClient, count: usize, window: usize, size: (usize, usize)) {
    let (w, h) = size;
    let mut sent = 0;
    while sent < window.min(count) {
        s.send_frame(jpeg_frame(sent, w, h)).await.unwrap();
        sent += 1;
    }
    for expected in 0..count {
        let Event::Result(r) = next(s).await else {
            panic!("frame {expected}: not a result")
        };
        assert_eq!(r.frame, expected as u64, "results come in frame order");
        if expected == 0 {
            assert_eq!(
                r.header["source"],
                json!({"width": w, "height": h, "fps": null})
            );
        } else {
            assert!(
                r.header.get("source").is_none(),
                "source only in the first result"
            );
        }
        assert_eq!(r.dropped("overrun") + r.dropped("slow_reader"), 0);
        let (rw, rh, pixels) = result_image(&r);
        assert_eq!((rw, rh), (w, h));
        assert_eq!(r.outputs[0].shape, vec![h as i64, w as i64, 3]);
        let original = frame(expected, w, h);
        let error = inversion_error(&original, &pixels);
        // Two JPEG generations (the client's at 95, the server's at 85).
        assert!(
            error < 4.0,
            "frame {expected}: mean error {error} against the inversion"
        );
        // And far from the frame itself: the pixels really were inverted.
        let not_inverted: Vec<u8> = original.iter().map(|v| 255 - v).collect();
        assert!(inversion_error(&not_inverted, &pixels) > 40.0);
        if sent < count {
            s.send_frame(jpeg_frame(sent, w, h)).await.unwrap();
            sent += 1;
        }
    }
}

#[tokio::test]
async fn three_hundred_frames_come_back_in_order_inverted() {
    let kiln = invert_video(&[]);
    let mut s = StreamClient::connect(&kiln.url, "invert-video", Some("1"))
        .await
        .unwrap();
    let opened = s
        .open(json!({"id": "video-1", "encoding": "jpeg", "max_inflight_frames": 4}))
        .await
        .unwrap();
    assert_eq!(opened["session"], "video-1");
    assert_eq!(opened["input"], "image");
    assert_eq!(opened["model_version"], "1");
    stream_in_order(&mut s, 300, 4, (160, 120)).await;
    s.close().await.unwrap();

    let text = kiln.client.metrics().await.unwrap();
    let m = [("model", "invert-video")];
    assert_eq!(metric(&text, "kiln_stream_frames_total", &m), Some(300.0));
    assert_eq!(
        metric(&text, "kiln_stream_sessions_opened_total", &m),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "kiln_stream_frame_duration_seconds_count", &m),
        Some(300.0)
    );
    let sessions =
        kiln_tests::wait_metric_until(&kiln.client, "kiln_stream_sessions", "invert-video", |v| {
            v == 0.0
        })
        .await;
    assert_eq!(sessions, 0.0);
}

#[tokio::test]
async fn raw_frames_and_binary_results_are_exact() {
    let kiln = invert_video(&[]);
    let mut s = session(
        &kiln,
        json!({"encoding": "raw", "output_format": "binary", "image_format": "raw"}),
    )
    .await;
    let (w, h) = (40, 30);
    for i in 0..3 {
        let pixels = frame(i, w, h);
        s.send_frame(raw_frame(
            DataType::Uint8,
            &[h as i64, w as i64, 3],
            &pixels,
        ))
        .await
        .unwrap();
        let Event::Result(r) = next(&mut s).await else {
            panic!("a result")
        };
        assert_eq!(r.frame, i as u64);
        let out = &r.outputs[0];
        assert_eq!(
            (out.datatype.as_str(), out.content_type.as_deref()),
            ("UINT8", None)
        );
        let inverted: Vec<u8> = pixels.iter().map(|v| 255 - v).collect();
        assert_eq!(out.bytes.as_deref(), Some(&inverted[..]));
    }
    // PNG frames too.
    let mut s = session(&kiln, json!({"encoding": "png", "image_format": "raw"})).await;
    let mut png = Vec::new();
    {
        let mut encoder = png_encoder(&mut png, 2, 1);
        encoder.write_image_data(&[0, 10, 20, 30, 40, 50]).unwrap();
    }
    s.send_frame(png).await.unwrap();
    let Event::Result(r) = next(&mut s).await else {
        panic!("a result")
    };
    assert_eq!(
        r.outputs[0].json,
        Some(json!([255, 245, 235, 225, 215, 205]))
    );
}

fn png_encoder(out: &mut Vec<u8>, w: u32, h: u32) -> png::Writer<&mut Vec<u8>> {
    let mut encoder = png::Encoder::new(out, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.write_header().unwrap()
}

#[tokio::test]
async fn a_bad_frame_gets_an_error_and_the_session_goes_on() {
    let kiln = invert_video(&[]);
    let mut s = session(&kiln, json!({})).await;
    s.send_frame(jpeg_frame(0, 64, 48)).await.unwrap();
    s.send_frame(b"not a JPEG".to_vec()).await.unwrap();
    s.send_frame(jpeg_frame(2, 64, 48)).await.unwrap();
    let Event::Result(r) = next(&mut s).await else {
        panic!("frame 0 answered")
    };
    assert_eq!(r.frame, 0);
    match next(&mut s).await {
        Event::FrameError { frame, error, .. } => {
            assert_eq!(frame, 1);
            assert!(error.contains("not a JPEG image"), "{error}");
        }
        other => panic!("frame 1 gets an error, not {other:?}"),
    }
    let Event::Result(r) = next(&mut s).await else {
        panic!("frame 2 answered after the bad one")
    };
    assert_eq!(r.frame, 2);
    let (_, _, pixels) = result_image(&r);
    assert!(inversion_error(&frame(2, 64, 48), &pixels) < 4.0);

    // Raw frames: a size that does not match the header, a datatype the model
    // does not take (refused by the core's validation, as REST would).
    let mut s = session(&kiln, json!({"encoding": "raw"})).await;
    s.send_frame(raw_frame(DataType::Uint8, &[2, 2, 3], &[0; 11]))
        .await
        .unwrap();
    s.send_frame(raw_frame(DataType::Fp32, &[1, 1, 3], &[0; 12]))
        .await
        .unwrap();
    s.send_frame(raw_frame(DataType::Uint8, &[1, 1, 3], &[1, 2, 3]))
        .await
        .unwrap();
    for (want, text) in [(0, "holds 12 bytes"), (1, "FP32")] {
        match next(&mut s).await {
            Event::FrameError { frame, error, .. } => {
                assert_eq!(frame, want);
                assert!(error.contains(text), "{error}");
            }
            other => panic!("frame {want} gets an error, not {other:?}"),
        }
    }
    let Event::Result(r) = next(&mut s).await else {
        panic!("frame 2 answered")
    };
    assert_eq!(r.outputs[0].json, None, "an image output comes as a JPEG");
    let text = kiln.client.metrics().await.unwrap();
    assert_eq!(
        metric(
            &text,
            "kiln_stream_frame_errors_total",
            &[("model", "invert-video")]
        ),
        Some(3.0)
    );
}

/// Reads `s` until the result of frame `last` (the newest result is never the
/// one dropped); returns the results read.
async fn drain_until(s: &mut StreamClient, last: u64) -> u64 {
    let mut results = 0;
    loop {
        match next(s).await {
            Event::Result(r) => {
                results += 1;
                if r.frame == last {
                    return results;
                }
            }
            other => panic!("only results expected, got {other:?}"),
        }
    }
}

/// The server's drop counts of invert-video: (`overrun`, `slow_reader`).
async fn drops(kiln: &Kiln) -> (u64, u64) {
    let text = kiln.client.metrics().await.unwrap();
    let dropped = |reason| {
        metric(
            &text,
            "kiln_stream_frames_dropped_total",
            &[("model", "invert-video"), ("reason", reason)],
        )
        .unwrap_or(0.0) as u64
    };
    (dropped("overrun"), dropped("slow_reader"))
}

#[tokio::test]
async fn a_slow_client_sees_drops_counted_and_memory_bounded() {
    let kiln = invert_video(&[]);
    let (w, h) = (640, 480);
    let data: Vec<Vec<u8>> = (0..4)
        .map(|i| raw_frame(DataType::Uint8, &[h, w, 3], &frame(i, 640, 480)))
        .collect();
    let rss_before = rss_bytes(kiln.pid());

    // A client sending faster than the model runs: 300 raw 640x480 frames
    // (264 MiB) sent without reading a result.
    let mut s = session(&kiln, json!({"encoding": "raw", "max_inflight_frames": 2})).await;
    let frames = 300;
    for i in 0..frames {
        s.send_frame(data[i % 4].clone()).await.unwrap();
    }
    let rss_fast = rss_bytes(kiln.pid());
    let results = drain_until(&mut s, frames as u64 - 1).await;
    let (overrun, slow) = drops(&kiln).await;
    assert!(
        overrun > 0,
        "frames sent faster than the model runs are dropped"
    );
    // Every frame is answered or counted dropped, once.
    assert_eq!(results + overrun + slow, frames as u64);

    // A client reading slower than results come: frames sent no faster than the
    // server answers them (as its metrics tell), results of 900 KiB (raw,
    // binary) not read until the end. Behind the session's queue of 2 are
    // actix-ws' channel of 32 messages and the socket's buffers: 80 results
    // overflow them.
    let mut s = session(
        &kiln,
        json!({"encoding": "raw", "image_format": "raw", "output_format": "binary",
               "max_inflight_frames": 2}),
    )
    .await;
    let answered = |text: &str| {
        let m = [("model", "invert-video")];
        metric(text, "kiln_stream_frame_duration_seconds_count", &m).unwrap_or(0.0)
    };
    let base = answered(&kiln.client.metrics().await.unwrap());
    let frames = 80;
    for i in 0..frames {
        s.send_frame(data[i % 4].clone()).await.unwrap();
        let deadline = std::time::Instant::now() + BOUND;
        while answered(&kiln.client.metrics().await.unwrap()) < base + i as f64 + 1.0 {
            assert!(
                std::time::Instant::now() < deadline,
                "frame {i} never answered"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let rss_slow = rss_bytes(kiln.pid());
    let results = drain_until(&mut s, frames as u64 - 1).await;
    let (overrun_after, slow_after) = drops(&kiln).await;
    assert_eq!(
        overrun_after, overrun,
        "frames were sent no faster than answered"
    );
    assert!(
        slow_after > slow,
        "results the client does not read are dropped"
    );
    assert_eq!(results + slow_after - slow, frames as u64);

    for rss in [rss_fast, rss_slow] {
        let grown = rss.saturating_sub(rss_before);
        assert!(grown < 160 << 20, "the server grew by {} MiB", grown >> 20);
    }
}

#[tokio::test]
async fn sixteen_sessions_batch_together() {
    let kiln = invert_video(&[]);
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut s = session(&kiln, json!({"max_inflight_frames": 4})).await;
        tasks.push(tokio::spawn(async move {
            stream_in_order(&mut s, 20, 4, (64, 48)).await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let text = kiln.client.metrics().await.unwrap();
    let m = [("model", "invert-video")];
    let rows = metric(&text, "kiln_batch_size_sum", &m).unwrap();
    let batches = metric(&text, "kiln_batch_size_count", &m).unwrap();
    assert_eq!(rows, 320.0);
    assert!(
        rows / batches > 1.0,
        "mean batch {} over {batches} batches",
        rows / batches
    );
    assert_eq!(
        metric(&text, "kiln_stream_sessions_opened_total", &m),
        Some(16.0)
    );
}

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
