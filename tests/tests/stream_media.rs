//! Server-side video over WebSocket streams (docs/websocket.md, "Server-side
//! sources"): the real `kiln` decodes the generated videos itself, from
//! `--media-dir` or an allowed URL, with a managed `ffmpeg`; frames are answered in
//! order (invert-video, checked on pixels) or turned into text boxes (ocr-det,
//! `"processing": "text_boxes"`); refused sources make no connection and open no
//! file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use kiln_client::stream::{Event, StreamClient};
use kiln_media::testvideo::{self, TEXT_BOXES};
use kiln_tests::file_server::FileServer;
use kiln_tests::media::{frames, media_dir};
use kiln_tests::{model_repository, Kiln};
use serde_json::{json, Value};

fn start(extra: &[&str]) -> Kiln {
    let repo = model_repository();
    let mut args = vec![
        "--model-repository",
        repo.to_str().unwrap(),
        "--load-model",
        "invert-video",
        "--load-model",
        "ocr-det",
    ];
    args.extend_from_slice(extra);
    Kiln::start(&args)
}

fn with_media() -> Kiln {
    start(&["--media-dir", &path_arg(&media_dir())])
}

/// Waits (at most 10 s) for `done`.
fn until(done: impl Fn() -> bool, what: &str) {
    for _ in 0..500 {
        if done() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("{what}: not within 10 s");
}

/// Opens a session with `open`; returns the client and the first answer (the
/// `opened` event, or the error message before the close).
async fn session(kiln: &Kiln, model: &str, open: Value) -> (StreamClient, Value) {
    let mut client = StreamClient::connect(&kiln.url, model, None).await.unwrap();
    client.send_text(open.to_string()).await.unwrap();
    match client.recv().await.unwrap() {
        Event::Message(m) => (client, m),
        other => panic!("the opening was answered with {other:?}"),
    }
}

/// A session refused at its opening: the error names `needle`, then the close
/// code is `code`.
async fn refused(kiln: &Kiln, source: Value, needle: &str, code: u16) {
    let (mut client, answer) = session(kiln, "invert-video", json!({"source": source})).await;
    let error = answer["error"].as_str().unwrap_or_default();
    assert!(error.contains(needle), "{source}: {answer}");
    match client.recv().await.unwrap() {
        Event::Closed { code: got, .. } => assert_eq!(got, code, "{source}: {answer}"),
        other => panic!("{source}: expected a close, got {other:?}"),
    }
}

/// The `ffmpeg` and `ffprobe` processes `pid` has as children (none once its
/// sessions are over: every decoder killed and reaped).
fn decoder_children(pid: u32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/comm"))
                .is_ok_and(|c| c.starts_with("ffmpeg") || c.starts_with("ffprobe"))
        })
        .count()
}

/// Reads a whole invert-video session of `frames` (JPEG results): every frame in
/// order, none dropped, the first reporting the source; every 5th checked on
/// pixels against the inverse of the test's own decoding of the video (on a
/// thread of its own, so that the reader keeps up); then the end and a normal
/// close.
async fn check_inverted(client: &mut StreamClient, frames: Vec<Vec<u8>>) {
    let total = frames.len();
    let (jpegs, checked) = std::sync::mpsc::channel::<(usize, bytes::Bytes)>();
    let checker = std::thread::spawn(move || {
        let mut count = 0;
        for (index, jpeg) in checked {
            let (w, h, pixels) = kiln_client::stream::decode_jpeg(&jpeg).unwrap();
            assert_eq!((w, h), (640, 480));
            let diff: u64 = pixels
                .iter()
                .zip(&frames[index])
                .map(|(&got, &src)| u64::from(got.abs_diff(255 - src)))
                .sum();
            let mean = diff as f64 / pixels.len() as f64;
            assert!(
                mean < 5.0,
                "frame {index}: mean |pixel - inverse| {mean:.1}"
            );
            count += 1;
        }
        count
    });
    let mut last = Value::Null;
    for index in 0..total {
        let result = match client.recv().await.unwrap() {
            Event::Result(r) => r,
            other => panic!("frame {index}: {other:?}"),
        };
        assert_eq!(
            result.frame, index as u64,
            "results in order: {}",
            result.header
        );
        if index == 0 {
            assert_eq!(
                result.header["source"],
                json!({"width": 640, "height": 480, "fps": 30.0})
            );
        }
        let output = &result.outputs[0];
        assert_eq!(output.content_type.as_deref(), Some("image/jpeg"));
        if index % 5 == 0 {
            jpegs.send((index, output.bytes.clone().unwrap())).unwrap();
        }
        last = result.header;
    }
    drop(jpegs);
    assert_eq!(checker.join().unwrap(), total.div_ceil(5));
    assert_eq!(
        last["dropped"],
        json!({"overrun": 0, "slow_reader": 0, "rejected": 0, "memory": 0})
    );
    match client.recv().await.unwrap() {
        Event::Message(m) => assert_eq!(
            (m["event"].as_str(), m["frames"].as_u64()),
            (Some("end"), Some(total as u64)),
            "{m}"
        ),
        other => panic!("expected the end, got {other:?}"),
    }
    match client.recv().await.unwrap() {
        Event::Closed { code, .. } => assert_eq!(code, 1000),
        other => panic!("expected a close, got {other:?}"),
    }
}

fn open_video(source: Value) -> Value {
    json!({"source": source, "max_inflight_frames": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_media_file_is_decoded_by_kiln_and_every_frame_answered_in_order() {
    let kiln = with_media();
    let frames = frames(testvideo::TEXT_VIDEO);
    assert_eq!(frames.len(), testvideo::FRAMES as usize);
    let (mut client, opened) = session(
        &kiln,
        "invert-video",
        open_video(json!({"media": testvideo::TEXT_VIDEO})),
    )
    .await;
    assert_eq!(opened["event"], "opened", "{opened}");
    check_inverted(&mut client, frames).await;
    until(
        || decoder_children(kiln.pid()) == 0,
        "the decoder is reaped",
    );
}

/// Each drawn line of text is covered by the boxes centred in its white box, which
/// stay within it (give or take 4 pixels).
fn check_text_boxes(frame: u64, boxes: &[Value]) {
    let b = |v: &Value, k: &str| v[k].as_u64().unwrap() as u32;
    for drawn in TEXT_BOXES {
        let over: Vec<(u32, u32, u32, u32)> = boxes
            .iter()
            .map(|v| (b(v, "x0"), b(v, "y0"), b(v, "x1"), b(v, "y1")))
            .filter(|&(x0, y0, x1, y1)| {
                let (cx, cy) = ((x0 + x1) / 2, (y0 + y1) / 2);
                (drawn.0..drawn.2).contains(&cx) && (drawn.1..drawn.3).contains(&cy)
            })
            .collect();
        assert!(
            !over.is_empty(),
            "frame {frame}: no box over {drawn:?}: {boxes:?}"
        );
        let x0 = over.iter().map(|o| o.0).min().unwrap();
        let y0 = over.iter().map(|o| o.1).min().unwrap();
        let x1 = over.iter().map(|o| o.2).max().unwrap();
        let y1 = over.iter().map(|o| o.3).max().unwrap();
        assert!(
            x0 + 4 >= drawn.0 && y0 + 4 >= drawn.1 && x1 <= drawn.2 + 4 && y1 <= drawn.3 + 4,
            "frame {frame}: boxes {over:?} leave the text's box {drawn:?}"
        );
        // The text itself starts 12 pixels inside its white box.
        let (text_w, text_h) = (drawn.2 - drawn.0 - 24, drawn.3 - drawn.1 - 24);
        assert!(
            (x1 - x0) * 10 >= text_w * 8 && (y1 - y0) * 10 >= text_h * 6,
            "frame {frame}: boxes {over:?} cover too little of {drawn:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_detection_finds_the_drawn_text_and_nothing_on_blank_frames() {
    let kiln = with_media();
    let open = json!({"source": {"media": testvideo::SHORT_VIDEO}, "processing": "text_boxes", "max_inflight_frames": 4});
    let (mut client, opened) = session(&kiln, "ocr-det", open).await;
    assert_eq!(opened["input"], "x", "{opened}");
    let total = testvideo::SHORT_TEXT_FRAMES + testvideo::SHORT_BLANK_FRAMES;
    for index in 0..u64::from(total) {
        let result = match client.recv().await.unwrap() {
            Event::Result(r) => r,
            other => panic!("frame {index}: {other:?}"),
        };
        assert_eq!(result.frame, index);
        assert!(
            result.outputs.is_empty(),
            "text_boxes sends boxes, not the map"
        );
        let boxes = result.header["boxes"].as_array().expect("boxes").clone();
        if index < u64::from(testvideo::SHORT_TEXT_FRAMES) {
            check_text_boxes(index, &boxes);
        } else {
            assert!(boxes.is_empty(), "blank frame {index}: {boxes:?}");
        }
    }
    match client.recv().await.unwrap() {
        Event::Message(m) => assert_eq!(m["event"], "end", "{m}"),
        other => panic!("expected the end, got {other:?}"),
    }
}

/// A media folder of its own for the refusal tests: a good video, a symlink out
/// of the folder, and a file FFmpeg cannot decode.
fn odd_folder(name: &str) -> PathBuf {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("stream-media-{name}"));
    let dir = base.join("media");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&dir).unwrap();
    let video = media_dir().join(testvideo::TEXT_VIDEO);
    std::fs::copy(&video, base.join("outside.mp4")).unwrap();
    std::fs::copy(&video, dir.join("ok.mp4")).unwrap();
    std::os::unix::fs::symlink(base.join("outside.mp4"), dir.join("escape.mp4")).unwrap();
    std::fs::write(
        dir.join("garbage.mp4"),
        b"this is not a video at all".repeat(2000),
    )
    .unwrap();
    dir
}

fn path_arg(path: &Path) -> String {
    path.to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_names_outside_the_folder_are_refused_and_undecodable_files_explained() {
    let dir = odd_folder("refusals");
    let kiln = start(&["--media-dir", &path_arg(&dir), "--media-max-decoders", "1"]);
    for (name, needle) in [
        (
            "../outside.mp4",
            "must be a relative path inside the media folder",
        ),
        (
            "/etc/passwd",
            "must be a relative path inside the media folder",
        ),
        ("escape.mp4", "leads out of the media folder"),
        ("missing.mp4", "not found in the media folder"),
    ] {
        refused(&kiln, json!({"media": name}), needle, 1008).await;
    }
    // An undecodable file: FFmpeg's own reason, and close 1011.
    refused(
        &kiln,
        json!({"media": "garbage.mp4"}),
        "garbage.mp4: Invalid data found when processing input",
        1011,
    )
    .await;
    until(|| decoder_children(kiln.pid()) == 0, "no decoder left");
    // One decoder at most: a second session is refused while the first decodes,
    // and opens once it has left.
    let (first, opened) = session(
        &kiln,
        "invert-video",
        open_video(json!({"media": "ok.mp4"})),
    )
    .await;
    assert_eq!(opened["event"], "opened", "{opened}");
    refused(
        &kiln,
        json!({"media": "ok.mp4"}),
        "all 1 media decoders are busy",
        1008,
    )
    .await;
    first.close().await.unwrap();
    until(
        || decoder_children(kiln.pid()) == 0,
        "the first session's decoder is reaped",
    );
    let (second, opened) = session(
        &kiln,
        "invert-video",
        open_video(json!({"media": "ok.mp4"})),
    )
    .await;
    assert_eq!(opened["event"], "opened", "{opened}");
    second.close().await.unwrap();
    // Without --media-dir every media name is refused.
    let bare = start(&[]);
    refused(
        &bare,
        json!({"media": testvideo::TEXT_VIDEO}),
        "no media folder (--media-dir)",
        1008,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urls_are_decoded_only_from_allowed_hosts_and_refused_before_connecting() {
    let server = FileServer::start(media_dir().join(testvideo::TEXT_VIDEO));
    let port = server.addr.port();
    let url = format!("http://127.0.0.1:{port}/{}", testvideo::TEXT_VIDEO);
    // No host allowed: refused; a host not allowed (the same server by another
    // name), another scheme: refused; none of them connected to.
    let bare = start(&[]);
    refused(
        &bare,
        json!({"url": url}),
        "allows no host (--media-url-allow)",
        1008,
    )
    .await;
    let allowed = start(&["--media-url-allow", "127.0.0.1"]);
    for (other, needle) in [
        (
            format!("http://localhost:{port}/{}", testvideo::TEXT_VIDEO),
            "host `localhost` is not allowed",
        ),
        (
            format!("ftp://127.0.0.1:{port}/x.mp4"),
            "scheme `ftp` is not one of",
        ),
        (
            "file:///etc/passwd".to_owned(),
            "scheme `file` is not one of",
        ),
    ] {
        refused(&allowed, json!({"url": other}), needle, 1008).await;
    }
    assert_eq!(server.connections(), 0, "a refused URL was connected to");
    // The allowed host: frames in order, the source's size and rate first; the
    // client then leaves mid-video, and kiln kills and reaps the decoder.
    let (mut client, opened) =
        session(&allowed, "invert-video", open_video(json!({"url": url}))).await;
    assert_eq!(opened["event"], "opened", "{opened}");
    for index in 0..30u64 {
        let result = match client.recv().await.unwrap() {
            Event::Result(r) => r,
            other => panic!("frame {index}: {other:?}"),
        };
        assert_eq!(result.frame, index);
        if index == 0 {
            assert_eq!(
                result.header["source"],
                json!({"width": 640, "height": 480, "fps": 30.0})
            );
        }
    }
    assert!(server.connections() >= 1);
    assert!(
        decoder_children(allowed.pid()) >= 1,
        "the decoder runs mid-video"
    );
    client.close().await.unwrap();
    until(
        || decoder_children(allowed.pid()) == 0,
        "the decoder is killed and reaped when the session ends",
    );
}

/// An allowed RTSP server answers DESCRIBE with a 302 to 127.0.0.2 (issue 27,
/// finding 7): the session is refused with the reason, and nothing connects to
/// 127.0.0.2 (before: FFmpeg followed and sent OPTIONS there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rtsp_redirect_does_not_leave_the_allowed_hosts() {
    use kiln_media::testrtsp::{self, RtspServer, Trap};
    let trap = Trap::start([127, 0, 0, 2].into()).unwrap();
    let location = format!("rtsp://127.0.0.2:{}/elsewhere", trap.port);
    let server = RtspServer::start(testrtsp::redirecting(location)).unwrap();
    let kiln = start(&["--media-url-allow", "127.0.0.1"]);
    let url = format!("rtsp://127.0.0.1:{}/cam", server.port);
    refused(
        &kiln,
        json!({"url": url}),
        "kiln follows no RTSP redirect",
        1008,
    )
    .await;
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r[0].starts_with("DESCRIBE")),
        "the allowed server was asked"
    );
    until(
        || decoder_children(kiln.pid()) == 0,
        "no FFmpeg is left running",
    );
    // With no FFmpeg left, any connection it made is queued at the trap.
    assert_eq!(trap.hits(), 0, "FFmpeg connected to the redirect's host");
}

/// A live camera (an RTSP server written for the tests, playing the text video
/// for 10 s) decoded by kiln through its RTSP relay: frames arrive; at
/// `--media-max-duration` (here 2 s) the decoder is stopped, the session closed
/// with 1011 and the reason, and no FFmpeg is left (issue 27, finding 7: a live
/// source held its decoder slot for as long as it sent frames).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_rtsp_source_runs_through_the_relay_until_its_longest_duration() {
    use kiln_media::testrtsp::RtspServer;
    let camera = RtspServer::streaming(&media_dir().join(testvideo::TEXT_VIDEO)).unwrap();
    let kiln = start(&[
        "--media-url-allow",
        "127.0.0.1",
        "--media-max-duration",
        "2",
    ]);
    let url = format!("rtsp://127.0.0.1:{}/cam", camera.port);
    let started = std::time::Instant::now();
    let (mut client, opened) =
        session(&kiln, "invert-video", open_video(json!({"url": url}))).await;
    assert_eq!(opened["event"], "opened", "{opened}");
    let mut results = 0;
    let error = loop {
        match client.recv().await.unwrap() {
            Event::Result(_) => results += 1,
            Event::Message(m) if m.get("error").is_some() => break m,
            other => panic!("after {results} results: {other:?}"),
        }
    };
    assert!(results > 0, "no frame came through the relay");
    let text = error["error"].as_str().unwrap();
    assert!(text.contains("--media-max-duration"), "{error}");
    match client.recv().await.unwrap() {
        Event::Closed { code, .. } => assert_eq!(code, 1011, "{error}"),
        other => panic!("expected a close, got {other:?}"),
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(9),
        "{:?}: the 10 s video played to its end",
        started.elapsed()
    );
    until(
        || decoder_children(kiln.pid()) == 0,
        "the decoder is killed and reaped",
    );
}
