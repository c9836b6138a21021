//! Text detection on video frames as a session's processing (`"processing":
//! "text_boxes"`, `stream/processing.rs`): a frame into PP-OCR det's input, and
//! its probability map into the frame's text boxes (`kiln_media::det`: the image
//! math, unit-tested there).
//!
//! Pre- and post-processing run on actix's blocking pool, any frame on any of its
//! threads: each thread keeps its own [`TextDetection`] (resize tables, label map,
//! probability map), so a warm thread allocates only the input tensor per frame.

use std::cell::RefCell;

use kiln_media::det::{TextBox, TextDetection};
use kiln_protocol::{InputTensor, OutputTensor};
use serde_json::{json, Value};

use crate::stream::image::Rgb;

thread_local! {
    static DETECTION: RefCell<TextDetection> = RefCell::new(TextDetection::default());
}

/// The detector's input `name` for `frame`: FP32 `[3, H, W]`, H and W the frame's
/// sides scaled to at most 960 and rounded to multiples of 32, RGB normalized
/// with PP-OCR's mean and standard deviation.
pub fn input(frame: &Rgb, name: &str) -> Result<InputTensor, String> {
    let (w, h) = sides(frame.width, frame.height)?;
    DETECTION.with(|d| d.borrow_mut().input(name, &frame.pixels, w, h, false))
}

/// The bytes [`input`] allocates for `frame` (reserved before it runs): the
/// detector's FP32 input, at most 960 × 960 × 3 × 4 whatever the frame's size.
pub fn input_len(frame: &Rgb) -> usize {
    let side = |s: usize| u32::try_from(s).unwrap_or(u32::MAX);
    let (w, h) = kiln_media::det::input_size(
        side(frame.width),
        side(frame.height),
        kiln_media::det::DEFAULT_LIMIT_SIDE,
    );
    w as usize * h as usize * 3 * std::mem::size_of::<f32>()
}

/// The text boxes in `outputs`' probability map (the first output), in a
/// `width × height` frame's pixels, as the result's `boxes`: `[{"x0", "y0", "x1",
/// "y1", "score"}]` (ends exclusive).
pub fn boxes(outputs: &[OutputTensor], (width, height): (usize, usize)) -> Result<Value, String> {
    let map = outputs
        .first()
        .ok_or("the text detector answered no output")?;
    let (w, h) = sides(width, height)?;
    DETECTION.with(|d| {
        let mut detection = d.borrow_mut();
        let boxes = detection.boxes_of(map, (w, h))?;
        Ok(Value::Array(boxes.iter().map(to_json).collect()))
    })
}

fn to_json(b: &TextBox) -> Value {
    json!({"x0": b.x0, "y0": b.y0, "x1": b.x1, "y1": b.y1,
           "score": (f64::from(b.score) * 1000.0).round() / 1000.0})
}

fn sides(width: usize, height: usize) -> Result<(u32, u32), String> {
    match (u32::try_from(width), u32::try_from(height)) {
        (Ok(w), Ok(h)) => Ok((w, h)),
        _ => Err(format!("a {width}x{height} frame is too large")),
    }
}
