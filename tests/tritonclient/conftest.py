"""Fixtures for the tritonclient compatibility tests.

tests/tests/tritonclient.rs starts kiln and runs these with pytest, passing:

- KILN_HTTP_URL, KILN_GRPC_URL: the servers as HOST:PORT (tritonclient's form);
- KILN_PROTO_DESCRIPTOR: kiln's proto/inference.proto compiled to a FileDescriptorSet.

kiln serves: `echo-multi` (UINT32, FP32 -> FP64 doubled, BYTES reversed), `echo`
(UINT32 + 1), `faulty` (INT32; -2 fails, -3 takes 1 s; one buffer set and a queue of
three, to fill), `accumulate` (a running sum kept as a sequence's implicit state,
reporting its control inputs; sequence batcher), and a model repository holding `pipe`
(tests/fixtures/triton/pipe.config.pbtxt, over `echo`) and `echo-repo` (worker echo, versions 1
and 2), not loaded.
"""

import os
import threading
import time
import urllib.request

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


def faulty_metric(name, outcome=None):
    """The value of kiln's metric `name` (with `outcome`, if given) for the model
    `faulty` (0 when absent)."""
    url = "http://{}/metrics".format(os.environ["KILN_HTTP_URL"])
    with urllib.request.urlopen(url) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        labels = line.split("{", 1)[-1]
        if (
            line.startswith(name + "{")
            and 'model="faulty"' in labels
            and (outcome is None or 'outcome="{}"'.format(outcome) in labels)
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def faulty_accepted():
    """How many requests `faulty` has accepted in all: pending plus answered."""
    return (
        faulty_metric("kiln_pending_requests")
        + faulty_metric("kiln_requests_total", "success")
        + faulty_metric("kiln_requests_total", "failure")
    )


def wait_until(condition, what):
    """Waits (up to about 10 s) until `condition()` holds: ordering by what the
    server has seen, not by sleeping."""
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("never happened: " + what)


def fill_queue_then_refuse(send):
    """Drives `faulty` (one buffer set, a queue of three) to a full queue: a request
    that takes 1 s holds the set, then requests `q1`, `q2`, ... are sent one at a
    time, each once the server has accepted the one before, until one is refused.
    The queue bound counts every request accepted and not yet in a batch (the one
    a batcher holds while it waits for the set too), so exactly three are accepted.
    `send(key, value)` sends one request and returns `{key: its result or
    error}`; returns them all, the refused one under `refused`."""
    results = {}
    threads = []

    def start(key, value):
        t = threading.Thread(target=lambda: results.update(send(key, value)))
        t.start()
        threads.append(t)

    batches = faulty_metric("kiln_batch_size_count")
    start("running", -3)
    wait_until(lambda: faulty_metric("kiln_batch_size_count") > batches, "the slow batch runs")
    before = faulty_accepted()
    for value in range(1, 5):
        key = "q{}".format(value)
        start(key, value)
        wait_until(
            lambda: key in results or faulty_accepted() == before + value,
            key + " accepted or refused",
        )
        if key in results:
            results["refused"] = results.pop(key)
            break
    for t in threads:
        t.join()
    assert "refused" in results, "no request was refused"
    assert value - 1 == 3, "a queue of 3 accepted {}".format(value - 1)
    return results


def accumulate_input(client_module, value):
    """`accumulate`'s one input, INPUT FP32 [1, 1]."""
    array = np.array([[value]], dtype=np.float32)
    i = client_module.InferInput("INPUT", list(array.shape), "FP32")
    i.set_data_from_numpy(array)
    return i
