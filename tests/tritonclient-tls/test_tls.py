"""kiln over TLS, driven by NVIDIA's tritonclient with ssl=True (HTTP and gRPC).

tests/tests/tls.rs starts kiln with --tls-cert/--tls-key and runs this with pytest,
passing KILN_HTTP_URL and KILN_GRPC_URL (HOST:PORT) and KILN_TLS_CA, the CA that
signed the server's certificate. kiln serves `echo` (UINT32 + 1).
"""

import os

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def echo_input(module):
    data = np.array([[1, 2, 3]], dtype=np.uint32)
    tensor = module.InferInput("INPUT0", list(data.shape), "UINT32")
    tensor.set_data_from_numpy(data)
    return data, tensor


def test_http_ssl():
    client = httpclient.InferenceServerClient(
        os.environ["KILN_HTTP_URL"],
        ssl=True,
        ssl_options={"ca_certs": os.environ["KILN_TLS_CA"]},
    )
    try:
        assert client.is_server_live()
        data, tensor = echo_input(httpclient)
        result = client.infer("echo", [tensor])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data + 1)
    finally:
        client.close()


def test_grpc_ssl():
    client = grpcclient.InferenceServerClient(
        os.environ["KILN_GRPC_URL"],
        ssl=True,
        root_certificates=os.environ["KILN_TLS_CA"],
    )
    try:
        assert client.is_server_live()
        data, tensor = echo_input(grpcclient)
        result = client.infer("echo", [tensor])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data + 1)
    finally:
        client.close()
