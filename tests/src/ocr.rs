//! The OCR reference: `tests/golden/ocr_reference.py` renders the test images
//! (DejaVu fonts, `scripts/setup-ocr-test`) and reads them with
//! `rapidocr_onnxruntime` 1.4.4 (`scripts/setup-python`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::{cache_dir, repo_root};

/// A text line: its box (4 corners), text and confidence.
#[derive(Debug, Clone)]
pub struct Line {
    pub quad: [[f32; 2]; 4],
    pub text: String,
    pub score: f32,
}

/// A rendered image and what the reference read in it.
pub struct RefImage {
    pub name: String,
    pub png: PathBuf,
    /// Its pixels, RGB, `height × width × 3`.
    pub rgb: Vec<u8>,
    pub width: usize,
    pub height: usize,
    pub lines: Vec<Line>,
}

/// Runs the reference once per test process; the images and what it read.
pub fn reference() -> &'static [RefImage] {
    static REFERENCE: OnceLock<Vec<RefImage>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let python = cache_dir().join("venv/bin/python");
        assert!(
            python.is_file(),
            "{} is missing: run scripts/setup-python",
            python.display()
        );
        let dir = std::env::temp_dir().join(format!("kiln-ocr-{}", std::process::id()));
        let status = Command::new(python)
            .arg(repo_root().join("tests/golden/ocr_reference.py"))
            .arg(&dir)
            .status()
            .expect("run ocr_reference.py");
        assert!(
            status.success(),
            "ocr_reference.py failed (scripts/setup-ocr-test?)"
        );
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(dir.join("reference.json")).expect("reference"))
                .expect("reference JSON");
        manifest["images"]
            .as_array()
            .expect("images")
            .iter()
            .map(|img| RefImage {
                name: img["name"].as_str().expect("name").to_owned(),
                png: dir.join(img["file"].as_str().expect("file")),
                rgb: std::fs::read(dir.join(img["rgb"].as_str().expect("rgb"))).expect("rgb file"),
                width: img["width"].as_u64().expect("width") as usize,
                height: img["height"].as_u64().expect("height") as usize,
                lines: img["lines"]
                    .as_array()
                    .expect("lines")
                    .iter()
                    .map(|l| Line {
                        quad: corners(&l["box"]),
                        text: l["text"].as_str().expect("text").to_owned(),
                        score: l["score"].as_f64().expect("score") as f32,
                    })
                    .collect(),
            })
            .collect()
    })
}

fn corners(v: &Value) -> [[f32; 2]; 4] {
    let mut out = [[0f32; 2]; 4];
    for (i, p) in v.as_array().expect("box").iter().enumerate().take(4) {
        out[i] = [
            p[0].as_f64().expect("x") as f32,
            p[1].as_f64().expect("y") as f32,
        ];
    }
    out
}

/// The lines of an `ocr` answer's outputs (`boxes` FP32 [n, 4, 2], `texts`
/// BYTES [n] as 4-byte length-prefixed elements, `scores` FP32 [n]).
pub fn lines_of(boxes: &[f32], texts: &[u8], scores: &[f32]) -> Vec<Line> {
    let mut out = Vec::new();
    let mut offset = 0;
    for (i, score) in scores.iter().enumerate() {
        let len =
            u32::from_le_bytes(texts[offset..offset + 4].try_into().expect("prefix")) as usize;
        let text = String::from_utf8(texts[offset + 4..offset + 4 + len].to_vec()).expect("UTF-8");
        offset += 4 + len;
        let b = &boxes[i * 8..i * 8 + 8];
        out.push(Line {
            quad: [[b[0], b[1]], [b[2], b[3]], [b[4], b[5]], [b[6], b[7]]],
            text,
            score: *score,
        });
    }
    out
}
