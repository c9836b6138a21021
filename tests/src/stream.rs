//! What the WebSocket stream tests share: the invert-video server, generated
//! video frames (a moving square over a drifting gradient, made here, not
//! downloaded) and checks of inverted pixels.

use kiln_client::stream::{encode_jpeg, Event, StreamClient, StreamResult};

use crate::{repo_root, Kiln};

/// `kiln serve` with the example repository's `invert-video` loaded, and `args`.
pub fn invert_video(args: &[&str]) -> Kiln {
    let repo = repo_root().join("examples/models");
    let repo = repo.to_string_lossy().into_owned();
    let mut all = vec!["--model-repository", &repo, "--load-model", "invert-video"];
    all.extend_from_slice(args);
    Kiln::start(&all)
}

/// Frame `i` of the generated video, RGB `[height, width, 3]`: a gradient that
/// drifts with `i`, and a 24-pixel white square moving right and down.
pub fn frame(i: usize, width: usize, height: usize) -> Vec<u8> {
    let side = 24.min(width).min(height);
    let (sx, sy) = ((i * 3) % (width - side + 1), (i * 2) % (height - side + 1));
    let mut pixels = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            if (sx..sx + side).contains(&x) && (sy..sy + side).contains(&y) {
                pixels.extend_from_slice(&[255, 255, 255]);
            } else {
                pixels.extend_from_slice(&[
                    ((x + i) * 255 / (width + i)) as u8,
                    (y * 255 / height) as u8,
                    (i % 256) as u8 / 2,
                ]);
            }
        }
    }
    pixels
}

/// Frame `i` as a JPEG (quality 95).
pub fn jpeg_frame(i: usize, width: usize, height: usize) -> Vec<u8> {
    encode_jpeg(&frame(i, width, height), width as u16, height as u16, 95).expect("encode JPEG")
}

/// The mean absolute difference between `decoded` and the inversion of `original`.
pub fn inversion_error(original: &[u8], decoded: &[u8]) -> f64 {
    assert_eq!(original.len(), decoded.len(), "picture sizes differ");
    let total: u64 = original
        .iter()
        .zip(decoded)
        .map(|(o, d)| u64::from((255 - o).abs_diff(*d)))
        .sum();
    total as f64 / original.len() as f64
}

/// The result's first output decoded from its JPEG: `(width, height, pixels)`.
pub fn result_image(result: &StreamResult) -> (usize, usize, Vec<u8>) {
    let output = &result.outputs[0];
    assert_eq!(output.content_type.as_deref(), Some("image/jpeg"));
    let jpeg = output.bytes.as_ref().expect("JPEG bytes");
    kiln_client::stream::decode_jpeg(jpeg).expect("decode result JPEG")
}

/// How long a stream test waits for one message before it fails.
pub const BOUND: std::time::Duration = std::time::Duration::from_secs(60);

/// The next message of `s`, within [`BOUND`].
pub async fn next(s: &mut StreamClient) -> Event {
    tokio::time::timeout(BOUND, s.recv())
        .await
        .expect("a message in time")
        .expect("a message")
}

/// Opens an invert-video session with `open`'s settings.
pub async fn session(kiln: &Kiln, open: serde_json::Value) -> StreamClient {
    let mut s = StreamClient::connect(&kiln.url, "invert-video", None)
        .await
        .expect("connect");
    s.open(open).await.expect("open");
    s
}

/// Reads until the server closes; returns its close code and reason, and the
/// JSON messages before it.
pub async fn until_closed(s: &mut StreamClient) -> (u16, String, Vec<serde_json::Value>) {
    let mut messages = Vec::new();
    loop {
        match s.recv().await.expect("a message before the close") {
            Event::Closed { code, reason } => return (code, reason, messages),
            Event::Message(m) => messages.push(m),
            other => messages.push(serde_json::json!({"other": format!("{other:?}")})),
        }
    }
}
