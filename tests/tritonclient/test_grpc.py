"""kiln over gRPC, driven by NVIDIA's tritonclient.grpc."""

import queue
from multiprocessing import shared_memory

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import descriptor_pb2, descriptor_pool
from tritonclient.grpc import model_config_pb2, service_pb2  # noqa: F401 (registers)
from tritonclient.utils import InferenceServerException

from conftest import accumulate_input, echo_multi_arrays, fill_queue_then_refuse


@pytest.fixture(scope="module")
def client(grpc_url):
    c = grpcclient.InferenceServerClient(grpc_url)
    yield c
    c.close()


def echo_multi_inputs():
    (a, b, c), expected = echo_multi_arrays()
    inputs = [
        grpcclient.InferInput("INPUT0", list(a.shape), "UINT32"),
        grpcclient.InferInput("INPUT1", list(b.shape), "FP32"),
        grpcclient.InferInput("INPUT2", list(c.shape), "BYTES"),
    ]
    for i, array in zip(inputs, (a, b, c)):
        i.set_data_from_numpy(array)
    return inputs, expected


def echo_input(values, name="INPUT0"):
    array = np.array([values], dtype=np.uint32)
    i = grpcclient.InferInput(name, list(array.shape), "UINT32")
    i.set_data_from_numpy(array)
    return i


def assert_code(error, code):
    assert isinstance(error, InferenceServerException), error
    assert error.status() == f"StatusCode.{code}", (error.status(), error.message())


def test_health(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("echo-multi")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("echo-multi", "2")


def test_server_metadata(client):
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "kiln"
    assert "model_repository" in meta["extensions"]
    assert "statistics" in meta["extensions"]


def test_model_metadata(client):
    meta = client.get_model_metadata("echo-multi", as_json=True)
    assert meta["name"] == "echo-multi"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "kiln_echo-multi"
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}
    assert inputs["INPUT0"][0] == "UINT32"
    assert inputs["INPUT1"][0] == "FP32"
    assert inputs["INPUT2"][0] == "BYTES"
    assert all(shape[0] == "-1" for _, shape in inputs.values())  # int64 in JSON: strings
    outputs = {o["name"]: o["datatype"] for o in meta["outputs"]}
    assert outputs == {"OUTPUT0": "UINT32", "OUTPUT1": "FP64", "OUTPUT2": "BYTES"}


def test_model_config(client):
    config = client.get_model_config("echo").config
    assert config.name == "echo"
    assert config.platform == "kiln_echo"
    assert config.backend == "echo"
    assert config.max_batch_size > 0
    assert config.input[0].name == "INPUT0"
    assert config.input[0].data_type == model_config_pb2.TYPE_UINT32
    assert list(config.input[0].dims) == [-1]
    assert config.output[0].data_type == model_config_pb2.TYPE_UINT32
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert config.instance_group[0].count == 1
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 4096
    assert config.parameters["batcher"].string_value == "soft"
    as_json = client.get_model_config("echo-multi", as_json=True)["config"]
    types = [i["data_type"] for i in as_json["input"]]
    assert types == ["TYPE_UINT32", "TYPE_FP32", "TYPE_STRING"]


def test_infer_unary(client):
    inputs, expected = echo_multi_inputs()
    result = client.infer("echo-multi", inputs, request_id="unary-1")
    assert result.get_response().id == "unary-1"
    assert result.get_response().model_name == "echo-multi"
    for name, want in expected.items():
        got = result.as_numpy(name)
        assert got.dtype == want.dtype or want.dtype == np.object_, (name, got.dtype)
        np.testing.assert_array_equal(got, want)
    # Only the outputs asked for.
    outputs = [grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("echo-multi", inputs, outputs=outputs)
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT0") is None
    # Request parameters reach the worker.
    result = client.infer("echo", [echo_input([1, 2])], parameters={"increment": 10})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[11, 12]])


def test_infer_async(client):
    done = queue.Queue()
    for i in range(20):
        client.async_infer(
            "echo",
            [echo_input([i])],
            callback=lambda result, error: done.put((result, error)),
            request_id=str(i),
        )
    seen = {}
    for _ in range(20):
        result, error = done.get(timeout=10)
        assert error is None, error
        seen[result.get_response().id] = result.as_numpy("OUTPUT0")[0][0]
    assert seen == {str(i): i + 1 for i in range(20)}


def test_stream(client):
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(50):
            client.async_stream_infer("echo", [echo_input([i, 2 * i])], request_id=f"s{i}")
        for i in range(50):
            result, error = answers.get(timeout=10)
            assert error is None, error
            assert result.get_response().id == f"s{i}"  # answered in order
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[i + 1, 2 * i + 1]])
        # A refused request answers with an error; the stream goes on.
        client.async_stream_infer("nope", [echo_input([1])], request_id="bad")
        result, error = answers.get(timeout=10)
        assert result is None
        assert "no model `nope`" in error.message()
        inputs, expected = echo_multi_inputs()
        client.async_stream_infer("echo-multi", inputs, request_id="multi")
        result, error = answers.get(timeout=10)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUTPUT2"), expected["OUTPUT2"])
    finally:
        client.stop_stream()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client, algorithm):
    """tritonclient's request compression (grpc-encoding), unary and streaming."""
    inputs, expected = echo_multi_inputs()
    result = client.infer("echo-multi", inputs, compression_algorithm=algorithm)
    for name, want in expected.items():
        np.testing.assert_array_equal(result.as_numpy(name), want)
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        compression_algorithm=algorithm)
    try:
        client.async_stream_infer("echo", [echo_input([1, 2])])
        result, error = answers.get(timeout=10)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[2, 3]])
    finally:
        client.stop_stream()


def test_sequences_over_a_stream(client):
    """Two sequences interleaved on one stream, with tritonclient's own sequence
    arguments: each keeps its own running sum and sees its own control values."""
    config = client.get_model_config("accumulate").config
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"
    controls = {c.name: c.control[0].kind for c in config.sequence_batching.control_input}
    assert set(controls) == {"START", "END", "READY", "CORRID"}
    assert config.sequence_batching.state[0].input_name == "STATE"
    assert [i.name for i in config.input] == ["INPUT"]
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        steps = [(11, 1.0, True, False), (22, 10.0, True, False), (11, 2.0, False, False),
                 (22, 20.0, False, True), (11, 3.0, False, True)]
        for seq, value, start, end in steps:
            client.async_stream_infer("accumulate", [accumulate_input(grpcclient, value)],
                                      sequence_id=seq, sequence_start=start, sequence_end=end)
        got = [answers.get(timeout=10) for _ in steps]
        assert all(error is None for _, error in got), got
        sums = [float(r.as_numpy("OUTPUT")[0][0]) for r, _ in got]
        assert sums == [1.0, 10.0, 3.0, 30.0, 6.0]
        assert [int(r.as_numpy("CORRID_OUT")[0][0]) for r, _ in got] == [11, 22, 11, 22, 11]
        assert got[3][0].as_numpy("CONTROLS").tolist() == [[0, 1, 1]]
        # Sequence 22 has ended: a step without a start is refused on the stream.
        client.async_stream_infer("accumulate", [accumulate_input(grpcclient, 1.0)],
                                  sequence_id=22)
        result, error = answers.get(timeout=10)
        assert result is None and "not active" in error.message()
    finally:
        client.stop_stream()


def test_statistics(client):
    def count():
        stats = client.get_inference_statistics("echo-multi").model_stats
        assert [s.name for s in stats] == ["echo-multi"]
        return stats[0].inference_stats.success.count, stats[0].inference_count

    before = count()
    inputs, _ = echo_multi_inputs()
    for _ in range(3):
        client.infer("echo-multi", inputs)
    after = count()
    assert after[0] - before[0] == 3
    assert after[1] - before[1] == 3
    stats = client.get_inference_statistics(as_json=True)["model_stats"]
    names = [s["name"] for s in stats]
    assert names == sorted(names) and "echo" in names and "echo-multi" in names
    s = next(s for s in stats if s["name"] == "echo-multi")
    assert int(s["inference_stats"]["compute_infer"]["count"]) >= 3
    assert s["batch_stats"], s


def test_repository(client):
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["echo-repo"].state == "UNAVAILABLE"
    assert index["echo-repo"].version == "2"
    client.load_model("echo-repo")
    assert client.is_model_ready("echo-repo")
    assert client.get_model_metadata("echo-repo").versions == ["2"]
    result = client.infer("echo-repo", [echo_input([5])])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[6]])
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["echo-repo"].state == "READY"
    client.unload_model("echo-repo")
    assert not client.is_model_ready("echo-repo")
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["echo-repo"].state == "UNAVAILABLE"
    with pytest.raises(InferenceServerException) as e:
        client.load_model("nope")
    assert_code(e.value, "NOT_FOUND")


def test_errors(client):
    cases = [
        ("nope", [echo_input([1])], "NOT_FOUND", "no model `nope`"),
        ("echo", [echo_input([1], name="X")], "INVALID_ARGUMENT", "unknown input `X`"),
    ]
    flat = grpcclient.InferInput("INPUT0", [3], "UINT32")
    flat.set_data_from_numpy(np.array([1, 2, 3], dtype=np.uint32))
    cases.append(("echo", [flat], "INVALID_ARGUMENT", "expected shape [-1, -1]"))
    floats = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
    floats.set_data_from_numpy(np.array([[1, 2]], dtype=np.float32))
    cases.append(("echo", [floats], "INVALID_ARGUMENT", "expected datatype UINT32"))
    for model, inputs, code, text in cases:
        with pytest.raises(InferenceServerException) as e:
            client.infer(model, inputs)
        assert_code(e.value, code)
        assert text in e.value.message(), e.value.message()
    for call in (client.get_model_metadata, client.get_model_config):
        with pytest.raises(InferenceServerException) as e:
            call("nope")
        assert_code(e.value, "NOT_FOUND")
    with pytest.raises(InferenceServerException) as e:
        client.infer("faulty", [faulty_input(-2)])
    assert_code(e.value, "INTERNAL")


def faulty_input(value):
    i = grpcclient.InferInput("INPUT0", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return i


def test_queue_full(grpc_url):
    def send(key, value):
        c = grpcclient.InferenceServerClient(grpc_url)
        try:
            return {key: c.infer("faulty", [faulty_input(value)]).as_numpy("OUTPUT0")}
        except InferenceServerException as e:
            return {key: e}
        finally:
            c.close()

    results = fill_queue_then_refuse(send)
    assert_code(results["refused"], "RESOURCE_EXHAUSTED")
    assert "queue of 3 is full" in results["refused"].message()
    np.testing.assert_array_equal(results["q1"], [[1]])
    np.testing.assert_array_equal(results["q2"], [[2]])


def test_system_shared_memory(client):
    """Input and output in a POSIX shared-memory object (as tritonclient's own
    shared_memory utilities make one: /dev/shm/<name>, registered as /<name>)."""
    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        values = np.array([[7, 8, 9]], dtype=np.uint32)
        np.ndarray(values.shape, np.uint32, buffer=shm.buf, offset=16)[:] = values
        client.register_system_shared_memory("io", "/" + shm.name, 64)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["io"]["key"] == "/" + shm.name
        assert int(status["io"]["byte_size"]) == 64
        i = grpcclient.InferInput("INPUT0", [1, 3], "UINT32")
        i.set_shared_memory("io", 12, offset=16)
        o = grpcclient.InferRequestedOutput("OUTPUT0")
        o.set_shared_memory("io", 12, offset=32)
        result = client.infer("echo", [i], outputs=[o])
        output = result.get_output("OUTPUT0")
        assert list(output.shape) == [1, 3]
        assert output.parameters["shared_memory_byte_size"].int64_param == 12
        got = np.ndarray((1, 3), np.uint32, buffer=shm.buf, offset=32).copy()
        np.testing.assert_array_equal(got, values + 1)
        with pytest.raises(InferenceServerException) as e:
            client.register_system_shared_memory("io", "/" + shm.name, 64)
        assert_code(e.value, "ALREADY_EXISTS")
        client.unregister_system_shared_memory("io")
        assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
        with pytest.raises(InferenceServerException) as e:
            client.infer("echo", [i], outputs=[o])
        assert_code(e.value, "INVALID_ARGUMENT")
    finally:
        client.unregister_system_shared_memory()
        shm.close()
        shm.unlink()


# KServe's `grpc_predict_v2.proto` answers a repository load or unload with these
# fields, where Triton's answers are empty messages (#29): kiln sends both shapes.
_FDP = descriptor_pb2.FieldDescriptorProto
KSERVE_ANSWER_FIELDS = {
    ("inference.RepositoryModelLoadResponse", "model_name"): (1, _FDP.TYPE_STRING),
    ("inference.RepositoryModelLoadResponse", "isLoaded"): (2, _FDP.TYPE_BOOL),
    ("inference.RepositoryModelUnloadResponse", "model_name"): (1, _FDP.TYPE_STRING),
    ("inference.RepositoryModelUnloadResponse", "isUnloaded"): (2, _FDP.TYPE_BOOL),
}


def test_proto_matches_triton(descriptor_path):
    """Every message, field and RPC of kiln's inference.proto has the name, number,
    type and label of tritonclient's own definitions: they agree on the wire."""
    with open(descriptor_path, "rb") as f:
        ours = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.Default()
    fdp = descriptor_pb2.FieldDescriptorProto
    checked = 0

    def check_message(message, prefix):
        nonlocal checked
        full = f"{prefix}.{message.name}"
        theirs = pool.FindMessageTypeByName(full)
        for field in message.field:
            if (full, field.name) in KSERVE_ANSWER_FIELDS:
                # Only in KServe's answer: Triton's message is empty, so its
                # clients skip the field; check KServe's number and type.
                number, kind = KSERVE_ANSWER_FIELDS[(full, field.name)]
                assert (field.number, field.type) == (number, kind), f"{full}.{field.name}"
                assert len(theirs.fields) == 0, f"{full} has fields in Triton's proto"
                checked += 1
                continue
            assert field.name in theirs.fields_by_name, f"{full}.{field.name}"
            t = theirs.fields_by_name[field.name]
            assert field.number == t.number, f"{full}.{field.name}"
            assert field.type == t.type, f"{full}.{field.name}"
            repeated = field.label == fdp.LABEL_REPEATED
            assert repeated == t.is_repeated, f"{full}.{field.name}"
            if field.type == fdp.TYPE_MESSAGE:
                assert field.type_name == "." + t.message_type.full_name, f"{full}.{field.name}"
            if field.type == fdp.TYPE_ENUM:
                assert field.type_name == "." + t.enum_type.full_name, f"{full}.{field.name}"
            if field.HasField("oneof_index"):
                oneof = message.oneof_decl[field.oneof_index].name
                assert t.containing_oneof is not None and t.containing_oneof.name == oneof
            checked += 1
        for nested in message.nested_type:
            check_message(nested, full)
        for enum in message.enum_type:
            check_enum(enum, full)

    def check_enum(enum, prefix):
        theirs = pool.FindEnumTypeByName(f"{prefix}.{enum.name}")
        for value in enum.value:
            assert theirs.values_by_name[value.name].number == value.number, value.name

    # inference.proto and the model_config.proto it imports, as Triton's
    # grpc_service.proto does.
    for file in ours.file:
        assert file.package == "inference", file.name
        for message in file.message_type:
            check_message(message, "inference")
        for enum in file.enum_type:
            check_enum(enum, "inference")
    (service,) = [service for file in ours.file for service in file.service]
    theirs = pool.FindServiceByName("inference.GRPCInferenceService")
    for method in service.method:
        t = theirs.methods_by_name[method.name]
        assert method.input_type == "." + t.input_type.full_name, method.name
        assert method.output_type == "." + t.output_type.full_name, method.name
        assert method.client_streaming == t.client_streaming, method.name
        assert method.server_streaming == t.server_streaming, method.name
    assert checked > 100
