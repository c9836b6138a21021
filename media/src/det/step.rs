//! Text detection as a per-session processing step: a frame in, the detector's
//! request out; its answer in, the frame's boxes out. The server's WebSocket
//! sessions run it for every decoded or received frame; the tests use the same.

use bytes::Bytes;
use kiln_protocol::{DataType, InferRequest, InferResponse, InputTensor, OutputTensor};

use super::{input_size, BoxFinder, BoxParams, Preprocessor, TextBox, DEFAULT_LIMIT_SIDE, INPUT};

/// `Vec<f32>` as the bytes of an input tensor, without a copy.
struct Floats(Vec<f32>);

impl AsRef<[u8]> for Floats {
    fn as_ref(&self) -> &[u8] {
        // Native order: little-endian on every target kiln builds for.
        bytemuck::cast_slice(&self.0)
    }
}

/// One session's text detection: its pre-processing tables (made again only when
/// the frame size changes), box finder and settings.
#[derive(Debug)]
pub struct TextDetection {
    params: BoxParams,
    limit_side: u32,
    pre: Option<(u32, u32, Preprocessor)>,
    finder: BoxFinder,
    boxes: Vec<TextBox>,
    /// The last probability map, as floats.
    map: Vec<f32>,
}

impl Default for TextDetection {
    fn default() -> Self {
        TextDetection::new(BoxParams::default(), DEFAULT_LIMIT_SIDE)
    }
}

impl TextDetection {
    /// With these thresholds and input side limit.
    pub fn new(params: BoxParams, limit_side: u32) -> TextDetection {
        TextDetection {
            params,
            limit_side,
            pre: None,
            finder: BoxFinder::default(),
            boxes: Vec::new(),
            map: Vec::new(),
        }
    }

    /// The detector's request for one rgb24 frame (`width × height × 3` bytes):
    /// input `x`, FP32 `[1, 3, H, W]`, H and W multiples of 32.
    pub fn request(
        &mut self,
        model: &str,
        rgb: &[u8],
        width: u32,
        height: u32,
    ) -> Result<InferRequest, String> {
        Ok(InferRequest {
            model: model.to_owned(),
            inputs: vec![self.input(INPUT, rgb, width, height, true)?],
            ..Default::default()
        })
    }

    /// The detector's input tensor `name` for one rgb24 frame: FP32 `[3, H, W]`,
    /// with a batch dimension of 1 in front when `batched`.
    pub fn input(
        &mut self,
        name: &str,
        rgb: &[u8],
        width: u32,
        height: u32,
        batched: bool,
    ) -> Result<InputTensor, String> {
        if width == 0 || height == 0 || rgb.len() != width as usize * height as usize * 3 {
            return Err(format!(
                "a {width}x{height} rgb24 frame is {} bytes, not {}",
                width as usize * height as usize * 3,
                rgb.len()
            ));
        }
        let pre = match &mut self.pre {
            Some((w, h, pre)) if (*w, *h) == (width, height) => pre,
            slot => {
                let (dw, dh) = input_size(width, height, self.limit_side);
                &mut slot
                    .insert((width, height, Preprocessor::new(width, height, dw, dh)))
                    .2
            }
        };
        let (dw, dh) = pre.output_size();
        let mut input = vec![0f32; pre.output_len()];
        pre.run(rgb, &mut input);
        let mut shape = vec![3, i64::from(dh), i64::from(dw)];
        if batched {
            shape.insert(0, 1);
        }
        Ok(InputTensor {
            name: name.to_owned(),
            dtype: DataType::Fp32,
            shape,
            data: Bytes::from_owner(Floats(input)),
        })
    }

    /// The boxes of the detector's answer to the last [`request`](Self::request),
    /// in that frame's pixels.
    pub fn boxes(&mut self, response: &InferResponse) -> Result<&[TextBox], String> {
        let Some((sw, sh, _)) = self.pre else {
            return Err("no frame was sent to the detector".into());
        };
        let out = response
            .outputs
            .first()
            .ok_or("the detector answered no output")?;
        self.boxes_of(out, (sw, sh))
    }

    /// The boxes of a probability map (FP32 `[H, W]`, `[1, H, W]` or
    /// `[1, 1, H, W]`) in a `width × height` frame's pixels.
    pub fn boxes_of(
        &mut self,
        map: &OutputTensor,
        (width, height): (u32, u32),
    ) -> Result<&[TextBox], String> {
        let dims = match map.shape.as_slice() {
            [h, w] | [1, h, w] | [1, 1, h, w] if map.dtype == DataType::Fp32 => {
                (u32::try_from(*w).ok(), u32::try_from(*h).ok())
            }
            _ => (None, None),
        };
        let (Some(w), Some(h)) = dims else {
            return Err(format!(
                "the detector's output `{}` is {:?} {:?}, not an FP32 probability map [1, 1, H, W]",
                map.name, map.dtype, map.shape
            ));
        };
        if map.data.len() != w as usize * h as usize * 4 {
            return Err(format!("the detector's output `{}` is short", map.name));
        }
        self.map.clear();
        self.map.extend(
            map.data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        self.finder.find(
            &self.map,
            (w, h),
            (width, height),
            &self.params,
            &mut self.boxes,
        );
        Ok(&self.boxes)
    }
}
