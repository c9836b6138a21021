"""The reference for scripts/bench-stream-text: PP-OCR det (the same model file)
in onnxruntime in Python on the same frames of the generated video, pre-processed
as kiln does (RGB / 255, PP-OCR's mean and std, NCHW; 640x480 stays 640x480),
with T threads sharing one session (onnxruntime's defaults), each thread a
"session" sending its next frame when the last is answered.

Per frame: pre-processing and inference (no box extraction: kiln's per-frame time
also holds JPEG-free frame decoding, box extraction and the WebSocket round trip).

Usage: python bench-stream-text-reference.py MODEL VIDEO THREADS SECONDS
Prints one JSON line: {"sessions", "fps", "p50_ms", "p99_ms", "frames"}.
"""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import onnxruntime as ort

model, video, threads, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
raw = subprocess.run(
    ["ffmpeg", "-nostdin", "-loglevel", "error", "-i", video, "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"],
    check=True, capture_output=True).stdout
frames = np.frombuffer(raw, np.uint8).reshape(-1, 480, 640, 3)
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
name = session.get_inputs()[0].name
mean = np.array([0.485, 0.456, 0.406], np.float32)
std = np.array([0.229, 0.224, 0.225], np.float32)


def detect(frame):
    x = ((frame.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)[None]
    return session.run(None, {name: np.ascontiguousarray(x)})[0]


for i in range(3):  # warm-up
    detect(frames[i])
latencies = [[] for _ in range(threads)]
stop = time.perf_counter() + seconds


def run(t):
    i = t * 37
    while time.perf_counter() < stop:
        start = time.perf_counter()
        detect(frames[i % len(frames)])
        latencies[t].append(time.perf_counter() - start)
        i += 1


began = time.perf_counter()
workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
elapsed = time.perf_counter() - began
all_ms = np.array(sorted(x * 1000 for lat in latencies for x in lat))
print(json.dumps({
    "sessions": threads,
    "fps": len(all_ms) / elapsed,
    "p50_ms": float(np.percentile(all_ms, 50)),
    "p99_ms": float(np.percentile(all_ms, 99)),
    "frames": len(all_ms),
}))
