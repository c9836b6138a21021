//! Frames as pictures: JPEG and PNG decoded to 8-bit RGB, and RGB encoded as
//! JPEG. zune-jpeg decodes (SIMD, no C library), png is image-rs's decoder,
//! jpeg-encoder encodes; the `image` crate and its other formats are not needed.
//!
//! Each is CPU work of milliseconds for a 640×480 frame, so the session runs it on
//! actix's blocking pool, never on a connection's I/O thread (`session.rs`).

use std::io::Cursor;
use std::sync::Arc;

use kiln_core::memory::client_bytes::{ClientBytes, Exhausted, Reservation, Use};

use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// The largest width or height a frame may have (a bound on a decoder's memory
/// before any pixel is decoded: 8192² RGB is 192 MiB).
pub const MAX_SIDE: usize = 8192;

/// An 8-bit RGB picture, row-major (`[height, width, 3]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rgb {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

impl Rgb {
    /// `pixels` as an RGB picture of `width`×`height` (checked: 3 bytes a pixel).
    pub fn new(width: usize, height: usize, pixels: Vec<u8>) -> Result<Rgb, String> {
        if width == 0 || height == 0 || pixels.len() != width * height * 3 {
            return Err(format!(
                "{} bytes is not an RGB picture of {width}x{height}",
                pixels.len()
            ));
        }
        Ok(Rgb {
            width,
            height,
            pixels,
        })
    }
}

/// Why a frame was not decoded.
#[derive(Debug)]
pub enum DecodeError {
    /// Not a picture kiln takes (a frame error).
    Invalid(String),
    /// Its pixels would pass the server's client-bytes budget (a frame dropped,
    /// reason `memory`).
    Exhausted(Exhausted),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Invalid(e) => f.write_str(e),
            DecodeError::Exhausted(e) => e.fmt(f),
        }
    }
}

impl From<Exhausted> for DecodeError {
    fn from(e: Exhausted) -> Self {
        DecodeError::Exhausted(e)
    }
}

fn invalid(e: impl Into<String>) -> DecodeError {
    DecodeError::Invalid(e.into())
}

/// Decodes a JPEG to RGB (grey and CMYK converted). The size comes from the
/// header; what decoding will allocate is reserved from `budget` before it is,
/// and the reservation returned holds the pixels' bytes.
pub fn decode_jpeg(
    data: &[u8],
    budget: &Arc<ClientBytes>,
) -> Result<(Rgb, Reservation), DecodeError> {
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut decoder = JpegDecoder::new_with_options(ZCursor::new(data), options);
    let not_jpeg = |e: zune_jpeg::errors::DecodeErrors| invalid(format!("not a JPEG image: {e}"));
    decoder.decode_headers().map_err(not_jpeg)?;
    let info = decoder
        .info()
        .ok_or_else(|| invalid("not a JPEG image: no header"))?;
    let (width, height) = (usize::from(info.width), usize::from(info.height));
    let size = decoder
        .output_buffer_size()
        .ok_or_else(|| invalid("not a JPEG image: no size"))?;
    // Beyond the output, zune-jpeg keeps a progressive image's coefficients whole
    // (an i16 per sample of each component, in 8-pixel blocks) and a baseline
    // image's rows of blocks (a 16-row MCU band per component, a few times over).
    let (w, h, c) = (
        width.next_multiple_of(16),
        height.next_multiple_of(16),
        usize::from(info.components),
    );
    let scratch = if info.sof.is_progressive() {
        w * h * c * 2
    } else {
        w * 16 * c * 8
    };
    let mut reservation = budget.reserve(Use::DecodedImage, size + scratch)?;
    let mut pixels = vec![0; size];
    decoder.decode_into(&mut pixels).map_err(not_jpeg)?;
    reservation.shrink_to(pixels.len());
    let rgb =
        Rgb::new(width, height, pixels).map_err(|e| invalid(format!("JPEG decoded to {e}")))?;
    Ok((rgb, reservation))
}

/// Decodes a PNG to RGB (grey, palette and alpha converted; 16-bit cut to 8),
/// reserving from `budget` as [`decode_jpeg`] does.
pub fn decode_png(
    data: &[u8],
    budget: &Arc<ClientBytes>,
) -> Result<(Rgb, Reservation), DecodeError> {
    let mut decoder = png::Decoder::new(Cursor::new(data));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder
        .read_info()
        .map_err(|e| invalid(format!("not a PNG image: {e}")))?;
    let (width, height) = {
        let info = reader.info();
        (info.width as usize, info.height as usize)
    };
    if width > MAX_SIDE || height > MAX_SIDE {
        return Err(invalid(format!(
            "a PNG image of {width}x{height}: at most {MAX_SIDE} on each side"
        )));
    }
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| invalid("a PNG image too large to decode"))?;
    let rgb_size = width * height * 3;
    // Grey (with or without alpha) becomes RGB in a second buffer; RGBA shrinks
    // in place.
    let grows = matches!(
        reader.output_color_type().0,
        png::ColorType::Grayscale | png::ColorType::GrayscaleAlpha
    );
    let mut reservation =
        budget.reserve(Use::DecodedImage, size + if grows { rgb_size } else { 0 })?;
    let mut buf = vec![0; size];
    let frame = reader
        .next_frame(&mut buf)
        .map_err(|e| invalid(format!("not a PNG image: {e}")))?;
    buf.truncate(frame.buffer_size());
    let pixels = match frame.color_type {
        png::ColorType::Rgb => buf,
        png::ColorType::Rgba => rgba_to_rgb(buf),
        png::ColorType::GrayscaleAlpha => buf
            .chunks_exact(2)
            .flat_map(|p| [p[0], p[0], p[0]])
            .collect(),
        png::ColorType::Grayscale => buf.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::Indexed => return Err(invalid("a PNG palette was not expanded")),
    };
    reservation.shrink_to(pixels.len());
    let rgb =
        Rgb::new(width, height, pixels).map_err(|e| invalid(format!("PNG decoded to {e}")))?;
    Ok((rgb, reservation))
}

/// RGBA pixels as RGB, in the same buffer: pixel i moves from 4i to 3i, so in
/// forward order no pixel is overwritten before it is read.
fn rgba_to_rgb(mut buf: Vec<u8>) -> Vec<u8> {
    let n = buf.len() / 4;
    for i in 0..n {
        buf.copy_within(4 * i..4 * i + 3, 3 * i);
    }
    buf.truncate(3 * n);
    buf
}

/// Encodes RGB pixels (`[height, width, 3]`) as a JPEG of `quality` (1–100).
pub fn encode_jpeg(
    pixels: &[u8],
    width: usize,
    height: usize,
    quality: u8,
) -> Result<Vec<u8>, String> {
    let (w, h) = match (u16::try_from(width), u16::try_from(height)) {
        (Ok(w), Ok(h)) if w > 0 && h > 0 => (w, h),
        _ => return Err(format!("cannot encode a JPEG of {width}x{height}")),
    };
    // JPEG compresses a frame some 10:1; start near that.
    let mut out = Vec::with_capacity(pixels.len() / 8 + 1024);
    jpeg_encoder::Encoder::new(&mut out, quality.clamp(1, 100))
        .encode(pixels, w, h, jpeg_encoder::ColorType::Rgb)
        .map_err(|e| format!("cannot encode a JPEG: {e}"))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(width: usize, height: usize) -> Vec<u8> {
        (0..width * height)
            .flat_map(|i| {
                let (x, y) = (i % width, i / width);
                [(x * 255 / width) as u8, (y * 255 / height) as u8, 128]
            })
            .collect()
    }

    #[test]
    fn jpeg_round_trip_keeps_the_picture() {
        let pixels = gradient(64, 48);
        let jpeg = encode_jpeg(&pixels, 64, 48, 95).unwrap();
        let budget = ClientBytes::new(1 << 20);
        let (rgb, held) = decode_jpeg(&jpeg, &budget).unwrap();
        assert_eq!((rgb.width, rgb.height), (64, 48));
        assert_eq!(
            held.amount(),
            64 * 48 * 3,
            "the reservation holds the pixels"
        );
        let worst = rgb
            .pixels
            .iter()
            .zip(&pixels)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        assert!(worst <= 12, "JPEG error {worst}");
    }

    fn png(width: u32, height: u32, color: png::ColorType, pixels: &[u8]) -> Vec<u8> {
        let mut data = Vec::new();
        let mut encoder = png::Encoder::new(&mut data, width, height);
        encoder.set_color(color);
        let mut writer = encoder.write_header().unwrap();
        writer.write_image_data(pixels).unwrap();
        writer.finish().unwrap();
        data
    }

    #[test]
    fn png_grey_and_alpha_become_rgb() {
        let budget = ClientBytes::new(1 << 20);
        let data = png(2, 1, png::ColorType::GrayscaleAlpha, &[10, 255, 200, 0]);
        let (rgb, _) = decode_png(&data, &budget).unwrap();
        assert_eq!(rgb.pixels, vec![10, 10, 10, 200, 200, 200]);
        let rgba = png(2, 1, png::ColorType::Rgba, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let (rgb, _) = decode_png(&rgba, &budget).unwrap();
        assert_eq!(rgb.pixels, vec![1, 2, 3, 5, 6, 7]);
    }

    /// A small PNG whose header says 8192×8192: refused by the budget before a
    /// pixel is allocated, holding nothing after.
    #[test]
    fn a_decode_bomb_is_refused_before_it_is_decoded() {
        let data = png(
            8192,
            8192,
            png::ColorType::Grayscale,
            &vec![255; 8192 * 8192],
        );
        assert!(data.len() < 200_000, "{} bytes", data.len());
        let budget = ClientBytes::new(64 << 20);
        match decode_png(&data, &budget) {
            Err(DecodeError::Exhausted(e)) => assert_eq!(e.what, Use::DecodedImage),
            other => panic!("{other:?}"),
        }
        // 24 MiB of pixels against 16 MiB.
        let jpeg = encode_jpeg(&vec![9; 4096 * 2048 * 3], 4096, 2048, 50).unwrap();
        let small = ClientBytes::new(16 << 20);
        assert!(matches!(
            decode_jpeg(&jpeg, &small),
            Err(DecodeError::Exhausted(_))
        ));
        assert_eq!(budget.held() + small.held(), 0);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let budget = ClientBytes::new(1 << 20);
        for data in [&b""[..], b"not an image", &[0xFF, 0xD8, 0xFF, 0xC0, 0, 3]] {
            assert!(decode_jpeg(data, &budget).is_err());
            assert!(decode_png(data, &budget).is_err());
        }
        assert_eq!(budget.held(), 0);
        assert!(encode_jpeg(&[0; 3], 0, 1, 90).is_err());
        assert!(Rgb::new(2, 2, vec![0; 11]).is_err());
    }
}
