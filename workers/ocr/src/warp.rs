//! Cutting a text line out of the image: the perspective transform that maps a
//! quadrilateral onto an upright rectangle (OpenCV's `getPerspectiveTransform`),
//! sampled bicubically with replicated borders (`warpPerspective` with
//! `INTER_CUBIC`, `BORDER_REPLICATE`), as rapidocr's `get_rotate_crop_image`.

use crate::image::Image;

/// A 3×3 homography, row-major, `h[8] = 1`.
pub type Homography = [f64; 9];

/// The homography mapping each `from[i]` onto `to[i]`; `None` when degenerate.
pub fn perspective(from: &[[f64; 2]; 4], to: &[[f64; 2]; 4]) -> Option<Homography> {
    // The 8 unknowns a..h of x' = (ax + by + c) / (gx + hy + 1), y' likewise.
    let mut m = [[0f64; 9]; 8];
    for i in 0..4 {
        let ([x, y], [u, v]) = (from[i], to[i]);
        m[i] = [x, y, 1.0, 0.0, 0.0, 0.0, -x * u, -y * u, u];
        m[i + 4] = [0.0, 0.0, 0.0, x, y, 1.0, -x * v, -y * v, v];
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..8 {
        let pivot = (col..8).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col];
        for (row, r) in m.iter_mut().enumerate() {
            if row != col {
                let f = r[col] / pivot_row[col];
                for (v, p) in r[col..].iter_mut().zip(&pivot_row[col..]) {
                    *v -= f * p;
                }
            }
        }
    }
    let mut h = [0f64; 9];
    for (i, (hi, row)) in h.iter_mut().zip(&m).enumerate() {
        *hi = row[8] / row[i];
    }
    h[8] = 1.0;
    Some(h)
}

/// OpenCV's bicubic weights (a = −0.75) for a fraction `t` in [0, 1).
fn cubic(t: f32) -> [f32; 4] {
    const A: f32 = -0.75;
    let w0 = ((A * (t + 1.0) - 5.0 * A) * (t + 1.0) + 8.0 * A) * (t + 1.0) - 4.0 * A;
    let w1 = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0;
    let w2 = ((A + 2.0) * (1.0 - t) - (A + 3.0)) * (1.0 - t) * (1.0 - t) + 1.0;
    [w0, w1, w2, 1.0 - w0 - w1 - w2]
}

/// The `width × height` image whose pixel (x, y) is `src` at `h · (x, y, 1)`.
pub fn warp(src: &Image, h: &Homography, width: usize, height: usize) -> Result<Image, String> {
    let mut out = Image::new(width, height)?;
    if src.width == 0 || src.height == 0 {
        return Ok(out);
    }
    let clamp_x = |x: i64| x.clamp(0, src.width as i64 - 1) as usize;
    let clamp_y = |y: i64| y.clamp(0, src.height as i64 - 1) as usize;
    for y in 0..height {
        for x in 0..width {
            let (xf, yf) = (x as f64, y as f64);
            let w = h[6] * xf + h[7] * yf + h[8];
            let w = if w.abs() > f64::EPSILON { 1.0 / w } else { 0.0 };
            let sx = (h[0] * xf + h[1] * yf + h[2]) * w;
            let sy = (h[3] * xf + h[4] * yf + h[5]) * w;
            // OpenCV quantizes the source position to 1/32 of a pixel.
            let qx = (sx * 32.0).round() as i64;
            let qy = (sy * 32.0).round() as i64;
            let (ix, iy) = (qx.div_euclid(32), qy.div_euclid(32));
            let wx = cubic(qx.rem_euclid(32) as f32 / 32.0);
            let wy = cubic(qy.rem_euclid(32) as f32 / 32.0);
            for c in 0..3 {
                let mut acc = 0f32;
                for (j, wyj) in wy.iter().enumerate() {
                    let yy = clamp_y(iy - 1 + j as i64);
                    let mut row = 0f32;
                    for (i, wxi) in wx.iter().enumerate() {
                        row += src.at(clamp_x(ix - 1 + i as i64), yy, c) as f32 * wxi;
                    }
                    acc += row * wyj;
                }
                out.data[(y * width + x) * 3 + c] = acc.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
    Ok(out)
}

fn corners(quad: &[[f32; 2]; 4]) -> [[f64; 2]; 4] {
    quad.map(|[x, y]| [x as f64, y as f64])
}

/// The width and height of the line [`crop_line`] cuts out of `quad` (before
/// any turn): what the pipeline checks against its limit first.
pub fn crop_size(quad: &[[f32; 2]; 4]) -> (usize, usize) {
    let p = corners(quad);
    let dist = |a: [f64; 2], b: [f64; 2]| ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2)).sqrt();
    // Lengths in f32, as NumPy computes them on the float32 box.
    let width = dist(p[0], p[1]).max(dist(p[2], p[3])) as f32 as usize;
    let height = dist(p[0], p[3]).max(dist(p[1], p[2])) as f32 as usize;
    (width, height)
}

/// The text line inside `quad` (top-left, top-right, bottom-right, bottom-left),
/// upright; turned 90° counter-clockwise when it is at least 1.5× taller than
/// wide (a vertical line), as rapidocr does.
pub fn crop_line(img: &Image, quad: &[[f32; 2]; 4]) -> Result<Image, String> {
    let p = corners(quad);
    let (width, height) = crop_size(quad);
    let (w, h) = (width as f64, height as f64);
    let rect = [[0.0, 0.0], [w, 0.0], [w, h], [0.0, h]];
    let line = match perspective(&rect, &p) {
        Some(m) if width > 0 && height > 0 => warp(img, &m, width, height)?,
        _ => Image::new(width.max(1), height.max(1))?,
    };
    if line.height as f64 / line.width as f64 >= 1.5 {
        line.rotate_90_ccw()
    } else {
        Ok(line)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn perspective_maps_the_corners() {
        let from = [[0.0, 0.0], [10.0, 0.0], [10.0, 5.0], [0.0, 5.0]];
        let to = [[3.0, 4.0], [23.0, 6.0], [22.0, 16.0], [2.0, 14.0]];
        let h = perspective(&from, &to).unwrap();
        for (f, t) in from.iter().zip(&to) {
            let w = h[6] * f[0] + h[7] * f[1] + h[8];
            let x = (h[0] * f[0] + h[1] * f[1] + h[2]) / w;
            let y = (h[3] * f[0] + h[4] * f[1] + h[5]) / w;
            assert!((x - t[0]).abs() < 1e-9 && (y - t[1]).abs() < 1e-9);
        }
    }

    #[test]
    fn cubic_weights_sum_to_one_and_interpolate() {
        for t in [0.0, 0.25, 0.5, 0.9] {
            let w = cubic(t);
            assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        assert_eq!(cubic(0.0), [0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn an_axis_aligned_crop_copies_pixels() {
        let mut img = Image::new(20, 10).unwrap();
        for (i, v) in img.data.iter_mut().enumerate() {
            *v = (i % 251) as u8;
        }
        let line = crop_line(&img, &[[2.0, 3.0], [12.0, 3.0], [12.0, 7.0], [2.0, 7.0]]).unwrap();
        assert_eq!((line.width, line.height), (10, 4));
        for y in 0..4 {
            for x in 0..10 {
                assert_eq!(line.at(x, y, 1), img.at(x + 2, y + 3, 1));
            }
        }
    }
}
