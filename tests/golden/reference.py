"""Reference outputs for kiln's ONNX golden tests.

Makes the test inputs (a page with text rendered into it, text-line crops), runs them through the reference onnxruntime Python package,
and writes inputs and outputs as raw little-endian files plus manifest.json.

Usage: python reference.py OUT_DIR MODEL_REPOSITORY

Silero VAD's reference (many streams, state carried) is silero_reference.py.
"""

import json
import pathlib
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageDraw, ImageFont

out = pathlib.Path(sys.argv[1])
models = pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
manifest = {"onnxruntime": ort.__version__, "cases": []}
DTYPES = {np.float32: "FP32", np.int64: "INT64"}


def session(name):
    return ort.InferenceSession(str(models / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


def save(array, stem):
    path = out / f"{stem}.bin"
    array.astype(array.dtype.newbyteorder("<")).tofile(path)
    return {"shape": list(array.shape), "datatype": DTYPES[array.dtype.type], "file": path.name}


def case(model, tag, inputs, sess):
    outputs = sess.run(None, inputs)
    names = [o.name for o in sess.get_outputs()]
    manifest["cases"].append({
        "model": model,
        "tag": tag,
        "inputs": [dict(name=n, **save(a, f"{tag}-in-{i}")) for i, (n, a) in enumerate(inputs.items())],
        "outputs": [dict(name=n, **save(a, f"{tag}-out-{i}")) for i, (n, a) in enumerate(zip(names, outputs))],
    })
    return outputs


def font(size):
    return ImageFont.load_default(size=size)


# A 640x640 page with three lines of text, normalized as PP-OCR's detector expects.
page = Image.new("RGB", (640, 640), "white")
draw = ImageDraw.Draw(page)
for i, text in enumerate(["kiln fires ware", "in batches 2026", "ONNX Runtime 1.31"]):
    draw.text((40, 60 + i * 110), text, fill="black", font=font(48))
mean = np.array([0.485, 0.456, 0.406], np.float32)
std = np.array([0.229, 0.224, 0.225], np.float32)
det_x = ((np.asarray(page, np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)
case("ocr-det", "det", {"x": det_x}, session("ocr-det"))


def line(text, width, flip=False):
    img = Image.new("RGB", (width, 48), "white")
    ImageDraw.Draw(img).text((6, 4), text, fill="black", font=font(34))
    if flip:
        img = img.rotate(180)
    return ((np.asarray(img, np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)


# The direction classifier: eight text lines, upright and upside down, each run alone.
cls = session("ocr-cls")
for i, (text, flip) in enumerate([("kiln", False), ("fires", True), ("ware 42", False), ("batch", True),
                                   ("ONNX", False), ("runtime", True), ("soft", False), ("hard", True)]):
    case("ocr-cls", f"cls{i}", {"x": line(text, 192, flip)}, cls)

# The recognizer on one text line 48x320.
case("ocr-rec", "rec", {"x": line("kiln 2026", 320)}, session("ocr-rec"))

(out / "manifest.json").write_text(json.dumps(manifest, indent=1))
