//! DB (Differentiable Binarization) post-processing of PP-OCR's detection map,
//! as rapidocr 1.4.4's `DBPostProcess` and `TextDetector` do it: threshold,
//! dilate (2×2), regions, their minimum-area rectangles, the mean probability
//! inside each ("fast" box score), the unclip (the polygon offset outward by
//! `area × ratio / perimeter`, round joins), the rectangle again, scaling back
//! to the image, clockwise corner order, clipping and the reading order.
//!
//! Regions are the 8-connected components of the dilated mask; a region's
//! minimum-area rectangle depends only on its convex hull, which is that of its
//! outer contour (what `cv2.findContours` gives). Holes (inner contours, which
//! `RETR_LIST` also lists) are not regions here: a text line's map has none
//! that would pass the box threshold.

/// A point (x, y).
pub type Point = [f64; 2];

/// The detection settings (rapidocr's `config.yaml`, `Det`).
#[derive(Debug, Clone, Copy)]
pub struct DbParams {
    pub thresh: f32,
    pub box_thresh: f64,
    pub max_candidates: usize,
    pub unclip_ratio: f64,
}

impl Default for DbParams {
    fn default() -> Self {
        DbParams {
            thresh: 0.3,
            box_thresh: 0.5,
            max_candidates: 1000,
            unclip_ratio: 1.6,
        }
    }
}

const MIN_SIZE: f64 = 3.0;

/// Text boxes (top-left, top-right, bottom-right, bottom-left, in pixels of a
/// `dest_w × dest_h` image) found in the `width × height` probability map `pred`.
pub fn boxes(
    pred: &[f32],
    width: usize,
    height: usize,
    dest_w: usize,
    dest_h: usize,
    params: &DbParams,
) -> Vec<[[f32; 2]; 4]> {
    let mask = dilate(
        &pred.iter().map(|&p| p > params.thresh).collect::<Vec<_>>(),
        width,
        height,
    );
    let mut found = Vec::new();
    for region in regions(&mask, width, height)
        .into_iter()
        .take(params.max_candidates)
    {
        let (points, side) = mini_box(&hull(region));
        if side < MIN_SIZE {
            continue;
        }
        if params.box_thresh > box_score(pred, width, height, &points) {
            continue;
        }
        let expanded = unclip(&points, params.unclip_ratio);
        let (points, side) = mini_box(&hull(expanded));
        if side < MIN_SIZE + 2.0 {
            continue;
        }
        // np.round (half to even), clipped, then int32.
        let scale = |v: f64, from: usize, to: usize| {
            (v / from as f64 * to as f64)
                .round_ties_even()
                .clamp(0.0, to as f64) as i32
        };
        let quad = points.map(|[x, y]| [scale(x, width, dest_w), scale(y, height, dest_h)]);
        if let Some(quad) = filter(quad, dest_w, dest_h) {
            found.push(quad);
        }
    }
    sort_reading_order(found)
}

/// `cv2.dilate` with a 2×2 kernel (anchor at its center, (1, 1)): a pixel is set
/// when it or its left, upper or upper-left neighbour is.
fn dilate(mask: &[bool], width: usize, height: usize) -> Vec<bool> {
    let mut out = vec![false; mask.len()];
    for y in 0..height {
        for x in 0..width {
            let at = |dx: usize, dy: usize| x >= dx && y >= dy && mask[(y - dy) * width + (x - dx)];
            out[y * width + x] = at(0, 0) || at(1, 0) || at(0, 1) || at(1, 1);
        }
    }
    out
}

/// The 8-connected components' pixels, as points, in scan order of their first
/// pixel.
fn regions(mask: &[bool], width: usize, height: usize) -> Vec<Vec<Point>> {
    let mut seen = vec![false; mask.len()];
    let mut out = Vec::new();
    let mut stack = Vec::new();
    for start in 0..mask.len() {
        if !mask[start] || seen[start] {
            continue;
        }
        seen[start] = true;
        stack.push(start);
        let mut pixels = Vec::new();
        while let Some(i) = stack.pop() {
            let (x, y) = ((i % width) as i64, (i / width) as i64);
            pixels.push([x as f64, y as f64]);
            for dy in -1..=1 {
                for dx in -1..=1 {
                    let (nx, ny) = (x + dx, y + dy);
                    if nx < 0 || ny < 0 || nx >= width as i64 || ny >= height as i64 {
                        continue;
                    }
                    let j = ny as usize * width + nx as usize;
                    if mask[j] && !seen[j] {
                        seen[j] = true;
                        stack.push(j);
                    }
                }
            }
        }
        out.push(pixels);
    }
    out
}

fn cross(o: Point, a: Point, b: Point) -> f64 {
    (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
}

/// The convex hull (Andrew's monotone chain), counter-clockwise in image
/// coordinates' sense of `cross`.
fn hull(mut points: Vec<Point>) -> Vec<Point> {
    points.sort_by(|a, b| a[0].total_cmp(&b[0]).then(a[1].total_cmp(&b[1])));
    points.dedup();
    if points.len() < 3 {
        return points;
    }
    let mut lower: Vec<Point> = Vec::new();
    for &p in &points {
        while lower.len() >= 2 && cross(lower[lower.len() - 2], lower[lower.len() - 1], p) <= 0.0 {
            lower.pop();
        }
        lower.push(p);
    }
    let mut upper: Vec<Point> = Vec::new();
    for &p in points.iter().rev() {
        while upper.len() >= 2 && cross(upper[upper.len() - 2], upper[upper.len() - 1], p) <= 0.0 {
            upper.pop();
        }
        upper.push(p);
    }
    lower.pop();
    upper.pop();
    lower.extend(upper);
    lower
}

/// The minimum-area rectangle around a convex hull: its four corners and its
/// two side lengths (rotating calipers over the hull's edges).
fn min_area_rect(hull: &[Point]) -> ([Point; 4], [f64; 2]) {
    if hull.is_empty() {
        return ([[0.0; 2]; 4], [0.0; 2]);
    }
    if hull.len() == 1 {
        return ([hull[0]; 4], [0.0; 2]);
    }
    let mut best: Option<(f64, [Point; 4], [f64; 2])> = None;
    for i in 0..hull.len() {
        let (a, b) = (hull[i], hull[(i + 1) % hull.len()]);
        let len = ((b[0] - a[0]).powi(2) + (b[1] - a[1]).powi(2)).sqrt();
        if len == 0.0 {
            continue;
        }
        let u = [(b[0] - a[0]) / len, (b[1] - a[1]) / len];
        let v = [-u[1], u[0]];
        let (mut lo_u, mut hi_u, mut lo_v, mut hi_v) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for p in hull {
            let pu = p[0] * u[0] + p[1] * u[1];
            let pv = p[0] * v[0] + p[1] * v[1];
            lo_u = lo_u.min(pu);
            hi_u = hi_u.max(pu);
            lo_v = lo_v.min(pv);
            hi_v = hi_v.max(pv);
        }
        let area = (hi_u - lo_u) * (hi_v - lo_v);
        if best.as_ref().is_none_or(|(b, _, _)| area < *b - 1e-9) {
            let corner = |cu: f64, cv: f64| [cu * u[0] + cv * v[0], cu * u[1] + cv * v[1]];
            let corners = [
                corner(lo_u, lo_v),
                corner(hi_u, lo_v),
                corner(hi_u, hi_v),
                corner(lo_u, hi_v),
            ];
            best = Some((area, corners, [hi_u - lo_u, hi_v - lo_v]));
        }
    }
    best.map_or(([hull[0]; 4], [0.0; 2]), |(_, c, s)| (c, s))
}

/// rapidocr's `get_mini_boxes`: the rectangle's corners ordered top-left,
/// top-right, bottom-right, bottom-left, and its shorter side.
fn mini_box(hull: &[Point]) -> ([Point; 4], f64) {
    let (mut corners, sides) = min_area_rect(hull);
    // Corners as float32, as cv2.boxPoints gives them.
    for c in &mut corners {
        *c = [c[0] as f32 as f64, c[1] as f32 as f64];
    }
    corners.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let (i1, i4) = if corners[1][1] > corners[0][1] {
        (0, 1)
    } else {
        (1, 0)
    };
    let (i2, i3) = if corners[3][1] > corners[2][1] {
        (2, 3)
    } else {
        (3, 2)
    };
    (
        [corners[i1], corners[i2], corners[i3], corners[i4]],
        sides[0].min(sides[1]),
    )
}

/// rapidocr's `box_score_fast`: the mean of `pred` over the pixels inside the
/// quadrilateral (its corners truncated to integers, as `fillPoly` gets them),
/// within its clipped bounding box.
fn box_score(pred: &[f32], width: usize, height: usize, quad: &[Point; 4]) -> f64 {
    let clip = |v: f64, hi: usize| (v as i64).clamp(0, hi as i64 - 1);
    let xmin = clip(
        quad.iter().map(|p| p[0]).fold(f64::MAX, f64::min).floor(),
        width,
    );
    let xmax = clip(
        quad.iter().map(|p| p[0]).fold(f64::MIN, f64::max).ceil(),
        width,
    );
    let ymin = clip(
        quad.iter().map(|p| p[1]).fold(f64::MAX, f64::min).floor(),
        height,
    );
    let ymax = clip(
        quad.iter().map(|p| p[1]).fold(f64::MIN, f64::max).ceil(),
        height,
    );
    let poly: Vec<Point> = quad
        .iter()
        .map(|p| [(p[0] as i64 - xmin) as f64, (p[1] as i64 - ymin) as f64])
        .collect();
    let (mut sum, mut count) = (0f64, 0usize);
    for y in ymin..=ymax {
        for x in xmin..=xmax {
            if inside(&poly, [(x - xmin) as f64, (y - ymin) as f64]) {
                sum += pred[y as usize * width + x as usize] as f64;
                count += 1;
            }
        }
    }
    if count == 0 {
        0.0
    } else {
        sum / count as f64
    }
}

/// Whether `p` lies inside the convex polygon or on its boundary.
fn inside(poly: &[Point], p: Point) -> bool {
    let (mut pos, mut neg) = (false, false);
    for i in 0..poly.len() {
        let c = cross(poly[i], poly[(i + 1) % poly.len()], p);
        pos |= c > 1e-9;
        neg |= c < -1e-9;
    }
    !(pos && neg)
}

/// The quadrilateral offset outward by `area × ratio / perimeter` with round
/// joins (pyclipper's `JT_ROUND`, arc tolerance 0.25, on integer coordinates).
fn unclip(quad: &[Point; 4], ratio: f64) -> Vec<Point> {
    let area = polygon_area(quad).abs();
    let perimeter: f64 = (0..4)
        .map(|i| {
            let (a, b) = (quad[i], quad[(i + 1) % 4]);
            ((b[0] - a[0]).powi(2) + (b[1] - a[1]).powi(2)).sqrt()
        })
        .sum();
    if perimeter == 0.0 {
        return quad.to_vec();
    }
    let distance = area * ratio / perimeter;
    // pyclipper takes integer coordinates (truncated).
    let pts: Vec<Point> = quad.iter().map(|p| [p[0].trunc(), p[1].trunc()]).collect();
    let sign = if polygon_area(&pts) >= 0.0 { 1.0 } else { -1.0 };
    // Arc steps per full turn for a 0.25 px tolerance (Clipper's formula).
    let steps = (std::f64::consts::PI / (1.0 - 0.25 / distance.max(0.25)).acos()).max(4.0);
    let step = 2.0 * std::f64::consts::PI / steps;
    let n = pts.len();
    let mut out = Vec::new();
    for i in 0..n {
        let (prev, cur, next) = (pts[(i + n - 1) % n], pts[i], pts[(i + 1) % n]);
        // Outward normals of the edges into and out of `cur`.
        let normal = |a: Point, b: Point| {
            let (dx, dy) = (b[0] - a[0], b[1] - a[1]);
            let len = (dx * dx + dy * dy).sqrt().max(1e-12);
            [sign * dy / len, -sign * dx / len]
        };
        let (n0, n1) = (normal(prev, cur), normal(cur, next));
        let a0 = n0[1].atan2(n0[0]);
        let mut a1 = n1[1].atan2(n1[0]);
        // Sweep the arc the outward way (the shorter one for a convex corner).
        let mut sweep = a1 - a0;
        while sweep > std::f64::consts::PI {
            sweep -= 2.0 * std::f64::consts::PI;
        }
        while sweep < -std::f64::consts::PI {
            sweep += 2.0 * std::f64::consts::PI;
        }
        a1 = a0 + sweep;
        let k = ((sweep.abs() / step).ceil() as usize).max(1);
        for j in 0..=k {
            let a = a0 + (a1 - a0) * j as f64 / k as f64;
            out.push([
                (cur[0] + distance * a.cos()).round(),
                (cur[1] + distance * a.sin()).round(),
            ]);
        }
    }
    out
}

fn polygon_area(p: &[Point]) -> f64 {
    let n = p.len();
    (0..n)
        .map(|i| p[i][0] * p[(i + 1) % n][1] - p[(i + 1) % n][0] * p[i][1])
        .sum::<f64>()
        / 2.0
}

/// rapidocr's `filter_tag_det_res`: corners in clockwise order from the top-left,
/// clipped into the image, and the box dropped when 3 px or less wide or high.
fn filter(quad: [[i32; 2]; 4], w: usize, h: usize) -> Option<[[f32; 2]; 4]> {
    let mut by_x = quad;
    by_x.sort_by_key(|p| p[0]);
    let (mut left, mut right) = ([by_x[0], by_x[1]], [by_x[2], by_x[3]]);
    left.sort_by_key(|p| p[1]);
    right.sort_by_key(|p| p[1]);
    let ordered = [left[0], right[0], right[1], left[1]];
    let clipped = ordered.map(|[x, y]| {
        [
            x.clamp(0, w as i32 - 1) as f32,
            y.clamp(0, h as i32 - 1) as f32,
        ]
    });
    let len =
        |a: [f32; 2], b: [f32; 2]| ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2)).sqrt() as i64;
    if len(clipped[0], clipped[1]) <= 3 || len(clipped[0], clipped[3]) <= 3 {
        return None;
    }
    Some(clipped)
}

/// rapidocr's `sorted_boxes`: top to bottom by the first corner, then, among
/// boxes less than 10 px apart vertically, left to right.
fn sort_reading_order(mut boxes: Vec<[[f32; 2]; 4]>) -> Vec<[[f32; 2]; 4]> {
    boxes.sort_by(|a, b| {
        a[0][1]
            .total_cmp(&b[0][1])
            .then(a[0][0].total_cmp(&b[0][0]))
    });
    for i in 0..boxes.len().saturating_sub(1) {
        for j in (0..=i).rev() {
            if (boxes[j + 1][0][1] - boxes[j][0][1]).abs() < 10.0
                && boxes[j + 1][0][0] < boxes[j][0][0]
            {
                boxes.swap(j, j + 1);
            } else {
                break;
            }
        }
    }
    boxes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map with one bright rectangle gives one box around it, grown by the
    /// unclip.
    #[test]
    fn one_rectangle_one_box() {
        let (w, h) = (64, 32);
        let mut pred = vec![0f32; w * h];
        for y in 10..20 {
            for x in 8..48 {
                pred[y * w + x] = 0.9;
            }
        }
        let found = boxes(&pred, w, h, w * 2, h * 2, &DbParams::default());
        assert_eq!(found.len(), 1, "{found:?}");
        let b = found[0];
        // The region spans x 8..=48 (dilated), y 10..=20; the unclip adds
        // area·1.6/perimeter ≈ 6.4 px; then ×2.
        assert!(b[0][0] < 8.0 * 2.0 && b[1][0] > 48.0 * 2.0, "{b:?}");
        assert!(b[0][1] < 10.0 * 2.0 && b[2][1] > 20.0 * 2.0, "{b:?}");
        assert!(b[0][0] <= b[1][0] && b[0][1] <= b[3][1]);
    }

    #[test]
    fn faint_or_tiny_regions_are_dropped() {
        let (w, h) = (32, 32);
        let mut pred = vec![0f32; w * h];
        // Above `thresh` but below `box_thresh` on average.
        for y in 4..14 {
            for x in 4..28 {
                pred[y * w + x] = 0.35;
            }
        }
        // A 2×2 speck.
        pred[20 * w + 20] = 0.9;
        assert!(boxes(&pred, w, h, w, h, &DbParams::default()).is_empty());
    }

    #[test]
    fn min_area_rect_of_a_rotated_square() {
        let pts = vec![[5.0, 0.0], [10.0, 5.0], [5.0, 10.0], [0.0, 5.0]];
        let (_, sides) = min_area_rect(&hull(pts));
        assert!((sides[0] - 50f64.sqrt()).abs() < 1e-9 && (sides[1] - 50f64.sqrt()).abs() < 1e-9);
    }

    #[test]
    fn reading_order() {
        let at = |x: f32, y: f32| [[x, y], [x + 5.0, y], [x + 5.0, y + 5.0], [x, y + 5.0]];
        let sorted = sort_reading_order(vec![at(50.0, 3.0), at(0.0, 40.0), at(10.0, 0.0)]);
        assert_eq!(sorted[0][0], [10.0, 0.0]);
        assert_eq!(sorted[1][0], [50.0, 3.0]);
        assert_eq!(sorted[2][0], [0.0, 40.0]);
    }
}
