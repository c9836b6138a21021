"""Fixtures for the tritonclient compatibility tests.

tests/tests/tritonclient.rs starts kiln and runs these with pytest, passing:

- KILN_HTTP_URL, KILN_GRPC_URL: the servers as HOST:PORT (tritonclient's form);
- KILN_PROTO_DESCRIPTOR: kiln's proto/inference.proto compiled to a FileDescriptorSet.

kiln serves: `echo-multi` (UINT32, FP32 -> FP64 doubled, BYTES reversed), `echo`
(UINT32 + 1), `faulty` (INT32; -2 fails, -3 takes 1 s; one buffer set and a queue of
three, to fill), `accumulate` (a running sum kept as a sequence's implicit state,
reporting its control inputs; sequence batcher), and a model repository holding `echo-repo` (worker echo, versions 1
and 2), not loaded.
"""

import os
import threading
import time

import numpy as np
import pytest


@pytest.fixture(scope="session")
def http_url():
    return os.environ["KILN_HTTP_URL"]


@pytest.fixture(scope="session")
def grpc_url():
    return os.environ["KILN_GRPC_URL"]


@pytest.fixture(scope="session")
def descriptor_path():
    return os.environ["KILN_PROTO_DESCRIPTOR"]


def echo_multi_arrays():
    """Inputs of echo-multi and the outputs they give."""
    a = np.array([[1, 2, 3]], dtype=np.uint32)
    b = np.array([[0.5, -1.0]], dtype=np.float32)
    c = np.array([[b"kiln", b""]], dtype=np.object_)
    expected = {
        "OUTPUT0": a + 1,
        "OUTPUT1": (b * 2).astype(np.float64),
        "OUTPUT2": np.array([[b"nlik", b""]], dtype=np.object_),
    }
    return (a, b, c), expected


def fill_queue_then_refuse(send):
    """Drives `faulty` (one buffer set, a queue of three) to a full queue: a request
    that takes 1 s holds the set, a second waits for it in the batcher (counted in
    the queue), two more fill the queue, and the next is refused at once. `send(key, value)` sends one
    request and returns `{key: its result or error}`; all five are returned."""
    results = {}
    threads = []
    for key, value in [("running", -3), ("blocked", -3), ("q1", 1), ("q2", 2)]:
        t = threading.Thread(target=lambda k=key, v=value: results.update(send(k, v)))
        t.start()
        threads.append(t)
        time.sleep(0.2)
    results.update(send("refused", 9))
    for t in threads:
        t.join()
    return results


def accumulate_input(client_module, value):
    """`accumulate`'s one input, INPUT FP32 [1, 1]."""
    array = np.array([[value]], dtype=np.float32)
    i = client_module.InferInput("INPUT", list(array.shape), "FP32")
    i.set_data_from_numpy(array)
    return i
