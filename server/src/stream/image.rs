//! Frames as pictures: JPEG and PNG decoded to 8-bit RGB, and RGB encoded as
//! JPEG. zune-jpeg decodes (SIMD, no C library), png is image-rs's decoder,
//! jpeg-encoder encodes; the `image` crate and its other formats are not needed.
//!
//! Each is CPU work of milliseconds for a 640×480 frame, so the session runs it on
//! actix's blocking pool, never on a connection's I/O thread (`session.rs`).

use std::io::Cursor;

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

/// Decodes a JPEG to RGB (grey and CMYK converted).
pub fn decode_jpeg(data: &[u8]) -> Result<Rgb, String> {
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut decoder = JpegDecoder::new_with_options(ZCursor::new(data), options);
    let pixels = decoder
        .decode()
        .map_err(|e| format!("not a JPEG image: {e}"))?;
    let info = decoder
        .info()
        .ok_or_else(|| "not a JPEG image: no header".to_owned())?;
    Rgb::new(info.width.into(), info.height.into(), pixels)
        .map_err(|e| format!("JPEG decoded to {e}"))
}

/// Decodes a PNG to RGB (grey, palette and alpha converted; 16-bit cut to 8).
pub fn decode_png(data: &[u8]) -> Result<Rgb, String> {
    let mut decoder = png::Decoder::new(Cursor::new(data));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder
        .read_info()
        .map_err(|e| format!("not a PNG image: {e}"))?;
    let (width, height) = {
        let info = reader.info();
        (info.width as usize, info.height as usize)
    };
    if width > MAX_SIDE || height > MAX_SIDE {
        return Err(format!(
            "a PNG image of {width}x{height}: at most {MAX_SIDE} on each side"
        ));
    }
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| "a PNG image too large to decode".to_owned())?;
    let mut buf = vec![0; size];
    let frame = reader
        .next_frame(&mut buf)
        .map_err(|e| format!("not a PNG image: {e}"))?;
    buf.truncate(frame.buffer_size());
    let pixels = match frame.color_type {
        png::ColorType::Rgb => buf,
        png::ColorType::Rgba => buf
            .chunks_exact(4)
            .flat_map(|p| [p[0], p[1], p[2]])
            .collect(),
        png::ColorType::Grayscale => buf.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => buf
            .chunks_exact(2)
            .flat_map(|p| [p[0], p[0], p[0]])
            .collect(),
        png::ColorType::Indexed => return Err("a PNG palette was not expanded".into()),
    };
    Rgb::new(width, height, pixels).map_err(|e| format!("PNG decoded to {e}"))
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
        let rgb = decode_jpeg(&jpeg).unwrap();
        assert_eq!((rgb.width, rgb.height), (64, 48));
        let worst = rgb
            .pixels
            .iter()
            .zip(&pixels)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        assert!(worst <= 12, "JPEG error {worst}");
    }

    #[test]
    fn png_grey_and_alpha_become_rgb() {
        let mut data = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut data, 2, 1);
            encoder.set_color(png::ColorType::GrayscaleAlpha);
            let mut writer = encoder.write_header().unwrap();
            writer.write_image_data(&[10, 255, 200, 0]).unwrap();
        }
        let rgb = decode_png(&data).unwrap();
        assert_eq!(rgb.pixels, vec![10, 10, 10, 200, 200, 200]);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for data in [&b""[..], b"not an image", &[0xFF, 0xD8, 0xFF, 0xC0, 0, 3]] {
            assert!(decode_jpeg(data).is_err());
            assert!(decode_png(data).is_err());
        }
        assert!(encode_jpeg(&[0; 3], 0, 1, 90).is_err());
        assert!(Rgb::new(2, 2, vec![0; 11]).is_err());
    }
}
