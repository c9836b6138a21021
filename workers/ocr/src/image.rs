//! Images as the pipeline handles them: 8-bit, 3 channels in **BGR** order (the
//! order PP-OCR's models were trained on and rapidocr converts to), row-major.
//! Decoding (PNG, JPEG, base64 of either), bilinear resizing with OpenCV's
//! `INTER_LINEAR` sampling, padding, rotations and the models' normalization.
//!
//! Every buffer here has a size a request sets (its header's dimensions, a
//! resize the pipeline computes from them): each is allocated fallibly
//! ([`zeroed`]), after the pipeline has checked the size against its limits.

use base64::Engine;

/// An 8-bit BGR image.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    pub width: usize,
    pub height: usize,
    /// `height × width × 3` bytes, B, G, R.
    pub data: Vec<u8>,
}

/// `len` zeroed values, or an error when the memory cannot be had: the size
/// comes from a request, so running out fails that request, not the process.
pub fn zeroed<T: Copy + Default>(len: usize) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        format!(
            "cannot allocate {} bytes for the image",
            len.saturating_mul(std::mem::size_of::<T>())
        )
    })?;
    v.resize(len, T::default());
    Ok(v)
}

/// `width × height × 3`, or an error when it overflows.
fn rgb_len(width: usize, height: usize) -> Result<usize, String> {
    width
        .checked_mul(height)
        .and_then(|n| n.checked_mul(3))
        .ok_or_else(|| format!("a {width}×{height} image is too large"))
}

impl Image {
    /// A black image.
    pub fn new(width: usize, height: usize) -> Result<Image, String> {
        Ok(Image {
            width,
            height,
            data: zeroed(rgb_len(width, height)?)?,
        })
    }

    /// From RGB bytes (`height × width × 3`).
    pub fn from_rgb(width: usize, height: usize, rgb: &[u8]) -> Result<Image, String> {
        if rgb.len() != rgb_len(width, height)? {
            return Err(format!(
                "{} bytes are not a {width}×{height} RGB image",
                rgb.len()
            ));
        }
        let mut data = zeroed(rgb.len())?;
        data.copy_from_slice(rgb);
        for px in data.chunks_exact_mut(3) {
            px.swap(0, 2);
        }
        Ok(Image {
            width,
            height,
            data,
        })
    }

    /// Channel `c` of pixel (`x`, `y`).
    #[inline]
    pub fn at(&self, x: usize, y: usize, c: usize) -> u8 {
        self.data[(y * self.width + x) * 3 + c]
    }

    /// Resized to `width × height`, bilinear as OpenCV's `INTER_LINEAR` samples
    /// (pixel centers aligned, edges clamped, no antialiasing).
    pub fn resize(&self, width: usize, height: usize) -> Result<Image, String> {
        let mut out = Image::new(width, height)?;
        if self.width == 0 || self.height == 0 {
            return Ok(out);
        }
        let xs = axis(self.width, width);
        let ys = axis(self.height, height);
        for (y, &(y0, y1, fy)) in ys.iter().enumerate() {
            for (x, &(x0, x1, fx)) in xs.iter().enumerate() {
                for c in 0..3 {
                    let top =
                        self.at(x0, y0, c) as f32 * (1.0 - fx) + self.at(x1, y0, c) as f32 * fx;
                    let bottom =
                        self.at(x0, y1, c) as f32 * (1.0 - fx) + self.at(x1, y1, c) as f32 * fx;
                    let v = top * (1.0 - fy) + bottom * fy;
                    out.data[(y * width + x) * 3 + c] = v.round().clamp(0.0, 255.0) as u8;
                }
            }
        }
        Ok(out)
    }

    /// With `top` black rows above and `bottom` below.
    pub fn pad_vertically(&self, top: usize, bottom: usize) -> Result<Image, String> {
        let mut out = Image::new(self.width, self.height + top + bottom)?;
        let row = self.width * 3;
        out.data[top * row..(top + self.height) * row].copy_from_slice(&self.data);
        Ok(out)
    }

    /// Turned by 180°.
    pub fn rotate_180(&self) -> Result<Image, String> {
        let mut out = Image::new(self.width, self.height)?;
        for (to, from) in out
            .data
            .chunks_exact_mut(3)
            .zip(self.data.chunks_exact(3).rev())
        {
            to.copy_from_slice(from);
        }
        Ok(out)
    }

    /// Turned by 90° counter-clockwise (NumPy's `rot90`).
    pub fn rotate_90_ccw(&self) -> Result<Image, String> {
        let (w, h) = (self.height, self.width);
        let mut out = Image::new(w, h)?;
        for y in 0..h {
            for x in 0..w {
                // new[y][x] = old[x][W-1-y]
                for c in 0..3 {
                    out.data[(y * w + x) * 3 + c] = self.at(self.width - 1 - y, x, c);
                }
            }
        }
        Ok(out)
    }

    /// `(v / 255 − 0.5) / 0.5` per channel, planar (C, H, W), written into `out`
    /// at row width `stride` (≥ `self.width`; the rest of each row stays as is).
    pub fn normalize_into(&self, out: &mut [f32], stride: usize) {
        let plane = self.height * stride;
        for y in 0..self.height {
            for x in 0..self.width {
                for c in 0..3 {
                    let v = self.at(x, y, c) as f32 / 255.0;
                    out[c * plane + y * stride + x] = (v - 0.5) / 0.5;
                }
            }
        }
    }
}

/// For each destination index along an axis of `src` → `dst` samples: the two
/// source indices and the weight of the second (OpenCV's `INTER_LINEAR`).
fn axis(src: usize, dst: usize) -> Vec<(usize, usize, f32)> {
    let scale = src as f64 / dst as f64;
    (0..dst)
        .map(|d| {
            let f = (d as f64 + 0.5) * scale - 0.5;
            let mut i = f.floor();
            let mut w = f - i;
            if i < 0.0 {
                i = 0.0;
                w = 0.0;
            }
            let i = i as usize;
            if i >= src - 1 {
                (src - 1, src - 1, 0.0)
            } else {
                (i, i + 1, w as f32)
            }
        })
        .collect()
}

/// The most pixels a decoded image may have (64 megapixels).
pub const MAX_PIXELS: usize = 64 << 20;

/// Decodes PNG or JPEG bytes, or base64 text of either (what a KServe JSON
/// request can carry in a BYTES element).
pub fn decode(bytes: &[u8], max_pixels: usize) -> Result<Image, String> {
    if bytes.starts_with(b"\x89PNG") {
        return decode_png(bytes, max_pixels);
    }
    if bytes.starts_with(&[0xFF, 0xD8]) {
        return decode_jpeg(bytes, max_pixels);
    }
    let text: Vec<u8> = bytes
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    match base64::engine::general_purpose::STANDARD.decode(&text) {
        Ok(raw) if raw.starts_with(b"\x89PNG") || raw.starts_with(&[0xFF, 0xD8]) => {
            decode(&raw, max_pixels)
        }
        _ => Err("the image is neither PNG nor JPEG (nor base64 of either)".into()),
    }
}

/// Refuses an empty image or one of more than `max_pixels` pixels.
pub fn check_size(width: usize, height: usize, max_pixels: usize) -> Result<(), String> {
    if width == 0 || height == 0 {
        return Err(format!("the image is empty ({width}×{height})"));
    }
    if width.saturating_mul(height) > max_pixels {
        return Err(format!(
            "the image has {width}×{height} pixels; the most is {max_pixels}"
        ));
    }
    Ok(())
}

fn decode_png(bytes: &[u8], max_pixels: usize) -> Result<Image, String> {
    let bad = |e: png::DecodingError| format!("bad PNG: {e}");
    let mut decoder = png::Decoder::new_with_limits(
        std::io::Cursor::new(bytes),
        png::Limits {
            bytes: max_pixels.saturating_mul(8),
        },
    );
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(bad)?;
    let (w, h) = {
        let info = reader.info();
        (info.width as usize, info.height as usize)
    };
    check_size(w, h, max_pixels)?;
    let size = reader.output_buffer_size().ok_or("the PNG is too large")?;
    let mut buf = zeroed(size)?;
    let frame = reader.next_frame(&mut buf).map_err(bad)?;
    let channels = frame.color_type.samples();
    let line = frame.line_size;
    let mut rgba = Vec::new();
    rgba.try_reserve_exact(w * h * 4)
        .map_err(|_| format!("cannot allocate the {w}×{h} image"))?;
    for y in 0..h {
        let row = &buf[y * line..y * line + w * channels];
        for px in row.chunks_exact(channels) {
            let (r, g, b, a) = match channels {
                1 => (px[0], px[0], px[0], 255),
                2 => (px[0], px[0], px[0], px[1]),
                3 => (px[0], px[1], px[2], 255),
                _ => (px[0], px[1], px[2], px[3]),
            };
            rgba.extend_from_slice(&[r, g, b, a]);
        }
    }
    from_rgba(w, h, &rgba, channels == 2 || channels == 4)
}

/// rapidocr's conversion: an image with alpha is composited as
/// `(alpha ? colour : 0) + (255 − alpha)`, saturating (white where transparent).
fn from_rgba(width: usize, height: usize, rgba: &[u8], alpha: bool) -> Result<Image, String> {
    let mut data = Vec::new();
    data.try_reserve_exact(rgb_len(width, height)?)
        .map_err(|_| format!("cannot allocate the {width}×{height} image"))?;
    for px in rgba.chunks_exact(4) {
        let (r, g, b, a) = (px[0], px[1], px[2], px[3]);
        if alpha {
            let keep = |v: u8| if a == 0 { 0 } else { v };
            let add = 255 - a;
            data.extend_from_slice(&[
                keep(b).saturating_add(add),
                keep(g).saturating_add(add),
                keep(r).saturating_add(add),
            ]);
        } else {
            data.extend_from_slice(&[b, g, r]);
        }
    }
    Ok(Image {
        width,
        height,
        data,
    })
}

fn decode_jpeg(bytes: &[u8], max_pixels: usize) -> Result<Image, String> {
    use zune_jpeg::zune_core::bytestream::ZCursor;
    use zune_jpeg::zune_core::colorspace::ColorSpace;
    use zune_jpeg::zune_core::options::DecoderOptions;
    let side = max_pixels.min(1 << 16);
    let options = DecoderOptions::default()
        .set_max_width(side)
        .set_max_height(side)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    decoder
        .decode_headers()
        .map_err(|e| format!("bad JPEG: {e:?}"))?;
    let (w, h) = decoder.dimensions().ok_or("bad JPEG: no dimensions")?;
    check_size(w, h, max_pixels)?;
    let rgb = decoder.decode().map_err(|e| format!("bad JPEG: {e:?}"))?;
    Image::from_rgb(w, h, &rgb)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn resize_matches_opencv_on_a_ramp() {
        // cv2.resize(np.array([[0, 100, 200, 250]]), (2, 1)) → [50, 225]; (8, 1)
        // upsampling → [0, 25, 75, 125, 175, 212.5→212, 238, 250] (OpenCV rounds
        // 212.5 to 213 with its fixed point; we accept ±1).
        let mut img = Image::new(4, 1).unwrap();
        for (x, v) in [0u8, 100, 200, 250].into_iter().enumerate() {
            img.data[x * 3..x * 3 + 3].fill(v);
        }
        let down = img.resize(2, 1).unwrap();
        assert_eq!((down.at(0, 0, 0), down.at(1, 0, 0)), (50, 225));
        let up = img.resize(8, 1).unwrap();
        let got: Vec<u8> = (0..8).map(|x| up.at(x, 0, 1)).collect();
        let want = [0u8, 25, 75, 125, 175, 213, 238, 250];
        for (g, w) in got.iter().zip(want) {
            assert!(g.abs_diff(w) <= 1, "{got:?}");
        }
    }

    #[test]
    fn rotations() {
        let mut img = Image::new(3, 2).unwrap();
        for (i, v) in img.data.iter_mut().enumerate() {
            *v = (i / 3) as u8;
        }
        // Pixels 0 1 2 / 3 4 5.
        let r = img.rotate_180().unwrap();
        assert_eq!((r.at(0, 0, 0), r.at(2, 1, 0)), (5, 0));
        let q = img.rotate_90_ccw().unwrap();
        assert_eq!((q.width, q.height), (2, 3));
        // np.rot90([[0,1,2],[3,4,5]]) = [[2,5],[1,4],[0,3]]
        let rows: Vec<u8> = (0..3)
            .flat_map(|y| (0..2).map(move |x| (x, y)))
            .map(|(x, y)| q.at(x, y, 0))
            .collect();
        assert_eq!(rows, vec![2, 5, 1, 4, 0, 3]);
    }

    #[test]
    fn refuses_what_is_not_an_image() {
        assert!(decode(b"hello", MAX_PIXELS).is_err());
        assert!(decode(b"\x89PNG broken", MAX_PIXELS).is_err());
    }
}
