//! One image through PP-OCR, as rapidocr_onnxruntime 1.4.4 runs it (its
//! `config.yaml` settings), with the three models called through the server
//! (`kiln_worker_sdk::call`): resize, detection (`ocr-det`), DB post-processing,
//! line crops, the direction classifier (`ocr-cls`, all lines in one call),
//! recognition (`ocr-rec`, lines sorted by width in groups of 6 padded to the
//! group's widest, the groups called together) and CTC decoding.
//!
//! Every size here is derived from the image, and some grow fast: rapidocr
//! raises a short side to 30 px, pads to an 8:1 aspect, then scales the short
//! side to 736, so a 1×2000 PNG (81 bytes) asked for a 736×1,380,000 detector
//! input, 12 GB of f32. Each canvas, crop and model input is checked against
//! `max_canvas_pixels` before it is allocated ([`check_canvas`]); an image
//! whose shape needs more gets a 400 of its own. The classifier's and the
//! recognizer's inputs, whose number grows with the lines found, are built
//! and called in waves of at most that many pixels.

use std::borrow::Cow;

use kiln_worker_sdk::call::{self, CallError, CallInput, ModelCall};
use kiln_worker_sdk::DataType;

use crate::ctc::Dictionary;
use crate::db::{self, DbParams};
use crate::image::{zeroed, Image};
use crate::warp::{crop_line, crop_size};

/// Why one image failed: its own shape (400) or the pipeline (500).
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// A size derived from the image is beyond `max_canvas_pixels`.
    TooLarge(String),
    /// A model call failed, or memory could not be had.
    Internal(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Internal(message)
    }
}

/// The most pixels of any canvas, crop or model input the pipeline makes for
/// one image (load parameter `max_canvas_pixels`): 8 Mi px, a 96 MiB f32
/// detector input. The largest an ordinary image needs is about 4.3 Mi px (a
/// photo brought down to 2000 px, a text column of 8:1 whose short side is
/// raised to 736); only aspect ratios beyond about 16:1 reach the limit.
pub const MAX_CANVAS_PIXELS: usize = 8 << 20;

/// Refuses a `w × h` `what` made for a `image`-sized input when it has more
/// than `max` pixels; called before it is allocated.
fn check_canvas(
    what: &str,
    (w, h): (usize, usize),
    image: (usize, usize),
    max: usize,
) -> Result<(), Failure> {
    if w.saturating_mul(h) <= max {
        return Ok(());
    }
    Err(Failure::TooLarge(format!(
        "the image ({}×{} px) cannot be read within this model's limit: {what} would be \
         {w}×{h} px, more than max_canvas_pixels = {max} (an image this narrow or wide \
         grows when its short side is scaled up)",
        image.0, image.1
    )))
}

/// `items` in runs whose pixels (`px` each) add up to at most `max`, at least
/// one item a run: the inputs built and called at once.
fn waves<T>(items: &[T], px: impl Fn(&T) -> usize, max: usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0usize);
    for (i, item) in items.iter().enumerate() {
        let n = px(item);
        if i > start && sum.saturating_add(n) > max {
            out.push(&items[start..i]);
            (start, sum) = (i, 0);
        }
        sum = sum.saturating_add(n);
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// The pipeline's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub det_model: String,
    pub cls_model: String,
    pub rec_model: String,
    pub db: DbParams,
    /// The detector's input: the shorter side is brought up to this (rapidocr's
    /// `limit_side_len`, `limit_type: min`).
    pub limit_side_len: usize,
    /// A line the classifier calls upside down above this is turned by 180°.
    pub cls_thresh: f32,
    /// Lines recognized below this confidence are dropped (`text_score`).
    pub text_score: f32,
    /// Most lines per classifier call: at most the classifier model's `batch_size`
    /// (the example `ocr-cls` takes 32; with 64, a page of 33+ lines failed).
    pub cls_batch: usize,
    /// The most pixels of any canvas, crop or model input for one image.
    pub max_canvas_pixels: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            det_model: "ocr-det".into(),
            cls_model: "ocr-cls".into(),
            rec_model: "ocr-rec".into(),
            db: DbParams::default(),
            limit_side_len: 736,
            cls_thresh: 0.9,
            text_score: 0.5,
            cls_batch: 16,
            max_canvas_pixels: MAX_CANVAS_PIXELS,
        }
    }
}

/// One recognized line: its box in the input image's pixels (top-left,
/// top-right, bottom-right, bottom-left), its text and confidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub quad: [[f32; 2]; 4],
    pub text: String,
    pub score: f32,
}

const MAX_SIDE_LEN: usize = 2000;
const MIN_SIDE_LEN: usize = 30;
const MIN_HEIGHT: usize = 30;
const WIDTH_HEIGHT_RATIO: f64 = 8.0;
const REC_HEIGHT: usize = 48;
const REC_WIDTH: usize = 320;
const REC_GROUP: usize = 6;
const CLS_WIDTH: usize = 192;

/// Sides rounded to multiples of 32 after scaling by `ratio` (rapidocr's
/// `int(round(int(h * ratio) / 32) * 32)`).
fn scaled_32(side: usize, ratio: f64) -> usize {
    let s = (side as f64 * ratio) as usize;
    ((s as f64 / 32.0).round_ties_even() * 32.0) as usize
}

/// rapidocr's `preprocess`: an image beyond 2000 px is brought down, one under
/// 30 px up; the ratios map boxes back.
fn preprocess(img: Image, max: usize) -> Result<(Image, f64, f64), Failure> {
    let (h, w) = (img.height, img.width);
    let mut out = (img, 1.0, 1.0);
    let resize = |img: &Image, ratio: f64| -> Result<(Image, f64, f64), Failure> {
        let (rh, rw) = (scaled_32(img.height, ratio), scaled_32(img.width, ratio));
        if rh == 0 || rw == 0 {
            return Err(Failure::TooLarge(format!(
                "the image ({}×{}) is too small",
                img.width, img.height
            )));
        }
        check_canvas("the resized image", (rw, rh), (w, h), max)?;
        Ok((
            img.resize(rw, rh)?,
            img.height as f64 / rh as f64,
            img.width as f64 / rw as f64,
        ))
    };
    if h.max(w) > MAX_SIDE_LEN {
        let ratio = MAX_SIDE_LEN as f64 / h.max(w) as f64;
        out = resize(&out.0, ratio)?;
    }
    let (h, w) = (out.0.height, out.0.width);
    if h.min(w) < MIN_SIDE_LEN {
        let ratio = MIN_SIDE_LEN as f64 / h.min(w) as f64;
        out = resize(&out.0, ratio)?;
    }
    Ok(out)
}

/// rapidocr's letterbox: a low or very wide image gets black bands above and
/// below; returns the band's height. `raw` is the input's size, for messages.
fn letterbox(img: Image, raw: (usize, usize), max: usize) -> Result<(Image, usize), Failure> {
    let (h, w) = (img.height, img.width);
    if h <= MIN_HEIGHT || w as f64 / h as f64 > WIDTH_HEIGHT_RATIO {
        let new_h = ((w as f64 / WIDTH_HEIGHT_RATIO) as usize).max(MIN_HEIGHT) * 2;
        let pad = new_h.abs_diff(h) / 2;
        check_canvas("the padded image", (w, h + 2 * pad), raw, max)?;
        Ok((img.pad_vertically(pad, pad)?, pad))
    } else {
        Ok((img, 0))
    }
}

fn fp32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// A call of a PP-OCR model (each takes one FP32 input `x`) for `request`.
fn x_call<'a>(model: &'a str, shape: &'a [i64], x: &'a [f32], request: usize) -> ModelCall<'a> {
    ModelCall {
        model,
        inputs: vec![CallInput {
            name: "x",
            dtype: DataType::Fp32,
            shape,
            data: fp32_bytes(x),
        }],
        for_request: Some(request),
        ..ModelCall::default()
    }
}

fn call_error(step: &str, e: CallError) -> String {
    format!("{step}: {e}")
}

/// The first output of a call.
fn first_output(
    step: &str,
    answer: Result<Vec<call::CallOutput>, CallError>,
) -> Result<call::CallOutput, String> {
    answer
        .map_err(|e| call_error(step, e))?
        .into_iter()
        .next()
        .ok_or_else(|| format!("{step}: the model returned no output"))
}

/// An output's data as floats: borrowed where its bytes are aligned for `f32` (an
/// allocation of this size always is in practice), copied otherwise. The
/// recognizer answers `steps × 6625` floats a line (250 MB for an A4 page of 40
/// lines), which `CallOutput::values` copied once more (copies were 1.3% of the
/// server's CPU on the varied documents, perf; docs/benchmarks.md).
fn floats<'a>(step: &str, output: &'a call::CallOutput) -> Result<Cow<'a, [f32]>, String> {
    if output.dtype != DataType::Fp32 {
        return Err(format!(
            "{step}: output `{}` is {}, not FP32",
            output.name, output.dtype
        ));
    }
    match bytemuck::try_cast_slice::<u8, f32>(&output.data) {
        Ok(values) => Ok(Cow::Borrowed(values)),
        Err(bytemuck::PodCastError::TargetAlignmentGreaterAndInputNotAligned) => {
            Ok(Cow::Owned(bytemuck::pod_collect_to_vec(&output.data)))
        }
        Err(e) => Err(format!("{step}: output `{}`: {e}", output.name)),
    }
}

/// Runs the pipeline on `img` for request `request` of the running batch.
pub fn run(
    img: Image,
    settings: &Settings,
    dict: &Dictionary,
    request: usize,
) -> Result<Vec<Line>, Failure> {
    let (raw_w, raw_h) = (img.width, img.height);
    let max = settings.max_canvas_pixels;
    let (img, ratio_h, ratio_w) = preprocess(img, max)?;
    let (img, pad_top) = letterbox(img, (raw_w, raw_h), max)?;

    // Detection: the shorter side up to `limit_side_len`, both multiples of 32.
    let (h, w) = (img.height, img.width);
    let ratio = if h.min(w) < settings.limit_side_len {
        settings.limit_side_len as f64 / h.min(w) as f64
    } else {
        1.0
    };
    let (dh, dw) = (scaled_32(h, ratio), scaled_32(w, ratio));
    if dh == 0 || dw == 0 {
        return Ok(Vec::new());
    }
    check_canvas("the detector's input", (dw, dh), (raw_w, raw_h), max)?;
    let resized = img.resize(dw, dh)?;
    let mut x = zeroed(3 * dh * dw)?;
    resized.normalize_into(&mut x, dw);
    let shape = [1, 3, dh as i64, dw as i64];
    let det = call::infer(&x_call(&settings.det_model, &shape, &x, request));
    let det = first_output("detection", det)?;
    let (map, map_shape) = (floats("detection", &det)?, &det.shape);
    if map.len() != dh * dw {
        return Err(Failure::Internal(format!(
            "detection: a map of shape {map_shape:?}, not [1, 1, {dh}, {dw}]"
        )));
    }
    let quads = db::boxes(&map, dw, dh, w, h, &settings.db);
    if quads.is_empty() {
        return Ok(Vec::new());
    }
    // The crops, each and all together within the limit, checked first.
    let mut total = 0usize;
    for quad in &quads {
        let size = crop_size(quad);
        check_canvas("a text line", size, (raw_w, raw_h), max)?;
        total = total.saturating_add(size.0.max(1).saturating_mul(size.1.max(1)));
        check_canvas("the text lines", (total, 1), (raw_w, raw_h), max)?;
    }
    let mut lines = Vec::new();
    lines
        .try_reserve_exact(quads.len())
        .map_err(|_| "cannot allocate the text lines".to_owned())?;
    for quad in &quads {
        lines.push(crop_line(&img, quad)?);
    }

    classify(&mut lines, settings, request)?;
    let texts = recognize(&lines, settings, dict, request, (raw_w, raw_h))?;

    let mut out = Vec::new();
    for (quad, (text, score)) in quads.iter().zip(texts) {
        if score < settings.text_score {
            continue;
        }
        // Back to the input image: the band off, the preprocess ratios, clipped.
        let quad = quad.map(|[x, y]| {
            let x = (x as f64 * ratio_w) as f32;
            let y = ((y - pad_top as f32) as f64 * ratio_h) as f32;
            [x.clamp(0.0, raw_w as f32), y.clamp(0.0, raw_h as f32)]
        });
        out.push(Line { quad, text, score });
    }
    Ok(out)
}

/// A line resized to height 48 and at most `max_width` wide (the width its
/// aspect ratio gives, rounded up), normalized into a zeroed `3 × 48 × stride`.
fn line_input(
    line: &Image,
    max_width: usize,
    stride: usize,
    out: &mut [f32],
) -> Result<(), String> {
    let ratio = line.width as f64 / line.height as f64;
    let w = ((REC_HEIGHT as f64 * ratio).ceil() as usize).clamp(1, max_width);
    line.resize(w, REC_HEIGHT)?.normalize_into(out, stride);
    Ok(())
}

/// The direction classifier: every line in calls of at most `cls_batch`; a
/// line it finds upside down (class 1 above `cls_thresh`) is turned.
/// The calls of a wave are made together, as before the waves: results are
/// the same, only the memory held at once is bounded.
fn classify(lines: &mut [Image], settings: &Settings, request: usize) -> Result<(), Failure> {
    let per_line = REC_HEIGHT * CLS_WIDTH;
    let per = 3 * per_line;
    let ranges: Vec<(usize, usize)> = (0..lines.len())
        .step_by(settings.cls_batch.max(1))
        .map(|s| (s, (s + settings.cls_batch.max(1)).min(lines.len())))
        .collect();
    let mut index = 0;
    for wave in waves(
        &ranges,
        |r| (r.1 - r.0) * per_line,
        settings.max_canvas_pixels,
    ) {
        let mut chunks: Vec<(Vec<f32>, [i64; 4])> = Vec::new();
        for &(start, end) in wave {
            let mut x = zeroed(per * (end - start))?;
            for (line, out) in lines[start..end].iter().zip(x.chunks_exact_mut(per)) {
                line_input(line, CLS_WIDTH, CLS_WIDTH, out)?;
            }
            let shape = [(end - start) as i64, 3, REC_HEIGHT as i64, CLS_WIDTH as i64];
            chunks.push((x, shape));
        }
        let calls: Vec<ModelCall<'_>> = chunks
            .iter()
            .map(|(x, shape)| x_call(&settings.cls_model, shape, x, request))
            .collect();
        for answer in call::infer_all(&calls) {
            let output = first_output("direction classifier", answer)?;
            let probs = floats("direction classifier", &output)?;
            for p in probs.chunks_exact(2) {
                if let Some(line) = lines.get_mut(index) {
                    if p[1] > p[0] && p[1] > settings.cls_thresh {
                        *line = line.rotate_180()?;
                    }
                }
                index += 1;
            }
        }
    }
    if index != lines.len() {
        return Err(Failure::Internal(format!(
            "direction classifier: {index} answers for {} lines",
            lines.len()
        )));
    }
    Ok(())
}

/// Recognition: lines sorted by aspect ratio, in groups of 6, each padded to
/// the width of its widest (at least 320), the groups called together.
/// `raw` is the input image's size, for messages.
fn recognize(
    lines: &[Image],
    settings: &Settings,
    dict: &Dictionary,
    request: usize,
    raw: (usize, usize),
) -> Result<Vec<(String, f32)>, Failure> {
    let max = settings.max_canvas_pixels;
    let ratio = |l: &Image| l.width as f64 / l.height as f64;
    let mut order: Vec<usize> = (0..lines.len()).collect();
    order.sort_by(|&a, &b| ratio(&lines[a]).total_cmp(&ratio(&lines[b])));
    // Each group's width (its widest line's), checked before any input is made.
    let mut groups: Vec<(&[usize], usize)> = Vec::new();
    for group in order.chunks(REC_GROUP) {
        let max_ratio = group
            .iter()
            .map(|&i| ratio(&lines[i]))
            .fold(REC_WIDTH as f64 / REC_HEIGHT as f64, f64::max);
        let width = (REC_HEIGHT as f64 * max_ratio) as usize;
        let rows = REC_HEIGHT.saturating_mul(group.len());
        check_canvas("the recognizer's input", (width, rows), raw, max)?;
        groups.push((group, width));
    }
    let mut texts = vec![(String::new(), 0.0); lines.len()];
    for wave in waves(&groups, |g| REC_HEIGHT * g.0.len() * g.1, max) {
        let mut inputs: Vec<(Vec<f32>, [i64; 4])> = Vec::new();
        for &(group, width) in wave {
            let per = 3 * REC_HEIGHT * width;
            let mut x = zeroed(per * group.len())?;
            for (&i, out) in group.iter().zip(x.chunks_exact_mut(per)) {
                line_input(&lines[i], width, width, out)?;
            }
            let shape = [group.len() as i64, 3, REC_HEIGHT as i64, width as i64];
            inputs.push((x, shape));
        }
        let calls: Vec<ModelCall<'_>> = inputs
            .iter()
            .map(|(x, shape)| x_call(&settings.rec_model, shape, x, request))
            .collect();
        for ((group, _), answer) in wave.iter().zip(call::infer_all(&calls)) {
            let output = first_output("recognizer", answer)?;
            let (probs, shape) = (floats("recognizer", &output)?, &output.shape);
            let per_line = probs.len() / group.len().max(1);
            if shape.last().copied() != Some(dict.len() as i64)
                || per_line * group.len() != probs.len()
            {
                return Err(Failure::Internal(format!(
                    "recognizer: output shape {shape:?} does not fit {} lines of {} classes",
                    group.len(),
                    dict.len()
                )));
            }
            for (&i, p) in group.iter().zip(probs.chunks_exact(per_line)) {
                texts[i] = dict.decode(p);
            }
        }
    }
    Ok(texts)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sides_round_to_32() {
        // A 100×40 image: ratio 736/40 = 18.4; 100 × 18.4 is 1839.999… in
        // floating point, truncated to 1839 (as Python's int() does) → 1824.
        let r = 736.0 / 40.0;
        assert_eq!((scaled_32(100, r), scaled_32(40, r)), (1824, 736));
        assert_eq!(scaled_32(10, 1.0), 0);
    }

    #[test]
    fn letterbox_pads_low_images() {
        let max = MAX_CANVAS_PIXELS;
        let (img, pad) = letterbox(Image::new(400, 20).unwrap(), (400, 20), max).unwrap();
        // max(400/8, 30)·2 = 100 → (100 − 20)/2 = 40 above and below.
        assert_eq!((pad, img.height), (40, 100));
        let (img, pad) = letterbox(Image::new(100, 100).unwrap(), (100, 100), max).unwrap();
        assert_eq!((pad, img.height), (0, 100));
    }

    /// A 2000×1 image is raised to 60000×32 (1.9 Mpx, within the limit), then
    /// its 8:1 padding would be 60000×15000: refused before it is made.
    #[test]
    fn the_padding_of_a_wide_line_is_checked_before_it_is_made() {
        let (img, ..) = preprocess(Image::new(2000, 1).unwrap(), MAX_CANVAS_PIXELS).unwrap();
        assert_eq!((img.width, img.height), (60000, 32));
        let err = letterbox(img, (2000, 1), MAX_CANVAS_PIXELS).unwrap_err();
        let Failure::TooLarge(message) = err else {
            panic!("{err:?}")
        };
        assert!(message.contains("60000×15000"), "{message}");
    }

    /// Floats are read in place (a `Vec<u8>` of this size is aligned; the copy
    /// for one that is not cannot be made here), and a wrong datatype or a length
    /// that is not whole floats is an error, not a panic.
    #[test]
    fn floats_borrow_aligned_data_and_refuse_what_is_not_fp32() {
        let values = [1.5f32, -2.0, 0.25];
        let output = |dtype, data: Vec<u8>| call::CallOutput {
            name: "y".into(),
            dtype,
            shape: vec![3],
            data,
        };
        let aligned = output(DataType::Fp32, bytemuck::cast_slice(&values).to_vec());
        let got = floats("t", &aligned).unwrap();
        assert!(matches!(got, Cow::Borrowed(_)));
        assert_eq!(&*got, &values);
        assert!(floats("t", &output(DataType::Int32, vec![0; 12])).is_err());
        assert!(floats("t", &output(DataType::Fp32, vec![0; 5])).is_err());
    }

    #[test]
    fn waves_hold_at_most_the_limit_and_every_item() {
        let items = [3usize, 4, 2, 9, 1];
        let got: Vec<Vec<usize>> = waves(&items, |&n| n, 7)
            .into_iter()
            .map(<[usize]>::to_vec)
            .collect();
        assert_eq!(got, vec![vec![3, 4], vec![2], vec![9], vec![1]]);
        assert!(waves(&[] as &[usize], |&n| n, 7).is_empty());
    }
}
