#!/usr/bin/env python3
"""The measuring half of scripts/bench-ocr: images per second for kiln (HTTP,
binary BYTES tensor) and rapidocr_onnxruntime (in-process threads), at 1 and 8
clients, then kiln's batch sizes per model from /metrics."""
import argparse
import http.client
import json
import re
import struct
import threading
import time
from pathlib import Path
from urllib.parse import urlparse


def kiln_client(url, images, stop, counts, i):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port)
    n = 0
    k = i
    while not stop.is_set():
        png = images[k % len(images)]
        k += 1
        header = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                                         "parameters": {"binary_data_size": len(png) + 4}}],
                             "outputs": [{"name": "texts"}, {"name": "boxes"}, {"name": "scores"}]}).encode()
        body = header + struct.pack("<I", len(png)) + png
        conn.request("POST", "/v2/models/ocr/infer", body,
                     {"Inference-Header-Content-Length": str(len(header)),
                      "Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"kiln answered {r.status}: {data[:200]!r}")
        n += 1
    counts[i] = n


def rapid_client(images, stop, counts, i, engines):
    engine = engines[i]
    n = 0
    k = i
    while not stop.is_set():
        engine(images[k % len(images)])
        k += 1
        n += 1
    counts[i] = n


def run(target, clients, seconds):
    stop = threading.Event()
    counts = [0] * clients
    threads = [threading.Thread(target=target, args=(stop, counts, i)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def batch_sizes(url):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {}
    for model in ("ocr-det", "ocr-cls", "ocr-rec", "ocr"):
        s = re.search(rf'kiln_batch_size_sum{{model="{model}"}} (\S+)', text)
        c = re.search(rf'kiln_batch_size_count{{model="{model}"}} (\S+)', text)
        if s and c and float(c.group(1)) > 0:
            out[model] = (float(c.group(1)), float(s.group(1)) / float(c.group(1)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("images")
    ap.add_argument("--url", required=True)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    images = [p.read_bytes() for p in sorted(Path(args.images).glob("bench-*.png"))]
    rows = []
    for clients in args.clients:
        # One warm-up pass over the images, then the measured run.
        for png in images:
            kiln_client_once(args.url, png)
        before = batch_sizes(args.url)
        kiln = run(lambda stop, counts, i: kiln_client(args.url, images, stop, counts, i), clients, args.seconds)
        after = batch_sizes(args.url)
        rows.append(("kiln", clients, kiln))
        if clients == max(args.clients):
            print(f"kiln batch sizes in the {clients}-client run (requests per batch, mean):")
            for model, (count, mean) in after.items():
                c0, m0 = before.get(model, (0.0, 0.0))
                n = count - c0
                if n > 0:
                    print(f"  {model}: {n:.0f} batches, mean {(mean * count - m0 * c0) / n:.2f}")
    from rapidocr_onnxruntime import RapidOCR

    for clients in args.clients:
        engines = [RapidOCR() for _ in range(clients)]
        for png in images:
            engines[0](png)
        rapid = run(lambda stop, counts, i: rapid_client(images, stop, counts, i, engines), clients, args.seconds)
        rows.append(("rapidocr_onnxruntime", clients, rapid))
    print(f"{'server':<22}{'clients':>8}{'images/s':>10}")
    for name, clients, rate in rows:
        print(f"{name:<22}{clients:>8}{rate:>10.2f}")
    by = {(n, c): r for n, c, r in rows}
    for c in args.clients:
        print(f"kiln / rapidocr at {c} client(s): {by[('kiln', c)] / by[('rapidocr_onnxruntime', c)]:.2f}x")


def kiln_client_once(url, png):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port)
    header = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(png) + 4}}]}).encode()
    conn.request("POST", "/v2/models/ocr/infer", header + struct.pack("<I", len(png)) + png,
                 {"Inference-Header-Content-Length": str(len(header))})
    r = conn.getresponse()
    r.read()
    if r.status != 200:
        raise RuntimeError(f"kiln answered {r.status}")


if __name__ == "__main__":
    main()
