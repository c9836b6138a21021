//! Per-session pre- and post-processing: what turns a decoded frame into the
//! model's input tensor, and the model's outputs into what the result carries.
//! A session picks one in its opening message (`"processing"`); each frame's
//! [`Processing::pre`] and [`Processing::post`] run on actix's blocking pool with
//! the frame's decoding and the result's encoding (`session.rs`).
//!
//! To add one (a model that wants its frames resized and normalized, outputs
//! turned into boxes): a variant, its name in [`Processing::parse`], and its arms
//! in `pre` and `post`.

use bytes::Bytes;
use kiln_protocol::{DataType, InputTensor, OutputTensor};
use serde_json::{Map, Value};

use super::image::Rgb;

/// A decoded frame, before processing.
#[derive(Debug, Clone)]
pub enum FrameData {
    /// A picture (a JPEG or PNG the client sent, a frame of a server-side source).
    Image(Rgb),
    /// A raw tensor the client sent (`"encoding": "raw"`).
    Tensor {
        dtype: DataType,
        shape: Vec<i64>,
        data: Bytes,
    },
}

impl FrameData {
    /// The picture's width and height (`None` for a raw tensor).
    pub fn size(&self) -> Option<(usize, usize)> {
        match self {
            FrameData::Image(rgb) => Some((rgb.width, rgb.height)),
            FrameData::Tensor { .. } => None,
        }
    }
}

/// What post-processing knows of the frame its outputs came from.
#[derive(Debug, Clone)]
pub struct FrameInfo {
    /// The decoded frame's width and height (`None` for a raw tensor).
    pub size: Option<(usize, usize)>,
    /// The shape of the input tensor the model was given (without a batch dimension).
    pub input_shape: Vec<i64>,
}

/// A frame's processed outputs: the tensors to send, and fields of its own
/// post-processing adds to the result message (e.g. `boxes`).
#[derive(Debug, Default)]
pub struct Processed {
    pub outputs: Vec<OutputTensor>,
    pub fields: Map<String, Value>,
}

/// A session's processing (`"processing"` in its opening message).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Processing {
    /// The decoded frame is the input (an image as UINT8 `[H, W, 3]`); outputs
    /// are sent as they come.
    #[default]
    None,
    /// Text detection (PP-OCR det, `crate::media::text`): the frame resized to
    /// multiples of 32 and normalized into FP32 `[3, H, W]`; the probability map
    /// becomes the result's `boxes`, in the frame's pixels (no tensor is sent).
    TextBoxes,
}

impl Processing {
    /// The processing `value` names (`None`: the default).
    pub fn parse(value: Option<&Value>) -> Result<Processing, String> {
        match value {
            None => Ok(Processing::None),
            Some(Value::String(name)) => match name.as_str() {
                "none" => Ok(Processing::None),
                "text_boxes" => Ok(Processing::TextBoxes),
                other => Err(format!(
                    "unknown processing `{other}` (known: none, text_boxes)"
                )),
            },
            Some(other) => Err(format!("`processing` must be a string, got {other}")),
        }
    }

    /// The bytes [`pre`](Self::pre) allocates beside `frame` (reserved before it
    /// runs): none when the frame's own buffer becomes the tensor.
    pub fn new_bytes(&self, frame: &FrameData) -> usize {
        match (self, frame) {
            (Processing::TextBoxes, FrameData::Image(rgb)) => crate::media::text::input_len(rgb),
            _ => 0,
        }
    }

    /// The input tensor `input` for `frame` (its shape without a batch dimension).
    pub fn pre(&self, frame: FrameData, input: &str) -> Result<InputTensor, String> {
        match self {
            Processing::None => Ok(match frame {
                FrameData::Image(rgb) => InputTensor {
                    name: input.to_owned(),
                    dtype: DataType::Uint8,
                    shape: vec![rgb.height as i64, rgb.width as i64, 3],
                    data: Bytes::from(rgb.pixels),
                },
                FrameData::Tensor { dtype, shape, data } => InputTensor {
                    name: input.to_owned(),
                    dtype,
                    shape,
                    data,
                },
            }),
            Processing::TextBoxes => match frame {
                FrameData::Image(rgb) => crate::media::text::input(&rgb, input),
                FrameData::Tensor { .. } => {
                    Err("`text_boxes` needs pictures (jpeg, png or a server-side source), not raw tensors".to_owned())
                }
            },
        }
    }

    /// The outputs to send for a frame (`frame` tells what it was).
    pub fn post(&self, outputs: Vec<OutputTensor>, frame: &FrameInfo) -> Result<Processed, String> {
        let _ = frame;
        match self {
            Processing::None => Ok(Processed {
                outputs,
                fields: Map::new(),
            }),
            Processing::TextBoxes => {
                let size = frame.size.ok_or("`text_boxes` without a picture")?;
                let mut fields = Map::new();
                fields.insert("boxes".into(), crate::media::text::boxes(&outputs, size)?);
                Ok(Processed {
                    outputs: Vec::new(),
                    fields,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_are_checked() {
        assert_eq!(Processing::parse(None).unwrap(), Processing::None);
        assert_eq!(
            Processing::parse(Some(&json!("none"))).unwrap(),
            Processing::None
        );
        assert!(Processing::parse(Some(&json!("sharpen"))).is_err());
        assert!(Processing::parse(Some(&json!(1))).is_err());
    }

    #[test]
    fn an_image_becomes_a_uint8_hwc_tensor() {
        let rgb = Rgb::new(2, 1, vec![1, 2, 3, 4, 5, 6]).unwrap();
        let t = Processing::None
            .pre(FrameData::Image(rgb), "image")
            .unwrap();
        assert_eq!(
            (t.name.as_str(), t.dtype, t.shape),
            ("image", DataType::Uint8, vec![1, 2, 3])
        );
        assert_eq!(&t.data[..], &[1, 2, 3, 4, 5, 6]);
    }

    /// What `pre` allocates is what was reserved for it beforehand: exactly the
    /// detector's input for text boxes (a 4K frame: 960 × 544 FP32), nothing
    /// for a frame whose pixels become the tensor.
    #[test]
    fn the_bytes_reserved_are_the_bytes_preprocessing_makes() {
        for (w, h) in [(3840, 2160), (1, 1), (640, 480), (1, 2000)] {
            let frame = FrameData::Image(Rgb::new(w, h, vec![0; w * h * 3]).unwrap());
            let reserved = Processing::TextBoxes.new_bytes(&frame);
            let t = Processing::TextBoxes.pre(frame, "x").unwrap();
            assert_eq!(reserved, t.data.len(), "{w}x{h}");
        }
        let frame = FrameData::Image(Rgb::new(2, 1, vec![0; 6]).unwrap());
        assert_eq!(Processing::None.new_bytes(&frame), 0);
    }
}
