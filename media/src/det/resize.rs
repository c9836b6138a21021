//! A frame (rgb24, rows top down) into the detector's input: bilinearly resized
//! (pixel centres aligned, as OpenCV's `INTER_LINEAR`), scaled to 0..=1 and
//! normalized by [`MEAN`](super::MEAN) and [`STD`](super::STD), in NCHW order.

use super::{MEAN, STD};

/// One output column's or row's two source taps and the second's weight.
#[derive(Debug, Clone, Copy)]
struct Tap {
    first: usize,
    second: usize,
    weight: f32,
}

fn taps(src: usize, dst: usize) -> Vec<Tap> {
    let scale = src as f32 / dst as f32;
    (0..dst)
        .map(|d| {
            let pos = ((d as f32 + 0.5) * scale - 0.5).clamp(0.0, (src - 1) as f32);
            let first = pos.floor() as usize;
            Tap {
                first,
                second: (first + 1).min(src - 1),
                weight: pos - first as f32,
            }
        })
        .collect()
}

/// Turns frames of one size into detector inputs of another; its tables are
/// computed once per session.
#[derive(Debug, Clone)]
pub struct Preprocessor {
    src: (usize, usize),
    dst: (usize, usize),
    cols: Vec<Tap>,
    rows: Vec<Tap>,
    /// `value * gain[c] + bias[c]` is `(value / 255 - MEAN[c]) / STD[c]`.
    gain: [f32; 3],
    bias: [f32; 3],
    /// One source row's two taps blended, per channel (the vertical pass).
    blend: Vec<f32>,
}

impl Preprocessor {
    /// For `src_w` × `src_h` frames into `dst_w` × `dst_h` inputs (all nonzero).
    pub fn new(src_w: u32, src_h: u32, dst_w: u32, dst_h: u32) -> Preprocessor {
        let (sw, sh) = (src_w.max(1) as usize, src_h.max(1) as usize);
        let (dw, dh) = (dst_w.max(1) as usize, dst_h.max(1) as usize);
        let gain = [0, 1, 2].map(|c| 1.0 / (255.0 * STD[c]));
        let bias = [0, 1, 2].map(|c| -MEAN[c] / STD[c]);
        Preprocessor {
            src: (sw, sh),
            dst: (dw, dh),
            cols: taps(sw, dw),
            rows: taps(sh, dh),
            gain,
            bias,
            blend: vec![0.0; sw * 3],
        }
    }

    /// The input's width and height.
    pub fn output_size(&self) -> (u32, u32) {
        (self.dst.0 as u32, self.dst.1 as u32)
    }

    /// Elements of one input: `3 × width × height`.
    pub fn output_len(&self) -> usize {
        3 * self.dst.0 * self.dst.1
    }

    /// Writes `rgb` (`src_w × src_h × 3` bytes) into `out` (`output_len()`
    /// elements, planes R, G, B). Panics on other lengths: the caller sizes both.
    pub fn run(&mut self, rgb: &[u8], out: &mut [f32]) {
        let (sw, sh) = self.src;
        let (dw, dh) = self.dst;
        assert_eq!(rgb.len(), sw * sh * 3, "frame length");
        assert_eq!(out.len(), 3 * dw * dh, "input length");
        let plane = dw * dh;
        let (gain, bias) = (self.gain, self.bias);
        if (sw, sh) == (dw, dh) {
            for (i, px) in rgb.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    out[c * plane + i] = f32::from(px[c]) * gain[c] + bias[c];
                }
            }
            return;
        }
        for (y, row) in self.rows.iter().enumerate() {
            let top = &rgb[row.first * sw * 3..(row.first + 1) * sw * 3];
            let bottom = &rgb[row.second * sw * 3..(row.second + 1) * sw * 3];
            let w = row.weight;
            for ((b, &t), &u) in self.blend.iter_mut().zip(top).zip(bottom) {
                *b = f32::from(t) + (f32::from(u) - f32::from(t)) * w;
            }
            let line = y * dw;
            for (x, col) in self.cols.iter().enumerate() {
                let (l, r) = (col.first * 3, col.second * 3);
                for c in 0..3 {
                    let left = self.blend[l + c];
                    let v = left + (self.blend[r + c] - left) * col.weight;
                    out[c * plane + line + x] = v * gain[c] + bias[c];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalized(v: u8, c: usize) -> f32 {
        (f32::from(v) / 255.0 - MEAN[c]) / STD[c]
    }

    #[test]
    fn same_size_only_normalizes_into_planes() {
        let rgb = [10u8, 20, 30, 200, 100, 0];
        let mut p = Preprocessor::new(2, 1, 2, 1);
        let mut out = vec![0.0; 6];
        p.run(&rgb, &mut out);
        let want = [
            normalized(10, 0),
            normalized(200, 0),
            normalized(20, 1),
            normalized(100, 1),
            normalized(30, 2),
            normalized(0, 2),
        ];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-5, "{out:?}");
        }
    }

    #[test]
    fn resizing_keeps_flat_areas_and_blends_edges() {
        // 4x2: left half black, right half white; to 2x1 and to 8x4.
        let mut rgb = vec![0u8; 4 * 2 * 3];
        for y in 0..2 {
            for x in 2..4 {
                rgb[(y * 4 + x) * 3..(y * 4 + x) * 3 + 3].fill(255);
            }
        }
        let mut down = Preprocessor::new(4, 2, 2, 1);
        let mut out = vec![0.0; down.output_len()];
        down.run(&rgb, &mut out);
        // Output pixel 0 samples source x = 0.5 (black), pixel 1 x = 2.5 (white).
        assert!((out[0] - normalized(0, 0)).abs() < 1e-5);
        assert!((out[1] - normalized(255, 0)).abs() < 1e-5);
        let mut up = Preprocessor::new(4, 2, 8, 4);
        let mut out = vec![0.0; up.output_len()];
        up.run(&rgb, &mut out);
        assert!((out[0] - normalized(0, 0)).abs() < 1e-5);
        assert!((out[7] - normalized(255, 0)).abs() < 1e-5);
        // Output x = 4 samples source x = 1.75, between the halves: a blend.
        let mid = out[4];
        assert!(mid > normalized(0, 0) && mid < normalized(255, 0), "{mid}");
        assert_eq!(up.output_size(), (8, 4));
    }
}
