//! The video page (`GET /ui/video`) in real headless Chromium from Debian, driven
//! over WebDriver: the fake camera plays a video FFmpeg generated, the page streams
//! its frames to the real `kiln` binary over the model's WebSocket, and the test
//! reads what the page drew (the result canvas's pixels) and the numbers it shows.
//! A screenshot is left in `target/test-output/`.

// Test support: a failed step fails the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use kiln_media::testvideo;
use kiln_tests::browser::{browser_available, fake_camera_video, Browser, TEXT_BAND};
use kiln_tests::Kiln;
use serde_json::{json, Value};

/// The page's three files are served from the binary, with their types; another
/// method is 405, as on every route.
#[tokio::test]
async fn page_files_are_served() {
    let kiln = Kiln::start(&[]);
    for (path, content_type, needle) in [
        ("/ui/video", "text/html; charset=utf-8", "/ui/video.js"),
        (
            "/ui/video.js",
            "text/javascript; charset=utf-8",
            "new WebSocket(",
        ),
        ("/ui/video.css", "text/css; charset=utf-8", "canvas"),
    ] {
        let r = reqwest::get(format!("{}{path}", kiln.url)).await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.headers()["content-type"], content_type, "{path}");
        let csp = r.headers()["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("connect-src 'self'"), "{path}: {csp}");
        assert!(r.text().await.unwrap().contains(needle), "{path}");
    }
    let r = reqwest::Client::new()
        .post(format!("{}/ui/video", kiln.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
}

/// The page lists the server's models, starts the (fake) camera and streams it:
/// each frame comes back inverted and the page reports a frame rate. Asked for
/// one frame in flight (`?inflight=1`), it sends the next frame only once the last
/// is answered: the camera's 15 frames a second come faster than a debug build
/// answers them, so a page that sent them all would have the server drop some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webcam_frames_come_back_inverted() {
    let test = "webcam_frames_come_back_inverted";
    let Some((kiln, browser)) = open(test, "invert-video", "&inflight=1", &[]).await else {
        return;
    };
    choose_source(&browser, "webcam", "").await;
    wait_for_answers(&browser, &kiln, 10).await;
    let shot = browser.screenshot("video_page.png").await;
    let pixels = compare_canvases(&browser, 320).await;
    let shown = page_text(&browser).await;
    browser.close().await;
    assert_inverted(&pixels, &shot);
    assert_eq!(shown["dropped"], json!("0"), "{shown}");
    assert_eq!(shown["peak_inflight"], json!("1"), "{shown}");
}

/// The page finds text in the camera's frames with PP-OCR det (`ocr-det`, the
/// `text_boxes` processing it picks for a float image input) and draws the boxes
/// kiln returns over the frame: a box over the line of text the video draws,
/// green on the result canvas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webcam_text_gets_boxes() {
    let Some((kiln, browser)) = open("webcam_text_gets_boxes", "ocr-det", "", &[]).await else {
        return;
    };
    choose_source(&browser, "webcam", "").await;
    wait_for_answers(&browser, &kiln, 5).await;
    let shot = browser.screenshot("video_page-text.png").await;
    let drawn = drawn_boxes(&browser).await;
    browser.close().await;
    println!("boxes: {drawn}");
    let boxes = drawn.as_array().expect("the boxes the page drew");
    // The white band holds `KILN 2026` from x = 30, rows 180 to about 215.
    let over_text = boxes.iter().find(|b| {
        let (x0, y0, x1, y1) = (
            b["x0"].as_u64().unwrap(),
            b["y0"].as_u64().unwrap(),
            b["x1"].as_u64().unwrap(),
            b["y1"].as_u64().unwrap(),
        );
        TEXT_BAND.contains(&(((y0 + y1) / 2) as u32)) && x0 <= 45 && x1 >= 220 && y1 - y0 >= 20
    });
    let over_text = over_text.unwrap_or_else(|| panic!("no box over the text: {drawn} ({shot:?})"));
    let green = over_text["green"].as_f64().unwrap();
    assert!(
        green > 0.8,
        "the box over the text is not drawn green: {over_text} ({shot:?})"
    );
}

/// A video file on the server (`--media-dir`, the media tests' generated
/// `text-640x480.mp4`), chosen by name on the page: kiln decodes it, inverts each
/// frame and the page draws what comes back. Where the video has a white box with
/// black text, the result is dark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_media_file_comes_back_inverted() {
    let test = "server_media_file_comes_back_inverted";
    if !browser_available(test) {
        return;
    }
    let media = kiln_tests::media::media_dir();
    let args = ["--media-dir", media.to_str().unwrap()];
    let Some((kiln, browser)) = open(test, "invert-video", "", &args).await else {
        return;
    };
    choose_source(&browser, "media", testvideo::TEXT_VIDEO).await;
    wait_for_answers(&browser, &kiln, 5).await;
    let shot = browser.screenshot("video_page-media.png").await;
    let (x0, y0, x1, y1) = testvideo::TEXT_BOXES[0];
    let region = browser
        .eval(
            "const [x0, y0, x1, y1] = arguments;
             const c = document.getElementById('result');
             const d = c.getContext('2d').getImageData(x0, y0, x1 - x0, y1 - y0).data;
             let sum = 0;
             for (let i = 0; i < d.length; i += 4) sum += (d[i] + d[i + 1] + d[i + 2]) / 3;
             return {width: c.width, height: c.height, mean: sum / (d.length / 4)};",
            vec![json!(x0), json!(y0), json!(x1), json!(y1)],
        )
        .await;
    browser.close().await;
    println!("text box region of the result: {region}");
    assert_eq!(region["width"], json!(testvideo::WIDTH), "{region}");
    assert_eq!(region["height"], json!(testvideo::HEIGHT), "{region}");
    // White with black text (mostly white) in the video; inverted, mostly black.
    let mean = region["mean"].as_f64().unwrap();
    assert!(
        mean < 80.0,
        "the text box is not inverted: {region} ({shot:?})"
    );
}

/// A local video file (the media tests' generated H.264 `text-640x480.mp4`),
/// chosen in the page's file input: played in the page's `<video>`, its frames
/// sent and answered inverted, as the camera's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_file_frames_come_back_inverted() {
    let test = "local_file_frames_come_back_inverted";
    let Some((kiln, browser)) = open(test, "invert-video", "", &[]).await else {
        return;
    };
    let video = kiln_tests::media::media_dir().join(testvideo::TEXT_VIDEO);
    choose_source(&browser, "file", video.to_str().unwrap()).await;
    wait_for_answers(&browser, &kiln, 5).await;
    let shot = browser.screenshot("video_page-file.png").await;
    let pixels = compare_canvases(&browser, testvideo::WIDTH).await;
    browser.close().await;
    assert_inverted(&pixels, &shot);
}

/// Each channel of the result is 255 minus the frame's, within what two JPEG
/// encodings (the page's, the server's) change; and far from the frame itself.
fn assert_inverted(pixels: &Value, shot: &Path) {
    println!("pixels: {pixels}");
    let inverted = pixels["inverted_error"].as_f64().unwrap();
    let same = pixels["same_error"].as_f64().unwrap();
    assert!(
        inverted < 20.0,
        "result is not the inverted frame: {pixels} ({shot:?})"
    );
    assert!(
        same > 60.0,
        "result is too close to the frame itself: {pixels} ({shot:?})"
    );
}

/// Unless the browser is missing (then `None`, the test skipped, but under CI):
/// kiln started with the example repository, `model` loaded and `args`, and the
/// page open in headless Chromium with `model` chosen (and `query` added to its
/// URL: `&name=value...`).
async fn open(test: &str, model: &str, query: &str, args: &[&str]) -> Option<(Kiln, Browser)> {
    if !browser_available(test) {
        return None;
    }
    let kiln = start_kiln(model, args);
    let browser = Browser::start(&fake_camera_video()).await;
    open_page(&browser, &kiln, model, query).await;
    Some((kiln, browser))
}

/// Starts kiln with the example repository, its `model` loaded, and `args`.
fn start_kiln(model: &str, args: &[&str]) -> Kiln {
    let repo = kiln_tests::repo_root().join("examples/models");
    let mut all = vec![
        "--model-repository",
        repo.to_str().unwrap(),
        "--load-model",
        model,
    ];
    all.extend_from_slice(args);
    Kiln::start(&all)
}

/// Opens the page (`query` added to its URL), waiting until its list has `model`,
/// chosen.
async fn open_page(browser: &Browser, kiln: &Kiln, model: &str, query: &str) {
    browser
        .client
        .goto(&format!("{}/ui/video?model={model}{query}", kiln.url))
        .await
        .expect("open /ui/video");
    let listed = browser
        .wait_until(
            &format!("return document.getElementById('model').value === '{model}';"),
            Duration::from_secs(30),
        )
        .await;
    assert!(
        listed,
        "the page does not list {model}: {}",
        page_text(browser).await
    );
}

/// Chooses the source `kind` (`webcam`, `file`: `value` is the file's path,
/// `media`: the name on the server) and presses Start.
async fn choose_source(browser: &Browser, kind: &str, value: &str) {
    browser
        .eval(
            "const [kind, value] = arguments;
             const source = document.getElementById('source');
             source.value = kind;
             source.dispatchEvent(new Event('change'));
             if (kind === 'media') document.getElementById('media').value = value;",
            vec![json!(kind), json!(value)],
        )
        .await;
    if kind == "file" {
        // A file input takes a path only from the user: WebDriver types it.
        let input = browser.client.find(fantoccini::Locator::Id("file")).await;
        let input = input.expect("the file input");
        input.send_keys(value).await.expect("choose the file");
    }
    browser
        .eval("document.getElementById('start').click();", vec![])
        .await;
}

/// Waits until the page has answers for `count` frames and reports a frame rate
/// above zero (no bound on how high: the machine is shared).
async fn wait_for_answers(browser: &Browser, kiln: &Kiln, count: u64) {
    let done = browser
        .wait_until(
            &format!(
                "const t = (id) => document.getElementById(id).textContent;
                 return t('error') !== '' || (Number(t('answered')) >= {count} && Number(t('fps')) > 0);"
            ),
            Duration::from_secs(90),
        )
        .await;
    let error = browser
        .eval(
            "return document.getElementById('error').textContent;",
            vec![],
        )
        .await;
    if !done || error != json!("") {
        browser.screenshot("video_page-failed.png").await;
        panic!(
            "the page shows no results: {}\nkiln's log:\n{}",
            page_text(browser).await,
            kiln.log()
        );
    }
}

/// The page's status, error and numbers, for a failure's message.
async fn page_text(browser: &Browser) -> Value {
    browser
        .eval(
            "const t = (id) => document.getElementById(id).textContent;
             return {status: t('status'), error: t('error'), fps: t('fps'),
                     latency: t('latency'), dropped: t('dropped'), answered: t('answered'),
                     inflight: t('inflight'),
                     peak_inflight: document.getElementById('inflight').dataset.peak,
                     models: [...document.getElementById('model').options].map(o => o.value)};",
            vec![],
        )
        .await
}

/// Reads the frame sent (`#input`) and the result (`#result`) in one script, so
/// both are the same frame, and returns the mean absolute error of the result
/// against the frame inverted (`inverted_error`) and against the frame itself
/// (`same_error`), per channel value.
async fn compare_canvases(browser: &Browser, width: u32) -> Value {
    let pixels = browser
        .eval(
            "const read = (id) => {
               const c = document.getElementById(id);
               return c.getContext('2d').getImageData(0, 0, c.width, c.height);
             };
             const a = read('input'), b = read('result');
             if (a.width !== b.width || a.height !== b.height)
               return {error: `sizes differ: ${a.width}x${a.height} and ${b.width}x${b.height}`};
             let inverted = 0, same = 0, n = 0;
             for (let i = 0; i < a.data.length; i += 4) {
               for (let c = 0; c < 3; c++) {
                 inverted += Math.abs(255 - a.data[i + c] - b.data[i + c]);
                 same += Math.abs(a.data[i + c] - b.data[i + c]);
                 n += 1;
               }
             }
             return {width: a.width, height: a.height,
                     inverted_error: inverted / n, same_error: same / n};",
            vec![],
        )
        .await;
    assert!(pixels.get("error").is_none(), "{pixels}");
    assert_eq!(pixels["width"], json!(width), "{pixels}");
    pixels
}

/// The boxes the page drew for the frame on show (`#boxes`' `data-boxes`), each
/// with `green`: the share of its top edge's pixels on the result canvas that
/// are the page's green (read in the same script, so the same frame).
async fn drawn_boxes(browser: &Browser) -> Value {
    browser
        .eval(
            "const boxes = JSON.parse(document.getElementById('boxes').dataset.boxes || '[]');
             const c = document.getElementById('result');
             const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
             for (const b of boxes) {
               let green = 0, n = 0;
               for (let x = b.x0 + 2; x < b.x1 - 2; x++) {
                 const i = (b.y0 * c.width + x) * 4;
                 if (px[i] < 100 && px[i + 1] > 180 && px[i + 2] < 100) green += 1;
                 n += 1;
               }
               b.green = n ? green / n : 0;
             }
             return boxes;",
            vec![],
        )
        .await
}
