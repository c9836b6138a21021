#!/usr/bin/env python3
"""Renders the OCR test images and reads each with the reference,
rapidocr_onnxruntime 1.4.4 (the package the PP-OCR models come from), with its
default settings. Writes OUT/<name>.png, its pixels as OUT/<name>.rgb (H × W × 3) and
OUT/reference.json: {"images": [{"name", "file", "rgb", "width", "height",
"lines": [{"box": [[x, y] x4], "text", "score"}]}]}.

usage: ocr_reference.py OUT [--fonts DIR] [--bench N]
  --bench N  also render N extra mixed images (bench-*.png) and skip the reference
"""
import argparse
import json
import os
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONTS = {
    "sans": "DejaVuSans.ttf",
    "serif": "DejaVuSerif.ttf",
    "mono": "DejaVuSansMono.ttf",
    "sans-bold": "DejaVuSans-Bold.ttf",
}


def font(fonts, name, size):
    return ImageFont.truetype(str(fonts / FONTS[name]), size)


def render(size, lines, fonts, flipped=()):
    """A white image with `lines` of (text, font, size, x, y) in black; the
    lines whose index is in `flipped` are drawn upside down."""
    img = Image.new("RGB", size, "white")
    for i, (text, face, points, x, y) in enumerate(lines):
        f = font(fonts, face, points)
        left, top, right, bottom = f.getbbox(text)
        line = Image.new("RGB", (right + 8, bottom + 8), "white")
        ImageDraw.Draw(line).text((4, 4), text, font=f, fill="black")
        if i in flipped:
            line = line.rotate(180)
        img.paste(line, (x, y))
    return img


def cases(fonts):
    return {
        "invoice": render(
            (640, 240),
            [
                ("Invoice 2026-118", "sans-bold", 32, 20, 20),
                ("Total due: 1,234.50 EUR", "sans", 24, 20, 90),
                ("Thank you for your order", "serif", 22, 20, 160),
            ],
            fonts,
        ),
        "sizes": render(
            (720, 300),
            [
                ("small print 42", "sans", 16, 30, 20),
                ("Medium Size Text", "serif", 28, 30, 70),
                ("LARGE 99", "sans-bold", 48, 30, 140),
                ("mono_spaced = 7;", "mono", 22, 30, 230),
            ],
            fonts,
        ),
        "two-columns": render(
            (800, 200),
            [
                ("left column", "sans", 26, 30, 40),
                ("right column", "serif", 26, 460, 40),
                ("second row here", "mono", 24, 30, 120),
            ],
            fonts,
        ),
        "upside-down": render(
            (640, 220),
            [
                ("This line reads normally", "sans", 28, 30, 30),
                ("This line is upside down", "sans", 28, 30, 130),
            ],
            fonts,
            flipped=(1,),
        ),
        "empty": Image.new("RGB", (320, 240), "white"),
    }


def bench_images(fonts, n):
    words = ["kiln", "serves", "models", "batching", "tensor", "queue", "worker", "2026",
             "latency", "OCR", "image", "text", "line", "server", "fast"]
    out = []
    for i in range(n):
        rows = []
        for r in range(3 + i % 4):
            text = " ".join(words[(i * 3 + r * 5 + k) % len(words)] for k in range(3 + (i + r) % 3))
            face = list(FONTS)[(i + r) % len(FONTS)]
            rows.append((text, face, 22 + (i + r) % 3 * 4, 20, 20 + r * 56))
        out.append((f"bench-{i}", render((720, 40 + len(rows) * 56), rows, fonts)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fonts", default="/usr/share/fonts/truetype/dejavu")
    ap.add_argument("--bench", type=int, default=0)
    args = ap.parse_args()
    out, fonts = Path(args.out), Path(args.fonts)
    out.mkdir(parents=True, exist_ok=True)
    if args.bench:
        for name, img in bench_images(fonts, args.bench):
            img.save(out / f"{name}.png")
        return
    from rapidocr_onnxruntime import RapidOCR

    engine = RapidOCR()
    images = []
    for name, img in cases(fonts).items():
        path = out / f"{name}.png"
        img.save(path)
        (out / f"{name}.rgb").write_bytes(img.tobytes())
        result, _ = engine(path.read_bytes())
        lines = [
            {"box": [[float(x), float(y)] for x, y in box], "text": text, "score": float(score)}
            for box, text, score in (result or [])
        ]
        images.append(
            {"name": name, "file": path.name, "rgb": f"{name}.rgb", "width": img.width,
             "height": img.height, "lines": lines}
        )
    (out / "reference.json").write_text(json.dumps({"images": images}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
