"""Triton's restricted APIs as tritonclient uses them: the operator's header passed
with `headers=`. tests/tests/restricted_api.rs starts kiln with
`--http-restricted-api` and `--grpc-restricted-protocol` restricting
`model-repository` to `admin-key: admin-value` (gRPC:
`triton-grpc-protocol-admin-key`) and runs this file with
KILN_RESTRICTED=1; the unrestricted run of the other files skips it."""

import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.skipif(
    not os.environ.get("KILN_RESTRICTED"), reason="needs kiln started with restrictions"
)

HTTP_ADMIN = {"admin-key": "admin-value"}
GRPC_ADMIN = {"triton-grpc-protocol-admin-key": "admin-value"}


def echo(client_module, client):
    i = client_module.InferInput("INPUT0", [1, 2], "UINT32")
    i.set_data_from_numpy(np.array([[1, 2]], dtype=np.uint32))
    return client.infer("echo-repo", [i]).as_numpy("OUTPUT0")


def test_http_load_needs_the_header(http_url):
    client = httpclient.InferenceServerClient(http_url)
    for headers in [None, {"admin-key": "wrong"}]:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("echo-repo", headers=headers)
        assert e.value.status() == "403", (e.value.status(), e.value.message())
        assert e.value.message() == "This API is restricted, expecting header 'admin-key'"
    assert not client.is_model_ready("echo-repo")
    client.load_model("echo-repo", headers=HTTP_ADMIN)
    # Inference is not restricted.
    np.testing.assert_array_equal(echo(httpclient, client), [[2, 3]])
    assert [m["name"] for m in client.get_model_repository_index(headers=HTTP_ADMIN)] == [
        "echo-repo"
    ]
    client.unload_model("echo-repo", headers=HTTP_ADMIN)
    client.close()


def test_grpc_load_needs_the_header(grpc_url):
    client = grpcclient.InferenceServerClient(grpc_url)
    for headers in [None, {"triton-grpc-protocol-admin-key": "wrong"}]:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("echo-repo", headers=headers)
        assert e.value.status() == "StatusCode.UNAVAILABLE", e.value.status()
        assert (
            "This protocol is restricted, expecting header "
            "'triton-grpc-protocol-admin-key'" in e.value.message()
        )
    assert not client.is_model_ready("echo-repo")
    client.load_model("echo-repo", headers=GRPC_ADMIN)
    np.testing.assert_array_equal(echo(grpcclient, client), [[2, 3]])
    client.unload_model("echo-repo", headers=GRPC_ADMIN)
    client.close()
