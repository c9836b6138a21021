"""tritonclient against a kiln ensemble: tests/tests/ensembles.rs starts kiln with a
repository whose `chain` ensemble (IN -> echo -> echo -> OUT = IN + 2) is loaded,
and passes KILN_HTTP_URL and KILN_GRPC_URL."""

import os

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def test_http_config_and_infer():
    c = httpclient.InferenceServerClient(os.environ["KILN_HTTP_URL"])
    config = c.get_model_config("chain")
    assert config["platform"] == "ensemble"
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["echo", "echo"]
    assert steps[0]["input_map"] == {"INPUT0": "IN"}
    assert steps[1]["output_map"] == {"OUTPUT0": "OUT"}
    assert c.is_model_ready("chain")
    metadata = c.get_model_metadata("chain")
    assert metadata["platform"] == "ensemble"
    i = httpclient.InferInput("IN", [1, 3], "UINT32")
    i.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.uint32), binary_data=True)
    r = c.infer("chain", [i])
    assert r.as_numpy("OUT").tolist() == [[3, 4, 5]]


def test_grpc_config_and_infer():
    c = grpcclient.InferenceServerClient(os.environ["KILN_GRPC_URL"])
    config = c.get_model_config("chain", as_json=True)["config"]
    assert config["platform"] == "ensemble"
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["echo", "echo"]
    assert steps[1]["input_map"] == {"INPUT0": "mid"}
    assert int(steps[1]["model_version"]) == -1
    i = grpcclient.InferInput("IN", [2, 1], "UINT32")
    i.set_data_from_numpy(np.array([[10], [20]], dtype=np.uint32))
    r = c.infer("chain", [i])
    assert r.as_numpy("OUT").tolist() == [[12], [22]]
    stats = c.get_inference_statistics("chain", as_json=True)
    assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) >= 1
    c.close()
