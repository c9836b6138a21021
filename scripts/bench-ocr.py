#!/usr/bin/env python3
"""The measuring half of scripts/bench-ocr: images per second for kiln (HTTP,
binary BYTES tensor) and rapidocr_onnxruntime (in-process threads), at 1 and 8
clients, then kiln's batch sizes per model from /metrics, and where an image's
time went at one client (kiln_compute_duration_seconds and
kiln_queue_duration_seconds per model, per image: the ocr worker's compute holds
its calls of the three models and its own work: decode, resize, boxes, crops,
copies)."""
import argparse
import http.client
import json
import re
import struct
import threading
import time
from pathlib import Path
from urllib.parse import urlparse


def connect(url):
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port)


def ocr_infer(conn, png):
    """One image to kiln's `ocr` over `conn`: the PNG as a binary BYTES tensor."""
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


def kiln_client(url, take):
    conn = connect(url)
    while (png := take()) is not None:
        ocr_infer(conn, png)


def rapid_client(engine, take):
    while (png := take()) is not None:
        engine(png)


def run(clients, images, passes):
    """Images per second for `clients` threads that share one work list: the image
    set `passes` times over, each image taken once by whichever client is free.
    Both sides do the same work: the set's images differ in cost by 100x (a label
    against an A4 page), so a timed window would count a different mix on each."""
    queue = iter([png for _ in range(passes) for png in images])
    lock = threading.Lock()
    failures = []

    def take():
        with lock:
            return None if failures else next(queue, None)

    def work_with(client):
        try:
            client(take)
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            failures.append(e)

    threads = [threading.Thread(target=work_with, args=(c,)) for c in clients]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return passes * len(images) / (time.perf_counter() - start)


def metrics(url):
    """kiln's /metrics text, read once for both parsers below."""
    conn = connect(url)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def batch_sizes(text):
    out = {}
    for model in ("ocr-det", "ocr-cls", "ocr-rec", "ocr"):
        s = re.search(rf'kiln_batch_size_sum{{[^}}]*model="{model}"[^}}]*}} (\S+)', text)
        c = re.search(rf'kiln_batch_size_count{{[^}}]*model="{model}"[^}}]*}} (\S+)', text)
        if s and c and float(c.group(1)) > 0:
            out[model] = (float(c.group(1)), float(s.group(1)) / float(c.group(1)))
    return out


def seconds_sums(text):
    out = {}
    for model in ("ocr-det", "ocr-cls", "ocr-rec", "ocr"):
        for kind in ("compute", "queue"):
            m = re.search(rf'kiln_{kind}_duration_seconds_sum{{[^}}]*model="{model}"[^}}]*}} (\S+)', text)
            out[(model, kind)] = float(m.group(1)) if m else 0.0
    m = re.search(r'kiln_requests_total{[^}]*model="ocr"[^}]*outcome="success"[^}]*} (\S+)', text)
    out["images"] = float(m.group(1)) if m else 0.0
    return out


def print_time_split(before, after):
    images = after["images"] - before["images"]
    if images <= 0:
        return
    print(f"where an image's time went at 1 client (ms per image, {images:.0f} images):")
    for model in ("ocr", "ocr-det", "ocr-cls", "ocr-rec"):
        c = (after[(model, "compute")] - before[(model, "compute")]) * 1000 / images
        q = (after[(model, "queue")] - before[(model, "queue")]) * 1000 / images
        print(f"  {model:<8} compute {c:7.1f}  queued {q:6.1f}")
    print("  (ocr's compute is the image's whole time in its worker; it sends a line's crops to")
    print("  ocr-cls and ocr-rec in several requests at once, so their queued times overlap)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("images")
    ap.add_argument("--url", required=True)
    ap.add_argument("--passes", type=int, default=1, help="times over the set per run")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kiln-only", action="store_true", help="skip rapidocr (A/B runs of kiln's configs)")
    args = ap.parse_args()
    images = [p.read_bytes() for p in sorted(Path(args.images).glob("bench-*.png"))]
    rows = []
    for clients in args.clients:
        # One warm-up pass over the images, then the measured run.
        warm = connect(args.url)
        for png in images:
            ocr_infer(warm, png)
        warm.close()
        text = metrics(args.url)
        before, times = batch_sizes(text), seconds_sums(text)
        kiln = run([lambda take: kiln_client(args.url, take)] * clients, images, args.passes)
        text = metrics(args.url)
        after = batch_sizes(text)
        rows.append(("kiln", clients, kiln))
        if clients == 1:
            print_time_split(times, seconds_sums(text))
        if clients == max(args.clients):
            print(f"kiln batch sizes in the {clients}-client run (requests per batch, mean):")
            for model, (count, mean) in after.items():
                c0, m0 = before.get(model, (0.0, 0.0))
                n = count - c0
                if n > 0:
                    print(f"  {model}: {n:.0f} batches, mean {(mean * count - m0 * c0) / n:.2f}")
    if not args.kiln_only:
        from rapidocr_onnxruntime import RapidOCR

        for clients in args.clients:
            engines = [RapidOCR() for _ in range(clients)]
            for png in images:
                engines[0](png)
            rapid = run([lambda take, e=e: rapid_client(e, take) for e in engines], images, args.passes)
            rows.append(("rapidocr_onnxruntime", clients, rapid))
    print(f"{'server':<22}{'clients':>8}{'images/s':>10}")
    for name, clients, rate in rows:
        print(f"{name:<22}{clients:>8}{rate:>10.2f}")
    by = {(n, c): r for n, c, r in rows}
    for c in args.clients:
        if ("rapidocr_onnxruntime", c) in by:
            print(f"kiln / rapidocr at {c} client(s): {by[('kiln', c)] / by[('rapidocr_onnxruntime', c)]:.2f}x")


if __name__ == "__main__":
    main()
