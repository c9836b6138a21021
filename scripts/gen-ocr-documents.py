#!/usr/bin/env python3
"""Renders a varied set of documents for scripts/bench-ocr (#32): PNG pages from a
receipt (576 px wide, a 80 mm roll at ~180 dpi) to an A4 page at 150 dpi
(1240 x 1754), one line to a full page of lines, in several fonts of Debian's
fonts-dejavu-core (installed by scripts/setup-ocr-test): Sans, Serif, Mono, the
condensed faces and bold. White paper, black text, a left margin and varied line
spacing; seeded, so the same N gives the same set. Not the golden-test images:
different sizes, fonts, words and layouts.

usage: gen-ocr-documents.py OUT N [--fonts DIR] [--seed S]   (writes OUT/bench-*.png)
"""
import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONTS = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSansCondensed.ttf",
         "DejaVuSerifCondensed.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif-Bold.ttf"]
WORDS = ("invoice total amount due date customer order number item quantity price tax "
         "subtotal paid balance account reference delivery address street city postal "
         "code phone email thank you for your purchase receipt store card cash change "
         "coffee bread milk apples cheese water tea sugar butter rice pasta soap").split()
# (name, width, height range, lines range, font size range)
LAYOUTS = [
    ("receipt", 576, (300, 1400), (1, 30), (18, 28)),
    ("label", 800, (120, 300), (1, 3), (28, 48)),
    ("letter", 1240, (600, 1754), (3, 40), (18, 30)),
    ("a4", 1240, (1754, 1754), (10, 55), (16, 24)),
]


def line(rng, layout):
    if layout == "receipt" and rng.random() < 0.6:
        item = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        return f"{item.upper() if rng.random() < 0.3 else item}  {rng.randint(0, 99)}.{rng.randint(0, 99):02d}"
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 9))]
    if rng.random() < 0.3:
        words.append(str(rng.randint(1, 99999)))
    text = " ".join(words)
    return text[:1].upper() + text[1:]


def document(rng, fonts):
    name, width, (hmin, hmax), (lmin, lmax), (smin, smax) = rng.choice(LAYOUTS)
    size = rng.randint(smin, smax)
    font = ImageFont.truetype(str(fonts / rng.choice(FONTS)), size)
    spacing = int(size * rng.uniform(1.4, 2.2))
    margin = rng.randint(16, 80) if width > 600 else rng.randint(8, 24)
    lines = rng.randint(lmin, lmax)
    height = max(rng.randint(hmin, hmax), 2 * margin + lines * spacing)
    height = min(height, 1754) if name != "receipt" else height
    lines = min(lines, (height - 2 * margin) // spacing)
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    y = margin
    for _ in range(max(lines, 1)):
        text = line(rng, name)
        while text and draw.textlength(text, font=font) > width - 2 * margin:
            text = text.rsplit(" ", 1)[0] if " " in text else text[:-1]
        draw.text((margin, y), text, fill="black", font=font)
        y += spacing
    return name, img


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("n", type=int)
    ap.add_argument("--fonts", default="/usr/share/fonts/truetype/dejavu")
    ap.add_argument("--seed", type=int, default=32)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for i in range(args.n):
        name, img = document(rng, Path(args.fonts))
        img.save(out / f"bench-{i:03d}-{name}-{img.width}x{img.height}.png")


if __name__ == "__main__":
    main()
