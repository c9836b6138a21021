//! `ocr`: image → text lines, PP-OCR as rapidocr_onnxruntime 1.4.4 runs it, with
//! the three models (`ocr-det`, `ocr-cls`, `ocr-rec`, served by the onnx worker)
//! called through the server (`kiln_worker_sdk::call`), so their requests batch
//! with every other request to those models, across images and clients. The image
//! math is pure Rust ([`image`], [`warp`], [`db`], [`ctc`]; the steps in
//! [`pipeline`]).
//!
//! Why a worker that calls models rather than an ensemble: an image has any
//! number of text lines, and each line is cropped, turned and recognized on its
//! own: a fan-out whose width is known only after detection, which a worker's
//! loop expresses directly and a fixed graph of tensors does not.
//!
//! Input `IMAGE`: one PNG or JPEG (BYTES, shape [1]; base64 text of either is
//! accepted too, so a KServe JSON request can carry it), or with the load
//! parameter `input = "rgb"`, a UINT8 `[H, W, 3]` RGB tensor. Outputs, one row
//! per line in reading order: `boxes` FP32 `[n, 4, 2]` (corners top-left,
//! top-right, bottom-right, bottom-left, in the image's pixels), `texts` BYTES
//! `[n]` (UTF-8), `scores` FP32 `[n]` (the recognizer's confidence).
//!
//! Parameters: `dictionary` (operator; the character list inside `model_dir`,
//! default `ppocr_keys.txt`, which `scripts/fetch-models` extracts from the
//! recognizer's metadata), `det_model`, `cls_model`, `rec_model` (the models
//! called), `input` (`encoded` or `rgb`), `box_thresh`, `unclip_ratio`,
//! `text_score`, `max_pixels` (the decoded image, 64 Mi px by default; its
//! header's dimensions are checked before decoding), `max_canvas_pixels` (every
//! canvas, crop and model input made for one image, 8 Mi px by default:
//! [`pipeline::MAX_CANVAS_PIXELS`]).

pub mod ctc;
pub mod db;
pub mod image;
pub mod pipeline;
pub mod warp;

use std::path::{Component, Path};

use kiln_worker_sdk::{
    encode_bytes, export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params,
    RequestError, Shape, TensorSpec, Worker, WorkerError, WorkerInfo,
};

use crate::ctc::Dictionary;
use crate::image::{Image, MAX_PIXELS};
use crate::pipeline::{Failure, Line, Settings, MAX_CANVAS_PIXELS};

/// The ocr worker.
pub struct Ocr {
    settings: Settings,
    dict: Dictionary,
    rgb: bool,
    max_pixels: usize,
}

fn dictionary(params: &Params<'_>) -> Result<Dictionary, WorkerError> {
    let dir = params.string("model_dir").ok_or_else(|| {
        WorkerError::new(
            "the ocr worker reads its dictionary from its model's folder: load it \
             from a model repository",
        )
    })?;
    let file = params
        .string("dictionary")
        .unwrap_or_else(|| "ppocr_keys.txt".to_owned());
    if Path::new(&file)
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(
            format!("`dictionary` must be a path inside the model's folder, got `{file}`").into(),
        );
    }
    let path = Path::new(&dir).join(&file);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("dictionary {}: {e}", path.display()))?;
    let dict = Dictionary::from_text(&text);
    if dict.is_empty() {
        return Err(format!("dictionary {} holds no character", path.display()).into());
    }
    Ok(dict)
}

impl Worker for Ocr {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::operator("model_dir"),
        ParamSpec::operator("dictionary"),
        ParamSpec::load("det_model", ParamKind::Any),
        ParamSpec::load("cls_model", ParamKind::Any),
        ParamSpec::load("rec_model", ParamKind::Any),
        ParamSpec::load("input", ParamKind::Any),
        ParamSpec::load("box_thresh", ParamKind::Float { min: 0.0, max: 1.0 }),
        ParamSpec::load(
            "unclip_ratio",
            ParamKind::Float {
                min: 0.0,
                max: 10.0,
            },
        ),
        ParamSpec::load("text_score", ParamKind::Float { min: 0.0, max: 1.0 }),
        ParamSpec::load(
            "max_pixels",
            ParamKind::Int {
                min: 1,
                max: MAX_PIXELS as i64,
            },
        ),
        ParamSpec::load(
            "max_canvas_pixels",
            ParamKind::Int {
                min: 1 << 20,
                max: MAX_PIXELS as i64,
            },
        ),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let mut settings = Settings::default();
        for (key, slot) in [
            ("det_model", &mut settings.det_model),
            ("cls_model", &mut settings.cls_model),
            ("rec_model", &mut settings.rec_model),
        ] {
            if let Some(v) = params.string(key) {
                *slot = v;
            }
        }
        if let Some(v) = params.float("box_thresh")? {
            settings.db.box_thresh = v;
        }
        if let Some(v) = params.float("unclip_ratio")? {
            settings.db.unclip_ratio = v;
        }
        if let Some(v) = params.float("text_score")? {
            settings.text_score = v as f32;
        }
        let rgb = match params.string("input").as_deref() {
            None | Some("encoded") => false,
            Some("rgb") => true,
            Some(other) => {
                return Err(format!("`input` must be `encoded` or `rgb`, got `{other}`").into())
            }
        };
        let max_pixels = params.int("max_pixels")?.map_or(MAX_PIXELS, |v| v as usize);
        settings.max_canvas_pixels = params
            .int("max_canvas_pixels")?
            .map_or(MAX_CANVAS_PIXELS, |v| v as usize);
        Ok(Ocr {
            settings,
            dict: dictionary(&params)?,
            rgb,
            max_pixels,
        })
    }

    fn info(&self) -> WorkerInfo {
        let input = if self.rgb {
            TensorSpec::new("IMAGE", DataType::Uint8, &[-1, -1, 3])
        } else {
            TensorSpec::new("IMAGE", DataType::Bytes, &[1])
        };
        WorkerInfo {
            inputs: vec![input].into(),
            outputs: vec![
                TensorSpec::new("boxes", DataType::Fp32, &[-1, 4, 2]),
                TensorSpec::new("texts", DataType::Bytes, &[-1]),
                TensorSpec::new("scores", DataType::Fp32, &[-1]),
            ]
            .into(),
            // One image a request; images run side by side on the instances.
            max_batch_size: 0,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: false,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let data = input.bytes();
        let mut results: Vec<Vec<Line>> = Vec::with_capacity(batch.request_count());
        let mut offset = 0usize;
        for (request, shape) in input.shapes().iter().enumerate() {
            let image = if self.rgb {
                let dims = shape.dims();
                let (h, w) = (dims[0].max(0) as usize, dims[1].max(0) as usize);
                let len = h.saturating_mul(w).saturating_mul(3);
                let img = data
                    .get(offset..offset.saturating_add(len))
                    .ok_or_else(|| "the image data is cut short".to_owned())
                    .and_then(|rgb| {
                        image::check_size(w, h, self.max_pixels)?;
                        Image::from_rgb(w, h, rgb)
                    });
                offset = offset.saturating_add(len);
                img
            } else {
                let element = bytes_element(data, offset);
                offset += 4 + element.as_ref().map_or(0, |e| e.len());
                element.and_then(|bytes| image::decode(bytes, self.max_pixels))
            };
            let lines = match image {
                Err(message) => {
                    batch.fail(request, RequestError::invalid(message))?;
                    Vec::new()
                }
                Ok(img) => match pipeline::run(img, &self.settings, &self.dict, request) {
                    Ok(lines) => lines,
                    Err(Failure::TooLarge(message)) => {
                        batch.fail(request, RequestError::invalid(message))?;
                        Vec::new()
                    }
                    Err(Failure::Internal(message)) => {
                        batch.fail(request, RequestError::internal(message))?;
                        Vec::new()
                    }
                },
            };
            results.push(lines);
        }
        write_outputs(batch, &results)
    }
}

/// The BYTES element at `offset` (its 4-byte length prefix, then the bytes).
fn bytes_element(data: &[u8], offset: usize) -> Result<&[u8], String> {
    let prefix = data
        .get(offset..offset + 4)
        .ok_or("the image element has no length prefix")?;
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    data.get(offset + 4..offset + 4 + len)
        .ok_or_else(|| "the image element is cut short".to_owned())
}

fn write_outputs(batch: &mut Batch<'_, '_>, results: &[Vec<Line>]) -> Result<(), WorkerError> {
    let shape = |dims: &[i64]| Shape::new(dims).ok_or_else(|| WorkerError::new("bad shape"));
    let boxes_shapes = results
        .iter()
        .map(|l| shape(&[l.len() as i64, 4, 2]))
        .collect::<Result<Vec<_>, _>>()?;
    let row_shapes = results
        .iter()
        .map(|l| shape(&[l.len() as i64]))
        .collect::<Result<Vec<_>, _>>()?;
    let boxes: Vec<f32> = results
        .iter()
        .flatten()
        .flat_map(|l| l.quad.iter().flatten().copied())
        .collect();
    batch
        .output(0)?
        .allocate_as::<f32>(&boxes_shapes)?
        .copy_from_slice(&boxes);
    let texts = encode_bytes(
        &results
            .iter()
            .flatten()
            .map(|l| l.text.as_bytes())
            .collect::<Vec<_>>(),
    );
    batch
        .output(1)?
        .allocate_bytes(&row_shapes, texts.len())?
        .copy_from_slice(&texts);
    let scores: Vec<f32> = results.iter().flatten().map(|l| l.score).collect();
    batch
        .output(2)?
        .allocate_as::<f32>(&row_shapes)?
        .copy_from_slice(&scores);
    Ok(())
}

export_worker!(Ocr);
