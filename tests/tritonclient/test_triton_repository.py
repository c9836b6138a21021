"""A Triton repository folder (`pipe`: tests/fixtures/triton/pipe.config.pbtxt, an
ensemble over `echo`) served by kiln, read through tritonclient over both protocols
and compared with what Triton 2.51 answered for the same file (recorded in
tests/fixtures/triton: its README says how)."""

import json

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2

FIXTURES = "tests/fixtures/triton"


def test_config_metadata_and_answers_are_tritons(http_url, grpc_url):
    grpc = grpcclient.InferenceServerClient(grpc_url)
    http = httpclient.InferenceServerClient(http_url)
    grpc.load_model("pipe")

    # gRPC ModelConfig: Triton's whole message, equal to Triton's answer.
    recorded = service_pb2.ModelConfigResponse()
    with open(f"{FIXTURES}/pipe.config.grpc.pb", "rb") as f:
        recorded.ParseFromString(f.read())
    assert grpc.get_model_config("pipe") == recorded

    # HTTP /config: Triton's JSON, but the field 2.51's model_config.proto lacks.
    with open(f"{FIXTURES}/pipe.config.json") as f:
        triton = json.load(f)
    config = http.get_model_config("pipe")
    assert config["ensemble_scheduling"].pop("max_inflight_requests", 0) == 0
    assert config == triton

    # Metadata as Triton gives an ensemble's, over both protocols.
    meta = http.get_model_metadata("pipe")
    assert meta["platform"] == "ensemble"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("IN", "UINT32", [-1, -1])
    ]
    grpc_meta = grpc.get_model_metadata("pipe")
    assert [(t.name, t.datatype, list(t.shape)) for t in grpc_meta.outputs] == [
        ("OUT", "UINT32", [-1, -1])
    ]

    # Answers: echo's contract (OUTPUT0 = INPUT0 + 1) through the ensemble.
    array = np.arange(16, dtype=np.uint32).reshape(1, 16)
    g = grpcclient.InferInput("IN", list(array.shape), "UINT32")
    g.set_data_from_numpy(array)
    h = httpclient.InferInput("IN", list(array.shape), "UINT32")
    h.set_data_from_numpy(array)
    for result in (grpc.infer("pipe", [g]), http.infer("pipe", [h])):
        np.testing.assert_array_equal(result.as_numpy("OUT"), array + 1)
    grpc.close()
