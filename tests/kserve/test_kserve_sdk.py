"""The KServe Python SDK (kserve 0.21) against kiln serving a Triton repository
(`ocr_cls/config.pbtxt` over the PP-OCR classifier) in explicit model control, as
tests/tests/kserve_sdk.rs starts it (KILN_GRPC_URL: HOST:PORT).

The SDK's `InferenceGRPCClient` has no model repository calls (it has infer, the
readiness checks and liveness); the SDK's own generated stub of the v2 protocol
(`kserve.protocol.grpc`) has them: KServe's `RepositoryModelLoadRequest` carries the
model name in field 1, where Triton's message carries the repository's name."""

import asyncio
import os

import grpc
import numpy as np
import pytest
from kserve import InferenceGRPCClient, InferInput, InferRequest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as stubs

MODEL = "ocr_cls"
OUTPUT = "save_infer_model/scale_0.tmp_1"


@pytest.fixture(scope="module")
def url():
    return os.environ["KILN_GRPC_URL"]


def image(rows):
    """`rows` images of the classifier's config dims [3, 48, 192] (values in [0, 1))."""
    values = np.arange(rows * 3 * 48 * 192, dtype=np.float32) % 251 / 251
    return values.reshape(rows, 3, 48, 192)


async def ready_and_infer(url, rows):
    client = InferenceGRPCClient(url)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        ready = await client.is_model_ready(MODEL)
        if not ready:
            return ready, None
        data = image(rows)
        tensor = InferInput("x", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        answer = await client.infer(InferRequest(MODEL, [tensor]))
        return ready, answer.get_output_by_name(OUTPUT).as_numpy()
    finally:
        await client.close()


def test_repository_calls_readiness_and_infer(url):
    with grpc.insecure_channel(url) as channel:
        stub = stubs.GRPCInferenceServiceStub(channel)
        # Not loaded yet (explicit model control, nothing named at start).
        assert asyncio.run(ready_and_infer(url, 1)) == (False, None)

        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL))
        ready, probs = asyncio.run(ready_and_infer(url, 2))
        assert ready
        # Two rows of the direction classifier's softmax: each sums to 1.
        assert probs.shape == (2, 2)
        np.testing.assert_allclose(probs.sum(axis=1), [1.0, 1.0], rtol=1e-5)

        # A name the repository does not hold: an error naming the model.
        with pytest.raises(grpc.RpcError) as error:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="nope"))
        assert "nope" in error.value.details()

        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=MODEL))
        assert asyncio.run(ready_and_infer(url, 1)) == (False, None)
