//! Text detection on video frames (PP-OCR det, `examples/models/ocr-det`): the
//! frame resized to multiples of 32 and normalized into the model's input
//! ([`Preprocessor`]), and the text boxes found in the model's probability map
//! ([`BoxFinder`]), in the source frame's pixels. Both keep their scratch memory
//! between frames: nothing is allocated per pixel, nor per frame once warm.

mod boxes;
mod resize;
mod step;

pub use boxes::{BoxFinder, BoxParams, TextBox};
pub use resize::Preprocessor;
pub use step::TextDetection;

/// The detector's input name.
pub const INPUT: &str = "x";

/// The longest side of the detector's input by default (PP-OCR's `limit_side_len`).
pub const DEFAULT_LIMIT_SIDE: u32 = 960;

/// PP-OCR det's normalization of RGB values in 0..=1: `(v - mean) / std`.
pub const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// See [`MEAN`].
pub const STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The detector's input size for a `width` × `height` frame: scaled down (never
/// up) so that its longer side is at most `limit_side`, each side then rounded to
/// the nearest multiple of 32, at least 32. A 640 × 480 frame stays 640 × 480.
pub fn input_size(width: u32, height: u32, limit_side: u32) -> (u32, u32) {
    let longer = width.max(height).max(1) as f32;
    let scale = (limit_side.max(32) as f32 / longer).min(1.0);
    let round = |side: u32| (((side as f32 * scale) / 32.0).round() as u32).max(1) * 32;
    (round(width), round(height))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_multiples_of_32_within_the_limit() {
        assert_eq!(input_size(640, 480, 960), (640, 480));
        assert_eq!(input_size(1920, 1080, 960), (960, 544));
        assert_eq!(input_size(100, 10, 960), (96, 32));
        assert_eq!(input_size(1, 1, 960), (32, 32));
        assert_eq!(input_size(3840, 2160, 640), (640, 352));
    }
}
