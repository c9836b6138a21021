"""kiln over REST, driven by NVIDIA's tritonclient.http."""

from multiprocessing import shared_memory

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import accumulate_input, echo_multi_arrays, fill_queue_then_refuse


@pytest.fixture(scope="module")
def client(http_url):
    c = httpclient.InferenceServerClient(http_url)
    yield c
    c.close()


def echo_multi_inputs(binary):
    (a, b, c), expected = echo_multi_arrays()
    inputs = [
        httpclient.InferInput("INPUT0", list(a.shape), "UINT32"),
        httpclient.InferInput("INPUT1", list(b.shape), "FP32"),
        httpclient.InferInput("INPUT2", list(c.shape), "BYTES"),
    ]
    for i, array in zip(inputs, (a, b, c)):
        i.set_data_from_numpy(array, binary_data=binary)
    return inputs, expected


def echo_input(values, name="INPUT0", binary=True):
    array = np.array([values], dtype=np.uint32)
    i = httpclient.InferInput(name, list(array.shape), "UINT32")
    i.set_data_from_numpy(array, binary_data=binary)
    return i


def assert_status(error, status):
    assert isinstance(error, InferenceServerException), error
    assert error.status() == str(status), (error.status(), error.message())


def test_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("echo-multi")
    meta = client.get_server_metadata()
    assert meta["name"] == "kiln"
    assert "binary_tensor_data" in meta["extensions"]
    meta = client.get_model_metadata("echo-multi")
    assert meta["platform"] == "kiln_echo-multi"
    assert [i["datatype"] for i in meta["inputs"]] == ["UINT32", "FP32", "BYTES"]
    assert meta["inputs"][0]["shape"] == [-1, -1]


def test_model_config(client):
    config = client.get_model_config("echo")
    assert config["name"] == "echo"
    assert config["backend"] == "echo"
    assert config["input"][0]["data_type"] == "TYPE_UINT32"
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 4096
    assert config["parameters"]["batcher"]["string_value"] == "soft"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer(client, binary):
    inputs, expected = echo_multi_inputs(binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in expected]
    result = client.infer("echo-multi", inputs, outputs=outputs, request_id="h1")
    assert result.get_response()["id"] == "h1"
    if not binary:
        # BYTES travel as JSON strings, and tritonclient gives them back as str.
        expected["OUTPUT2"] = np.array([["nlik", ""]], dtype=np.object_)
    for name, want in expected.items():
        got = result.as_numpy(name)
        np.testing.assert_array_equal(got, want)
        if want.dtype != np.object_:
            assert got.dtype == want.dtype, (name, got.dtype)
    result = client.infer("echo", [echo_input([1, 2], binary=binary)], parameters={"increment": 3})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[4, 5]])


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client, algorithm):
    """tritonclient's request compression (Content-Encoding), JSON and binary bodies."""
    for binary in (False, True):
        inputs, expected = echo_multi_inputs(binary)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in expected]
        result = client.infer("echo-multi", inputs, outputs=outputs,
                              request_compression_algorithm=algorithm,
                              response_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected["OUTPUT0"])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT2"), expected["OUTPUT2"])


def test_statistics(client):
    def count():
        stats = client.get_inference_statistics("echo-multi")["model_stats"]
        return stats[0]["inference_stats"]["success"]["count"]

    before = count()
    inputs, _ = echo_multi_inputs(True)
    for _ in range(4):
        client.infer("echo-multi", inputs)
    assert count() - before == 4
    names = [s["name"] for s in client.get_inference_statistics()["model_stats"]]
    assert "echo" in names and "echo-multi" in names


def test_repository(client):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["echo-repo"]["state"] in ("UNAVAILABLE", "READY")
    client.load_model("echo-repo")
    assert client.is_model_ready("echo-repo")
    result = client.infer("echo-repo", [echo_input([7])])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[8]])
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["echo-repo"]["state"] == "READY"
    client.unload_model("echo-repo")
    assert not client.is_model_ready("echo-repo")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["echo-repo"]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException) as e:
        client.load_model("nope")
    assert_status(e.value, 404)


def test_system_shared_memory(client):
    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        values = np.array([[4, 5]], dtype=np.uint32)
        np.ndarray(values.shape, np.uint32, buffer=shm.buf)[:] = values
        client.register_system_shared_memory("http-io", "/" + shm.name, 64)
        status = {r["name"]: r for r in client.get_system_shared_memory_status()}
        assert status["http-io"]["byte_size"] == 64
        i = httpclient.InferInput("INPUT0", [1, 2], "UINT32")
        i.set_shared_memory("http-io", 8)
        o = httpclient.InferRequestedOutput("OUTPUT0")
        o.set_shared_memory("http-io", 8, offset=8)
        result = client.infer("echo", [i], outputs=[o])
        output = result.get_output("OUTPUT0")
        assert "data" not in output and "parameters" not in output, output
        got = np.ndarray((1, 2), np.uint32, buffer=shm.buf, offset=8).copy()
        np.testing.assert_array_equal(got, values + 1)
    finally:
        client.unregister_system_shared_memory()
        shm.close()
        shm.unlink()


def test_errors(client):
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", [echo_input([1])])
    assert_status(e.value, 404)
    assert "no model `nope`" in e.value.message()
    flat = httpclient.InferInput("INPUT0", [3], "UINT32")
    flat.set_data_from_numpy(np.array([1, 2, 3], dtype=np.uint32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("echo", [flat])
    assert_status(e.value, 400)
    assert "expected shape [-1, -1]" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.get_model_config("nope")
    assert_status(e.value, 404)
    i = httpclient.InferInput("INPUT0", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[-2]], dtype=np.int32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("faulty", [i])
    assert_status(e.value, 500)


def test_queue_full(http_url):
    """As over gRPC: a refused request is a 429."""

    def send(key, value):
        c = httpclient.InferenceServerClient(http_url)
        i = httpclient.InferInput("INPUT0", [1, 1], "INT32")
        i.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        try:
            return {key: c.infer("faulty", [i]).as_numpy("OUTPUT0")}
        except InferenceServerException as e:
            return {key: e}
        finally:
            c.close()

    results = fill_queue_then_refuse(send)
    assert_status(results["refused"], 429)
    np.testing.assert_array_equal(results["q2"], [[2]])


def test_sequences(client):
    """tritonclient's sequence arguments (string and integer ids) over REST."""
    config = client.get_model_config("accumulate")
    assert config["sequence_batching"]["state"][0]["output_name"] == "STATE_OUT"
    assert [i["name"] for i in config["input"]] == ["INPUT"]
    def step(seq, value, **flags):
        r = client.infer("accumulate", [accumulate_input(httpclient, value)], sequence_id=seq, **flags)
        return float(r.as_numpy("OUTPUT")[0][0]), r.as_numpy("CONTROLS").tolist()[0]
    assert step(5, 1.5, sequence_start=True) == (1.5, [1, 0, 1])
    assert step(5, 2.0) == (3.5, [0, 0, 1])
    assert step(5, 0.5, sequence_end=True) == (4.0, [0, 1, 1])
    with pytest.raises(InferenceServerException) as e:
        step(5, 1.0)
    assert_status(e.value, 400)
    assert "sequence 5 is not active" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("accumulate", [accumulate_input(httpclient, 1.0)])
    assert_status(e.value, 400)
    assert "sequence_id" in e.value.message()
