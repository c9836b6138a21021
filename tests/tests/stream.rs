//! WebSocket streams (docs/websocket.md) end to end: the real binary with the
//! invert-image plugin serving the example repository's `invert-video`, a real
//! WebSocket client (kiln-client's, tokio-tungstenite) on loopback, frames of a
//! video generated here. The protocol's errors and close codes: `stream_protocol.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kiln_client::stream::{raw_frame, Event, StreamClient};
use kiln_client::DataType;
use kiln_tests::stream::{
    frame, inversion_error, invert_video, jpeg_frame, next, result_image, session, BOUND,
};
use kiln_tests::{metric, rss_bytes, Kiln};
use serde_json::json;

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
