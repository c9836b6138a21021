//! Server-side video (kiln-media): text detection on the generated video's frames
//! through the real ocr-det model, and WebSocket sessions whose frames kiln
//! decodes itself from `--media-dir` or an allowed URL.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_media::det::{TextBox, TextDetection};
use kiln_media::testvideo::{self, TEXT_BOXES};
use kiln_tests::file_server::FileServer;
use kiln_tests::media::{frames, media_dir};
use kiln_tests::{model_repository, Kiln};

/// Whether `b`'s centre lies in the rectangle.
fn centred_in(b: &TextBox, (x0, y0, x1, y1): (u32, u32, u32, u32)) -> bool {
    let (cx, cy) = ((b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2);
    (x0..x1).contains(&cx) && (y0..y1).contains(&cy)
}

/// Each drawn line of text is covered by the boxes centred in its white box, which
/// stay within it (give or take 4 pixels).
fn check_text_boxes(frame: usize, boxes: &[TextBox]) {
    for drawn in TEXT_BOXES {
        let over: Vec<&TextBox> = boxes.iter().filter(|b| centred_in(b, drawn)).collect();
        assert!(
            !over.is_empty(),
            "frame {frame}: no box over {drawn:?}: {boxes:?}"
        );
        let x0 = over.iter().map(|b| b.x0).min().unwrap();
        let x1 = over.iter().map(|b| b.x1).max().unwrap();
        let (y0, y1) = (
            over.iter().map(|b| b.y0).min().unwrap(),
            over.iter().map(|b| b.y1).max().unwrap(),
        );
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

/// The detection step's request and box extraction around the real model: the two
/// drawn lines of text are found, each box over one of them, and a blank frame has
/// none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_detection_finds_the_drawn_text_and_nothing_on_blank_frames() {
    let repo = model_repository();
    let kiln = Kiln::start(&[
        "--model-repository",
        repo.to_str().unwrap(),
        "--load-model",
        "ocr-det",
    ]);
    let frames = frames(testvideo::TEXT_VIDEO);
    let mut det = TextDetection::default();
    for index in [0usize, 100, 269] {
        let request = det.request("ocr-det", &frames[index], 640, 480).unwrap();
        let response = kiln.client.infer_binary(&request).await.unwrap();
        let boxes = det.boxes(&response).unwrap().to_vec();
        check_text_boxes(index, &boxes);
    }
    let blank = testvideo::FIRST_BLANK as usize + 5;
    let request = det.request("ocr-det", &frames[blank], 640, 480).unwrap();
    let response = kiln.client.infer_binary(&request).await.unwrap();
    assert!(det.boxes(&response).unwrap().is_empty());
}

/// The server's media settings on their own: an allowed 127.0.0.1 URL is decoded;
/// a host not allowed, or no host allowed, is refused before any connection.
#[test]
fn urls_are_decoded_only_for_allowed_hosts() {
    use kiln_server::media::{Media, MediaConfig, SourceSpec};
    let server = FileServer::start(media_dir().join(testvideo::TEXT_VIDEO));
    let url = format!(
        "http://127.0.0.1:{}/{}",
        server.addr.port(),
        testvideo::TEXT_VIDEO
    );
    let other = format!(
        "http://localhost:{}/{}",
        server.addr.port(),
        testvideo::TEXT_VIDEO
    );
    let none = Media::new(&MediaConfig::default()).unwrap();
    let allowed = Media::new(&MediaConfig {
        url_allow: vec!["127.0.0.1".into()],
        ..MediaConfig::default()
    })
    .unwrap();
    for (media, url) in [(&none, &url), (&allowed, &other)] {
        let err = media
            .open(&SourceSpec::Url(url.clone()))
            .err()
            .expect("refused");
        assert!(err.to_string().contains("--media-url-allow"), "{err}");
    }
    assert_eq!(server.connections(), 0, "a refused URL was connected to");
    let mut decoder = allowed.open(&SourceSpec::Url(url)).unwrap();
    assert_eq!((decoder.info().width, decoder.info().height), (640, 480));
    let mut frame = Vec::new();
    let mut frames = 0;
    while decoder.read_frame(&mut frame).unwrap() {
        frames += 1;
    }
    assert_eq!(frames, testvideo::FRAMES);
    assert!(server.connections() >= 1);
}
