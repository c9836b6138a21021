//! Text boxes from the detector's probability map, as PP-OCR's DB post-processing
//! finds them, axis-aligned: pixels above `threshold`, grouped into 8-connected
//! components; a component of at least `min_area` pixels whose mean probability
//! reaches `box_threshold` gives its bounding box, grown by DB's unclip distance
//! (`area × unclip_ratio / perimeter`: the model predicts shrunk text kernels) and
//! scaled to the source frame's pixels.

/// The thresholds of box extraction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoxParams {
    /// A pixel is text above this probability (PP-OCR: 0.3).
    pub threshold: f32,
    /// A component's mean probability must reach this (PaddleOCR's `det_db_box_thresh`: 0.6).
    pub box_threshold: f32,
    /// Fewest pixels of the map a component needs.
    pub min_area: u32,
    /// DB's unclip ratio (PP-OCR: 1.5 to 2.0).
    pub unclip_ratio: f32,
    /// Most boxes returned for one frame (the largest components are not
    /// preferred: the first found, top to bottom).
    pub max_boxes: usize,
}

impl Default for BoxParams {
    fn default() -> Self {
        BoxParams {
            threshold: 0.3,
            box_threshold: 0.6,
            min_area: 16,
            unclip_ratio: 1.5,
            max_boxes: 1000,
        }
    }
}

/// One text box in the source frame's pixels: `x0..x1` × `y0..y1` (ends
/// exclusive), and the component's mean probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextBox {
    pub x0: u32,
    pub y0: u32,
    pub x1: u32,
    pub y1: u32,
    pub score: f32,
}

/// Finds boxes; keeps its label map and stack between frames.
#[derive(Debug, Default)]
pub struct BoxFinder {
    seen: Vec<bool>,
    stack: Vec<u32>,
}

/// A component's extent and probability sum while it is filled.
struct Extent {
    x0: usize,
    y0: usize,
    x1: usize,
    y1: usize,
    count: u32,
    sum: f32,
}

impl BoxFinder {
    /// Boxes of `map` (`width × height` probabilities, rows top down) in a
    /// `src_w × src_h` frame, appended to `out` (cleared first).
    pub fn find(
        &mut self,
        map: &[f32],
        (width, height): (u32, u32),
        (src_w, src_h): (u32, u32),
        params: &BoxParams,
        out: &mut Vec<TextBox>,
    ) {
        out.clear();
        let (w, h) = (width as usize, height as usize);
        if w == 0 || h == 0 || map.len() < w * h {
            return;
        }
        self.seen.clear();
        self.seen.resize(w * h, false);
        let sx = src_w as f32 / w as f32;
        let sy = src_h as f32 / h as f32;
        for start in 0..w * h {
            if self.seen[start] || map[start] <= params.threshold {
                continue;
            }
            let e = self.fill(map, w, h, start, params.threshold);
            if e.count < params.min_area || e.sum / (e.count as f32) < params.box_threshold {
                continue;
            }
            let (bw, bh) = ((e.x1 - e.x0 + 1) as f32, (e.y1 - e.y0 + 1) as f32);
            let d = bw * bh * params.unclip_ratio / (2.0 * (bw + bh));
            let scale = |v: f32, s: f32, max: u32| ((v * s).round().max(0.0) as u32).min(max);
            out.push(TextBox {
                x0: scale(e.x0 as f32 - d, sx, src_w),
                y0: scale(e.y0 as f32 - d, sy, src_h),
                x1: scale(e.x1 as f32 + 1.0 + d, sx, src_w),
                y1: scale(e.y1 as f32 + 1.0 + d, sy, src_h),
                score: e.sum / e.count as f32,
            });
            if out.len() >= params.max_boxes {
                return;
            }
        }
    }

    /// Marks the 8-connected component of `start` seen and measures it.
    fn fill(&mut self, map: &[f32], w: usize, h: usize, start: usize, threshold: f32) -> Extent {
        let mut e = Extent {
            x0: usize::MAX,
            y0: usize::MAX,
            x1: 0,
            y1: 0,
            count: 0,
            sum: 0.0,
        };
        self.stack.clear();
        self.seen[start] = true;
        self.stack.push(start as u32);
        while let Some(i) = self.stack.pop() {
            let i = i as usize;
            let (x, y) = (i % w, i / w);
            e.x0 = e.x0.min(x);
            e.x1 = e.x1.max(x);
            e.y0 = e.y0.min(y);
            e.y1 = e.y1.max(y);
            e.count += 1;
            e.sum += map[i];
            for ny in y.saturating_sub(1)..=(y + 1).min(h - 1) {
                for nx in x.saturating_sub(1)..=(x + 1).min(w - 1) {
                    let n = ny * w + nx;
                    if !self.seen[n] && map[n] > threshold {
                        self.seen[n] = true;
                        self.stack.push(n as u32);
                    }
                }
            }
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map_with(w: usize, h: usize, rects: &[(usize, usize, usize, usize, f32)]) -> Vec<f32> {
        let mut map = vec![0.01; w * h];
        for &(x0, y0, x1, y1, p) in rects {
            for y in y0..y1 {
                map[y * w + x0..y * w + x1].fill(p);
            }
        }
        map
    }

    #[test]
    fn two_text_regions_give_two_boxes_in_source_pixels() {
        let map = map_with(64, 32, &[(4, 4, 24, 8, 0.9), (30, 20, 60, 28, 0.8)]);
        let params = BoxParams {
            unclip_ratio: 0.0,
            ..BoxParams::default()
        };
        let mut out = Vec::new();
        BoxFinder::default().find(&map, (64, 32), (128, 64), &params, &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!((out[0].x0, out[0].y0, out[0].x1, out[0].y1), (8, 8, 48, 16));
        assert_eq!(
            (out[1].x0, out[1].y0, out[1].x1, out[1].y1),
            (60, 40, 120, 56)
        );
        assert!((out[0].score - 0.9).abs() < 1e-5);
    }

    #[test]
    fn unclip_grows_a_box_and_stays_inside_the_frame() {
        let map = map_with(32, 32, &[(0, 10, 20, 14, 0.9)]);
        let mut out = Vec::new();
        BoxFinder::default().find(&map, (32, 32), (32, 32), &BoxParams::default(), &mut out);
        // 20 x 4: d = 80 * 1.5 / 48 = 2.5.
        assert_eq!((out[0].x0, out[0].y0, out[0].x1, out[0].y1), (0, 8, 23, 17));
    }

    #[test]
    fn blank_noise_and_weak_regions_give_no_box() {
        let mut finder = BoxFinder::default();
        let mut out = vec![TextBox {
            x0: 1,
            y0: 1,
            x1: 2,
            y1: 2,
            score: 1.0,
        }];
        finder.find(
            &map_with(32, 32, &[]),
            (32, 32),
            (32, 32),
            &BoxParams::default(),
            &mut out,
        );
        assert!(out.is_empty());
        // 3x3 specks (under min_area) and a faint region (mean under box_threshold).
        let map = map_with(32, 32, &[(2, 2, 5, 5, 0.9), (10, 10, 30, 20, 0.4)]);
        finder.find(&map, (32, 32), (32, 32), &BoxParams::default(), &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn diagonal_pixels_join_and_max_boxes_caps() {
        let mut map = vec![0.0; 16 * 16];
        for i in 0..16 {
            map[i * 16 + i] = 0.9;
        }
        let params = BoxParams {
            min_area: 1,
            unclip_ratio: 0.0,
            ..BoxParams::default()
        };
        let mut out = Vec::new();
        BoxFinder::default().find(&map, (16, 16), (16, 16), &params, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].x1, out[0].y1), (16, 16));
        let map = map_with(
            32,
            8,
            &[(0, 0, 1, 1, 0.9), (4, 0, 5, 1, 0.9), (8, 0, 9, 1, 0.9)],
        );
        let capped = BoxParams {
            max_boxes: 2,
            ..params
        };
        BoxFinder::default().find(&map, (32, 8), (32, 8), &capped, &mut out);
        assert_eq!(out.len(), 2);
    }
}
